"""Whether the fused grouped MLP's backward runs fc2's dgrad with the SwiGLU backward in its
epilogue.

``kernels/dgrad_dswiglu_triton.py`` computes fc2's dgrad da and, in the same launch, the
(Scaled)SwiGLU backward of it: dh, the recomputed activation output a (fc2's wgrad input) and
the probs gradient; dh and a bit for bit what fc2's persistent Triton dgrad followed by the
Triton SwiGLU backward produce (so dx, dW1 and dW2 downstream are the two launches' too), the
probs gradient within fp32 summation order of it (a deterministic two-step sum). The backward
(``BackwardGroupedMLP``) takes it when
:func:`fc2_dgrad_epilogue_reason` returns ``None``:

* ``TE_OPS_FC2_DSWIGLU_EPILOGUE`` is not ``0``;
* no recipe (fc2's dgrad would read quantized operands) and no bias on fc1 or fc2 (the plain
  block; neither bias enters this dataflow, but the combination is not measured or tested);
* fc2's dgrad runs in the persistent many-rows kernel (``"dgrad" in backend.large_kinds``:
  SM90 bf16 at >= 32 rows per group under auto, or the forced ``triton`` backend at >= 512),
  whose bits the fused launch gives;
* the activation runs in Triton (halves layout, contiguous; ``glu_interleave_size`` unset);
* under ``auto`` (the default): at least :data:`AUTO_MIN_ROWS_PER_GROUP` rows per group on
  average (padding rows counted; the measured rule, docs/benchmarks.md "fc2 dgrad with the
  dSwiGLU in its epilogue": never so far, the fused launch measured 0.57-0.74x the two
  launches); ``1`` takes it wherever it can run.

Which kernel runs the fused launch (:func:`dswiglu_kernel`, ``TE_OPS_FC2_DSWIGLU_KERNEL``):
under ``auto`` the warp-specialized Gluon kernel (``kernels/dgrad_dswiglu_gluon.py``; the
same bits: dh and a the two launches', dprobs the same deterministic partial sums) where it
can run (SM90, Triton's Gluon API, TMA-aligned operands), else the persistent Triton one.
Measured (docs/benchmarks.md "fc2 dgrad + dSwiGLU in a warp-specialized Gluon epilogue"): the Gluon kernel 1.14-1.30x the Triton fused kernel at the three issue-10 shapes,
but still 0.73-0.93x the two launches, so ``auto`` of ``TE_OPS_FC2_DSWIGLU_EPILOGUE`` stays
off.

The saved context does not change (``SwiGLUSaved`` holds h, ``GroupedLinearSaved`` fc2's
weights), so fused and unfused halves still pair in any combination.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import env
from ..basic.grouped_linear import stacked
from ..basic.swiglu import FC2_EPILOGUE
from ..kernels import dgrad_dswiglu_gluon, dgrad_dswiglu_triton
from ..shapes import as_shape
from .fc1_epilogue import not_cuda_note

__all__ = ["fc2_dgrad_epilogue_reason", "fc2_dgrad_dswiglu", "AUTO_MIN_ROWS_PER_GROUP",
           "dswiglu_kernel", "run_dgrad_dswiglu"]

_KIND = FC2_EPILOGUE

#: ``TE_OPS_FC2_DSWIGLU_EPILOGUE=auto`` takes the fused launch at this many rows per group on
#: average or more (padding included; ``float("inf")``: never). Never, for now: measured
#: against the two launches with ``benchmarks/large_gemm_triton.py --gemms fc2_dswiglu`` on
#: the H200 (2026-11-30, docs/benchmarks.md "fc2 dgrad with the dSwiGLU in its epilogue") it
#: ran at 0.64-0.69x at E8 T16384 H4096 FF14336 (2048 rows per group), 0.64-0.71x at E32
#: T32768 H7168 FF2048 (1024), 0.74x at E128 T65536 H2048 FF768 (512) and 0.57x at E128
#: T16384 (128), best launch config of each; the epilogue's h loads and dh / a stores do not
#: overlap the GEMM (one program per SM, no warp specialization on SM90 in Triton 3.6). The
#: warp-specialized Gluon kernel (an earlier change, docs/benchmarks.md "fc2 dgrad + dSwiGLU in a
#: warp-specialized Gluon epilogue") measured 0.73x (E8), 0.76x (E32) and 0.93x (E128) the
#: two launches: still never.
AUTO_MIN_ROWS_PER_GROUP: float = float("inf")


def fc2_dgrad_epilogue_reason(backend2: Any, backend_act: Any, recipe: Any, has_bias: bool,
                              interleave: int | None, rows_per_group: float,
                              device: torch.device | None = None) -> str | None:
    """Why fc2's dgrad and the activation backward run as two launches (``None``: one).

    ``backend2``: fc2's ``BackendChoice`` (saved by the forward); ``backend_act``: the
    activation's ``ActivationChoice`` (``None``: not known yet, checked last);
    ``has_bias``: fc1 or fc2 has a bias; ``rows_per_group``: the call's rows (padding
    included) over groups; ``device``: the call's device (named in the reason where it is not
    CUDA).

    Raises
    ------
    ValueError
        ``TE_OPS_FC2_DSWIGLU_EPILOGUE`` is not one of auto, 0, 1 (names the variable).
    """
    mode = env.read("TE_OPS_FC2_DSWIGLU_EPILOGUE")
    if mode == "0":
        return "TE_OPS_FC2_DSWIGLU_EPILOGUE=0"
    if device is not None and device.type != "cuda":  # the first reason off CUDA
        return (f"fc2's dgrad does not run in the persistent many-rows Triton kernel (backend "
                f"{backend2.name}{not_cuda_note(device)})")
    if recipe is not None:
        return "a recipe (fc2's dgrad reads quantized operands)"
    if has_bias:
        return "fc1 or fc2 has a bias (not measured with the fused launch)"
    if "dgrad" not in backend2.large_kinds:
        return (f"fc2's dgrad does not run in the persistent many-rows Triton kernel (backend "
                f"{backend2.name}, large_kinds {list(backend2.large_kinds)})")
    if interleave is not None:
        return f"glu_interleave_size={interleave} (the fused kernel takes the halves layout)"
    if backend_act is not None and backend_act.name != "triton":
        return f"the activation runs in {backend_act.name} ({backend_act.reason})"
    limit = AUTO_MIN_ROWS_PER_GROUP
    if mode == "auto" and rows_per_group < limit:
        return (f"{rows_per_group:g} rows per group < AUTO_MIN_ROWS_PER_GROUP={limit:g} "
                "(measured no faster than the two launches there; "
                "TE_OPS_FC2_DSWIGLU_EPILOGUE=1 takes it)")
    return None


def dswiglu_kernel(dy: torch.Tensor, weights: torch.Tensor, h: torch.Tensor
                   ) -> tuple[str, str]:
    """``("gluon" | "triton", why)``: the kernel of the fused launch for these operands
    (``TE_OPS_FC2_DSWIGLU_KERNEL``; module docstring). Shapes: dy (T, N), weights (G, N, F),
    h (T, 2F).

    Raises
    ------
    RuntimeError
        ``TE_OPS_FC2_DSWIGLU_KERNEL=gluon`` where the Gluon kernel cannot run (the reason).
    ValueError
        The variable is not one of auto, triton, gluon (names the variable).
    """
    mode = env.read("TE_OPS_FC2_DSWIGLU_KERNEL")
    if mode == "triton":
        return "triton", "forced by TE_OPS_FC2_DSWIGLU_KERNEL=triton"
    why = dgrad_dswiglu_gluon.gluon_dswiglu_unsupported_reason(dy, weights, h)
    if why is not None and mode == "gluon":
        raise RuntimeError(f"TE_OPS_FC2_DSWIGLU_KERNEL=gluon cannot run: {why}")
    if why is not None:
        return "triton", f"the Gluon kernel cannot run: {why}"
    return "gluon", "measured 1.14-1.30x the Triton fused kernel"


def run_dgrad_dswiglu(dy: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                      h: torch.Tensor, probs: torch.Tensor | None, write_output: bool = True,
                      grad_into_input: bool = False, kernel: str | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The fused launch in ``kernel`` (:func:`dswiglu_kernel`'s choice when ``None``):
    ``dgrad_dswiglu_gluon.gluon_dgrad_dswiglu`` or ``dgrad_dswiglu_triton
    .large_dgrad_dswiglu`` (the same contract, shapes and errors)."""
    if kernel is None:
        kernel = dswiglu_kernel(dy, weights, h)[0]
    fn = (dgrad_dswiglu_gluon.gluon_dgrad_dswiglu if kernel == "gluon"
          else dgrad_dswiglu_triton.large_dgrad_dswiglu)
    return fn(dy, weights, offsets, h, probs, write_output=write_output,
              grad_into_input=grad_into_input)


