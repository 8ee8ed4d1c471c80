"""``benchmarks/large_gemm_triton.py`` on the CPU: argument errors (exit 2 naming the flag),
the no-CUDA error, and one comparison record built end to end with the GPU calls replaced by
torch references on tiny shapes (the record's fields, ratios and checks), then ``--summarize``
of the file written. The timings themselves need the H200."""

from __future__ import annotations

import argparse
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from bench_helpers import usage_error
from block_replay import summarize_record

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import large_gemm_triton as bench  # noqa: E402

from te_ops.gemm import grouped_gemm_large_triton as lg  # noqa: E402
from te_ops.gemm import grouped_wgrad_large_triton as lw  # noqa: E402
from te_ops.kernels import swiglu_triton as st  # noqa: E402


@pytest.mark.parametrize("argv, words", [
    (["--shapes", "E8_bad"], ["--shapes", "'E8_bad'", "E128_T65536_H2048_FF768"]),
    (["--gemms", "fc1,dgrad"], ["--gemms", "'dgrad'", "fc2"]),
    (["--reps", "19"], ["--reps", ">= 20", "got 19"]),
    (["--sweep-reps", "1"], ["--sweep-reps", ">= 5"]),
    (["--warmup", "-1"], ["--warmup", ">= 0"]),
    (["--summarize", "/no/such/file.jsonl"], ["--summarize", "/no/such/file.jsonl"]),
    (["--variants", "{bad"], ["--variants must be a JSON object", "'{bad'"]),
    (["--variants", '{"flat": 1}'], ["--variants must be a JSON object of objects"]),
    (["--config-override", "[1]"], ["--config-override must be a JSON object", "'[1]'"]),
])
def test_bad_arguments(capsys, argv, words):
    err = usage_error(capsys, bench.main, argv)
    for word in words:
        assert word in err


def test_measuring_without_cuda_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "measuring needs CUDA" in usage_error(capsys, bench.main, [])


def test_sweep_configs_are_launch_configs():
    keys = set(lg.large_config("fprop"))
    assert bench.SWEEP and all(set(cfg) == keys for cfg in bench.SWEEP)
    assert len({json.dumps(c, sort_keys=True) for c in bench.SWEEP}) == len(bench.SWEEP)
    keys = set(lw.large_wgrad_config())
    assert 0 < len(bench.WGRAD_SWEEP) <= 12 and all(set(c) == keys for c in bench.WGRAD_SWEEP)
    assert lw.large_wgrad_config() in bench.WGRAD_SWEEP
    assert len({json.dumps(c, sort_keys=True) for c in bench.WGRAD_SWEEP}) == len(
        bench.WGRAD_SWEEP)
    for c in bench.WGRAD_SWEEP:  # the stages and the TMA-store tile fit SM90's 227 KiB
        epilogue = c["BLOCK_N"] * c["BLOCK_K"] * 2 // c["SUBTILE"] if c["TMA_STORE"] else 0
        stages = c["num_stages"] * c["BLOCK_M"] * (c["BLOCK_N"] + c["BLOCK_K"]) * 2
        assert stages + epilogue <= 227 * 1024, c


def _ref_fprop(x, w, offs, cfg=None):
    out, start = torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype), 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = F.linear(x[start:end], w[g])
        start = end
    return out


def _ref_dgrad(dy, w, offs, cfg=None):
    return _ref_fprop(dy, w.transpose(1, 2), offs)


def _ref_wgrad(x, dy, offs, cfg=None):
    out, start = torch.zeros(offs.shape[0], dy.shape[1], x.shape[1], dtype=x.dtype), 0
    for g, end in enumerate(offs.tolist()):
        out[g] = dy[start:end].t() @ x[start:end]
        start = end
    return out


def _grouped_mm_wgrad(a, b, offs):
    assert a.shape[0] < a.shape[1]  # dy.t(): (n, T)
    return _ref_wgrad(b, a.t(), offs)


def _ref_swiglu(h, probs):
    f = h.shape[1] // 2
    a = F.silu(h[:, :f].float()) * h[:, f:].float()
    return (a * probs[:, None]).to(h.dtype)


