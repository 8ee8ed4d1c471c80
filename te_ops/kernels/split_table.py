"""Split-size metadata in one kernel: int64 offsets, int32 offsets and the validity flag.

:func:`te_ops.splits.make_splits` derives, from device split sizes ``s`` (G,) and the input's
row count ``R``:

* ``table`` (2G + 2,) int64: ``[0, ends..., sizes..., valid]`` with ``ends = cumsum(s)``;
  ``table[:G + 1]`` are the group starts then the total (``base_offsets``), ``table[1:G + 1]``
  the group ends and ``table[G + 1:2G + 1]`` the sizes as int64;
* ``offsets`` (G,) int32: the group ends (``torch._grouped_mm``'s ``offs``, the Triton GEMMs');
* ``valid`` (0-d view of ``table[2G + 1]``): 1 when every size and every end lies in
  ``[0, R]`` (so the int64 sum cannot wrap) and, for floating sizes, every size is a whole
  number; else 0. ``make_splits`` hands it to ``torch._assert_async``.

``cuda`` with Triton
    One Triton program (``_split_table_kernel``; ``torch.ops.te_ops.split_table``, a
    ``torch.library.triton_op``, while ``torch.compile`` traces; eager calls launch it
    directly). In a captured E64 step it replaces nine launches (cumsum's two scan kernels,
    the zeros and ``cat`` of the table, ``clamp`` / ``eq`` / ``all`` of the check, the int32
    cast). Graph-safe: no host read, launch size from ``G`` only.
otherwise (CPU, ``meta``, CUDA without Triton, more than :data:`MAX_TRITON_GROUPS` groups)
    the same values from torch ops (:func:`split_table_torch`; a (2G + 1,) table without the
    flag slot, the flag a separate bool: no aten op spent on packing it into the table).

Both return a :class:`SplitTable` of the views ``make_splits`` keeps.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..tracing import tracing
from .triton_launch import launch, next_power_of_2

try:  # Triton is optional: CPU-only installs have no use for it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

__all__ = ["SplitTable", "split_table", "split_table_torch", "split_table_backend",
           "MAX_TRITON_GROUPS"]

#: Most groups the one-program kernel takes (its block holds every size); more take torch ops.
MAX_TRITON_GROUPS = 8192


def split_table_backend(split_sizes: torch.Tensor) -> str:
    """``triton`` or ``torch``: which path :func:`split_table` takes for ``split_sizes``."""
    groups = split_sizes.shape[0]
    if (split_sizes.device.type == "cuda" and triton is not None
            and 0 < groups <= MAX_TRITON_GROUPS):
        return "triton"
    return "torch"


class SplitTable(NamedTuple):
    """Device metadata of split sizes (G groups), as :func:`te_ops.splits.make_splits` keeps it.

    Attributes
    ----------
    base_offsets : torch.Tensor
        (G + 1,) int64: group starts, then the total.
    ends : torch.Tensor
        (G,) int64: cumulative group ends.
    sizes : torch.Tensor
        (G,) int64: the sizes (the caller's tensor when it is int64 already).
    offsets : torch.Tensor
        (G,) int32: the ends for ``torch._grouped_mm`` and the Triton GEMMs.
    valid : torch.Tensor or None
        0-d, nonzero when the sizes are valid (see the module); ``None`` when not asked for
        on the torch path.
    """

    base_offsets: torch.Tensor
    ends: torch.Tensor
    sizes: torch.Tensor
    offsets: torch.Tensor
    valid: torch.Tensor | None


def split_table(split_sizes: torch.Tensor, num_rows: int, check: bool = True) -> SplitTable:
    """The offsets and validity flag of ``split_sizes`` (see the module).

    Parameters
    ----------
    split_sizes : torch.Tensor
        Shape (G,) (any stride), any integer dtype of ``te_ops.splits`` or a floating dtype
        holding whole numbers; any device.
    num_rows : int
        The input's rows ``R`` (sizes and their sum must lie in ``[0, R]``).
    check : bool
        Whether the flag is wanted (the torch path then skips its three check ops; the
        Triton kernel always writes it).

    Returns
    -------
    SplitTable
        On CUDA with Triton, views of the kernel's (2G + 2,) int64 table ``[0, ends, sizes,
        valid]`` (``valid`` 0-d int64) and its int32 ends; else torch ops' results
        (``valid`` 0-d bool).
    """
    groups = split_sizes.shape[0]
    if split_table_backend(split_sizes) == "triton":
        if tracing():
            table, offsets = torch.ops.te_ops.split_table(split_sizes, num_rows)
        else:  # eager: launch directly (a custom-op dispatch costs host time)
            table, offsets = _launch(split_sizes, num_rows, _split_table_kernel)
        sizes = (split_sizes if split_sizes.dtype is torch.int64
                 else table[groups + 1:2 * groups + 1])
        return SplitTable(table[:groups + 1], table[1:groups + 1], sizes, offsets,
                          table[2 * groups + 1])
    return split_table_torch(split_sizes, num_rows, check)


def split_table_torch(split_sizes: torch.Tensor, num_rows: int, check: bool = True
                      ) -> SplitTable:
    """:func:`split_table` in torch ops (the CPU path and the reference of the kernel's
    tests): ``to`` (non-int64 sizes), ``cumsum``, ``new_zeros``, ``cat``, the three check ops
    and the int32 cast."""
    sizes = (split_sizes if split_sizes.dtype is torch.int64
             else split_sizes.to(torch.int64))  # floating sizes: cast on the device
    ends = torch.cumsum(sizes, 0)
    # [0, ends, sizes] in one buffer: base_offsets is its head (a view), and one range check
    # covers every size (so the int64 cumsum cannot wrap) and every end (the total) at once.
    table = torch.cat([ends.new_zeros(1), ends, sizes])
    valid = None
    if check:
        valid = (table.clamp(0, num_rows) == table).all()
        if split_sizes.is_floating_point():  # whole numbers only
            valid = valid & (split_sizes == sizes.to(split_sizes.dtype)).all()
    return SplitTable(table[:split_sizes.shape[0] + 1], ends, sizes, ends.to(torch.int32),
                      valid)


if triton is not None:

    @triton.jit
    def _split_table_kernel(sizes_ptr, table_ptr, offs_ptr, G, stride, num_rows,
                            BLOCK_G: tl.constexpr, FLOAT: tl.constexpr):
        """One program: table = [0, cumsum(s), s, valid], offsets = int32(cumsum(s)); the
        sizes are read ``stride`` elements apart (a strided 1-D view; usually 1)."""
        i = tl.arange(0, BLOCK_G)
        in_range = i < G
        raw = tl.load(sizes_ptr + i * stride, mask=in_range, other=0)
        if FLOAT == 1:  # truncation toward zero, as torch's cast; whole numbers only
            f = raw.to(tl.float32)  # exact for 16/32-bit floats
            s = f.to(tl.int64)
            ok = s.to(tl.float32) == f
        elif FLOAT == 2:
            s = raw.to(tl.int64)
            ok = s.to(tl.float64) == raw
        else:
            s = raw.to(tl.int64)
            ok = s == s
        ends = tl.cumsum(s, 0)
        ok = ok & (s >= 0) & (s <= num_rows) & (ends >= 0) & (ends <= num_rows)
        valid = tl.min(tl.where(in_range, ok, True).to(tl.int64), 0)
        tl.store(table_ptr + i, tl.zeros_like(s), mask=i == 0)
        tl.store(table_ptr + 1 + i, ends, mask=in_range)
        tl.store(table_ptr + G + 1 + i, s, mask=in_range)
        tl.store(table_ptr + 2 * G + 1 + i, tl.zeros_like(s) + valid, mask=i == 0)
        tl.store(offs_ptr + i, ends.to(tl.int32), mask=in_range)

    def _float_kind(dtype: torch.dtype) -> int:
        """0: integer sizes; 1: 16/32-bit floats (checked in float32); 2: float64."""
        if not dtype.is_floating_point:
            return 0
        return 2 if dtype == torch.float64 else 1

    def _launch(split_sizes: torch.Tensor, num_rows: int, kernel
                ) -> tuple[torch.Tensor, torch.Tensor]:
        groups = split_sizes.shape[0]
        dev = split_sizes.device
        table = torch.empty(2 * groups + 2, dtype=torch.int64, device=dev)
        offsets = torch.empty(groups, dtype=torch.int32, device=dev)
        block = max(16, next_power_of_2(groups))
        # Eager: through the compiled kernel's cached launcher (kernels/triton_launch.py);
        # wrap_triton's kernel (the op body, traced) launches the normal way there.
        launch(kernel, (1,), split_sizes, table, offsets, groups, split_sizes.stride(0), num_rows,
               BLOCK_G=block, FLOAT=_float_kind(split_sizes.dtype),
               num_warps=1 if block <= 256 else 4)
        return table, offsets

    @torch.library.triton_op("te_ops::split_table", mutates_args={})
    def _split_table_op(split_sizes: torch.Tensor, num_rows: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`split_table`'s Triton path as an op (table, offsets); the body, run on
        FakeTensors, is also the fake kernel."""
        return _launch(split_sizes, num_rows, torch.library.wrap_triton(_split_table_kernel))
