"""Warp-specialized persistent grouped GEMM for SM90 in Gluon (fprop, dgrad).

The persistent Triton kernel (``grouped_gemm_large_triton``, ``FLAT``) runs its tile epilogue
(fp32 -> bf16, masked stores clipped at the group's end) on the warps that issue the next
tile's wgmmas: Triton 3.6 builds no warp-specialized partitions for ``tl.range(...,
warp_specialize=True)`` on SM90. Gluon (``triton.experimental.gluon``, in Triton 3.6) states
the partitions explicitly (``gl.warp_specialize``). This kernel has three:

* the **producer** (1 warp): walks the program's tiles, issues the TMA loads of x's row tile
  and W's tile per k-step into a ``STAGES``-deep shared-memory ring (``ready`` / ``empty``
  mbarriers per slot);
* the **MMA consumer** (the default partition, ``num_warps`` = 8: two warpgroups, each 64 of
  the tile's 128 rows): one async ``warpgroup_mma`` per k-step into a 128 x 256 fp32
  accumulator, at most one in flight (the slot read by the previous one is released as soon
  as it completes); at the tile's end it rounds the accumulator to the output dtype into one
  shared-memory tile buffer (``c_ready`` / ``c_free``) and goes on with the next tile;
* the **epilogue** (``EPI_WARPS`` = 2 warps): reads that buffer in ``SUB_M``-row slices and
  stores the rows inside the tile's group with masked pointer stores (a TMA store would write
  the next group's rows), then frees the buffer. So the global stores of tile t overlap the
  MMAs of tile t + 1; the consumer's part of the epilogue is the register -> shared copy.
  Before its first tile it writes the padding rows' zeros (rows past ``offsets[-1]``).

Config switches (:func:`gluon_config`; the dispatched calls use :data:`DISPATCH_CONFIG`):

* ``SPLIT``: the consumer is two 4-warp partitions, rows [0, 64) and [64, 128) of each tile,
  each releasing ring slots by itself (the ring barriers count two arrivals);
* ``C_HALF`` (with ``SPLIT``): the output buffer holds 64 rows (32 KiB); half 0 writes it,
  the epilogue stores it and frees it for half 1 (``c_free`` [1]), then stores half 1's
  rows and frees it for half 0's next tile (``c_free`` [0]). The 32 KiB saved hold a fourth
  ring stage (``STAGES`` = 4: 4 x 48 + 32 KiB = 224 KiB): the loads run one more k-step
  ahead of the wgmmas, which measured 1.05-1.11x the 3-stage ``SPLIT`` config at the long
  k-loops of E8 and E32 (1.00-1.03x at E128);
* ``TMA_STORE``: the epilogue stores a buffered part (64 rows with ``C_HALF``, else 128)
  that lies inside its group with one TMA store from the shared buffer (a device-side
  descriptor of y as (M, N)) and waits for it before freeing the buffer; tail parts and the
  padding rows keep the masked register stores. The consumers fence the proxy
  (``fence_async_shared``) before handing the buffer over. Where y's rows are not a
  multiple of 16 bytes (``N`` * element size; a TMA descriptor's stride must be) the launch
  turns it off (:func:`_launch_args`).

One wgmma is in flight per consumer (the slot of the previous k-step is released as soon as
its wgmma completed).

Same schedule as the Triton kernel's ``FLAT`` one: the tiles of all groups numbered group
after group (``cdiv(rows_g, 128) * cdiv(N, 256)`` per group, in ``GROUP_M``-row-tile bands),
program p takes tiles p, p + P, ...; each partition finds a tile's group in a cumulative tile
table it keeps in registers (``next_power_of_2(G)`` lanes). Groups' rows clamped to
``0 <= start <= end <= M`` as there. The k-steps of every output element run in order with
fp32 accumulation, the first with ``use_acc=False`` (CUTLASS's order), so outputs are meant to
equal ``torch._grouped_mm``'s bit for bit (checked on the H200 by
``experimental/gemm_kernel_ab/large_gemm_triton.py --gluon``).

Loads through device-side TMA descriptors (``tma.make_tensor_descriptor``; the torch-backed
allocator of ``grouped_gemm_large_triton`` is installed when none is set): x as (M, K) with
(128, 64) blocks, W as (G, N, K) with (1, 256, 64) blocks for fprop (the shared tile is
transposed as a view for the wgmma) or as (G, K_red, N_out) with (1, 64, 256) blocks for
dgrad (``W_KN``). Shared memory: ``STAGES`` x 48 KiB ring + the output tile, 64 KiB (3
stages: 208 KiB of the H200's 227) or 32 KiB with ``C_HALF`` (4 stages: 224 KiB).

Measured on the H200 against the Triton kernel and ``torch._grouped_mm`` (today's numbers:
docs/performance.md "Gluon fprop/dgrad"): with 3 stages 1.03-1.10x the Triton kernel at E128
T65536 H2048 FF768 (short k-loops, where the overlapped epilogue is a large share of a tile),
0.92-0.98x at E8 T16384 H4096 FF14336 and E32 T32768 H7168 FF2048 (long k-loops); with
``C_HALF`` and 4 stages 1.00-1.04x at E8 / E32 and 1.05-1.10x at E128. Auto dispatch takes
it where a Gluon row of :mod:`te_ops.gemm.rules` holds (:func:`gluon_grouped_gemm`: the op
``te_ops::grouped_gemm_gluon`` under a trace).
"""

