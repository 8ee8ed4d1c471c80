"""fc2's grouped dgrad with the (Scaled)SwiGLU backward in its epilogue (persistent Triton).

The fused grouped MLP's backward at many rows per group runs fc2's dgrad in the persistent
kernel (``grouped_gemm_large_triton.large_dgrad``: ``da_g = dy_g @ W2_g``, da (T, F) in the
operands' dtype), then the Triton SwiGLU backward (``swiglu_triton._bwd_kernel``), which reads
fc1's output h (T, 2F), da and probs and writes dh (T, 2F), the probs gradient (T,) and the
recomputed activation output a (T, F) (fc2's wgrad input). :func:`large_dgrad_dswiglu` does
both in one launch, the dataflow of SonicMoE's backward: each (row tile, column tile) of da
is accumulated as ``large_dgrad`` accumulates it (same row and k tiles, ``BLOCK_K`` k-steps in
the same order, so the fp32 tile is the same), rounded to the output dtype (the bits
``large_dgrad`` stores), and the epilogue loads the matching gate columns ``h[:, j]`` and up
columns ``h[:, F + j]`` and the tile's probs and computes, with the SwiGLU backward kernel's
own per-element function (``swiglu_triton._dswiglu``), dh's two halves and a. da itself never
reaches memory: 2 T F bytes written and read less (470 MB each way at E8 T16384 FF14336).

Bits. dh and a equal the two launches' bit for bit (the same rounded da, the same function
on the same fp32 values). The probs gradient is a row sum over all F columns, which spans
the column tiles of different programs: each (column tile, row) writes its fp32 partial sum
to a (tiles_n, T) buffer, and a second small Triton launch adds each row's partials in
column-tile order (no atomics: deterministic, and the same kernel in eager and compiled
runs). That order differs from the SwiGLU kernel's (one program per row summing
``BLOCK``-wide column chunks), so dprobs is not bitwise the two launches' (fp32 sums of the
same terms in another order, then rounded to probs' dtype; the tests compare it with a
tolerance).

Padding rows past ``offsets[-1]``: da is zero there (as ``large_dgrad`` stores), and the
epilogue runs on those zeros and the padding rows' h, so dh, a and dprobs of those rows are
the two launches' too (NaN garbage in the output buffers is overwritten).

Schedule: the persistent kernel's (``grouped_gemm_large_triton`` module docstring): ``FLAT``
(the default; one ``tl.range(flatten=True)`` loop over the program's tiles found in an
in-register tile table, then the padding tiles) or the group walk (``FLAT=False``, taken above
``FLAT_MAX_GROUPS`` groups); ``GROUP_M`` bands; dy and W through TMA descriptors
(``USE_TMA``) or masked pointer loads. ``EPI_SPLIT=2`` runs the epilogue on the tile's two
column halves one after the other (``tl.reshape`` / ``tl.permute`` / ``tl.split`` of the
rounded tile), so fewer fp32 values are live at once; the h tiles come through masked
pointer loads (a tile's rows end at its group's end, so a TMA box would need per-group
bounds).

Speed (H200, bf16, 2026-11-30, ``benchmarks/large_gemm_triton.py --gemms fc2_dswiglu``,
docs/benchmarks.md): slower than the two launches at every shape measured, 0.64-0.69x at E8
T16384 H4096 FF14336, 0.64-0.71x at E32 T32768 H7168 FF2048 (the default and three other
launch configs: the group walk, 64 x 128 tiles at two programs per SM, 4 stages), 0.74x at
E128 T65536 H2048 FF768 and 0.57x at E128 T16384 (the default; the whole-tile epilogue and h
through TMA were slower everywhere). The fused kernel saves da's write and read (0.94 GB at
E8) but its epilogue (h read, dh and a written) runs between k-loops with nothing
overlapping it, and costs more than the bandwidth-bound SwiGLU pass it replaces (fused -
dgrad: 2.2-2.6 ms at E8 against the pass's 0.7 ms). So auto does not take it
(``fused/fc2_dgrad_epilogue.py``); ``TE_OPS_FC2_DSWIGLU_EPILOGUE=1`` does.

Registered as ``torch.library.triton_op`` ``te_ops::grouped_dgrad_dswiglu_large`` (the body,
run on FakeTensors, is the fake kernel); eager calls launch through
:func:`te_ops.kernels.triton_launch.launch`.
"""

