"""The per-step host caches (host overhead) follow every change they stand for.

Each cache is checked by changing what it remembers and demanding the new behaviour: an
environment variable (its value, a bad value, a new unknown name), a parameter object swapped
or re-pointed, split sizes with and without padding rows on the CPU. Values are checked against
the float64 per-expert reference of ``tests/reference.py``.
"""

from __future__ import annotations

import os

import pytest
import reference as ref
import torch

import te_ops
from te_ops import env
from te_ops.fused.grouped_mlp import ForwardGroupedMLP
from te_ops.gemm import dispatch as grouped_gemm
from te_ops.splits import make_splits


def _block(single: bool = False) -> te_ops.Sequential:
    torch.manual_seed(0)
    return te_ops.Sequential(
        te_ops.GroupedLinear(4, 8, 12, single_grouped_weight=single),
        te_ops.ScaledSwiGLU(),
        te_ops.GroupedLinear(4, 6, 8, single_grouped_weight=single),
    )


def _inputs(rows: int = 10, sizes=(3, 0, 4, 2)):
    x = torch.randn(rows, 8, requires_grad=True)
    probs = torch.rand(rows, requires_grad=True)
    return x, probs, torch.tensor(sizes)


def _expected(block: te_ops.Sequential, x, probs, sizes) -> torch.Tensor:
    fc1, fc2 = block[0], block[2]
    w1 = [ref.leaf(w) for w in te_ops.basic.grouped_linear.stacked(fc1.weights(),
                                                                  fc1.single_grouped_weight)]
    w2 = [ref.leaf(w) for w in te_ops.basic.grouped_linear.stacked(fc2.weights(),
                                                                  fc2.single_grouped_weight)]
    b1 = [ref.leaf(b) for b in te_ops.basic.grouped_linear.stacked(fc1.biases(),
                                                                  fc1.single_grouped_weight)]
    b2 = [ref.leaf(b) for b in te_ops.basic.grouped_linear.stacked(fc2.biases(),
                                                                  fc2.single_grouped_weight)]
    h = ref.grouped_linear(ref.leaf(x), w1, b1, sizes)
    a = ref.scaled_swiglu(h, ref.leaf(probs))
    return ref.grouped_linear(a, w2, b2, sizes)


# ------------------------------------------------------------------------- environment
def test_env_read_follows_every_change(monkeypatch):
    monkeypatch.delenv("TE_OPS_FUSION", raising=False)
    assert env.read("TE_OPS_FUSION") == "1"
    monkeypatch.setenv("TE_OPS_FUSION", "0")
    assert env.read("TE_OPS_FUSION") == "0"
    assert dict(env.snapshot())["TE_OPS_FUSION"] == "0"
    monkeypatch.setenv("TE_OPS_FUSION", " 1 ")
    assert dict(env.snapshot())["TE_OPS_FUSION"] == "1"
    monkeypatch.setenv("TE_OPS_FUSION", "yes")
    for _ in range(2):  # a bad value raises every time, never cached
        with pytest.raises(ValueError, match="TE_OPS_FUSION"):
            env.snapshot()
        with pytest.raises(ValueError, match="TE_OPS_FUSION"):
            env.read("TE_OPS_FUSION")
    monkeypatch.delenv("TE_OPS_FUSION")
    assert dict(env.snapshot())["TE_OPS_FUSION"] == "1"
    with pytest.raises(KeyError):
        env.read("TE_OPS_NOT_DECLARED")


def test_fusion_toggle_between_calls_replans(monkeypatch):
    block = _block()
    x, probs, sizes = _inputs()
    fuser = block.fusers()[0]
    monkeypatch.setenv("TE_OPS_FUSION", "1")
    y1 = block(x, sizes, probs, sizes)
    assert isinstance(fuser._plan.forward_ops[0][0], ForwardGroupedMLP)
    monkeypatch.setenv("TE_OPS_FUSION", "0")
    y0 = block(x, sizes, probs, sizes)
    assert not any(isinstance(op, ForwardGroupedMLP) for op, _ in fuser._plan.forward_ops)
    assert torch.equal(y0, y1)


def test_unknown_name_set_later_still_warns_once(monkeypatch):
    monkeypatch.setattr(env, "_WARNED", set())
    monkeypatch.delenv("TE_OPS_FUSOIN", raising=False)
    lin = te_ops.GroupedLinear(2, 4, 4)
    x = torch.randn(3, 4)
    lin(x, [1, 2])  # the scan of this environment is remembered
    monkeypatch.setenv("TE_OPS_FUSOIN", "0")  # a new name: scanned again
    with pytest.warns(UserWarning, match="TE_OPS_FUSOIN is not a te_ops variable"):
        lin(x, [1, 2])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lin(x, [1, 2])  # once per name


