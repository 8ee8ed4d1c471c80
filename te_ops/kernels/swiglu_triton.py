"""Triton kernels for (Scaled)SwiGLU on CUDA: one pass forward, one pass backward.

The eager PyTorch path (``te_ops.basic.swiglu``) launches about ten elementwise kernels and
materializes fp32 temporaries of the (tokens, 2 * ffn) activation; these kernels read ``x``
(and ``grad_output``) once, keep fp32 values in registers and write the result once. The
backward kernel reduces the ``probs`` gradient over each row inside one program (no atomics,
so it is deterministic) and can also write the forward output, which the fused grouped-MLP
backward uses as fc2's wgrad input.

Math (same as the PyTorch path): ``s = sigmoid(a)``, ``SiLU(a) = a * s``,
``out = SiLU(a) * b * p``; ``d/da SiLU(a) = s * (1 + a * (1 - s))``.

Dispatch: :func:`unsupported_reason` says why a call cannot use these kernels (not CUDA, no
Triton, interleaved layout, dtype, non-contiguous); ``TE_OPS_ACTIVATION_BACKEND`` forces
``torch`` or ``triton``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import env
from ..tracing import tracing
from .triton_launch import cdiv, launch, next_power_of_2

try:  # Triton is optional: CPU-only installs have no use for it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

__all__ = ["ActivationChoice", "select_backend", "unsupported_reason", "use_triton",
           "swiglu_forward", "swiglu_backward"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unsupported_reason(x: torch.Tensor, interleave: int | None) -> str | None:
    """Why the Triton SwiGLU kernels cannot take ``x`` (``None`` when they can)."""
    # The device first: a CPU run must not be told that installing triton would help.
    if x.device.type != "cuda":
        return f"device type {x.device.type} is not cuda"
    if triton is None:
        return "triton is not installed"
    if interleave is not None:
        return "glu_interleave_size is set (the Triton kernels handle the halves layout only)"
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype} is not one of {list(_DTYPES)}"
    if not x.is_contiguous():
        return "input is not contiguous"
    return None


@dataclass(frozen=True)
class ActivationChoice:
    """The SwiGLU kernels picked for a call, and why (saved in the op's layout, so the
    backward runs the same kernels and ``explain()`` reports what ran)."""

    name: str  # "triton" | "torch"
    reason: str


def select_backend(x: torch.Tensor, interleave: int | None) -> ActivationChoice:
    """The SwiGLU kernels for this input (``TE_OPS_ACTIVATION_BACKEND`` decides ties).

    Raises
    ------
    RuntimeError
        ``TE_OPS_ACTIVATION_BACKEND=triton`` where the kernels cannot run; gives the reason.
    """
    forced = env.read("TE_OPS_ACTIVATION_BACKEND")
    if forced == "torch":
        return ActivationChoice("torch", "forced by TE_OPS_ACTIVATION_BACKEND")
    reason = unsupported_reason(x, interleave)
    if forced == "triton" and reason is not None:
        raise RuntimeError(f"TE_OPS_ACTIVATION_BACKEND=triton cannot run: {reason}")
    if reason is not None:
        return ActivationChoice("torch", reason)
    return ActivationChoice("triton", "one kernel forward, one backward")


def use_triton(x: torch.Tensor, interleave: int | None) -> bool:
    """Whether :func:`select_backend` picks the Triton kernels for this input."""
    return select_backend(x, interleave).name == "triton"


if triton is not None:

    @triton.jit
    def _core(a, b):
        sig = 1.0 / (1.0 + tl.exp(-a))
        return sig, a * sig

    @triton.jit
    def _dswiglu(a, b, dy, p, HAS_P: tl.constexpr):
        """The backward of ``out = SiLU(a) * b (* p)`` per element, fp32 in and out:
        ``(d a, d b, out, the probs-gradient term SiLU(a) * b * dy)`` (the last only with
        ``HAS_P``; ``p`` a scalar or a tensor broadcasting against ``a``). The SwiGLU backward
        kernel and the experimental fc2 dgrad kernel with this in its epilogue
        (``experimental/fc2_dgrad_dswiglu/``) share it, so their gradients and ``out`` are
        the same bits."""
        sig, silu = _core(a, b)
        out = silu * b
        dp = out
        if HAS_P:
            out = out * p
            dp = silu * b * dy
            dy = dy * p
        da = dy * b * sig * (1 + a * (1 - sig))
        db = dy * silu
        return da, db, out, dp

    @triton.jit
    def _fwd_kernel(x_ptr, p_ptr, out_ptr, F, HAS_P: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < F
        a = tl.load(x_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
        _, silu = _core(a, b)
        out = silu * b
        if HAS_P:
            out = out * tl.load(p_ptr + row).to(tl.float32)
        tl.store(out_ptr + row * F + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _bwd_kernel(x_ptr, dy_ptr, p_ptr, dx_ptr, dp_ptr, out_ptr, F, HAS_P: tl.constexpr,
                    WRITE_OUT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        p = 1.0
        if HAS_P:
            p = tl.load(p_ptr + row).to(tl.float32)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, F, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < F
            a = tl.load(x_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(x_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * F + cols, mask=mask, other=0.0).to(tl.float32)
            da, db, out, dp = _dswiglu(a, b, dy, p, HAS_P)
            if WRITE_OUT:
                tl.store(out_ptr + row * F + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
            if HAS_P:
                acc += dp
            tl.store(dx_ptr + row * 2 * F + cols, da.to(dx_ptr.dtype.element_ty), mask=mask)
            tl.store(dx_ptr + row * 2 * F + F + cols, db.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_P:
            tl.store(dp_ptr + row, tl.sum(acc, axis=0).to(dp_ptr.dtype.element_ty))


def _block(F: int) -> int:
    return min(1024, next_power_of_2(max(F, 16)))


def swiglu_forward(x: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    """Triton ``SiLU(a) * b (* probs)``. Shapes: x (..., 2F) contiguous, probs (...) -> (..., F).

    Eager calls launch the kernel directly; under a ``torch.compile`` trace the call is the
    ``triton_op`` ``te_ops::swiglu_forward`` (same kernel)."""
    if tracing():
        return torch.ops.te_ops.swiglu_forward(x, probs)
    return _forward(x, probs, _fwd_kernel)


def _forward(x: torch.Tensor, probs: torch.Tensor | None, kernel) -> torch.Tensor:
    F = x.shape[-1] // 2
    rows = x.numel() // max(x.shape[-1], 1)
    out = torch.empty(*x.shape[:-1], F, device=x.device, dtype=x.dtype)
    if rows == 0 or F == 0:
        return out
    block = _block(F)
    p = probs.contiguous() if probs is not None else x
    launch(kernel, (rows, cdiv(F, block)), x, p, out, F, HAS_P=probs is not None,
           BLOCK=block)
    return out


def swiglu_backward(x: torch.Tensor, grad_output: torch.Tensor, probs: torch.Tensor | None,
                    write_output: bool = False, grad_into_input: bool = False):
    """Triton backward. Returns ``(grad_x, grad_probs | None, output | None)``.

    Shapes: x (..., 2F), grad_output (..., F), probs (...); ``grad_probs`` has probs' dtype.
    With ``grad_into_input=True`` ``grad_x`` is written over ``x`` (each program reads a row's
    values before writing that row's gradient), saving one (..., 2F) buffer; ``x`` is lost.
    Under a ``torch.compile`` trace the call is the ``triton_op`` ``te_ops::swiglu_backward``
    (same kernel, ``grad_x`` always a new buffer: a custom op returns no alias of an input).
    """
    if tracing():
        dx, dp, out = torch.ops.te_ops.swiglu_backward(x, grad_output, probs, write_output)
        return dx, (dp if probs is not None else None), (out if write_output else None)
    return _backward(x, grad_output, probs, write_output, grad_into_input, _bwd_kernel)


def _backward(x, grad_output, probs, write_output, grad_into_input, kernel):
    F = x.shape[-1] // 2
    rows = x.numel() // max(x.shape[-1], 1)
    dy = grad_output.contiguous()
    dx = x if grad_into_input else torch.empty_like(x)
    dp = torch.empty_like(probs) if probs is not None else None
    out = torch.empty(*x.shape[:-1], F, device=x.device, dtype=x.dtype) if write_output else None
    if rows == 0 or F == 0:
        if dp is not None:
            dp.zero_()
        return dx.zero_(), dp, out
    p = probs.contiguous() if probs is not None else x
    launch(kernel, (rows,), x, dy, p, dx, dp if dp is not None else x,
           out if out is not None else x, F, HAS_P=probs is not None, WRITE_OUT=write_output,
           BLOCK=_block(F))
    return dx, dp, out


if triton is not None:

    @torch.library.triton_op("te_ops::swiglu_forward", mutates_args={})
    def _swiglu_forward_op(x: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
        """:func:`swiglu_forward` as an op; the body (run on FakeTensors) is also the fake."""
        return _forward(x, probs, torch.library.wrap_triton(_fwd_kernel))

    @torch.library.triton_op("te_ops::swiglu_backward", mutates_args={})
    def _swiglu_backward_op(x: torch.Tensor, grad_output: torch.Tensor,
                            probs: torch.Tensor | None, write_output: bool
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`swiglu_backward` as an op: ``(grad_x, grad_probs, output)``, the last two
        0-element when absent (an op returns tensors only)."""
        dx, dp, out = _backward(x, grad_output, probs, write_output, False,
                                torch.library.wrap_triton(_bwd_kernel))
        return (dx, dp if dp is not None else x.new_empty(0),
                out if out is not None else x.new_empty(0))
