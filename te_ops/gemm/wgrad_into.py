"""Grouped wgrad written into caller-owned buffers (Megatron's ``main_grad``).

``grouped_wgrad_into(targets, x, dy, splits, backend, accumulate)`` computes, for every group
``g``, ``dW_g = dy_g^T @ x_g`` and adds it to (``accumulate[g]``) or writes it over
``targets[g]``. The targets usually are fp32 ``main_grad`` tensors of bf16/fp16/fp32 weights.

How each backend writes into the targets
----------------------------------------
``loop``
    Same dtype: ``target.addmm_(dy_g^T, x_g, beta=1 or 0)``, the GEMM's own output is the
    target (no separate wgrad). Different dtypes (bf16 weights, fp32 ``main_grad``): a per-group
    product in the weights' dtype, added in fp32 (``torch.addmm`` has no mixed-dtype CPU kernel).
    A zero-token group is skipped (accumulate) or zeroed (overwrite): its target is unchanged
    bit for bit when accumulating.
``grouped_mm``
    ``torch._grouped_mm`` has no ``out=``: one (G, N, K) product for all groups, in the
    target's dtype where ``out_dtype`` is accepted (bf16 operands with fp32 output on CUDA,
    found by a one-time probe), else in the operands' dtype, then one ``add_`` / ``copy_``
    (also when the targets are adjacent in reverse order, as Megatron's gradient buffer lays
    out parameters: then on the product flipped along the groups; per group otherwise).
    A zero-token group's product is zero, so accumulating leaves its target unchanged.
``triton``
    As ``grouped_mm`` where the targets' dtype differs and ``torch._grouped_mm`` takes it
    (out_dtype probe, 16-byte aligned rows): the Triton wgrad kernels write the operands'
    dtype only. Otherwise the backend's wgrad (few-rows or persistent Triton kernel), then one
    ``add_`` / ``copy_``.

Graph-safe exactly when the backend is (no host reads beyond the loop backend's own).
"""

from __future__ import annotations

import torch

from ..quantization.gemm import is_quantized
from ..splits import GroupedSplits
from .dispatch import (
    BackendChoice,
    as_rows,
    grouped_mm_operands,
    grouped_mm_unsupported_reason,
    grouped_wgrad,
)

__all__ = ["grouped_wgrad_into", "grouped_mm_out_dtype_reason"]

_OUT_DTYPE_PROBE: dict[tuple[str, int | None, torch.dtype, torch.dtype], str | None] = {}


def grouped_mm_out_dtype_reason(device: torch.device, dtype: torch.dtype,
                                out_dtype: torch.dtype) -> str | None:
    """Why ``torch._grouped_mm(..., out_dtype=out_dtype)`` cannot run for ``dtype`` operands
    on ``device`` (``None`` when it can). Probed once per key, never during graph capture."""
    if dtype == out_dtype:
        return None
    key = (device.type, device.index, dtype, out_dtype)
    if key in _OUT_DTYPE_PROBE:
        return _OUT_DTYPE_PROBE[key]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "not probed before CUDA graph capture (run once eagerly)"
    reason = None
    try:
        a = torch.zeros(32, 16, device=device, dtype=dtype)
        offs = torch.arange(1, 3, device=device, dtype=torch.int32) * 16
        out = torch._grouped_mm(a.t(), a, offs=offs, out_dtype=out_dtype)
        if out.dtype != out_dtype:
            reason = f"torch._grouped_mm returned {out.dtype} for out_dtype={out_dtype}"
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        reason = str(exc).splitlines()[0][:200]
    _OUT_DTYPE_PROBE[key] = reason
    return reason


def _stacked(targets: list[torch.Tensor]) -> torch.Tensor | None:
    """The targets as one (G, N, K) view when they are adjacent slices of one buffer with
    one dtype and shape (a target re-viewed at its address, e.g. ``.view(K, N)``, must not
    be written through target 0's layout)."""
    t0 = targets[0]
    if t0.device.type == "meta" or not all(t.is_contiguous() for t in targets):
        return None
    if {(t.dtype, t.shape) for t in targets} != {(t0.dtype, t0.shape)}:
        return None
    step = t0.numel() * t0.element_size()
    if [t.data_ptr() for t in targets] != [t0.data_ptr() + g * step
                                          for g in range(len(targets))]:
        return None
    if any(t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr()
           for t in targets):
        return None
    return t0.as_strided((len(targets), *t0.shape), (t0.numel(), *t0.stride()))


