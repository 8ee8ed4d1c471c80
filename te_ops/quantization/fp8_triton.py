"""Triton kernels for FP8 current scaling on CUDA: one kernel per quantized copy.

The PyTorch ops of :mod:`te_ops.quantization.numerics` take about ten passes over a tensor (abs,
isfinite, amax, multiply, clamp, cast, ...); these kernels read the input twice (amax, then
quantize) and write the FP8 bytes once. They produce the same bytes as the PyTorch path (checked
by ``tests/test_quantization_cuda.py``): same power-of-two scale rule (computed here from the
amax's exponent and mantissa bits: ``floor(log2(448 / amax))`` is ``126 - e + 8`` when the
mantissa fraction is above 0.75, else ``126 - e + 9``, with ``e`` the biased exponent), the same
saturation and NaN / Inf handling, and the hardware's round-to-nearest-even conversion. Row-wise
rows of up to 32768 elements are read once (kept in registers), longer ones twice.

Column-wise copies take two launches over one grid of (chunk of destination rows, block of
columns), so the work is spread evenly whatever the group sizes (a grid of one program per
(group, column block) left a large group's rows to a few long programs): the first streams its
chunk once and folds each group's column maxima into a (G, K) amax buffer (``atomic_max`` on
the fp32 bits), the second streams it again, quantizes with the finished scales, transposes
each tile in registers so its stores are contiguous, and writes every destination byte
(zeros in the alignment gaps and the layout's tail: no zero-fill pass).

Each column-wise program issues its next tile's load before working on the current one
(``PREFETCH``): phase 1 then streams at about 4 TB/s on the weights (H200), against 2.8 without.
Phase 2 packs the bytes of four destination rows into one 32-bit word before the transpose
(``PACK4``, where the layout's rows and strides are multiples of 4): 3.5 TB/s on the weights
against 2.7 byte-wise.

* :func:`fp8_rows`: along the last dim of a contiguous (rows, K) tensor.
* :func:`fp8_rows_column_amax`: the same for (G, N, K) weights, plus their column amax
  (per (g, k) over N) folded from the same read, so the later column-wise copy needs phase 2
  only.
* :func:`fp8_columns_grouped`: per group of rows, along the rows, written transposed: the
  column-wise copy of split activations (into the group-aligned layout) and of (G, N, K) weights
  (phase 2 alone when given the amax).

Registered with ``torch.library.triton_op`` so ``torch.compile`` sees them as ops with fake
kernels (eager calls launch the same kernels directly, without the op dispatch's host time);
no host sync (group sizes are read inside the kernel).
"""

from __future__ import annotations

import torch

from ..tracing import tracing

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None
    tl = None

