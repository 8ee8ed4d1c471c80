"""Opt-in recompute of fc1's output in the fused grouped MLP (``SwiGLU(recompute_input=True)``).

The fused forward (:class:`~te_ops.fused.grouped_mlp.ForwardGroupedMLP`) already leaves fc2's
input out of the saved context (it is recomputed from h, the activation's input). What it still
saves is h itself, fc1's output: 2F elements per token, the floor without recomputation, since
the SwiGLU backward reads both halves. With ``recompute_input=True`` on the activation, h is not
saved either: the activation's context (``SwiGLUSaved``) holds a :class:`Fc1Recompute` instead,
which re-runs fc1's forward GEMM (and bias) in backward from fc1's own saved context, the
``GroupedLinearSaved`` the fused and unfused fc1 backward read anyway (input, weights or their
forward view, split tensors, backend). It is the forward's call on the same operands, so the
recomputed h is bitwise the forward's, and every fused / unfused forward x backward pairing stays
bit-exact. The trade, as in Megatron-LM's selective activation recompute: one more fc1 GEMM
(2·T·H·2F FLOPs: 2/9, about 22 %, of the step's 3 x (2·T·H·2F + 2·T·F·H)) for T x 2F
activation elements less between forward and backward.

Not honoured (h saved as with the option off, with the reason in ``explain()`` and a warning,
once per op and reason, :meth:`~te_ops.basic.swiglu.SwiGLU.record_recompute`):

* the forward runs unfused (fusion toggled off, the fused gate refused, or no
  ``GroupedLinear`` before the activation): the unfused activation cannot reach fc1;
* a recipe (``te_ops.autocast``): fc1's forward GEMM read quantized copies of its input and
  weights, which are not saved (the input is saved column-wise only, for wgrad);
* fc1's context keeps no input (fc1's weights need no gradient, or fc1 takes no part in
  backward).
"""

from __future__ import annotations

from typing import Any

import torch

from ..basic.grouped_linear import GroupedLinear, GroupedLinearSaved, add_group_bias, stacked
from ..basic.swiglu import SwiGLU
from ..gemm import grouped_fprop
from ..op import OperationContext
from ..shapes import as_shape

__all__ = ["Fc1Recompute", "fc1_output", "recompute_reason", "fused_forward_recompute",
           "note_plan"]

#: The reasons ``recompute_input`` is not honoured (``explain()``, warnings, tests).
RECIPE_REASON = ("a recipe (te_ops.autocast) is active: fc1's forward GEMM read quantized "
                 "copies of its input and weights, which are not saved")
NO_INPUT_REASON = ("fc1's context keeps no input (fc1's weights need no gradient, or fc1 takes "
                   "no part in backward), so its GEMM cannot be re-run")
UNFUSED_REASON = "the fused grouped MLP forward does not cover it"


def fc1_output(saved: GroupedLinearSaved) -> torch.Tensor:
    """fc1's forward output (rows, out_features) from its saved layout, bitwise the forward's:
    the same ``grouped_fprop`` call (saved input or its row gather, the forward's stacked-weights view or the
    weights stacked as the forward stacked them, split tensors, backend), then the same bias
    gather (times the saved probs with ``scale_bias``). High precision only (no recipe).

    Raises
    ------
    RuntimeError
        The layout holds no input or was made under a recipe.
    """
    if not saved.has_input() or saved.recipe is not None:
        raise RuntimeError("fc1's saved context cannot recompute its output: "
                           + (RECIPE_REASON if saved.recipe is not None else NO_INPUT_REASON))
    weights = (saved.weights_view if saved.weights_view is not None
               else stacked(saved.weights, saved.single))
    y = grouped_fprop(saved.fprop_input(), weights, saved.splits, saved.backend)
    if saved.biases:
        y = add_group_bias(y, stacked(saved.biases, saved.single), saved.splits, saved.probs)
    return y


class Fc1Recompute:
    """The activation context's ``recompute_x``: h from fc1's context (see module docstring).

    ``h = recompute(keep=False)``: loads fc1's ``GroupedLinearSaved`` (the fuser has restored
    every context's saved tensors before the first backward op runs, so the weights' version
    check has already passed) and runs :func:`fc1_output`, shaped as the forward's h.
    ``keep=True`` keeps h for the next call: the unfused backward after a fused forward reads h
    twice (fc2's recomputed input, then the activation backward), one GEMM serves both.
    """

    def __init__(self, ctx1: OperationContext, shape: tuple[int, ...]) -> None:
        self._ctx1, self.shape, self._kept = ctx1, tuple(shape), None

    def __call__(self, keep: bool = False) -> torch.Tensor:
        h = self._kept
        if h is None:
            h = as_shape(fc1_output(GroupedLinearSaved.load(self._ctx1)), self.shape)
        self._kept = h if keep else None
        return h


def recompute_reason(saved1: GroupedLinearSaved | None, recipe: Any) -> str | None:
    """Why a fused forward cannot leave h out (``None``: it can). ``saved1``: fc1's layout of
    this call (``None`` when fc1 saves nothing)."""
    if recipe is not None:
        return RECIPE_REASON
    if saved1 is None or not saved1.has_input():
        return NO_INPUT_REASON
    return None


def fused_forward_recompute(act: SwiGLU, ctx1: OperationContext,
                            saved1: GroupedLinearSaved | None, recipe: Any,
                            h_shape: tuple[int, ...]) -> Fc1Recompute | None:
    """For the fused forward: the activation context's ``recompute_x`` when ``act`` asks for
    it and it can be honoured (then h is not saved), else ``None`` (h is saved); records the
    decision for ``explain()`` and warns when not honoured."""
    if not act.recompute_input:
        act.forget_recompute()
        return None
    reason = recompute_reason(saved1, recipe)
    act.record_recompute(reason)
    return None if reason is not None else Fc1Recompute(ctx1, h_shape)


def note_plan(ops: list, info: Any) -> None:
    """Plan-time notes (``explain()``'s "fusions not applied") for every activation with
    ``recompute_input=True`` that the forward plan ``ops`` will not honour: not covered by a
    fused op, or covered under a recipe or with fc1 outside backward or frozen (the runtime
    record of the last call is exact; this is the plan's view)."""
    for op in ops:
        if op.is_fused_op:
            fc1, act = (op.basic_ops + [None, None])[:2]
            if not (isinstance(act, SwiGLU) and act.recompute_input
                    and isinstance(fc1, GroupedLinear)):
                continue
            reason = None
            if info.recipe is not None:
                reason = RECIPE_REASON
            elif (not info.requires_grad[info.index(fc1)]
                  or not any(w.requires_grad for w in fc1.weights())):
                reason = NO_INPUT_REASON
        elif isinstance(op, SwiGLU) and op.recompute_input:
            act, reason = op, UNFUSED_REASON
        else:
            continue
        if reason is not None:
            info.note(f"op {info.index(act)} ({act.describe()}): recompute_input not honoured, "
                      f"h is saved: {reason}")
