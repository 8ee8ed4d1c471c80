"""``GroupedTensorStorage``: N logical 2-D tensors in one contiguous buffer.

Two kinds of grouping are supported:

* *uniform*: every member has ``tensor_shape`` (e.g. expert weights, (out, in) each);
* *split*: members are consecutive row blocks of one (rows, cols) matrix with
  ``split_sizes[i]`` rows each (e.g. a token-sorted activation); ``tensor_shape`` is then the
  whole matrix's (rows, cols) and rows past the split-size sum are padding.

Split sizes and base offsets are device tensors, so building or saving a grouped tensor never
syncs with the host. Quantized data (data plus scale-inverse, row-wise and column-wise) has
fields of its own (``rowwise_scale_inv``, ``columnwise_data``, ``columnwise_scale_inv``); they
travel through :meth:`GroupedTensorStorage.prepare_for_saving` like the data.

The saving protocol mirrors TransformerEngine's ``GroupedTensorStorage``:
``prepare_for_saving()`` returns the plain tensors to give ``save_for_backward`` and empties
those fields; ``restore_from_saved(tensors)`` refills them and returns the unused rest.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["GroupedTensorStorage", "GroupedTensor", "make_grouped_tensor_from_rowwise_data"]

_TENSOR_FIELDS = (
    "rowwise_data",
    "rowwise_scale_inv",
    "columnwise_data",
    "columnwise_scale_inv",
    "split_sizes",
    "base_offsets",
)


class GroupedTensorStorage:
    """Storage of N grouped 2-D tensors.

    Parameters
    ----------
    num_tensors : int
        Number of members (groups / experts).
    tensor_shape : tuple[int, int]
        Uniform grouping: each member's shape. Split grouping: the whole (rows, cols) matrix.
    dtype : torch.dtype
        Logical dtype of the members (the dtype they dequantize to).
    rowwise_data : torch.Tensor | None
        Contiguous buffer of ``prod(tensor_shape) * (num_tensors if uniform else 1)`` elements,
        any shape.
    split_sizes : torch.Tensor | None
        Shape (num_tensors,), integer, on the data's device: rows per member (split grouping).
    base_offsets : torch.Tensor | None
        Shape (num_tensors + 1,), int64: first row of each member, then the total (split
        grouping); derived from ``split_sizes`` by a device ``cumsum`` when not given.
    rowwise_scale_inv, columnwise_data, columnwise_scale_inv : torch.Tensor | None
        Reserved for quantized data.

    Raises
    ------
    ValueError
        Wrong element count, a non-contiguous buffer, or split sizes of the wrong length.
    """

    def __init__(
        self,
        num_tensors: int,
        tensor_shape: Sequence[int],
        dtype: torch.dtype,
        rowwise_data: torch.Tensor | None,
        *,
        split_sizes: torch.Tensor | None = None,
        base_offsets: torch.Tensor | None = None,
        rowwise_scale_inv: torch.Tensor | None = None,
        columnwise_data: torch.Tensor | None = None,
        columnwise_scale_inv: torch.Tensor | None = None,
    ) -> None:
        if num_tensors < 1:
            raise ValueError(f"num_tensors must be >= 1, got {num_tensors}")
        if len(tensor_shape) != 2:
            raise ValueError(f"tensor_shape must have 2 dims, got {tuple(tensor_shape)}")
        self.num_tensors = int(num_tensors)
        # SymInts (torch.compile with dynamic token counts) stay symbolic.
        self.tensor_shape = tuple(v if isinstance(v, torch.SymInt) else int(v)
                                  for v in tensor_shape)
        self.dtype = dtype
        self._split = split_sizes is not None or base_offsets is not None
        if split_sizes is not None:
            if split_sizes.dim() != 1 or split_sizes.numel() != num_tensors:
                raise ValueError(
                    f"split_sizes must have shape ({num_tensors},), got "
                    f"{tuple(split_sizes.shape)}"
                )
            if base_offsets is None:
                ends = torch.cumsum(split_sizes.to(torch.int64), 0)
                base_offsets = torch.cat([ends.new_zeros(1), ends])
        if rowwise_data is not None:
            _check_buffer("rowwise_data", rowwise_data, self.numel())
        self.rowwise_data = rowwise_data
        self.rowwise_scale_inv = rowwise_scale_inv
        self.columnwise_data = columnwise_data
        self.columnwise_scale_inv = columnwise_scale_inv
        self.split_sizes = split_sizes
        self.base_offsets = base_offsets

    # ------------------------------------------------------------------ shape helpers
    @property
    def is_split(self) -> bool:
        """True for split grouping (row blocks of one matrix)."""
        return self._split

    def numel(self) -> int:
        """Elements of the whole buffer."""
        rows, cols = self.tensor_shape
        return rows * cols * (1 if self.is_split else self.num_tensors)

    def _data(self) -> torch.Tensor:
        if self.rowwise_data is None:
            raise RuntimeError(
                "rowwise_data is empty: call restore_from_saved() after prepare_for_saving()"
            )
        return self.rowwise_data

    def as_2d(self) -> torch.Tensor:
        """Split grouping: the (rows, cols) matrix; uniform: (num_tensors * rows, cols)."""
        rows, cols = self.tensor_shape
        if self.is_split:
            data = self._data()
            return data if data.shape == (rows, cols) else data.view(rows, cols)
        return self._data().view(self.num_tensors * rows, cols)

    def as_3d(self) -> torch.Tensor:
        """Uniform grouping only: the members stacked, (num_tensors, rows, cols)."""
        if self.is_split:
            raise ValueError("as_3d needs uniform grouping; this storage is split by split_sizes")
        return self._data().view(self.num_tensors, *self.tensor_shape)

    def split_into_tensors(self, host_split_sizes: Sequence[int] | None = None
                           ) -> list[torch.Tensor]:
        """Per-member views.

        Split grouping needs the sizes on the host: pass ``host_split_sizes`` to avoid copying
        ``split_sizes`` from the device (which is a host sync).
        """
        if not self.is_split:
            return list(self.as_3d().unbind(0))
        sizes = (list(host_split_sizes) if host_split_sizes is not None
                 else [int(v) for v in self.split_sizes.tolist()])
        if len(sizes) != self.num_tensors:
            raise ValueError(
                f"host_split_sizes must have {self.num_tensors} entries, got {len(sizes)}"
            )
        matrix = self.as_2d()
        views, start = [], 0
        for m in sizes:
            views.append(matrix[start:start + m])
            start += m
        return views

    # ------------------------------------------------------------------ saving protocol
    def prepare_for_saving(self) -> tuple[list[torch.Tensor | None], GroupedTensorStorage]:
        """Plain tensors for ``save_for_backward``; empties those fields on this object.

        Returns
        -------
        (tensors, self)
            ``tensors`` lists, in a fixed order, rowwise data, rowwise scale-inverse,
            columnwise data, columnwise scale-inverse, split sizes and base offsets
            (``None`` where absent).
        """
        tensors = [getattr(self, name) for name in _TENSOR_FIELDS]
        for name in _TENSOR_FIELDS:
            setattr(self, name, None)
        return tensors, self

    def restore_from_saved(self, tensors: Sequence[torch.Tensor | None]
                           ) -> list[torch.Tensor | None]:
        """Refill the fields emptied by :meth:`prepare_for_saving`; return the unused rest.

        Raises
        ------
        ValueError
            Fewer tensors than fields.
        """
        n = len(_TENSOR_FIELDS)
        if len(tensors) < n:
            raise ValueError(f"tensors must hold at least {n} entries, got {len(tensors)}")
        for name, value in zip(_TENSOR_FIELDS, tensors[:n]):
            setattr(self, name, value)
        return list(tensors[n:])

    def __repr__(self) -> str:
        kind = "split" if self.is_split else "uniform"
        return (f"GroupedTensorStorage(num_tensors={self.num_tensors}, tensor_shape="
                f"{self.tensor_shape}, dtype={self.dtype}, {kind})")


class GroupedTensor(GroupedTensorStorage):
    """A grouped tensor with the factory constructor; see :class:`GroupedTensorStorage`."""

    @staticmethod
    def make_grouped_tensor_from_rowwise_data(
        num_tensors: int,
        tensor_shape: Sequence[int],
        rowwise_data: torch.Tensor,
        dtype: torch.dtype | None = None,
        split_sizes: torch.Tensor | None = None,
        *,
        copy_if_noncontiguous: bool = True,
    ) -> GroupedTensor:
        """Wrap an existing buffer (no copy when it is contiguous).

        Parameters
        ----------
        num_tensors, tensor_shape, split_sizes : see :class:`GroupedTensorStorage`.
        rowwise_data : torch.Tensor
            The data, any shape with the right element count.
        dtype : torch.dtype, optional
            Defaults to ``rowwise_data.dtype``.
        copy_if_noncontiguous : bool
            A non-contiguous buffer is copied (True) or rejected with ``ValueError`` naming its
            shape and strides (False).
        """
        if not isinstance(rowwise_data, torch.Tensor):
            raise TypeError(f"rowwise_data must be a torch.Tensor, got {type(rowwise_data)}")
        if not rowwise_data.is_contiguous():
            if not copy_if_noncontiguous:
                raise ValueError(
                    "rowwise_data must be contiguous, got shape "
                    f"{tuple(rowwise_data.shape)} with strides {rowwise_data.stride()}"
                )
            rowwise_data = rowwise_data.contiguous()
        return GroupedTensor(
            num_tensors,
            tensor_shape,
            dtype or rowwise_data.dtype,
            rowwise_data,
            split_sizes=split_sizes,
        )


make_grouped_tensor_from_rowwise_data = GroupedTensor.make_grouped_tensor_from_rowwise_data


def _check_buffer(name: str, data: torch.Tensor, expected_numel: int) -> None:
    if not data.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous, got shape {tuple(data.shape)} with strides "
            f"{data.stride()}"
        )
    if data.numel() != expected_numel:
        raise ValueError(
            f"{name} must have {expected_numel} elements, got {data.numel()} "
            f"(shape {tuple(data.shape)})"
        )