from __future__ import annotations

import torch

from ..tracing import tracing
from .grouped_gemm_large_triton import (
    _check,
    _ensure_allocator,
    check_config_values,
    grid_size,
    large_dgrad,
    large_fprop,
    tma_unsupported_reason,
)
from ..kernels.triton_launch import capability, launch, next_power_of_2

try:  # Gluon ships with Triton >= 3.5 (experimental); optional like Triton itself
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except ImportError:  # pragma: no cover - depends on the install
    triton = gluon = gl = None

__all__ = ["gluon_config", "gluon_fprop", "gluon_dgrad", "gluon_unsupported_reason",
           "gluon_grouped_gemm", "GLUON_MAX_GROUPS",
           "DISPATCH_CONFIG"]

#: The tile table has ``next_power_of_2(G)`` int64 lanes per partition; above this many
#: groups the kernel is not offered (:func:`gluon_unsupported_reason`).
GLUON_MAX_GROUPS = 1024

#: The launch config of the dispatched calls: ``SPLIT`` (two 4-warp consumer partitions),
#: ``C_HALF`` (a 64-row output buffer the two fill in turn) and a 4-stage ring: measured
#: 1.05-1.11x the 3-stage ``SPLIT`` config at E8 and E32, 1.00-1.03x at E128 (same runs,
#: interleaved). ``TMA_STORE``: in power-capped blocks of back-to-back
#: calls on the H200 1.02-1.08x without it at E128,
#: 1.007-1.029x at E8, 0.991-1.026x at E32, bitwise equal.
DISPATCH_CONFIG: dict[str, int | bool] = {"SPLIT": True, "num_warps": 4, "C_HALF": True,
                                          "STAGES": 4, "TMA_STORE": True}

#: Registers per thread ptxas may use: 65536 / (12 warps x 32 threads), rounded down to 8.
MAXNREG = 168


def gluon_config() -> dict[str, int]:
    """Launch parameters: 128 x 256 x 64 tiles (the Triton kernel's and CUTLASS's), ``GROUP_M``
    8, a 3-stage load ring, 8 consumer warps (two warpgroups), a 2-warp epilogue partition
    storing 8-row slices, ``WORKER_REGS`` registers per thread for the producer's and the
    epilogue's warpgroup (they share the third warpgroup; the consumers get the rest of the
    65536). 12 warps in all, so ptxas compiles every partition under :data:`MAXNREG` (it
    allocates registers for the whole function; ``setmaxnreg`` only moves them at run time,
    and 16 warps would cap the wgmma's 128 accumulator registers at 128 in all). Off by
    default: ``SPLIT``, ``C_HALF``, ``TMA_STORE`` (module docstring; :data:`DISPATCH_CONFIG`
    sets them). One wgmma in flight per consumer."""
    return {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "STAGES": 3,
            "num_warps": 8, "EPI_WARPS": 2, "SUB_M": 8, "WORKER_REGS": 48, "SPLIT": False,
            "CONSUMER_REGS": 232, "C_HALF": False, "TMA_STORE": False}


def _resolve(config: dict | None) -> dict:
    """:func:`gluon_config` updated by ``config``: known keys only; ``SPLIT`` (two 4-warp
    consumer partitions, each 64 rows of the tile, ``CONSUMER_REGS`` for the second) needs
    ``num_warps`` 4 (the default partition is the first half); the switches bools, the sizes
    and counts ints >= 1 (``check_config_values``); ``C_HALF`` needs ``SPLIT``;
    ring + output buffer within :data:`SHARED_LIMIT`. Raises
    ``ValueError`` naming the key otherwise."""
    cfg = gluon_config()
    unknown = sorted(set(config or {}) - set(cfg))
    if unknown:
        raise ValueError(f"config keys must be among {sorted(cfg)}, got unknown {unknown}")
    cfg.update(config or {})
    check_config_values(cfg, gluon_config())  # bools for the switches, ints >= 1 else
    if cfg["SPLIT"] and cfg["num_warps"] != 4:
        raise ValueError(f"config SPLIT=True needs num_warps=4 (one warpgroup per consumer "
                         f"partition), got num_warps={cfg['num_warps']}")
    if not cfg["SPLIT"] and cfg["num_warps"] != 8:
        raise ValueError(f"config num_warps must be 8 (two warpgroups, 64 rows each) without "
                         f"SPLIT, got {cfg['num_warps']}")
    if cfg["C_HALF"] and not cfg["SPLIT"]:
        raise ValueError("config C_HALF=True (a 64-row output buffer the two consumer "
                         "partitions fill in turn) needs SPLIT=True, got SPLIT=False")
    need = _shared_bytes(cfg)
    if need > SHARED_LIMIT:
        raise ValueError(f"config STAGES={cfg['STAGES']} with C_HALF={cfg['C_HALF']} needs "
                         f"{need} bytes of shared memory (ring + output buffer, 16-bit "
                         f"dtypes), more than the {SHARED_LIMIT} SM90 leaves for them")
    return cfg


