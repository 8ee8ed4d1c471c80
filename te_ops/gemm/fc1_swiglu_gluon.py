"""fc1's grouped fprop with the (Scaled)SwiGLU forward in a warp-specialized epilogue (Gluon).

The persistent Triton kernel's fused variant (``grouped_gemm_large_triton.large_fc1_swiglu``,
``PAIRED``) measured 0.97-0.99x its plain fprop + the Triton SwiGLU pass: its epilogue (the
SiLU, h's and a's stores) runs on the warps that issue the next tile's wgmmas, so it adds to
every tile. This kernel is the Gluon fprop of ``grouped_gemm_gluon`` (the same partitions,
tile table, ring, consumer; that module's ``_consumer`` is called as it is) with two changes:

* the **producer** loads W1 (G, 2F, K) through its (G, 2, F, K) view, block
  [1, 2, 128, 64]: gate rows [n0, n0 + 128) then up rows [F + n0, F + n0 + 128) of one
  group in one TMA load (``PAIRED``, as the Triton kernel), so the 128 x 256 accumulator's
  left half is h's gate column tile ``n0..`` and its right half the up column tile
  ``F + n0..``; the consumer rounds it to bf16/fp16 into the 64 KiB output tile as for the
  plain fprop;
* the **epilogue** partition (``EPI_WARPS`` warps) reads that tile in ``SUB_M``-row slices,
  each as a gate and an up (SUB_M, 128) slice of shared memory, stores both into h (masked
  pointer stores clipped at the group's end and at column F), computes
  ``a = SiLU(gate) * up (* probs[row])`` in fp32 from the rounded values and stores it.
  So the activation runs while the consumer warps issue the next tile's wgmmas.

Bits. Every h element takes the k-steps of the plain fprop (128-row tiles, 64-wide k-steps
in order, fp32 accumulation, first step ``use_acc=False``), so h equals ``torch._grouped_mm``,
``large_fprop`` and ``gluon_fprop`` bit for bit; a is computed from the rounded h with the
Triton SwiGLU forward's operations in its order (``swiglu_triton._core``: ``sig = 1 / (1 +
exp(-g))``, ``silu = g * sig``, ``silu * up``, ``* p``; same Triton lowering: ``exp`` via
``ex2.approx``, fp32 ``div.full``), so a equals ``swiglu_forward(h, probs)`` bit for bit
(checked on the H200 by tests/test_fc1_swiglu_gluon.py and
``experimental/gemm_kernel_ab/large_gemm_triton.py --gluon-fc1``). Padding rows past
``offsets[-1]``: h = 0 and a = SiLU(0) * 0 (* p), as the two launches write them (the
epilogue partition writes them before its first tile).

Shared memory: the 3-stage ring of 48 KiB (x 128 x 64 + W 256 x 64, bf16) + the 64 KiB
output tile = 208 KiB of the H200's 227 (a is stored from registers, no buffer).

Auto dispatch (``te_ops.gemm.fc1_swiglu``) takes it where the Gluon ``fc1_swiglu`` row of
:mod:`te_ops.gemm.rules` holds; ``gluon_fc1_swiglu`` is the op ``te_ops::grouped_fc1_swiglu_gluon``
under a trace (a ``custom_op``: ``wrap_triton`` takes Triton ``JITFunction`` kernels only).
"""

from __future__ import annotations

import torch

from . import grouped_gemm_gluon as GG
from ..tracing import tracing
from .grouped_gemm_large_triton import (
    _check,
    _ensure_allocator,
    check_config_values,
    grid_size,
    large_fc1_swiglu,
)
from ..kernels.triton_launch import launch, next_power_of_2

gluon = GG.gluon
if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

__all__ = ["gluon_fc1_swiglu", "gluon_fc1_dispatched", "gluon_fc1_config",
           "gluon_fc1_unsupported_reason"]

def gluon_fc1_config() -> dict[str, int | bool]:
    """Launch parameters: 128 x (128 gate + 128 up) x 64 tiles, ``GROUP_M`` 8, a 3-stage
    ring, 8 consumer warps (two warpgroups, 64 rows each), a 2-warp epilogue partition
    reading (``SUB_M``, ``SUB_N``) slices of the gate and the up half (the 128B swizzle of the
    output tile allows row slices of >= 8 rows), ``WORKER_REGS`` registers per thread for
    the producer's and the epilogue's warpgroup (``GG.MAXNREG`` for the function, as
    ``grouped_gemm_gluon``). ``WORKER_REGS`` 96: ptxas (Triton 3.6, sm_90a) spills 4 bytes
    there, 64 bytes at 88 and 788 bytes at 64 (the SiLU slices of the epilogue); the
    consumer warps keep >= 200 (their 128 accumulator registers fit under MAXNREG 168)."""
    return {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "STAGES": 3,
            "num_warps": 8, "EPI_WARPS": 2, "SUB_M": 8, "SUB_N": 128, "WORKER_REGS": 96}


