"""Persistent Triton grouped wgrad for many rows per group (``dW_g = dy_g^T @ x_g``).

Dispatched (``te_ops.gemm.dispatch.grouped_wgrad``; never for a wgrad into an fp32
``main_grad`` that ``torch._grouped_mm`` can write, nor with the ``out=`` accumulate variant)
where a ``triton_persistent`` wgrad row of ``te_ops.gemm.rules`` holds: auto at 64-256 rows
per group on SM90 in bf16, where the flat schedule measured 1.01-1.09x
``torch._grouped_mm(dy.t(), x, offs=offsets)`` (CUTLASS; parity at 512-2048 rows, where auto
keeps CUTLASS), and the forced rows (``TE_OPS_GROUPED_GEMM_BACKEND=triton``) from 512
(``experimental/gemm_kernel_ab/large_gemm_triton.py``; docs/performance.md "Persistent
Triton GEMMs"). It is the wgrad counterpart of ``grouped_gemm_large_triton`` (fprop,
dgrad). The schedule, masking and stores below describe the nested schedule
(``FLAT=False``, the accumulate launch); the default ``FLAT`` one is
:func:`_wgrad_flat_kernel` (one pipelined loop, per-group TMA bounds, TMA-store epilogue).

For group ``g`` (rows ``offsets[g-1]:offsets[g]``, ``offsets[-1] <= M``; rows past it are
padding, possibly NaN garbage, and never contribute; bad offsets, past M, negative or
decreasing, are clamped on the device to ``0 <= start <= end <= M``):
``dW[g] = dy_g^T @ x_g``, x (M, K), dy (M, N) -> dW (G, N, K) in x's dtype, fp32
accumulation, zeros for an empty group. With ``out`` (fp32 (G, N, K), Megatron's
``main_grad``) the kernel adds its fp32 sum into ``out`` instead (the ``ACCUMULATE`` launch
constexpr: one fp32 load and add per output element).

Schedule. A persistent kernel: ``min(#SMs, G * tiles_n * tiles_k)`` programs; program ``p``
takes tiles ``p, p + P, p + 2P, ...``. A tile is (group, n-tile, k-tile) and loops over its
group's rows in ``BLOCK_M`` steps, so its cost is proportional to the group's rows while the
tile count per group is fixed (``cdiv(N, BLOCK_N) * cdiv(K, BLOCK_K)``). To keep big groups
from running last (a long tail where a few programs work and the rest idle), the groups are
numbered by decreasing row count (ties by index), and tile ``t`` belongs to group
``order[t // tiles_per_group]``. The round-robin assignment of tiles in that order is the
"longest first" list schedule: each wave of P tiles holds tiles of similar cost and the last
wave holds the cheapest ones. The flat schedule (the default) builds the order inside the
kernel: every program loads the G offsets it reads anyway for its pre-pass, sorts the
``(row count, group)`` keys of the ``next_power_of_2(G)`` lanes with ``tl.sort`` in registers
and picks a tile's group out of the sorted lanes (no torch kernel, no device copy per call;
graph-safe). The nested schedule (the accumulate launch) takes the ``order`` table from a
stable ``torch.argsort`` of the split sizes on the device (:func:`group_order`: a few small
torch kernels per call). The order decides only which program computes which tile, never a
tile's sum (each tile's row steps run in one program, in row order), so the outputs are the
same bits in any order. Inside a
group the k-tile runs fastest, so the programs of one wave share the same dy column slab
and sweep x's rows together (L2 reuse); a band order (``GROUP_M`` of the fprop module)
matters less here than this load balance.

Masking. Each tile runs the full ``BLOCK_M`` row steps of its group unmasked and then, when
the group's row count is not a multiple of ``BLOCK_M``, one tail step whose rows past the
group's end (the next group's rows or the padding) are set to zero with ``tl.where`` on the
loaded tiles before the dot (a multiply would keep NaN: NaN * 0 is NaN). Pointer loads are
masked loads with ``other=0`` (the masked rows are not read at all).

Loads. ``USE_TMA=True`` (a launch constexpr): x and dy through ``tl.make_tensor_descriptor``
(device-side TMA descriptors, Triton >= 3.4; needs both contiguous with 16-byte-aligned row
strides and base pointers, :func:`tma_unsupported_reason`, and a global-memory allocator for
the descriptors, installed by ``grouped_gemm_large_triton._ensure_allocator``).
``USE_TMA=False``: pointer loads (what Triton's CPU interpreter runs in the tests). dW is
stored with masked pointer stores (the flat schedule: a TMA store where ``TMA_STORE``). The
dot is ``tl.dot(dy_tile^T, x_tile)`` (wgmma on SM90, the transposed operand read from shared
memory).

Registered as ``torch.library.triton_op`` (``te_ops::grouped_wgrad_large`` and, for ``out``,
``te_ops::grouped_wgrad_large_accumulate`` which mutates ``out``; the bodies, run on
FakeTensors, are the fake kernels); eager calls launch through
:func:`te_ops.kernels.triton_launch.launch`.
"""

