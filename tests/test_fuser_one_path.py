"""The fuser's one eager execution path (te_ops/fuser.py): every eager call of a block, fused or
unfused, per-expert or single grouped weight, with or without grad, runs one
``_FuserFunction``; a repeated call reuses the cached plan; repeated calls follow changes of
the parameters, their dtype, the environment and the inputs' kind; values against the fp64
per-expert reference of ``tests/reference.py``.
"""

from __future__ import annotations

import pytest
import reference as ref
import torch
from block_replay import fwd_bwd_step

import te_ops
from te_ops import fuser as fuser_mod
from te_ops.fused import BackwardGroupedMLP, ForwardGroupedMLP

H, FF, GROUPS = 16, 8, 4
FUNCTION_NODE = "_FuserFunctionBackward"


def _block(single: bool, bias: bool = False, dtype: torch.dtype = torch.float32
           ) -> te_ops.Sequential:
    torch.manual_seed(0)
    kw = {"single_grouped_weight": single, "bias": bias, "dtype": dtype}
    return te_ops.Sequential(te_ops.GroupedLinear(GROUPS, H, 2 * FF, **kw),
                             te_ops.ScaledSwiGLU(), te_ops.GroupedLinear(GROUPS, FF, H, **kw))


def _inputs(rows: int = 10, sizes=(3, 0, 4, 2), dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, H, generator=gen, dtype=dtype).requires_grad_()
    probs = torch.rand(rows, generator=gen, dtype=dtype).requires_grad_()
    return x, probs, torch.tensor(sizes)


def _count_function_forwards(monkeypatch) -> list[int]:
    """Wrap ``_FuserFunction.forward`` (looked up by ``Function.apply`` per call) so every
    run appends 1 to the returned list."""
    runs: list[int] = []
    inner = fuser_mod._FuserFunction.forward

    def counted(*args, **kwargs):
        runs.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(fuser_mod._FuserFunction, "forward", staticmethod(counted))
    return runs


@pytest.mark.parametrize("single", [True, False], ids=["single_weight", "per_expert"])
@pytest.mark.parametrize("fusion", ["1", "0"], ids=["fused", "unfused"])
def test_one_autograd_function_runs_every_call(monkeypatch, single, fusion):
    """Fused and unfused plans, per-expert and single weight: the output's node is the
    fuser Function's backward on the first and every repeated call, one Function run per
    call; under ``no_grad`` the same Function runs (and the output has no node)."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = _block(single)
    x, probs, split = _inputs()
    runs = _count_function_forwards(monkeypatch)
    for i in range(3):
        assert fwd_bwd_step(block, x, probs, split)[2] == FUNCTION_NODE
        assert len(runs) == i + 1
    plan = block.fusers()[0]._plan
    fused = [type(op) for op, _ in plan.forward_ops], [type(op) for op, _ in plan.backward_ops]
    if fusion == "1":
        assert fused == ([ForwardGroupedMLP], [BackwardGroupedMLP])
    else:
        assert ForwardGroupedMLP not in fused[0] and BackwardGroupedMLP not in fused[1]
    with torch.no_grad():
        out = block(x, split, probs, split)
    assert out.grad_fn is None and len(runs) == 4
    frozen = _block(single)
    frozen.requires_grad_(False)
    assert frozen(x.detach(), split, probs.detach(), split).grad_fn is None
    assert len(runs) == 5


@pytest.mark.parametrize("single", [True, False], ids=["single_weight", "per_expert"])
def test_a_repeated_call_reuses_the_cached_plan(monkeypatch, single):
    """The plan is made once for calls of one kind (new tensors and split-size values of the
    same kind included) and again when the kind changes (grad pattern, dtype, split-size
    kind); ``explain()`` shows the last call's plan."""
    block = _block(single)
    fuser = block.fusers()[0]
    made = []
    inner = fuser._make_plan

    def counted(*args, **kwargs):
        made.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(fuser, "_make_plan", counted)
    x, probs, split = _inputs()
    fwd_bwd_step(block, x, probs, split)
    plan = fuser._plan
    for sizes in ((3, 0, 4, 2), (1, 1, 1, 1), (0, 0, 0, 10)):
        x2, probs2, split2 = _inputs(10, sizes)
        fwd_bwd_step(block, x2, probs2, split2)
        assert fuser._plan is plan
    assert len(made) == 1
    with torch.no_grad():  # another grad pattern: a plan of its own, then cached
        block(x, split, probs, split)
        block(x, split, probs, split)
    assert len(made) == 2 and fuser._plan is not plan
    fwd_bwd_step(block, x, probs, split)
    assert fuser._plan is plan and len(made) == 2
    block(x, [3, 0, 4, 2], probs, [3, 0, 4, 2]).sum().backward()  # host split sizes
    assert len(made) == 3


