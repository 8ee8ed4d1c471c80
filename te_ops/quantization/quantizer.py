"""Quantizers and the quantized storage they return.

A quantizer is a callable: ``q(x)`` or ``q(x, splits)`` returns a :class:`QuantizedTensorStorage`
(a :class:`~te_ops.grouped_tensor.GroupedTensorStorage` whose data fields hold FP8 bytes):

* ``rowwise_data``: ``torch.float8_e4m3fn``, the input's shape, quantized along the last dim;
  ``rowwise_scale_inv``: fp32 (..., ) for FP8 current scaling, E8M0 bytes (``uint8``,
  (..., ceil(K / 32))) for MXFP8, fp32 (..., ceil(K / 128)) for blockwise FP8 (1 x 128 tiles;
  weights: 128 x 128 blocks, (G, ceil(N / 128), ceil(K / 128)));
* ``columnwise_data``: the same values quantized along the *other* axis and stored transposed
  (a (G, N, K) weight gives (G, K, N); a split (M, K) activation gives (K, capacity) in the
  group-aligned layout of :mod:`te_ops.quantization.layout`, quantized per group);
  ``columnwise_scale_inv``: FP8 (G, K) for split activations / (G, K) for weights, MXFP8
  (..., ceil(cols / 32)) of the transposed data;
* :meth:`QuantizedTensorStorage.dequantize` rebuilds the high-precision tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from ..grouped_tensor import GroupedTensorStorage
from . import fp8_swiglu, fp8_triton, numerics
from .layout import column_layout, splits_layout

__all__ = [
    "Quantizer",
    "Float8CurrentScalingQuantizer",
    "MXFP8Quantizer",
    "Float8BlockQuantizer",
    "QuantizedTensorStorage",
]

_INPUT_DTYPES = (torch.float32, torch.bfloat16)


class QuantizedTensorStorage(GroupedTensorStorage):
    """Quantized data + ``scale_inv`` (row-wise and/or column-wise) of one tensor.

    Extra attributes: ``quantizer`` (what made it; its ``format`` is ``"fp8"`` or ``"mxfp8"``),
    ``shape`` (the high-precision tensor's shape) and ``align`` (group alignment of the
    column-wise layout, rows).
    """

    quantizer: Quantizer
    shape: tuple[int, ...]
    #: FP8 current scaling, weights: the (G, K) fp32 column amax recorded by a row-wise call
    #: with ``record_columnwise_amax=True`` (``None`` when not made); a later column-wise call
    #: on the same tensor takes it as ``columnwise_amax`` and skips the amax pass.
    columnwise_amax: torch.Tensor | None = None

    @property
    def format(self) -> str:
        return self.quantizer.format

    def dequantize(self, dtype: torch.dtype | None = None, *, copy: str = "auto"
                   ) -> torch.Tensor:
        """The high-precision tensor (shape ``self.shape``, default dtype ``self.dtype``).

        ``copy``: ``"rowwise"``, ``"columnwise"`` or ``"auto"`` (the row-wise copy when present,
        else the column-wise one). The two copies round differently (other scaling axis).

        Raises
        ------
        RuntimeError
            The requested copy is absent.
        TypeError
            ``dtype`` is not a floating ``torch.dtype``.
        """
        dtype = dtype or self.dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        q = self.quantizer
        if copy not in ("auto", "rowwise", "columnwise"):
            raise ValueError(f"copy must be 'auto', 'rowwise' or 'columnwise', got {copy!r}")
        if copy == "auto":
            copy = "rowwise" if self.rowwise_data is not None else "columnwise"
        data = self.rowwise_data if copy == "rowwise" else self.columnwise_data
        if data is None:
            raise RuntimeError(f"QuantizedTensorStorage holds no {copy} data (not requested "
                               "from the quantizer, or emptied by prepare_for_saving)")
        if copy == "rowwise":
            return q.dequantize_rows(self.rowwise_data, self.rowwise_scale_inv, dtype)
        if not self.is_split:
            t = q.dequantize_columns_uniform(self.columnwise_data, self.columnwise_scale_inv,
                                             dtype)
            return t.transpose(-2, -1).reshape(self.shape)
        layout = column_layout(self.split_sizes, self.base_offsets, self.shape[0], q.align)
        padded = q.dequantize_columns_split(self, layout, dtype)  # (capacity, K)
        padded = torch.cat([padded, padded.new_zeros(1, padded.shape[1])])
        return padded[layout.dest]


class Quantizer:
    """Base quantizer. ``rowwise`` / ``columnwise`` say which copies to make.

    Call: ``q(x, splits=None)``. ``x``: fp32 or bf16, (..., K) (row-wise only), (G, N, K)
    uniform groups (e.g. weights), or (M, K) with ``splits`` (a
    :class:`~te_ops.splits.GroupedSplits`, or split sizes as a list of ints or a 1-D tensor, for
    column-wise per-group copies).

    Raises
    ------
    TypeError
        ``x`` is not a floating tensor of dtype fp32 / bf16, ``splits`` is of another type, or
        ``rowwise`` / ``columnwise`` / ``record_columnwise_amax`` is not a bool.
    ValueError
        Neither copy requested, ``x`` is 0-d, a column-wise copy of a tensor that is neither
        3-D nor 2-D, ``columnwise_amax`` that is not a (G, K) fp32 tensor on ``x``'s device or
        given where no uniform column-wise copy is made (or to a format without per-column
        amax), or ``record_columnwise_amax=True`` on a call that is not a row-wise-only
        quantize of (G, N, K) ``x`` without splits.
    """

    format = ""
    align = 16

    def __init__(self, *, rowwise: bool = True, columnwise: bool = False) -> None:
        for name, flag in (("rowwise", rowwise), ("columnwise", columnwise)):
            if not isinstance(flag, (bool, int)):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__} ({flag!r})")
        if not (rowwise or columnwise):
            raise ValueError("a quantizer needs rowwise=True or columnwise=True, got both False")
        self.rowwise = bool(rowwise)
        self.columnwise = bool(columnwise)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rowwise={self.rowwise}, columnwise={self.columnwise})"

    # subclasses: along the last dim
    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def dequantize_rows(self, data, scale_inv, dtype) -> torch.Tensor:
        raise NotImplementedError

    def quantize_columns_split(self, x2d, layout, gid) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def dequantize_columns_split(self, storage, layout, dtype) -> torch.Tensor:
        raise NotImplementedError

    def dequantize_columns_uniform(self, data, scale_inv, dtype) -> torch.Tensor:
        return self.dequantize_rows(data, scale_inv, dtype)

    def quantize_columns_uniform(self, x3d, amax=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(G, N, K) -> data (G, K, N) quantized along N, and its scales. ``amax``: see
        :meth:`quantize_rows_column_amax` (formats whose scales come from it only)."""
        if amax is not None:
            raise ValueError(f"{type(self).__name__} takes no columnwise_amax (its column-wise "
                             "scales are not one amax per column), got a tensor")
        return self.quantize_rows(x3d.transpose(-2, -1).contiguous())

    def quantize_rows_column_amax(self, x3d) -> tuple[tuple, torch.Tensor | None]:
        """Row-wise copy of (G, N, K) ``x3d`` and, where this format's column-wise scales come
        from one amax per (g, k) over N, that amax ((G, K) fp32) from the same read; ``None``
        for the amax where not made."""
        return self.quantize_rows(x3d), None

    def quantize_swiglu_rows(self, h: torch.Tensor, probs: torch.Tensor | None
                             ) -> QuantizedTensorStorage | None:
        """The row-wise copy of ``SiLU(h[:, :F]) * h[:, F:] (* probs[:, None])`` for (rows, 2F)
        ``h``, made without the activation output in ``h``'s dtype, with the bytes this
        quantizer's call gives on that output; ``None`` where this format has no such kernel
        or it cannot take the input (the caller then runs the activation and quantizes it)."""
        return None

    def rowwise_storage(self, data: torch.Tensor, scale_inv: torch.Tensor,
                        dtype: torch.dtype) -> QuantizedTensorStorage:
        """A row-wise-only storage of 2-D (rows, K) ``data`` as this quantizer's call on a
        (rows, K) ``dtype`` tensor returns it."""
        shape = tuple(data.shape)
        return self._storage(1, shape, dtype, shape, (data, scale_inv))

    def _storage(self, num: int, tshape: tuple, dtype: torch.dtype, shape: tuple, row: tuple,
                 col: tuple = (None, None), col_amax: Any = None,
                 **kw: Any) -> QuantizedTensorStorage:
        """The result storage of a quantize call: ``row`` / ``col`` are (data, scale_inv)
        pairs (``None`` for a copy not made), ``shape`` the quantized tensor's shape."""
        out = QuantizedTensorStorage(num, tshape, dtype, None, rowwise_scale_inv=row[1],
                                     columnwise_data=col[0], columnwise_scale_inv=col[1], **kw)
        out.rowwise_data = row[0]
        out.quantizer = self
        out.shape = shape
        out.columnwise_amax = col_amax
        return out

    # Both copies in one go: subclasses with a kernel that writes both copies from one pair of
    # reads return ((row data, row scale_inv), (column data, column scale_inv)) with the bytes
    # of the separate methods; ``None`` means "make them apart".
    def quantize_both_uniform(self, x3d) -> tuple[tuple, tuple] | None:
        return None

    def quantize_both_split(self, x2d, layout, splits) -> tuple[tuple, tuple] | None:
        return None

    def __call__(self, x: torch.Tensor, splits: Any = None, *,
                 columnwise_amax: torch.Tensor | None = None,
                 record_columnwise_amax: bool = False) -> QuantizedTensorStorage:
        """Quantize ``x`` (see the class docstring). For (G, N, K) ``x`` without ``splits``:
        ``record_columnwise_amax`` (row-wise only) also records the column amax on the result
        (``columnwise_amax``, FP8 current scaling); ``columnwise_amax`` (G, K) fp32 makes the
        column-wise copy from that amax (it must be the amax of this very tensor, e.g.
        recorded by the forward's row-wise call) instead of reading ``x`` for it."""
        if not isinstance(x, torch.Tensor) or x.dtype not in _INPUT_DTYPES:
            raise TypeError(f"x must be a float32 or bfloat16 tensor, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.dim() == 0:
            raise ValueError("x must have at least one dim (..., K) to quantize along, got a "
                             "0-d tensor")
        shape = tuple(x.shape)
        row = col = (None, None)
        both = col_amax = None
        uniform = x.dim() == 3 and splits is None
        if columnwise_amax is not None:
            _check_column_amax(columnwise_amax, x, uniform and self.columnwise)
        if record_columnwise_amax is not False:
            _check_record_amax(record_columnwise_amax, x, uniform,
                               self.rowwise and not self.columnwise)
        kw: dict[str, Any] = {}
        if splits is not None:
            if x.dim() != 2:
                raise ValueError(f"x must be 2-D (rows, K) with splits, got shape {shape}")
            splits = _as_splits(splits, x)
            num, tshape = splits.num_groups, shape
            kw = {"split_sizes": splits.split_sizes, "base_offsets": splits.base_offsets}
        elif x.dim() == 3:
            num, tshape = shape[0], shape[1:]
        else:
            num, tshape = 1, (x.numel() // max(shape[-1], 1) if shape else 1, shape[-1])
        if self.columnwise:
            if uniform:
                if self.rowwise and columnwise_amax is None:
                    both = self.quantize_both_uniform(x)
                col = (self.quantize_columns_uniform(x, columnwise_amax) if both is None
                       else both[1])
            elif x.dim() == 2:
                if splits is None:
                    from ..splits import make_splits
                    splits = make_splits([shape[0]], 1, shape[0], x.device)
                    kw = {"split_sizes": splits.split_sizes, "base_offsets": splits.base_offsets}
                layout = (splits_layout(splits, self.align) if splits.num_rows == shape[0]
                          else column_layout(splits.split_sizes, splits.base_offsets, shape[0],
                                             self.align))
                if self.rowwise:
                    both = self.quantize_both_split(x, layout, splits)
                col = self.quantize_columns_split(x, layout, splits) if both is None else both[1]
            else:
                raise ValueError(f"columnwise quantization needs a 2-D or 3-D tensor, got "
                                 f"shape {shape}")
        if self.rowwise and both is None and record_columnwise_amax and uniform \
                and not self.columnwise:
            row, col_amax = self.quantize_rows_column_amax(x)
        elif self.rowwise:
            row = self.quantize_rows(x) if both is None else both[0]
        return self._storage(num, tshape, x.dtype, shape, row, col, col_amax, **kw)


def _check_column_amax(amax: Any, x: torch.Tensor, applies: bool) -> None:
    """Raise unless ``amax`` is a (G, K) fp32 tensor on ``x``'s device, given for the
    column-wise copy of (G, N, K) ``x`` (``applies``)."""
    if not applies:
        raise ValueError("columnwise_amax is for the column-wise copy of a (G, N, K) tensor "
                         "without splits (a quantizer with columnwise=True); got x of shape "
                         f"{tuple(x.shape)}")
    expected = (x.shape[0], x.shape[2])
    if not isinstance(amax, torch.Tensor) or tuple(amax.shape) != expected \
            or amax.dtype != torch.float32 or amax.device != x.device:
        got = (f"{tuple(amax.shape)} {amax.dtype} on {amax.device}"
               if isinstance(amax, torch.Tensor) else type(amax).__name__)
        raise ValueError(f"columnwise_amax must be a float32 tensor of shape {expected} on "
                         f"{x.device}, got {got}")


def _check_record_amax(record: Any, x: torch.Tensor, uniform: bool, rowwise_only: bool
                       ) -> None:
    """Raise unless ``record`` is a bool and, when True, the call can record the column amax:
    a row-wise-only quantizer on (G, N, K) ``x`` without splits (``uniform``). A format that
    does not make this amax (MXFP8) still records ``None``: that is its documented answer."""
    if not isinstance(record, bool):
        raise TypeError(f"record_columnwise_amax must be a bool, got {type(record).__name__}")
    if not record:
        return
    if not uniform:
        raise ValueError("record_columnwise_amax=True needs a (G, N, K) tensor without splits, "
                         f"got x of shape {tuple(x.shape)}"
                         + ("" if x.dim() != 3 else " with splits"))
    if not rowwise_only:
        raise ValueError("record_columnwise_amax=True needs a row-wise-only quantizer "
                         "(rowwise=True, columnwise=False): a column-wise copy made in the same "
                         "call needs no recorded amax")


def _as_splits(splits: Any, x: torch.Tensor) -> Any:
    """``splits`` as a :class:`~te_ops.splits.GroupedSplits` (split sizes given as a list of
    ints or a 1-D tensor are validated against ``x``'s rows)."""
    from ..splits import GroupedSplits, make_splits

    if isinstance(splits, GroupedSplits):
        return splits
    if isinstance(splits, (list, tuple)) or (isinstance(splits, torch.Tensor)
                                             and splits.dim() == 1):
        return make_splits(splits, len(splits), x.shape[0], x.device)
    shape = f" of shape {tuple(splits.shape)}" if isinstance(splits, torch.Tensor) else ""
    raise TypeError("splits must be a GroupedSplits, a list of ints or a 1-D tensor of split "
                    f"sizes, got {type(splits).__name__}{shape}")


#: A quantizer asked for both copies of a CUDA tensor makes them with one pair of Triton
#: passes (``fp8_triton.fp8_both_grouped``: two reads instead of three); False makes them
#: with the separate row-wise and column-wise kernels (same bytes; kept for measurements).
BOTH_COPIES_ONE_KERNEL = True

#: A row-wise FP8 call on (G, N, K) weights with ``record_columnwise_amax=True`` folds the
#: column amax into the row-wise read (``fp8_triton.fp8_rows_column_amax``), so the later
#: column-wise copy (dgrad, in backward) is one pass instead of two; False leaves the amax to
#: that pass (same bytes; kept for measurements).
WEIGHT_COLUMN_AMAX_FROM_ROWWISE = True


def _uniform_align(n: int) -> int:
    """Row alignment passed to the column-wise kernels for uniform groups of ``n`` rows
    (weights): 4 when ``n % 4 == 0`` (the same layout as 1, and lets phase 2 store 32-bit words:
    ``fp8_triton.pack4_ok``), else 1."""
    return 4 if n % 4 == 0 else 1


class Float8CurrentScalingQuantizer(Quantizer):
    """FP8 E4M3 with fp32 power-of-two scales from the current amax.

    Row-wise: one scale per row of the last dim (``rowwise_scale_inv`` shape (...,)).
    Column-wise: for (G, N, K) weights one scale per (g, k) over N; for split (M, K) activations
    one scale per (group, column) over the group's rows (``columnwise_scale_inv`` (G, K)), data
    (K, capacity) in the 16-row group-aligned layout. Rule: :mod:`te_ops.quantization.numerics`.
    """

    format = "fp8"
    align = 16
    fast_accumulate_backward = False  # set by Float8CurrentScaling

    def quantize_rows(self, x):
        if fp8_triton.unsupported_reason(x) is None:  # same bytes, one kernel
            return fp8_triton.fp8_rows(x)
        return numerics.fp8_quantize_rows(x)

    def quantize_columns_uniform(self, x3d, amax=None):
        if fp8_triton.unsupported_reason(x3d) is not None:
            if amax is None:
                return super().quantize_columns_uniform(x3d)
            scale = numerics.pow2_scale_from_amax(amax)  # (G, K): the bytes of the line above
            # contiguous (G, K, N) as the line above makes it: the dgrad GEMM that reads the
            # copy then sums in the same order (a strided copy took another CPU matmul path,
            # 1 ulp off on AVX2 machines)
            data = numerics.to_e4m3(x3d.transpose(-2, -1).contiguous().float()
                                    * scale.unsqueeze(-1))
            return data, scale.reciprocal()
        g, n, k = x3d.shape
        out = torch.empty(g, k, n, dtype=torch.float8_e4m3fn, device=x3d.device)
        starts = torch.arange(g, device=x3d.device, dtype=torch.int64) * n
        sinv = fp8_triton.fp8_columns_grouped(
            x3d.reshape(g * n, k), out, starts, torch.full_like(starts, n), starts, g * n,
            _uniform_align(n), k * n, n, True, amax=amax)
        return out, sinv

    def quantize_rows_column_amax(self, x3d):
        if not WEIGHT_COLUMN_AMAX_FROM_ROWWISE:
            return self.quantize_rows(x3d), None
        if fp8_triton.unsupported_reason(x3d) is None:
            res = fp8_triton.fp8_rows_column_amax(x3d)
            if res is None:  # shape the kernel does not take: the column pass makes it later
                return self.quantize_rows(x3d), None
            return (res[0], res[1]), res[2]
        amax = (numerics.finite_abs(x3d).amax(1) if x3d.shape[1] else
                x3d.new_zeros(x3d.shape[0], x3d.shape[2], dtype=torch.float32))
        return self.quantize_rows(x3d), amax

    def quantize_swiglu_rows(self, h, probs):
        if (self.columnwise or not self.rowwise or not fp8_swiglu.ENABLED or h.dim() != 2
                or fp8_swiglu.unsupported_reason(h, probs) is not None):
            return None
        data, sinv = fp8_swiglu.swiglu_fp8_rows(h, probs)
        return self.rowwise_storage(data, sinv, h.dtype)

    def quantize_both_uniform(self, x3d):
        if not BOTH_COPIES_ONE_KERNEL or fp8_triton.unsupported_reason(x3d) is not None:
            return None
        g, n, k = x3d.shape
        out = torch.empty(g, k, n, dtype=torch.float8_e4m3fn, device=x3d.device)
        starts = torch.arange(g, device=x3d.device, dtype=torch.int64) * n
        sinv, row, row_sinv = fp8_triton.fp8_both_grouped(
            x3d.reshape(g * n, k), out, starts, torch.full_like(starts, n), starts, g * n,
            _uniform_align(n), k * n, n, True)
        return (row.view(g, n, k), row_sinv.view(g, n)), (out, sinv)

    def quantize_both_split(self, x2d, layout, splits):
        if (not BOTH_COPIES_ONE_KERNEL or fp8_triton.unsupported_reason(x2d) is not None
                or splits.num_groups == 0):
            return None
        k = x2d.shape[1]
        out = torch.empty(k, layout.capacity, dtype=torch.float8_e4m3fn, device=x2d.device)
        sinv, row, row_sinv = fp8_triton.fp8_both_grouped(
            x2d, out, splits.base_offsets[:splits.num_groups], splits.split_sizes,
            layout.starts, layout.capacity, self.align, 0, layout.capacity, False)
        return (row, row_sinv), (out, sinv)

    def dequantize_rows(self, data, scale_inv, dtype):
        return numerics.fp8_dequantize_rows(data, scale_inv, dtype)

    def quantize_columns_split(self, x2d, layout, splits):
        g, k = splits.num_groups, x2d.shape[1]
        if fp8_triton.unsupported_reason(x2d) is None:
            # The kernel writes every byte (gaps and tail as zeros): no zero fill needed.
            out = torch.empty(k, layout.capacity, dtype=torch.float8_e4m3fn, device=x2d.device)
            sinv = fp8_triton.fp8_columns_grouped(
                x2d, out, splits.base_offsets[:g], splits.split_sizes, layout.starts,
                layout.capacity, self.align, 0, layout.capacity, False)
            return out, sinv
        absx = numerics.finite_abs(x2d)
        gid = splits.group_ids.unsqueeze(1).expand(-1, k)
        amax = absx.new_zeros(g + 1, k).scatter_reduce_(0, gid, absx, "amax")
        scale = numerics.pow2_scale_from_amax(amax)  # (G + 1, K); row G (padding) is 1
        padded = torch.cat([x2d.float(), x2d.new_zeros(1, k, dtype=torch.float32)])[layout.src]
        data = numerics.to_e4m3(padded * scale[layout.group_ids]).t().contiguous()
        return data, scale[:g].reciprocal()

    def dequantize_columns_split(self, storage, layout, dtype):
        s = storage.columnwise_scale_inv
        s = torch.cat([s, s.new_ones(1, s.shape[1])])[layout.group_ids]  # (capacity, K)
        return (storage.columnwise_data.t().float() * s).to(dtype)


class MXFP8Quantizer(Quantizer):
    """MXFP8: E4M3 elements, E8M0 scale per 32 consecutive elements (OCP MX v1.0).

    Row-wise: blocks along the last dim (``rowwise_scale_inv`` uint8 (..., ceil(K / 32))).
    Column-wise: blocks along the other axis, data stored transposed; split activations use the
    32-row group-aligned layout, so no block straddles two experts (groups whose row count is
    not a multiple of 32 are zero-padded inside the quantizer).
    """

    format = "mxfp8"
    align = numerics.MX_BLOCK

    def quantize_rows(self, x):
        return numerics.mx_quantize_rows(x)

    def dequantize_rows(self, data, scale_inv, dtype):
        return numerics.mx_dequantize_rows(data, scale_inv, dtype)

    def quantize_columns_split(self, x2d, layout, splits):
        k = x2d.shape[1]
        padded = torch.cat([x2d, x2d.new_zeros(1, k)])[layout.src]
        return numerics.mx_quantize_rows(padded.t().contiguous())

    def dequantize_columns_split(self, storage, layout, dtype):
        return numerics.mx_dequantize_rows(storage.columnwise_data,
                                           storage.columnwise_scale_inv, dtype).t()


class Float8BlockQuantizer(Quantizer):
    """Blockwise FP8 (DeepSeek-V3 section 3.3.2; TransformerEngine's ``Float8BlockQuantizer``):
    E4M3 with one fp32 scale per tile of 128 elements along the reduction dim
    (``block_dim=1``: activations and gradients) or per 128 x 128 block (``block_dim=2``:
    weights). Rules: :func:`te_ops.quantization.numerics.block_quantize_rows` /
    :func:`~te_ops.quantization.numerics.block_quantize_2d`.

    Row-wise: 1 x 128 tiles along the last dim (``rowwise_scale_inv`` (..., ceil(K / 128)));
    weights (G, N, K): 128 x 128 blocks (G, ceil(N / 128), ceil(K / 128)).
    Column-wise: split activations use the 128-row group-aligned layout, so every 128 x 1
    token tile lies inside one expert (tiles restart at each expert's first row; the last one
    is partial and its amax is over the expert's rows only); data (K, capacity),
    ``columnwise_scale_inv`` (K, capacity / 128). Weights: the same 128 x 128 blocks
    transposed, bytes and scales (data (G, K, N), scales (G, ceil(K / 128), ceil(N / 128))),
    as TransformerEngine writes the transpose of a 2-D-scaled tensor.

    Parameters
    ----------
    block_dim : int
        1 (1 x 128 tiles) or 2 (128 x 128 blocks; uniform (G, N, K) tensors only).
    force_pow_2_scales : bool
        Round each scale down to a power of two (default True; TransformerEngine's default).
    amax_epsilon : float
        Lower bound of each tile's amax (default 0).

    Raises
    ------
    ValueError
        ``block_dim`` not 1 or 2; ``block_dim=2`` on a tensor of fewer than 2 dims or with
        split sizes.
    """

    format = "fp8_block"
    align = numerics.FP8_BLOCK

    def __init__(self, *, rowwise: bool = True, columnwise: bool = False, block_dim: int = 1,
                 force_pow_2_scales: bool = True, amax_epsilon: float = 0.0) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        if block_dim not in (1, 2) or isinstance(block_dim, bool):
            raise ValueError(f"block_dim must be 1 (1 x 128 tiles) or 2 (128 x 128 blocks), "
                             f"got {block_dim!r}")
        self.block_dim = block_dim
        self.options = {"pow2": bool(force_pow_2_scales), "epsilon": float(amax_epsilon)}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rowwise={self.rowwise}, columnwise={self.columnwise}, "
                f"block_dim={self.block_dim}, force_pow_2_scales={self.options['pow2']}, "
                f"amax_epsilon={self.options['epsilon']})")

    def quantize_rows(self, x):
        if self.block_dim == 1:
            return numerics.block_quantize_rows(x, **self.options)
        if x.dim() < 2:
            raise ValueError(f"128 x 128 blocks (block_dim=2) need a tensor of at least 2 dims, "
                             f"got shape {tuple(x.shape)}")
        return numerics.block_quantize_2d(x, **self.options)

    def dequantize_rows(self, data, scale_inv, dtype):
        if self.block_dim == 1:
            return numerics.block_dequantize_rows(data, scale_inv, dtype)
        return numerics.block_dequantize_2d(data, scale_inv, dtype)

    def quantize_columns_uniform(self, x3d, amax=None):
        if self.block_dim == 1 or amax is not None:
            return super().quantize_columns_uniform(x3d, amax)
        data, sinv = self.quantize_rows(x3d)
        return (data.transpose(-2, -1).contiguous(), sinv.transpose(-2, -1).contiguous())

    def quantize_columns_split(self, x2d, layout, splits):
        if self.block_dim == 2:
            raise ValueError("128 x 128 blocks (block_dim=2) are for uniform (G, N, K) tensors "
                             f"(weights), got a split tensor of shape {tuple(x2d.shape)}")
        k = x2d.shape[1]
        padded = torch.cat([x2d, x2d.new_zeros(1, k)])[layout.src]
        return numerics.block_quantize_rows(padded.t().contiguous(), **self.options)

    def dequantize_columns_split(self, storage, layout, dtype):
        return numerics.block_dequantize_rows(storage.columnwise_data,
                                              storage.columnwise_scale_inv, dtype).t()