def test_backend_choice_follows_env(monkeypatch):
    lin = te_ops.GroupedLinear(2, 16, 16)
    x = torch.randn(5, 16)
    sizes = torch.tensor([2, 3])
    monkeypatch.delenv("TE_OPS_GROUPED_GEMM_BACKEND", raising=False)
    y_auto = lin(x, sizes)
    assert any("grouped_mm" in r for r in lin.dispatch_records())
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "loop")
    y_loop = lin(x, sizes)
    assert any("loop (forced" in r for r in lin.dispatch_records())
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "1")
    with pytest.raises(RuntimeError, match="TE_OPS_GRAPH_SAFE=1"):
        lin(x, sizes)
    torch.testing.assert_close(y_auto, y_loop)
    assert os.environ.get("TE_OPS_GROUPED_GEMM_BACKEND") == "loop"


def test_backend_choice_is_not_cached_before_the_probe(monkeypatch):
    monkeypatch.setattr(grouped_gemm, "_CHOICES", {})
    monkeypatch.setattr(grouped_gemm, "_PROBE_CACHE", {})
    grouped_gemm.select_backend(torch.device("meta"), torch.float16, 16, 16, True)
    # (the key's head, not the whole key: its tail grows with the dispatch rules
    # added the Gluon kinds, which a hard-coded 9-tuple never matched)
    cached = any(k[:5] == (torch.device("meta"), torch.float16, 16, 16, True)
                 for k in grouped_gemm._CHOICES)
    assert cached == (("meta", None, torch.float16) in grouped_gemm._PROBE_CACHE)


# -------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("single", [False, True])
def test_swapped_parameter_object_is_used_and_gets_the_grad(single):
    block = _block(single)
    x, probs, sizes = _inputs()
    block(x, sizes, probs, sizes).sum().backward()  # fills the caches
    fc1 = block[0]
    name = "weight" if single else "weight2"
    old = getattr(fc1, name)
    new = torch.nn.Parameter(torch.randn_like(old))
    setattr(fc1, name, new)
    before = old.grad.clone()  # from the first step
    x.grad = probs.grad = None
    y = block(x, sizes, probs, sizes)
    ref.assert_close(y, _expected(block, x, probs, sizes), torch.float32)
    y.sum().backward()
    assert new.grad is not None and new.grad.abs().sum() > 0
    assert torch.equal(old.grad, before)  # the swapped-out parameter gets nothing more


def test_repointed_parameter_data_is_used():
    block = _block()
    x, probs, sizes = _inputs()
    block(x, sizes, probs, sizes)
    with torch.no_grad():
        block[2].weight1.data = torch.randn(8, 6)  # no longer a slice of the shared buffer
    y = block(x, sizes, probs, sizes)
    ref.assert_close(y, _expected(block, x, probs, sizes), torch.float32)


def test_requires_grad_flip_is_seen_by_the_next_call():
    block = _block()
    x, probs, sizes = _inputs()
    block(x, sizes, probs, sizes).sum().backward()
    for p in block[0].parameters():
        p.requires_grad_(False)
        p.grad = None
    block(x, sizes, probs, sizes).sum().backward()
    assert all(p.grad is None for p in block[0].parameters())
    assert block[2].weight0.grad is not None


# ------------------------------------------------------------------------------ splits
@pytest.mark.parametrize("sizes,padding", [((3, 0, 4, 3), False), ((3, 0, 4, 2), True)])
def test_cpu_split_tensor_knows_its_padding(sizes, padding):
    splits = make_splits(torch.tensor(sizes), 4, 10, torch.device("cpu"))
    assert splits.has_padding is padding
    assert splits.base_offsets.tolist() == [0, *torch.tensor(sizes).cumsum(0).tolist()]
    meta = make_splits(torch.tensor(sizes, device="meta"), 4, 10, torch.device("meta"))
    assert meta.has_padding is None


def test_cpu_padding_rows_stay_zero_with_garbage_in_them():
    block = _block()
    x, probs, sizes = _inputs(sizes=(3, 0, 4, 2))
    with torch.no_grad():
        x[9] = float("nan")
        probs[9] = float("nan")
    y = block(x, sizes, probs, sizes)
    assert torch.equal(y[9], torch.zeros_like(y[9]))
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad[9], torch.zeros_like(x.grad[9]))
    assert all(torch.isfinite(p.grad).all() for p in block.parameters() if p.grad is not None)


@pytest.mark.parametrize("sizes", [(3, -1, 2), (3, 3, 3), (2**62, 2**62, 2**62),
                                   (2**63 - 1, 2, 0)])
def test_device_split_check_catches_negative_overflowing_and_too_large(sizes):
    with pytest.raises(RuntimeError, match="split_sizes must be non-negative"):
        make_splits(torch.tensor(sizes), 3, 6, torch.device("cpu"))


def test_parsed_env_values_stay_bounded(monkeypatch):
    for i in range(300):
        monkeypatch.setenv("TE_OPS_FUSION", " " * (i % 7) + ("1" if i % 2 else "0"))
        assert env.read("TE_OPS_FUSION") == ("1" if i % 2 else "0")
        monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "AUTO" + " " * i)
        assert env.read("TE_OPS_GROUPED_GEMM_BACKEND") == "auto"
    assert len(env._PARSED) <= 256
