"""Grouped GEMMs on quantized operands (the recipe branch of ``gemm/dispatch.py``).

Operands are :class:`~te_ops.quantization.QuantizedTensorStorage`. Which copy each GEMM reads
(each quantized along the dim the GEMM reduces):

========  =====================================  ==========================================
GEMM      A                                      B
========  =====================================  ==========================================
fprop     x row-wise (scale per token, over K)   W row-wise (per (g, n), over K)
dgrad     dy row-wise (per token, over N)        W column-wise (per (g, k), over N)
wgrad     dy column-wise (per (g, n), over the   x column-wise (per (g, k), over the group's
          group's tokens)                        tokens)
========  =====================================  ==========================================

Native: FP8 current scaling on CUDA SM90 / SM100 with bf16 parameters runs
``torch._scaled_grouped_mm`` (row-wise fp32 ``scale_inv`` vectors; fprop/dgrad as 2-D x 3-D with
the token offsets, wgrad as 2-D x 2-D over the 16-row group-aligned column-wise layout).
Emulated everywhere else: the operands are dequantized (exact: power-of-two scales) to the
parameters' dtype and the high-precision grouped GEMM runs on them (fp32 accumulation), so the
same FP8 bytes feed both paths.

Blockwise FP8 (``Float8BlockScaling``): the scales change every 128 elements of the reduced
dim, so no scale factors out of a whole dot product. Native on SM90 with bf16 parameters:
te_ops' Triton kernels (:mod:`te_ops.quantization.fp8_block_triton`; torch has no grouped
GEMM with these scales). Emulated elsewhere by :func:`block_grouped_gemm_emulated`, which
runs the kernels' loop with fp32 matrix products: for each 128-block of the reduced dim in
increasing order, the product of the two operands' FP8 values in fp32 (exact products, fp32
sums), times ``sa * sb`` (the two tiles' fp32 ``scale_inv``, multiplied first), added to an
fp32 accumulator; the result is rounded to the parameters' dtype once. Device-side torch ops
with shapes known on the host (graph-safe), the same on every device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import env
from ..kernels.padding import padding_backend, zero_padding_rows_
from ..kernels.triton_launch import capability
from . import fp8_block_triton
from .layout import splits_layout
from .numerics import FP8_BLOCK
from .quantizer import QuantizedTensorStorage

__all__ = ["native_unsupported_reason", "quantized_grouped_gemm", "is_quantized",
           "block_grouped_gemm_emulated"]

_ALIGN_FP8 = 16


def is_quantized(t: Any) -> bool:
    """True for a :class:`QuantizedTensorStorage` operand."""
    return isinstance(t, QuantizedTensorStorage)


def native_unsupported_reason(fmt: str, device: torch.device, dtype: torch.dtype,
                              dims: tuple[int, ...], backend_name: str = "grouped_mm"
                              ) -> str | None:
    """Why no native scaled grouped GEMM runs here (``None`` when one does)."""
    if fmt == "fp8_block":
        return _block_native_reason(device, dtype, backend_name)
    if fmt == "mxfp8":
        return ("MXFP8 native grouped GEMM (torch._scaled_grouped_mm with blocked E8M0 scales) "
                "needs SM100 and a torch built with FBGEMM GenAI; te_ops does not call it yet "
                "(it cannot be verified on the SM90 machines here), so MXFP8 is emulated")
    if device.type != "cuda":
        return f"no FP8 grouped GEMM kernel on {device.type}"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    if torch.version.hip:
        return "FP8 grouped GEMM on ROCm is not wired up in te_ops"
    major, minor = capability(device)
    if major not in (9, 10):
        return f"torch._scaled_grouped_mm runs on SM90 / SM100, not SM{major}{minor}"
    if dtype != torch.bfloat16:
        return f"the FP8 grouped GEMM writes bfloat16; parameters are {dtype}"
    if any(d % 16 for d in dims):
        return f"in/out features {dims} are not multiples of 16 (FP8 kernel alignment)"
    if backend_name not in ("grouped_mm", "triton"):
        return f"the high-precision backend is {backend_name} (forced or unavailable)"
    return None


def _block_native_reason(device: torch.device, dtype: torch.dtype, backend_name: str
                         ) -> str | None:
    """Why the blockwise FP8 Triton GEMMs do not run here (``None`` when they do)."""
    reason = fp8_block_triton.unsupported_reason(device)
    if reason is not None:
        return reason
    if dtype != torch.bfloat16:
        return f"the blockwise FP8 Triton GEMMs write bfloat16; parameters are {dtype}"
    if backend_name not in ("grouped_mm", "triton"):
        return f"the high-precision backend is {backend_name} (forced or unavailable)"
    return None


def _reason(a: QuantizedTensorStorage, b: QuantizedTensorStorage, dims: tuple[int, ...],
            backend: Any) -> str | None:
    mode = env.read("TE_OPS_QUANTIZED_GEMM")
    if mode == "emulate":
        return "TE_OPS_QUANTIZED_GEMM=emulate"
    dev = (a.rowwise_data if a.rowwise_data is not None else a.columnwise_data).device
    reason = native_unsupported_reason(a.format, dev, a.dtype, dims, backend.name)
    if reason is not None and mode == "native":
        raise RuntimeError(f"TE_OPS_QUANTIZED_GEMM=native cannot run: {reason}")
    return reason


def _zero_padding(out: torch.Tensor, splits: Any) -> torch.Tensor:
    """Zero the output rows past the split-size total: only those rows are written (the
    tail-only kernel of ``kernels/padding.py``, as in the high-precision GEMMs)."""
    if splits.has_padding is False:
        return out
    mask = splits.padding_rows() if padding_backend(out) == "mask" else None
    return zero_padding_rows_(out, splits.offsets, mask)


def quantized_grouped_gemm(kind: str, a: QuantizedTensorStorage, b: QuantizedTensorStorage,
                           splits: Any, backend: Any,
                           fallback: Callable[..., torch.Tensor]) -> torch.Tensor:
    """One grouped GEMM (``kind`` = ``"fprop"``, ``"dgrad"`` or ``"wgrad"``) on quantized
    operands, with the argument order and output of the matching function of
    ``gemm/dispatch.py`` (``fallback``, used on dequantized operands when emulating).

    fprop: a = x (M, K) row-wise, b = W (G, N, K) row-wise -> (M, N).
    dgrad: a = dy (M, N) row-wise, b = W column-wise -> (M, K).
    wgrad: a = x (M, K) column-wise, b = dy (M, N) column-wise -> (G, N, K).
    """
    if not (is_quantized(a) and is_quantized(b)):
        raise TypeError(f"{kind}: both operands must be quantized (a recipe quantizes all "
                        f"operands of a GEMM), got {type(a).__name__} and {type(b).__name__}")
    dims = tuple(b.shape[1:]) if kind != "wgrad" else (a.shape[1], b.shape[1])
    if a.format == "fp8_block":
        native = _reason(a, b, dims, backend) is None
        return (block_grouped_gemm_native if native else block_grouped_gemm_emulated)(
            kind, a, b, splits)
    if _reason(a, b, dims, backend) is not None:
        copies = {"fprop": ("rowwise", "rowwise"), "dgrad": ("rowwise", "columnwise"),
                  "wgrad": ("columnwise", "columnwise")}[kind]
        return fallback(a.dequantize(copy=copies[0]), b.dequantize(copy=copies[1]), splits,
                        backend)
    dtype = a.dtype
    if kind == "wgrad":
        if a.shape[0] == 0:
            return torch.zeros(splits.num_groups, b.shape[1], a.shape[1], dtype=dtype,
                               device=a.columnwise_data.device)
        layout = splits_layout(splits, _ALIGN_FP8)
        return torch._scaled_grouped_mm(
            b.columnwise_data, a.columnwise_data.t(), b.columnwise_scale_inv.reshape(-1),
            a.columnwise_scale_inv.reshape(-1), offs=layout.offsets, out_dtype=dtype,
            use_fast_accum=bool(getattr(a.quantizer, "fast_accumulate_backward", False)))
    # fprop reads W row-wise (G, N, K); dgrad its column-wise copy (G, K, N). Both go in as
    # the column-major (G, K_red, N_out) view the kernel wants. Fast accumulation in fprop; in
    # backward only with Float8CurrentScaling(fast_accumulate_backward=True).
    fprop = kind == "fprop"
    data = b.rowwise_data if fprop else b.columnwise_data
    w_scale = b.rowwise_scale_inv if fprop else b.columnwise_scale_inv
    fast = fprop or bool(getattr(a.quantizer, "fast_accumulate_backward", False))
    w, n = data.transpose(-2, -1), b.shape[1] if fprop else b.shape[2]
    if a.shape[0] == 0:
        return torch.zeros(0, n, dtype=dtype, device=a.rowwise_data.device)
    out = torch._scaled_grouped_mm(a.rowwise_data, w, a.rowwise_scale_inv, w_scale,
                                   offs=splits.offsets, out_dtype=dtype, use_fast_accum=fast)
    return _zero_padding(out, splits)


def _block_operands(kind: str, a: QuantizedTensorStorage, b: QuantizedTensorStorage
                    ) -> tuple[torch.Tensor, ...]:
    """(data, scale_inv) of the two operands as the blockwise GEMM ``kind`` reads them:
    fprop x row-wise, W row-wise; dgrad dy row-wise, W column-wise (the 128 x 128 blocks
    transposed); wgrad x and dy column-wise (128-token tiles in the aligned layout)."""
    if kind == "wgrad":
        return a.columnwise_data, a.columnwise_scale_inv, b.columnwise_data, b.columnwise_scale_inv
    w, sw = ((b.rowwise_data, b.rowwise_scale_inv) if kind == "fprop"
             else (b.columnwise_data, b.columnwise_scale_inv))
    return a.rowwise_data, a.rowwise_scale_inv, w, sw


def block_grouped_gemm_native(kind: str, a: QuantizedTensorStorage, b: QuantizedTensorStorage,
                              splits: Any) -> torch.Tensor:
    """The blockwise FP8 GEMM ``kind`` in te_ops' Triton kernels (operands and result as
    :func:`quantized_grouped_gemm`'s)."""
    qa, sa, qb, sb = _block_operands(kind, a, b)
    if kind == "wgrad":
        layout = splits_layout(splits, FP8_BLOCK)
        return fp8_block_triton.block_wgrad(qa, sa, qb, sb, layout.starts, layout.offsets,
                                            a.dtype)
    return fp8_block_triton.block_rows(qa, sa, qb, sb, splits.offsets, a.dtype)


