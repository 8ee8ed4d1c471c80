"""The MoE layer's routing fused into its expert GEMMs: ``Permute -> fc1`` (forward) and
``fc2 -> Combine`` (backward).

``Permute -> GroupedLinear`` (:class:`ForwardPermuteFC1`, forward-only, ``permute_fc1_forward``)
    fc1's fprop reads the tokens through the permute's row index (row ``r`` is token
    ``pair_index[r] // k``; an empty capacity slot is a zero row): where fc1's fprop runs in
    the few-rows Triton kernel (and the fused fc1 + SwiGLU launch), the kernel gathers the rows
    in its A load and the permuted copy of x is never written; elsewhere the GEMM reads a
    transient gathered copy (:func:`te_ops.gemm.row_gather_reason` says which, ``explain()``
    shows it). Either way fc1's context keeps the tokens in token order (the tensor the router
    saves for its own weight gradient: autograd keeps one copy of a tensor saved twice) and the
    (rows,) index (``GroupedLinearSaved.x_gather``) instead of the (rows, H) permuted rows. In
    backward, fc1's wgrad reads the rows through the index too (in the few-rows wgrad kernel's
    load, else from a transient copy made right before the GEMM and dropped after it: the
    persistent / Gluon kernels read tiles of a plain row-major tensor); fc1's dgrad rows are
    summed back into token order by the permute's unfused backward, a gather over
    ``row_index``, as before. When the grouped-MLP forward fusion has taken fc1, this fusion
    puts the permute in front of it instead (:class:`~te_ops.fused.grouped_mlp.ForwardGroupedMLP`
    with basic ops ``[permute, fc1, act, fc2]``), so the two compose.

``GroupedLinear -> Combine`` (:class:`BackwardFC2Combine`, backward-only, ``fc2_combine_backward``)
    The combine's backward is a gather of the output gradient over the same kind of index
    (row ``r`` gets token ``pair_index[r] // k``'s gradient): fc2's dgrad and wgrad read ``dy``
    through it (:meth:`te_ops.basic.moe.Combine.grad_rows`), so the (rows, H) gradient copy is
    not written where they run in the few-rows Triton kernels; elsewhere it is gathered once,
    for both (:func:`te_ops.gemm.rows_for`). With the grouped-MLP backward
    fusion it extends :class:`~te_ops.fused.grouped_mlp.BackwardGroupedMLP` to
    ``[fc1, act, fc2, combine]``. The forward is not fused: the unfused combine keeps only
    ``pair_index`` (fc2's output is never saved), and a combine in fc2's epilogue would be a
    scatter-add of each token's top-k rows (atomics: neither deterministic nor the unfused
    fixed-order sum's bits).

Both keep the basic ops' saved layouts (``GroupedLinearSaved``, the permute's and the
combine's contexts), so every fused / unfused forward pairs with every fused / unfused backward
bit for bit. Not applied (``explain()`` says why): under a recipe (fc1's fprop would read a
quantized copy of the permuted rows, which the gather does not make; fc2's dgrad a quantized
``dy``), fc1's split sizes not fed by this permute, fc2 with a bias (its gradient sums plain
``dy`` rows).
"""

from __future__ import annotations

from typing import Any

from ..basic.grouped_linear import GroupedLinear, GroupedLinearSaved, check_probs
from ..basic.moe import Combine, Permute
from ..fuser import (
    PlanInfo,
    fusible_as,
    match_window,
    register_backward_fusion,
    register_forward_fusion,
)
from ..gemm import rows_for
from ..op import BasicOperation, FusedOperation, FusibleOperation, fed_from
from ..shapes import as_shape
from ..signature import FedOutput
from .grouped_mlp import BackwardGroupedMLP, ForwardGroupedMLP

__all__ = ["ForwardPermuteFC1", "BackwardFC2Combine", "permute_fc1_unsupported_reason",
           "fc2_combine_unsupported_reason", "fuse_permute_fc1_forward",
           "fuse_fc2_combine_backward"]

