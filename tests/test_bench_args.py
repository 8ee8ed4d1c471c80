"""Command lines of the benchmarks added for stop 10 (``profile_gaps.py``,
``gemm_call_patterns.py``, ``host_ab.py``): a bad argument is a usage error (exit 2) that
names the flag, what was expected and what was given, before any work starts, not a
traceback from deep inside the run."""

from __future__ import annotations

import os
import sys

import pytest
from bench_helpers import usage_error

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import gemm_call_patterns  # noqa: E402
import host_ab  # noqa: E402
import profile_gaps  # noqa: E402


@pytest.mark.parametrize("argv, words", [
    (["--shapes", "E8_bad"], ["--shapes", "'E8_bad'", "E8_T16384_H4096_FF14336"]),
    (["--peers", "torch_grouped_mm,nope"], ["--peers", "'nope'", "te_ops_fused"]),
    (["--summarize", "/no/such/file.jsonl"], ["--summarize", "/no/such/file.jsonl"]),
    (["--top", "0"], ["--top", ">= 1", "got 0"]),
    (["--depth", "0"], ["--depth", ">= 1", "got 0"]),
    (["--min-gap-us", "-1"], ["--min-gap-us", ">= 0", "got -1.0"]),
    (["--steps", "0"], ["--steps", "got 0"]),
])
def test_profile_gaps_bad_arguments(capsys, argv, words):
    err = usage_error(capsys, profile_gaps.main, argv)
    for word in words:
        assert word in err


@pytest.mark.parametrize("argv, words", [
    (["--shapes", "E8_bad"], ["--shapes", "'E8_bad'", "E4_T256_H64_FF64"]),
    (["--parts", "step,foo"], ["--parts", "'foo'", "dense"]),
    (["--reps", "0"], ["--reps", ">= 1", "got 0"]),
    (["--step-reps", "0"], ["--step-reps", ">= 1", "got 0"]),
    (["--warmup", "-1"], ["--warmup", ">= 0", "got -1"]),
    (["--device", "cpux"], ["--device", "'cpux'"]),
    (["--summarize", "/no/such/file.jsonl"], ["--summarize", "/no/such/file.jsonl"]),
])
def test_gemm_call_patterns_bad_arguments(capsys, argv, words):
    err = usage_error(capsys, gemm_call_patterns.main, ["--quick", *argv])
    for word in words:
        assert word in err


@pytest.mark.parametrize("argv, words", [
    (["--shapes", "E64_bad"], ["--shapes", "'E64_bad'", "E64_T256_H2048_FF768"]),
    (["--modes", "single,foo"], ["--modes", "'foo'", "per_expert"]),
    (["--dtype", "float33"], ["--dtype", "'float33'", "bfloat16"]),
    (["--iters", "0"], ["--iters", ">= 1", "got 0"]),
    (["--rounds", "0"], ["--rounds", ">= 1", "got 0"]),
    (["--device", "cpux"], ["--device", "'cpux'"]),
    (["--make-baseline", "/no/such/te_ops", "/tmp/unused"],
     ["--make-baseline SRC", "'/no/such/te_ops'"]),
])
def test_host_ab_bad_arguments(capsys, argv, words):
    base = [] if argv[0] in ("--device", "--make-baseline") else ["--device", "cpu"]
    err = usage_error(capsys, host_ab.main, [*base, *argv])
    for word in words:
        assert word in err


@pytest.mark.parametrize("argv, words", [
    (["--shapes", "E8_bad"], ["--shapes", "'E8_bad'", "E32_T32768_H7168_FF2048"]),
    (["--parts", "steps,foo"], ["--parts", "'foo'", "kernels"]),
    (["--sets", "main,nope"], ["--sets", "'nope'", "fp8t"]),
    (["--profile-set", "nope"], ["--profile-set", "'nope'"]),
    (["--iters", "0"], ["--iters", ">= 1", "got 0"]),
    (["--rounds", "0"], ["--rounds", ">= 1", "got 0"]),
    (["--device", "cpux"], ["--device", "'cpux'"]),
])
def test_fp8t_ab_bad_arguments(monkeypatch, capsys, argv, words):
    from te_ops.quantization import fp8_triton

    # fp8t_ab.py reads the Triton kernels' settings at import; without triton (CPU installs)
    # a stand-in lets the command line be checked (nothing runs: the errors come first).
    monkeypatch.setattr(fp8_triton, "ROWS_COLAMAX_SETTINGS",
                        getattr(fp8_triton, "ROWS_COLAMAX_SETTINGS", ()), raising=False)
    import fp8t_ab

    base = [] if argv[0] == "--device" else ["--device", "cpu"]
    err = usage_error(capsys, fp8t_ab.main, [*base, *argv])
    for word in words:
        assert word in err