#: Shared memory per block on SM90 (227 KiB) less 2 KiB for the barriers, ``rows_buf`` and
#: the compiler's scratch (about 1 KiB in the sm_90 compiles, Triton 3.6).
SHARED_LIMIT = 227 * 1024 - 2048


def _shared_bytes(cfg: dict) -> int:
    """The ring (``STAGES`` x one x tile + one W tile) and the output buffer (``BLOCK_M`` or,
    ``C_HALF``, ``BLOCK_M / 2`` rows), in bytes of a 16-bit dtype."""
    ring = cfg["STAGES"] * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2
    rows = cfg["BLOCK_M"] // 2 if cfg["C_HALF"] else cfg["BLOCK_M"]
    return ring + rows * cfg["BLOCK_N"] * 2


def gluon_unsupported_reason(x: torch.Tensor, weights: torch.Tensor) -> str | None:
    """Why the Gluon kernel cannot take these operands (``None`` when it can): no Gluon,
    not CUDA SM90 (wgmma, setmaxnreg), TMA not possible (:func:`tma_unsupported_reason`),
    more than :data:`GLUON_MAX_GROUPS` groups."""
    if gluon is None:
        return "the installed Triton has no triton.experimental.gluon"
    if x.device.type != "cuda":
        return f"needs a CUDA device, got {x.device.type}"
    if capability(x.device) != (9, 0):
        return "needs SM90 (Hopper wgmma and warp specialization)"
    if weights.shape[0] > GLUON_MAX_GROUPS:
        return f"more than {GLUON_MAX_GROUPS} groups ({weights.shape[0]})"
    return tma_unsupported_reason(x, weights)