from __future__ import annotations

import torch

from ..tracing import tracing
from .grouped_gemm_large_triton import _plain_eager
from .grouped_gemm_triton import unsupported_reason
from ..kernels.triton_launch import capability, cdiv, launch, next_power_of_2, sm_count

try:  # Triton is optional: CPU-only installs have no use for it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

__all__ = ["large_wgrad", "large_wgrad_config", "tma_unsupported_reason", "grid_size",
           "group_order", "unsupported_reason"]

#: Programs of the persistent kernel where the device is not CUDA (the CPU interpreter).
_CPU_PROGRAMS = 4


def large_wgrad_config() -> dict[str, int | bool]:
    """Default launch parameters, untuned (``experimental/gemm_kernel_ab/large_gemm_triton.py
    --sweep --gemms fc1_wgrad,fc2_wgrad`` sweeps them): 128 x 256 dW tiles (BLOCK_N x BLOCK_K,
    the tile of torch's CUTLASS kernel), 64 rows per step, 8 warps, 3 stages (3 x 48 KiB of
    shared memory), TMA loads (per-group descriptor bounds in the flat schedule), a TMA-store
    epilogue. ``USE_TMA`` is dropped by the launch where :func:`tma_unsupported_reason` says
    the operands cannot take it, ``TMA_STORE`` where the launch cannot store through TMA."""
    return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 256, "USE_TMA": True, "FLAT": True,
            "TMA_STORE": True, "num_warps": 8, "num_stages": 3}


def _fake(t: torch.Tensor) -> bool:
    """Whether ``t`` has no data pointer (a FakeTensor, also when wrapped in a
    FunctionalTensor under ``torch.compile`` or a functorch wrapper; a meta tensor). A plain
    eager tensor answers without ``is_fake``'s subclass walk (``_plain_eager``)."""
    if t.device.type == "meta":
        return True
    if _plain_eager(t):
        return False
    return torch._subclasses.fake_tensor.is_fake(t)


def tma_unsupported_reason(x: torch.Tensor, dy: torch.Tensor) -> str | None:
    """Why the TMA loads cannot take x (M, K) and dy (M, N) (``None`` when they can): no
    ``tl.make_tensor_descriptor`` in the installed Triton, a GPU before SM90, an operand not
    contiguous, a row stride or base pointer not 16-byte aligned."""
    why = _tma_layout_reason(x, dy)
    if why is not None:
        return why
    if _fake(x) or _fake(dy):  # no data pointer: the storage offset is what is known
        if any(t.storage_offset() * t.element_size() % 16 for t in (x, dy)):
            return "x or dy do not start on a 16-byte boundary (storage offset)"
        return None
    if x.data_ptr() % 16 or dy.data_ptr() % 16:
        return "x or dy do not start on a 16-byte boundary"
    return None


def _tma_layout_reason(x: torch.Tensor, dy: torch.Tensor) -> str | None:
    """:func:`tma_unsupported_reason` without the base pointers (what a bound call site
    decides once; it checks the pointers per call)."""
    if tl is None or not hasattr(tl, "make_tensor_descriptor"):
        return "the installed Triton has no tl.make_tensor_descriptor"
    if x.device.type == "cuda" and capability(x.device)[0] < 9:
        return "TMA needs SM90 or newer"
    for name, t in (("x", x), ("dy", dy)):
        if not t.is_contiguous():
            return f"{name} is not contiguous"
        if t.stride(0) * t.element_size() % 16:
            return (f"{name}'s row stride ({t.stride(0)} elements) is not a multiple of "
                    f"16 bytes")
    return None


