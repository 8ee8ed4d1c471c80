"""SwiGLU and ScaledSwiGLU activations.

SwiGLU (Shazeer, "GLU Variants Improve Transformer", 2020): the input's last dim is split in
halves ``a`` (first) and ``b`` (second) and ``out = SiLU(a) * b``. This is TransformerEngine's
convention; note that ``torch.nn.functional.glu`` gates the *other* half (``a * sigmoid(b)``).

With ``glu_interleave_size=s`` the last dim is laid out in blocks of ``s``: ``a`` block, ``b``
block, ``a`` block, ... (as TransformerEngine's ``glu_interleave_size``), which lets a
tensor-parallel or block-quantized fc1 keep matching halves together.

Math is done in float32 (float64 for float64 inputs) and the output cast back to the input
dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import swiglu_triton
from ..kernels.swiglu_triton import ActivationChoice
from ..op import BasicOperation, OperationContext
from ..shapes import as_shape
from .grouped_linear import check_probs

__all__ = ["SwiGLU", "ScaledSwiGLU", "SwiGLUSaved", "swiglu_forward", "swiglu_backward"]


def _halves(x: torch.Tensor, interleave: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    if interleave is None:
        return x.chunk(2, dim=-1)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // (2 * interleave), 2, interleave)
    a, b = blocks.unbind(-2)
    half = x.shape[-1] // 2  # explicit: -1 is ambiguous for an empty batch
    return a.reshape(*x.shape[:-1], half), b.reshape(*x.shape[:-1], half)


def _join(da: torch.Tensor, db: torch.Tensor, interleave: int | None) -> torch.Tensor:
    if interleave is None:
        return torch.cat([da, db], dim=-1)
    shape = (*da.shape[:-1], da.shape[-1] // interleave, 1, interleave)
    return torch.cat([da.reshape(shape), db.reshape(shape)], dim=-2).reshape(
        *da.shape[:-1], 2 * da.shape[-1])


def _parts(x: torch.Tensor, interleave: int | None):
    """fp32 ``a``, ``b`` and ``SiLU(a)`` (one ``F.silu`` pass); every SwiGLU path (forward,
    backward, fused recompute) derives its values from these, so they agree bitwise."""
    a, b = _halves(x, interleave)
    compute = torch.promote_types(x.dtype, torch.float32)  # fp64 inputs keep fp64
    a, b = a.to(compute), b.to(compute)
    return a, b, torch.nn.functional.silu(a)


def _output(silu: torch.Tensor, b: torch.Tensor, probs: torch.Tensor | None,
            dtype: torch.dtype, silu_b: torch.Tensor | None = None) -> torch.Tensor:
    out = silu * b if silu_b is None else silu_b  # a fresh tensor either way: scaled in place
    if probs is not None:
        out.mul_(probs.to(out.dtype).unsqueeze(-1))
    return out.to(dtype)


def swiglu_forward(x: torch.Tensor, interleave: int | None = None,
                   probs: torch.Tensor | None = None,
                   backend: ActivationChoice | None = None) -> torch.Tensor:
    """``SiLU(a) * b`` (times ``probs[..., None]``), computed in fp32, cast to ``x.dtype``.

    Shapes: x (..., 2F), probs (...) -> (..., F). On CUDA this runs one Triton kernel
    (``te_ops.kernels.swiglu_triton``) where it applies; ``backend`` is the choice made for
    this call (``swiglu_triton.select_backend``; chosen here when ``None``).
    """
    backend = backend or swiglu_triton.select_backend(x, interleave)
    if backend.name == "triton":
        return swiglu_triton.swiglu_forward(x, probs)
    _, b, silu = _parts(x, interleave)
    return _output(silu, b, probs, x.dtype)


def swiglu_backward(x: torch.Tensor, grad_output: torch.Tensor,
                    interleave: int | None = None, probs: torch.Tensor | None = None,
                    *, with_output: bool = False, backend: ActivationChoice | None = None,
                    grad_into_input: bool = False):
    """Gradients of :func:`swiglu_forward` w.r.t. ``x`` and ``probs``.

    With ``s = sigmoid(a)``: ``d/da SiLU(a) = s * (1 + a * (1 - s))``.

    Shapes: x (..., 2F), grad_output (..., F) -> (grad_x (..., 2F), grad_probs (...) | None).
    With ``with_output=True`` a third result is the forward output, bitwise equal to
    :func:`swiglu_forward`'s, computed from the same intermediates in the same pass (the fused
    grouped-MLP backward uses it as fc2's wgrad input). ``backend``: the forward's choice
    (saved in :class:`SwiGLUSaved`); chosen here when ``None``. ``grad_into_input=True`` lets
    the Triton kernel write ``grad_x`` over ``x`` (``x`` is then lost; the torch path ignores it).
    """
    backend = backend or swiglu_triton.select_backend(x, interleave)
    if backend.name == "triton":
        grad_x, grad_probs, out = swiglu_triton.swiglu_backward(
            x, grad_output, probs, write_output=with_output, grad_into_input=grad_into_input)
        return (grad_x, grad_probs, out) if with_output else (grad_x, grad_probs)
    # Few full passes (the CPU cost): aten's silu_backward computes dy * s * (1 + a * (1 - s))
    # in one kernel; the probs gradient is one fused multiply-and-sum per row.
    a, b, silu = _parts(x, interleave)
    dy = grad_output.to(a.dtype)
    grad_probs = silu_b = None
    if probs is not None:
        silu_b = silu * b
        grad_probs = torch.linalg.vecdot(silu_b, dy).to(probs.dtype)
        dy = dy * probs.to(a.dtype).unsqueeze(-1)
    if interleave is None:  # write both halves in place: no concatenation pass
        half = silu.shape[-1]
        grad_x = torch.empty(*silu.shape[:-1], 2 * half, dtype=a.dtype, device=a.device)
        da = grad_x[..., :half]  # dy * b, then dSiLU applied in place (no temporaries)
        torch.ops.aten.silu_backward.grad_input(torch.mul(dy, b, out=da), a, grad_input=da)
        torch.mul(dy, silu, out=grad_x[..., half:])
        grad_x = grad_x.to(x.dtype)
    else:
        da = torch.ops.aten.silu_backward(dy * b, a)
        grad_x = _join(da, dy * silu, interleave).to(x.dtype)
    if with_output:
        return grad_x, grad_probs, _output(silu, b, probs, x.dtype, silu_b)
    return grad_x, grad_probs


@dataclass
class SwiGLUSaved:
    """The one saved-context layout of SwiGLU / ScaledSwiGLU: the input, the probs and the
    kernels the forward chose (the backward and the recompute run the same)."""

    x: torch.Tensor
    probs: torch.Tensor | None
    backend: ActivationChoice | None = None

    def save(self, ctx: OperationContext) -> None:
        ctx.save_for_backward(self.x, self.probs)
        ctx.swiglu_layout = {"backend": self.backend}

    @classmethod
    def load(cls, ctx: OperationContext) -> SwiGLUSaved:
        x, probs = ctx.saved_tensors
        return cls(x, probs, ctx.swiglu_layout["backend"])


class SwiGLU(BasicOperation):
    """``SiLU(a) * b`` with ``a`` the first half of the last dim and ``b`` the second.

    Parameters
    ----------
    glu_interleave_size : int, optional
        Block size of an interleaved layout (see module docstring); ``None`` or ``0`` for
        halves (as TransformerEngine). May be given positionally: ``ScaledSwiGLU(32)``.

    Shapes
    ------
    input (..., 2F) -> output (..., F), same dtype (fp32 math inside).

    Raises
    ------
    ValueError
        The last dim is odd or not a multiple of ``2 * glu_interleave_size``.
    """

    def __init__(self, glu_interleave_size: int | None = None) -> None:
        super().__init__()
        if glu_interleave_size == 0 and not isinstance(glu_interleave_size, bool):
            glu_interleave_size = None  # TransformerEngine's "no interleave"
        if glu_interleave_size is not None and (
            isinstance(glu_interleave_size, bool) or not isinstance(glu_interleave_size, int)
            or glu_interleave_size < 1
        ):
            raise ValueError(
                "glu_interleave_size must be a positive int, 0 or None, got "
                f"{glu_interleave_size!r}"
            )
        self.glu_interleave_size = glu_interleave_size

    def check_input(self, input_: torch.Tensor) -> None:
        step = 2 * (self.glu_interleave_size or 1)
        if input_.dim() < 1 or input_.shape[-1] % step:
            raise ValueError(
                f"input must have a last dim divisible by {step}, got shape "
                f"{tuple(input_.shape)}"
            )
        if not input_.is_floating_point():
            raise TypeError(f"input must be floating point, got {input_.dtype}")

    def extra_repr(self) -> str:
        return (f"glu_interleave_size={self.glu_interleave_size}"
                if self.glu_interleave_size else "")

    def select_backend(self, input_: torch.Tensor) -> ActivationChoice:
        """Choose the SwiGLU kernels for this call, once (saved in the layout, recorded for
        ``explain()``)."""
        choice = swiglu_triton.select_backend(input_, self.glu_interleave_size)
        self.record_dispatch("activation backend", f"{choice.name} ({choice.reason})")
        return choice

    def dispatch_notes(self, info) -> list[str]:
        if info.device is None or info.device.type != "cuda":
            where = "unknown device" if info.device is None else info.device.type
            return [f"activation backend: torch ({where}; Triton kernels are CUDA-only)"]
        if self.glu_interleave_size is not None:
            return ["activation backend: torch (glu_interleave_size is set)"]
        if swiglu_triton.triton is None:
            return ["activation backend: torch (triton is not installed)"]
        return ["activation backend: triton (one kernel forward, one backward)"]

    def describe(self) -> str:
        il = f"glu_interleave_size={self.glu_interleave_size}" if self.glu_interleave_size else ""
        return f"{type(self).__name__}({il})"

    def op_forward(self, ctx, input_, *, recipe=None):
        self.check_input(input_)
        backend = self.select_backend(input_)
        if ctx.requires_grad:
            SwiGLUSaved(input_, None, backend).save(ctx)
        return swiglu_forward(input_, self.glu_interleave_size, backend=backend)

    def op_backward(self, ctx, grad_output):
        saved = SwiGLUSaved.load(ctx)
        grad_input, _ = swiglu_backward(saved.x, grad_output, self.glu_interleave_size,
                                        backend=saved.backend)
        return grad_input, []

    def recompute_output(self, saved: SwiGLUSaved) -> torch.Tensor:
        """The forward output, recomputed bit-identically from the saved context."""
        return swiglu_forward(saved.x, self.glu_interleave_size, saved.probs, saved.backend)


class ScaledSwiGLU(SwiGLU):
    """``SwiGLU(x) * probs[..., None]``; ``probs`` is an extra input with its own gradient.

    Extra inputs
    ------------
    probs : torch.Tensor
        Shape (tokens,) where tokens = ``input.numel() // input.shape[-1]``, float.

    Raises
    ------
    ValueError / TypeError
        As :class:`SwiGLU`, and ``probs`` of the wrong shape, dtype or device.
    """

    num_extra_inputs = 1

    def extra_input_names(self) -> list[str | None]:
        return ["probs"]

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, recipe=None):
        ctx = basic_op_ctxs[0]
        (probs,) = basic_op_extra_inputs[0]
        self.check_input(input_)
        probs = check_probs(probs, input_.numel() // input_.shape[-1], input_.device,
                            lead_shape=tuple(input_.shape[:-1]))
        probs = as_shape(probs, input_.shape[:-1])
        backend = self.select_backend(input_)
        if ctx.requires_grad:
            SwiGLUSaved(input_, probs, backend).save(ctx)
        return swiglu_forward(input_, self.glu_interleave_size, probs, backend), [()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        saved = SwiGLUSaved.load(basic_op_ctxs[0])
        grad_input, grad_probs = swiglu_backward(saved.x, grad_output, self.glu_interleave_size,
                                                 saved.probs, backend=saved.backend)
        return grad_input, [[]], [[as_shape(grad_probs, (grad_probs.numel(),))]]
