"""Zero the padding rows of a grouped GEMM output: only the rows past the split-size total.

Rows of a grouped input past the sum of the split sizes are padding (``te_ops.splits``);
``torch._grouped_mm`` leaves the matching output rows unwritten (whatever the allocator handed
back, NaN included). A mask fill (``out.masked_fill_(row >= total, 0)``) reads and writes the
whole tensor to fix the tail: measured on the H200 at 8-24 % of a grouped-MLP step. Here
only the tail is touched:

``cuda`` (Triton)
    :func:`zero_rows_past_total_` (``torch.ops.te_ops.zero_rows_past_total_``, a
    ``torch.library.triton_op``): one program per block of rows; a program reads the total
    (``offsets[-1]``, on the device) and, when its rows all lie below it, does nothing else.
    No host sync, a launch of host-known size: graph-safe, and it compiles under
    ``torch.compile(fullgraph=True)``.
``cpu`` (eager)
    ``out[total:].zero_()`` with the total read from host memory (no device to sync with).
otherwise (``meta``, CPU under ``torch.compile``, CUDA without Triton)
    the mask fill, which has no data-dependent shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..tracing import tracing
from .triton_launch import cdiv, launch, next_power_of_2

try:  # Triton is optional: CPU-only installs have no use for it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

__all__ = ["zero_padding_rows_", "padding_backend"]

_BLOCK_M = 32


def padding_backend(out: torch.Tensor) -> str:
    """Which path :func:`zero_padding_rows_` takes for ``out``: ``triton``, ``slice`` or
    ``mask``."""
    kind = out.device.type
    if kind == "cuda" and triton is not None and out.dim() == 2 and out.stride(1) == 1:
        return "triton"
    if kind == "cpu" and not tracing():
        return "slice"
    return "mask"


def zero_padding_rows_(out: torch.Tensor, offsets: torch.Tensor,
                       padding_rows: torch.Tensor | Callable[[], torch.Tensor] | None = None
                       ) -> torch.Tensor:
    """Set rows ``offsets[-1]:`` of ``out`` to zero, in place; return ``out``.

    Parameters
    ----------
    out : torch.Tensor
        Shape (M, N), any float dtype; rows past the total may hold anything (NaN included).
    offsets : torch.Tensor
        Shape (G,), integer, on ``out``'s device: cumulative group ends (``offsets[-1]`` is
        the number of real rows, at most M; ``GroupedSplits.offsets``).
    padding_rows : torch.Tensor or callable, optional
        Shape (M, 1) bool mask of the padding rows, used by the mask path (built when absent),
        or a function returning it (called only on the mask path, e.g.
        ``GroupedSplits.padding_rows``).

    Raises
    ------
    ValueError
        ``out`` is not 2-D or ``offsets`` is not 1-D / on another device.
    """
    if out.dim() != 2:
        raise ValueError(f"out must be 2-D (rows, cols), got shape {tuple(out.shape)}")
    if offsets.dim() != 1 or offsets.device != out.device:
        raise ValueError(f"offsets must be 1-D on {out.device}, got shape "
                         f"{tuple(offsets.shape)} on {offsets.device}")
    if out.numel() == 0 or offsets.numel() == 0:
        return out
    path = padding_backend(out)
    if path == "triton":
        if tracing():
            torch.ops.te_ops.zero_rows_past_total_(out, offsets)
        else:  # eager: launch directly (the custom-op dispatch cost ~0.2 ms of host per call)
            _launch(out, offsets)
    elif path == "slice":
        out[int(offsets[-1]):].zero_()
    else:
        if callable(padding_rows):
            padding_rows = padding_rows()
        if padding_rows is None:
            rows = torch.arange(out.shape[0], device=out.device)
            padding_rows = (rows >= offsets[-1]).unsqueeze(-1)
        out.masked_fill_(padding_rows, 0)
    return out


if triton is not None:

    @triton.jit
    def _zero_rows_kernel(out_ptr, offsets_ptr, last, M, N, stride_m,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        total = tl.load(offsets_ptr + last).to(tl.int64)
        row0 = tl.program_id(0).to(tl.int64) * BLOCK_M
        if row0 + BLOCK_M > total:  # only blocks that reach past the total do any work
            rows = row0 + tl.arange(0, BLOCK_M).to(tl.int64)
            row_ok = (rows >= total) & (rows < M)
            zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty)
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                ptrs = out_ptr + rows[:, None] * stride_m + cols[None, :]
                tl.store(ptrs, zeros, mask=row_ok[:, None] & (cols[None, :] < N))

    def _launch(out: torch.Tensor, offsets: torch.Tensor, kernel=_zero_rows_kernel) -> None:
        m, n = out.shape
        block_n = min(256, next_power_of_2(max(n, 16)))
        launch(kernel, (cdiv(m, _BLOCK_M),), out, offsets, offsets.shape[0] - 1, m, n,
               out.stride(0), BLOCK_M=_BLOCK_M, BLOCK_N=block_n)

    @torch.library.triton_op("te_ops::zero_rows_past_total_", mutates_args={"out"})
    def zero_rows_past_total_(out: torch.Tensor, offsets: torch.Tensor) -> None:
        """Triton: zero rows ``offsets[-1]:`` of the 2-D, unit-column-stride ``out`` in place.

        Registered with ``torch.library.triton_op``, which also uses this body (run on
        FakeTensors) as the fake kernel: it allocates nothing and returns nothing. Eager
        callers of :func:`zero_padding_rows_` launch the same kernel without the op dispatch.
        """
        _launch(out, offsets, torch.library.wrap_triton(_zero_rows_kernel))
