"""Fused grouped MLP: ``GroupedLinear (fc1) -> SwiGLU / ScaledSwiGLU -> GroupedLinear (fc2)``.

Two fused ops, registered as a forward-only and a backward-only fusion, each usable with the
other's unfused half because both read and write the basic ops' one saved-context layout
(``GroupedLinearSaved``, ``SwiGLUSaved``; see docs/saved_context.md).

What each saves over the unfused chain
--------------------------------------
Forward (:class:`ForwardGroupedMLP`):

* split sizes are validated and offsets / per-row group ids computed once for both GEMMs
  (unfused: once per GroupedLinear);
* fc2's input (the activation output, tokens x ffn elements) is *not saved*: fc2's context
  says to recompute it from the activation's saved input, bit-identically. Unfused saves it.
  Under FP8 current scaling on CUDA it is not even made in the input's dtype: one kernel
  writes fprop's row-wise FP8 copy of it straight from the activation's input
  (``quantization/fp8_swiglu.py``; same bytes).

Backward (:class:`BackwardGroupedMLP`):

* fc2's dgrad runs first, then one activation-backward pass that also writes the activation
  output (fc2's wgrad input, when the forward did not save it): the activation is read once
  (unfused: once by the recompute and once by the activation backward; on CUDA that is one
  Triton kernel instead of two);
* fc1 and fc2 share one set of split tensors and their cached padding mask and one-hot matrix.

With the MoE layer's routing (``te_ops/fused/moe_routing.py``) the forward op may also cover
the ``Permute`` before fc1 (fc1 reads the tokens through the row index, its context keeps the
index instead of the permuted rows) and the backward op the ``Combine`` after fc2 (fc2's dgrad
and wgrad read the output gradient through the row index).

``benchmarks/memory_report.py`` measures saved bytes and op counts of both.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..basic.grouped_linear import GroupedLinear, GroupedLinearSaved, check_probs
from ..basic.moe import Permute
from ..basic.swiglu import ScaledSwiGLU, SwiGLU, SwiGLUSaved, swiglu_backward, swiglu_forward
from ..fuser import PlanInfo, match_window, register_backward_fusion, register_forward_fusion
from ..gemm import RowGather, rows_for, rules
from ..gemm.dispatch import probe_settled
from ..gemm import registry as gemm_registry
from ..op import FusedOperation, FusibleOperation, fed_from
from ..quantization.autocast import check_operand_dtype, swiglu_output_operand
from ..shapes import as_shape, rows_2d
from ..tracing import tracing
from .fc1_epilogue import fc1_swiglu_choice, fc1_swiglu_forward
from .fc1_recompute import fused_forward_recompute, note_plan

__all__ = [
    "ForwardGroupedMLP",
    "BackwardGroupedMLP",
    "grouped_mlp_unsupported_reason",
    "fuse_grouped_mlp_forward",
    "fuse_grouped_mlp_backward",
]

#: Most call kinds (device, dtype, rows, ...) one fused forward keeps its choices for.
MAX_CHOICES = 64

_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FUSED_DEVICES = ("cpu", "cuda", "meta")


#: What the grouped MLP fusions match: exact types (or subclasses declaring ``fuses_as``).
GROUPED_MLP_PATTERN = (
    ("fc1", GroupedLinear),
    ("the activation", (SwiGLU, ScaledSwiGLU)),
    ("fc2", GroupedLinear),
)


#: Warned (once per plan: plans are cached) when fc1 and fc2 get two split-size tensors.
SPLIT_COPIES_WARNING = (
    "fc1 and fc2 of a GroupedLinear -> SwiGLU -> GroupedLinear chain got their split sizes as "
    "two different tensor objects, so the fused grouped MLP is not used (telling whether two "
    "device tensors hold equal values would need a host sync). If they hold the same sizes, "
    "pass the same tensor object to both (not a .clone() or a copy)."
)


def grouped_mlp_unsupported_reason(fc1: GroupedLinear, act: SwiGLU, fc2: GroupedLinear,
                                   info: PlanInfo, *, backward: bool = False) -> str | None:
    """Why ``fc1 -> act -> fc2`` cannot take the fused grouped MLP (``None`` when it can).

    Checks: same number of groups; ``fc1.out_features == 2 * fc2.in_features``; fc1 and fc2
    fed by the same split sizes (the same tensor object, or equal host lists); dtype in
    fp32/bf16/fp16; device cpu/cuda/meta; for the backward, all three ops need grad.
    """
    if fc1.num_groups != fc2.num_groups:
        return f"fc1 has {fc1.num_groups} groups, fc2 has {fc2.num_groups}"
    if fc1.out_features != 2 * fc2.in_features:
        return (f"fc1.out_features={fc1.out_features} != 2 * fc2.in_features="
                f"{2 * fc2.in_features}")
    if info.dtype is None:
        return "input not known yet (planned before the first call)"
    if info.dtype not in _FUSED_DTYPES:
        return f"dtype {info.dtype} is not one of {list(_FUSED_DTYPES)}"
    if info.device.type not in _FUSED_DEVICES:
        return f"device type {info.device.type} is not one of {list(_FUSED_DEVICES)}"
    i1, i2 = info.index(fc1), info.index(fc2)
    s1, s2 = info.extra_inputs[i1][0], info.extra_inputs[i2][0]
    if s1 is None or s2 is None:  # explain(x) / plan(x) without the extra inputs
        return "split sizes not known (planned without the extra inputs: pass them too)"
    if not info.same_source(s1, s2):
        if isinstance(s1, torch.Tensor) and isinstance(s2, torch.Tensor) and not backward:
            warnings.warn(SPLIT_COPIES_WARNING, UserWarning, stacklevel=2)
        return "fc1 and fc2 split sizes are not the same source (pass one tensor or equal lists)"
    if backward and not all(info.requires_grad[i] for i in range(i1, i2 + 1)):
        return "not every op of the chain takes part in backward"
    return None


def _fuse(ops: list[FusibleOperation], info: PlanInfo, fused_cls: type, backward: bool
          ) -> list[FusibleOperation]:
    out: list[FusibleOperation] = []
    i = 0
    while i < len(ops):
        op = ops[i]
        window, reason = match_window(ops, i, GROUPED_MLP_PATTERN)
        if window is not None:
            reason = grouped_mlp_unsupported_reason(*window, info, backward=backward)
            if reason is None:
                out.append(fused_cls(window))
                i += 3
                continue
        if reason is not None:
            info.note(f"op {info.index(op)} ({op.describe()}): {reason}")
        out.append(op)
        i += 1
    if not backward:
        note_plan(out, info)  # SwiGLU(recompute_input=True) the forward will not honour
    return out


def fuse_grouped_mlp_forward(ops, *, recipe: Any = None, info: PlanInfo):
    """Forward-only fusion: replace each matching chain with :class:`ForwardGroupedMLP`."""
    return _fuse(ops, info, ForwardGroupedMLP, backward=False)


def fuse_grouped_mlp_backward(ops, *, recipe: Any = None, info: PlanInfo):
    """Backward-only fusion: replace each matching chain with :class:`BackwardGroupedMLP`."""
    return _fuse(ops, info, BackwardGroupedMLP, backward=True)


class ForwardGroupedMLP(FusedOperation):
    """Fused forward of ``fc1 -> (Scaled)SwiGLU -> fc2`` (see module docstring), or of
    ``Permute -> fc1 -> (Scaled)SwiGLU -> fc2`` (basic ops ``[permute, fc1, act, fc2]``, made
    by the ``permute_fc1_forward`` fusion): fc1 then reads the tokens through the permute's
    row index (:meth:`te_ops.basic.moe.Permute.route`) and the permute's extra outputs feed
    the three ops.

    Shapes: input (..., H) (with the permute: (T, H) tokens) -> output (..., H_out) (with the
    permute: (R, H_out) rows); extra inputs as the basic ops take them (``split_sizes[,
    probs]``, ``[probs]``, ``split_sizes[, probs]``; the permute's top-k ids and probs).
    """

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, recipe=None):
        permute_outputs = None
        if isinstance(self.basic_ops[0], Permute):
            permute = self.basic_ops[0]
            input_, permute_outputs = permute.route(basic_op_ctxs[0], input_,
                                                    basic_op_extra_inputs[0])
            basic_op_ctxs = basic_op_ctxs[1:]
            basic_op_extra_inputs = fed_from(permute, permute_outputs, self.basic_ops[1:],
                                             basic_op_extra_inputs[1:])
        y, outputs = self._forward(basic_op_ctxs, input_, basic_op_extra_inputs, recipe)
        return y, outputs if permute_outputs is None else [permute_outputs, *outputs]

    def _choices(self, x2d: Any, splits: Any, recipe: Any) -> tuple[Any, Any, Any]:
        """fc1's GEMM backend, the activation's backend where fc1's fprop and the activation
        run as one launch (else ``None``), and fc2's GEMM backend, with their ``explain()``
        records. They depend on the call's device, dtype, split-size kind, rows and groups,
        the rules table and the kernel registry, and on what the plan is keyed on (recipe,
        ``TE_OPS_*`` values, which ops need grad): so this op, which belongs to one plan,
        keeps them per such call kind (at most :data:`MAX_CHOICES`) and a repeated call
        replays the records instead of asking the dispatch again (not while tracing: a
        traced row count is symbolic)."""
        fc1, act, fc2 = self.basic_ops[-3:]
        ops = (fc1, act, fc2)
        key = memo = None
        if not tracing():
            key = (x2d.device, x2d.dtype, splits.on_device, splits.num_rows,
                   splits.num_groups, isinstance(x2d, RowGather), rules.VERSION[0],
                   gemm_registry.VERSION[0], act.glu_interleave_size)
            memo = self.__dict__.setdefault("_choice_memo", {})
            hit = memo.get(key)
            if hit is not None:
                for op, records in zip(ops, hit[1]):
                    op.__dict__.setdefault("_dispatch_records", {}).update(records)
                return hit[0]
        # The choices record into fresh dicts, merged below: the records this call kind makes.
        kept = [op.__dict__.pop("_dispatch_records", {}) for op in ops]
        try:
            backend1 = fc1.select_backend(x2d, splits)
            fused_act = fc1_swiglu_choice(fc1, act, x2d, splits, backend1, recipe)
            backend2 = fc2.select_backend(x2d, splits)  # fc2's input: x's dtype and device
        finally:
            made = [op.__dict__.pop("_dispatch_records", {}) for op in ops]
            for op, old, new in zip(ops, kept, made):
                old.update(new)
                op.__dict__["_dispatch_records"] = old
        choices = (backend1, fused_act, backend2)
        if memo is not None and probe_settled(x2d.device, x2d.dtype):
            if len(memo) >= MAX_CHOICES:
                memo.clear()
            memo[key] = (choices, made)
        return choices

    def _forward(self, basic_op_ctxs, input_, basic_op_extra_inputs, recipe):
        """fc1 -> act -> fc2 on ``input_``, a tensor or a ``RowGather`` of fc1's input rows."""
        fc1, act, fc2 = self.basic_ops[-3:]
        ctx1, ctx_act, ctx2 = basic_op_ctxs
        ex1, ex_act, ex2 = basic_op_extra_inputs
        gathered = isinstance(input_, RowGather)
        # The unfused ops' input checks first, in their order (fc1's input, under a recipe its
        # dtype, then fc2's input: the activation's output has the input's dtype and device).
        fc1.check_input(input_.src if gathered else input_)
        if recipe is not None:
            check_operand_dtype(recipe, "input", input_)
        fc2.check_input_dtype(input_.dtype, input_.device)
        # Under a recipe, the weights' quantize kernels next: they need no split sizes, so
        # the GPU runs them (about 1.5 ms on E8 H4096 FF14336, H200) while the host builds the
        # split and layout tensors, a stretch it otherwise sits idle through (profile in
        # docs/recipes.md, fp8q).
        w_ops1 = w_ops2 = None
        if recipe is not None:
            w_ops1 = fc1.forward_weight_operand(ctx1, recipe)
            w_ops2 = fc2.forward_weight_operand(ctx2, recipe)
        splits = fc1.prepare_splits(input_.src if gathered else input_, ex1[0], checked=True,
                                    num_rows=input_.shape[0] if gathered else None)
        rows = splits.num_rows
        lead = tuple(input_.shape[:-1])
        # Every probs an op takes is checked (a None one raises, as on the unfused path).
        probs1, probs_act, probs2 = (
            check_probs(ex[i], rows, input_.device, name, lead_shape=lead) if takes else None
            for name, ex, i, takes in (("fc1 probs", ex1, 1, fc1.scale_bias),
                                       ("probs", ex_act, 0, isinstance(act, ScaledSwiGLU)),
                                       ("fc2 probs", ex2, 1, fc2.scale_bias)))

        x2d = input_ if gathered else rows_2d(input_, fc1.in_features)
        backend1, fused_act, backend2 = self._choices(x2d, splits, recipe)
        ops1 = fc1.forward_operands(ctx1, x2d, splits, recipe, weight_operand=w_ops1)
        # At decode sizes fc1's fprop and the activation run as one Triton launch (same bits
        # and saved layout; fused/fc1_epilogue.py says where); else two.
        if fused_act is None:
            h = fc1.forward_math(x2d, splits, backend1, probs1, recipe, ops1)
        else:
            h, a_epilogue = fc1_swiglu_forward(
                act, x2d, ops1[1], splits, backend1,
                None if probs_act is None else as_shape(probs_act, (rows,)))
            backend_act = fused_act
            fc1._record_recipe(recipe, x2d, backend1)  # as forward_math: drop a stale note
            fc1.record_row_gather(backend1, ("fprop", "wgrad") if gathered else ())
        h = as_shape(h, (*lead, fc1.out_features))
        act.check_input(h)
        if probs_act is not None:
            probs_act = as_shape(probs_act, lead)
        if fused_act is None:
            backend_act = act.select_backend(h)
        # fc2's input is recomputed in backward when the activation saves its input: no
        # column-wise copy of it here then, and under a recipe with a kernel for it
        # (quantization/fp8_swiglu.py) fprop's row-wise copy comes straight from h: the
        # activation output itself is not made.
        a_q = None
        if ctx_act.requires_grad and backend_act.name == "triton":
            a_q = swiglu_output_operand(recipe, rows_2d(h, fc1.out_features),
                                        None if probs_act is None else as_shape(probs_act,
                                                                                (rows,)))
        a2d = None
        if fused_act is not None:
            a2d = a_epilogue
        elif a_q is None:
            a = swiglu_forward(h, act.glu_interleave_size, probs_act, backend_act)
            a2d = as_shape(a, (rows, fc2.in_features))
        a_shape = (*lead, fc2.in_features)
        like_a = h if a2d is None else a2d  # the activation output's dtype and device
        ops2 = fc2.forward_operands(ctx2, a2d, splits, recipe,
                                    save_input=not ctx_act.requires_grad, weight_operand=w_ops2,
                                    input_operand=a_q)
        y = fc2.forward_math(like_a, splits, backend2, probs2, recipe, ops2)

        saved1 = None
        if ctx1.requires_grad:
            saved1 = fc1.make_saved(ctx1, x2d, splits, backend1, probs1, input_.shape,
                                    recipe=recipe, operands=ops1)
            saved1.save(ctx1)
        if ctx_act.requires_grad:  # h, or with recompute_input a way to re-run fc1's GEMM
            redo_h = fused_forward_recompute(act, ctx1, saved1, recipe, tuple(h.shape))
            SwiGLUSaved(h if redo_h is None else None, probs_act, backend_act,
                        redo_h).save(ctx_act)
        if ctx2.requires_grad:
            recompute = None
            if ctx_act.requires_grad:
                def recompute() -> torch.Tensor:
                    return act.recompute_output(SwiGLUSaved.load(ctx_act))
            fc2.make_saved(ctx2, None if recompute else a2d, splits, backend2, probs2, a_shape,
                           recompute_x=recompute, recipe=recipe, operands=ops2).save(ctx2)
        return as_shape(y, (*lead, fc2.out_features)), [(), (), ()]


class BackwardGroupedMLP(FusedOperation):
    """Fused backward of ``fc1 -> (Scaled)SwiGLU -> fc2`` (see module docstring), or of
    ``fc1 -> (Scaled)SwiGLU -> fc2 -> Combine`` (basic ops ``[fc1, act, fc2, combine]``, made
    by the ``fc2_combine_backward`` fusion): fc2's GEMMs then read the output gradient
    through the combine's row index (:meth:`te_ops.basic.moe.Combine.grad_rows`).

    Shapes: grad_output (..., H_out) (with the combine: (T, H_out)) -> the gradient of fc1's
    input (..., H)."""

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        fc1, act, fc2 = self.basic_ops[:3]
        ctx1, ctx_act, ctx2 = basic_op_ctxs[:3]
        combine = self.basic_ops[3] if len(self.basic_ops) == 4 else None
        s1 = GroupedLinearSaved.load(ctx1)
        sa = SwiGLUSaved.load(ctx_act)
        s2 = GroupedLinearSaved.load(ctx2)

        # The gate guarantees fc1 and fc2 share one split-size source: share the derived
        # tensors (padding mask, one-hot for bias grads) instead of building them twice.
        s2.splits = s1.splits
        if combine is None:
            dy2d = rows_2d(grad_output, fc2.out_features)
        else:  # no fc2 bias, no recipe (the fusion's gate): the GEMMs take the gather
            dy2d = rows_for(combine.grad_rows(basic_op_ctxs[3], grad_output), s2.backend,
                            ("dgrad", "wgrad"))
            fc2.record_row_gather(s2.backend, ("dgrad", "wgrad"))
        # Order: fc2 dgrad, then ONE activation-backward pass that also yields the activation
        # output when the forward did not save fc2's input, then fc2's weight grads with it.
        dy_q2 = GroupedLinear.quantize_grad_output(s2, dy2d, True)  # both copies, one go
        need_out = s2.x is None and s2.recompute_x is not None
        dgrad2 = GroupedLinear.dgrad_math(s2, dy2d, dy_q2)
        # The activation's input is dead after this pass, but the autograd node holds it
        # until the whole backward ends: the activation backward (Triton kernel or torch
        # path) writes dh over it (one (T, 2FF) buffer less at the peak; on the CPU the
        # stores hit lines the pass just read). Its version is bumped, so a second
        # backward through a retained graph raises torch's "modified by an inplace
        # operation" error instead of reading dh. The activation output (fc2's wgrad
        # input) goes over dgrad2, dead after this pass too.
        h = sa.input()  # saved, or fc1's GEMM re-run (recompute_input), after the dgrad
        act_result = swiglu_backward(h, as_shape(dgrad2, s2.in_shape),
                                     act.glu_interleave_size, sa.probs,
                                     with_output=need_out, backend=sa.backend,
                                     grad_into_input=True, output_into_grad=True)
        torch.autograd.graph.increment_version(h)
        h = None
        del dgrad2  # free before fc1's GEMMs
        dh, gprobs_act = act_result[0], act_result[1]
        ctx_act.overwrote_input = True  # dh went over h: a second backward's error says so
        if need_out:
            act_out = act_result[2]
            s2.recompute_x = lambda: act_out
        grads2, gprobs2 = GroupedLinear.param_grads_math(s2, dy2d, dy_q2)
        dy_q2 = None
        s2.recompute_x = None  # free fc2's input (the activation output) before fc1's GEMMs
        act_result = act_out = None
        dh2d = as_shape(dh, (dh.numel() // fc1.out_features, fc1.out_features))
        dgrad1, grads1, gprobs1 = GroupedLinear.backward_math(s1, dh2d, ctx1.input_requires_grad)
        if dgrad1 is not None:
            dgrad1 = as_shape(dgrad1, s1.in_shape)
        extra1 = [None, gprobs1] if fc1.scale_bias else [None]
        extra_act = ([as_shape(gprobs_act, (gprobs_act.numel(),))]
                     if isinstance(act, ScaledSwiGLU) else [])
        extra2 = [None, gprobs2] if fc2.scale_bias else [None]
        if combine is not None:
            return dgrad1, [grads1, [], grads2, []], [extra1, extra_act, extra2, [None, None]]
        return dgrad1, [grads1, [], grads2], [extra1, extra_act, extra2]


register_forward_fusion(fuse_grouped_mlp_forward, name="grouped_mlp_forward")
register_backward_fusion(fuse_grouped_mlp_backward, name="grouped_mlp_backward")
