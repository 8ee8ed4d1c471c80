"""benchmarks/profile_gaps.py's trace analysis on hand-built Kineto events (CPU only)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from kineto import x_event as _x  # noqa: E402
from profile_gaps import analyze_trace  # noqa: E402


def _trace():
    return [
        _x("cpu_op", "outer", 100.0, 60.0),
        _x("cpu_op", "inner", 125.0, 10.0),
        {**_x("cpu_op", "other_thread", 120.0, 20.0), "tid": 2},
        _x("cuda_runtime", "cudaLaunchKernel", -10.0, 2.0, 1),
        {**_x("cuda_runtime", "cudaLaunchKernel", 130.0, 3.0, 2), "tid": 1},
        _x("cuda_driver", "cuLaunchKernelEx", 140.0, 4.0, 3),
        _x("cuda_runtime", "cudaStreamSynchronize", 300.0, 40.0),
        _x("kernel", "gemm_a", 0.0, 100.0, 1),
        _x("kernel", "swiglu_b", 150.0, 50.0, 2),   # 50 us gap, host launched 30 us late
        _x("gpu_memcpy", "Memcpy HtoD", 160.0, 20.0),  # overlaps b: not idle, not busy twice
        _x("kernel", "gemm_c", 203.0, 7.0, 3),      # 3 us gap: idle but under min_gap_us
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 500.0},
    ]


def test_busy_idle_and_gap_attribution():
    r = analyze_trace(_trace(), steps=1, min_gap_us=5.0)
    assert r["span_ms"] == pytest.approx(0.210)
    assert r["busy_ms"] == pytest.approx(0.157)
    assert r["idle_ms"] == pytest.approx(0.053)
    assert r["listed_gap_ms"] == pytest.approx(0.050)
    (gap,) = r["gaps"]
    assert gap["next_kernel"] == "swiglu_b" and gap["launched_in"] == "outer > inner"
    assert gap["ms"] == pytest.approx(0.050) and gap["late_ms"] == pytest.approx(0.030)
    calls = {c["name"]: c for c in r["runtime"]}
    assert calls["cudaLaunchKernel"]["calls"] == 2 and calls["cuLaunchKernelEx"]["calls"] == 1
    assert calls["cudaStreamSynchronize"]["ms"] == pytest.approx(0.040)
    assert r["runtime"][0]["name"] == "cudaStreamSynchronize"  # most host time first


def test_per_step_division_and_launch_before_gap():
    events = _trace()
    (launch,) = [e for e in events if e.get("args", {}).get("correlation") == 2
                 and e["cat"] == "cuda_runtime"]
    launch["ts"] = 90.0  # launched before the previous kernel ended: device-side wait
    r = analyze_trace(events, steps=2, min_gap_us=1.0)
    assert r["span_ms"] == pytest.approx(0.105)
    by_kernel = {g["next_kernel"]: g for g in r["gaps"]}
    assert by_kernel["swiglu_b"]["late_ms"] == 0.0
    assert by_kernel["swiglu_b"]["launched_in"] == "(no host op)"
    assert by_kernel["gemm_c"]["ms"] == pytest.approx(0.0015)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        analyze_trace(_trace(), steps=0)
    with pytest.raises(ValueError, match="no kernel, memcpy or memset"):
        analyze_trace([e for e in _trace() if e["cat"] not in ("kernel", "gpu_memcpy")], 1)


def test_profile_each_peer_records_a_failing_peer_and_goes_on(monkeypatch):
    """One peer raising gives a record with its error; the next peer still runs."""
    import common
    import grouped_mlp

    monkeypatch.setattr(grouped_mlp, "make_problem", lambda *a: "problem")
    monkeypatch.setattr(common, "free_memory", lambda: None)

    def profile(peer, problem, args):
        if peer == "bad":
            raise RuntimeError("no kernel\nsecond line")
        return {"busy": 1.0, "problem": problem}

    args = type("A", (), {"shapes": "E64_T256_H2048_FF768", "peers": "bad,good", "seed": 0})
    records = list(common.profile_each_peer(args, "b", profile))
    assert records == [
        {"bench": "b", "shape": "E64_T256_H2048_FF768", "peer": "bad",
         "error": "RuntimeError: no kernel"},
        {"bench": "b", "shape": "E64_T256_H2048_FF768", "peer": "good", "busy": 1.0,
         "problem": "problem"},
    ]