def block_grouped_gemm_emulated(kind: str, a: QuantizedTensorStorage,
                                b: QuantizedTensorStorage, splits: Any) -> torch.Tensor:
    """The blockwise FP8 GEMM ``kind`` (``"fprop"``, ``"dgrad"``, ``"wgrad"``) in torch ops,
    the native kernels' loop with fp32 products (module docstring), on any device.

    Operands and result as :func:`quantized_grouped_gemm`'s: fprop / dgrad (M, J) in
    ``a.dtype`` with padding rows zero, wgrad (G, N, K), zero for empty groups.
    """
    qa, sa, qb, sb = _block_operands(kind, a, b)
    layout = splits_layout(splits, FP8_BLOCK)
    tile_group = layout.group_ids[::FP8_BLOCK]  # (tiles,): G for the layout's unused tail
    if kind == "wgrad":
        return _block_wgrad_emulated(qa, sa, qb, sb, tile_group, splits.num_groups
                                     ).to(a.dtype)
    return _block_rows_emulated(qa, sa, qb, sb, layout, tile_group).to(a.dtype)


def _block_rows_emulated(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor,
                         sb: torch.Tensor, layout: Any, tile_group: torch.Tensor
                         ) -> torch.Tensor:
    """fp32 (M, J): per group ``a_g @ b_g^T`` for qa (M, R), sa (M, nR), qb (G, J, R),
    sb (G, nJ, nR). The rows go to the 128-row aligned layout, so each tile of 128 rows has
    one group and one batched product per reduction block covers every tile."""
    r, j = qa.shape[1], qb.shape[1]
    tiles = layout.capacity // FP8_BLOCK
    a32 = torch.cat([qa.float(), qa.new_zeros(1, r, dtype=torch.float32)])[layout.src]
    a32 = a32.reshape(tiles, FP8_BLOCK, r)
    sa_t = torch.cat([sa, sa.new_ones(1, sa.shape[1])])[layout.src].reshape(tiles, FP8_BLOCK, -1)
    sb_t = torch.cat([sb, sb.new_ones(1, *sb.shape[1:])])[tile_group]
    sb_t = sb_t.repeat_interleave(FP8_BLOCK, dim=1)[:, :j]  # (tiles, J, nR)
    acc = a32.new_zeros(tiles, FP8_BLOCK, j)
    for kb in range(sa.shape[1]):
        cols = slice(kb * FP8_BLOCK, (kb + 1) * FP8_BLOCK)
        b32 = qb[:, :, cols].float()  # group G (the unused tail's tiles) reads zeros
        b32 = torch.cat([b32, b32.new_zeros(1, *b32.shape[1:])])[tile_group]
        part = torch.bmm(a32[:, :, cols], b32.transpose(1, 2))
        acc = acc + part * (sa_t[:, :, kb, None] * sb_t[:, None, :, kb])
    out = torch.cat([acc.reshape(layout.capacity, j), acc.new_zeros(1, j)])
    return out[layout.dest]