def _resolve(config: dict | None) -> dict:
    """:func:`gluon_fc1_config` updated by ``config``, checked: known keys only, values of
    their defaults' kind (ints >= 1: ``check_config_values``), ``num_warps`` 8, ``SUB_M``
    dividing the output buffer's rows; ring + output buffer within
    ``grouped_gemm_gluon.SHARED_LIMIT`` (:func:`shared_bytes`). Raises ``ValueError``
    naming the key and the values otherwise."""
    cfg = gluon_fc1_config()
    unknown = sorted(set(config or {}) - set(cfg))
    if unknown:
        raise ValueError(f"config keys must be among {sorted(cfg)}, got unknown {unknown}")
    cfg.update(config or {})
    check_config_values(cfg, gluon_fc1_config())
    if cfg["num_warps"] != 8:
        raise ValueError(f"config num_warps must be 8 (one warpgroup per 64 rows), got "
                         f"num_warps={cfg['num_warps']}")
    if cfg["BLOCK_N"] % 2 or cfg["BLOCK_M"] % cfg["SUB_M"] or (cfg["BLOCK_N"] // 2) % cfg["SUB_N"]:
        raise ValueError(f"config needs an even BLOCK_N (gate + up halves), SUB_M dividing "
                         f"BLOCK_M and SUB_N dividing BLOCK_N / 2, got BLOCK_N="
                         f"{cfg['BLOCK_N']}, BLOCK_M={cfg['BLOCK_M']}, SUB_M={cfg['SUB_M']}, "
                         f"SUB_N={cfg['SUB_N']}")
    need = shared_bytes(cfg)
    if need > GG.SHARED_LIMIT:
        raise ValueError(f"config STAGES={cfg['STAGES']} "
                         f"(BLOCK_M={cfg['BLOCK_M']}, BLOCK_N={cfg['BLOCK_N']}, BLOCK_K="
                         f"{cfg['BLOCK_K']}) needs {need} bytes of shared memory (ring + "
                         f"output buffer, 16-bit dtypes), more than the {GG.SHARED_LIMIT} "
                         f"SM90 leaves for them")
    return cfg


def shared_bytes(cfg: dict) -> int:
    """Shared memory of the launch in bytes (16-bit dtypes), barriers and the compiler's
    scratch aside: the ring (``STAGES`` x (BLOCK_M x tile + the paired gate/up W1 tile of
    BLOCK_N rows) x BLOCK_K) and the output buffer (BLOCK_M rows x BLOCK_N): the layout of
    ``grouped_gemm_gluon``'s, so its ``_shared_bytes``."""
    return GG._shared_bytes({**cfg, "C_HALF": False})


def gluon_fc1_unsupported_reason(x: torch.Tensor, weights: torch.Tensor) -> str | None:
    """Why this kernel cannot take these operands (``None`` when it can): the Gluon fprop's
    reasons (:func:`grouped_gemm_gluon.gluon_unsupported_reason`: Gluon, CUDA SM90, TMA
    layout and alignment, groups), and F = weights.shape[1] / 2 whose up half does not start
    on a 16-byte boundary (the (G, 2, F, K) TMA view's stride F * K)."""
    why = GG.gluon_unsupported_reason(x, weights)
    if why is not None:
        return why
    half = weights.shape[1] // 2
    if half * weights.stride(1) * weights.element_size() % 16:
        return f"the up half's offset F * stride = {half} * {weights.stride(1)} elements is " \
               "not a multiple of 16 bytes"
    return None


if gluon is not None:

    @gluon.jit
    def _producer(x_desc, w_desc, a_bufs, b_bufs, ready, empty, offs_ptr, M, F, K, G, P,
                  GBLOCK: gl.constexpr, BLOCK_M: gl.constexpr, HALF: gl.constexpr,
                  BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        """TMA loads of every k-step of the program's tiles: x's row tile and the paired
        (gate, up) W1 rows of column tile pn (one [1, 2, HALF, BLOCK_K] block)."""
        pid = gl.program_id(0)
        tiles_n = gl.cdiv(F, HALF)
        ends = GG._tile_table(offs_ptr, M, G, tiles_n, BLOCK_M, GBLOCK, 1)
        n_tiles = gl.max(ends, 0)
        nbytes: gl.constexpr = (BLOCK_M + 2 * HALF) * BLOCK_K * 2
        it = 0
        for tile in range(pid, n_tiles, P):
            g, m0, end, pn = GG._tile_at(ends, tile, offs_ptr, M, tiles_n, BLOCK_M, GROUP_M)
            m0 = m0.to(gl.int32)
            n0 = pn * HALF
            for k0 in range(0, K, BLOCK_K):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, nbytes)
                tma.async_copy_global_to_shared(x_desc, [m0, k0], bar, a_bufs.index(s))
                tma.async_copy_global_to_shared(w_desc, [g, 0, n0, k0], bar, b_bufs.index(s))
                it += 1

    @gluon.jit
    def _swiglu_store(h_ptr, a_ptr, p_ptr, gate, up, r0, end, n0, F, HAS_P: gl.constexpr,
                      SUB_M: gl.constexpr, SUB_N: gl.constexpr, layout: gl.constexpr):
        """Rows r0.. (below ``end``), columns n0.. (below F): h's gate and up values (in h's
        dtype), and a = SiLU(gate) * up (* p[row]) in fp32 from them (``swiglu_triton._core``'s
        operations and order), rounded to a's dtype."""
        rows = r0 + gl.arange(0, SUB_M, gl.SliceLayout(1, layout)).to(gl.int64)
        cols = n0 + gl.arange(0, SUB_N, gl.SliceLayout(0, layout))
        row_ok = rows < end
        mask = row_ok[:, None] & (cols < F)[None, :]
        h_at = h_ptr + rows[:, None] * (2 * F) + cols[None, :]
        gl.store(h_at, gate, mask=mask)
        gl.store(h_at + F, up, mask=mask)
        g32 = gate.to(gl.float32)
        u32 = up.to(gl.float32)
        sig = 1.0 / (1.0 + gl.exp(-g32))
        out = g32 * sig * u32
        if HAS_P:
            p = gl.load(p_ptr + rows, mask=row_ok, other=0.0).to(gl.float32)
            out = out * p[:, None]
        gl.store(a_ptr + rows[:, None] * F + cols[None, :], out.to(a_ptr.dtype.element_ty),
                 mask=mask)

    @gluon.jit
    def _swiglu_buf(c_buf, h_ptr, a_ptr, p_ptr, m0, end, pn, F, HAS_P: gl.constexpr,
                    ROWS: gl.constexpr, HALF: gl.constexpr, SUB_M: gl.constexpr,
                    SUB_N: gl.constexpr, layout: gl.constexpr):
        """Rows [0, ROWS) of ``c_buf`` (gate columns [0, HALF), up columns [HALF, 2 HALF))
        to h's and a's rows m0.. (below ``end``), columns of column tile ``pn``, in
        (``SUB_M``, ``SUB_N``) slices (:func:`_swiglu_store`)."""
        for i in gl.static_range(ROWS // SUB_M):
            rows = c_buf.slice(i * SUB_M, SUB_M)
            for j in gl.static_range(HALF // SUB_N):
                gate = rows.slice(j * SUB_N, SUB_N, 1).load(layout)
                up = rows.slice(HALF + j * SUB_N, SUB_N, 1).load(layout)
                _swiglu_store(h_ptr, a_ptr, p_ptr, gate, up, m0 + i * SUB_M, end,
                              pn * HALF + j * SUB_N, F, HAS_P, SUB_M, SUB_N, layout)

    @gluon.jit
    def _epilogue(c_buf, c_ready, c_empty, h_ptr, a_ptr, p_ptr, offs_ptr, M, F, G, P,
                  HAS_P: gl.constexpr, GBLOCK: gl.constexpr, BLOCK_M: gl.constexpr,
                  HALF: gl.constexpr, GROUP_M: gl.constexpr, SUB_M: gl.constexpr,
                  SUB_N: gl.constexpr, EPI_WARPS: gl.constexpr):
        """Padding rows first (h = 0, a from zeros), then per tile: h's gate / up slices
        from ``c_buf`` to h, a to a; frees ``c_buf`` after the last slice is read."""
        pid = gl.program_id(0)
        tiles_n = gl.cdiv(F, HALF)
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // SUB_N, SUB_N // 8],
                                                [EPI_WARPS, 1], [1, 0])
        ends = GG._tile_table(offs_ptr, M, G, tiles_n, BLOCK_M, GBLOCK, EPI_WARPS)
        n_tiles = gl.max(ends, 0)
        pad_start = gl.minimum(gl.maximum(gl.load(offs_ptr + G - 1).to(gl.int64), 0), M)
        col_tiles = gl.cdiv(F, SUB_N)
        pad_tiles = ((M - pad_start + SUB_M - 1) // SUB_M * col_tiles).to(gl.int32)
        zero = gl.zeros([SUB_M, SUB_N], c_buf.dtype, layout)
        for tile in range(pid, pad_tiles, P):
            _swiglu_store(h_ptr, a_ptr, p_ptr, zero, zero,
                          pad_start + (tile // col_tiles) * SUB_M, M,
                          (tile % col_tiles) * SUB_N, F, HAS_P, SUB_M, SUB_N, layout)
        t = 0
        for tile in range(pid, n_tiles, P):
            g, m0, end, pn = GG._tile_at(ends, tile, offs_ptr, M, tiles_n, BLOCK_M, GROUP_M)
            mbarrier.wait(c_ready, t & 1)
            _swiglu_buf(c_buf, h_ptr, a_ptr, p_ptr, m0, end, pn, F, HAS_P, BLOCK_M,
                        HALF, SUB_M, SUB_N, layout)
            gl.thread_barrier()  # every epilogue warp has read c_buf
            mbarrier.arrive(c_empty)
            t += 1

    @gluon.jit
    def _fc1_swiglu_kernel(x_ptr, w_ptr, h_ptr, a_ptr, p_ptr, offs_ptr, M, F, K, G, P,
                           stride_wg, stride_wn, HAS_P: gl.constexpr, GBLOCK: gl.constexpr,
                           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                           STAGES: gl.constexpr, EPI_WARPS: gl.constexpr,
                           SUB_M: gl.constexpr, SUB_N: gl.constexpr,
                           WORKER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """h[rows of g] = x[rows of g] @ W1[g]^T (h (M, 2F)), a = SiLU(h[:, :F]) * h[:, F:]
        (* p) (a (M, F)); rows past offsets[G-1]: h = 0, a from zeros. Allocates the ring,
        the output tile and the barriers, then forks the partitions."""
        HALF: gl.constexpr = BLOCK_N // 2
        dtype: gl.constexpr = x_ptr.dtype.element_ty
        x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
        x_desc = tma.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1],
                                            block_shape=[BLOCK_M, BLOCK_K], layout=x_layout)
        w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
            [1, 2, HALF, BLOCK_K], dtype)
        w_desc = tma.make_tensor_descriptor(w_ptr, shape=[G, 2, F, K],
                                            strides=[stride_wg, F * stride_wn, stride_wn, 1],
                                            block_shape=[1, 2, HALF, BLOCK_K], layout=w_layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, 1, 2, HALF, BLOCK_K], w_layout)
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], x_layout)
        c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
        c_buf = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], c_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        c_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        c_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(c_ready, count=1)
        mbarrier.init(c_empty, count=1)
        # The consumer is grouped_gemm_gluon's: N = 2F gives its tile count cdiv(2F, BLOCK_N)
        # = cdiv(F, HALF), and the ring slot [1, 2, HALF, BLOCK_K] reshapes to
        # [BLOCK_N, BLOCK_K] (gate rows, then up rows).
        gl.warp_specialize([
            (GG._consumer, (a_bufs, b_bufs, c_buf, ready, empty, c_ready, c_empty,
                            offs_ptr, M, 2 * F, K, G, P, False, GBLOCK, BLOCK_M, BLOCK_N,
                            BLOCK_K, STAGES, num_warps, 0, BLOCK_M)),
            (_producer, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, offs_ptr, M, F, K,
                         G, P, GBLOCK, BLOCK_M, HALF, BLOCK_K, GROUP_M, STAGES)),
            (_epilogue, (c_buf, c_ready, c_empty, h_ptr, a_ptr, p_ptr, offs_ptr, M, F, G,
                         P, HAS_P, GBLOCK, BLOCK_M, HALF, GROUP_M, SUB_M, SUB_N,
                         EPI_WARPS)),
        ], [1, EPI_WARPS], [WORKER_REGS, WORKER_REGS])