PERMUTE_FC1 = (("the permute", Permute), ("fc1", GroupedLinear))
FC2_COMBINE = (("fc2", GroupedLinear), ("the combine", Combine))

RECIPE_REASON = ("a recipe (te_ops.autocast) is active: fc1's fprop reads a quantized copy of "
                 "the permuted rows, which the row gather does not make")


def permute_fc1_unsupported_reason(permute: Permute, fc1: GroupedLinear, info: PlanInfo
                                   ) -> str | None:
    """Why ``permute -> fc1`` cannot take the fused forward (``None`` when it can): a recipe,
    the input not known yet, or fc1's split sizes not fed by this permute's ``split_sizes``
    (:meth:`~te_ops.op.BasicOperation.feed_extra_input`: then fc1's rows are not the permute's
    rows by construction)."""
    if info.recipe is not None:
        return RECIPE_REASON
    if info.dtype is None:
        return "input not known yet (planned before the first call)"
    sizes = info.extra_inputs[info.index(fc1)][0]
    if not (isinstance(sizes, FedOutput) and sizes.op == info.index(permute)
            and sizes.output == 0):
        return "fc1's split sizes are not fed by this permute's split_sizes output"
    return None


def fc2_combine_unsupported_reason(fc2: GroupedLinear, combine: Combine, info: PlanInfo
                                   ) -> str | None:
    """Why ``fc2 -> combine`` cannot take the fused backward (``None`` when it can): a recipe
    (fc2's GEMMs read a quantized ``dy``), fc2 with a bias (its gradient sums plain ``dy``
    rows), or fc2 taking no part in backward."""
    if info.recipe is not None:
        return "a recipe (te_ops.autocast) is active: fc2's dgrad and wgrad read a quantized dy"
    if fc2.has_bias:
        return "fc2 has a bias (its gradient sums the output-gradient rows themselves)"
    if not info.requires_grad[info.index(fc2)]:
        return "fc2 takes no part in backward"
    return None


class ForwardPermuteFC1(FusedOperation):
    """Fused forward of ``Permute -> fc1`` (see module docstring).

    Shapes: input (T, H) tokens -> fc1's output (R, out_features), R rows as the permute makes
    them; extra inputs: the permute's ``top_k_index``, ``top_k_probs`` (fc1's split sizes come
    from the permute), fc1's ``probs`` with ``scale_bias``; extra outputs: the permute's.
    """

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, recipe=None):
        permute, fc1 = self.basic_ops
        ctx_p, ctx1 = basic_op_ctxs
        if recipe is not None:  # the plan is made per recipe: the gate keeps it out
            raise RuntimeError(f"{type(self).__name__}: {RECIPE_REASON}")
        rows, outputs = permute.route(ctx_p, input_, basic_op_extra_inputs[0])
        (ex1,) = fed_from(permute, outputs, [fc1], basic_op_extra_inputs[1:])
        fc1.check_input(rows.src)
        splits = fc1.prepare_splits(rows.src, ex1[0], checked=True, num_rows=rows.shape[0])
        probs = (check_probs(ex1[1], splits.num_rows, input_.device)
                 if fc1.scale_bias else None)
        backend = fc1.select_backend(rows, splits)
        operands = fc1.forward_operands(ctx1, rows, splits, None)
        y = fc1.forward_math(rows, splits, backend, probs, None, operands)
        if ctx1.requires_grad:
            fc1.make_saved(ctx1, rows, splits, backend, probs, rows.shape,
                           operands=operands).save(ctx1)
        return y, [outputs, ()]


