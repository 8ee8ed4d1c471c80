"""fc2's grouped dgrad with the (Scaled)SwiGLU backward in a warp-specialized epilogue (Gluon).

The same fusion as ``dgrad_dswiglu_triton.large_dgrad_dswiglu`` (its docstring: the dataflow,
the bits contract, the probs-gradient partials, the padding rows), built on the
warp-specialized Gluon grouped GEMM (``grouped_gemm_gluon``), so that the SwiGLU backward's
memory traffic (h read, dh and a written) runs on its own warps while the next tile's
wgmmas run. The Triton version lost (0.57-0.74x the two launches) because its epilogue ran
between k-loops with nothing overlapping it. Partitions (one CTA per SM, persistent):

* **producer** (1 warp; ``grouped_gemm_gluon._producer`` with ``W_KN``): TMA loads of dy's
  row tile and W2's (K, N) tile per k-step into a ``STAGES``-deep ring;
* **MMA consumer** (``grouped_gemm_gluon._consumer``, one warpgroup per 64 rows of the
  tile: 4 warps at the default 64 x 256 tiles, 8 or two 4-warp partitions (``SPLIT``) at
  128 x 128): async wgmma per k-step, at most one in flight; at the tile's end it rounds the
  fp32 accumulator to dy's dtype (the bits the plain dgrad stores: da) into a shared-memory
  tile ``c_buf`` and goes on with the next tile;
* **dSwiGLU epilogue** (``EPI_WARPS`` warps, :func:`_dswiglu_partition`): for each of its
  tiles it first issues the TMA loads of the tile's gate columns ``h[m0:m0+BM, n0:n0+BN]``
  and up columns ``h[..., F+n0:...]`` into two shared tiles (so the h read is in flight while
  the consumer still runs the tile's k-loop), then waits for ``c_buf``, and per ``SUB_M``-row
  slice computes ``swiglu_triton._dswiglu`` (the SwiGLU backward kernel's own per-element
  function, called from Gluon: the same fp32 operations, so the same bits) on the rounded
  da, gate, up and probs, and stores dh's two halves and a with masked pointer stores
  clipped at the group's end (a TMA store would write the next group's rows), the rows'
  probs-gradient partial sums to a (tiles_n, T) fp32 buffer, then frees ``c_buf``. Before
  its first tile it runs the padding rows (past ``offsets[-1]``) with da = 0 and h through
  pointer loads (what the two launches compute there).

Tiles: 64 x 256 x 64 by default (one consumer warpgroup, m64n256k16 wgmmas, 128 fp32
accumulator registers per thread): shared memory holds the ring (3 x 40 KiB), ``c_buf``
(32 KiB) and the two h tiles (64 KiB): 217 KiB of SM90's 227. The plain dgrad's 128 x 256
does not fit (the h tiles alone would take 128 KiB beside a 144 KiB ring and a 64 KiB
``c_buf``; and its 8 consumer warps hold 128 accumulator registers each, leaving 48 per
thread for the 4 other warps, too few for the epilogue's arithmetic). 128 x 128 with two
consumer warpgroups is a launch config. Each output element's k-steps are the plain dgrad's
(64 per step, in order, fp32, the first with ``use_acc=False``), so da has the bits of
``grouped_gemm_large_triton.large_dgrad`` / ``torch._grouped_mm`` and dh and a are the two
launches' bit for bit (checked on the H200: tests/test_dgrad_dswiglu_gluon.py and every
benchmark record). dprobs is the deterministic two-step sum of the Triton version
(``dgrad_dswiglu_triton._sum_partials_kernel`` over the partials in column-tile order): not
bitwise the SwiGLU kernel's order, compared with a tolerance.

Registers: the consumers' warps, the producer's and ``EPI_WARPS`` = 4 epilogue warps, rounded
up to warpgroups (:func:`total_warps`: 12 at the default, 16 at 128 x 128), ``maxnreg``
:func:`maxnreg` (65536 over the threads); ``setmaxnreg`` gives the workers ``WORKER_REGS``
(the epilogue holds a (SUB_M, BN) slice of da, gate, up and the outputs in fp32) and the
consumers the rest (``CONSUMER_REGS`` with ``SPLIT``). Two epilogue warps made the epilogue
the bottleneck (3x slower at E128, H200); staging probs in shared memory once per tile
changed nothing measurable.

Speed (H200, bf16, 2026-11-30, ``benchmarks/large_gemm_triton.py --gemms fc2_dswiglu
--gluon``, docs/benchmarks.md "fc2 dgrad + dSwiGLU in a warp-specialized Gluon epilogue"): 1.14-1.30x the Triton fused kernel, but 0.73x (E8 T16384 H4096 FF14336), 0.76x
(E32 T32768 H7168 FF2048) and 0.93x (E128 T65536 H2048 FF768) the two launches: at these
tiles the GEMM alone is slower than the plain dgrad at 128 x 256 (at 128 x 128: 4.10 against
2.65 ms at E8), and the epilogue's traffic and issue slots still slow the mainloop. So
``TE_OPS_FC2_DSWIGLU_EPILOGUE=auto`` stays off; where the fused launch is taken (``1``)
``TE_OPS_FC2_DSWIGLU_KERNEL=auto`` runs this kernel (``fused/fc2_dgrad_epilogue.py``).

In-place (``grad_into_input``): each h element is read by one tile's TMA load (or one padding
pointer load) before its dh is written by the same partition; a TMA box past the group's end
or past F reads other tiles' rows or columns, which are never used (masked stores; the probs
sum takes ``where(column < F)``).

Registered as ``torch.library.custom_op`` ``te_ops::grouped_dgrad_dswiglu_gluon`` with a fake
(a Gluon kernel is no ``wrap_triton`` kernel): compiles under ``torch.compile(fullgraph=True)``
and captures in a CUDA graph (device-side TMA descriptors, no host sync).
"""

