"""Warp-specialized Gluon grouped wgrad for SM90 (``dW_g = dy_g^T @ x_g``).

The Triton wgrad (``grouped_wgrad_large_triton``, flat schedule) runs
each dW tile's fp32 -> bf16 epilogue on the warps that issue the next tile's MMAs (Triton 3.6
builds no warp-specialized partitions on SM90). Gluon (``triton.experimental.gluon``, Triton
>= 3.5) states the partitions explicitly (``gl.warp_specialize``); this kernel uses them:

* a loader partition (1 warp, few registers) walks this program's tiles and issues the TMA
  loads of each row step (``BLOCK_M`` rows of dy and x) into a ring of ``STAGES`` shared-memory
  slots, each guarded by a "ready" and an "empty" mbarrier;
* ``CONSUMERS`` consumer partitions (``num_warps`` warps each; the first is the default
  partition; the default config has one of 8 warps, a 128 x 256 tile over two warp groups,
  the measured fastest) take the program's tiles in turn (tile ``j`` to consumer ``j %
  CONSUMERS``), run the wgmma chain of a tile out of the ring (``warpgroup_mma``, one in
  flight), convert the fp32 accumulator, write it to their own shared-memory tile and start
  a TMA store, which they wait for only before the next store into that tile (or, with
  ``EPI_SPLIT`` > 1, store the tile as that many column slices through ``EPI_BUFS`` smaller
  shared-memory buffers, waiting before each slice only for the store that last used its
  buffer: the subtiled epilogue, which frees shared memory for a 4th ring stage). With two
  consumers their mainloops alternate (ping-pong): a consumer starts a tile's mainloop only
  after the other has waited for all row steps of its previous tile (the ``turn``
  mbarriers), so one consumer's epilogue runs while the other issues MMAs. The turn order is
  also what keeps the ring's parity waits sound: an mbarrier wait tells only a phase's
  parity, so a consumer must never wait for a slot more than one phase ahead of it (without
  the turns, consumer 1 would wait for its first step while consumer 0 is still several ring
  cycles behind, see a completed phase of the right parity and read consumer 0's data).

Groups and masking: group ``g`` holds rows ``offsets[g-1]:offsets[g]`` (clamped on the
device to ``0 <= start <= end <= M``; rows past ``offsets[-1]`` are padding and never
read). When the loader reaches a new group it builds device-side TMA descriptors whose row
count ends at the group's end, so the tail step's rows past it come in as zeros (neither
the next group's rows nor NaN padding are read). The new descriptors overwrite the old
ones in global scratch, so the loader first waits for the copies still in flight. An empty
group loads nothing and stores a
zero tile. Tiles are taken in the order of ``order`` (groups by decreasing row count, from
``grouped_wgrad_large_triton.group_order``), inside a group in bands of ``GROUP_N`` dW row
tiles (n-tile fastest in a band, then the k-tile), program ``p`` taking tiles
``p, p + P, ...``; a tile's row steps run in row order in one accumulator, the same k-steps
as ``torch._grouped_mm``'s wgrad.

Constraints (:func:`gluon_unsupported_reason`): SM90, bf16 / fp16, x and dy contiguous with
16-byte-aligned rows and bases, ``N % BLOCK_N == 0`` (the output descriptor is the 2-D
(G * N, K) view of dW, so a tile must not cross into the next group's rows), Gluon present.
Written against Triton 3.6.0 (the H200's): ``gl.warp_specialize`` there builds the
partitions on SM90 (``setmaxnreg``, named barriers; ``tests/test_gluon_wgrad.py`` compiles
it for sm_90 on CPU), unlike ``tl.range(warp_specialize=True)``.

Measured with ``experimental/gemm_kernel_ab/gluon_wgrad.py`` (docs/performance.md "Gluon
wgrad": faster than ``torch._grouped_mm`` and the Triton wgrad on the E8 / E32 / E128
layers' wgrads). Dispatched by ``te_ops.gemm.dispatch`` where a wgrad row of
``te_ops.gemm.rules`` names it (SM90, bfloat16, 512 rows per group or more), with the row's
launch config: the subtiled epilogue with a 4th ring stage (:data:`MID_ROWS_CONFIG`) at
512-1023 rows per group, where it measured 1.06-1.09x the default config, the default config
from 1024, where the 4-stage config measured 0.966-0.976x it.
The launch goes through ``triton_launch.launch``: on the tensors' device (Triton launches on
the current one; the descriptor scratch is allocated inside the launch, so there too).
"""