class BackwardFC2Combine(FusedOperation):
    """Fused backward of ``fc2 -> Combine`` (see module docstring).

    Shapes: grad_output (T, H_out) -> the gradient of fc2's input (R, in_features).
    """

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        fc2, combine = self.basic_ops
        ctx2, ctx_c = basic_op_ctxs
        saved = GroupedLinearSaved.load(ctx2)
        dy = rows_for(combine.grad_rows(ctx_c, grad_output), saved.backend, ("dgrad", "wgrad"))
        fc2.record_row_gather(saved.backend, ("dgrad", "wgrad"))
        dgrad, grads, _ = GroupedLinear.backward_math(saved, dy, ctx2.input_requires_grad)
        if dgrad is not None:
            dgrad = as_shape(dgrad, saved.in_shape)
        return dgrad, [grads, []], [[None], [None, None]]


def _next(ops: list[FusibleOperation], i: int) -> FusibleOperation | None:
    return ops[i + 1] if i + 1 < len(ops) else None


def _note(info: PlanInfo, op: BasicOperation, reason: str) -> None:
    info.note(f"op {info.index(op)} ({op.describe()}): {reason}")


def fuse_permute_fc1_forward(ops: list[FusibleOperation], *, recipe: Any = None,
                             info: PlanInfo) -> list[FusibleOperation]:
    """Forward-only fusion: ``Permute -> GroupedLinear`` becomes :class:`ForwardPermuteFC1`;
    ``Permute -> ForwardGroupedMLP`` (fc1 already in the grouped-MLP forward) becomes one
    ``ForwardGroupedMLP`` over ``[permute, fc1, act, fc2]``."""
    out: list[FusibleOperation] = []
    i = 0
    while i < len(ops):
        op, nxt = ops[i], _next(ops, i)
        if (fusible_as(op, Permute) is None and isinstance(nxt, ForwardGroupedMLP)
                and len(nxt.basic_ops) == 3):
            reason = permute_fc1_unsupported_reason(op, nxt.basic_ops[0], info)
            if reason is None:
                out.append(ForwardGroupedMLP([op, *nxt.basic_ops]))
                i += 2
                continue
            _note(info, op, reason)
            out.append(op)
            i += 1
            continue
        window, reason = match_window(ops, i, PERMUTE_FC1)
        if window is not None:
            reason = permute_fc1_unsupported_reason(*window, info)
            if reason is None:
                out.append(ForwardPermuteFC1(window))
                i += 2
                continue
        if reason is not None:
            _note(info, op, reason)
        out.append(op)
        i += 1
    return out


def fuse_fc2_combine_backward(ops: list[FusibleOperation], *, recipe: Any = None,
                              info: PlanInfo) -> list[FusibleOperation]:
    """Backward-only fusion: ``GroupedLinear -> Combine`` becomes :class:`BackwardFC2Combine`;
    ``BackwardGroupedMLP -> Combine`` one ``BackwardGroupedMLP`` over
    ``[fc1, act, fc2, combine]``."""
    out: list[FusibleOperation] = []
    i = 0
    while i < len(ops):
        op, nxt = ops[i], _next(ops, i)
        if (isinstance(op, BackwardGroupedMLP) and len(op.basic_ops) == 3 and nxt is not None
                and fusible_as(nxt, Combine) is None):
            fc2 = op.basic_ops[2]
            reason = fc2_combine_unsupported_reason(fc2, nxt, info)
            if reason is None:
                out.append(BackwardGroupedMLP([*op.basic_ops, nxt]))
                i += 2
                continue
            _note(info, fc2, reason)
            out.append(op)
            i += 1
            continue
        window, reason = match_window(ops, i, FC2_COMBINE)
        if window is not None:
            reason = fc2_combine_unsupported_reason(*window, info)
            if reason is None:
                out.append(BackwardFC2Combine(window))
                i += 2
                continue
            _note(info, op, reason)
        out.append(op)
        i += 1
    return out


register_forward_fusion(fuse_permute_fc1_forward, name="permute_fc1_forward")
register_backward_fusion(fuse_fc2_combine_backward, name="fc2_combine_backward")
