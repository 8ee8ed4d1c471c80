"""Triton kernels for FP8 current scaling on CUDA: one kernel per quantized copy.

The PyTorch ops of :mod:`te_ops.quantization.numerics` take about ten passes over a tensor (abs,
isfinite, amax, multiply, clamp, cast, ...); these kernels read the input twice (amax, then
quantize) and write the FP8 bytes once. They produce the same bytes as the PyTorch path (checked
by ``tests/test_quantization_cuda.py``): same power-of-two scale rule (computed here from the
amax's exponent and mantissa bits: ``floor(log2(448 / amax))`` is ``126 - e + 8`` when the
mantissa fraction is above 0.75, else ``126 - e + 9``, with ``e`` the biased exponent), the same
saturation and NaN / Inf handling, and the hardware's round-to-nearest-even conversion. Row-wise
rows of up to 16384 elements are read once (kept in registers), longer ones twice; the
column-wise kernel reads twice (amax over a group's rows first) and transposes each tile in
registers so its stores are contiguous.

* :func:`fp8_rows`: along the last dim of a contiguous (rows, K) tensor.
* :func:`fp8_columns_grouped`: per group of rows, along the rows, written transposed: the
  column-wise copy of split activations (into the group-aligned layout) and of (G, N, K) weights.

Registered with ``torch.library.triton_op`` so ``torch.compile`` sees them as ops with fake
kernels; no host sync (group sizes are read inside the kernel).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None
    tl = None

__all__ = ["unsupported_reason", "fp8_rows", "fp8_columns_grouped"]


def unsupported_reason(x: torch.Tensor) -> str | None:
    """Why the Triton FP8 quantize kernels cannot take ``x`` (``None`` when they can)."""
    if triton is None:
        return "triton is not installed"
    if x.device.type != "cuda":
        return f"device type {x.device.type} is not cuda"
    if x.dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {x.dtype} is not float32 / bfloat16"
    if not x.is_contiguous():
        return "input is not contiguous"
    if x.numel() == 0:
        return "empty input"
    return None


if triton is not None:

    @triton.jit
    def _pow2_scale(amax):
        bits = amax.to(tl.int32, bitcast=True)
        eb = bits >> 23
        mant = bits & 0x7FFFFF
        sexp = 126 - eb + tl.where(mant > 0x600000, 8, 9)
        sexp = tl.minimum(tl.maximum(sexp, -126), 127)
        sexp = tl.where(amax > 0, sexp, 0)
        scale = ((sexp + 127) << 23).to(tl.float32, bitcast=True)
        inv = -sexp
        inv_bits = tl.where(inv >= -126, (inv + 127) << 23, 0x400000)
        return scale, inv_bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _finite_abs(v):
        a = tl.abs(v)
        return tl.where(a < float("inf"), a, 0.0)  # NaN and Inf -> 0

    @triton.jit
    def _to_e4m3(v, scale):
        s = v * scale
        s = tl.minimum(tl.maximum(s, -448.0), 448.0)
        s = tl.where(tl.abs(v) < float("inf"), s, float("nan"))
        return s.to(tl.float8e4nv)

    @triton.jit
    def _fp8_rows_kernel(x_ptr, q_ptr, sinv_ptr, K, BLOCK_K: tl.constexpr,
                         ONE_PASS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = row * K
        if ONE_PASS:  # the whole row fits in registers: read it once
            offs = tl.arange(0, BLOCK_K)
            mask = offs < K
            v = tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
            scale, sinv = _pow2_scale(tl.max(_finite_abs(v), 0))
            tl.store(sinv_ptr + row, sinv)
            tl.store(q_ptr + base + offs, _to_e4m3(v, scale), mask=mask)
        else:
            acc = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs = k0 + tl.arange(0, BLOCK_K)
                v = tl.load(x_ptr + base + offs, mask=offs < K, other=0.0).to(tl.float32)
                acc = tl.maximum(acc, _finite_abs(v))
            scale, sinv = _pow2_scale(tl.max(acc, 0))
            tl.store(sinv_ptr + row, sinv)
            for k0 in range(0, K, BLOCK_K):
                offs = k0 + tl.arange(0, BLOCK_K)
                mask = offs < K
                v = tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(q_ptr + base + offs, _to_e4m3(v, scale), mask=mask)

    @triton.jit
    def _fp8_cols_kernel(x_ptr, q_ptr, sinv_ptr, starts_ptr, sizes_ptr, pstarts_ptr, K,
                         OUT_G_STRIDE, OUT_COL_STRIDE, BLOCK_R: tl.constexpr,
                         BLOCK_C: tl.constexpr):
        g = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < K
        start = tl.load(starts_ptr + g).to(tl.int64)
        size = tl.load(sizes_ptr + g).to(tl.int64)
        pstart = tl.load(pstarts_ptr + g).to(tl.int64)
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for r0 in range(0, size, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            mask = (rows < size)[:, None] & cmask[None, :]
            v = tl.load(x_ptr + (start + rows)[:, None] * K + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.max(_finite_abs(v), 0))
        scale, sinv = _pow2_scale(acc)
        tl.store(sinv_ptr + g * K + cols, sinv, mask=cmask)
        out_base = g.to(tl.int64) * OUT_G_STRIDE + pstart
        for r0 in range(0, size, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            mask = (rows < size)[:, None] & cmask[None, :]
            v = tl.load(x_ptr + (start + rows)[:, None] * K + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            # Transpose in registers (through shared memory) so each column's bytes are
            # written as one contiguous run: coalesced stores.
            q = _to_e4m3(tl.trans(v), scale[:, None])  # (BLOCK_C, BLOCK_R)
            tl.store(q_ptr + out_base + cols[:, None].to(tl.int64) * OUT_COL_STRIDE
                     + rows[None, :], q, mask=cmask[:, None] & (rows < size)[None, :])

    @torch.library.triton_op("te_ops::fp8_quantize_rows", mutates_args={})
    def _fp8_rows_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = x.shape[-1]
        rows = x.numel() // k
        q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        sinv = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(k)
        one_pass = block <= 16384
        block = block if one_pass else 4096
        torch.library.wrap_triton(_fp8_rows_kernel)[(rows,)](
            x, q, sinv, k, BLOCK_K=block, ONE_PASS=one_pass, num_warps=8 if block <= 8192 else 16)
        return q, sinv

    @torch.library.triton_op("te_ops::fp8_quantize_columns_grouped", mutates_args={"out"})
    def _fp8_cols_op(x: torch.Tensor, out: torch.Tensor, starts: torch.Tensor,
                     sizes: torch.Tensor, pstarts: torch.Tensor, out_g_stride: int,
                     out_col_stride: int) -> torch.Tensor:
        g = sizes.numel()
        k = x.shape[-1]
        sinv = torch.empty(g, k, dtype=torch.float32, device=x.device)
        grid = (g, triton.cdiv(k, 64))
        torch.library.wrap_triton(_fp8_cols_kernel)[grid](
            x, out, sinv, starts, sizes, pstarts, k, out_g_stride, out_col_stride,
            BLOCK_R=128, BLOCK_C=64, num_warps=8)
        return sinv


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise FP8 current scaling: x (..., K) contiguous fp32/bf16 on CUDA -> (data (..., K)
    float8_e4m3fn, scale_inv (...,) fp32); same bytes as ``numerics.fp8_quantize_rows``."""
    return _fp8_rows_op(x)


def fp8_columns_grouped(x2d: torch.Tensor, out: torch.Tensor, starts: torch.Tensor,
                        sizes: torch.Tensor, pstarts: torch.Tensor, out_g_stride: int,
                        out_col_stride: int) -> torch.Tensor:
    """Column-wise FP8 per group of rows of ``x2d`` (rows, K), written transposed into ``out``.

    Group ``g`` covers rows ``starts[g] : starts[g] + sizes[g]``; element (r, k) of the group
    lands at flat index ``g * out_g_stride + k * out_col_stride + pstarts[g] + r`` of ``out``
    (float8_e4m3fn, pre-zeroed where nothing is written). Returns scale_inv (G, K) fp32.
    """
    return _fp8_cols_op(x2d, out, starts, sizes, pstarts, out_g_stride, out_col_stride)
