"""Whether the fused grouped MLP's forward runs fc1's fprop with the SwiGLU in its epilogue.

Two kernels compute fc1's output ``h`` and the (Scaled)SwiGLU output ``a`` in one Triton
launch, each bit for bit what fc1's Triton fprop of the same rows followed by the Triton SwiGLU
kernel produce: ``kernels/grouped_mlp_triton.py`` (few rows per group) and
``grouped_gemm_large_triton.large_fc1_swiglu`` (the persistent many-rows kernel, ``PAIRED``: h
is the persistent fprop's). The forward (``ForwardGroupedMLP``) takes one when :func:`fc1_epilogue_reason` returns ``None``:

* ``TE_OPS_FC1_SWIGLU_EPILOGUE`` is not ``0``;
* no recipe (fc1's fprop would read quantized operands) and no bias on fc1 (the bias is added
  between the GEMM and the activation);
* fc1's fprop runs in Triton: in the few-rows kernel (``"fprop" in backend.triton_kinds``:
  CUDA, bf16 under auto, few rows per group, or the forced ``triton`` backend below its
  ``FORCED_MIN_ROWS_PER_GROUP``; the fused launch is ``grouped_mlp_triton.fc1_swiglu``) or in
  the persistent many-rows kernel (``backend.large_kinds``; the fused launch is
  ``large_fc1_swiglu``, same tiles and k-steps as ``large_fprop``), and the activation runs in
  Triton (halves layout, contiguous; ``swiglu_triton.select_backend``);
* under ``auto`` (the default): in the persistent case at the measured shapes of
  ``fc1_swiglu_gluon.GLUON_FC1_RULE`` (in_features, 2 * ffn, rows per group exactly; SM90,
  bfloat16: under ``TE_OPS_GROUPED_GEMM_BACKEND=triton`` on another GPU or in float16 not),
  where the fused launch is the warp-specialized Gluon kernel ``gluon_fc1_swiglu`` (h
  bitwise the persistent fprop's, a bitwise the Triton SwiGLU's; docs/benchmarks.md, "Gluon
  fc1 + SwiGLU epilogue (stop 17)"), with ``TE_OPS_FC1_SWIGLU_EPILOGUE=1`` too; in the
  few-rows case at most :data:`~te_ops.kernels.grouped_mlp_triton.MAX_ROWS_PER_GROUP` rows per
  group on average (padding rows counted; docs/benchmarks.md, "Epilogue-fused decode
  kernels"); in the persistent case elsewhere never (:data:`LARGE_AUTO`: measured 0.97-0.99x
  the persistent fprop + the Triton SwiGLU pass at 128-2048 rows per group on the H200,
  docs/benchmarks.md, "fc1 + SwiGLU in the persistent kernel's epilogue"). ``1`` takes it
  wherever it can run.

What the forward saves does not change (``SwiGLUSaved`` holds ``h``; fc2's input is recomputed
in backward), so a forward that took the fused launch pairs with any backward bit-exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import env
from ..basic.swiglu import FC1_EPILOGUE
from ..kernels import fc1_swiglu_gluon, grouped_mlp_triton
from ..kernels.grouped_gemm_large_triton import large_fc1_swiglu

__all__ = ["LARGE_AUTO", "fc1_epilogue_reason", "fc1_swiglu_forward", "large_fused_launch",
           "uses_gluon_fc1"]

_KIND = FC1_EPILOGUE

#: Whether ``auto`` takes the persistent kernel's fused launch (``large_fc1_swiglu``) where fc1's
#: fprop runs in the persistent kernel. Off: it measured 0.97-0.99x ``large_fprop`` + the Triton
#: SwiGLU forward (``benchmarks/large_gemm_triton.py --gemms fc1``, H200, 2026-11-30: E8 T16384
#: H4096 FF14336 0.994x, E32 T32768 H7168 FF2048 0.991x, E128 T65536 H2048 FF768 0.992x, E128
#: T16384 0.972x; h and a bitwise the two launches'), so auto keeps the two launches (but at
#: ``fc1_swiglu_gluon.GLUON_FC1_RULE``'s shapes, where the fused launch is the Gluon kernel).
LARGE_AUTO = False


def fc1_epilogue_reason(backend1: Any, backend_act: Any, recipe: Any, has_bias: bool,
                        interleave: int | None, rows_per_group: float,
                        device: torch.device | None = None,
                        features: tuple[int, int] | None = None,
                        dtype: torch.dtype | None = None) -> str | None:
    """Why fc1's fprop and the activation forward run as two launches (``None``: one).

    ``backend1``: fc1's ``BackendChoice``; ``backend_act``: the activation's
    ``ActivationChoice``; ``rows_per_group``: the call's rows (padding included) over groups;
    ``device``: the call's device (named in the reason where it is not CUDA); ``features``:
    fc1's (in_features, out_features), which the Gluon kernel's measured rule
    (``fc1_swiglu_gluon.GLUON_FC1_RULE``) is keyed on, with ``device`` and ``dtype`` (the
    call's input dtype: the rule holds on SM90 in bfloat16 only) (``None``: the rule is not
    consulted).

    Raises
    ------
    ValueError
        ``TE_OPS_FC1_SWIGLU_EPILOGUE`` is not one of auto, 0, 1 (names the variable), or
        ``features`` is given without ``device`` and ``dtype``.
    """
    if features is not None and (device is None or dtype is None):
        raise ValueError(f"features={features} needs the call's device and dtype (the Gluon "
                         f"rule holds on SM90 in bfloat16), got device={device}, dtype={dtype}")
    mode = env.read("TE_OPS_FC1_SWIGLU_EPILOGUE")
    if mode == "0":
        return "TE_OPS_FC1_SWIGLU_EPILOGUE=0"
    if device is not None and device.type != "cuda":  # the first reason off CUDA
        return (f"fc1's fprop does not run in Triton (backend {backend1.name}"
                f"{not_cuda_note(device)})")
    if recipe is not None:
        return "a recipe (fc1's fprop reads quantized operands)"
    if has_bias:
        return "fc1 has a bias (added between the GEMM and the activation)"
    large = "fprop" in backend1.large_kinds
    if not large and "fprop" not in backend1.triton_kinds:
        return f"fc1's fprop does not run in Triton (backend {backend1.name})"
    if interleave is not None:
        return f"glu_interleave_size={interleave} (the fused kernel takes the halves layout)"
    if backend_act.name != "triton":
        return f"the activation runs in {backend_act.name} ({backend_act.reason})"
    if large:
        if features is not None and uses_gluon_fc1(features[0], features[1], rows_per_group,
                                                   device, dtype):
            return None  # measured faster than the two launches (GLUON_FC1_RULE)
        if mode == "auto" and "fprop" in backend1.gluon_kinds:  # GLUON_RULE's shapes
            return (f"fc1's fprop runs in the warp-specialized Gluon kernel (backend "
                    f"{backend1.name}, gluon_kinds: measured faster than the persistent Triton "
                    "kernel at this shape), which the fused launch (large_fc1_swiglu) would "
                    "replace; TE_OPS_FC1_SWIGLU_EPILOGUE=1 takes it")
        if mode == "auto" and not LARGE_AUTO:
            return (f"fc1's fprop runs in the persistent many-rows Triton kernel (backend "
                    f"{backend1.name}, large_kinds), where the fused launch (large_fc1_swiglu, "
                    "same bits) measured 0.97-0.99x that kernel + the Triton SwiGLU pass; "
                    "TE_OPS_FC1_SWIGLU_EPILOGUE=1 takes it")
        return None
    limit = grouped_mlp_triton.MAX_ROWS_PER_GROUP
    if mode == "auto" and rows_per_group > limit:
        return (f"{rows_per_group:g} rows per group > MAX_ROWS_PER_GROUP={limit} (measured no "
                "faster than the two launches there; TE_OPS_FC1_SWIGLU_EPILOGUE=1 takes it)")
    return None


def not_cuda_note(device: torch.device | None) -> str:
    """``"; te_ops' Triton kernels run on CUDA only, this call is on cpu"`` for a device that
    is not CUDA (an empty string else): why a fused Triton launch cannot run there."""
    if device is None or device.type == "cuda":
        return ""
    return f"; te_ops' Triton kernels run on CUDA only, this call is on {device.type}"


def fc1_swiglu_forward(fc1: Any, act: Any, x2d: torch.Tensor, weights: torch.Tensor,
                       splits: Any, backend1: Any, probs: torch.Tensor | None, recipe: Any
                       ) -> tuple[torch.Tensor, torch.Tensor, Any] | None:
    """``(h, a, activation backend)`` from the fused launch, or ``None`` when it does not
    apply (the reason is recorded for ``explain()`` on the activation op; the caller then
    runs the two launches).

    Shapes: x2d (rows, in), weights (G, 2F, in), probs (rows,) or ``None`` -> h (rows, 2F),
    a (rows, F).
    """
    rows_per_group = splits.num_rows / max(splits.num_groups, 1)
    triton_fprop = "fprop" in backend1.triton_kinds or "fprop" in backend1.large_kinds
    if (recipe is not None or fc1.has_bias or not triton_fprop
            or act.glu_interleave_size is not None):
        why = fc1_epilogue_reason(backend1, None, recipe, fc1.has_bias,
                                  act.glu_interleave_size, rows_per_group, x2d.device)
        act.record_dispatch(_KIND, f"not used: {why}")
        return None
    # The activation's backend for an h of this dtype and device (h is always contiguous).
    backend_act = act.select_backend(x2d.new_empty(0, fc1.out_features))
    why = fc1_epilogue_reason(backend1, backend_act, recipe, fc1.has_bias,
                              act.glu_interleave_size, rows_per_group, x2d.device,
                              features=(weights.shape[2], weights.shape[1]), dtype=x2d.dtype)
    if why is not None:
        act.record_dispatch(_KIND, f"not used: {why}")
        return None
    h, a = fc1_swiglu_launch(backend1, act, x2d, weights, splits.offsets, probs)
    return h, a, backend_act


def fc1_swiglu_launch(backend1: Any, act: Any, x2d: torch.Tensor, weights: torch.Tensor,
                      offsets: torch.Tensor, probs: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, a)`` from the fused launch of the kernel fc1's fprop runs in (``backend1``): the
    persistent many-rows one (``large_kinds``) or the few-rows one; recorded on ``act`` for
    ``explain()``. Shapes as :func:`fc1_swiglu_forward`."""
    if "fprop" in backend1.large_kinds:
        why = "off GLUON_FC1_RULE: its measured shapes, SM90, bfloat16"
        if _gluon_shape(x2d, weights):
            # what gluon_fc1_dispatched checks before it launches (on the contiguous x)
            x2d = x2d.contiguous()
            why = fc1_swiglu_gluon.gluon_fc1_unsupported_reason(x2d, weights)
            why = None if why is None else f"the Gluon kernel cannot take the operands: {why}"
        if why is None:
            act.record_dispatch(_KIND, "one launch for fc1's fprop and the activation (the "
                                       "warp-specialized Gluon kernel, gluon_fc1_swiglu: "
                                       "GLUON_FC1_RULE's measured shapes)")
        else:
            act.record_dispatch(_KIND, "one Triton launch for fc1's fprop and the activation "
                                       f"(the persistent many-rows kernel, large_fc1_swiglu; "
                                       f"{why})")
        return large_fused_launch(x2d, weights, offsets, probs)
    act.record_dispatch(_KIND, "one Triton launch for fc1's fprop and the activation")
    return grouped_mlp_triton.fc1_swiglu(x2d, weights, offsets, probs)