from __future__ import annotations

from typing import Any

import torch

from ..tracing import tracing
from ..kernels.triton_launch import capability, cdiv, launch, sm_count

try:  # Gluon ships with Triton >= 3.5 (experimental API)
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
    triton = None
    gluon = None
    gl = None
    tma = None

__all__ = ["gluon_wgrad", "gluon_wgrad_config", "gluon_unsupported_reason",
           "gluon_api_reason", "gluon_unavailable_reason", "check_config",
           "MID_ROWS_CONFIG", "PRESETS"]

#: The launch config (changes to :func:`gluon_wgrad_config`) the rules table names
#: ``"mid_rows"`` (``te_ops.gemm.rules``: 512 to 1023 rows per group): 4 ring stages,
#: the 128 x 256 dW tile stored as 4 column slices of 64 through 2 smem buffers (4 x 48 KiB +
#: 2 x 16 KiB of smem); the ``s4_epi4x2`` config of ``experimental/gemm_kernel_ab/gluon_wgrad.py``.
MID_ROWS_CONFIG = {"STAGES": 4, "EPI_SPLIT": 4, "EPI_BUFS": 2}

#: The named launch configs the rules table picks from (a row's ``config``), as changes to
#: :func:`gluon_wgrad_config`; ``gluon_wgrad(..., preset=name)`` and the op
#: ``te_ops::grouped_wgrad_gluon`` take the name.
PRESETS: dict[str, dict[str, int]] = {"default": {}, "mid_rows": MID_ROWS_CONFIG}

def gluon_api_reason(gl_module: Any, tma_module: Any) -> str | None:
    """Why the Gluon of ``gl_module`` (``triton.experimental.gluon.language``) and
    ``tma_module`` (its Hopper ``tma``) is not the API this kernel is written against
    (Triton 3.6.0), ``None`` when it is. Gluon is experimental: Triton 3.5 (torch 2.9's)
    imports with the same modules but has ``gl.warp_specialize(default_args,
    default_partition, worker_args, ...)``, where the kernel would fail in its compile."""
    import inspect

    try:
        params = list(inspect.signature(gl_module.warp_specialize).parameters)
    except (AttributeError, TypeError, ValueError):
        params = []
    if params[:1] != ["functions_and_args"]:
        return ("the installed Triton's Gluon has another gl.warp_specialize API (the kernel "
                "is written against Triton 3.6's warp_specialize(functions_and_args, "
                f"worker_num_warps, worker_num_regs)), got parameters {params}")
    if not hasattr(tma_module, "make_tensor_descriptor"):
        return ("the installed Triton's Gluon has no device-side tma.make_tensor_descriptor "
                "(the kernel is written against Triton 3.6)")
    return None


#: :func:`gluon_api_reason` of the installed Triton (``None`` without Gluon: then ``gluon`` is
#: ``None``, which the rule and the gate check first).
GLUON_API_REASON = None if gluon is None else gluon_api_reason(gl, tma)


def gluon_unavailable_reason(out_features: int) -> str | None:
    """Why the dispatch never runs the wgrad of a layer with ``out_features`` here,
    whatever the row count and mode (``None`` when it can): no Gluon, another Gluon API
    (:func:`gluon_api_reason`), ``out_features`` not a multiple of ``BLOCK_N``. The dispatch
    skips the rules table's Gluon wgrad rows then."""
    if gluon is None:
        return "the installed Triton has no Gluon (triton.experimental.gluon)"
    if GLUON_API_REASON is not None:
        return GLUON_API_REASON
    block_n = gluon_wgrad_config()["BLOCK_N"]
    if out_features % block_n:
        return (f"out_features ({out_features}) is not a multiple of BLOCK_N ({block_n}): a "
                "dW tile would cross into the next group's rows of the output")
    return None