from __future__ import annotations

import torch

from . import grouped_gemm_large_triton as lg
from . import swiglu_triton
from ..tracing import tracing
from .grouped_gemm_triton import check_offsets_and_probs, unsupported_reason
from .triton_launch import cdiv, launch, next_power_of_2

try:  # Triton is optional: CPU-only installs have no use for it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

__all__ = ["large_dgrad_dswiglu", "dswiglu_config"]


def dswiglu_config() -> dict[str, int | bool]:
    """Default launch parameters of :func:`large_dgrad_dswiglu`: 128 x 128 output tiles
    (half the plain dgrad's 256 columns: the epilogue holds the fp32 accumulator and two h
    tiles), 64 k per step, ``GROUP_M = 8``, 8 warps, 3 stages, TMA loads of dy and W2, the
    ``FLAT`` schedule, the epilogue in two column halves (``EPI_SPLIT = 2``: no register
    spills in the sm_90 compile with Triton 3.6, where the whole tile at once spills).
    ``benchmarks/large_gemm_triton.py --gemms fc2_dswiglu`` times variants."""
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "USE_TMA": True,
            "FLAT": True, "EPI_SPLIT": 2, "H_TMA": False, "PROGRAMS_PER_SM": 1,
            "num_warps": 8, "num_stages": 3}


def _resolve(config: dict | None, groups: int) -> dict[str, int | bool]:
    """:func:`dswiglu_config` updated by ``config``, checked (``EPI_SPLIT`` 1 or 2, an even
    ``BLOCK_N`` for 2); ``FLAT`` above ``FLAT_MAX_GROUPS`` groups becomes the group walk."""
    cfg = dict(dswiglu_config())
    cfg.update(config or {})
    unknown = sorted(set(cfg) - set(dswiglu_config()))
    if unknown:
        raise ValueError(f"config keys must be among {sorted(dswiglu_config())}, got "
                         f"unknown {unknown}")
    lg.check_config_values(cfg, dswiglu_config())
    if cfg["EPI_SPLIT"] not in (1, 2) or cfg["BLOCK_N"] % (2 * cfg["EPI_SPLIT"]):
        raise ValueError(f"config EPI_SPLIT must be 1 or 2 with BLOCK_N a multiple of "
                         f"2 * EPI_SPLIT, got EPI_SPLIT={cfg['EPI_SPLIT']} "
                         f"BLOCK_N={cfg['BLOCK_N']}")
    if int(cfg["PROGRAMS_PER_SM"]) < 1:
        raise ValueError(f"config PROGRAMS_PER_SM must be >= 1, got {cfg['PROGRAMS_PER_SM']}")
    if cfg["FLAT"] and groups > lg.FLAT_MAX_GROUPS:
        cfg["FLAT"] = False
    return cfg


