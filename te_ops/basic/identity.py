"""``Identity``: returns its input (a placeholder op that fusions may see through)."""

from __future__ import annotations

from ..op import BasicOperation

__all__ = ["Identity"]


class Identity(BasicOperation):
    """``y = x``. Shapes: any -> the same."""

    def op_forward(self, ctx, input_, *, recipe=None):
        return input_

    def op_backward(self, ctx, grad_output):
        return grad_output, []