def gluon_wgrad_config() -> dict[str, int]:
    """Default launch parameters (the fastest of the configs measured): one
    consumer partition of 8 warps (two warp groups, each 64 rows of the 128 x 256 fp32 dW
    tile: 128 registers a thread) and the loader, 64 rows per step, 3 ring stages
    (3 x 48 KiB) plus one 64 KiB bf16 output tile; ``maxnreg`` 168 over the 12 warps of the
    launch, the loader's warp group set to 40 registers (the consumers get 232).
    ``CONSUMERS=2`` with ``num_warps=4`` is the ping-pong schedule (two warp groups with a
    BLOCK_N x BLOCK_K tile each, ``CONSUMER_REGS`` for the second).

    ``EPI_SPLIT`` (1, 2 or 4) column slices of ``BLOCK_K / EPI_SPLIT`` per output tile, each
    stored through one of ``EPI_BUFS`` (1 or 2) bf16 smem buffers per consumer; the default 1 / 1
    is the whole-tile store. ``STAGES=4, EPI_SPLIT=2, EPI_BUFS=1`` (or ``EPI_SPLIT=4,
    EPI_BUFS=2``) fits 4 x 48 KiB + 32 KiB (229,700 bytes of smem at sm_90, of 232,448): measured
    0.966-0.976x this default on the E8 / E32 wgrads (>= 1024 rows per group), so it is not the
    default, and 1.06-1.09x it at E128 (512 rows per group), where the dispatch
    runs ``EPI_SPLIT=4, EPI_BUFS=2`` (:data:`MID_ROWS_CONFIG`, the rules table's ``"mid_rows"``).

    ``GROUP_N`` 8: a group's tiles go in bands of 8 dW row tiles, row tile fastest,
    instead of a whole row of tiles at a time (``GROUP_N=1``), so the programs running at once
    share the x columns they read and a wave does not stream all of x_g from HBM (ncu, E8
    fc2 wgrad: 7.2 GB of DRAM reads against ``_grouped_mm``'s 2.2 GB). Measured in power-capped
    blocks on the H200: 1.15x ``GROUP_N=1`` on E8's fc2 wgrad, 1.00-1.06x on the fc1 wgrads of
    E8 / E32 / E128, 0.99-1.00x on E32's and E128's fc2 wgrads;
    outputs bitwise unchanged (the order of tiles changes no arithmetic)."""
    return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 256, "STAGES": 3, "CONSUMERS": 1,
            "EPI_SPLIT": 1, "EPI_BUFS": 1, "LOADER_REGS": 40, "CONSUMER_REGS": 232,
            "GROUP_N": 8, "num_warps": 8, "maxnreg": 168}


