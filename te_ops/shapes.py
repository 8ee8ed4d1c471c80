"""Shape changes that skip the op when there is nothing to change.

A ``reshape`` / ``view`` to a tensor's own shape still dispatches an aten op and makes a new
view (about a microsecond of host time each; the fused grouped-MLP step would make fifteen
such views per forward+backward: experimental/host_overhead_ab/). These helpers
return the tensor itself in that case; the values are the same either way. A tensor returned
unchanged is not a view, so a saved-for-backward input needs no base-and-restride treatment
(``te_ops.fuser``).
"""

from __future__ import annotations

import torch

__all__ = ["rows_2d", "as_shape"]


def rows_2d(t: torch.Tensor, cols: int) -> torch.Tensor:
    """``t.reshape(-1, cols).contiguous()``: ``t`` itself when it is already a contiguous
    (rows, cols) tensor.

    Shapes: (..., cols) -> (rows, cols), rows = ``t.numel() // cols``; same dtype and device.
    """
    if t.dim() == 2 and t.shape[1] == cols and t.is_contiguous():
        return t
    return t.reshape(-1, cols).contiguous()


def as_shape(t: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """``t.reshape(shape)``: ``t`` itself when it already has ``shape``. (A view whenever the
    strides allow one, as for the contiguous GEMM outputs it is used on; else a copy.)

    Raises
    ------
    RuntimeError
        From ``reshape``, when ``shape`` does not have ``t.numel()`` elements.
    """
    return t if t.shape == shape else t.reshape(shape)