from __future__ import annotations

import torch

from . import dgrad_dswiglu_triton as dd
from . import grouped_gemm_gluon as GG
from . import grouped_gemm_large_triton as lg
from . import swiglu_triton
from ..tracing import tracing
from .grouped_gemm_gluon import gluon, gluon_unsupported_reason
from .triton_launch import cdiv, launch, next_power_of_2

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
    )

    from .grouped_gemm_gluon import _consumer, _producer, _tile_at, _tile_table
    from .swiglu_triton import _dswiglu

__all__ = ["gluon_dswiglu_config", "gluon_dgrad_dswiglu", "gluon_dswiglu_unsupported_reason",
           "MAXNREG"]


def gluon_dswiglu_config() -> dict[str, int | bool]:
    """Launch parameters: 64 x 256 x 64 tiles, ``GROUP_M`` 8, a 3-stage ring, one consumer
    warpgroup (``num_warps`` = BLOCK_M / 16; at BLOCK_M 128 ``SPLIT`` makes two 4-warp
    consumer partitions, ``num_warps`` 4), a 4-warp epilogue on 8-row slices (``SUB_M``, a
    multiple of the 128-byte swizzle's 8 rows), ``WORKER_REGS`` registers per thread for the
    producer's and the epilogue's warpgroups and ``CONSUMER_REGS`` for a ``SPLIT`` consumer
    (consumer warps x CONSUMER_REGS + other warps x WORKER_REGS <= 2048: the 65536-register
    file over 32 threads). Measured the fastest of those timed (docs/benchmarks.md)."""
    return {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "STAGES": 3,
            "num_warps": 4, "EPI_WARPS": 4, "SUB_M": 8, "WORKER_REGS": 136, "SPLIT": False,
            "CONSUMER_REGS": 232}


