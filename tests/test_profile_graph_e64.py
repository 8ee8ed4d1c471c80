"""benchmarks/profile_graph_e64.py's trace analysis on hand-built Kineto events (CPU only)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from kineto import x_event as _x  # noqa: E402
from profile_graph_e64 import category, format_record, step_kernels, summary  # noqa: E402


def _trace():
    return [
        _x("user_annotation", "profile_graph_step_0", 0.0, 100.0),
        _x("user_annotation", "profile_graph_step_1", 200.0, 100.0),
        _x("gpu_user_annotation", "profile_graph_step_1", 300.0, 40.0),  # device copy: ignored
        _x("cuda_runtime", "cudaMemcpyAsync", 1.0, 1.0, 1),
        _x("cuda_runtime", "cudaGraphLaunch", 5.0, 2.0, 2),
        _x("cuda_runtime", "cudaGraphLaunch", 5.0, 2.0, 3),
        _x("cuda_runtime", "cudaLaunchKernel", 210.0, 1.0, 4),
        _x("cuda_runtime", "cudaGraphLaunch", 150.0, 1.0, 9),  # outside both steps
        _x("gpu_memcpy", "Memcpy DtoD", 10.0, 2.0, 1),
        _x("kernel", "_rows_kernel", 14.0, 20.0, 2),        # 2 us gap
        _x("kernel", "triton_cumsum", 30.0, 10.0, 3),       # overlaps the GEMM by 4 us
        _x("kernel", "_wgrad_kernel", 300.0, 30.0, 4),
        _x("kernel", "stray", 160.0, 5.0, 9),
    ]


def test_steps_gaps_and_categories():
    steps = step_kernels(_trace())
    assert [s["count"] for s in steps] == [3, 1]
    first = steps[0]
    assert [k["name"] for k in first["kernels"]] == ["Memcpy DtoD", "_rows_kernel",
                                                     "triton_cumsum"]
    assert [k["graph"] for k in first["kernels"]] == [False, True, True]
    assert [k["gap_us"] for k in first["kernels"]] == [0.0, 2.0, 0.0]
    assert first["span_us"] == pytest.approx(30.0)
    assert first["busy_us"] == pytest.approx(28.0)
    assert first["gap_us"] == pytest.approx(2.0)
    assert first["per_cat_us"] == {"gpu_memcpy": 2.0, "gemm": 20.0, "other": 10.0}
    s = summary(steps)
    assert s["steps"] == 2 and s["step"] is steps[1]  # spans tie (30 us): the later one
    assert s["medians"]["span_us"] == pytest.approx(30.0)
    text = format_record({"shape": "E", "peer": "p", **s})
    assert "_wgrad_kernel" in text and "span 30.0 us" in text and "medians of 2" in text


def test_category_names():
    assert category("_rows_kernel") == "gemm"
    assert category("void cutlass::device_kernel<...>") == "gemm"
    assert category("_splits_kernel") == "other"


def test_errors():
    with pytest.raises(ValueError, match="annotations"):
        step_kernels([_x("kernel", "k", 0.0, 1.0, 1)])
    with pytest.raises(ValueError, match="no device events"):
        step_kernels([_x("user_annotation", "profile_graph_step_0", 0.0, 1.0)])


@pytest.mark.parametrize("argv, words", [
    (["--peers", "te_ops_fused,nope"], ["--peers", "'nope'"]),
    (["--steps", "0"], ["--steps"]),
    (["--summarize", "/no/such/file.jsonl"], ["--summarize", "/no/such/file.jsonl"]),
])
def test_bad_arguments_are_usage_errors(capsys, argv, words):
    from profile_graph_e64 import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_summarize_reads_written_records(tmp_path, capsys):
    import json

    from profile_graph_e64 import main

    record = {"bench": "profile_graph_e64", "shape": "E64", "peer": "p",
              **summary(step_kernels(_trace()))}
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(record) + "\n" + json.dumps(
        {"bench": "profile_graph_e64", "shape": "E64", "peer": "q", "error": "boom"}) + "\n")
    assert main(["--summarize", str(path)]) == 0
    out = capsys.readouterr().out
    assert "## E64 p" in out and "_rows_kernel" not in out.split("## E64 q")[1]
    assert "## E64 q: boom" in out