def _block_wgrad_emulated(qx: torch.Tensor, sx: torch.Tensor, qdy: torch.Tensor,
                          sdy: torch.Tensor, tile_group: torch.Tensor, groups: int
                          ) -> torch.Tensor:
    """fp32 (G, N, K): per group ``dy_g^T x_g`` for the column-wise copies qx (K, C),
    qdy (N, C) and their (K, C / 128), (N, C / 128) scales; tile t (tokens [128 t, 128 t +
    128) of the aligned layout) adds into its group, tiles in increasing order."""
    k, n = qx.shape[0], qdy.shape[0]
    x32, dy32 = qx.float(), qdy.float()
    out = x32.new_zeros(groups + 1, n, k)  # row G: the layout's unused tail tiles
    for t in range(sx.shape[1]):
        cols = slice(t * FP8_BLOCK, (t + 1) * FP8_BLOCK)
        part = dy32[:, cols] @ x32[:, cols].t()
        out.index_add_(0, tile_group[t:t + 1], (part * (sdy[:, t, None] * sx[None, :, t]))[None])
    return out[:groups]


#: GEMMs whose smaller feature dim is below this were slower in FP8 than in bf16 on an H200
#: (quantize passes and per-call host work outweigh the faster GEMM; docs/recipes.md): E8 H4096
#: FF14336 ran 1.11-1.20x faster, E32 H7168 FF2048 0.91-0.96x, E128 H2048 FF768 0.34-0.46x.
SMALL_GEMM_DIM = 4096


def quantized_gemm_note(recipe: Any, device: torch.device | None, dtype: torch.dtype | None,
                        in_features: int, out_features: int, backend_name: str) -> str:
    """One ``explain()`` line: how this GroupedLinear's GEMMs run under ``recipe``."""
    name = type(recipe).__name__
    fmt = recipe.format
    if device is None or dtype is None:
        return f"recipe {name}: GEMM path decided at the first call"
    reason = native_unsupported_reason(fmt, device, dtype, (in_features, out_features),
                                       backend_name)
    if reason is not None:
        return f"recipe {name}: emulated ({reason})"
    if fmt == "fp8_block":
        return (f"recipe {name}: blockwise FP8 GEMMs in te_ops' Triton kernels "
                "(te_ops.quantization.fp8_block_triton)")
    note = f"recipe {name}: FP8 GEMMs via torch._scaled_grouped_mm"
    if min(in_features, out_features) < SMALL_GEMM_DIM:
        note += (f"; small GEMM (min(in, out) = {min(in_features, out_features)} < "
                 f"{SMALL_GEMM_DIM}): FP8 measured slower than bf16 on H200 (quantize passes "
                 "and host work outweigh the faster GEMM; docs/recipes.md)")
    return note
