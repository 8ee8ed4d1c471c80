"""``benchmarks/grouped_mlp.py`` on the CPU at tiny shapes: the command line (a bad value is a
usage error naming the flag), the records and the summary it writes to its ``--out`` folder,
the ratios to the eager and the compiled torch peer, and that every te_ops peer computes what
the eager ``torch._grouped_mm`` peer computes."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from bench_helpers import usage_error

import te_ops

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import grouped_mlp as bench  # noqa: E402

TINY = ["--device", "cpu", "--shapes", "E4_T256_H64_FF64", "--iters", "2", "--warmup", "1"]


def _records(folder) -> list[dict]:
    with open(os.path.join(folder, "grouped_mlp.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("argv, words", [
    (["--shapes", "E8_bad"], ["--shapes", "'E8_bad'", "tiny", "E8_T16384_H4096_FF14336"]),
    (["--peers", "torch_grouped_mm,nope"], ["--peers", "'nope'", "torch_grouped_mm_compiled"]),
    (["--recipe", "fp9"], ["--recipe", "'fp9'", "mxfp8"]),
    (["--rounds", "0"], ["--rounds must be >= 1, got 0"]),
    (["--iters", "0"], ["--iters must be >= 1, got 0"]),
    (["--warmup", "-1"], ["--warmup must be >= 0, got -1"]),
    (["--interleaved", "--recipe", "fp8"], ["--interleaved", "--recipe fp8"]),
    (["--summarize", "/no/such/file.jsonl"], ["--summarize", "'/no/such/file.jsonl'"]),
    (["--device", "tpu"], ["--device", "'tpu'"]),
    (["--align", "0"], ["--align must be >= 1, got 0"]),
])
def test_bad_arguments_are_usage_errors_naming_the_flag(capsys, argv, words):
    err = usage_error(capsys, bench.main, ["--device", "cpu", *argv] if argv[0] != "--device"
                      else argv)
    for word in words:
        assert word in err


def test_shape_sets_expand_and_cpu_is_the_cpu_default():
    args, shapes = bench.parse_args(["--device", "cpu", "--shapes", "tiny"])
    assert shapes == bench.TINY_SHAPES
    args, shapes = bench.parse_args(["--device", "cpu"])
    assert shapes == bench.CPU_SHAPES and args.dtype == "float32"
    assert args.peers == ["torch_grouped_mm", "torch_grouped_mm_compiled", "te_ops"]
    _, shapes = bench.parse_args(["--device", "cpu", "--shapes", "E64_T256_H2048_FF768,tiny"])
    assert list(shapes) == ["E64_T256_H2048_FF768", *bench.TINY_SHAPES]


def test_cpu_run_writes_records_and_a_summary_of_round_medians(tmp_path, capsys):
    peers = "te_ops,torch_grouped_mm,te_ops_packed,te_ops_per_expert,te_ops_unfused,te_ops_graph"
    assert bench.main([*TINY, "--rounds", "3", "--peers", peers, "--out", str(tmp_path)]) == 0
    records = _records(tmp_path)
    run = records[0]
    assert run["bench"] == "grouped_mlp_run" and run["torch"] and run["rounds"] == 3
    rows = [r for r in records[1:] if "ms_median" in r]
    skipped = [r for r in records[1:] if "skipped" in r]
    assert [r["peer"] for r in skipped] == ["te_ops_graph"]
    # the eager peer is measured first in every round, whatever --peers' order
    assert [r["peer"] for r in rows[:5]] == ["torch_grouped_mm", "te_ops", "te_ops_packed",
                                             "te_ops_per_expert", "te_ops_unfused"]
    assert sorted({r["round"] for r in rows}) == [0, 1, 2] and len(rows) == 15
    for r in rows:
        assert r["ms_median"] > 0 and r["ratio_vs_eager"] > 0 and "ratio_vs_compiled" not in r
        assert r["max_abs_diff"] < 1e-4, r  # every te_ops layout computes the eager peer's math
        assert r["shape"] == "E4_T256_H64_FF64" and r["dtype"] == "fp32"
    summary = (tmp_path / "summary.txt").read_text()
    assert summary == bench.summarize(str(tmp_path / "grouped_mlp.jsonl")) + "\n"
    lines = summary.splitlines()
    assert lines[0].split() == ["shape", "peer", "rounds", "ms", "TFLOP/s", "peak", "MiB",
                                "x", "eager", "x", "compiled", "x", "bf16"]
    te = next(line.split() for line in lines if line.split()[1:2] == ["te_ops"])
    assert te[2] == "3"  # medians over the three rounds
    assert any("te_ops_graph" in line and "CUDA graphs need a CUDA device" in line
               for line in lines)
    assert summary in capsys.readouterr().out


def test_a_second_run_replaces_the_first_runs_file(tmp_path):
    for _ in range(2):
        assert bench.main([*TINY, "--rounds", "1", "--peers", "torch_grouped_mm",
                           "--out", str(tmp_path)]) == 0
    assert [r["bench"] for r in _records(tmp_path)] == ["grouped_mlp_run", "grouped_mlp"]


def test_compiled_peer_is_skipped_with_its_reason_in_fp32_on_cpu(tmp_path):
    assert bench.main([*TINY, "--rounds", "1", "--out", str(tmp_path)]) == 0
    by_peer = {r["peer"]: r for r in _records(tmp_path)[1:]}
    assert "bfloat16 only on CPU" in by_peer["torch_grouped_mm_compiled"]["skipped"]
    assert by_peer["te_ops"]["ratio_vs_eager"] > 0


def test_ratios_are_against_the_same_rounds_eager_and_compiled_peers():
    records = [{"peer": "torch_grouped_mm", "ms_median": 4.0},
               {"peer": "torch_grouped_mm_compiled", "ms_median": 2.0},
               {"peer": "te_ops", "ms_median": 1.0},
               {"peer": "te_ops+fp8", "ms_median": 0.5},
               {"peer": "te_ops_graph", "skipped": "no CUDA"}]
    bench.add_ratios(records)
    assert records[2]["ratio_vs_eager"] == 4.0 and records[2]["ratio_vs_compiled"] == 2.0
    assert records[3]["ratio_vs_bf16"] == 2.0 and records[3]["ratio_vs_eager"] == 8.0
    assert "ratio_vs_bf16" not in records[2] and "ratio_vs_eager" not in records[4]


def test_align_rounds_each_experts_tokens_up_and_records_the_rows(tmp_path):
    shape = (4, 250, 64, 64)
    plain = bench.make_problem("s", shape, torch.device("cpu"), torch.float32, 0)
    aligned = bench.make_problem("s", shape, torch.device("cpu"), torch.float32, 0, align=16)
    assert sum(plain.sizes) == plain.tokens == 250 and plain.x.shape == (250, 64)
    assert aligned.sizes == [-(-s // 16) * 16 for s in plain.sizes]
    assert aligned.tokens == sum(aligned.sizes) == aligned.x.shape[0] > 250
    assert aligned.offsets.tolist() == torch.tensor(aligned.sizes).cumsum(0).tolist()
    assert bench.main([*TINY, "--rounds", "1", "--peers", "torch_grouped_mm,te_ops",
                       "--align", "16", "--out", str(tmp_path)]) == 0
    rows = [r for r in _records(tmp_path)[1:]]
    assert {r["align"] for r in rows} == {16} and all(r["rows"] % 16 == 0 for r in rows)
    assert all(r["max_abs_diff"] < 1e-4 for r in rows if r["peer"] == "te_ops")


def test_torchao_peer_is_skipped_with_its_reason(tmp_path, monkeypatch):
    """Without torchao the peer is skipped and says so; with it (faked here) each other
    condition gives its own reason (CUDA, bf16, multiples of 16)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else real(name, *a))
    assert bench.main([*TINY, "--rounds", "1", "--peers", "torch_grouped_mm,torchao_fp8",
                       "--out", str(tmp_path)]) == 0
    by_peer = {r["peer"]: r for r in _records(tmp_path)[1:]}
    assert "torchao is not installed" in by_peer["torchao_fp8"]["skipped"]
    assert by_peer["torch_grouped_mm"]["ms_median"] > 0
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "torchao" else real(name, *a))
    problem = bench.make_problem("s", (4, 64, 32, 32), torch.device("cpu"), torch.bfloat16, 0)
    assert "needs CUDA" in bench.torchao_skip_reason(problem)
    problem.device = torch.device("cuda")
    problem.dtype = torch.float32
    assert "takes bfloat16" in bench.torchao_skip_reason(problem)
    problem.dtype = torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert "SM89" in bench.torchao_skip_reason(problem)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    problem.sizes = [16, 5, 43, 0]
    assert "--align 16" in bench.torchao_skip_reason(problem)
    problem.sizes = [16, 0, 48, 0]
    assert bench.torchao_skip_reason(problem) is None


