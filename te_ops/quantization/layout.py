"""Group-aligned row layout for column-wise quantized activations.

The wgrad GEMM reduces over tokens, so its operands are quantized column-wise *per group* and
stored transposed, (cols, rows). A scaled grouped GEMM reads each group's tokens as one slice of
that transposed matrix: FP8 kernels need every slice to start at a multiple of 16 elements (16-byte
TMA alignment of 1-byte data) and MXFP8 needs whole 32-element blocks inside one group. So the
rows are re-laid out with every group starting at a multiple of ``align`` and zero rows filling
the gaps (zeros add nothing to a GEMM). The layout is computed on the device from the split
sizes (cumsum, searchsorted): no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ColumnLayout", "column_layout", "splits_layout"]


@dataclass
class ColumnLayout:
    """Where each row goes in the group-aligned layout.

    Attributes
    ----------
    capacity : int
        Rows of the aligned layout: ``round_up(rows + G * (align - 1), align)`` (static, so the
        buffer shape does not depend on device values).
    src : torch.Tensor
        (capacity,) int64: source row of each aligned row; ``rows`` (a zero row) for gaps.
    dest : torch.Tensor
        (rows,) int64: aligned row of each source row; ``capacity`` for padding rows.
    group_ids : torch.Tensor
        (capacity,) int64: group of each aligned row (``G`` past the last group).
    offsets : torch.Tensor
        (G,) int32: cumulative group ends in the aligned layout (the GEMM's ``offs``).
    starts : torch.Tensor
        (G,) int64: first aligned row of each group.
    """

    capacity: int
    src: torch.Tensor
    dest: torch.Tensor
    group_ids: torch.Tensor
    offsets: torch.Tensor
    starts: torch.Tensor


def column_layout(split_sizes: torch.Tensor, base_offsets: torch.Tensor, num_rows: int,
                  align: int) -> ColumnLayout:
    """Build the group-aligned layout of ``num_rows`` rows split by ``split_sizes``.

    Parameters
    ----------
    split_sizes : torch.Tensor
        (G,) integer, device: rows per group (may sum to fewer than ``num_rows``: padding).
    base_offsets : torch.Tensor
        (G + 1,) int64: group starts, then the total.
    align : int
        Every group starts at a multiple of this many rows.
    """
    g = split_sizes.numel()
    dev = split_sizes.device
    sizes = split_sizes.to(torch.int64)
    aligned = (sizes + (align - 1)) // align * align
    ends = torch.cumsum(aligned, 0)
    starts = ends - aligned
    capacity = -(-(num_rows + g * (align - 1)) // align) * align
    pos = torch.arange(capacity, device=dev)
    gid = torch.searchsorted(ends, pos, right=True)  # G past the last group
    zero = sizes.new_zeros(1)
    sizes_x = torch.cat([sizes, zero])
    starts_x = torch.cat([starts, ends[-1:] if g else zero])
    base_x = torch.cat([base_offsets[:g].to(torch.int64), zero])
    within = pos - starts_x[gid]
    src = torch.where(within < sizes_x[gid], base_x[gid] + within, torch.full_like(pos, num_rows))
    rows = torch.arange(num_rows, device=dev)
    # over base_offsets itself, one off for its leading 0: not the slice base_offsets[1:],
    # whose storage offset inductor's searchsorted ignores (te_ops.splits._row_groups)
    row_gid = torch.searchsorted(base_offsets.to(torch.int64), rows, right=True) - 1
    row_gid = torch.where(rows < base_offsets[-1], row_gid, torch.full_like(rows, g))
    dest = torch.where(row_gid < g, rows - base_x[row_gid] + starts_x[row_gid],
                       torch.full_like(rows, capacity))
    return ColumnLayout(capacity, src, dest, gid, ends.to(torch.int32), starts)


def splits_layout(splits, align: int) -> ColumnLayout:
    """:func:`column_layout` of a ``GroupedSplits`` (its ``num_rows`` rows), built once per
    ``align`` and kept with the splits (``GroupedSplits.derived``)."""
    def build() -> ColumnLayout:
        return column_layout(splits.split_sizes, splits.base_offsets, splits.num_rows, align)

    return splits.derived(f"column_layout_{align}", build)
