"""Activation checkpointing under ``te_ops.autocast``: a recomputation that runs without the
recipe of its first forward (plain ``torch.utils.checkpoint``, which restores torch's state,
not te_ops') raises naming ``te_ops.checkpoint``; every way that keeps the recipe, or that has
no recipe to keep, runs and gives the uncheckpointed call's gradients."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import te_ops

RECIPES = pytest.mark.parametrize(
    "recipe", [te_ops.recipe.Float8CurrentScaling(), te_ops.recipe.MXFP8BlockScaling()],
    ids=["fp8", "mxfp8"])
SIZES = [2, 3, 4]


def _mlp() -> te_ops.Sequential:
    torch.manual_seed(3)
    return te_ops.Sequential(te_ops.GroupedLinear(3, 32, 64), te_ops.ScaledSwiGLU(),
                             te_ops.GroupedLinear(3, 32, 32))


def _grads(block, call):
    block.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 32, generator=g).requires_grad_()
    probs = torch.rand(9, generator=g).requires_grad_()
    y = call(block, x, probs)
    y.square().sum().backward()
    return [y.detach(), x.grad, probs.grad] + [p.grad for p in block.parameters()]


def _assert_equal(got, expected):
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@RECIPES
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_torch_checkpoint_under_a_recipe_raises_naming_te_ops_checkpoint(recipe, use_reentrant):
    block = _mlp()

    def ckpt(b, x, p):
        with te_ops.autocast(recipe=recipe):
            return torch_checkpoint(b, x, SIZES, p, SIZES, use_reentrant=use_reentrant)

    with pytest.raises(RuntimeError, match=rf"recomputed during backward .* without "
                                           rf"te_ops.autocast.*{type(recipe).__name__}.*"
                                           r"Use te_ops.checkpoint"):
        _grads(block, ckpt)


@RECIPES
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_te_ops_checkpoint_under_a_recipe_gives_the_recipe_grads(recipe, use_reentrant):
    block = _mlp()

    def plain(b, x, p):
        with te_ops.autocast(recipe=recipe):
            return b(x, SIZES, p, SIZES)

    def ckpt(b, x, p):
        with te_ops.autocast(recipe=recipe):
            return te_ops.checkpoint(b, x, SIZES, p, SIZES, use_reentrant=use_reentrant)

    expected = _grads(block, plain)
    _assert_equal(_grads(block, ckpt), expected)
    # the recipe's gradients differ from the high-precision ones (the comparison can fail)
    assert not torch.equal(_grads(block, lambda b, x, p: b(x, SIZES, p, SIZES))[1], expected[1])


@RECIPES
def test_torch_checkpoint_with_te_ops_context_fn_gives_the_recipe_grads(recipe):
    block = _mlp()

    def plain(b, x, p):
        with te_ops.autocast(recipe=recipe):
            return b(x, SIZES, p, SIZES)

    def ckpt(b, x, p):
        with te_ops.autocast(recipe=recipe):
            return torch_checkpoint(b, x, SIZES, p, SIZES, use_reentrant=False,
                                    context_fn=te_ops.checkpoint_context_fn)

    _assert_equal(_grads(block, ckpt), _grads(block, plain))


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_torch_checkpoint_without_a_recipe_runs(use_reentrant):
    block = _mlp()
    expected = _grads(block, lambda b, x, p: b(x, SIZES, p, SIZES))
    got = _grads(block, lambda b, x, p: torch_checkpoint(b, x, SIZES, p, SIZES,
                                                         use_reentrant=use_reentrant))
    _assert_equal(got, expected)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_recipe_inference_then_checkpoint_without_a_recipe_runs(use_reentrant):
    # the recipe of an earlier call (inference under autocast) is not held against a later
    # checkpointed call without one
    block = _mlp()
    x = torch.randn(9, 32)
    with torch.no_grad(), te_ops.autocast(recipe=te_ops.recipe.Float8CurrentScaling()):
        block(x, SIZES, torch.rand(9), SIZES)
    expected = _grads(block, lambda b, x, p: b(x, SIZES, p, SIZES))
    got = _grads(block, lambda b, x, p: torch_checkpoint(b, x, SIZES, p, SIZES,
                                                         use_reentrant=use_reentrant))
    _assert_equal(got, expected)