if triton is not None:
    from .grouped_gemm_large_triton import _group_of, _load_w, _row_tiles, _tile_ends, _tile_of
    from .grouped_gemm_triton import _group_rows
    from .swiglu_triton import _dswiglu

    @triton.jit
    def _dgrad_acc(x_desc, w_desc, x_ptr, w_ptr, g, k_end, rows, row_ok, m0, pn, N, K,
                   stride_wg, stride_wn, stride_wk, USE_TMA: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The fp32 tile ``dy[rows] @ W[g][:, pn * BLOCK_N:...]`` (W read as (G, K_red,
        N_out)), k-steps up to ``k_end``: ``grouped_gemm_large_triton._tile``'s k-loop with
        ``W_KN`` (the same loads, ``tl.dot`` calls and order)."""
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, k_end, BLOCK_K):
            if USE_TMA:
                xa = x_desc.load([m0.to(tl.int32), k0])
            else:
                k = k0 + tl.arange(0, BLOCK_K)
                xa = tl.load(x_ptr + rows[:, None] * K + k[None, :],
                             mask=row_ok[:, None] & (k[None, :] < K), other=0.0)
            wt = _load_w(w_desc, w_ptr, g, pn * BLOCK_N, k0, N, K, stride_wg, stride_wn,
                         stride_wk, USE_TMA, True, BLOCK_N, BLOCK_K)
            acc = tl.dot(xa, wt, acc)
        return acc

    @triton.jit
    def _dswiglu_part(da, h_desc, h_ptr, dh_ptr, a_ptr, p, m0, row_ok, col0, N,
                      HAS_P: tl.constexpr, WRITE_OUT: tl.constexpr, EVEN_N: tl.constexpr,
                      H_TMA: tl.constexpr, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
        """dh's gate and up columns ``col0 + arange(WIDTH)`` and a's of the rows
        ``m0 + arange(BLOCK_M)`` (where ``row_ok``) from the rounded da tile (fp32 values)
        and h; returns the rows' probs-gradient sums over those columns (fp32; zeros without
        ``HAS_P``). Addresses: a 64-bit tile base, 32-bit offsets inside the tile (fewer
        registers). ``H_TMA`` (needs ``EVEN_N``): h's tiles through the TMA descriptor
        ``h_desc`` (rows past the group's end are read, not used)."""
        local = tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, WIDTH)
        if EVEN_N:
            mask = row_ok[:, None]
        else:
            mask = row_ok[:, None] & (cols < N)[None, :]
        base = m0.to(tl.int64) * (2 * N)
        off = local[:, None] * (2 * N) + cols[None, :]
        if H_TMA:
            gate = h_desc.load([m0.to(tl.int32), col0.to(tl.int32)]).to(tl.float32)
            up = h_desc.load([m0.to(tl.int32), (N + col0).to(tl.int32)]).to(tl.float32)
        else:
            gate = tl.load(h_ptr + base + off, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(h_ptr + base + N + off, mask=mask, other=0.0).to(tl.float32)
        dgate, dup, out, dp = _dswiglu(gate, up, da, p, HAS_P)
        tl.store(dh_ptr + base + off, dgate.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_ptr + base + N + off, dup.to(dh_ptr.dtype.element_ty), mask=mask)
        if WRITE_OUT:
            tl.store(a_ptr + m0.to(tl.int64) * N + local[:, None] * N + cols[None, :],
                     out.to(a_ptr.dtype.element_ty), mask=mask)
        if HAS_P:
            return tl.sum(dp, axis=1)  # columns past N: da = gate = up = 0
        return tl.zeros([BLOCK_M], dtype=tl.float32)

    @triton.jit
    def _dswiglu_epilogue(acc, h_desc, h_ptr, dh_ptr, a_ptr, p_ptr, dpp_ptr, m0, row_ok, pn,
                          N, M, HAS_P: tl.constexpr, WRITE_OUT: tl.constexpr,
                          EPI_SPLIT: tl.constexpr, EVEN_N: tl.constexpr, H_TMA: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """The SwiGLU backward of one da tile (``acc``, fp32) at rows ``m0 + arange(BLOCK_M)``
        (stored where ``row_ok``), column tile ``pn``: da rounded to dh's dtype first
        (``large_dgrad``'s stored bits); the probs partial of (pn, row) to ``dpp_ptr`` (a
        (tiles_n, M) fp32 buffer)."""
        da = acc.to(dh_ptr.dtype.element_ty)
        rows = m0 + tl.arange(0, BLOCK_M)
        p = 1.0
        if HAS_P:
            p = tl.load(p_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        if EPI_SPLIT == 2:
            half: tl.constexpr = BLOCK_N // 2
            d0, d1 = tl.split(tl.permute(tl.reshape(da, [BLOCK_M, 2, half]), [0, 2, 1]))
            dp = _dswiglu_part(d0.to(tl.float32), h_desc, h_ptr, dh_ptr, a_ptr, p, m0, row_ok,
                               pn * BLOCK_N, N, HAS_P, WRITE_OUT, EVEN_N, H_TMA, BLOCK_M,
                               half)
            dp += _dswiglu_part(d1.to(tl.float32), h_desc, h_ptr, dh_ptr, a_ptr, p, m0,
                                row_ok, pn * BLOCK_N + half, N, HAS_P, WRITE_OUT, EVEN_N,
                                H_TMA, BLOCK_M, half)
        else:
            dp = _dswiglu_part(da.to(tl.float32), h_desc, h_ptr, dh_ptr, a_ptr, p, m0, row_ok,
                               pn * BLOCK_N, N, HAS_P, WRITE_OUT, EVEN_N, H_TMA, BLOCK_M,
                               BLOCK_N)
        if HAS_P:
            tl.store(dpp_ptr + pn.to(tl.int64) * M + rows, dp, mask=row_ok)

    @triton.jit
    def _dgrad_dswiglu_kernel(x_ptr, w_ptr, h_ptr, dh_ptr, a_ptr, p_ptr, dpp_ptr, offs_ptr,
                              M, N, K, G, P, stride_wg, stride_wn, stride_wk,
                              HAS_P: tl.constexpr, WRITE_OUT: tl.constexpr,
                              USE_TMA: tl.constexpr, FLAT: tl.constexpr,
                              GBLOCK: tl.constexpr, EPI_SPLIT: tl.constexpr,
                              EVEN_N: tl.constexpr, H_TMA: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """x = dy (M, K) contiguous, W (G, K_red=K, N_out=N) by strides, h and dh (M, 2N),
        a (M, N) contiguous (dh may be h itself: each element is read, then written, by
        one program), p (M,), dpp (cdiv(N, BLOCK_N), M) fp32; P programs; group G = the
        padding rows (da = 0, the epilogue still runs). Tile order and schedules as
        ``grouped_gemm_large_triton._large_kernel`` (no ``TAIL``)."""
        pid = tl.program_id(0)
        x_desc = None
        w_desc = None
        h_desc = None
        if H_TMA:
            h_desc = tl.make_tensor_descriptor(h_ptr, shape=[M, 2 * N], strides=[2 * N, 1],
                                               block_shape=[BLOCK_M, BLOCK_N // EPI_SPLIT])
        if USE_TMA:
            x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1],
                                               block_shape=[BLOCK_M, BLOCK_K])
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[G, K, N],
                                               strides=[stride_wg, stride_wk, 1],
                                               block_shape=[1, BLOCK_K, BLOCK_N])
        tiles_n = tl.cdiv(N, BLOCK_N)
        if FLAT:
            ends, no_half = _tile_ends(offs_ptr, M, G, tiles_n, BLOCK_M, False, GBLOCK)
            n_full = tl.max(ends, 0)
            for tile in tl.range(pid, n_full, P, flatten=True):
                g, base = _group_of(ends, tile)
                start, end = _group_rows(offs_ptr, g, G, M)
                tiles_m, no_tail = _row_tiles(end - start, BLOCK_M, False)
                pm, pn = _tile_of((tile - base).to(tl.int32), tiles_m.to(tl.int32), tiles_n,
                                  GROUP_M)
                m0 = start + pm * BLOCK_M
                rows = m0 + tl.arange(0, BLOCK_M)
                row_ok = rows < end
                acc = _dgrad_acc(x_desc, w_desc, x_ptr, w_ptr, g, K, rows, row_ok, m0, pn, N,
                                 K, stride_wg, stride_wn, stride_wk, USE_TMA, BLOCK_M,
                                 BLOCK_N, BLOCK_K)
                _dswiglu_epilogue(acc, h_desc, h_ptr, dh_ptr, a_ptr, p_ptr, dpp_ptr, m0, row_ok, pn,
                                  N, M, HAS_P, WRITE_OUT, EPI_SPLIT, EVEN_N, H_TMA, BLOCK_M,
                                  BLOCK_N)
            first = (pid + P - n_full % P) % P  # the tile numbering goes on round robin
            pad_start, pad_end = _group_rows(offs_ptr, G, G, M)
            pad_tiles = ((pad_end - pad_start + BLOCK_M - 1) // BLOCK_M * tiles_n).to(tl.int32)
            for tile in range(first, pad_tiles, P):  # padding rows: da = 0, no k-step
                m0 = pad_start + (tile // tiles_n) * BLOCK_M
                rows = m0 + tl.arange(0, BLOCK_M)
                zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                _dswiglu_epilogue(zero, h_desc, h_ptr, dh_ptr, a_ptr, p_ptr, dpp_ptr, m0,
                                  rows < pad_end, tile % tiles_n, N, M, HAS_P, WRITE_OUT,
                                  EPI_SPLIT, EVEN_N, H_TMA, BLOCK_M, BLOCK_N)
        else:
            tile = pid
            base = 0
            for g in range(0, G + 1):
                start, end = _group_rows(offs_ptr, g, G, M)
                tiles_m = ((end - start + BLOCK_M - 1) // BLOCK_M).to(tl.int32)
                count = tiles_m * tiles_n
                k_end = tl.where(g < G, K, 0)  # the padding group: no k-step, da = 0
                while tile < base + count:
                    pm, pn = _tile_of(tile - base, tiles_m, tiles_n, GROUP_M)
                    m0 = start + pm * BLOCK_M
                    rows = m0 + tl.arange(0, BLOCK_M)
                    row_ok = rows < end
                    acc = _dgrad_acc(x_desc, w_desc, x_ptr, w_ptr, g, k_end, rows, row_ok, m0,
                                     pn, N, K, stride_wg, stride_wn, stride_wk, USE_TMA,
                                     BLOCK_M, BLOCK_N, BLOCK_K)
                    _dswiglu_epilogue(acc, h_desc, h_ptr, dh_ptr, a_ptr, p_ptr, dpp_ptr, m0, row_ok,
                                      pn, N, M, HAS_P, WRITE_OUT, EPI_SPLIT, EVEN_N, H_TMA, BLOCK_M,
                                      BLOCK_N)
                    tile += P
                base += count


    @triton.jit
    def _sum_partials_kernel(dpp_ptr, dp_ptr, M, T, BLOCK: tl.constexpr):
        """dp[m] = sum over t < T of dpp[t, m], t in order (fp32), stored in dp's dtype."""
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = rows < M
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for t in range(0, T):
            acc += tl.load(dpp_ptr + t * M + rows, mask=ok, other=0.0)
        tl.store(dp_ptr + rows, acc.to(dp_ptr.dtype.element_ty), mask=ok)


#: Rows per program of the probs-partials reduction.
_SUM_BLOCK = 1024


def _check(dy: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor, h: torch.Tensor,
           probs: torch.Tensor | None) -> None:
    """Argument checks of :func:`large_dgrad_dswiglu` (errors name the argument, the expected
    and the actual value)."""
    if dy.dim() != 2:
        raise ValueError(f"dy must be 2-D (rows, out_features), got shape {tuple(dy.shape)}")
    if weights.dim() != 3 or weights.dtype != dy.dtype or weights.device != dy.device:
        raise ValueError(f"weights must be 3-D (G, N, F) {dy.dtype} on {dy.device}, got shape "
                         f"{tuple(weights.shape)} {weights.dtype} on {weights.device}")
    if weights.shape[1] != dy.shape[1]:
        raise ValueError(f"dy has {dy.shape[1]} columns, weights (G, N, F) have N="
                         f"{weights.shape[1]}")
    want = (dy.shape[0], 2 * weights.shape[2])
    if tuple(h.shape) != want or h.dtype != dy.dtype or h.device != dy.device:
        raise ValueError(f"h must have shape {want} (rows, 2F), {dy.dtype} on {dy.device}, "
                         f"got {tuple(h.shape)} {h.dtype} on {h.device}")
    if probs is not None and not probs.is_floating_point():
        raise ValueError(f"probs must be a floating-point tensor, got {probs.dtype}")
    check_offsets_and_probs(dy, offsets, weights.shape[0], probs)
    why = unsupported_reason(dy.device, dy.dtype)
    if why is not None:
        raise RuntimeError(f"the fc2 dgrad + dSwiGLU Triton kernel cannot run: {why}")


def _launch(dy: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor, h: torch.Tensor,
            probs: torch.Tensor | None, config: dict | None, grad_into_input: bool, kernels,
            write_out: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Allocate the outputs, launch the fused kernel and the probs-partials reduction
    (``kernels``: those two and the SwiGLU backward kernel, plain or wrapped for a
    ``triton_op``): (dh, dprobs, a | None). Without groups, rows, columns or reduction (da all
    zeros) the SwiGLU backward runs on a zero da: the two launches' values."""
    kernel, sum_kernel, swiglu_kernel = kernels
    m, k = dy.shape
    groups, f = weights.shape[0], weights.shape[2]
    cfg = _resolve(config, groups)  # before the early returns: a bad config always raises
    if groups == 0 or k == 0 or m == 0 or f == 0:
        da = torch.zeros(m, f, device=dy.device, dtype=dy.dtype)
        return swiglu_triton._backward(h, da, probs, write_out, grad_into_input,
                                       swiglu_kernel)
    dy = dy.contiguous()
    h = h.contiguous()
    offsets = offsets.contiguous()
    dh = h if grad_into_input else torch.empty_like(h)
    a = torch.empty(m, f, device=dy.device, dtype=dy.dtype) if write_out else None
    tiles_n = cdiv(f, cfg["BLOCK_N"])
    partials = (torch.empty(tiles_n, m, device=dy.device, dtype=torch.float32)
                if probs is not None else None)
    p = probs.contiguous() if probs is not None else dy
    if cfg["USE_TMA"] and lg.tma_unsupported_reason(dy, weights) is not None:
        cfg["USE_TMA"] = False
    if cfg["H_TMA"] and (f % cfg["BLOCK_N"] or (2 * f * h.element_size()) % 16
                         or lg.tma_unsupported_reason(h, weights) is not None):
        cfg["H_TMA"] = False  # needs whole column tiles, 16-byte rows, a TMA-capable device
    if (cfg["USE_TMA"] or cfg["H_TMA"]) and dy.device.type == "cuda":
        lg._ensure_allocator()
    per_sm = cfg.pop("PROGRAMS_PER_SM")  # > 1: another program's epilogue overlaps the GEMM
    bound = (cdiv(m, cfg["BLOCK_M"]) + groups + 1) * cdiv(f, cfg["BLOCK_N"])
    grid = (min(bound, per_sm * lg.grid_size(dy.device, m, groups, f, cfg["BLOCK_M"],
                                             cfg["BLOCK_N"])),)
    launch(kernel, grid, dy, weights, h, dh, a if a is not None else dh, p,
           partials if partials is not None else dy, offsets, m, f, k, groups, grid[0],
           weights.stride(0), weights.stride(2), weights.stride(1),
           HAS_P=probs is not None, WRITE_OUT=write_out, EVEN_N=f % cfg["BLOCK_N"] == 0,
           GBLOCK=next_power_of_2(groups) if cfg["FLAT"] else 1, **cfg)
    dp = None
    if partials is not None:  # a fixed order (no atomics), the same in eager and compiled
        dp = torch.empty(m, device=dy.device, dtype=probs.dtype)
        launch(sum_kernel, (cdiv(m, _SUM_BLOCK),), partials, dp, m, tiles_n, BLOCK=_SUM_BLOCK)
    return dh, dp, a


def large_dgrad_dswiglu(dy: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                        h: torch.Tensor, probs: torch.Tensor | None = None,
                        write_output: bool = True, grad_into_input: bool = False,
                        config: dict | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """fc2's grouped dgrad with the (Scaled)SwiGLU backward in its epilogue (module
    docstring): ``da_g = dy_g @ W2_g`` rounded to dy's dtype, then with ``gate = h[:, :F]``,
    ``up = h[:, F:]``, ``s = sigmoid(gate)``: ``a = SiLU(gate) * up (* probs)``,
    ``dgate = da (* probs) * up * s * (1 + gate * (1 - s))``, ``dup = da (* probs) *
    SiLU(gate)``, ``dprobs = sum_j SiLU(gate) * up * da`` (formulas of
    ``te_ops.basic.swiglu``).

    Shapes: dy (T, N) bf16/fp16 on CUDA (fc2's output gradient), weights (G, N, F) (fc2's
    weights; TMA loads need them contiguous along F, else pointer loads), offsets (G,)
    int32/int64 cumulative group ends on dy's device, h (T, 2F) in dy's dtype (fc1's output),
    probs (T,) float or ``None`` -> (dh (T, 2F) in dy's dtype, dprobs (T,) in probs' dtype or
    ``None``, a (T, F) in dy's dtype, ``None`` with ``write_output=False``). dh and a
    are bitwise ``large_dgrad`` followed by ``swiglu_triton.swiglu_backward(...,
    write_output=True)``; dprobs sums the same fp32 terms in another order. Rows past
    ``offsets[-1]`` are computed from da = 0. ``grad_into_input=True`` writes dh over h
    (eager only). ``config`` overrides keys of :func:`dswiglu_config` (benchmarks). Under a
    ``torch.compile`` trace the call is the op ``te_ops::grouped_dgrad_dswiglu_large`` (dh a
    new buffer, a always computed).

    Raises
    ------
    ValueError
        Shapes, dtypes or devices of the arguments do not match (the message names the
        argument, the expected and the actual value); ``config`` has an unknown key or a bad
        ``EPI_SPLIT``.
    RuntimeError
        The kernel cannot run here (not CUDA, dtype, no Triton; the reason is given).
    """
    _check(dy, weights, offsets, h, probs)
    if tracing() and config is None:
        dh, dp, a = torch.ops.te_ops.grouped_dgrad_dswiglu_large(dy, weights, offsets, h,
                                                                 probs)
        return dh, (dp if probs is not None else None), (a if write_output else None)
    return _launch(dy, weights, offsets, h, probs, config, grad_into_input,
                   (_dgrad_dswiglu_kernel, _sum_partials_kernel, swiglu_triton._bwd_kernel),
                   write_output)


if triton is not None:

    @torch.library.triton_op("te_ops::grouped_dgrad_dswiglu_large", mutates_args={})
    def _grouped_dgrad_dswiglu_large_op(dy: torch.Tensor, weights: torch.Tensor,
                                        offsets: torch.Tensor, h: torch.Tensor,
                                        probs: torch.Tensor | None
                                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`large_dgrad_dswiglu` as an op: ``(dh, dprobs, a)``, dprobs 0-element
        without probs (an op returns tensors only); the body, run on FakeTensors, is also
        the fake."""
        wrap = torch.library.wrap_triton
        dh, dp, a = _launch(dy, weights, offsets, h, probs, None, False,
                            (wrap(_dgrad_dswiglu_kernel), wrap(_sum_partials_kernel),
                             wrap(swiglu_triton._bwd_kernel)))
        return dh, (dp if dp is not None else dy.new_empty(0)), a