def _launch(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
            probs: torch.Tensor | None, config: dict | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    groups, two_f = weights.shape[0], weights.shape[1]
    ffn = two_f // 2
    cfg = _resolve(config)  # before the early returns: a bad config always raises
    if m == 0 or ffn == 0 or groups == 0 or k == 0:  # the Triton kernel's zero handling
        return large_fc1_swiglu(x, weights, offsets, probs)
    why = gluon_fc1_unsupported_reason(x, weights)
    if why is not None:
        raise RuntimeError(f"the Gluon fc1 + SwiGLU kernel cannot run: {why}")
    h = torch.empty(m, two_f, device=x.device, dtype=x.dtype)
    a = torch.empty(m, ffn, device=x.device, dtype=x.dtype)
    _ensure_allocator()
    grid = (grid_size(x.device, m, groups, ffn, cfg["BLOCK_M"], cfg["BLOCK_N"] // 2),)
    p = probs if probs is not None else x
    launch(_fc1_swiglu_kernel, grid, x, weights, h, a, p, offsets, m, ffn, k, groups, grid[0],
           weights.stride(0), weights.stride(1), HAS_P=probs is not None,
           GBLOCK=max(next_power_of_2(groups), 1), maxnreg=GG.MAXNREG, **cfg)
    return h, a


def gluon_fc1_swiglu(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                     probs: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """fc1's grouped fprop with the (Scaled)SwiGLU forward in the warp-specialized epilogue.

    ``h_g = x_g @ W_g^T`` (bitwise ``torch._grouped_mm`` / ``large_fprop``);
    ``a = SiLU(h[:, :F]) * h[:, F:]`` (times ``probs[:, None]``) in fp32 from the rounded h
    (bitwise ``swiglu_triton.swiglu_forward(h, probs)``).

    Shapes: x (M, K) bf16/fp16 on a CUDA SM90 device, weights (G, 2F, K) (gate rows first,
    then up rows; k-contiguous, 16-byte-aligned strides), offsets (G,) int32/int64 cumulative
    group ends on x's device, probs (M,) any float dtype or ``None`` -> (h (M, 2F), a (M, F))
    in x's dtype; rows past ``offsets[-1]`` have h = 0 and a computed from those zeros.
    Launch parameters: :func:`gluon_fc1_config`. Under a ``torch.compile`` trace the call is
    the op ``te_ops::grouped_fc1_swiglu_gluon``, which runs ``large_fc1_swiglu`` (same bits)
    where :func:`gluon_fc1_unsupported_reason` rules the operands out at run time.

    Raises
    ------
    ValueError
        Shapes, dtypes or devices do not match (as ``large_fc1_swiglu``).
    RuntimeError
        The kernel cannot run here (:func:`gluon_fc1_unsupported_reason`, eager calls).
    """
    _check(x, weights, offsets, probs, swiglu=True)
    x = x.contiguous()
    offsets = offsets.contiguous()
    probs = None if probs is None else probs.contiguous()
    if tracing():
        return torch.ops.te_ops.grouped_fc1_swiglu_gluon(x, weights, offsets, probs)
    return _launch(x, weights, offsets, probs, None)


def gluon_fc1_dispatched(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                         probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The dispatched call (``te_ops.gemm.fc1_swiglu`` where its Gluon rules row holds): as
    :func:`gluon_fc1_swiglu` with the default config, but where
    :func:`gluon_fc1_unsupported_reason` rules the operands out at run time (a base pointer
    off 16 bytes, say) the persistent Triton kernel's fused launch (``large_fc1_swiglu``,
    same bits). Under a trace the op ``te_ops::grouped_fc1_swiglu_gluon``. Shapes and
    argument errors as :func:`gluon_fc1_swiglu`."""
    _check(x, weights, offsets, probs, swiglu=True)
    x = x.contiguous()
    offsets = offsets.contiguous()
    probs = None if probs is None else probs.contiguous()
    if tracing():
        return torch.ops.te_ops.grouped_fc1_swiglu_gluon(x, weights, offsets, probs)
    return _run(x, weights, offsets, probs)


def _run(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
         probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if gluon_fc1_unsupported_reason(x, weights) is not None:  # same bits in Triton
        return large_fc1_swiglu(x, weights, offsets, probs)
    return _launch(x, weights, offsets, probs, None)


@torch.library.custom_op("te_ops::grouped_fc1_swiglu_gluon", mutates_args=())
def _grouped_fc1_swiglu_gluon_op(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                                 probs: torch.Tensor | None
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gluon_fc1_swiglu` as an opaque op."""
    return _run(x, weights, offsets, probs)


@_grouped_fc1_swiglu_gluon_op.register_fake
def _(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
      probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    two_f = weights.shape[1]
    return x.new_empty(x.shape[0], two_f), x.new_empty(x.shape[0], two_f // 2)
