"""Copies, pickles and ``explain()`` records of a block on the CPU: the fc1 recompute record
follows the option, a block pickles after training steps and copies after a ``torch.compile``
step, and one expert weight cast alone is named as the parameter.

Each test compares against what the call actually did (the tensors autograd saved, counted
through ``saved_tensors_hooks``), never against te_ops' own record of it.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import te_ops

E, HIDDEN, FFN, ROWS = 3, 8, 8, 12


def _block(recompute: bool, single: bool = True) -> te_ops.Sequential:
    torch.manual_seed(0)
    return te_ops.Sequential(
        te_ops.GroupedLinear(E, HIDDEN, 2 * FFN, bias=False, single_grouped_weight=single),
        te_ops.ScaledSwiGLU(recompute_input=recompute),
        te_ops.GroupedLinear(E, FFN, HIDDEN, bias=False, single_grouped_weight=single),
    )


def _saved_h_count(blk: te_ops.Sequential) -> int:
    """Run one training call; how many saved tensors have h's shape (rows, 2 x ffn)."""
    torch.manual_seed(1)
    x = torch.randn(ROWS, HIDDEN, requires_grad=True)
    probs = torch.rand(ROWS, requires_grad=True)
    splits = torch.tensor([4, 3, 5])
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = blk(x, splits, probs, splits)
    y.sum().backward()
    return shapes.count((ROWS, 2 * FFN))


def _recompute_records(blk: te_ops.Sequential) -> list[str]:
    return [r for r in blk[1].dispatch_records() if r.startswith("fc1 recompute")]


@pytest.mark.parametrize("env", [{}, {"TE_OPS_FUSION": "0"}])
def test_explain_drops_the_recompute_record_when_the_option_is_switched_off(monkeypatch, env):
    """``recompute_input`` is a plain attribute (read per call): a
    user who switches it off after a call gets h saved again, and explain() must not keep
    saying "fc1 recompute: on: h is not saved" (or "off ... not honoured") from the previous
    call."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    blk = _block(recompute=True)
    with pytest.warns(UserWarning) if env else _no_warning():
        _saved_h_count(blk)
    assert _recompute_records(blk), "the call with the option on records its decision"
    blk[1].recompute_input = False
    assert _saved_h_count(blk) == 1  # h is saved now
    assert _recompute_records(blk) == [], blk.explain()
    assert "fc1 recompute" not in blk.explain()


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _clone_by_pickle(blk: te_ops.Sequential) -> te_ops.Sequential:
    return pickle.loads(pickle.dumps(blk))


def _clone_by_torch_save(blk: te_ops.Sequential) -> te_ops.Sequential:
    buf = io.BytesIO()
    torch.save(blk, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _train_step(blk: te_ops.Sequential, x, probs, splits) -> list[torch.Tensor]:
    blk.zero_grad(set_to_none=True)
    y = blk(x, splits, probs, splits)
    y.square().sum().backward()
    return [y.detach(), *[p.grad for p in blk.parameters()]]


@pytest.mark.parametrize("clone", [_clone_by_pickle, _clone_by_torch_save, copy.deepcopy])
def test_block_pickles_after_training_steps(clone):
    """Whole-module ``pickle`` / ``torch.save`` / ``deepcopy`` of a block after a few training
    steps (the fuser then holds its cached plans). The copy trains on, with the original's
    values."""
    blk = _block(recompute=False)
    torch.manual_seed(2)
    x, probs, splits = torch.randn(ROWS, HIDDEN), torch.rand(ROWS), torch.tensor([4, 3, 5])
    for _ in range(2):
        _train_step(blk, x, probs, splits)
    twin = clone(blk)
    for _ in range(2):
        got, want = _train_step(twin, x, probs, splits), _train_step(blk, x, probs, splits)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert twin[0].weights()[0] is not blk[0].weights()[0]


@pytest.mark.parametrize("clone", [_clone_by_pickle, copy.deepcopy])
@pytest.mark.parametrize("single", [False, True])
def test_block_copies_after_a_torch_compile_step(clone, single):
    """After a ``torch.compile`` training step of a block, pickling or deep-copying the block
    works (no ``RuntimeError: Attempted to access the data pointer on an invalid python
    storage``): ``GroupedLinear``'s parameter-list cache does not keep the trace's functional
    stand-ins of the parameters, which AOTAutograd swaps in. The copy then trains with the
    original's values."""
    torch.manual_seed(0)
    blk = te_ops.Sequential(
        te_ops.GroupedLinear(E, HIDDEN, 2 * FFN, bias=False, single_grouped_weight=single),
        te_ops.ScaledSwiGLU(),
        te_ops.GroupedLinear(E, FFN, HIDDEN, bias=False, single_grouped_weight=single))
    torch.manual_seed(2)
    x, probs, splits = torch.randn(ROWS, HIDDEN), torch.rand(ROWS), torch.tensor([4, 3, 5])
    compiled = torch.compile(blk, fullgraph=True, backend="aot_eager")
    compiled(x.requires_grad_(), splits, probs, splits).sum().backward()
    twin = clone(blk)
    got, want = _train_step(twin, x, probs, splits), _train_step(blk, x, probs, splits)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("fusion", ["1", "0"])
@pytest.mark.parametrize("layer,index,named", [(0, 0, "weight1 is torch.float32"),
                                               (0, 2, "weight2 is torch.bfloat16"),
                                               (2, 1, "weight1 is torch.bfloat16")])
def test_one_expert_weight_cast_alone_is_named_as_the_parameter(monkeypatch, fusion, layer,
                                                               index, named):
    """One per-expert weight cast alone: the error names the parameters by their names
    (``weight1`` and ``weight0``), also when it is weight0 (not "input must match the
    weights' dtype torch.bfloat16" while the other experts are still float32)."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    blk = _block(False, single=False)
    w = getattr(blk[layer], f"weight{index}")
    w.data = w.data.to(torch.bfloat16)
    x = torch.randn(ROWS, HIDDEN, requires_grad=True)
    probs = torch.rand(ROWS, requires_grad=True)
    splits = torch.tensor([4, 3, 5])
    with pytest.raises(ValueError, match=named + r" on cpu, expected torch\.\w+ on cpu as "
                                                 r"weight0.*cast or moved alone"):
        blk(x, splits, probs, splits)