@pytest.mark.parametrize("single", [True, False], ids=["single_weight", "per_expert"])
def test_repeated_calls_match_the_fp64_reference(single):
    block = _block(single)
    for sizes in ((3, 0, 4, 2), (3, 0, 4, 2), (1, 2, 0, 1)):
        x, probs, split = _inputs(10, sizes)
        out, grads, _ = fwd_bwd_step(block, x, probs, split)
        w1, w2 = ([ref.leaf(w) for w in (b.weight if single else b.weights())]
                  for b in (block[0], block[2]))
        xr, pr = ref.leaf(x), ref.leaf(probs)
        h = ref.grouped_linear(xr, w1, None, list(sizes))
        y = ref.grouped_linear(ref.scaled_swiglu(h, pr), w2, None, list(sizes))
        ref.assert_close(out, y, torch.float32, "output")
        y.sum().backward()
        ref.assert_close(grads[0], xr.grad, torch.float32, "x.grad")
        ref.assert_close(grads[1], pr.grad, torch.float32, "probs.grad")
        want = [w.grad for w in w1 + w2]
        got = grads[2:]
        if single:
            want = [torch.stack(want[:GROUPS]), torch.stack(want[GROUPS:])]
        for g, w in zip(got, want):
            ref.assert_close(g, w, torch.float32, "weight grad")


@pytest.mark.parametrize("change", ["swap", "freeze", "cast", "fusion_off", "data"])
def test_repeated_calls_follow_changes(monkeypatch, change):
    """After warm calls, a changed parameter object, requires_grad, dtype, environment or
    parameter data gives a fresh block's values bit for bit."""
    block, fresh = _block(False), _block(False)
    x, probs, split = _inputs()
    for _ in range(2):
        fwd_bwd_step(block, x, probs, split)
    dtype = torch.float32
    if change == "swap":
        for b in (block, fresh):
            b[2].weight1 = torch.nn.Parameter(torch.full_like(b[2].weight1, 0.5))
    elif change == "freeze":
        for b in (block, fresh):
            b[0].weight2.requires_grad_(False)
    elif change == "cast":
        dtype = torch.float64
        block.to(dtype)
        fresh.to(dtype)
    elif change == "fusion_off":
        monkeypatch.setenv("TE_OPS_FUSION", "0")
    elif change == "data":
        for b in (block, fresh):
            b[0].weight3.data = b[0].weight3.data * 2
    x, probs = x.detach().to(dtype).requires_grad_(), probs.detach().to(dtype).requires_grad_()
    got, want = fwd_bwd_step(block, x, probs, split), fwd_bwd_step(fresh, x, probs, split)
    assert torch.equal(got[0], want[0])
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got[1], want[1]))


@pytest.mark.parametrize("single", [True, False], ids=["single_weight", "per_expert"])
def test_in_place_weight_change_between_forward_and_backward_raises(single):
    block = _block(single)
    x, probs, split = _inputs()
    fwd_bwd_step(block, x, probs, split)
    out = block(x, split, probs, split)
    with torch.no_grad():
        (block[2].weight if single else block[2].weights()[1]).add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