def _resolve(config: dict | None) -> dict:
    """:func:`gluon_dswiglu_config` updated by ``config``, checked (known keys, ints >= 1 /
    bools, the warp counts of ``SPLIT``, the register file, the slice shape, the shared
    memory: :func:`shared_bytes` within ``grouped_gemm_gluon.SHARED_LIMIT``)."""
    base = gluon_dswiglu_config()
    unknown = sorted(set(config or {}) - set(base))
    if unknown:
        raise ValueError(f"config keys must be among {sorted(base)}, got unknown {unknown}")
    cfg = {**base, **(config or {})}
    lg.check_config_values(cfg, base)
    if cfg["BLOCK_M"] not in (64, 128) or cfg["BLOCK_N"] not in (64, 128, 256):
        raise ValueError(f"config needs BLOCK_M in (64, 128) and BLOCK_N in (64, 128, 256), "
                         f"got BLOCK_M={cfg['BLOCK_M']} BLOCK_N={cfg['BLOCK_N']}")
    want = 4 if cfg["SPLIT"] else cfg["BLOCK_M"] // 16
    if cfg["num_warps"] != want or (cfg["SPLIT"] and cfg["BLOCK_M"] != 128):
        raise ValueError(f"config num_warps must be {want} with BLOCK_M={cfg['BLOCK_M']} "
                         f"SPLIT={cfg['SPLIT']} (one warpgroup per 64 rows of the tile; SPLIT "
                         f"needs BLOCK_M 128), got {cfg['num_warps']}")
    if cfg["EPI_WARPS"] not in (1, 2, 4):
        raise ValueError(f"config EPI_WARPS must be 1, 2 or 4, got {cfg['EPI_WARPS']}")
    consumers = consumer_warps(cfg)
    workers = total_warps(cfg) - consumers
    if consumers * cfg["CONSUMER_REGS"] + workers * cfg["WORKER_REGS"] > 2048:
        raise ValueError(f"config {consumers} * CONSUMER_REGS + {workers} * WORKER_REGS must "
                         f"be <= 2048 (the register file over 32 threads), got "
                         f"{cfg['CONSUMER_REGS']} and {cfg['WORKER_REGS']}")
    # the epilogue layout's rows, and 8: a slice of the 128-byte-swizzled tiles
    rows = max(32 // (cfg["BLOCK_N"] // 8) * cfg["EPI_WARPS"], 8)
    if cfg["BLOCK_M"] % cfg["SUB_M"] or cfg["SUB_M"] % rows:
        raise ValueError(f"config SUB_M must divide BLOCK_M={cfg['BLOCK_M']} and be a multiple "
                         f"of {rows} (the epilogue layout's rows, the swizzle's 8), got SUB_M="
                         f"{cfg['SUB_M']}")
    need = shared_bytes(cfg)
    if need > GG.SHARED_LIMIT:
        raise ValueError(f"config STAGES={cfg['STAGES']} BLOCK_M={cfg['BLOCK_M']} BLOCK_N="
                         f"{cfg['BLOCK_N']} BLOCK_K={cfg['BLOCK_K']} needs {need} bytes of shared "
                         f"memory (ring, da tile, gate and up tiles, probs), more than the "
                         f"{GG.SHARED_LIMIT} SM90 leaves for them")
    return cfg


def shared_bytes(cfg: dict) -> int:
    """Shared memory of the launch in bytes (16-bit dtypes), barriers and the compiler's
    scratch aside: the ring (``STAGES`` x (BLOCK_M + BLOCK_N) x BLOCK_K), ``c_buf`` and the two
    h tiles (BLOCK_M x BLOCK_N each) and the fp32 probs of a tile (BLOCK_M)."""
    ring = cfg["STAGES"] * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2
    return ring + 3 * cfg["BLOCK_M"] * cfg["BLOCK_N"] * 2 + 4 * cfg["BLOCK_M"]


def consumer_warps(cfg: dict) -> int:
    """The MMA consumers' warps: one warpgroup per 64 rows of the tile."""
    return cfg.get("BLOCK_M", 128) // 16


def total_warps(cfg: dict) -> int:
    """Warps of the launch: the consumers', the producer's and the epilogue's, rounded up to
    whole warpgroups (``setmaxnreg`` acts on a warpgroup)."""
    return -(-(consumer_warps(cfg) + 1 + cfg["EPI_WARPS"]) // 4) * 4


def maxnreg(cfg: dict) -> int:
    """Registers per thread ptxas compiles the function under: 65536 over the launch's
    threads, rounded down to 8 (``setmaxnreg`` moves them between partitions at run
    time)."""
    return 65536 // (total_warps(cfg) * 32) // 8 * 8


#: Registers per thread ptxas compiles the default launch under (:func:`maxnreg`: 12 warps).
MAXNREG = maxnreg(gluon_dswiglu_config())


def gluon_dswiglu_unsupported_reason(dy: torch.Tensor, weights: torch.Tensor,
                                     h: torch.Tensor) -> str | None:
    """Why the Gluon kernel cannot take these operands (``None`` when it can): those of
    ``grouped_gemm_gluon.gluon_unsupported_reason`` (no Gluon, not SM90, TMA not possible for
    dy or W2 read as (G, K, N) along F, too many groups), h not TMA-loadable (contiguous, a
    16-byte-aligned base and row stride: F a multiple of 4 for 2-byte dtypes). dy is judged
    as the launch takes it: contiguous (a non-contiguous dy, e.g. the expanded gradient of
    ``out.sum()``, is copied first, so it is judged by a fresh contiguous tensor of its
    shape)."""
    if not dy.is_contiguous():
        dy = dy.new_empty(dy.shape)
    why = gluon_unsupported_reason(dy, weights)
    if why is not None:
        return why
    if weights.stride(2) != 1:
        return f"weights (G, N, F) are not contiguous along F (strides {weights.stride()})"
    if not h.is_contiguous():
        return "h is not contiguous"
    if (h.shape[1] * h.element_size()) % 16:
        return f"h's rows ({h.shape[1]} elements) are not a multiple of 16 bytes"
    if not lg._fake(h) and h.data_ptr() % 16:
        return "h does not start on a 16-byte boundary"
    return None


if gluon is not None:

    @gluon.jit
    def _rows_dswiglu(da, gate, up, pr, dh_ptr, a_ptr, dpp_ptr, rows, end, n0, M, N,
                      HAS_P: gl.constexpr, WRITE_OUT: gl.constexpr, SUB_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, layout: gl.constexpr):
        """dh, a and the probs partial of rows ``rows`` (below ``end``), columns n0.. (below
        N) from fp32 da, gate, up (SUB_M, BLOCK_N) in ``layout`` and the rows' probs ``pr``
        (fp32, ``SliceLayout(1, layout)``; unused without ``HAS_P``)."""
        cols = n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(0, layout))
        row_ok = rows < end
        col_ok = cols < N
        mask = row_ok[:, None] & col_ok[None, :]
        p = 1.0
        if HAS_P:
            p = pr[:, None]
        dgate, dup, out, dp = _dswiglu(gate, up, da, p, HAS_P)
        off = rows[:, None] * (2 * N) + cols[None, :]
        gl.store(dh_ptr + off, dgate.to(dh_ptr.dtype.element_ty), mask=mask)
        gl.store(dh_ptr + off + N, dup.to(dh_ptr.dtype.element_ty), mask=mask)
        if WRITE_OUT:
            gl.store(a_ptr + rows[:, None] * N + cols[None, :], out.to(a_ptr.dtype.element_ty),
                     mask=mask)
        if HAS_P:
            part = gl.sum(gl.where(col_ok[None, :], dp, 0.0), axis=1)
            gl.store(dpp_ptr + (n0 // BLOCK_N).to(gl.int64) * M + rows, part, mask=row_ok)

    @gluon.jit
    def _padding_rows(h_ptr, dh_ptr, a_ptr, p_ptr, dpp_ptr, offs_ptr, M, N, G, P,
                      HAS_P: gl.constexpr, WRITE_OUT: gl.constexpr, SUB_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, layout: gl.constexpr):
        """Rows past offsets[G-1]: the SwiGLU backward of da = 0 (h by pointer loads)."""
        pid = gl.program_id(0)
        tiles_n = gl.cdiv(N, BLOCK_N)
        pad_start = gl.minimum(gl.maximum(gl.load(offs_ptr + G - 1).to(gl.int64), 0), M)
        pad_tiles = ((M - pad_start + SUB_M - 1) // SUB_M * tiles_n).to(gl.int32)
        zero = gl.zeros([SUB_M, BLOCK_N], gl.float32, layout)
        for tile in range(pid, pad_tiles, P):
            rows = (pad_start + (tile // tiles_n) * SUB_M
                    + gl.arange(0, SUB_M, gl.SliceLayout(1, layout)).to(gl.int64))
            n0 = (tile % tiles_n) * BLOCK_N
            cols = n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(0, layout))
            mask = (rows < M)[:, None] & (cols < N)[None, :]
            off = rows[:, None] * (2 * N) + cols[None, :]
            gate = gl.load(h_ptr + off, mask=mask, other=0.0).to(gl.float32)
            up = gl.load(h_ptr + off + N, mask=mask, other=0.0).to(gl.float32)
            pr = gl.load(p_ptr + rows, mask=rows < M, other=0.0).to(gl.float32)
            _rows_dswiglu(zero, gate, up, pr, dh_ptr, a_ptr, dpp_ptr, rows, M, n0, M, N,
                          HAS_P, WRITE_OUT, SUB_M, BLOCK_N, layout)

    @gluon.jit
    def _dswiglu_partition(c_buf, c_ready, c_empty, h_desc, h_bufs, p_buf, h_bar, h_ptr, dh_ptr,
                           a_ptr, p_ptr, dpp_ptr, offs_ptr, M, N, G, P, HAS_P: gl.constexpr,
                           WRITE_OUT: gl.constexpr, GBLOCK: gl.constexpr,
                           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           GROUP_M: gl.constexpr, SUB_M: gl.constexpr,
                           EPI_WARPS: gl.constexpr):
        """The padding rows, then per tile: h's gate / up tiles by TMA (issued before waiting
        for the tile's da), then the SwiGLU backward slice by slice, then ``c_buf`` freed."""
        pid = gl.program_id(0)
        tiles_n = gl.cdiv(N, BLOCK_N)
        lanes: gl.constexpr = BLOCK_N // 8
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // lanes, lanes], [EPI_WARPS, 1],
                                                [1, 0])
        _padding_rows(h_ptr, dh_ptr, a_ptr, p_ptr, dpp_ptr, offs_ptr, M, N, G, P, HAS_P,
                      WRITE_OUT, SUB_M, BLOCK_N, layout)
        ends = _tile_table(offs_ptr, M, G, tiles_n, BLOCK_M, GBLOCK, EPI_WARPS)
        n_tiles = gl.max(ends, 0)
        nbytes: gl.constexpr = 2 * BLOCK_M * BLOCK_N * 2
        p_layout: gl.constexpr = gl.BlockedLayout([1], [32], [EPI_WARPS], [0])
        gate_buf = h_bufs.index(0)
        up_buf = h_bufs.index(1)
        t = 0
        for tile in range(pid, n_tiles, P):
            g, m0, end, pn = _tile_at(ends, tile, offs_ptr, M, tiles_n, BLOCK_M, GROUP_M)
            n0 = pn * BLOCK_N
            fence_async_shared()  # this partition's reads of the last tile's h come first
            mbarrier.expect(h_bar, nbytes)
            tma.async_copy_global_to_shared(h_desc, [m0.to(gl.int32), n0], h_bar, gate_buf)
            tma.async_copy_global_to_shared(h_desc, [m0.to(gl.int32), N + n0], h_bar, up_buf)
            if HAS_P:  # the tile's probs into shared memory once (not a load per slice)
                prow = m0 + gl.arange(0, BLOCK_M, p_layout).to(gl.int64)
                p_buf.store(gl.load(p_ptr + prow, mask=prow < end, other=0.0).to(gl.float32))
                gl.thread_barrier()
            mbarrier.wait(h_bar, t & 1)
            mbarrier.wait(c_ready, t & 1)
            for i in gl.static_range(BLOCK_M // SUB_M):
                da = c_buf.slice(i * SUB_M, SUB_M).load(layout).to(gl.float32)
                gate = gate_buf.slice(i * SUB_M, SUB_M).load(layout).to(gl.float32)
                up = up_buf.slice(i * SUB_M, SUB_M).load(layout).to(gl.float32)
                pr = p_buf.slice(i * SUB_M, SUB_M).load(gl.SliceLayout(1, layout))
                rows = m0 + i * SUB_M + gl.arange(0, SUB_M, gl.SliceLayout(1, layout)).to(
                    gl.int64)
                _rows_dswiglu(da, gate, up, pr, dh_ptr, a_ptr, dpp_ptr, rows, end, n0, M, N,
                              HAS_P, WRITE_OUT, SUB_M, BLOCK_N, layout)
            gl.thread_barrier()  # every epilogue warp has read c_buf and the h tiles
            mbarrier.arrive(c_empty)
            t += 1

    @gluon.jit
    def _dgrad_dswiglu_kernel(x_ptr, w_ptr, h_ptr, dh_ptr, a_ptr, p_ptr, dpp_ptr, offs_ptr,
                              M, N, K, G, P, stride_wg, stride_wn, stride_wk,
                              HAS_P: gl.constexpr, WRITE_OUT: gl.constexpr,
                              GBLOCK: gl.constexpr, BLOCK_M: gl.constexpr,
                              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                              GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                              EPI_WARPS: gl.constexpr, SUB_M: gl.constexpr,
                              WORKER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                              SPLIT: gl.constexpr, num_warps: gl.constexpr):
        """x = dy (M, K), W (G, K_red=K, N_out=N) by strides (N contiguous), h / dh (M, 2N),
        a (M, N), p (M,), dpp (cdiv(N, BLOCK_N), M) fp32. Allocates the ring, ``c_buf``, the
        h tiles and the barriers, then forks the partitions."""
        dtype: gl.constexpr = x_ptr.dtype.element_ty
        x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
        x_desc = tma.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1],
                                            block_shape=[BLOCK_M, BLOCK_K], layout=x_layout)
        w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_K, BLOCK_N],
                                                                      dtype)
        w_desc = tma.make_tensor_descriptor(w_ptr, shape=[G, K, N],
                                            strides=[stride_wg, stride_wk, 1],
                                            block_shape=[1, BLOCK_K, BLOCK_N], layout=w_layout)
        c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
        h_desc = tma.make_tensor_descriptor(h_ptr, shape=[M, 2 * N], strides=[2 * N, 1],
                                            block_shape=[BLOCK_M, BLOCK_N], layout=c_layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_K, BLOCK_N], w_layout)
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], x_layout)
        c_buf = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], c_layout)
        h_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], c_layout)
        p_buf = gl.allocate_shared_memory(gl.float32, [BLOCK_M],
                                          gl.SwizzledSharedLayout(1, 1, 1, [0]))
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        c_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        c_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        h_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        arrivals: gl.constexpr = 2 if SPLIT else 1
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=arrivals)
        mbarrier.init(c_ready, count=arrivals)
        mbarrier.init(c_empty, count=1)
        mbarrier.init(h_bar, count=1)
        if SPLIT:
            gl.warp_specialize([
                (_consumer, (a_bufs, b_bufs, c_buf, ready, empty, c_ready, c_empty, offs_ptr,
                             M, N, K, G, P, True, GBLOCK, BLOCK_M, BLOCK_N, BLOCK_K, STAGES,
                             num_warps, 0, BLOCK_M // 2)),
                (_consumer, (a_bufs, b_bufs, c_buf, ready, empty, c_ready, c_empty, offs_ptr,
                             M, N, K, G, P, True, GBLOCK, BLOCK_M, BLOCK_N, BLOCK_K, STAGES,
                             num_warps, 1, BLOCK_M // 2)),
                (_producer, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, offs_ptr, M, N, K,
                             G, P, True, GBLOCK, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES)),
                (_dswiglu_partition, (c_buf, c_ready, c_empty, h_desc, h_bufs, p_buf, h_bar, h_ptr,
                                      dh_ptr, a_ptr, p_ptr, dpp_ptr, offs_ptr, M, N, G, P,
                                      HAS_P, WRITE_OUT, GBLOCK, BLOCK_M, BLOCK_N, GROUP_M,
                                      SUB_M, EPI_WARPS)),
            ], [num_warps, 1, EPI_WARPS], [CONSUMER_REGS, WORKER_REGS, WORKER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (a_bufs, b_bufs, c_buf, ready, empty, c_ready, c_empty, offs_ptr,
                             M, N, K, G, P, True, GBLOCK, BLOCK_M, BLOCK_N, BLOCK_K, STAGES,
                             num_warps, 0, BLOCK_M)),
                (_producer, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, offs_ptr, M, N, K,
                             G, P, True, GBLOCK, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES)),
                (_dswiglu_partition, (c_buf, c_ready, c_empty, h_desc, h_bufs, p_buf, h_bar, h_ptr,
                                      dh_ptr, a_ptr, p_ptr, dpp_ptr, offs_ptr, M, N, G, P,
                                      HAS_P, WRITE_OUT, GBLOCK, BLOCK_M, BLOCK_N, GROUP_M,
                                      SUB_M, EPI_WARPS)),
            ], [1, EPI_WARPS], [WORKER_REGS, WORKER_REGS])


def _launch(dy: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor, h: torch.Tensor,
            probs: torch.Tensor | None, config: dict | None, grad_into_input: bool,
            write_out: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Allocate the outputs, launch the fused kernel and the probs-partials reduction:
    (dh, dprobs, a | None). Nothing to multiply (no groups, rows, columns or reduction): the
    SwiGLU backward on a zero da, the two launches' values."""
    m, k = dy.shape
    groups, f = weights.shape[0], weights.shape[2]
    cfg = _resolve(config)
    if groups == 0 or k == 0 or m == 0 or f == 0:
        da = torch.zeros(m, f, device=dy.device, dtype=dy.dtype)
        return swiglu_triton._backward(h, da, probs, write_out, grad_into_input,
                                       swiglu_triton._bwd_kernel)
    dy = dy.contiguous()
    offsets = offsets.contiguous()
    why = gluon_dswiglu_unsupported_reason(dy, weights, h)
    if why is not None:
        raise RuntimeError(f"the Gluon fc2 dgrad + dSwiGLU kernel cannot run: {why}")
    dh = h if grad_into_input else torch.empty_like(h)
    a = torch.empty(m, f, device=dy.device, dtype=dy.dtype) if write_out else None
    tiles_n = cdiv(f, cfg["BLOCK_N"])
    partials = (torch.empty(tiles_n, m, device=dy.device, dtype=torch.float32)
                if probs is not None else None)
    p = probs.contiguous() if probs is not None else dy
    lg._ensure_allocator()
    grid = (lg.grid_size(dy.device, m, groups, f, cfg["BLOCK_M"], cfg["BLOCK_N"]),)
    _dgrad_dswiglu_kernel[grid](
        dy, weights, h, dh, a if a is not None else dh, p,
        partials if partials is not None else dy, offsets, m, f, k, groups, grid[0],
        weights.stride(0), weights.stride(2), weights.stride(1), HAS_P=probs is not None,
        WRITE_OUT=write_out, GBLOCK=max(next_power_of_2(groups), 1), maxnreg=maxnreg(cfg), **cfg)
    dp = None
    if partials is not None:  # a fixed order (no atomics), the Triton version's reduction
        dp = torch.empty(m, device=dy.device, dtype=probs.dtype)
        launch(dd._sum_partials_kernel, (cdiv(m, dd._SUM_BLOCK),), partials, dp, m, tiles_n,
               BLOCK=dd._SUM_BLOCK)
    return dh, dp, a


def gluon_dgrad_dswiglu(dy: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                        h: torch.Tensor, probs: torch.Tensor | None = None,
                        write_output: bool = True, grad_into_input: bool = False,
                        config: dict | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """fc2's grouped dgrad with the (Scaled)SwiGLU backward in a warp-specialized epilogue:
    the contract of ``dgrad_dswiglu_triton.large_dgrad_dswiglu`` (formulas, shapes, dh and a
    bitwise ``large_dgrad`` then ``swiglu_triton.swiglu_backward(..., write_output=True)``,
    dprobs the same fp32 terms summed in column-tile order, padding rows from da = 0,
    ``grad_into_input`` writes dh over h in eager calls).

    Shapes: dy (T, N) bf16/fp16 on CUDA SM90, weights (G, N, F) contiguous along F, offsets
    (G,) int32/int64 cumulative group ends, h (T, 2F) contiguous in dy's dtype, probs (T,)
    float or ``None`` -> (dh (T, 2F), dprobs (T,) in probs' dtype or ``None``, a (T, F) or
    ``None`` with ``write_output=False``). ``config`` changes keys of
    :func:`gluon_dswiglu_config` (benchmarks). Under a ``torch.compile`` trace the call is the
    op ``te_ops::grouped_dgrad_dswiglu_gluon`` (dh a new buffer, a always computed).

    Raises
    ------
    ValueError
        Shapes, dtypes or devices do not match (the argument, expected and actual value);
        ``config`` has an unknown key or a bad value.
    RuntimeError
        The kernel cannot run here (:func:`gluon_dswiglu_unsupported_reason`).
    """
    dd._check(dy, weights, offsets, h, probs)
    if tracing() and config is None:
        dh, dp, a = torch.ops.te_ops.grouped_dgrad_dswiglu_gluon(dy, weights, offsets, h,
                                                                 probs)
        return dh, (dp if probs is not None else None), (a if write_output else None)
    return _launch(dy, weights, offsets, h.contiguous() if not grad_into_input else h, probs,
                   config, grad_into_input, write_output)


@torch.library.custom_op("te_ops::grouped_dgrad_dswiglu_gluon", mutates_args=())
def _grouped_dgrad_dswiglu_gluon_op(dy: torch.Tensor, weights: torch.Tensor,
                                    offsets: torch.Tensor, h: torch.Tensor,
                                    probs: torch.Tensor | None
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gluon_dgrad_dswiglu` as an opaque op: ``(dh, dprobs, a)``, dprobs 0-element
    without probs."""
    dh, dp, a = _launch(dy, weights, offsets, h.contiguous(), probs, None, False)
    return dh, (dp if dp is not None else dy.new_empty(0)), a


@_grouped_dgrad_dswiglu_gluon_op.register_fake
def _(dy: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor, h: torch.Tensor,
      probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, f = dy.shape[0], weights.shape[2]
    dp = dy.new_empty(m, dtype=probs.dtype) if probs is not None else dy.new_empty(0)
    return h.new_empty(m, 2 * f), dp, dy.new_empty(m, f)
