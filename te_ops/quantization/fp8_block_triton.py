"""Blockwise FP8 grouped GEMMs in Triton: the native GEMMs of ``Float8BlockScaling`` on SM90.

torch 2.11-2.13 has no grouped GEMM with blockwise scales: ``torch._scaled_grouped_mm`` (and
``torch.nn.functional.scaled_grouped_mm``, ``_scaled_grouped_mm_v2``) takes row-wise and MX /
NV block scales only; the 1 x 128 / 128 x 128 scalings (``ScalingType.BlockWise1x128`` /
``BlockWise128x128``) exist for the dense ``torch._scaled_mm`` alone. These kernels fill that
gap for the three GEMMs of a grouped linear layer, with device offsets (no host sync, launch
sizes from the host: graph-safe).

The math (DeepSeek-V3, arXiv:2412.19437, section 3.3.2 "increasing accumulation precision";
what TransformerEngine's blockwise cuBLAS GEMM and DeepGEMM do): the reduction dim is walked
in blocks of 128 (one scale per operand tile and block); each block's product of the FP8
values is one ``tl.dot`` (FP8 tensor cores, the hardware's own accumulation inside the block),
then it is multiplied by the product of the two tiles' ``scale_inv`` and added to an fp32
accumulator, block after block in increasing order::

    acc = 0;  for kb in 0, 1, ...:  acc += dot(qa[:, kb], qb[kb, :]) * (sa[:, kb] * sb[kb, :])

The output is ``acc`` rounded to bfloat16 once. ``te_ops.quantization.gemm``'s emulation runs
the same loop with fp32 matrix products (exact products of FP8 values, fp32 sums).

* :func:`block_rows`: fprop ``y_g = x_g W_g^T`` and dgrad ``dx_g = dy_g W_g``: ``a`` (M, R)
  FP8 with 1 x 128 ``scale_inv`` (M, ceil(R / 128)), ``b`` (G, J, R) FP8 (fprop: W's row-wise
  copy (G, N, K); dgrad: its column-wise copy (G, K, N)) with 128 x 128 ``scale_inv``
  (G, ceil(J / 128), ceil(R / 128)); out (M, J). Program (g, column block, s) walks group g's
  rows in ``BLOCK_M`` blocks s, s + SPLIT, ...; ``g == G`` writes zeros to the padding rows
  past ``offsets[-1]``. Its column block is one 128-wide weight block: one weight scale per
  reduction block.
* :func:`block_wgrad`: ``dW_g = dy_g^T x_g`` over the 128-row group-aligned column-wise copies
  (``quantization/layout.py``): ``x`` (K, C) and ``dy`` (N, C) FP8, ``scale_inv`` (K, C / 128)
  and (N, C / 128), the group's aligned rows ``[starts[g], ends[g])``; out (G, N, K), zero for
  empty groups. Each 128-token tile lies in one group (the layout starts every group at a
  multiple of 128), so a tile's scales never mix two experts.

Operands are read with masked pointer loads, K-contiguous (what FP8 wgmma takes), so no
shape needs any alignment. Registered as ``torch.library.triton_op`` (``te_ops::fp8_block_rows``,
``te_ops::fp8_block_wgrad``; the bodies, run on FakeTensors, are the fake kernels); eager calls
launch through :func:`te_ops.kernels.triton_launch.launch`.
"""

from __future__ import annotations

import torch

from ..kernels.triton_launch import capability, cdiv, launch
from ..tracing import tracing

try:  # Triton is optional: CPU-only installs have no use for it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

__all__ = ["unsupported_reason", "block_rows", "block_wgrad", "rows_config", "wgrad_config"]

#: The tile edge of the scales (numerics.FP8_BLOCK); the kernels' reduction step and the rows
#: kernel's column block.
BLOCK = 128