def grid_size(device: torch.device, groups: int, n: int, k: int, block_n: int,
              block_k: int) -> int:
    """Programs of the persistent kernel: the device's SM count (4 off CUDA), at most the
    tile count ``groups * cdiv(n, block_n) * cdiv(k, block_k)``, at least 1."""
    programs = sm_count(device) if device.type == "cuda" else _CPU_PROGRAMS
    return max(1, min(programs, groups * cdiv(n, block_n) * cdiv(k, block_k)))


def group_order(offsets: torch.Tensor) -> torch.Tensor:
    """int64 (G,) group indices by decreasing row count (ties by index), on the device with
    torch ops (no host sync; a zero fill, a concatenation and a difference for the split
    sizes, then the sort): the nested schedule's tile order (module docstring, "Schedule";
    the flat schedule sorts by the same rule in the kernel, ``_rank_order``, over the rows
    clamped to [0, M] as the tiles run them: the orders differ only for bad offsets, the
    outputs never)."""
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1))
    return torch.argsort(sizes, descending=True, stable=True)


if triton is not None:

    @triton.jit
    def _load_step(x_desc, dy_desc, x_ptr, dy_ptr, m0, end, n0, k0, N, K,
                   MASK: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """dy[m0:m0+BLOCK_M, n0:n0+BLOCK_N] and x[m0:m0+BLOCK_M, k0:k0+BLOCK_K], zeros past
        N / K; with MASK, rows >= end are zero too (tl.where on TMA tiles, whose rows may hold
        NaN; masked pointer loads never read them)."""
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        if USE_TMA:
            d = dy_desc.load([m0, n0])
            xa = x_desc.load([m0, k0])
            if MASK:
                d = tl.where(row_ok[:, None], d, tl.zeros_like(d))
                xa = tl.where(row_ok[:, None], xa, tl.zeros_like(xa))
        else:
            cols_n = n0 + tl.arange(0, BLOCK_N)
            cols_k = k0 + tl.arange(0, BLOCK_K)
            r64 = rows.to(tl.int64)[:, None]
            d = tl.load(dy_ptr + r64 * N + cols_n[None, :],
                        mask=row_ok[:, None] & (cols_n[None, :] < N), other=0.0)
            xa = tl.load(x_ptr + r64 * K + cols_k[None, :],
                         mask=row_ok[:, None] & (cols_k[None, :] < K), other=0.0)
        return d, xa

    @triton.jit
    def _wgrad_tile(x_desc, dy_desc, x_ptr, dy_ptr, out_ptr, g, start, end, pn, pk, N, K,
                    ACCUMULATE: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """dW[g, n-tile pn, k-tile pk] over the group's rows [start, end): full BLOCK_M steps
        unmasked, then the tail step masked."""
        cols_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        cols_k = pk * BLOCK_K + tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        full_end = start + (end - start) // BLOCK_M * BLOCK_M
        for m0 in range(start, full_end, BLOCK_M):
            d, xa = _load_step(x_desc, dy_desc, x_ptr, dy_ptr, m0, end, pn * BLOCK_N,
                               pk * BLOCK_K, N, K, False, USE_TMA, BLOCK_M, BLOCK_N, BLOCK_K)
            acc = tl.dot(tl.trans(d), xa, acc)
        if full_end < end:
            d, xa = _load_step(x_desc, dy_desc, x_ptr, dy_ptr, full_end, end, pn * BLOCK_N,
                               pk * BLOCK_K, N, K, True, USE_TMA, BLOCK_M, BLOCK_N, BLOCK_K)
            acc = tl.dot(tl.trans(d), xa, acc)
        mask = (cols_n[:, None] < N) & (cols_k[None, :] < K)
        ptr = (out_ptr + g.to(tl.int64) * N * K + cols_n[:, None].to(tl.int64) * K
               + cols_k[None, :])
        if ACCUMULATE:
            acc += tl.load(ptr, mask=mask, other=0.0)
        tl.store(ptr, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _wgrad_large_kernel(x_ptr, dy_ptr, out_ptr, offs_ptr, order_ptr, M, N, K, G, P,
                            ACCUMULATE: tl.constexpr, USE_TMA: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
        """out[g, n, k] (=, or += with ACCUMULATE) sum over group g's rows m of
        dy[m, n] * x[m, k]; x (M, K), dy (M, N), out (G, N, K) contiguous; offs (G,)
        cumulative group ends; order (G,) int64 groups by decreasing rows; P programs."""
        pid = tl.program_id(0)
        x_desc = None
        dy_desc = None
        if USE_TMA:
            x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1],
                                               block_shape=[BLOCK_M, BLOCK_K])
            dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[M, N], strides=[N, 1],
                                                block_shape=[BLOCK_M, BLOCK_N])
        tiles_k = tl.cdiv(K, BLOCK_K)
        per_group = tl.cdiv(N, BLOCK_N) * tiles_k
        tile = pid
        base = 0
        for rank in range(0, G):  # walk the groups in order; this program's tiles in each
            g = tl.load(order_ptr + rank)
            start = tl.load(offs_ptr + tl.maximum(g - 1, 0))
            start = tl.where(g == 0, 0, start)
            # offsets past M, negative or decreasing: 0 <= start <= end <= M, rows of x only
            # (clamped in the offsets' dtype: an int64 offset past 2**31 is past M, too)
            end = tl.minimum(tl.maximum(tl.load(offs_ptr + g), 0), M)
            start = tl.minimum(tl.maximum(start, 0), end).to(tl.int32)
            end = end.to(tl.int32)
            while tile < base + per_group:
                local = tile - base
                _wgrad_tile(x_desc, dy_desc, x_ptr, dy_ptr, out_ptr, g, start, end,
                            local // tiles_k, local % tiles_k, N, K, ACCUMULATE, USE_TMA,
                            BLOCK_M, BLOCK_N, BLOCK_K)
                tile += P
            base += per_group


    @triton.jit
    def _rank_order(offs_ptr, r, valid, M, G_POW2: tl.constexpr):
        """int32 (G_POW2,): lane ``i < G`` holds the group of rank ``i``, groups by decreasing
        row count (clamped as the tiles clamp them), ties by index; lanes past G hold group
        0 (never read: masked by the caller). One ``tl.sort`` of unique int64 keys
        ``rows * G_POW2 + (G_POW2 - 1 - g)`` (descending: more rows first, then the lower
        index), so no torch kernel runs for the order."""
        end = tl.minimum(tl.maximum(tl.load(offs_ptr + r, mask=valid, other=0), 0), M)
        start = tl.load(offs_ptr + tl.maximum(r - 1, 0), mask=valid & (r > 0), other=0)
        start = tl.minimum(tl.maximum(start, 0), end)
        rows = (end - start).to(tl.int64)
        key = tl.where(valid, rows * G_POW2 + (G_POW2 - 1 - r), -1)
        key = tl.sort(key, descending=True)
        return (G_POW2 - 1 - (key & (G_POW2 - 1))).to(tl.int32)

    @triton.jit
    def _rank_info(offs_ptr, ranks, lanes, tile, per_group, tiles_k, M,
                   BLOCK_M: tl.constexpr):
        """Group, its clamped rows [start, end), its row steps (>= 1) and the (n, k) tile
        indices of the flat schedule's tile ``tile``; ``ranks``: the groups by
        rank in registers (:func:`_rank_order`; the lane of this rank is picked out with
        a masked sum over ``lanes``, the lane indices)."""
        rank = tile // per_group
        local = tile % per_group
        g = tl.sum(tl.where(lanes == rank, ranks, 0), 0)
        end = tl.minimum(tl.maximum(tl.load(offs_ptr + g), 0), M)  # clamped before the
        start = tl.load(offs_ptr + tl.maximum(g - 1, 0))  # cast: int64 offsets past 2**31
        start = tl.minimum(tl.maximum(tl.where(g == 0, 0, start), 0), end).to(tl.int32)
        end = end.to(tl.int32)
        steps = tl.maximum((end - start + BLOCK_M - 1) // BLOCK_M, 1)
        return g, start, end, steps, local // tiles_k, local % tiles_k

    @triton.jit
    def _wgrad_flat_kernel(x_ptr, dy_ptr, out_ptr, offs_ptr, M, N, K, G, P,
                           ACCUMULATE: tl.constexpr, USE_TMA: tl.constexpr,
                           TMA_STORE: tl.constexpr, G_POW2: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
        """The ``FLAT`` schedule of :func:`_wgrad_large_kernel` (same tiles, same order, same
        results): one loop over this program's row steps of all its tiles, so Triton's
        software pipeliner overlaps a tile's epilogue with the next tile's first loads.
        Each program sorts the groups by decreasing rows itself (:func:`_rank_order`, in
        registers; no ``order`` table). ``USE_TMA``: per-group descriptors whose row count
        ends at the group's end, so TMA fills the tail step's rows past it with zeros (no
        ``tl.where`` on the loaded tiles); pointer loads mask rows >= end.
        ``TMA_STORE``: dW tiles leave through a TMA store (not with ACCUMULATE)."""
        pid = tl.program_id(0)
        tiles_k = tl.cdiv(K, BLOCK_K)
        per_group = tl.cdiv(N, BLOCK_N) * tiles_k
        # the program's total row steps: its tile count in each rank times that group's
        # steps, over all ranks at once (vector ops, no loop)
        r = tl.arange(0, G_POW2).to(tl.int64)  # 64-bit: the counts are summed products
        valid = r < G
        gr = _rank_order(offs_ptr, r, valid, M, G_POW2)
        end_r = tl.minimum(tl.maximum(tl.load(offs_ptr + gr, mask=valid, other=0), 0), M)
        start_r = tl.load(offs_ptr + tl.maximum(gr - 1, 0), mask=valid, other=0)
        start_r = tl.minimum(tl.maximum(tl.where(gr == 0, 0, start_r), 0), end_r).to(tl.int32)
        end_r = end_r.to(tl.int32)
        steps_r = tl.maximum((end_r - start_r + BLOCK_M - 1) // BLOCK_M, 1)
        lo = r * per_group - pid
        hi = lo + per_group
        cnt = (tl.maximum(hi + P - 1, 0) // P) - (tl.maximum(lo + P - 1, 0) // P)
        total = tl.sum(tl.where(valid, cnt * steps_r, 0))

        x_desc = None
        dy_desc = None
        if USE_TMA:  # whole-tensor descriptors (replaced per group below)
            x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1],
                                               block_shape=[BLOCK_M, BLOCK_K])
            dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[M, N], strides=[N, 1],
                                                block_shape=[BLOCK_M, BLOCK_N])
        out_desc = None
        if TMA_STORE:
            out_desc = tl.make_tensor_descriptor(out_ptr, shape=[G, N, K],
                                                 strides=[N * K, K, 1],
                                                 block_shape=[1, BLOCK_N, BLOCK_K])
        tile = pid - P
        kk = -1
        steps = 0
        g = 0
        start = 0
        end = 0
        pn = 0
        pk = 0
        desc_g = -1
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for _ in tl.range(0, total):
            kk = tl.where(kk == steps - 1, 0, kk + 1)
            if kk == 0:
                tile += P
                g, start, end, steps, pn, pk = _rank_info(offs_ptr, gr, r, tile, per_group,
                                                          tiles_k, M, BLOCK_M)
                if USE_TMA and g != desc_g:  # a new group: new bounds
                    desc_g = g
                    # an empty group reads row 0 (inside x and dy) and stores zeros
                    base = tl.where(end > start, start, 0).to(tl.int64)
                    rows = tl.maximum(end - start, 1)
                    x_desc = tl.make_tensor_descriptor(
                        x_ptr + base * K, shape=[rows, K], strides=[K, 1],
                        block_shape=[BLOCK_M, BLOCK_K])
                    dy_desc = tl.make_tensor_descriptor(
                        dy_ptr + base * N, shape=[rows, N], strides=[N, 1],
                        block_shape=[BLOCK_M, BLOCK_N])
            m0 = start + kk * BLOCK_M
            if USE_TMA:
                d = dy_desc.load([kk * BLOCK_M, pn * BLOCK_N])
                xa = x_desc.load([kk * BLOCK_M, pk * BLOCK_K])
            else:
                d, xa = _load_step(x_desc, dy_desc, x_ptr, dy_ptr, m0, end, pn * BLOCK_N,
                                   pk * BLOCK_K, N, K, True, USE_TMA, BLOCK_M, BLOCK_N,
                                   BLOCK_K)
            acc = tl.dot(tl.trans(d), xa, acc)
            if kk == steps - 1:
                if USE_TMA:  # an empty group read one row of its neighbour: zeros
                    acc = tl.where(end > start, acc, 0.0)
                if TMA_STORE:
                    out_desc.store([g, pn * BLOCK_N, pk * BLOCK_K],
                                   acc.to(out_ptr.dtype.element_ty).reshape(1, BLOCK_N,
                                                                            BLOCK_K))
                else:
                    cols_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
                    cols_k = pk * BLOCK_K + tl.arange(0, BLOCK_K)
                    mask = (cols_n[:, None] < N) & (cols_k[None, :] < K)
                    ptr = (out_ptr + g.to(tl.int64) * N * K
                           + cols_n[:, None].to(tl.int64) * K + cols_k[None, :])
                    res = acc
                    if ACCUMULATE:
                        res += tl.load(ptr, mask=mask, other=0.0)
                    tl.store(ptr, res.to(out_ptr.dtype.element_ty), mask=mask)
                acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)

def _launch(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor,
            out: torch.Tensor | None, config: dict | None, wrap=None) -> torch.Tensor:
    """Launch the configured kernel (``FLAT``: :func:`_wgrad_flat_kernel`, else
    :func:`_wgrad_large_kernel`; ``wrap``: ``torch.library.wrap_triton`` inside the ops) into
    ``out`` (accumulate) or a new (G, N, K) tensor in x's dtype. A ``config`` key that is
    not :func:`large_wgrad_config`'s raises ``ValueError`` (before the early returns)."""
    unknown = sorted(set(config or ()) - set(large_wgrad_config()))
    if unknown:  # e.g. ACCUMULATE, which the flat launch would take from the config
        raise ValueError(f"config keys must be among {sorted(large_wgrad_config())}, got "
                         f"unknown {unknown}")
    m, k = x.shape
    n = dy.shape[1]
    groups = offsets.shape[0]
    accumulate = out is not None
    if out is None:
        out = torch.empty(groups, n, k, device=x.device, dtype=x.dtype)
        if m == 0 or n == 0 or k == 0 or groups == 0:
            return out.zero_()
    elif m == 0 or n == 0 or k == 0 or groups == 0:
        return out
    x, dy = x.contiguous(), dy.contiguous()  # row strides K, N (the ops may be called directly)
    offsets = offsets.contiguous()  # the kernels read offs_ptr + g
    tma = tma_unsupported_reason(x, dy) is None
    flat, cfg, grid = _launch_plan(x, dy, groups, tma, accumulate, config)
    if cfg["USE_TMA"] and x.device.type == "cuda":
        from .grouped_gemm_large_triton import _ensure_allocator

        _ensure_allocator()
    if flat:  # the group order is the kernel's own (sorted in registers)
        launch(wrap(_wgrad_flat_kernel) if wrap is not None else _wgrad_flat_kernel, grid,
               x, dy, out, offsets, m, n, k, groups, grid[0], **cfg)
        return out
    order = group_order(offsets)
    launch(wrap(_wgrad_large_kernel) if wrap is not None else _wgrad_large_kernel, grid, x,
           dy, out, offsets, order, m, n, k, groups, grid[0], ACCUMULATE=accumulate, **cfg)
    return out


def _launch_plan(x: torch.Tensor, dy: torch.Tensor, groups: int, tma: bool,
                 accumulate: bool, config: dict | None) -> tuple[bool, dict, tuple[int]]:
    """(flat schedule?, the launch's keyword arguments, grid) for x (M, K), dy (M, N) and
    ``groups`` groups: :func:`large_wgrad_config` updated by ``config``, ``USE_TMA`` only
    where ``tma`` (the operands can take it), the flat schedule's keys (``ACCUMULATE``
    and ``G_POW2`` set) or the nested one's (``ACCUMULATE`` set by the caller). What the
    eager launch passes."""
    n, k = dy.shape[1], x.shape[1]
    cfg = dict(large_wgrad_config())
    cfg.update(config or {})
    if not tma:
        cfg["USE_TMA"] = False
    flat = cfg.pop("FLAT", False)
    flat_keys = {"TMA_STORE": cfg.pop("TMA_STORE", False)}
    flat = flat and not accumulate  # the accumulate launch keeps the nested schedule
    if flat_keys["TMA_STORE"] and (accumulate or not cfg["USE_TMA"]
                                   or k * x.element_size() % 16):  # out: x's dtype
        flat_keys["TMA_STORE"] = False
    grid = (grid_size(x.device, groups, n, k, cfg["BLOCK_N"], cfg["BLOCK_K"]),)
    if flat:
        cfg = {"ACCUMULATE": False, **cfg, **flat_keys, "G_POW2": next_power_of_2(groups)}
    return flat, cfg, grid


def large_wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``dW_g = dy_g^T @ x_g`` with the persistent kernel (module docstring: when dispatched).

    Same result as ``torch._grouped_mm(dy.t(), x, offs=offsets)`` (te_ops'
    ``te_ops.gemm.dispatch.grouped_wgrad``), with fp32 accumulation.

    Shapes: x (M, K) and dy (M, N), bf16/fp16 on CUDA, same dtype; offsets (G,) int32/int64
    cumulative group ends on x's device, ``offsets[-1] <= M`` (rows past it are padding and
    do not contribute, whatever they hold) -> dW (G, N, K) in x's dtype, zeros for an empty
    group. With ``out`` (fp32 (G, N, K) contiguous, e.g. Megatron's ``main_grad``): ``out +=``
    the fp32 sums (rounded once, to fp32) and ``out`` is returned. Launch parameters:
    :func:`large_wgrad_config`. Under a ``torch.compile`` trace the call is the op
    ``te_ops::grouped_wgrad_large`` (``..._accumulate`` with ``out``).

    Raises
    ------
    ValueError
        Shapes, dtypes or devices of the arguments do not match (the message names them).
    RuntimeError
        The kernel cannot run here (not CUDA, dtype, no Triton; the reason is given).
    """
    _check(x, dy, offsets, out)
    x, dy = x.contiguous(), dy.contiguous()
    if tracing():
        if out is None:
            return torch.ops.te_ops.grouped_wgrad_large(x, dy, offsets)
        torch.ops.te_ops.grouped_wgrad_large_accumulate(x, dy, offsets, out)
        return out
    return _launch(x, dy, offsets, out, None)


def check_wgrad_operands(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor) -> None:
    """``ValueError`` naming the wgrad operand (x (M, K), dy (M, N), offsets (G,) int32 /
    int64 on x's device) whose shape, dtype or device does not fit (this kernel's and the
    Gluon wgrad's check)."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (rows, in_features), got shape {tuple(x.shape)}")
    if dy.dim() != 2 or dy.shape[0] != x.shape[0] or dy.dtype != x.dtype or (
            dy.device != x.device):
        raise ValueError(f"dy must be 2-D ({x.shape[0]}, out_features) {x.dtype} on "
                         f"{x.device}, got shape {tuple(dy.shape)} {dy.dtype} on {dy.device}")
    if (offsets.dim() != 1 or offsets.device != x.device
            or offsets.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"offsets must be 1-D int32/int64 (G,) on {x.device}, got "
                         f"{offsets.dtype} {tuple(offsets.shape)} on {offsets.device}")


def _check(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor,
           out: torch.Tensor | None) -> None:
    check_wgrad_operands(x, dy, offsets)
    want = (offsets.shape[0], dy.shape[1], x.shape[1])
    if out is not None and (tuple(out.shape) != want or out.dtype != torch.float32
                            or out.device != x.device or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous torch.float32 tensor of shape {want} on "
                         f"{x.device}, got {out.dtype} {tuple(out.shape)} on {out.device}"
                         f"{'' if out.is_contiguous() else ' (not contiguous)'}")
    why = unsupported_reason(x.device, x.dtype)
    if why is not None:
        raise RuntimeError(f"the large-shape Triton grouped wgrad cannot run: {why}")


if triton is not None:

    @torch.library.triton_op("te_ops::grouped_wgrad_large", mutates_args={})
    def _grouped_wgrad_large_op(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor
                                ) -> torch.Tensor:
        """:func:`large_wgrad` as an op; the body, run on FakeTensors, is also the fake."""
        return _launch(x, dy, offsets, None, None, torch.library.wrap_triton)

    @torch.library.triton_op("te_ops::grouped_wgrad_large_accumulate", mutates_args={"out"})
    def _grouped_wgrad_large_accumulate_op(x: torch.Tensor, dy: torch.Tensor,
                                           offsets: torch.Tensor, out: torch.Tensor) -> None:
        """:func:`large_wgrad` with ``out`` as an op (``out += dW``, in place)."""
        _launch(x, dy, offsets, out, None, torch.library.wrap_triton)