def _write(target: torch.Tensor, value: torch.Tensor, accumulate: bool) -> None:
    if accumulate:
        target.add_(value)
    else:
        target.copy_(value)


def grouped_wgrad_into(targets: list[torch.Tensor], x: torch.Tensor, dy: torch.Tensor,
                       splits: GroupedSplits, backend: BackendChoice,
                       accumulate: list[bool]) -> None:
    """``targets[g] (+)= dy_g^T @ x_g`` for every group.

    Parameters
    ----------
    targets : list of G tensors of shape (N, K), any float dtype, any strides
        Written in place (``None`` entries are skipped: frozen experts).
    x : (M, K), dy : (M, N)
        Same dtype (either may be a :class:`~te_ops.gemm.dispatch.RowGather`); padding rows (past the split-size sum) do not contribute. Under a
        low-precision recipe, the quantized storages of ``te_ops.quantization`` (the recipe's
        grouped GEMM runs, then its result is written into the targets).
    accumulate : list of G bools
        Add into the target (True) or overwrite it (False).
    """
    live = [g for g, t in enumerate(targets) if t is not None]
    if not live:
        return
    # a row-gathered operand (te_ops.gemm.RowGather): its rows, gathered into a transient copy
    # (the product is written into the targets by the paths below, which take plain tensors)
    x, dy = as_rows(x), as_rows(dy)
    if (is_quantized(x) or is_quantized(dy)  # a recipe's operands: its own GEMM, then one add
            or backend.registered_kernel("wgrad") is not None):  # a registered kernel's
        wgrad = grouped_wgrad(x, dy, splits, backend)
    elif backend.name == "loop":
        _loop_into(targets, x, dy, splits, accumulate)
        return
    else:
        wgrad = _high_precision_wgrad(targets, live, x, dy, splits, backend)
    if len(live) == len(targets) and len(set(accumulate)) == 1:
        stacked = _stacked(targets)
        if stacked is not None:
            _write(stacked, wgrad, accumulate[0])
            return
        stacked = _stacked(targets[::-1])  # Megatron lays parameters out in reverse order
        if stacked is not None:
            _write(stacked, wgrad.flip(0), accumulate[0])
            return
    for g in live:
        _write(targets[g], wgrad[g], accumulate[g])


def _high_precision_wgrad(targets: list[torch.Tensor | None], live: list[int], x: torch.Tensor,
                          dy: torch.Tensor, splits: GroupedSplits,
                          backend: BackendChoice) -> torch.Tensor:
    """(G, N, K) wgrad, straight in the targets' dtype where ``torch._grouped_mm`` allows:
    the out_dtype probe passes and the rows are 16-byte aligned (a forced ``triton`` backend
    takes in/out features that ``torch._grouped_mm`` rejects; its wgrad then runs there and
    is added in the targets' dtype)."""
    out_dtype = targets[live[0]].dtype
    same = all(targets[g].dtype == out_dtype for g in live)
    if (same and out_dtype != x.dtype and x.shape[0] > 0
            and grouped_mm_out_dtype_reason(x.device, x.dtype, out_dtype) is None
            and grouped_mm_unsupported_reason(x.device, x.dtype, x.shape[1], dy.shape[1])
            is None):
        (x, dy), _ = grouped_mm_operands(("x", x), ("dy", dy))  # misaligned views: copied
        return torch._grouped_mm(dy.t(), x, offs=splits.offsets, out_dtype=out_dtype)
    return grouped_wgrad(x, dy, splits, backend)


def _loop_into(targets: list[torch.Tensor | None], x: torch.Tensor, dy: torch.Tensor,
               splits: GroupedSplits, accumulate: list[bool]) -> None:
    start = 0
    for g, m in enumerate(splits.sizes_on_host()):
        target = targets[g]
        rows = slice(start, start + m)
        start += m
        if target is None:
            continue
        if m == 0:
            if not accumulate[g]:
                target.zero_()
            continue
        a, b = dy[rows].t(), x[rows]
        if target.dtype == x.dtype:
            target.addmm_(a, b, beta=1 if accumulate[g] else 0)
        else:
            _write(target, torch.mm(a, b), accumulate[g])