if gluon is not None:

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _tile_table(offs_ptr, M, G, tiles_n, BLOCK_M: gl.constexpr, GBLOCK: gl.constexpr,
                    WARPS: gl.constexpr):
        """Cumulative tile counts of groups 0..g in lane g (int64; lanes past G - 1 hold
        the total), rows clamped as the Triton kernel's ``_tile_ends``."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        gi = gl.arange(0, GBLOCK, layout)
        real = gi < G
        end = gl.load(offs_ptr + gi, mask=real, other=0).to(gl.int64)
        end = gl.minimum(gl.maximum(end, 0), M)
        start = gl.load(offs_ptr + gi - 1, mask=(gi > 0) & real, other=0).to(gl.int64)
        start = gl.minimum(gl.maximum(start, 0), end)
        count = gl.where(real, (end - start + BLOCK_M - 1) // BLOCK_M * tiles_n, 0)
        return gl.associative_scan(count, 0, _add)

    @gluon.jit
    def _group_rows(offs_ptr, g, M):
        """Rows [start, end) of group g (g < G), clamped to 0 <= start <= end <= M."""
        start = gl.load(offs_ptr + gl.maximum(g - 1, 0)).to(gl.int64)
        start = gl.where(g == 0, 0, start)
        end = gl.minimum(gl.maximum(gl.load(offs_ptr + g).to(gl.int64), 0), M)
        return gl.minimum(gl.maximum(start, 0), end), end

    @gluon.jit
    def _tile_at(ends, tile, offs_ptr, M, tiles_n, BLOCK_M: gl.constexpr,
                 GROUP_M: gl.constexpr):
        """(group, first row, row end of the group, column tile) of ``tile``: its group is
        the count of table lanes <= tile; inside the group GROUP_M-row-tile bands."""
        before = ends <= tile
        g = gl.sum(before.to(gl.int32), 0)
        base = gl.max(gl.where(before, ends, 0), 0)
        start, end = _group_rows(offs_ptr, g, M)
        tiles_m = ((end - start + BLOCK_M - 1) // BLOCK_M).to(gl.int32)
        local = (tile - base).to(gl.int32)
        band = GROUP_M * tiles_n
        first_m = (local // band) * GROUP_M
        size_m = gl.minimum(tiles_m - first_m, GROUP_M)
        pm = first_m + (local % band) % size_m
        pn = (local % band) // size_m
        return g, start + pm * BLOCK_M, end, pn

    @gluon.jit
    def _producer(x_desc, w_desc, a_bufs, b_bufs, ready, empty, offs_ptr, M, N, K, G, P,
                  W_KN: gl.constexpr, GBLOCK: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                  STAGES: gl.constexpr):
        """TMA loads of every k-step of the program's tiles into the ring, in tile order
        (:func:`_load_tiles`; the signature the Gluon epilogue kernels, ``fc1_swiglu_gluon``
        and ``dgrad_dswiglu_gluon``, call)."""
        _load_tiles(x_desc, x_desc, w_desc, a_bufs, b_bufs, None, ready, empty, offs_ptr, M,
                    N, K, G, P, W_KN, GBLOCK, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES,
                    None)

    @gluon.jit
    def _load_tiles(x_desc, xh_desc, w_desc, a_bufs, b_bufs, rows_buf, ready, empty, offs_ptr,
                    M, N, K, G, P, W_KN: gl.constexpr, GBLOCK: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                    GROUP_M: gl.constexpr, STAGES: gl.constexpr, x_ptr):
        """TMA loads of every k-step of the program's tiles into the ring, in tile order.
        ``xh_desc``, ``rows_buf`` and ``x_ptr`` are not read: the kernel passes them so that
        the partition's arguments stay those of the measured kernel."""
        pid = gl.program_id(0)
        tiles_n = gl.cdiv(N, BLOCK_N)
        ends = _tile_table(offs_ptr, M, G, tiles_n, BLOCK_M, GBLOCK, 1)
        n_tiles = gl.max(ends, 0)
        it = 0
        for tile in range(pid, n_tiles, P):
            g, m0, end, pn = _tile_at(ends, tile, offs_ptr, M, tiles_n, BLOCK_M, GROUP_M)
            m0 = m0.to(gl.int32)
            n0 = pn * BLOCK_N
            it = _load_steps(x_desc, w_desc, a_bufs, b_bufs, ready, empty, it, g, m0, n0, K,
                             W_KN, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)

    @gluon.jit
    def _load_steps(x_desc, w_desc, a_bufs, b_bufs, ready, empty, it, g, m0, n0, K,
                    W_KN: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
        """One tile's k-steps of :func:`_load_tiles` (ring iterations ``it``..): x's row
        block and W's tile; returns the next ring iteration."""
        nbytes: gl.constexpr = (BLOCK_M + BLOCK_N) * BLOCK_K * 2
        for k0 in range(0, K, BLOCK_K):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(x_desc, [m0, k0], bar, a_bufs.index(s))
            if W_KN:
                tma.async_copy_global_to_shared(w_desc, [g, k0, n0], bar, b_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(w_desc, [g, n0, k0], bar, b_bufs.index(s))
            it += 1
        return it

    @gluon.jit
    def _mma_tile(a_bufs, b_bufs, out_buf, ready, empty, c_free, free_phase, K, it,
                  W_KN: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  BLOCK_K: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
                  HALF: gl.constexpr, ROWS: gl.constexpr):
        """One tile's k-steps (ring iterations ``it``..), one wgmma in flight (the slot
        of the previous k-step is released once its wgmma completed); the rounded
        accumulator into ``out_buf`` once the epilogue freed it (``c_free`` at parity
        ``free_phase``). Returns the next ring iteration."""
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_N, 16])
        acc = gl.zeros([ROWS, BLOCK_N], gl.float32, mma_layout)
        for k0 in range(0, K, BLOCK_K):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            if W_KN:
                b = b_bufs.index(s).reshape([BLOCK_K, BLOCK_N])
            else:
                b = b_bufs.index(s).reshape([BLOCK_N, BLOCK_K]).permute((1, 0))
            a = a_bufs.index(s).slice(HALF * ROWS, ROWS)
            acc = warpgroup_mma(a, b, acc, use_acc=k0 > 0, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if ROWS == BLOCK_M:
                gl.thread_barrier()  # both warpgroups' previous wgmma done
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=k0 >= BLOCK_K)
            it += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if ROWS == BLOCK_M:
            gl.thread_barrier()
        # the last k-step's slot (where there is one)
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=K > 0)
        out = acc.to(out_buf.dtype)
        mbarrier.wait(c_free, free_phase)
        out_buf.store(out)
        return it

    @gluon.jit
    def _consumer(a_bufs, b_bufs, c_buf, ready, empty, c_ready, c_empty, offs_ptr, M, N, K,
                  G, P, W_KN: gl.constexpr, GBLOCK: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                  WARPS: gl.constexpr, HALF: gl.constexpr, ROWS: gl.constexpr):
        """wgmma over the ring's slots, one in flight; the rounded tile into ``c_buf``
        (BLOCK_M rows; ``c_ready`` counts the consumer partitions, ``c_empty`` the
        epilogue's): :func:`_mma_tiles` of rows [HALF * ROWS, (HALF + 1) * ROWS) of the
        buffer. The signature the Gluon epilogue
        kernels (``fc1_swiglu_gluon``, ``dgrad_dswiglu_gluon``) call."""
        _mma_tiles(a_bufs, b_bufs, c_buf.slice(HALF * ROWS, ROWS), None, ready, empty,
                   c_ready, c_empty, offs_ptr, M, N, K, G, P, W_KN, GBLOCK, BLOCK_M, BLOCK_N,
                   BLOCK_K, STAGES, WARPS, HALF, ROWS, False)

    @gluon.jit
    def _mma_tiles(a_bufs, b_bufs, out_buf, rows_buf, ready, empty, c_ready, c_free, offs_ptr,
                   M, N, K, G, P, W_KN: gl.constexpr, GBLOCK: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                   STAGES: gl.constexpr, WARPS: gl.constexpr, HALF: gl.constexpr,
                   ROWS: gl.constexpr, SECOND_TURN: gl.constexpr):
        """A consumer partition: the program's tiles (:func:`_mma_tile`), each rounded into
        ``out_buf`` (ROWS rows), then an arrival on ``c_ready``.
        ``ROWS`` = BLOCK_M: one partition of ``WARPS`` = 8 warps computes the whole tile
        and syncs its warps before each barrier arrival (an arrival is one thread's);
        ``ROWS`` = BLOCK_M / 2 (``SPLIT``): this partition (4 warps) computes rows
        [HALF * ROWS, (HALF + 1) * ROWS) of each tile and arrives by itself (the ring's
        barriers count two arrivals), so the two halves need no common sync.
        ``rows_buf`` is not read (the kernel passes it: the partition's arguments stay
        those of the measured kernel).
        ``c_free`` frees ``out_buf`` once per tile: after the epilogue read the previous
        tile's rows, or (``SECOND_TURN``: ``C_HALF``'s second half, whose buffer half 0
        shares) after it read this tile's first half."""
        pid = gl.program_id(0)
        tiles_n = gl.cdiv(N, BLOCK_N)
        ends = _tile_table(offs_ptr, M, G, tiles_n, BLOCK_M, GBLOCK, WARPS)
        n_tiles = gl.max(ends, 0)
        it = 0
        t = 0
        for _tile in range(pid, n_tiles, P):
            if SECOND_TURN:
                free_phase = t & 1
            else:
                free_phase = (t & 1) ^ 1
            it = _mma_tile(a_bufs, b_bufs, out_buf, ready, empty, c_free, free_phase,
                           K, it, W_KN, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, WARPS, HALF,
                           ROWS)
            # the buffer's generic-proxy stores before a TMA store (async proxy) reads them
            # (``TMA_STORE``; one fence per tile otherwise unused)
            fence_async_shared()
            gl.thread_barrier()  # every warp's rows are in the buffer
            mbarrier.arrive(c_ready)
            t += 1

    @gluon.jit
    def _store_rows(y_ptr, vals, r0, end, n0, N, SUB_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    layout: gl.constexpr):
        """Masked store of a (SUB_M, BLOCK_N) slice at rows r0.. (below ``end``), columns
        n0.. (below N)."""
        rows = r0 + gl.arange(0, SUB_M, gl.SliceLayout(1, layout)).to(gl.int64)
        cols = n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(0, layout))
        mask = (rows < end)[:, None] & (cols < N)[None, :]
        gl.store(y_ptr + rows[:, None] * N + cols[None, :], vals, mask=mask)

    @gluon.jit
    def _store_buf(c_buf, y_ptr, m0, end, n0, N, FIRST: gl.constexpr, ROWS: gl.constexpr,
                   BLOCK_N: gl.constexpr, SUB_M: gl.constexpr, layout: gl.constexpr):
        """Rows [FIRST, FIRST + ROWS) of ``c_buf`` to y's rows m0.. (below ``end``) in
        ``SUB_M``-row slices."""
        for i in gl.static_range(ROWS // SUB_M):
            r0 = m0 + i * SUB_M
            vals = c_buf.slice(FIRST + i * SUB_M, SUB_M).load(layout)
            _store_rows(y_ptr, vals, r0, end, n0, N, SUB_M, BLOCK_N, layout)

    @gluon.jit
    def _store_part(c_buf, y_desc, y_ptr, m0, end, n0, N, ROWS: gl.constexpr,
                    BLOCK_N: gl.constexpr, SUB_M: gl.constexpr, TMA_STORE: gl.constexpr,
                    layout: gl.constexpr):
        """``c_buf``'s ROWS rows to y's rows m0..: with ``TMA_STORE``, where all ROWS rows
        lie before the group's ``end``, one TMA store (waited for before the caller frees
        the buffer), else :func:`_store_buf`'s masked slices."""
        if TMA_STORE:
            if m0 + ROWS <= end:
                tma.async_copy_shared_to_global(y_desc, [m0.to(gl.int32), n0.to(gl.int32)],
                                                c_buf)
                tma.store_wait(0)
            else:
                _store_buf(c_buf, y_ptr, m0, end, n0, N, 0, ROWS, BLOCK_N, SUB_M, layout)
        else:
            _store_buf(c_buf, y_ptr, m0, end, n0, N, 0, ROWS, BLOCK_N, SUB_M, layout)

    @gluon.jit
    def _epilogue(c_buf, c_ready, c_free, y_ptr, offs_ptr, M, N, K, G, P,
                  GBLOCK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  GROUP_M: gl.constexpr, SUB_M: gl.constexpr, EPI_WARPS: gl.constexpr,
                  C_HALF: gl.constexpr, TMA_STORE: gl.constexpr):
        """Padding rows' zeros first, then each tile's rows from ``c_buf`` to y (``C_HALF``:
        half 0's rows, then half 1's, each freeing the buffer for the other half;
        ``TMA_STORE``: parts that lie inside their group in one TMA store each)."""
        pid = gl.program_id(0)
        C_ROWS: gl.constexpr = c_buf.shape[0]
        if TMA_STORE:  # y as (M, N): a part inside its group is inside y
            y_desc = tma.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[N, 1],
                                                block_shape=[C_ROWS, BLOCK_N],
                                                layout=c_buf.type.layout)
        else:
            y_desc = None
        tiles_n = gl.cdiv(N, BLOCK_N)
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [EPI_WARPS, 1], [1, 0])
        ends = _tile_table(offs_ptr, M, G, tiles_n, BLOCK_M, GBLOCK, EPI_WARPS)
        n_tiles = gl.max(ends, 0)
        pad_start = gl.minimum(gl.maximum(gl.load(offs_ptr + G - 1).to(gl.int64), 0), M)
        pad_tiles = ((M - pad_start + SUB_M - 1) // SUB_M * tiles_n).to(gl.int32)
        zero = gl.zeros([SUB_M, BLOCK_N], c_buf.dtype, layout)
        for tile in range(pid, pad_tiles, P):
            _store_rows(y_ptr, zero, pad_start + (tile // tiles_n) * SUB_M, M,
                        (tile % tiles_n) * BLOCK_N, N, SUB_M, BLOCK_N, layout)
        HALF_M: gl.constexpr = BLOCK_M // 2
        t = 0
        for tile in range(pid, n_tiles, P):
            g, m0, end, pn = _tile_at(ends, tile, offs_ptr, M, tiles_n, BLOCK_M, GROUP_M)
            if C_HALF:
                mbarrier.wait(c_ready.index(0), t & 1)
                _store_part(c_buf, y_desc, y_ptr, m0, end, pn * BLOCK_N, N, HALF_M, BLOCK_N,
                            SUB_M, TMA_STORE, layout)
                gl.thread_barrier()  # every epilogue warp has read c_buf
                mbarrier.arrive(c_free.index(1))
                mbarrier.wait(c_ready.index(1), t & 1)
                _store_part(c_buf, y_desc, y_ptr, m0 + HALF_M, end, pn * BLOCK_N, N, HALF_M,
                            BLOCK_N, SUB_M, TMA_STORE, layout)
            else:
                mbarrier.wait(c_ready.index(0), t & 1)
                _store_part(c_buf, y_desc, y_ptr, m0, end, pn * BLOCK_N, N, BLOCK_M, BLOCK_N,
                            SUB_M, TMA_STORE, layout)
            gl.thread_barrier()  # every epilogue warp has read c_buf
            mbarrier.arrive(c_free.index(0))
            t += 1

    @gluon.jit
    def _gluon_kernel(x_ptr, w_ptr, y_ptr, offs_ptr, M, N, K, G, P,
                      stride_wg, stride_wn, stride_wk,
                      W_KN: gl.constexpr, GBLOCK: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                      STAGES: gl.constexpr, EPI_WARPS: gl.constexpr, SUB_M: gl.constexpr,
                      WORKER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                      SPLIT: gl.constexpr, C_HALF: gl.constexpr, TMA_STORE: gl.constexpr,
                      num_warps: gl.constexpr):
        """y[rows of g] = x[rows of g] @ B_g with B_g = W[g]^T (W (G, N, K)) or, ``W_KN``,
        W[g] read as (K_red, N_out); rows past offsets[G-1] zero. Allocates the ring, the
        output tile and the barriers, then forks the partitions."""
        dtype: gl.constexpr = x_ptr.dtype.element_ty
        x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
        x_desc = tma.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1],
                                            block_shape=[BLOCK_M, BLOCK_K], layout=x_layout)
        xh_desc = x_desc
        if W_KN:
            w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
                [1, BLOCK_K, BLOCK_N], dtype)
            w_desc = tma.make_tensor_descriptor(w_ptr, shape=[G, K, N],
                                                strides=[stride_wg, stride_wk, 1],
                                                block_shape=[1, BLOCK_K, BLOCK_N],
                                                layout=w_layout)
            b_bufs = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_K, BLOCK_N], w_layout)
        else:
            w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
                [1, BLOCK_N, BLOCK_K], dtype)
            w_desc = tma.make_tensor_descriptor(w_ptr, shape=[G, N, K],
                                                strides=[stride_wg, stride_wn, 1],
                                                block_shape=[1, BLOCK_N, BLOCK_K],
                                                layout=w_layout)
            b_bufs = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, BLOCK_K], w_layout)
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], x_layout)
        C_ROWS: gl.constexpr = BLOCK_M // 2 if C_HALF else BLOCK_M
        c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C_ROWS, BLOCK_N], dtype)
        c_buf = gl.allocate_shared_memory(dtype, [C_ROWS, BLOCK_N], c_layout)
        # not read by the partitions; kept: the measured kernel's shared-memory layout
        rows_buf = gl.allocate_shared_memory(gl.int32, [STAGES, 1],
                                             gl.SwizzledSharedLayout(1, 1, 1, [0]))
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        c_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        c_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        arrivals: gl.constexpr = 2 if SPLIT else 1  # consumer partitions
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=arrivals)
        for i in gl.static_range(2):
            mbarrier.init(c_ready.index(i), count=1 if C_HALF else arrivals)
            mbarrier.init(c_free.index(i), count=1)
        if SPLIT:  # two 4-warp consumer partitions, rows [0, 64) and [64, 128) of a tile
            ROWS: gl.constexpr = BLOCK_M // 2
            if C_HALF:  # one 64-row buffer, filled in turn; a barrier pair per half
                out0 = c_buf
                out1 = c_buf
                second: gl.constexpr = 1
            else:  # each half its rows of one 128-row buffer; one barrier pair
                out0 = c_buf.slice(0, ROWS)
                out1 = c_buf.slice(ROWS, ROWS)
                second: gl.constexpr = 0
            gl.warp_specialize([
                (_mma_tiles, (a_bufs, b_bufs, out0, rows_buf, ready, empty, c_ready.index(0),
                              c_free.index(0), offs_ptr, M, N, K, G, P, W_KN, GBLOCK, BLOCK_M,
                              BLOCK_N, BLOCK_K, STAGES, num_warps, 0, ROWS, False)),
                (_mma_tiles, (a_bufs, b_bufs, out1, rows_buf, ready, empty,
                              c_ready.index(second), c_free.index(second), offs_ptr, M, N, K,
                              G, P, W_KN, GBLOCK, BLOCK_M, BLOCK_N, BLOCK_K, STAGES,
                              num_warps, 1, ROWS, C_HALF)),
                (_load_tiles, (x_desc, xh_desc, w_desc, a_bufs, b_bufs, rows_buf, ready,
                               empty, offs_ptr, M, N, K, G, P, W_KN, GBLOCK, BLOCK_M, BLOCK_N,
                               BLOCK_K, GROUP_M, STAGES, x_ptr)),
                (_epilogue, (c_buf, c_ready, c_free, y_ptr, offs_ptr, M, N, K, G, P, GBLOCK,
                             BLOCK_M, BLOCK_N, GROUP_M, SUB_M, EPI_WARPS, C_HALF,
                             TMA_STORE)),
            ], [num_warps, 1, EPI_WARPS], [CONSUMER_REGS, WORKER_REGS, WORKER_REGS])
        else:
            gl.warp_specialize([
                (_mma_tiles, (a_bufs, b_bufs, c_buf, rows_buf, ready, empty, c_ready.index(0),
                              c_free.index(0), offs_ptr, M, N, K, G, P, W_KN, GBLOCK, BLOCK_M,
                              BLOCK_N, BLOCK_K, STAGES, num_warps, 0, BLOCK_M, False)),
                (_load_tiles, (x_desc, xh_desc, w_desc, a_bufs, b_bufs, rows_buf, ready,
                               empty, offs_ptr, M, N, K, G, P, W_KN, GBLOCK, BLOCK_M, BLOCK_N,
                               BLOCK_K, GROUP_M, STAGES, x_ptr)),
                (_epilogue, (c_buf, c_ready, c_free, y_ptr, offs_ptr, M, N, K, G, P, GBLOCK,
                             BLOCK_M, BLOCK_N, GROUP_M, SUB_M, EPI_WARPS, False,
                             TMA_STORE)),
            ], [1, EPI_WARPS], [WORKER_REGS, WORKER_REGS])