def fc2_dgrad_dswiglu(fc1: Any, act: Any, fc2: Any, saved2: Any, saved_act: Any,
                      dy2d: torch.Tensor, recipe: Any, need_out: bool
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """``(dh over h, dprobs | None, activation output | None)`` from the fused launch, or
    ``None`` when it does not apply (the reason is recorded for ``explain()`` on the
    activation op; the caller then runs fc2's dgrad and the activation backward).

    ``saved2``: fc2's ``GroupedLinearSaved``; ``saved_act``: the activation's ``SwiGLUSaved``
    (h is read from it, or recomputed, only when the fused launch runs); ``need_out``: fc2's
    wgrad needs the activation output (the forward did not save fc2's input).

    Shapes: dy2d (rows, H) -> dh like h (..., 2F), dprobs like probs, output (rows, F).
    """
    splits = saved2.splits
    rows_per_group = splits.num_rows / max(splits.num_groups, 1)
    why = fc2_dgrad_epilogue_reason(saved2.backend, saved_act.backend, recipe,
                                    fc1.has_bias or fc2.has_bias, act.glu_interleave_size,
                                    rows_per_group, dy2d.device)
    if why is not None:
        act.record_dispatch(_KIND, f"not used: {why}")
        return None
    weights = (saved2.weights_view if saved2.weights_view is not None
               else stacked(saved2.weights, saved2.single))
    h = saved_act.input()  # saved, or fc1's GEMM re-run (recompute_input)
    h2d = as_shape(h, (dy2d.shape[0], 2 * fc2.in_features))
    kernel, kernel_why = dswiglu_kernel(dy2d, weights, h2d)
    kind = "Triton" if kernel == "triton" else "warp-specialized Gluon"
    act.record_dispatch(_KIND, f"one {kind} launch for fc2's dgrad and the activation "
                        f"backward ({kernel_why})")
    probs = saved_act.probs
    p1d = None if probs is None else as_shape(probs, (dy2d.shape[0],))
    dh, dp, out = run_dgrad_dswiglu(dy2d, weights, splits.offsets, h2d, p1d,
                                    write_output=need_out, grad_into_input=True, kernel=kernel)
    torch.autograd.graph.increment_version(h)
    dh = as_shape(dh, tuple(h.shape))
    if dp is not None:
        dp = as_shape(dp, tuple(probs.shape))
    return dh, dp, out
