"""Per-call host caches (host overhead): what they remember holds only for the fuser call
that made it.

* ``te_ops/call_scope.py``: a GroupedLinear checks its parameter dict once per fuser forward
  call; a parameter swapped between calls, or by a module hook (which runs the op in a call
  of its own), is used and gets the gradient.
* ``GroupedLinearSaved.weights_view``: dgrad reads the forward's stacked view of adjacent
  per-expert weights; the weights themselves stay saved, so an in-place change between
  forward and backward still raises torch's error, also for weights that no longer share a
  version counter (``copy.deepcopy``) or a buffer (re-pointed ``.data``).
* The fuser calls autograd's C ``apply`` directly only without functorch transforms; under
  one the error is torch's own.

Values are checked against the float64 per-expert reference of ``tests/reference.py``.
"""

from __future__ import annotations

import copy

import pytest
import reference as ref
import torch
from test_host_caches import _block  # the same small fc1 / SwiGLU / fc2 block

import te_ops
from te_ops.basic.grouped_linear import stacked
from te_ops.call_scope import close_call_scope, current_call, open_call_scope


def _inputs(rows: int = 10, sizes=(3, 0, 4, 2)):
    torch.manual_seed(1)
    x = torch.randn(rows, 8, requires_grad=True)
    probs = torch.rand(rows, requires_grad=True)
    return x, probs, torch.tensor(sizes)


def _reference(block, x, probs, sizes):
    """float64 output and leaves (x, probs, fc1 weights, fc2 weights) of the block's math."""
    fc1, fc2 = block[0], block[2]
    leaves = {}
    for name, fc in (("fc1", fc1), ("fc2", fc2)):
        single = fc.single_grouped_weight
        leaves[name] = [ref.leaf(w) for w in stacked(fc.weights(), single)]
        leaves[name + "_b"] = [ref.leaf(b) for b in stacked(fc.biases(), single)]
    xr, pr = ref.leaf(x), ref.leaf(probs)
    h = ref.grouped_linear(xr, leaves["fc1"], leaves["fc1_b"], sizes)
    y = ref.grouped_linear(ref.scaled_swiglu(h, pr), leaves["fc2"], leaves["fc2_b"], sizes)
    return y, xr, pr, leaves


def _check_step(block, x, probs, sizes) -> None:
    """Output and every gradient of one step match the reference, which is built after the
    step from the parameters the block holds then (a hook may swap one during the step)."""
    for p in (x, probs, *block.parameters()):
        p.grad = None
    y = block(x, sizes, probs, sizes)
    dy = torch.randn_like(y)
    y.backward(dy)
    want, xr, pr, leaves = _reference(block, x, probs, sizes)
    ref.assert_close(y, want, torch.float32)
    want.backward(dy.to(torch.float64))
    ref.assert_close(x.grad, xr.grad, torch.float32)
    ref.assert_close(probs.grad, pr.grad, torch.float32)
    for fc, name in ((block[0], "fc1"), (block[2], "fc2")):
        got = stacked([w.grad for w in fc.weights()], fc.single_grouped_weight)
        ref.assert_close(got, torch.stack([w.grad for w in leaves[name]]), torch.float32)


# ---------------------------------------------------------------------------- call scope
def test_call_scope_is_fresh_per_call_and_gone_after():
    assert current_call() is None
    outer = open_call_scope()
    first = current_call()
    inner = open_call_scope()
    assert current_call() is not first and current_call() is not None
    close_call_scope(inner)
    assert current_call() is first
    close_call_scope(outer)
    assert current_call() is None


def test_param_lists_outside_a_call_follow_a_swap():
    block = _block()
    x, probs, sizes = _inputs()
    block(x, sizes, probs, sizes)  # caches the lists inside a call
    fc1 = block[0]
    new = torch.nn.Parameter(torch.randn(12, 8))
    fc1.weight1 = new
    assert fc1.weights()[1] is new  # outside a call: checked again


@pytest.mark.parametrize("single", [False, True])
def test_parameter_swapped_by_a_pre_hook_is_used_and_gets_the_grad(single):
    """A hook runs between fuser calls (the op with hooks runs in a call of its own): a
    parameter it swaps in is what the op's call uses, and what gets the gradient."""
    block = _block(single)
    x, probs, sizes = _inputs()
    block(x, sizes, probs, sizes).sum().backward()  # caches filled
    fc2 = block[2]
    name = "weight" if single else "weight2"
    new = torch.nn.Parameter(torch.randn_like(getattr(fc2, name)))

    def swap(module, args):
        setattr(module, name, new)

    old = getattr(fc2, name)
    fc2.register_forward_pre_hook(swap)
    _check_step(block, x, probs, sizes)
    assert getattr(fc2, name) is new
    assert new.grad is not None and new.grad.abs().sum() > 0
    assert old.grad is None  # reset by _check_step; the swapped-out weight gets nothing


@pytest.mark.parametrize("single", [False, True])
def test_swap_between_steps_is_seen_inside_the_next_call(single):
    block = _block(single)
    x, probs, sizes = _inputs()
    _check_step(block, x, probs, sizes)
    fc1 = block[0]
    name = "weight" if single else "weight0"
    setattr(fc1, name, torch.nn.Parameter(torch.randn_like(getattr(fc1, name))))
    _check_step(block, x, probs, sizes)


# -------------------------------------------------------------------------- weights_view
@pytest.mark.parametrize("fusion", ["1", "0"])
@pytest.mark.parametrize("layout", ["packed", "deepcopy", "repointed"])
def test_dgrad_with_forward_view_matches_reference(monkeypatch, fusion, layout):
    """Adjacent weights (the forward's view feeds dgrad), adjacent weights with their own
    version counters (deepcopy), and non-adjacent weights (a stacked copy, not kept)."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = _block()
    if layout == "deepcopy":
        block = copy.deepcopy(block)
    elif layout == "repointed":
        with torch.no_grad():
            block[2].weight1.data = torch.randn(8, 6)
    x, probs, sizes = _inputs()
    _check_step(block, x, probs, sizes)


@pytest.mark.parametrize("fusion", ["1", "0"])
@pytest.mark.parametrize("layout", ["packed", "deepcopy"])
def test_inplace_weight_change_before_backward_still_raises(monkeypatch, fusion, layout):
    """The per-expert weights stay saved tensors: changing one in place between forward and
    backward raises torch's error, whether or not the weights share a version counter."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = _block()
    if layout == "deepcopy":
        block = copy.deepcopy(block)  # adjacent again, but one version counter per weight
    x, probs, sizes = _inputs()
    y = block(x, sizes, probs, sizes)
    with torch.no_grad():
        block[2].weight3.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


# ---------------------------------------------------------------------------- apply path
def test_functorch_transform_still_goes_through_function_apply():
    """Under a functorch transform the fuser does not take the C apply it uses otherwise: it
    raises te_ops' error naming the transform (te_ops/func_transforms.py; torch's own
    ``Function.apply`` check named only ``setup_context``)."""
    fc = te_ops.GroupedLinear(2, 4, 3)
    x = torch.randn(5, 4)
    with pytest.raises(RuntimeError, match="te_ops.*torch.func.grad"):
        torch.func.grad(lambda x: fc(x, [2, 3]).sum())(x)
    with pytest.raises(RuntimeError, match="te_ops.*torch.func.functionalize"):
        torch.func.functionalize(lambda x: fc(x, [2, 3]))(x)