def _launch_args(x: torch.Tensor, weights: torch.Tensor, dgrad: bool, cfg: dict
                 ) -> tuple[tuple[int], tuple, dict]:
    """(grid, scalar arguments after the four tensors, keyword arguments)."""
    m, k = x.shape
    groups = weights.shape[0]
    n = weights.shape[2] if dgrad else weights.shape[1]
    grid = (grid_size(x.device, m, groups, n, cfg["BLOCK_M"], cfg["BLOCK_N"]),)
    stride_n, stride_k = ((weights.stride(2), weights.stride(1)) if dgrad
                          else (weights.stride(1), weights.stride(2)))
    rest = (m, n, k, groups, grid[0], weights.stride(0), stride_n, stride_k)
    if cfg["TMA_STORE"] and n * x.element_size() % 16:
        # a TMA descriptor of y (M, N) needs 16-byte row strides (fprop's N = out_features
        # is not checked by tma_unsupported_reason): the masked stores, the same bits
        cfg = {**cfg, "TMA_STORE": False}
    kwargs = dict(W_KN=dgrad, GBLOCK=max(next_power_of_2(groups), 1), maxnreg=MAXNREG, **cfg)
    return grid, rest, kwargs


def _launch(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor, dgrad: bool,
            config: dict | None) -> torch.Tensor:
    m, k = x.shape
    n = weights.shape[2] if dgrad else weights.shape[1]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    cfg = _resolve(config)
    if m == 0 or n == 0:
        return y
    if weights.shape[0] == 0 or k == 0:
        return y.zero_()
    x = x.contiguous()
    offsets = offsets.contiguous()
    why = gluon_unsupported_reason(x, weights)
    if why is not None:
        raise RuntimeError(f"the Gluon grouped GEMM cannot run: {why}")
    _ensure_allocator()
    grid, rest, kwargs = _launch_args(x, weights, dgrad, cfg)
    launch(_gluon_kernel, grid, x, weights, y, offsets, *rest, **kwargs)
    return y