def uses_gluon_fc1(in_features: int, out_features: int, rows_per_group: float,
                   device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fused launch where fc1's fprop runs in the persistent kernel is the Gluon
    kernel (``fc1_swiglu_gluon.gluon_fc1_rule``: its measured shapes, on SM90 in bfloat16),
    under any ``TE_OPS_FC1_SWIGLU_EPILOGUE`` but ``0`` (checked by the caller)."""
    return fc1_swiglu_gluon.gluon_fc1_rule(in_features, out_features, rows_per_group, device,
                                           dtype)


def _gluon_shape(x2d: torch.Tensor, weights: torch.Tensor) -> bool:
    return uses_gluon_fc1(weights.shape[2], weights.shape[1],
                          x2d.shape[0] / max(weights.shape[0], 1), x2d.device, x2d.dtype)


def large_fused_launch(x2d: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                       probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, a)`` of the fused launch where fc1's fprop runs in the persistent kernel: the
    Gluon kernel at :func:`uses_gluon_fc1`'s shapes (``gluon_fc1_dispatched``: the persistent
    Triton kernel's fused launch, same bits, where its operands rule it out at run time),
    else ``large_fc1_swiglu``. Shapes as :func:`fc1_swiglu_forward`."""
    if _gluon_shape(x2d, weights):
        return fc1_swiglu_gluon.gluon_fc1_dispatched(x2d, weights, offsets, probs)
    return large_fc1_swiglu(x2d, weights, offsets, probs)