def unsupported_reason(device: torch.device) -> str | None:
    """Why the blockwise FP8 Triton GEMMs cannot run on ``device`` (``None`` when they can)."""
    if device.type != "cuda":
        return f"no blockwise FP8 grouped GEMM kernel on {device.type}"
    if triton is None:
        return "triton is not installed"
    if torch.version.hip:
        return "the blockwise FP8 Triton GEMMs are not wired up for ROCm"
    major, minor = capability(device)
    if major != 9:
        return (f"te_ops' blockwise FP8 Triton GEMMs are verified on SM90 (H200) only, not "
                f"SM{major}{minor}")
    return None


def rows_config(rows: int, groups: int) -> dict[str, int]:
    """Launch parameters of the fprop / dgrad kernel: 64-row blocks, up to 8 programs per
    (group, column block) sharing a group's row blocks. Not tuned (no measurement yet)."""
    block_m = 64
    split = max(1, min(8, cdiv(max(rows, 1), max(groups, 1) * block_m)))
    return {"BLOCK_M": block_m, "SPLIT": split, "num_warps": 4, "num_stages": 3}


def wgrad_config() -> dict[str, int]:
    """Launch parameters of the wgrad kernel (128 x 128 output tiles). Not tuned."""
    return {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3}


if triton is not None:

    @triton.jit
    def _group_rows(offs_ptr, g, G, M):
        """Rows [start, end) of group ``g`` (``g == G``: the padding tail), clamped to
        ``0 <= start <= end <= M`` (bad device offsets never address memory outside)."""
        start = tl.load(offs_ptr + tl.maximum(g - 1, 0)).to(tl.int64)
        start = tl.where(g == 0, 0, start)
        end = tl.load(offs_ptr + tl.minimum(g, G - 1)).to(tl.int64)
        end = tl.minimum(tl.maximum(tl.where(g == G, M, end), 0), M)
        return tl.minimum(tl.maximum(start, 0), end), end

    @triton.jit
    def _fp8_block_rows_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, out_ptr, offs_ptr, M, J, R, G,
                               NRB, NJB, stride_bg, stride_bj, BLOCK_M: tl.constexpr,
                               SPLIT: tl.constexpr):
        """out[m, j] = sum over 128-blocks kb of dot(a[m, kb], b[g, j, kb]) * sa[m, kb] *
        sb[g, j // 128, kb] for the rows m of group g (a (M, R), sa (M, NRB), sb (G, NJB,
        NRB), out (M, J) contiguous; b[g, j, r] at ``g * stride_bg + j * stride_bj + r``)."""
        g = tl.program_id(0)
        jb = tl.program_id(1)
        cols = jb * 128 + tl.arange(0, 128)
        col_ok = cols < J
        start, end = _group_rows(offs_ptr, g, G, M)
        rk = tl.arange(0, 128)
        b_base = b_ptr + g.to(tl.int64) * stride_bg
        sb_base = sb_ptr + (g.to(tl.int64) * NJB + jb) * NRB
        for m0 in range(start + tl.program_id(2) * BLOCK_M, end, SPLIT * BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < end
            acc = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
            if g < G:
                for kb in range(0, NRB):
                    r = kb * 128 + rk
                    r_ok = r < R
                    a = tl.load(a_ptr + rows[:, None] * R + r[None, :],
                                mask=row_ok[:, None] & r_ok[None, :], other=0.0)
                    b = tl.load(b_base + cols[None, :].to(tl.int64) * stride_bj + r[:, None],
                                mask=r_ok[:, None] & col_ok[None, :], other=0.0)
                    part = tl.dot(a, b)
                    sa = tl.load(sa_ptr + rows * NRB + kb, mask=row_ok, other=0.0)
                    sb = tl.load(sb_base + kb)
                    acc += part * (sa[:, None] * sb)
            tl.store(out_ptr + rows[:, None] * J + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _fp8_block_wgrad_kernel(x_ptr, sx_ptr, dy_ptr, sdy_ptr, out_ptr, starts_ptr,
                                ends_ptr, N, K, C, NT, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr):
        """out[g, n, k] = sum over group g's 128-token tiles t of dot(dy[n, t], x[k, t]) *
        sdy[n, t] * sx[k, t] (x (K, C), dy (N, C), sx (K, NT), sdy (N, NT), out (G, N, K)
        contiguous; the group's aligned tokens [starts[g], ends[g]) are whole tiles)."""
        g = tl.program_id(0)
        ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
        n_ok = ns < N
        k_ok = ks < K
        end = tl.minimum(tl.maximum(tl.load(ends_ptr + g).to(tl.int64), 0), C)
        start = tl.minimum(tl.maximum(tl.load(starts_ptr + g).to(tl.int64), 0), end)
        tt = tl.arange(0, 128)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for t0 in range(start, end, 128):
            t = t0 + tt
            d = tl.load(dy_ptr + ns[:, None].to(tl.int64) * C + t[None, :],
                        mask=n_ok[:, None], other=0.0)
            xv = tl.load(x_ptr + ks[None, :].to(tl.int64) * C + t[:, None],
                         mask=k_ok[None, :], other=0.0)
            part = tl.dot(d, xv)
            tile = t0 // 128
            s_d = tl.load(sdy_ptr + ns.to(tl.int64) * NT + tile, mask=n_ok, other=0.0)
            s_x = tl.load(sx_ptr + ks.to(tl.int64) * NT + tile, mask=k_ok, other=0.0)
            acc += part * (s_d[:, None] * s_x[None, :])
        out = out_ptr + g.to(tl.int64) * N * K + ns[:, None].to(tl.int64) * K + ks[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
           device: torch.device) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
        raise ValueError(f"{name} must be {dtype} of shape {shape} on {device}, got {t.dtype} "
                         f"of shape {tuple(t.shape)} on {t.device}")


def _check_bounds(device: torch.device, groups: int, **bounds: torch.Tensor) -> None:
    """Raise unless each of ``bounds`` is an int32 / int64 tensor of shape (groups,) and the
    kernels can run on ``device``."""
    for name, t in bounds.items():
        if t.shape != (groups,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64 of shape ({groups},), got {t.dtype} "
                             f"of shape {tuple(t.shape)}")
    why = unsupported_reason(device)
    if why is not None:
        raise RuntimeError(f"the blockwise FP8 Triton GEMMs cannot run: {why}")


def _rows_launch(a, sa, b, sb, offsets, out_dtype, kernel):
    m, r = a.shape
    groups, j = b.shape[0], b.shape[1]
    out = torch.empty(m, j, device=a.device, dtype=out_dtype)
    if m == 0 or j == 0:
        return out
    cfg = rows_config(m, groups)
    grid = (groups + 1, cdiv(j, BLOCK), cfg["SPLIT"])
    launch(kernel, grid, a, sa, b, sb, out, offsets, m, j, r, groups, sa.shape[1],
           sb.shape[1], b.stride(0), b.stride(1), **cfg)
    return out


def _wgrad_launch(x, sx, dy, sdy, starts, ends, out_dtype, kernel):
    k, c = x.shape
    n = dy.shape[0]
    groups = starts.shape[0]
    out = torch.empty(groups, n, k, device=x.device, dtype=out_dtype)
    if out.numel() == 0:
        return out
    cfg = wgrad_config()
    grid = (groups, cdiv(n, cfg["BLOCK_N"]), cdiv(k, cfg["BLOCK_K"]))
    launch(kernel, grid, x, sx, dy, sdy, out, starts, ends, n, k, c, sx.shape[1], **cfg)
    return out


def block_rows(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
               offsets: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Per group ``out_g = a_g @ b_g^T`` with blockwise scales (fprop, dgrad; module docstring).

    Shapes: a (M, R) float8_e4m3fn, sa (M, ceil(R / 128)) fp32, b (G, J, R) float8_e4m3fn with
    a unit stride along R, sb (G, ceil(J / 128), ceil(R / 128)) fp32, offsets (G,) int32 /
    int64 cumulative group ends -> out (M, J) ``out_dtype``; rows past ``offsets[-1]`` zero.

    Raises
    ------
    ValueError
        A shape, dtype, device or stride does not match (the message names the argument).
    RuntimeError
        The kernels cannot run here (:func:`unsupported_reason`).
    """
    m, r = a.shape
    if b.dim() != 3 or b.shape[0] == 0 or b.shape[2] != r or b.stride(2) != 1:
        raise ValueError(f"b must be (G >= 1, J, {r}) with unit stride along R, got shape "
                         f"{tuple(b.shape)} strides {b.stride()}")
    g, j = b.shape[:2]
    fp8 = torch.float8_e4m3fn
    _check("a", a, (m, r), fp8, a.device)
    _check("b", b, (g, j, r), fp8, a.device)
    _check("sa", sa, (m, cdiv(r, BLOCK)), torch.float32, a.device)
    _check("sb", sb, (g, cdiv(j, BLOCK), cdiv(r, BLOCK)), torch.float32, a.device)
    _check_bounds(a.device, g, offsets=offsets)
    a, sa, sb, offsets = a.contiguous(), sa.contiguous(), sb.contiguous(), offsets.contiguous()
    if tracing():
        return torch.ops.te_ops.fp8_block_rows(a, sa, b, sb, offsets, out_dtype)
    return _rows_launch(a, sa, b, sb, offsets, out_dtype, _fp8_block_rows_kernel)


def block_wgrad(x: torch.Tensor, sx: torch.Tensor, dy: torch.Tensor, sdy: torch.Tensor,
                starts: torch.Tensor, ends: torch.Tensor,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Per group ``dW_g = dy_g^T x_g`` with 128 x 1 token tiles (module docstring).

    Shapes: x (K, C), dy (N, C) float8_e4m3fn (column-wise copies in the 128-row aligned
    layout, C a multiple of 128), sx (K, C / 128), sdy (N, C / 128) fp32, starts / ends (G,)
    integer aligned group bounds (multiples of 128) -> (G, N, K) ``out_dtype``.

    Raises
    ------
    ValueError, RuntimeError
        As :func:`block_rows`.
    """
    k, c = x.shape
    n = dy.shape[0]
    fp8 = torch.float8_e4m3fn
    if c % BLOCK:
        raise ValueError(f"x must have a multiple of {BLOCK} columns (aligned tokens), got {c}")
    _check("x", x, (k, c), fp8, x.device)
    _check("dy", dy, (n, c), fp8, x.device)
    _check("sx", sx, (k, c // BLOCK), torch.float32, x.device)
    _check("sdy", sdy, (n, c // BLOCK), torch.float32, x.device)
    _check_bounds(x.device, starts.shape[0], starts=starts, ends=ends)
    args = [t.contiguous() for t in (x, sx, dy, sdy, starts, ends)]
    if tracing():
        return torch.ops.te_ops.fp8_block_wgrad(*args, out_dtype)
    return _wgrad_launch(*args, out_dtype, _fp8_block_wgrad_kernel)


if triton is not None:

    @torch.library.triton_op("te_ops::fp8_block_rows", mutates_args={})
    def _fp8_block_rows_op(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor,
                           sb: torch.Tensor, offsets: torch.Tensor,
                           out_dtype: torch.dtype) -> torch.Tensor:
        """:func:`block_rows` as an op (the body, run on FakeTensors, is the fake kernel)."""
        return _rows_launch(a, sa, b, sb, offsets, out_dtype,
                            torch.library.wrap_triton(_fp8_block_rows_kernel))

    @torch.library.triton_op("te_ops::fp8_block_wgrad", mutates_args={})
    def _fp8_block_wgrad_op(x: torch.Tensor, sx: torch.Tensor, dy: torch.Tensor,
                            sdy: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                            out_dtype: torch.dtype) -> torch.Tensor:
        """:func:`block_wgrad` as an op."""
        return _wgrad_launch(x, sx, dy, sdy, starts, ends, out_dtype,
                             torch.library.wrap_triton(_fp8_block_wgrad_kernel))
