"""``benchmarks/host_ab.py``'s command line: a missing baseline package is a clear error that
says how to make one (not an import traceback)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import host_ab  # noqa: E402


def test_missing_baseline_names_make_baseline(capsys):
    with pytest.raises(SystemExit) as info:
        host_ab.main(["--baseline", "te_ops_no_such_baseline", "--device", "cpu"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--baseline 'te_ops_no_such_baseline' cannot be imported" in err
    assert "--make-baseline SRC DEST" in err


@pytest.mark.parametrize("item,message", [
    ("TE_OPS_FUSION", "expected NAME=VALUE with NAME a te_ops variable"),
    ("TE_OPS_NO_SUCH=1", "expected NAME=VALUE with NAME a te_ops variable"),
    ("TE_OPS_FUSION=2", "TE_OPS_FUSION must be one of ['0', '1']"),
])
def test_bad_variant_env_is_named(capsys, item, message):
    with pytest.raises(SystemExit) as info:
        host_ab.main(["--variant-env", item, "--device", "cpu"])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_variant_env_adds_a_variant(tmp_path, monkeypatch):
    base = tmp_path / "base"
    src = os.path.join(os.path.dirname(__file__), "..", "te_ops")
    assert host_ab.main(["--make-baseline", src, str(base)]) == 0
    monkeypatch.syspath_prepend(str(base))
    out = tmp_path / "ab.jsonl"
    assert host_ab.main(["--device", "cpu", "--shapes", "E64_T256_H64_FF32", "--modes", "single",
                         "--iters", "1", "--warmup", "0", "--variant-env",
                         "TE_OPS_FUSION=0", "--out", str(out)]) == 0
    import json

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    variants = {r["variant"] for r in rows if r["bench"] == "host_ab"}
    assert variants == {"torch_grouped_mm", "base_single", "new_single",
                        "new_single_TE_OPS_FUSION=0"}


def test_threads_must_be_positive(capsys):
    with pytest.raises(SystemExit) as info:
        host_ab.main(["--threads", "0", "--device", "cpu", "--shapes", "E8_T4096_H256_FF512"])
    assert info.value.code == 2
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err


def test_floor_adds_the_autograd_floor_variants(tmp_path, monkeypatch):
    """``--floor``: a bare autograd.Function with the block's parameters per mode, whose
    backward hands every parameter a gradient of its shape."""
    base = tmp_path / "base"
    src = os.path.join(os.path.dirname(__file__), "..", "te_ops")
    assert host_ab.main(["--make-baseline", src, str(base)]) == 0
    monkeypatch.syspath_prepend(str(base))
    out = tmp_path / "ab.jsonl"
    assert host_ab.main(["--device", "cpu", "--shapes", "E8_T4096_H8_FF8", "--iters", "1",
                         "--warmup", "0", "--floor", "--out", str(out)]) == 0
    import json

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    variants = {r["variant"] for r in rows if r["bench"] == "host_ab"}
    assert {"floor_single", "floor_per_expert"} <= variants
    import torch
    from grouped_mlp import HOST_SHAPES, make_problem

    problem = make_problem("E8_T4096_H8_FF8", HOST_SHAPES["E8_T4096_H8_FF8"],
                           torch.device("cpu"), torch.float32, 0)
    for single, count in ((True, 2), (False, 16)):
        floor = host_ab.AutogradFloor(problem, single)
        params = floor.parameters()
        assert len(params) == count
        floor.forward(problem.x, problem.probs).backward(problem.dy)
        assert all(p.grad is not None and p.grad.shape == p.shape for p in params)