def _cpu_bench(monkeypatch) -> None:
    """The benchmark on the CPU with one tiny shape: the kernels, ``torch._grouped_mm`` and
    the timing replaced by references and fixed times (call i of a round takes 1 + i ms)."""
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "SHAPES", {"E2_T64_H32_FF16": (2, 64, 32, 16)})
    monkeypatch.setattr(bench, "ALL_SHAPES", bench.SHAPES)
    monkeypatch.setattr(lg, "large_fprop", _ref_fprop)
    monkeypatch.setattr(lg, "large_dgrad", _ref_dgrad)
    monkeypatch.setattr(lg, "large_fc1_swiglu",
                        lambda x, w, o, p, c=None: (h := _ref_fprop(x, w, o), _ref_swiglu(h, p)))
    monkeypatch.setattr(st, "swiglu_forward", _ref_swiglu)
    monkeypatch.setattr(lw, "large_wgrad", _ref_wgrad)
    monkeypatch.setattr(torch, "_grouped_mm", lambda a, b, offs: (
        _grouped_mm_wgrad(a, b, offs) if b.dim() == 2 else _ref_fprop(a, b.transpose(1, 2),
                                                                      offs)))
    monkeypatch.setattr(bench, "_time_interleaved",
                        lambda calls, reps, warmup: {n: [1.0 + i] * reps
                                                     for i, n in enumerate(calls)})


