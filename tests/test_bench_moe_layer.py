"""``benchmarks/moe_layer.py --quick`` on the CPU: the command line (a bad value is a usage error
naming the flag), the records and the summary it writes to its ``--out`` folder, the saved-bytes
count, and that every peer computes what the eager torch layer computes (the compiled peers
with ``aot_eager``, the eager kernels: quick to compile)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from bench_helpers import usage_error

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import moe_layer as bench  # noqa: E402


@pytest.mark.parametrize("argv, words", [
    (["--shapes", "E8_bad"], ["--shapes", "'E8_bad'", "quick", "E8_T16384_H4096_FF14336_K2"]),
    (["--peers", "te_ops,nope"], ["--peers", "'nope'", "torch_layer_compiled"]),
    (["--rounds", "0"], ["--rounds must be >= 1, got 0"]),
    (["--iters", "0"], ["--iters must be >= 1, got 0"]),
    (["--warmup", "-1"], ["--warmup must be >= 0, got -1"]),
    (["--compile-backend", "nope"], ["--compile-backend", "'nope'", "aot_eager"]),
    (["--summarize", "/no/such/file.jsonl"], ["--summarize", "'/no/such/file.jsonl'"]),
])
def test_bad_arguments_are_usage_errors_naming_the_flag(capsys, argv, words):
    err = usage_error(capsys, bench.main, ["--device", "cpu", *argv])
    for word in words:
        assert word in err


def test_quick_and_default_shapes():
    args, shapes = bench.parse_args(["--device", "cpu", "--quick", "--iters", "4"])
    assert shapes == bench.QUICK_SHAPES and (args.rounds, args.iters, args.warmup) == (1, 4, 1)
    args, shapes = bench.parse_args(["--device", "cpu"])
    assert shapes == bench.SHAPES and (args.rounds, args.iters, args.warmup) == (3, 10, 3)
    for name, (e, rows, h, ff, k) in bench.SHAPES.items():
        assert name == f"E{e}_T{rows}_H{h}_FF{ff}_K{k}" and rows // k == 8192


def test_saved_bytes_counts_each_storage_once_without_parameters_or_input():
    class Doubled(bench.Peer):
        def __init__(self, problem):
            super().__init__(problem)
            self.w = torch.nn.Parameter(torch.ones(problem.hidden))

        def parameters(self):
            return [self.w]

        def forward(self, x):
            h = x * 2  # a product with a number saves nothing
            y = h * h  # saves h twice: one storage
            return y * self.w, (h * x).sum()  # y, the parameter w; h again and the input x

    problem = bench.make_problem("q", bench.QUICK_SHAPES["E4_T64_H32_FF32_K2"],
                                 torch.device("cpu"), torch.float32, 0)
    assert bench.saved_bytes(Doubled(problem), problem) == 2 * problem.x.numel() * 4  # h, y


def test_quick_run_writes_records_and_a_summary(tmp_path):
    argv = ["--quick", "--device", "cpu", "--compile-backend", "aot_eager", "--out",
            str(tmp_path)]
    assert bench.main(argv) == 0
    with open(tmp_path / "moe_layer.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert records[0]["bench"] == "moe_layer_run" and records[0]["rounds"] == 1
    skipped = {r["peer"]: r["skipped"] for r in records if "skipped" in r}
    assert skipped == {"te_ops_graph": "CUDA graphs need a CUDA device (running with --device "
                                       "cpu)"}
    rows = {r["peer"]: r for r in records if "ms_median" in r}
    assert list(rows) == ["torch_layer", "torch_layer_compiled", "te_ops", "te_ops_compiled"]
    for r in rows.values():
        assert r["ms_median"] > 0 and r["tflops"] > 0 and r["saved_mib"] > 0, r
        assert r["ratio_vs_eager"] > 0 and r["ratio_vs_compiled"] > 0
        assert r["max_abs_diff"] < 0.1 and r["aux_abs_diff"] < 1e-5, r  # bf16 rounding
        assert r["tokens"] == 32 and r["top_k"] == 2 and r["peak_mib"] is None
    assert rows["torch_layer_compiled"]["max_abs_diff"] == 0  # aot_eager: the same kernels
    assert rows["te_ops_compiled"]["max_abs_diff"] == rows["te_ops"]["max_abs_diff"]
    summary = (tmp_path / "summary.txt").read_text()
    assert summary == bench.summarize(str(tmp_path / "moe_layer.jsonl")) + "\n"
    assert summary.splitlines()[0].split() == ["shape", "peer", "rounds", "ms", "TFLOP/s",
                                               "peak", "MiB", "saved", "MiB", "x", "eager",
                                               "x", "compiled"]
    assert "te_ops_graph" in summary.splitlines()[-1]