__all__ = ["unsupported_reason", "fp8_rows", "fp8_rows_column_amax", "fp8_columns_grouped",
           "fp8_both_grouped"]




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
    def _fp8_rows_colamax_kernel(x_ptr, q_ptr, sinv_ptr, camax_ptr, N, K,
                                 ROWS_PER_PROG: tl.constexpr, BLOCK_K: tl.constexpr,
                                 ROWS_TILE: tl.constexpr = 1):
        # Row-wise bytes of ROWS_PER_PROG whole rows (read once each, in registers, ROWS_TILE
        # rows at a time; the next tile's load issued before this one is worked on), and the
        # rows' column maxima folded into camax[g, :] (fp32 bits as int32, atomic_max) once
        # per program: the rows of one program lie in one group g of N rows (ROWS_PER_PROG
        # divides N; ROWS_TILE divides ROWS_PER_PROG).
        r0 = tl.program_id(0).to(tl.int64) * ROWS_PER_PROG
        offs = tl.arange(0, BLOCK_K)
        rr = tl.arange(0, ROWS_TILE)
        mask = offs < K
        mask2 = mask[None, :] & (rr < ROWS_TILE)[:, None]
        acc = tl.zeros([BLOCK_K], dtype=tl.float32)
        nxt = tl.load(x_ptr + (r0 + rr)[:, None] * K + offs[None, :], mask=mask2, other=0.0)
        for i in range(0, ROWS_PER_PROG, ROWS_TILE):
            rows = r0 + i + rr
            v = nxt.to(tl.float32)
            nxt = tl.load(x_ptr + (rows + ROWS_TILE)[:, None] * K + offs[None, :],
                          mask=mask2 & (i + ROWS_TILE < ROWS_PER_PROG), other=0.0)
            fa = _finite_abs(v)
            acc = tl.maximum(acc, tl.max(fa, 0))
            scale, sinv = _pow2_scale(tl.max(fa, 1))
            tl.store(sinv_ptr + rows, sinv)
            tl.store(q_ptr + rows[:, None] * K + offs[None, :], _to_e4m3(v, scale[:, None]),
                     mask=mask2)
        tl.atomic_max(camax_ptr + (r0 // N) * K + offs, acc.to(tl.int32, bitcast=True),
                      mask=mask, sem="relaxed")

    @triton.jit
    def _group_range(pstarts_ptr, sizes_ptr, G, p_lo, p_hi, ALIGN, G_BLOCK: tl.constexpr):
        """First and last group whose destination rows [pstart, pstart + round_up(size,
        ALIGN)) meet [p_lo, p_hi) (pstarts are non-decreasing); first > last when none."""
        gs = tl.arange(0, G_BLOCK)
        gmask = gs < G
        ps = tl.load(pstarts_ptr + gs, mask=gmask, other=0).to(tl.int64)
        sz = tl.load(sizes_ptr + gs, mask=gmask, other=0).to(tl.int64)
        pe = ps + (sz + ALIGN - 1) // ALIGN * ALIGN
        g_first = tl.sum(((pe <= p_lo) & gmask).to(tl.int32), 0)
        g_last = tl.sum(((ps < p_hi) & gmask).to(tl.int32), 0) - 1
        return g_first, g_last

    @triton.jit
    def _tail_start(starts_ptr, sizes_ptr, pstarts_ptr, G, ALIGN):
        """First destination row of the layout's tail (past the last group's aligned end) and
        first padding source row (past the last group). The tail has at least as many rows as
        there are padding rows (capacity >= rows + G * (ALIGN - 1)), so tail row t0 + i reads
        padding row s_end + i for the row-wise copy."""
        last_ps = tl.load(pstarts_ptr + G - 1).to(tl.int64)
        last_sz = tl.load(sizes_ptr + G - 1).to(tl.int64)
        t0 = last_ps + (last_sz + ALIGN - 1) // ALIGN * ALIGN
        return t0, tl.load(starts_ptr + G - 1).to(tl.int64) + last_sz

    @triton.jit
    def _chunk_ids(COLS_FIRST: tl.constexpr):
        """(row chunk, column block) of this program. COLS_FIRST: grid axis 0 runs over the
        column blocks, so programs launched together read the same rows side by side (whole
        rows of DRAM pages at once) rather than one column block of many row chunks."""
        if COLS_FIRST:
            pid_r = tl.program_id(1)
            pid_c = tl.program_id(0)
        else:
            pid_r = tl.program_id(0)
            pid_c = tl.program_id(1)
        return pid_r, pid_c

    @triton.jit
    def _fp8_cols_amax_kernel(x_ptr, amax_ptr, row_amax_ptr, starts_ptr, sizes_ptr,
                              pstarts_ptr, G, K, P, M, ALIGN, CHUNK: tl.constexpr,
                              BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                              G_BLOCK: tl.constexpr, COLS_FIRST: tl.constexpr,
                              ROWS: tl.constexpr, PREFETCH: tl.constexpr = False):
        # Phase 1: per (group, column) largest finite magnitude. Each program streams CHUNK
        # destination rows x BLOCK_C columns once and folds its part of each group into
        # amax (fp32 bits as int32: the order of non-negative floats is that of their bits).
        # ROWS: also each source row's largest finite magnitude (row_amax, (M,), folded across
        # the column blocks), for the row-wise copy; padding source rows (past the last
        # group) are read by the programs of the layout's tail.
        pid_r, pid_c = _chunk_ids(COLS_FIRST)
        p_lo = pid_r.to(tl.int64) * CHUNK
        p_hi = tl.minimum(p_lo + CHUNK, P)
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < K
        g_first, g_last = _group_range(pstarts_ptr, sizes_ptr, G, p_lo, p_hi, ALIGN, G_BLOCK)
        for g in range(g_first, g_last + 1):
            ps = tl.load(pstarts_ptr + g).to(tl.int64)
            src0 = tl.load(starts_ptr + g).to(tl.int64) - ps
            lo = tl.maximum(p_lo, ps)
            hi = tl.minimum(p_hi, ps + tl.load(sizes_ptr + g).to(tl.int64))
            acc = tl.zeros([BLOCK_C], dtype=tl.float32)
            if PREFETCH:  # the first tile's load, issued before the loop
                nxt = _load_tile(x_ptr, src0, lo, hi, cols, cmask, K, BLOCK_R)
            for p0 in range(lo, hi, BLOCK_R):
                pr = p0 + tl.arange(0, BLOCK_R)
                if PREFETCH:  # issue the next tile's load before working on this one
                    v = nxt.to(tl.float32)
                    nxt = _load_tile(x_ptr, src0, p0 + BLOCK_R, hi, cols, cmask, K, BLOCK_R)
                else:
                    v = _load_tile(x_ptr, src0, p0, hi, cols, cmask, K, BLOCK_R).to(tl.float32)
                fa = _finite_abs(v)
                acc = tl.maximum(acc, tl.max(fa, 0))
                if ROWS:
                    tl.atomic_max(row_amax_ptr + src0 + pr,
                                  tl.max(fa, 1).to(tl.int32, bitcast=True), mask=pr < hi,
                                  sem="relaxed")
            if hi > lo:
                tl.atomic_max(amax_ptr + g * K + cols, acc.to(tl.int32, bitcast=True),
                              mask=cmask, sem="relaxed")
        if ROWS:
            t0, s_end = _tail_start(starts_ptr, sizes_ptr, pstarts_ptr, G, ALIGN)
            for p0 in range(tl.maximum(p_lo, t0), p_hi, BLOCK_R):
                pr = p0 + tl.arange(0, BLOCK_R)
                src = s_end + (pr - t0)
                rmask = (pr < p_hi) & (src < M)
                v = tl.load(x_ptr + src[:, None] * K + cols[None, :],
                            mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
                tl.atomic_max(row_amax_ptr + src, tl.max(_finite_abs(v), 1).to(
                    tl.int32, bitcast=True), mask=rmask, sem="relaxed")

    @triton.jit
    def _load_tile(x_ptr, src0, p0, hi, cols, cmask, K, BLOCK_R: tl.constexpr):
        # Destination rows p0 .. p0 + BLOCK_R - 1 below hi (source rows src0 + p), in the
        # input's dtype; rows at or past hi read as zeros.
        pr = p0 + tl.arange(0, BLOCK_R)
        return tl.load(x_ptr + (src0 + pr)[:, None] * K + cols[None, :],
                       mask=(pr < hi)[:, None] & cmask[None, :], other=0.0)

    @triton.jit
    def _store_cols(q_ptr, v, scale, base, pr, pmask, cols, cmask, OUT_COL_STRIDE,
                    TRANS_BYTES: tl.constexpr):
        # Transpose the (rows, cols) tile in registers (through shared memory) so each
        # column's bytes go out as one contiguous run: coalesced stores.
        if TRANS_BYTES:  # convert first, move 1-byte values
            q = tl.trans(_to_e4m3(v, scale[None, :]).to(tl.uint8, bitcast=True))
            q = q.to(tl.float8e4nv, bitcast=True)
        else:  # move fp32 values, then convert
            q = _to_e4m3(tl.trans(v), scale[:, None])
        tl.store(q_ptr + base + cols[:, None].to(tl.int64) * OUT_COL_STRIDE + pr[None, :], q,
                 mask=cmask[:, None] & pmask[None, :])

    @triton.jit
    def _store_rows(row_q_ptr, row_amax_ptr, row_sinv_ptr, v, src, rmask, cols, cmask, K,
                    WRITE_SINV):
        # Row-wise bytes of a (rows, cols) tile with the rows' finished amax; the programs
        # of the first column block also write the rows' scale_inv.
        a = tl.load(row_amax_ptr + src, mask=rmask, other=0)
        scale, sinv = _pow2_scale(a.to(tl.float32, bitcast=True))
        tl.store(row_q_ptr + src[:, None] * K + cols[None, :], _to_e4m3(v, scale[:, None]),
                 mask=rmask[:, None] & cmask[None, :])
        if WRITE_SINV:
            tl.store(row_sinv_ptr + src, sinv, mask=rmask)

    @triton.jit
    def _load_tile4(x_ptr, src0, p0, hi, cols, cmask, K, BLOCK_R: tl.constexpr):
        # Destination rows p0 .. p0 + BLOCK_R - 1 as four (BLOCK_R / 4, cols) tiles: tile s
        # holds rows p0 + 4 j + s (rows at or past hi read as zeros).
        pq = p0 + 4 * tl.arange(0, BLOCK_R // 4)
        t0 = _load_tile_rows(x_ptr, src0, pq, hi, cols, cmask, K)
        t1 = _load_tile_rows(x_ptr, src0, pq + 1, hi, cols, cmask, K)
        t2 = _load_tile_rows(x_ptr, src0, pq + 2, hi, cols, cmask, K)
        t3 = _load_tile_rows(x_ptr, src0, pq + 3, hi, cols, cmask, K)
        return t0, t1, t2, t3

    @triton.jit
    def _load_tile_rows(x_ptr, src0, pr, hi, cols, cmask, K):
        return tl.load(x_ptr + (src0 + pr)[:, None] * K + cols[None, :],
                       mask=(pr < hi)[:, None] & cmask[None, :], other=0.0)

    @triton.jit
    def _e4m3_bits(v, scale):
        return _to_e4m3(v, scale[None, :]).to(tl.uint8, bitcast=True).to(tl.uint32)

    @triton.jit
    def _quant_group_pack4(x_ptr, q_ptr, row_amax_ptr, row_q_ptr, row_sinv_ptr, scale, base,
                           src0, lo, hi, hi_src, cols, cmask, K, OUT_COL_STRIDE,
                           BLOCK_R: tl.constexpr, ROWS: tl.constexpr, PREFETCH: tl.constexpr,
                           WRITE_SINV):
        # Phase 2 of one group's destination rows [lo, hi) with the bytes of four consecutive
        # destination rows packed into one 32-bit word (little-endian: row p + s in byte s)
        # before the in-register transpose: the transpose moves a quarter of the fp32
        # variant's data, and each column's run is stored as 32-bit words. Needs lo, hi,
        # base and OUT_COL_STRIDE to be multiples of 4 (checked by the launcher).
        q32 = q_ptr.to(tl.pointer_type(tl.uint32))
        col_off = base // 4 + cols[:, None].to(tl.int64) * (OUT_COL_STRIDE // 4)
        if PREFETCH:
            n0, n1, n2, n3 = _load_tile4(x_ptr, src0, lo, hi_src, cols, cmask, K, BLOCK_R)
        for p0 in range(lo, hi, BLOCK_R):
            pq = p0 + 4 * tl.arange(0, BLOCK_R // 4)
            if PREFETCH:
                v0 = n0.to(tl.float32)
                v1 = n1.to(tl.float32)
                v2 = n2.to(tl.float32)
                v3 = n3.to(tl.float32)
                n0, n1, n2, n3 = _load_tile4(x_ptr, src0, p0 + BLOCK_R, hi_src, cols, cmask, K,
                                             BLOCK_R)
            else:
                t0, t1, t2, t3 = _load_tile4(x_ptr, src0, p0, hi_src, cols, cmask, K, BLOCK_R)
                v0 = t0.to(tl.float32)
                v1 = t1.to(tl.float32)
                v2 = t2.to(tl.float32)
                v3 = t3.to(tl.float32)
            if ROWS:
                _store_rows(row_q_ptr, row_amax_ptr, row_sinv_ptr, v0, src0 + pq,
                            pq < hi_src, cols, cmask, K, WRITE_SINV)
                _store_rows(row_q_ptr, row_amax_ptr, row_sinv_ptr, v1, src0 + pq + 1,
                            pq + 1 < hi_src, cols, cmask, K, WRITE_SINV)
                _store_rows(row_q_ptr, row_amax_ptr, row_sinv_ptr, v2, src0 + pq + 2,
                            pq + 2 < hi_src, cols, cmask, K, WRITE_SINV)
                _store_rows(row_q_ptr, row_amax_ptr, row_sinv_ptr, v3, src0 + pq + 3,
                            pq + 3 < hi_src, cols, cmask, K, WRITE_SINV)
            w = (_e4m3_bits(v0, scale) | (_e4m3_bits(v1, scale) << 8)
                 | (_e4m3_bits(v2, scale) << 16) | (_e4m3_bits(v3, scale) << 24))
            words = p0 // 4 + tl.arange(0, BLOCK_R // 4)
            tl.store(q32 + col_off + words[None, :], tl.trans(w),
                     mask=cmask[:, None] & (pq < hi)[None, :])

    @triton.jit
    def _fp8_cols_quant_kernel(x_ptr, q_ptr, amax_ptr, sinv_ptr, row_amax_ptr, row_q_ptr,
                               row_sinv_ptr, starts_ptr, sizes_ptr, pstarts_ptr, G, K, P, M,
                               ALIGN, OUT_G_STRIDE, OUT_COL_STRIDE,
                               ROW_IN_GROUP: tl.constexpr, CHUNK: tl.constexpr,
                               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                               G_BLOCK: tl.constexpr, COLS_FIRST: tl.constexpr,
                               TRANS_BYTES: tl.constexpr, ROWS: tl.constexpr,
                               PREFETCH: tl.constexpr = False, PACK4: tl.constexpr = False):
        # Phase 2: quantize with the finished amax; writes every destination byte (alignment
        # gaps and the tail past the last group get zeros), so `out` needs no zero fill.
        # ROWS: the same tiles also give the row-wise copy (row_q (M, K), row_sinv (M,)),
        # scaled by row_amax; the tail's programs write the padding rows' row-wise bytes.
        pid_r, pid_c = _chunk_ids(COLS_FIRST)
        p_lo = pid_r.to(tl.int64) * CHUNK
        p_hi = tl.minimum(p_lo + CHUNK, P)
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < K
        if pid_r == 0:  # scale_inv of every group for these columns
            for g in range(0, G):
                a = tl.load(amax_ptr + g * K + cols, mask=cmask, other=0)
                _, sinv = _pow2_scale(a.to(tl.float32, bitcast=True))
                tl.store(sinv_ptr + g * K + cols, sinv, mask=cmask)
        g_first, g_last = _group_range(pstarts_ptr, sizes_ptr, G, p_lo, p_hi, ALIGN, G_BLOCK)
        for g in range(g_first, g_last + 1):
            ps = tl.load(pstarts_ptr + g).to(tl.int64)
            sz = tl.load(sizes_ptr + g).to(tl.int64)
            src0 = tl.load(starts_ptr + g).to(tl.int64) - ps
            a = tl.load(amax_ptr + g * K + cols, mask=cmask, other=0)
            scale, _ = _pow2_scale(a.to(tl.float32, bitcast=True))
            lo = tl.maximum(p_lo, ps)
            hi = tl.minimum(p_hi, ps + (sz + ALIGN - 1) // ALIGN * ALIGN)
            base = tl.cast(g, tl.int64) * OUT_G_STRIDE
            if ROW_IN_GROUP:
                base -= ps
            hi_src = tl.minimum(hi, ps + sz)  # rows past it are alignment gaps: zeros
            if PACK4:
                _quant_group_pack4(x_ptr, q_ptr, row_amax_ptr, row_q_ptr, row_sinv_ptr, scale,
                                   base, src0, lo, hi, hi_src, cols, cmask, K, OUT_COL_STRIDE,
                                   BLOCK_R, ROWS, PREFETCH, pid_c == 0)
            else:
                if PREFETCH:  # the first tile's load, issued before the loop
                    nxt = _load_tile(x_ptr, src0, lo, hi_src, cols, cmask, K, BLOCK_R)
                for p0 in range(lo, hi, BLOCK_R):
                    pr = p0 + tl.arange(0, BLOCK_R)
                    pmask = pr < hi
                    if PREFETCH:  # issue the next tile's load before working on this one
                        v = nxt.to(tl.float32)
                        nxt = _load_tile(x_ptr, src0, p0 + BLOCK_R, hi_src, cols, cmask, K,
                                         BLOCK_R)
                    else:
                        v = _load_tile(x_ptr, src0, p0, hi_src, cols, cmask, K,
                                       BLOCK_R).to(tl.float32)
                    if ROWS:
                        _store_rows(row_q_ptr, row_amax_ptr, row_sinv_ptr, v, src0 + pr,
                                    pmask & (pr < ps + sz), cols, cmask, K, pid_c == 0)
                    _store_cols(q_ptr, v, scale, base, pr, pmask, cols, cmask, OUT_COL_STRIDE,
                                TRANS_BYTES)
        # Rows past the last group's aligned end (the layout's tail): zeros.
        t0, s_end = _tail_start(starts_ptr, sizes_ptr, pstarts_ptr, G, ALIGN)
        for p0 in range(tl.maximum(p_lo, t0), p_hi, BLOCK_R):
            pr = p0 + tl.arange(0, BLOCK_R)
            zeros = tl.zeros([BLOCK_C, BLOCK_R], dtype=tl.float32).to(tl.float8e4nv)
            tl.store(q_ptr + cols[:, None].to(tl.int64) * OUT_COL_STRIDE + pr[None, :], zeros,
                     mask=cmask[:, None] & (pr < p_hi)[None, :])
            if ROWS:  # padding source rows: row-wise copy only
                src = s_end + (pr - t0)
                rmask = (pr < p_hi) & (src < M)
                v = tl.load(x_ptr + src[:, None] * K + cols[None, :],
                            mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
                _store_rows(row_q_ptr, row_amax_ptr, row_sinv_ptr, v, src, rmask, cols, cmask,
                            K, pid_c == 0)

    #: Rows up to this many elements (rounded up to a power of two) are read once, kept in
    #: registers; longer ones are read twice (amax, then bytes). 32768 (fc1's dgrad input,
    #: rows of 2 x 14336) measured 5 % faster than 16384 on an H200.
    ROWS_ONE_PASS_MAX = 32768

    def launch_rows(x, wrap=lambda k: k):
        """The row-wise kernel on contiguous ``x``; returns (data, scale_inv)."""
        k = x.shape[-1]
        rows = x.numel() // k
        q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        sinv = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(k)
        one_pass = block <= ROWS_ONE_PASS_MAX
        block = block if one_pass else 4096
        wrap(_fp8_rows_kernel)[(rows,)](
            x, q, sinv, k, BLOCK_K=block, ONE_PASS=one_pass, num_warps=8 if block <= 8192 else 16)
        return q, sinv

    @torch.library.triton_op("te_ops::fp8_quantize_rows", mutates_args={})
    def _fp8_rows_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return launch_rows(x, wrap=torch.library.wrap_triton)

    #: Row-wise + column-amax kernel settings by row length: (largest BLOCK_K (row length
    #: rounded up to a power of two), most rows per program, rows per tile[, warps]). A program
    #: takes the largest power of two up to "most rows" that divides the group's row count N,
    #: ROWS per tile at a time (each tile's load issued before the previous tile is worked on);
    #: below ROWS_COLAMAX_MIN rows (too many atomics per byte) the column amax is not made
    #: there. Warps default to 8 (BLOCK_K <= 8192) or 16. Measured on an H200, same process
    #: (experimental/fp8_quantize_ab/):
    #: tiles of 2 rows pay where each thread holds at least 32 elements of a tile (2 x BLOCK_K /
    #: (32 x warps)): E8's W1 rows (4096) 0.83 ms against 0.96 with one row, E32's W1 rows
    #: (7168) 0.96 against 1.15-1.19; with 16 elements per thread they collapse (no spills):
    #: E32's W2 rows (2048, 8 warps) 4.14 ms against 0.54 with one row (E32's FP8 step
    #: slowdown), E8's W1 rows with 16 warps 8.65 ms. Rows of 16384: 64 rows per
    #: program, 0.48 ms against 0.54 with 32.
    ROWS_COLAMAX_SETTINGS: tuple[tuple[int, ...], ...] = (
        (2048, 32, 1), (8192, 64, 2), (16384, 64, 1, 16), (32768, 32, 1))
    ROWS_COLAMAX_MIN = 8

    def _rows_colamax_setting(k: int) -> tuple[int, int, int]:
        """(most rows per program, rows per tile, warps) for rows of ``k`` elements."""
        block = triton.next_power_of_2(k)
        for max_block, most, tile, *warps in ROWS_COLAMAX_SETTINGS:
            if block <= min(max_block, ROWS_ONE_PASS_MAX):
                return most, tile, warps[0] if warps else (8 if block <= 8192 else 16)
        return 0, 1, 8

    def rows_colamax_per_prog(n: int, k: int) -> int:
        """Rows per program for (G, N, K) weights, 0 when the kernel does not take them."""
        r = _rows_colamax_setting(k)[0]
        while r >= ROWS_COLAMAX_MIN and n % r:
            r //= 2
        return r if r >= ROWS_COLAMAX_MIN else 0

    def launch_rows_colamax(x3d, wrap=lambda k: k):
        """Row-wise copy of (G, N, K) contiguous ``x3d`` plus its column amax: (data (G, N, K),
        scale_inv (G, N), amax (G, K) fp32). Needs ``rows_colamax_per_prog(N, K) > 0``."""
        g, n, k = x3d.shape
        per_prog = rows_colamax_per_prog(n, k)
        q = torch.empty(x3d.shape, dtype=torch.float8_e4m3fn, device=x3d.device)
        sinv = torch.empty(g, n, dtype=torch.float32, device=x3d.device)
        camax = torch.zeros(g, k, dtype=torch.int32, device=x3d.device)
        block = triton.next_power_of_2(k)
        _, tile, warps = _rows_colamax_setting(k)
        wrap(_fp8_rows_colamax_kernel)[(g * n // per_prog,)](
            x3d, q, sinv, camax, n, k, ROWS_PER_PROG=per_prog, BLOCK_K=block,
            ROWS_TILE=min(tile, per_prog), num_warps=warps)
        return q, sinv, camax.view(torch.float32)

    @torch.library.triton_op("te_ops::fp8_quantize_rows_column_amax", mutates_args={})
    def _fp8_rows_colamax_op(x3d: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return launch_rows_colamax(x3d, wrap=torch.library.wrap_triton)

    #: Column-wise launch: CHUNK destination rows x BLOCK_C columns per program, tiles of
    #: BLOCK_R rows; TRANS_BYTES moves the converted 1-byte tile through shared memory
    #: instead of the fp32 one; PREFETCH issues each tile's load one tile ahead (inside a
    #: group's rows); PACK4 packs four destination rows' bytes into one 32-bit word before
    #: the transpose (where ``pack4_ok``; else byte-wise as TRANS_BYTES says). "AMAX"
    #: overrides the tile settings of phase 1 (amax) alone: the phases share only the amax
    #: buffers, so their grids may differ; "COLS_ONLY" those of a packed phase 2 that writes
    #: no row-wise copy (weights, fc2's input). Measured on an H200
    #: (experimental/fp8_quantize_ab/: the column-wise tile, phase and phase-2 variants;
    #: PACK4 2.62 ms for the six phase-2 calls against 2.92,
    #: 2.44 with 512-row tiles where no row-wise copy is written: W1 / W2 0.79 / 0.40 ms
    #: against 1.03 / 0.52; 256-row tiles with the row-wise copy: dh 1.35 against 0.77).
    #: "COLS_ONLY_MIN_ROWS": "COLS_ONLY" applies only where the groups average at least this
    #: many destination rows (``num_rows / G``; 0: always).
    COLS_CONFIG = {"CHUNK": 1024, "BLOCK_R": 128, "BLOCK_C": 64, "num_warps": 4,
                   "TRANS_BYTES": False, "COLS_FIRST": True, "PREFETCH": True, "PACK4": True,
                   "AMAX": {}, "COLS_ONLY": {"BLOCK_R": 512}, "COLS_ONLY_MIN_ROWS": 0}
    #: CHUNK is halved (down to BLOCK_R) while a pass would launch fewer programs than this
    #: (about 8 per SM of an H200's 132): small operands keep the whole GPU busy.
    COLS_MIN_PROGRAMS = 1024

    def _cols_grid(cfg, num_rows, k, g, with_rows):
        """Grid and launch keywords of one column-wise pass under tile settings ``cfg``."""
        chunk, col_blocks = cfg["CHUNK"], triton.cdiv(k, cfg["BLOCK_C"])
        while chunk > cfg["BLOCK_R"] and triton.cdiv(num_rows, chunk) * col_blocks < \
                COLS_MIN_PROGRAMS:
            chunk //= 2
        grid = (triton.cdiv(num_rows, chunk), col_blocks)
        cols_first = cfg["COLS_FIRST"] and grid[0] <= 65535  # grid axis 1 holds <= 65535
        if cols_first:
            grid = grid[::-1]
        return grid, {"CHUNK": chunk, "BLOCK_R": cfg["BLOCK_R"],
                      "BLOCK_C": cfg["BLOCK_C"], "G_BLOCK": triton.next_power_of_2(g),
                      "COLS_FIRST": cols_first, "ROWS": with_rows,
                      "PREFETCH": cfg["PREFETCH"], "num_warps": cfg["num_warps"]}

    #: Column blocks with which the packed phase 2 runs. On the H200 (Triton 3.6) 32-column
    #: blocks with the row-wise copy write wrong column-wise bytes (experimental/
    #: fp8_quantize_ab/, the phase-2 variants) while the interpreter's bytes of the
    #: same kernel agree with the byte-wise pass (tests/test_fp8q_interpret.py): cause not
    #: found, so other blocks keep the byte-wise stores.
    PACK4_BLOCK_C = (64,)

    def pack4_ok(align, num_rows, out_g_stride, out_col_stride, block_c=64):
        """Whether phase 2 may store four destination rows per 32-bit word: every group's
        first and last aligned row, the chunk bounds and the output strides are multiples of
        4 (``align`` a multiple of 4: callers with uniform groups of ``n % 4 == 0`` rows pass
        ``align=4``, the same layout as 1), and ``block_c`` is in ``PACK4_BLOCK_C``."""
        return (align % 4 == 0 and num_rows % 4 == 0 and out_g_stride % 4 == 0
                and out_col_stride % 4 == 0 and block_c in PACK4_BLOCK_C)

    def launch_cols(x, out, starts, sizes, pstarts, num_rows, align, out_g_stride,
                    out_col_stride, row_in_group, config=None, wrap=lambda k: k,
                    with_rows=False, amax=None):
        """Both column-wise passes (amax, then quantize); returns scale_inv (G, K) fp32, or
        with ``with_rows`` (scale_inv, row-wise data (M, K), row-wise scale_inv (M,)) from the
        same two passes. ``amax`` (G, K) fp32, the finished column amax (not with
        ``with_rows``): phase 2 alone."""
        cfg = {**COLS_CONFIG, **(config or {})}
        cfg_amax = {**cfg, **cfg["AMAX"]}
        g, k = sizes.numel(), x.shape[-1]
        m = x.shape[0]
        given = amax is not None
        if given:
            amax = amax.contiguous().view(torch.int32)  # non-negative: bits order as values
        else:
            amax = torch.zeros(g, k, dtype=torch.int32, device=x.device)
        sinv = torch.empty(g, k, dtype=torch.float32, device=x.device)
        if with_rows:
            row_amax = torch.zeros(m, dtype=torch.int32, device=x.device)
            row_q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
            row_sinv = torch.empty(m, dtype=torch.float32, device=x.device)
        else:  # unused pointers (the ROWS branches are compiled out)
            row_amax, row_q, row_sinv = amax, out, sinv
        if not given:
            grid, tiles = _cols_grid(cfg_amax, num_rows, k, g, with_rows)
            wrap(_fp8_cols_amax_kernel)[grid](x, amax, row_amax, starts, sizes, pstarts, g, k,
                                              num_rows, m, align, **tiles)
        if cfg["PACK4"] and not with_rows and num_rows >= cfg["COLS_ONLY_MIN_ROWS"] * g:
            cfg = {**cfg, **cfg["COLS_ONLY"]}
        pack4 = cfg["PACK4"] and pack4_ok(align, num_rows, out_g_stride, out_col_stride,
                                          cfg["BLOCK_C"])
        if not pack4:  # the byte-wise phase 2 keeps its own tiles
            cfg = {**COLS_CONFIG, **(config or {})}
        grid, tiles = _cols_grid(cfg, num_rows, k, g, with_rows)
        wrap(_fp8_cols_quant_kernel)[grid](
            x, out, amax, sinv, row_amax, row_q, row_sinv, starts, sizes, pstarts, g, k,
            num_rows, m, align, out_g_stride, out_col_stride, ROW_IN_GROUP=row_in_group,
            TRANS_BYTES=cfg["TRANS_BYTES"], PACK4=pack4, **tiles)
        return (sinv, row_q, row_sinv) if with_rows else sinv

    def _private_index_copies(*index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copies of the (G,)-sized group index tensors for the traced kernels. Triton's
        mutation analysis (torch.compile) cannot prove the column-wise kernels only read them
        and marks them mutated; ``sizes`` is the caller's split-size tensor, so inductor would
        copy it back into that graph input, and CUDA-graph trees (``mode="reduce-overhead"``)
        skip a graph with a mutated input. Measured on the H200: "skipping cudagraphs due to
        mutated inputs". The copies are G elements each."""
        return tuple(t.clone() for t in index)

    @torch.library.triton_op("te_ops::fp8_quantize_columns_grouped", mutates_args={"out"})
    def _fp8_cols_op(x: torch.Tensor, out: torch.Tensor, starts: torch.Tensor,
                     sizes: torch.Tensor, pstarts: torch.Tensor, num_rows: int, align: int,
                     out_g_stride: int, out_col_stride: int, row_in_group: bool
                     ) -> torch.Tensor:
        starts, sizes, pstarts = _private_index_copies(starts, sizes, pstarts)
        return launch_cols(x, out, starts, sizes, pstarts, num_rows, align, out_g_stride,
                           out_col_stride, row_in_group, wrap=torch.library.wrap_triton)

    @torch.library.triton_op("te_ops::fp8_quantize_columns_given_amax", mutates_args={"out"})
    def _fp8_cols_given_op(x: torch.Tensor, out: torch.Tensor, amax: torch.Tensor,
                           starts: torch.Tensor, sizes: torch.Tensor, pstarts: torch.Tensor,
                           num_rows: int, align: int, out_g_stride: int, out_col_stride: int,
                           row_in_group: bool) -> torch.Tensor:
        starts, sizes, pstarts, amax = _private_index_copies(starts, sizes, pstarts, amax)
        return launch_cols(x, out, starts, sizes, pstarts, num_rows, align, out_g_stride,
                           out_col_stride, row_in_group, wrap=torch.library.wrap_triton,
                           amax=amax)

    @torch.library.triton_op("te_ops::fp8_quantize_both_grouped", mutates_args={"out"})
    def _fp8_both_op(x: torch.Tensor, out: torch.Tensor, starts: torch.Tensor,
                     sizes: torch.Tensor, pstarts: torch.Tensor, num_rows: int, align: int,
                     out_g_stride: int, out_col_stride: int, row_in_group: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        starts, sizes, pstarts = _private_index_copies(starts, sizes, pstarts)
        return launch_cols(x, out, starts, sizes, pstarts, num_rows, align, out_g_stride,
                           out_col_stride, row_in_group, wrap=torch.library.wrap_triton,
                           with_rows=True)


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise FP8 current scaling: x (..., K) contiguous fp32/bf16 on CUDA -> (data (..., K)
    float8_e4m3fn, scale_inv (...,) fp32); same bytes as ``numerics.fp8_quantize_rows``."""
    if tracing():
        return _fp8_rows_op(x)
    return launch_rows(x)  # eager: skip the custom-op dispatch (host time per call)


def fp8_rows_column_amax(x3d: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Row-wise FP8 of (G, N, K) contiguous ``x3d`` (as :func:`fp8_rows`) and, from the same
    read, its column amax: the largest finite magnitude of each (g, k) over N, (G, K) fp32 --
    what :func:`fp8_columns_grouped` with ``amax`` needs for the column-wise copy of the same
    tensor. Returns (data (G, N, K) float8_e4m3fn, scale_inv (G, N) fp32, amax), or ``None``
    when the kernel does not take the shape (no power of two from 8 to 32 divides N, or rows
    longer than ``ROWS_ONE_PASS_MAX``)."""
    g, n, k = x3d.shape
    if g * n == 0 or not rows_colamax_per_prog(n, k):
        return None
    if tracing():
        return _fp8_rows_colamax_op(x3d)
    return launch_rows_colamax(x3d)


def fp8_columns_grouped(x2d: torch.Tensor, out: torch.Tensor, starts: torch.Tensor,
                        sizes: torch.Tensor, pstarts: torch.Tensor, num_rows: int, align: int,
                        out_g_stride: int, out_col_stride: int, row_in_group: bool,
                        amax: torch.Tensor | None = None) -> torch.Tensor:
    """Column-wise FP8 per group of rows of ``x2d`` (rows, K), written transposed into ``out``.

    Destination rows ``0 .. num_rows - 1`` are split by group: group ``g`` owns
    ``pstarts[g] .. pstarts[g] + round_up(sizes[g], align) - 1`` (``pstarts`` non-decreasing);
    its ``r``-th row is source row ``starts[g] + r`` for ``r < sizes[g]`` and zero after. Byte
    (dest row p, column k) of group ``g`` lands at flat index ``g * out_g_stride + k *
    out_col_stride + p`` of ``out`` (``p - pstarts[g]`` with ``row_in_group``); rows past the
    last group's end are zero (``row_in_group=False`` only). Every byte of the destination is
    written, so ``out`` (float8_e4m3fn) may come from ``torch.empty``. Two passes, each one
    streaming read of the group rows: the (G, K) amax, then the bytes; given ``amax`` (G, K)
    fp32 (the largest finite magnitude per group and column, e.g. from
    :func:`fp8_rows_column_amax`), the second alone. Returns scale_inv (G, K) fp32.
    """
    if sizes.numel() == 0:
        return torch.empty(0, x2d.shape[-1], dtype=torch.float32, device=x2d.device)
    args = (x2d, out, starts, sizes, pstarts, num_rows, align, out_g_stride, out_col_stride,
            row_in_group)
    if amax is not None:
        if tracing():
            return _fp8_cols_given_op(x2d, out, amax, *args[2:])
        return launch_cols(*args, amax=amax)
    if tracing():
        return _fp8_cols_op(*args)
    return launch_cols(*args)  # eager: skip the custom-op dispatch (host time per call)


def fp8_both_grouped(x2d: torch.Tensor, out: torch.Tensor, starts: torch.Tensor,
                     sizes: torch.Tensor, pstarts: torch.Tensor, num_rows: int, align: int,
                     out_g_stride: int, out_col_stride: int, row_in_group: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Column-wise copy (as :func:`fp8_columns_grouped`) *and* row-wise copy (as
    :func:`fp8_rows`) of ``x2d`` (M, K) from the same two passes: each pass reads ``x2d`` once
    (amax: the (G, K) column amax and the (M,) row amax, folded with ``atomic_max`` across row
    chunks and column blocks; bytes: both copies from each tile), instead of three reads for
    the two copies made apart. Same bytes and scales as the separate kernels (exact maxima,
    one scale formula).

    Source rows must be the groups back to back from row ``starts[0] = 0`` (split
    activations, or uniform groups such as weights), with padding rows, if any, after the last
    group: row-wise bytes of the padding rows are written by the programs of the layout's tail
    (``num_rows`` covers ``M + G * (align - 1)`` rows, so it has room for them).

    Returns (column-wise scale_inv (G, K) fp32, row-wise data (M, K) float8_e4m3fn, row-wise
    scale_inv (M,) fp32); the column-wise bytes go into ``out``.
    """
    args = (x2d, out, starts, sizes, pstarts, num_rows, align, out_g_stride, out_col_stride,
            row_in_group)
    if tracing():
        return _fp8_both_op(*args)
    return launch_cols(*args, with_rows=True)
