"""``benchmarks/swiglu_cpu_blocks.py``: a tiny run writes its records (aligned block sizes give
bitwise equal results), restores ``CPU_BLOCK_ELEMENTS``, and bad arguments name the flag."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import swiglu_cpu_blocks  # noqa: E402

from te_ops.basic import swiglu  # noqa: E402


def test_tiny_run_records(tmp_path, capsys):
    threads = torch.get_num_threads()
    default = swiglu.CPU_BLOCK_ELEMENTS
    out = tmp_path / "r.jsonl"
    try:
        assert swiglu_cpu_blocks.main(["--rows", "70", "--half", "64", "--block-elements",
                                       "128,1000000", "--overhead-rows", "4", "--iters", "1",
                                       "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert swiglu.CPU_BLOCK_ELEMENTS == default
    records = [json.loads(line) for line in out.read_text().splitlines()][1:]
    assert [(r["case"], r["variant"], r["blocks"]) for r in records] == [
        ("shape", "this_128", 35), ("shape", "this_1000000", 1),
        ("one_row_blocks", "this_64", 4)]
    assert records[1]["bitwise_vs_this_128"] is True  # 2-row blocks vs one block
    assert all(r["bwd_ms_min"] > 0 and r["fwd_us_per_block_min"] > 0 for r in records)
    capsys.readouterr()


@pytest.mark.parametrize(("argv", "message"), [
    (["--block-elements", "64,x"], "--block-elements: expected comma-separated ints"),
    (["--block-elements", "0"], "--block-elements must be >= 1"),
    (["--iters", "0"], "--iters must be >= 1"),
    (["--baseline", "te_ops_no_such_baseline"], "--make-baseline SRC DEST"),
])
def test_bad_arguments_name_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        swiglu_cpu_blocks.parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err
