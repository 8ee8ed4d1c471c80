"""``Bias``: add a learnable vector along the last dim."""

from __future__ import annotations

import torch

from ..op import BasicOperation
from .grouped_linear import check_param_dtype

__all__ = ["Bias"]


class Bias(BasicOperation):
    """``y = x + bias``.

    Parameters
    ----------
    size : int
        Length of ``bias`` (the input's last dim).
    device, dtype :
        Of the parameter; it starts at zero.

    Shapes
    ------
    input (..., size) -> output (..., size); parameter ``bias`` (size,). The bias gradient is
    summed over the rows in float32, or float64 for float64 parameters or gradients.

    Raises
    ------
    ValueError
        ``size`` is not positive, ``dtype`` is not float32, bfloat16, float16 or float64, or
        the input's last dim is not ``size``.
    """

    def __init__(self, size: int, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        self.size = size
        self.bias = torch.nn.Parameter(torch.zeros(size, device=device,
                                                   dtype=check_param_dtype(dtype)))

    def extra_repr(self) -> str:
        return f"size={self.size}"

    def describe(self) -> str:
        return f"Bias({self.size})"

    def op_forward(self, ctx, input_, *, recipe=None):
        if input_.dim() < 1 or input_.shape[-1] != self.size:
            raise ValueError(
                f"input must have last dim size={self.size}, got shape {tuple(input_.shape)}"
            )
        return input_ + self.bias.to(input_.dtype)

    def op_backward(self, ctx, grad_output):
        grad_bias = None
        if self.bias.requires_grad:
            # Summed in at least float32 and at least the parameter's precision (float64 stays
            # float64); float32 / bfloat16 / float16 parameters sum in float32.
            acc = torch.promote_types(torch.promote_types(grad_output.dtype, self.bias.dtype),
                                      torch.float32)
            grad_bias = grad_output.reshape(-1, self.size).to(acc).sum(0).to(self.bias.dtype)
        return grad_output, [grad_bias]
