"""(Scaled)SwiGLU forward straight into FP8 current scaling's row-wise copy (CUDA, Triton).

Under a recipe the fused grouped-MLP forward needs fc2's input (the activation output ``a``,
(rows, F)) only as fprop's row-wise FP8 copy when the activation's input is saved for backward
(``a`` is recomputed there). Made apart, that copy costs one kernel writing ``a`` in the input's
dtype and a second reading it back (``fp8_triton.fp8_rows``); :func:`swiglu_fp8_rows` is one
kernel: each program computes a whole row of ``a`` as ``swiglu_triton``'s forward kernel does
(same operations in the same order), rounds it to the input's dtype, takes the row's largest
finite magnitude and writes the FP8 bytes and the row's ``scale_inv`` with ``fp8_triton``'s
rule. The bytes equal ``fp8_rows(swiglu_forward(h, probs))`` bit for bit (checked by
``tests/test_fp8t_cuda.py`` on the GPU and ``tests/test_fp8t_interpret.py`` through Triton's
interpreter), and ``a`` never exists in the input's dtype.

Registered as the ``triton_op`` ``te_ops::swiglu_fp8_rows`` (its body is the fake kernel);
eager calls launch the kernel directly. No host sync: graph-safe.
"""

from __future__ import annotations

import torch

from . import fp8_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None
    tl = None
else:
    from .fp8_triton import _finite_abs, _pow2_scale, _to_e4m3

__all__ = ["ENABLED", "MAX_FFN", "unsupported_reason", "shape_reason", "swiglu_fp8_rows"]

#: Whether the fused grouped-MLP forward uses this kernel where it applies (False: the
#: SwiGLU kernel, then the row-wise quantize kernel; same bytes).
ENABLED = True

#: Longest activation row (F) one program keeps in registers; longer rows take the two
#: kernels.
MAX_FFN = 16384


def unsupported_reason(h: torch.Tensor, probs: torch.Tensor | None) -> str | None:
    """Why :func:`swiglu_fp8_rows` cannot take ``h`` (..., 2F) and ``probs`` (``None``: it
    can): the Triton FP8 kernels' conditions (CUDA, fp32 / bf16, contiguous, not empty), an
    even last dim of at most ``2 * MAX_FFN``, probs (if any) on ``h``'s device."""
    if h.device.type != "cuda":  # first: a CPU run is not told to install triton
        return f"device type {h.device.type} is not cuda"
    return fp8_triton.unsupported_reason(h) or shape_reason(h, probs)


def shape_reason(h: torch.Tensor, probs: torch.Tensor | None) -> str | None:
    """The shape and device part of :func:`unsupported_reason`."""
    two_f = h.shape[-1]
    if two_f % 2 or two_f // 2 > MAX_FFN:
        return f"last dim {two_f} is odd or above 2 * {MAX_FFN}"
    if probs is not None and probs.device != h.device:
        return f"probs on {probs.device}, input on {h.device}"
    return None


if triton is not None:

    @triton.jit
    def _swiglu_fp8_rows_kernel(x_ptr, p_ptr, q_ptr, sinv_ptr, F, HAS_P: tl.constexpr,
                                BLOCK: tl.constexpr):
        # One row: a = SiLU(x[:F]) * x[F:] (* p), as swiglu_triton._fwd_kernel computes it,
        # rounded to the output dtype (q's row-wise source), then fp8_triton's row rule.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < F
        a = tl.load(x_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-a))
        out = a * sig * b
        if HAS_P:
            out = out * tl.load(p_ptr + row).to(tl.float32)
        v = out.to(x_ptr.dtype.element_ty).to(tl.float32)
        scale, sinv = _pow2_scale(tl.max(_finite_abs(v), 0))
        tl.store(sinv_ptr + row, sinv)
        tl.store(q_ptr + row * F + cols, _to_e4m3(v, scale), mask=mask)

    def launch(h: torch.Tensor, probs: torch.Tensor | None, wrap=lambda k: k
               ) -> tuple[torch.Tensor, torch.Tensor]:
        f = h.shape[-1] // 2
        lead = tuple(h.shape[:-1])
        rows = h.numel() // max(h.shape[-1], 1)
        q = torch.empty(*lead, f, dtype=torch.float8_e4m3fn, device=h.device)
        sinv = torch.empty(lead, dtype=torch.float32, device=h.device)
        if rows == 0 or f == 0:
            return q, sinv.fill_(1.0)
        block = triton.next_power_of_2(f)
        p = probs.contiguous() if probs is not None else h
        wrap(_swiglu_fp8_rows_kernel)[(rows,)](h, p, q, sinv, f, HAS_P=probs is not None,
                                               BLOCK=block,
                                               num_warps=8 if block <= 8192 else 16)
        return q, sinv

    @torch.library.triton_op("te_ops::swiglu_fp8_rows", mutates_args={})
    def _swiglu_fp8_rows_op(h: torch.Tensor, probs: torch.Tensor | None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        return launch(h, probs, wrap=torch.library.wrap_triton)


def swiglu_fp8_rows(h: torch.Tensor, probs: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 current scaling's row-wise copy of ``SiLU(h[..., :F]) * h[..., F:] (* probs)``.

    Shapes: h (..., 2F) contiguous fp32 / bf16 on CUDA, probs (...) or ``None`` -> (data
    (..., F) float8_e4m3fn, scale_inv (...) fp32); the bytes of
    ``fp8_triton.fp8_rows(swiglu_triton.swiglu_forward(h, probs))``.

    Raises
    ------
    ValueError
        Where :func:`unsupported_reason` gives a reason (it names it).
    """
    reason = unsupported_reason(h, probs)
    if reason is not None:
        raise ValueError(f"swiglu_fp8_rows cannot take this input: {reason}")
    if fp8_triton.tracing():
        return _swiglu_fp8_rows_op(h, probs)
    return launch(h, probs)
