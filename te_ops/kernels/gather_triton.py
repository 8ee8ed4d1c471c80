"""Triton row gathers of the MoE token movement on CUDA: ``out[m] = sum_j src[index[m, j]]``
in one pass.

The routing's masked gathers (:func:`te_ops.routing.pick`) in plain torch are three kernels
over the (rows, hidden) data: a gather of clamped indices, a ``torch.where`` that zeroes the
empty rows and, for the combine, a sum over the top-k axis. On an H200 at 65,536 routed rows
of hidden 2048 (bf16) the three cost about 0.6 ms of a 5.9 ms layer step (profile of
``benchmarks/moe_layer.py``'s te_ops layer); this kernel reads each taken row once and writes
each output row once (docs/performance.md, "MoE layer", for the layer with it).

Math: ``index`` entries in ``[0, S)`` name rows of ``src`` (S rows); an entry ``>= S`` (the
routing's "empty slot / dropped pair" value ``S``) adds nothing. With one index per output row
(``K = 1``) the output is the row itself or zeros, bit for bit. With ``K > 1`` the rows are
summed in fp32 in ``j`` order, starting from the first term, and rounded once to ``src``'s
dtype (torch's ``sum`` over the k axis also accumulates bf16 / fp16 in fp32 and rounds once;
its order within the axis may differ, so the two may differ in the last bit).

The routing's :func:`te_ops.routing.pick` / :func:`~te_ops.routing.pick_sum` run it on CUDA
wherever :func:`unsupported_reason` is ``None``; elsewhere torch's gather, ``where`` and ``sum``.
Under ``torch.compile`` the call is the opaque custom op
``te_ops::gather_rows_sum`` (same kernel, launched on the real tensors, so a buffer that
inductor lays out with padded row strides is still read as it is).
"""

from __future__ import annotations

import torch

from ..tracing import tracing
from .triton_launch import cdiv, launch, next_power_of_2

try:  # Triton is optional: CPU-only installs have no use for it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

__all__ = ["gather_rows_sum", "unsupported_reason"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unsupported_reason(src: torch.Tensor, index: torch.Tensor) -> str | None:
    """Why :func:`gather_rows_sum` cannot take ``src`` / ``index`` (``None`` when it can)."""
    if src.device.type != "cuda":
        return f"device type {src.device.type} is not cuda"
    if triton is None:
        return "triton is not installed"
    if src.dim() != 2:
        return f"src is {src.dim()}-D (the kernel gathers rows of a 2-D tensor)"
    if src.dtype not in _DTYPES:
        return f"dtype {src.dtype} is not one of {list(_DTYPES)}"
    if index.dim() not in (1, 2) or index.dtype != torch.int64:
        return f"index is {index.dim()}-D {index.dtype} (the kernel takes 1-D or 2-D int64)"
    if index.device != src.device:
        return f"index is on {index.device}, src on {src.device}"
    if src.requires_grad and torch.is_grad_enabled():
        return "src requires grad (the kernel's output has no autograd graph)"
    return None


if triton is not None:

    @triton.jit
    def _gather_sum_kernel(src_ptr, idx_ptr, out_ptr, S, H, K: tl.constexpr,
                           BLOCK: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        in_row = cols < H
        r = tl.load(idx_ptr + m * K)
        v = tl.load(src_ptr + r * H + cols, mask=in_row & (r < S), other=0.0)
        if K == 1:
            out = v
        else:
            acc = v.to(tl.float32)
            for j in tl.static_range(1, K):
                r = tl.load(idx_ptr + m * K + j)
                acc += tl.load(src_ptr + r * H + cols, mask=in_row & (r < S),
                               other=0.0).to(tl.float32)
            out = acc
        tl.store(out_ptr + m * H + cols, out.to(out_ptr.dtype.element_ty), mask=in_row)


def _run(src: torch.Tensor, index: torch.Tensor, kernel) -> torch.Tensor:
    src = src.contiguous()
    idx = (index if index.dim() == 2 else index.unsqueeze(1)).contiguous()
    rows, k = idx.shape
    hidden = src.shape[1]
    out = torch.empty(rows, hidden, device=src.device, dtype=src.dtype)
    if rows == 0 or hidden == 0:
        return out
    if k == 0 or src.shape[0] == 0:  # nothing to gather: every row empty
        return out.zero_()
    block = min(1024, next_power_of_2(max(hidden, 16)))
    launch(kernel, (rows, cdiv(hidden, block)), src, idx, out, src.shape[0], hidden, K=k,
           BLOCK=block)
    return out


def gather_rows_sum(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``sum_j src[index[:, j]]`` with entries ``>= len(src)`` adding nothing (see the module
    docstring for the rounding).

    Shapes: src (S, H) float32 / bfloat16 / float16 on CUDA; index (M,) or (M, K) int64 on the
    same device, entries in ``[0, S]`` -> (M, H) in ``src``'s dtype (``(M,)``: the rows
    themselves, an entry ``S`` a zero row). Check :func:`unsupported_reason` first.
    """
    if tracing():
        return torch.ops.te_ops.gather_rows_sum(src, index)
    return _run(src, index, _gather_sum_kernel)


@torch.library.custom_op("te_ops::gather_rows_sum", mutates_args=())
def _gather_rows_sum_op(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """:func:`gather_rows_sum` as an opaque op: the kernel reads the real tensors' layout at
    run time (inductor may lay buffers out with padded row strides)."""
    return _run(src, index, _gather_sum_kernel)


@_gather_rows_sum_op.register_fake
def _gather_rows_sum_fake(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return src.new_empty(index.shape[0], src.shape[1])
