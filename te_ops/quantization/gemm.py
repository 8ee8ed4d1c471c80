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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import env
from ..kernels.padding import padding_backend, zero_padding_rows_
from .layout import splits_layout
from .quantizer import QuantizedTensorStorage

__all__ = ["native_unsupported_reason", "quantized_grouped_gemm", "is_quantized"]

_ALIGN_FP8 = 16


def is_quantized(t: Any) -> bool:
    """True for a :class:`QuantizedTensorStorage` operand."""
    return isinstance(t, QuantizedTensorStorage)


def native_unsupported_reason(fmt: str, device: torch.device, dtype: torch.dtype,
                              dims: tuple[int, ...], backend_name: str = "grouped_mm"
                              ) -> str | None:
    """Why no native scaled grouped GEMM runs here (``None`` when one does)."""
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
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"torch._scaled_grouped_mm runs on SM90 / SM100, not SM{major}{minor}"
    if dtype != torch.bfloat16:
        return f"the FP8 grouped GEMM writes bfloat16; parameters are {dtype}"
    if any(d % 16 for d in dims):
        return f"in/out features {dims} are not multiples of 16 (FP8 kernel alignment)"
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
    note = f"recipe {name}: FP8 GEMMs via torch._scaled_grouped_mm"
    if min(in_features, out_features) < SMALL_GEMM_DIM:
        note += (f"; small GEMM (min(in, out) = {min(in_features, out_features)} < "
                 f"{SMALL_GEMM_DIM}): FP8 measured slower than bf16 on H200 (quantize passes "
                 "and host work outweigh the faster GEMM; docs/recipes.md)")
    return note