def test_te_ops_peer_builds_the_library_default_layout():
    """``te_ops`` passes no layout flag: it measures what a user gets from the README."""
    args, shapes = bench.parse_args([*TINY])
    problem = bench.make_problem("E4_T256_H64_FF64", shapes["E4_T256_H64_FF64"],
                                 torch.device("cpu"), torch.float32, 0)
    default = bench.PEER_CLASSES["te_ops"](problem).block[0]
    assert default.single_grouped_weight == te_ops.GroupedLinear(2, 3, 4).single_grouped_weight
    packed = bench.PEER_CLASSES["te_ops_packed"](problem).block[0]
    per_expert = bench.PEER_CLASSES["te_ops_per_expert"](problem).block[0]
    assert packed.single_grouped_weight and not per_expert.single_grouped_weight


def test_compiled_peer_runs_fullgraph_in_bf16_on_cpu(tmp_path):
    """The compiled peer is the eager peer's function through ``torch.compile(fullgraph=True)``:
    same output bits on the same inputs (bf16, where torch._grouped_mm's CPU fake kernel runs)."""
    assert bench.main(["--device", "cpu", "--dtype", "bfloat16", "--shapes", "E4_T256_H64_FF64",
                       "--iters", "1", "--warmup", "2", "--rounds", "1", "--peers",
                       "torch_grouped_mm,torch_grouped_mm_compiled", "--out", str(tmp_path)]) == 0
    rows = {r["peer"]: r for r in _records(tmp_path)[1:]}
    compiled = rows["torch_grouped_mm_compiled"]
    assert "error" not in compiled and compiled["ratio_vs_compiled"] == 1.0
    assert compiled["max_abs_diff"] < 0.1  # inductor may fuse the SwiGLU in another order
    assert rows["torch_grouped_mm"]["ratio_vs_compiled"] > 0