def gluon_unsupported_reason(x: torch.Tensor, dy: torch.Tensor,
                             config: dict | None = None) -> str | None:
    """Why :func:`gluon_wgrad` cannot run on x (M, K), dy (M, N) with ``config`` (``None``
    when it can): the operands' dtype and layout first (TMA: contiguous, 16-byte-aligned rows
    and bases; a dW tile must not cross a group: ``N % BLOCK_N == 0``), then Gluon, the
    device and its capability (SM90: wgmma, ``setmaxnreg``)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or dy.dtype != x.dtype:
        return f"x and dy must both be bf16 or fp16, got {x.dtype} and {dy.dtype}"
    for name, t in (("x", x), ("dy", dy)):
        if not t.is_contiguous():
            return f"{name} is not contiguous"
        # Under a trace (fake tensors: no data pointer) the storage offset is what is known.
        base = (t.storage_offset() * t.element_size() if t.device.type == "meta" or tracing()
                else t.data_ptr())
        # the kernel's row pitch is the width (shape[1]), also where stride(0) differs
        # (a contiguous one-row view of a wider buffer)
        if t.shape[1] * t.element_size() % 16 or base % 16:
            return f"{name}'s rows or base are not 16-byte aligned (TMA)"
    block_n = {**gluon_wgrad_config(), **(config or {})}["BLOCK_N"]
    if dy.shape[1] % block_n:
        return (f"out_features ({dy.shape[1]}) is not a multiple of BLOCK_N ({block_n}): a "
                "dW tile would cross into the next group's rows of the output")
    if gluon is None:
        return "the installed Triton has no Gluon (triton.experimental.gluon)"
    if GLUON_API_REASON is not None:
        return GLUON_API_REASON
    if x.device.type != "cuda":
        return f"Gluon kernels need a CUDA device, got {x.device}"
    if capability(x.device)[0] != 9:
        return "the Gluon wgrad is written for SM90 (wgmma, setmaxnreg)"
    return None


if gluon is not None:

    @gluon.jit
    def _tile(t, offs_ptr, order_ptr, M, tiles_k, per_group, GROUP_N: gl.constexpr):
        """(group, first row, end row, n-tile, k-tile) of tile ``t``; rows clamped to
        ``0 <= start <= end <= M``. Inside a group the tiles go in bands of ``GROUP_N``
        n-tiles (dW row tiles), the n-tile fastest inside a band (``GROUP_N == 1``: k-tile
        fastest over the whole row of tiles)."""
        rank = t // per_group
        local = t - rank * per_group
        g = gl.load(order_ptr + rank).to(gl.int32)
        end = gl.minimum(gl.maximum(gl.load(offs_ptr + g).to(gl.int64), 0), M)
        start = gl.load(offs_ptr + gl.maximum(g - 1, 0)).to(gl.int64)
        start = gl.where(g == 0, 0, start)
        start = gl.minimum(gl.maximum(start, 0), end)
        if GROUP_N == 1:
            pn = local // tiles_k
            pk = local % tiles_k
        else:
            band = GROUP_N * tiles_k
            first_n = (local // band) * GROUP_N
            size_n = gl.minimum(per_group // tiles_k - first_n, GROUP_N)
            inner = local % band
            pn = first_n + inner % size_n
            pk = inner // size_n
        return g, start.to(gl.int32), end.to(gl.int32), pn, pk

    @gluon.jit
    def _loader(x_ptr, dy_ptr, offs_ptr, order_ptr, x_bufs, dy_bufs, ready, empty, M, N, K,
                G, P, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                STAGES: gl.constexpr, GROUP_N: gl.constexpr):
        """Worker: TMA loads of every row step of this program's tiles into the ring.

        The tiles of one group run back to back (``order`` ranks whole groups), so the loop
        is over groups, then over the group's tiles: each group's two descriptors are made
        in the outer loop's body and carried by no loop, which keeps them at two
        global-scratch slots per program (a loop-carried descriptor needs a seed made before
        the loop, and every ``make_tensor_descriptor`` call site takes its own 128 bytes)."""
        x_layout: gl.constexpr = x_bufs.type.layout
        dy_layout: gl.constexpr = dy_bufs.type.layout
        nbytes: gl.constexpr = (BLOCK_M * (BLOCK_N + BLOCK_K)
                                * x_ptr.dtype.element_ty.primitive_bitwidth // 8)
        tiles_k = gl.cdiv(K, BLOCK_K)
        per_group = gl.cdiv(N, BLOCK_N) * tiles_k
        total = G * per_group
        s = 0
        t = gl.program_id(0)
        while t < total:  # a new group: descriptors that end at its last row
            # they overwrite the previous group's in global scratch: first let the copies
            # in flight (the last min(s, STAGES) steps) finish reading them
            for i in range(gl.minimum(s, STAGES)):
                done = s - 1 - i
                mbarrier.wait(ready.index(done % STAGES), (done // STAGES) & 1)
            g, start, end, pn, pk = _tile(t, offs_ptr, order_ptr, M, tiles_k, per_group,
                                          GROUP_N)
            base = start.to(gl.int64)
            rows = gl.maximum(end - start, 1)
            x_desc = tma.make_tensor_descriptor(x_ptr + base * K, [rows, K], [K, 1],
                                                [BLOCK_M, BLOCK_K], x_layout)
            dy_desc = tma.make_tensor_descriptor(dy_ptr + base * N, [rows, N], [N, 1],
                                                 [BLOCK_M, BLOCK_N], dy_layout)
            rank = t // per_group
            while (t < total) & (t // per_group == rank):  # this group's tiles
                g, start, end, pn, pk = _tile(t, offs_ptr, order_ptr, M, tiles_k, per_group,
                                          GROUP_N)
                for kk in range(gl.cdiv(end - start, BLOCK_M)):
                    st = s % STAGES
                    mbarrier.wait(empty.index(st), ((s // STAGES) & 1) ^ 1)
                    mbarrier.expect(ready.index(st), nbytes)
                    tma.async_copy_global_to_shared(dy_desc, [kk * BLOCK_M, pn * BLOCK_N],
                                                    ready.index(st), dy_bufs.index(st))
                    tma.async_copy_global_to_shared(x_desc, [kk * BLOCK_M, pk * BLOCK_K],
                                                    ready.index(st), x_bufs.index(st))
                    s += 1
                t += P

    @gluon.jit
    def _split_cols(t):
        """The left and right column halves of a 2-D register tensor (``reshape`` to
        (rows, 2, cols / 2), ``permute``, ``split``: column c = h * cols / 2 + c', and h is a
        register bit of the wgmma accumulator layout, so no data moves)."""
        rows: gl.constexpr = t.shape[0]
        half: gl.constexpr = t.shape[1] // 2
        return t.reshape([rows, 2, half]).permute((0, 2, 1)).split()

    @gluon.jit
    def _store_slice(val, out_desc, c_bufs, e, row, col, WHICH: gl.constexpr,
                     EPI_BUFS: gl.constexpr):
        """TMA store of one output slice through buffer ``e % EPI_BUFS`` of this consumer,
        first waiting only for the store that last used that buffer (bulk groups complete in
        order: at most ``EPI_BUFS - 1`` newer ones may stay in flight)."""
        c_smem = c_bufs.index(WHICH * EPI_BUFS + e % EPI_BUFS)
        tma.store_wait(EPI_BUFS - 1)  # the store that last read this buffer has left it ...
        gl.thread_barrier()  # ... for every thread (the issuing one waited)
        c_smem.store(val)
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [row, col], c_smem)
        return e + 1

    @gluon.jit
    def _epilogue(acc, out_desc, c_bufs, e, row, col, WHICH: gl.constexpr,
                  EPI_SPLIT: gl.constexpr, EPI_BUFS: gl.constexpr):
        """Store the (BLOCK_N, BLOCK_K) tile ``acc`` (output dtype) at (row, col) as
        ``EPI_SPLIT`` column slices (1, 2 or 4); returns the new store count ``e``."""
        if EPI_SPLIT == 1:
            e = _store_slice(acc, out_desc, c_bufs, e, row, col, WHICH, EPI_BUFS)
        elif EPI_SPLIT == 2:
            w: gl.constexpr = acc.shape[1] // 2
            lo, hi = _split_cols(acc)
            e = _store_slice(lo, out_desc, c_bufs, e, row, col, WHICH, EPI_BUFS)
            e = _store_slice(hi, out_desc, c_bufs, e, row, col + w, WHICH, EPI_BUFS)
        else:
            w4: gl.constexpr = acc.shape[1] // 4
            lo, hi = _split_cols(acc)
            q0, q1 = _split_cols(lo)
            e = _store_slice(q0, out_desc, c_bufs, e, row, col, WHICH, EPI_BUFS)
            e = _store_slice(q1, out_desc, c_bufs, e, row, col + w4, WHICH, EPI_BUFS)
            q2, q3 = _split_cols(hi)
            e = _store_slice(q2, out_desc, c_bufs, e, row, col + 2 * w4, WHICH, EPI_BUFS)
            e = _store_slice(q3, out_desc, c_bufs, e, row, col + 3 * w4, WHICH, EPI_BUFS)
        return e

    @gluon.jit
    def _consumer(out_ptr, offs_ptr, order_ptr, x_bufs, dy_bufs, c_bufs, ready, empty, turn,
                  M, N, K, G, P, WHICH: gl.constexpr, CONSUMERS: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  STAGES: gl.constexpr, EPI_SPLIT: gl.constexpr, EPI_BUFS: gl.constexpr,
                  WARPS: gl.constexpr, GROUP_N: gl.constexpr):
        """wgmma chains of tiles ``j % CONSUMERS == WHICH`` and their TMA-store epilogue."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[WARPS, 1],
            instr_shape=[16, BLOCK_K if BLOCK_K <= 256 else 256, 16])
        out_desc = tma.make_tensor_descriptor(out_ptr, [G * N, K], [K, 1],
                                              [BLOCK_N, BLOCK_K // EPI_SPLIT],
                                              c_bufs.type.layout)
        tiles_k = gl.cdiv(K, BLOCK_K)
        per_group = gl.cdiv(N, BLOCK_N) * tiles_k
        s = 0
        j = 0
        e = 0  # TMA stores issued by this consumer
        for t in range(gl.program_id(0), G * per_group, P):
            g, start, end, pn, pk = _tile(t, offs_ptr, order_ptr, M, tiles_k, per_group,
                                          GROUP_N)
            steps = gl.cdiv(end - start, BLOCK_M)
            if j % CONSUMERS == WHICH:
                if CONSUMERS == 2:  # wait for the other consumer's mainloop (module docstring)
                    mbarrier.wait(turn.index(WHICH), ((j // 2) & 1) ^ (1 - WHICH))
                acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, acc_layout)
                for kk in range(steps):
                    st = s % STAGES
                    mbarrier.wait(ready.index(st), (s // STAGES) & 1)
                    acc = warpgroup_mma(dy_bufs.index(st).permute((1, 0)), x_bufs.index(st),
                                        acc, is_async=True)
                    acc = warpgroup_mma_wait(1, deps=(acc,))
                    # the previous step's MMA is done: its slot may be refilled
                    mbarrier.arrive(empty.index((s + STAGES - 1) % STAGES), pred=kk > 0)
                    s += 1
                if CONSUMERS == 2:  # all ready waits done: the other consumer's turn
                    mbarrier.arrive(turn.index(1 - WHICH))
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(empty.index((s + STAGES - 1) % STAGES), pred=steps > 0)
                e = _epilogue(acc.to(out_ptr.dtype.element_ty), out_desc, c_bufs, e,
                              g * N + pn * BLOCK_N, pk * BLOCK_K, WHICH, EPI_SPLIT, EPI_BUFS)
            else:
                s += steps
            j += 1
        tma.store_wait(0)

    @gluon.jit
    def _gluon_wgrad_kernel(x_ptr, dy_ptr, out_ptr, offs_ptr, order_ptr, M, N, K, G, P,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                            CONSUMERS: gl.constexpr, EPI_SPLIT: gl.constexpr,
                            EPI_BUFS: gl.constexpr, LOADER_REGS: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, GROUP_N: gl.constexpr,
                            num_warps: gl.constexpr):
        """out (G, N, K) = per group g: dy_g^T @ x_g; x (M, K), dy (M, N) contiguous; offs (G,)
        group ends; order (G,) groups in tile order; P programs."""
        dtype: gl.constexpr = x_ptr.dtype.element_ty
        x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
        dy_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
        c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
            [BLOCK_N, BLOCK_K // EPI_SPLIT], dtype)
        x_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], x_layout)
        dy_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_N], dy_layout)
        c_bufs = gl.allocate_shared_memory(
            dtype, [CONSUMERS * EPI_BUFS, BLOCK_N, BLOCK_K // EPI_SPLIT], c_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        fence_async_shared()
        if CONSUMERS == 2:
            gl.warp_specialize([
                (_consumer, (out_ptr, offs_ptr, order_ptr, x_bufs, dy_bufs, c_bufs, ready,
                             empty, turn, M, N, K, G, P, 0, 2, BLOCK_M, BLOCK_N, BLOCK_K, STAGES,
                             EPI_SPLIT, EPI_BUFS, num_warps, GROUP_N)),
                (_consumer, (out_ptr, offs_ptr, order_ptr, x_bufs, dy_bufs, c_bufs, ready,
                             empty, turn, M, N, K, G, P, 1, 2, BLOCK_M, BLOCK_N, BLOCK_K, STAGES,
                             EPI_SPLIT, EPI_BUFS, num_warps, GROUP_N)),
                (_loader, (x_ptr, dy_ptr, offs_ptr, order_ptr, x_bufs, dy_bufs, ready, empty, M, N,
                           K, G, P, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_N))],
                [num_warps, 1], [CONSUMER_REGS, LOADER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (out_ptr, offs_ptr, order_ptr, x_bufs, dy_bufs, c_bufs, ready,
                             empty, turn, M, N, K, G, P, 0, 1, BLOCK_M, BLOCK_N, BLOCK_K, STAGES,
                             EPI_SPLIT, EPI_BUFS, num_warps, GROUP_N)),
                (_loader, (x_ptr, dy_ptr, offs_ptr, order_ptr, x_bufs, dy_bufs, ready, empty, M, N,
                           K, G, P, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_N))],
                [1], [LOADER_REGS])


def gluon_wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor,
                config: dict | None = None, preset: str = "default") -> torch.Tensor:
    """``dW_g = dy_g^T @ x_g`` with the warp-specialized Gluon kernel (module docstring).

    Same result as ``torch._grouped_mm(dy.t(), x, offs=offsets)`` (bit for bit on every case
    and shape measured, docs/performance.md "Gluon wgrad"), fp32
    accumulation.

    Shapes: x (M, K), dy (M, N) bf16/fp16 contiguous on an SM90 GPU; offsets (G,) int32/int64
    cumulative group ends on x's device (rows past ``offsets[-1]`` are padding and never
    read) -> dW (G, N, K) in x's dtype, zeros for an empty group. No host sync (graph-safe):
    the group order is a device argsort. ``preset`` names the launch config (a key of
    :data:`PRESETS`: ``"default"`` or ``"mid_rows"``, a rules row's ``config``; the
    dispatch passes it); ``config`` overrides keys of it (benchmarks). Under a
    ``torch.compile`` trace the call without ``config`` is the op
    ``te_ops::grouped_wgrad_gluon`` (which takes the preset's name).

    Raises
    ------
    ValueError
        Shapes, dtypes or devices do not match (the message names the argument), ``preset``
        is not a key of :data:`PRESETS`, or a ``config`` key is unknown or ``EPI_SPLIT`` /
        ``EPI_BUFS`` is not one of their values or ``GROUP_N`` not an int >= 1
        (:func:`check_config`).
    RuntimeError
        The kernel cannot run here (:func:`gluon_unsupported_reason`).
    """
    _check(x, dy, offsets)
    if preset not in _RESOLVED:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    if config is not None:
        unknown = sorted(set(config) - set(gluon_wgrad_config()))
        if unknown:
            raise ValueError(f"config keys must be among {sorted(gluon_wgrad_config())}, got "
                             f"unknown {unknown}")
        config = {**PRESETS[preset], **config}
        check_config(config)
    elif tracing():
        return torch.ops.te_ops.grouped_wgrad_gluon(x, dy, offsets, preset)
    return _launch(x, dy, offsets, config, preset)


def check_config(config: dict | None) -> None:
    """ValueError where ``config`` (changes to :func:`gluon_wgrad_config`) has an ``EPI_SPLIT``
    other than 1, 2, 4 or an ``EPI_BUFS`` other than 1, 2 (the epilogue's slices), or a
    ``GROUP_N`` (the tile order's band of dW row tiles) that is not an int >= 1."""
    cfg = {**gluon_wgrad_config(), **(config or {})}
    if cfg["EPI_SPLIT"] not in (1, 2, 4):
        raise ValueError(f"config EPI_SPLIT must be 1, 2 or 4, got {cfg['EPI_SPLIT']!r}")
    if cfg["EPI_BUFS"] not in (1, 2):
        raise ValueError(f"config EPI_BUFS must be 1 or 2, got {cfg['EPI_BUFS']!r}")
    if (isinstance(cfg["GROUP_N"], bool) or not isinstance(cfg["GROUP_N"], int)
            or cfg["GROUP_N"] < 1):
        raise ValueError(f"config GROUP_N must be an int >= 1, got {cfg['GROUP_N']!r}")


def _check(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor) -> None:
    """ValueError naming the argument whose shape, dtype or device does not fit."""
    from .grouped_wgrad_large_triton import check_wgrad_operands

    check_wgrad_operands(x, dy, offsets)


def _resolve_presets() -> dict[str, dict[str, int]]:
    """Each preset's full launch parameters, checked once (:func:`check_config`)."""
    for changes in PRESETS.values():
        check_config(changes)
    return {name: {**gluon_wgrad_config(), **changes} for name, changes in PRESETS.items()}


_RESOLVED = _resolve_presets()


def _launch(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor,
            config: dict | None, preset: str = "default") -> torch.Tensor:
    """The kernel launch into a new (G, N, K) tensor (the gate first: RuntimeError):
    ``config`` (changes to :func:`gluon_wgrad_config`, already checked) or else the preset's
    parameters."""
    from .grouped_gemm_large_triton import _ensure_allocator
    from .grouped_wgrad_large_triton import group_order

    x, dy, offsets = x.contiguous(), dy.contiguous(), offsets.contiguous()
    cfg = _RESOLVED[preset] if config is None else {**gluon_wgrad_config(), **config}
    why = gluon_unsupported_reason(x, dy, cfg)
    if why is not None:
        raise RuntimeError(f"the Gluon grouped wgrad cannot run: {why}")
    m, k = x.shape
    n = dy.shape[1]
    groups = offsets.shape[0]
    out = torch.empty(groups, n, k, device=x.device, dtype=x.dtype)
    if m == 0 or n == 0 or k == 0 or groups == 0:
        return out.zero_()
    order = group_order(offsets)
    programs = max(1, min(sm_count(x.device),
                          groups * cdiv(n, cfg["BLOCK_N"]) * cdiv(k, cfg["BLOCK_K"])))
    _ensure_allocator()  # global scratch for the device-side TMA descriptors
    # launch(): on x's device (Triton launches on the current one, and the scratch allocator
    # runs inside the launch), not on cuda:0 for tensors on cuda:1
    launch(_gluon_wgrad_kernel, (programs,), x, dy, out, offsets, order, m, n, k, groups,
           programs, **cfg)
    return out


@torch.library.custom_op("te_ops::grouped_wgrad_gluon", mutates_args=())
def _grouped_wgrad_gluon_op(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor,
                            preset: str = "default") -> torch.Tensor:
    """:func:`gluon_wgrad` with the launch config ``preset`` (a key of :data:`PRESETS`) as an
    op (a ``custom_op``, opaque to Inductor: whether ``triton_op`` / ``wrap_triton`` take a
    Gluon kernel was not tried)."""
    if preset not in _RESOLVED:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    return _launch(x, dy, offsets, None, preset)


@_grouped_wgrad_gluon_op.register_fake
def _(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor,
      preset: str = "default") -> torch.Tensor:
    return x.new_empty(offsets.shape[0], dy.shape[1], x.shape[1])