def gluon_fprop(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                config: dict | None = None) -> torch.Tensor:
    """``y_g = x_g @ W_g^T`` in the warp-specialized Gluon kernel.

    Shapes: x (M, K) bf16/fp16 on a CUDA SM90 device, weights (G, N, K) k-contiguous with
    16-byte-aligned strides, offsets (G,) int32/int64 cumulative group ends on x's device
    -> y (M, N) in x's dtype; rows past ``offsets[-1]`` are zero.

    Raises
    ------
    ValueError
        Shapes, dtypes or devices do not match (as ``large_fprop``).
    RuntimeError
        The kernel cannot run here (:func:`gluon_unsupported_reason`).
    """
    _check(x, weights, offsets, None, swiglu=False)
    return _launch(x, weights, offsets, False, config)


def gluon_dgrad(dy: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                config: dict | None = None) -> torch.Tensor:
    """``dx_g = dy_g @ W_g`` in the warp-specialized Gluon kernel (W (G, N, K) read as
    (G, K_red = N, N_out = K)). Shapes, errors: as :func:`gluon_fprop` with dy (M, N)."""
    _check(dy, weights, offsets, None, swiglu=False, dgrad=True)
    return _launch(dy, weights, offsets, True, config)


def gluon_grouped_gemm(a: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                       dgrad: bool) -> torch.Tensor:
    """The dispatched call (``te_ops.gemm.dispatch`` where a Gluon rules row holds):
    :func:`gluon_fprop` (``dgrad`` False) or :func:`gluon_dgrad` with
    :data:`DISPATCH_CONFIG`; where :func:`gluon_unsupported_reason` rules the operands out
    at run time (a base pointer off 16 bytes, say), the persistent Triton kernel's
    ``large_fprop`` / ``large_dgrad``, whose outputs are the same bits. Under a
    ``torch.compile`` trace the op ``te_ops::grouped_gemm_gluon``.

    Shapes: a (M, R) (x, or dy for dgrad), weights (G, N, K), offsets (G,) -> (M, N) for
    fprop, (M, K) for dgrad; rows past ``offsets[-1]`` zero. Raises as :func:`gluon_fprop`.
    """
    _check(a, weights, offsets, None, swiglu=False, dgrad=dgrad)
    a = a.contiguous()
    if tracing():
        return torch.ops.te_ops.grouped_gemm_gluon(a, weights, offsets, dgrad)
    return _run(a, weights, offsets, dgrad)


def _run(a: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor, dgrad: bool
         ) -> torch.Tensor:
    if gluon_unsupported_reason(a, weights) is not None:  # same bits in the Triton kernel
        return (large_dgrad if dgrad else large_fprop)(a, weights, offsets)
    return _launch(a, weights, offsets, dgrad, DISPATCH_CONFIG)


@torch.library.custom_op("te_ops::grouped_gemm_gluon", mutates_args=())
def _grouped_gemm_gluon_op(a: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                           dgrad: bool) -> torch.Tensor:
    """:func:`gluon_grouped_gemm` as an opaque op (a Gluon kernel is no ``triton_op``
    kernel Inductor can trace: ``wrap_triton`` takes Triton ``JITFunction`` kernels)."""
    return _run(a, weights, offsets, dgrad)


@_grouped_gemm_gluon_op.register_fake
def _(a: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor, dgrad: bool
      ) -> torch.Tensor:
    return a.new_empty(a.shape[0], weights.shape[2] if dgrad else weights.shape[1])