def test_compare_record_and_summary(monkeypatch, tmp_path, capsys):
    _cpu_bench(monkeypatch)
    args = argparse.Namespace(seed=0, reps=20, warmup=0)
    path = tmp_path / "r.jsonl"
    out = bench.JsonLines(str(path))
    for gemm in bench.GEMMS:
        out.write(bench.compare("E2_T64_H32_FF16", gemm, args))
    out.close()
    capsys.readouterr()  # the records JsonLines echoed
    fc1, fc2, fc1_dgrad, fc2_dgrad, fc1_wgrad, fc2_wgrad = bench.read_records(str(path),
                                                                              bench.BENCH)
    assert fc1_dgrad["max_abs_diff"] < 0.1 and fc2_dgrad["max_abs_diff"] < 0.1
    assert fc1_dgrad["triton_x"] == 0.5 and "fused_ms" not in fc2_dgrad
    assert fc1["max_abs_diff"] < 0.1 and fc1["a_equal"] is True
    assert fc1["grouped_mm_ms"] == 1.0 and fc1["triton_ms"] == 2.0 and fc1["triton_x"] == 0.5
    assert fc1["fused_x"] == 3.0 / 5.0 and fc1["triton_swiglu_x"] == 3.0 / 4.0
    assert sum(fc1["split_sizes"]) == 64 and fc1["config"]["BLOCK_N"] == 256
    assert fc1["fused_config"]["BLOCK_N"] == 256 and fc1["fused_config"]["PAIRED"] is True
    assert fc1["fused_vs_triton_swiglu"] == 4.0 / 5.0 and fc1["fused_h_equal_triton"] is True
    assert "fused_ms" not in fc2
    for rec in (fc1_wgrad, fc2_wgrad):
        assert rec["bitwise_equal"] is True and rec["max_abs_diff"] == 0.0
        assert rec["config"]["BLOCK_K"] == 256 and rec["triton_x"] == 0.5
        assert "fused_ms" not in rec
    for gemm, n, k in (("fc1_wgrad", 32, 32), ("fc2_wgrad", 32, 16)):  # dW (E, 2FF, H), (E, H, FF)
        ops = bench._operands((2, 64, 32, 16), gemm, 0)
        assert ops["x"].shape == (64, k) and ops["dy"].shape == (64, n)
        assert ops["flop"] == 2.0 * 64 * n * k
    assert bench.main(["--summarize", str(path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 8 and "0.60" in table[1]
    assert "fused vs triton fprop + SwiGLU (4.000 ms): 0.800x, h bits True" in table[2]
    assert table[6].split()[:2] == ["E2_T64_H32_FF16", "fc1_wgrad"]
    assert table[4].split()[:2] == ["E2_T64_H32_FF16", "fc1_dgrad"]
    assert table[1].split()[:2] == ["E2_T64_H32_FF16", "fc1"]


def test_variants_are_timed_checked_and_summarized(monkeypatch, tmp_path, capsys):
    """``--variants``: each config is one more interleaved call with its own time, ratios
    and bitwise check, passed to the kernel on top of the default; wgrad GEMMs take none."""
    _cpu_bench(monkeypatch)
    seen = []
    monkeypatch.setattr(lg, "large_fprop", lambda x, w, o, c=None: (seen.append(c),
                                                                    _ref_fprop(x, w, o))[1])
    args = argparse.Namespace(seed=0, reps=20, warmup=0,
                              variants={"walk": {"FLAT": False}, "tail": {"TAIL": True}})
    rec = bench.compare("E2_T64_H32_FF16", "fc2", args, cfg={"GROUP_M": 4})
    assert rec["triton_walk_ms"] == 3.0 and rec["triton_tail_ms"] == 4.0
    assert rec["triton_walk_x"] == 1.0 / 3.0 and rec["triton_tail_vs_triton"] == 2.0 / 4.0
    assert rec["bitwise_equal_walk"] is True and rec["bitwise_equal_tail"] is True
    assert rec["variants"]["walk"]["FLAT"] is False and rec["variants"]["tail"]["GROUP_M"] == 4
    assert {"GROUP_M": 4, "FLAT": False} in seen and {"GROUP_M": 4, "TAIL": True} in seen
    assert "variants" not in bench.compare("E2_T64_H32_FF16", "fc2_wgrad", args)
    table = summarize_record(bench, rec, tmp_path / "v.jsonl", capsys).splitlines()
    assert table[2].split()[:2] == ["variant", "walk"] and "bits True" in table[2]


def test_for_nesting_counts_loops_inside_loops():
    ttgir = "scf.for %a {\n  scf.if %c {\n    scf.for %b {\n    }\n  }\n}\nscf.for %d {\n}"
    assert bench.for_nesting(ttgir) == 2
    assert bench.for_nesting("scf.for %a {\n}\nscf.for %b {\n}") == 1
    assert bench.for_nesting("tt.func {\n}") == 0


def test_fused_variants_are_timed_and_summarized(monkeypatch, tmp_path, capsys):
    """``--fused-variants``: each fc1 + SwiGLU config is one more interleaved call (its time
    and ratio to the Triton fprop + SwiGLU pass), on top of ``--fused-config``; a bad one is
    a usage error before GPU work."""
    _cpu_bench(monkeypatch)
    seen = []
    monkeypatch.setattr(lg, "large_fc1_swiglu", lambda x, w, o, p, c=None: (
        seen.append(c), (h := _ref_fprop(x, w, o), _ref_swiglu(h, p)))[1])
    args = argparse.Namespace(seed=0, reps=20, warmup=0,
                              fused_variants={"old": {"PAIRED": False, "BLOCK_N": 128}})
    rec = bench.compare("E2_T64_H32_FF16", "fc1", args, None, {"FLAT": False})
    ops = bench._operands((2, 64, 32, 16), "fc1", 0)
    bench._calls(ops, "fc1", None, {"FLAT": False}, None, args.fused_variants)["fused_old"]()
    assert seen[-1] == {"FLAT": False, "PAIRED": False, "BLOCK_N": 128}
    assert rec["fused_old_ms"] == 6.0 and rec["fused_old_vs_triton_swiglu"] == 4.0 / 6.0
    assert rec["fused_old_config"]["PAIRED"] is False
    table = summarize_record(bench, rec, tmp_path / "r.jsonl", capsys)
    assert "fused variant old: 6.000 ms, 0.667x" in table
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # never reached
    with pytest.raises(SystemExit):
        bench.main(["--fused-variants", '{"x": {"PAIRED": true, "BLOCK_N": 7}}'])
    assert "PAIRED=True needs an even BLOCK_N" in capsys.readouterr().err
