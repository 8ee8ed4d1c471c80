"""The fused grouped MLP's forward with fc1's fprop and the (Scaled)SwiGLU in one launch.

Whether the fused launch runs, and which kernel runs it, is :mod:`te_ops.gemm`'s answer
(:func:`te_ops.gemm.fc1_swiglu_reason`: no recipe, no fc1 bias, fc1's fprop in a Triton kernel,
the activation in Triton, and an ``fc1_swiglu`` row of the rules table holding the call). This
module asks it, records the answer for ``explain()`` on the activation op, and runs the launch.

What the forward saves does not change (``SwiGLUSaved`` holds ``h``; fc2's input is recomputed
in backward), so a forward that took the fused launch pairs with any backward bit-exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from ..basic.swiglu import FC1_EPILOGUE
from ..gemm import fc1_swiglu_launch, fc1_swiglu_reason

__all__ = ["fc1_swiglu_choice", "fc1_swiglu_forward"]

_KIND = FC1_EPILOGUE


def fc1_swiglu_choice(fc1: Any, act: Any, x2d: torch.Tensor, splits: Any, backend1: Any,
                      recipe: Any) -> Any:
    """The activation's backend when fc1's fprop and the activation run as one launch, or
    ``None`` when they do not (the reason is then recorded for ``explain()`` on the activation
    op; the caller runs the two launches). Reads only the call's device, dtype, rows per group
    and fc1's features, so a plan may keep the answer for calls that share them."""
    rows_per_group = splits.num_rows / max(splits.num_groups, 1)
    triton_fprop = "fprop" in backend1.triton_kinds or "fprop" in backend1.large_kinds
    if (recipe is not None or fc1.has_bias or not triton_fprop
            or act.glu_interleave_size is not None):
        why = fc1_swiglu_reason(backend1, None, recipe, fc1.has_bias,
                                act.glu_interleave_size, rows_per_group, x2d.device)
        act.record_dispatch(_KIND, f"not used: {why}")
        return None
    # The activation's backend for an h of this dtype and device (h is always contiguous).
    backend_act = act.select_backend(torch.empty(0, fc1.out_features, device=x2d.device,
                                                 dtype=x2d.dtype))
    why = fc1_swiglu_reason(backend1, backend_act, recipe, fc1.has_bias,
                            act.glu_interleave_size, rows_per_group, x2d.device,
                            features=(fc1.in_features, fc1.out_features), dtype=x2d.dtype)
    if why is not None:
        act.record_dispatch(_KIND, f"not used: {why}")
        return None
    return backend_act


def fc1_swiglu_forward(act: Any, x2d: torch.Tensor, weights: torch.Tensor, splits: Any,
                       backend1: Any, probs: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, a)`` from the fused launch that :func:`fc1_swiglu_choice` chose (the launch's
    note is recorded for ``explain()`` on the activation op).

    Shapes: x2d (rows, in) (or a :class:`~te_ops.gemm.RowGather` of those rows), weights
    (G, 2F, in), probs (rows,) or ``None`` -> h (rows, 2F), a (rows, F).
    """
    h, a, note = fc1_swiglu_launch(backend1, x2d, weights, splits.offsets, probs)
    act.record_dispatch(_KIND, note)
    return h, a
