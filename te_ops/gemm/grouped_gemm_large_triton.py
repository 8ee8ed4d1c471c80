"""Persistent Triton grouped GEMMs for many rows per group (fprop, dgrad; fc1 + SwiGLU).

Dispatched by ``te_ops.gemm.dispatch`` where a ``triton_persistent`` row of
``te_ops.gemm.rules`` holds (fprop and dgrad from 32 rows per group on SM90 in bfloat16,
measured faster than ``torch._grouped_mm`` there). The fc1 variant with the (Scaled)SwiGLU
in its epilogue (:func:`large_fc1_swiglu`, measured 0.97-0.99x fprop + the Triton SwiGLU pass
at 128-2048 rows per group, so no rules row) is what ``fc1_swiglu_gluon`` falls back to (same
bits) where TMA cannot take the operands.

For group ``g`` (rows ``offsets[g-1]:offsets[g]``, ``offsets[-1]`` the total, rows past it
padding; the kernel clamps each group's rows to ``0 <= start <= end <= M``, so offsets past M,
negative or decreasing never address memory outside x and the outputs; no groups: all rows
padding):

* :func:`large_fprop`: ``y_g = x_g @ W_g^T``, x (M, K), W (G, N, K) -> y (M, N);
* :func:`large_dgrad`: ``dx_g = dy_g @ W_g``, dy (M, N), W (G, N, K) -> dx (M, K) (the same
  kernel with ``W_KN``: it reads W as (G, K_red, N_out), rows contiguous along the output);
* :func:`large_fc1_swiglu`: ``h_g = x_g @ W1_g^T`` with W1 (G, 2F, K) -> h (M, 2F), and
  ``a = SiLU(h[:, :F]) * h[:, F:] (* probs[:, None])`` -> a (M, F), computed in fp32 from the
  *rounded* h with ``swiglu_triton._core`` (the Triton SwiGLU forward's function and order of
  operations, so ``a`` equals that kernel's output on this ``h`` bit for bit).

Schedule. A persistent kernel: ``min(#SMs, tile bound)`` programs; the tiles of all groups
(and of the padding tail, group index ``G``, whose tiles write zeros) are numbered group after
group, ``cdiv(rows_g, BLOCK_M) * cdiv(N, BLOCK_N)`` per group, and program ``p`` takes tiles
``p, p + P, p + 2P, ...``; offsets are read on the device (no host sync, launch size known on
the host: graph-safe). ``FLAT`` (a launch constexpr; the default of fprop and dgrad) runs one
``tl.range(..., flatten=True)`` loop over the program's tiles of the G groups: each program
builds the groups' cumulative tile counts in registers once (``next_power_of_2(G)`` lanes, at
most :data:`FLAT_MAX_GROUPS`), a tile's group is the count of lanes <= tile, and the k-loop
runs to K for every tile, so Triton's FuseNestedLoops pass fuses the two loops into one
software-pipelined loop (TTGIR: one level of ``scf.for``, in which the TMA loads run ahead
across tile boundaries). The padding rows' tiles follow in a plain loop that stores zeros
(no k-step). ``FLAT=False``:
each program walks the groups in order (a ``while`` over the group's tiles inside a loop over
groups: Triton fuses nothing, the pipeline drains at every tile; what the launch runs above
:data:`FLAT_MAX_GROUPS` groups).
Inside a group, tiles go in ``GROUP_M``-row-tile bands (the "grouped ordering" of Triton's
matmul tutorials) so that concurrently running programs share the same weight tiles in L2.
``tl.dot`` (wgmma on SM90), fp32 accumulation, output in the operands' dtype (bf16/fp16).

fc1 + SwiGLU, ``PAIRED`` (the launch sets it for fc1 + SwiGLU only): structurally the plain
fprop. W1
(G, 2F, K) is read through its (G, 2, F, K) view (TMA block [1, 2, BLOCK_N/2, BLOCK_K]: gate
rows [n0, n0 + BLOCK_N/2) and up rows [F + n0, ...) in one load, reshaped to (BLOCK_N,
BLOCK_K) without data movement), one ``tl.dot`` per k-step into one (BLOCK_M, BLOCK_N)
accumulator; the epilogue splits it in registers (reshape (BLOCK_M, 2, BLOCK_N/2), permute,
``tl.split``) into h's gate and up column tiles ``pn`` (BLOCK_N/2 wide), stores both and
``a`` from the rounded values. Every h element takes the plain fprop's k-steps, so h equals
:func:`large_fprop`'s bit for bit (checked on the H200 at the E8 / E32 / E128 layers). It
compiles to the plain fprop's loop (one wgmma chain) with 2 KB of spills (ptxas, Triton 3.6;
the plain fprop's 0.6 KB stay outside the k-loop, some of these are reloaded in it) and measured
0.97-0.99x fprop + the SwiGLU pass: the epilogue's SiLU, its a stores and the spills cost
about what the memory-bound SwiGLU pass costs, since nothing overlaps the epilogue with the
next tile's MMAs (experimental/gemm_kernel_ab/README.md).

Loads. ``USE_TMA=True`` (a launch constexpr): x and W through ``tl.make_tensor_descriptor``
(device-side TMA descriptors; Triton >= 3.4, the H200 machine has 3.6.0; needs x contiguous, W
k-contiguous with 16-byte-aligned strides and base pointers, :func:`tma_unsupported_reason`;
Triton then needs a global-memory allocator for the descriptors, which
:func:`_ensure_allocator` installs when none is set). ``USE_TMA=False``: masked pointer loads
(any strides; what Triton's CPU interpreter runs in the tests). The output is stored with
masked pointer stores in both (a TMA store would have to clip per group). Rows of a tile past
its group's end are loaded (they belong to the next group or the padding, possibly garbage)
but never stored; rows are independent in a GEMM, so they do not touch the stored rows.

Registered as ``torch.library.triton_op`` (``te_ops::grouped_gemm_large``,
``te_ops::grouped_fc1_swiglu_large``; the bodies, run on FakeTensors, are the fake kernels);
eager calls launch through :func:`te_ops.kernels.triton_launch.launch`.
"""

from __future__ import annotations

import torch

from ..tracing import tracing
from .grouped_gemm_triton import check_offsets_and_probs, unsupported_reason
from ..kernels.triton_launch import capability, cdiv, launch, next_power_of_2, sm_count

try:  # Triton is optional: CPU-only installs have no use for it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

__all__ = ["large_config",
           "large_fprop", "large_dgrad",
           "large_fc1_swiglu", "tma_unsupported_reason", "unsupported_reason", "grid_size",
           "FLAT_MAX_GROUPS"]

#: Programs of the persistent kernel where the device is not CUDA (the CPU interpreter).
_CPU_PROGRAMS = 4

#: The ``FLAT`` schedule keeps two int64 tile counts per group in registers,
#: ``next_power_of_2(G)`` lanes per program; above this many groups the launch runs the group
#: walk instead (same outputs).
FLAT_MAX_GROUPS = 1024


def large_config(kind: str) -> dict[str, int | bool]:
    """Default launch parameters of ``kind`` (``"fprop"``, ``"dgrad"`` or ``"fc1_swiglu"``;
    tuned with ``experimental/gemm_kernel_ab/large_gemm_triton.py --sweep``): 128 x 256
    output tiles (torch's CUTLASS kernel uses 128x256x64 at these shapes; for fc1 + SwiGLU one
    accumulator of 128 gate + 128 up columns, ``PAIRED`` in the module docstring), 64 k per
    step, ``GROUP_M = 8``, 8 warps, 3 stages, TMA loads, the flattened schedule (``FLAT``,
    measured faster than the group walk). ``USE_TMA`` is dropped by the launch where
    :func:`tma_unsupported_reason` says the operands cannot take it."""
    if kind not in ("fprop", "dgrad", "fc1_swiglu"):
        raise ValueError(f"kind must be 'fprop', 'dgrad' or 'fc1_swiglu', got {kind!r}")
    return {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "USE_TMA": True,
            "FLAT": True, "num_warps": 8, "num_stages": 3}


#: :func:`_resolve`'s result without a ``config``, per (kind, groups past FLAT_MAX_GROUPS):
#: the default is the same dict every call (copied out: the launch changes ``USE_TMA``).
_DEFAULTS: dict[tuple[str, bool], dict[str, int | bool]] = {}


def check_config_values(cfg: dict, defaults: dict) -> None:
    """Raise ``ValueError`` naming the key, the expected and the given value where a launch
    config value is not of its default's kind: a ``bool`` for the flags (``FLAT``,
    ``USE_TMA``, ...), an ``int`` >= 1 (not a ``bool``) for the sizes and counts (``BLOCK_*``,
    ``GROUP_M``, ``num_warps``, ...). Shared by the kernels' ``_resolve`` checks."""
    for key, value in cfg.items():
        if isinstance(defaults[key], bool):
            if not isinstance(value, bool):
                raise ValueError(f"config {key} must be a bool, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config {key} must be an int >= 1, got {value!r}")


def _resolve(kind: str, config: dict | None, groups: int) -> dict[str, int | bool]:
    """:func:`large_config` of ``kind`` updated by ``config``, checked: known keys, values of
    their defaults' kind (:func:`check_config_values`), for ``"fc1_swiglu"`` an even
    ``BLOCK_N`` of at least 16 (``PAIRED``). ``FLAT`` with more than
    :data:`FLAT_MAX_GROUPS` groups runs the group walk instead (the same tiles and k-steps;
    the in-register tile table would take too many registers). A new dict each call."""
    if config is None:
        key = (kind, groups > FLAT_MAX_GROUPS)
        cached = _DEFAULTS.get(key)
        if cached is None:
            cached = _DEFAULTS[key] = _resolve(kind, {}, groups)
        return dict(cached)
    cfg = dict(large_config(kind))
    cfg.update(config or {})
    unknown = sorted(set(cfg) - set(large_config(kind)))
    if unknown:
        raise ValueError(f"config keys must be among {sorted(large_config(kind))}, got "
                         f"unknown {unknown}")
    check_config_values(cfg, large_config(kind))
    if cfg["FLAT"] and groups > FLAT_MAX_GROUPS:
        cfg["FLAT"] = False
    if kind == "fc1_swiglu" and (cfg["BLOCK_N"] < 16 or cfg["BLOCK_N"] % 2):
        raise ValueError(f"config BLOCK_N of fc1_swiglu must be even and >= 16 (gate and up "
                         f"halves of one accumulator), got BLOCK_N={cfg['BLOCK_N']}")
    return cfg


def tma_unsupported_reason(x: torch.Tensor, weights: torch.Tensor) -> str | None:
    """Why the TMA loads cannot take these operands (``None`` when they can): no
    ``tl.make_tensor_descriptor`` in the installed Triton, a GPU before SM90, x not
    contiguous, W not contiguous along K, a stride or base pointer not 16-byte aligned."""
    why = _tma_layout_reason(x, weights)
    if why is not None:
        return why
    size = x.element_size()
    if _fake(x) or _fake(weights):  # no data pointer: the storage offset is what is known
        if x.storage_offset() * size % 16 or weights.storage_offset() * size % 16:
            return "x or weights do not start on a 16-byte boundary (storage offset)"
        return None
    if x.data_ptr() % 16 or weights.data_ptr() % 16:
        return "x or weights do not start on a 16-byte boundary"
    return None


def _tma_layout_reason(x: torch.Tensor, weights: torch.Tensor) -> str | None:
    """:func:`tma_unsupported_reason` without the base pointers: what the shapes, strides,
    dtype, device and Triton decide (a bound call site decides it once; the pointers it
    checks per call)."""
    if tl is None or not hasattr(tl, "make_tensor_descriptor"):
        return "the installed Triton has no tl.make_tensor_descriptor"
    if x.device.type == "cuda" and capability(x.device)[0] < 9:
        return "TMA needs SM90 or newer"
    size = x.element_size()
    if not x.is_contiguous():
        return "x is not contiguous"
    if weights.stride(2) != 1:
        return f"weights are not contiguous along K (stride {weights.stride(2)})"
    strides = (x.stride(0), weights.stride(0), weights.stride(1))
    if any(s * size % 16 for s in strides):
        return f"a stride of x / weights is not a multiple of 16 bytes ({strides} elements)"
    return None


#: Tensor types that are never fake by their type (the C++ wrappers of that Python type,
#: functional and functorch ones, are checked apart: see :func:`_plain_eager`).
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_FUNCTORCH_WRAPPED = torch._C._functorch.is_functorch_wrapped_tensor


def _plain_eager(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain ``torch.Tensor`` or ``Parameter`` that wraps nothing, so
    not fake (``is_fake`` need not walk it). A C++ functional wrapper (``torch.compile``'s
    functionalization) or functorch wrapper (``torch.func.grad`` / ``vmap``) has the Python
    type ``torch.Tensor`` and may wrap a FakeTensor: not plain."""
    return (type(t) in _PLAIN and not torch._is_functional_tensor(t)
            and not _FUNCTORCH_WRAPPED(t))


def _fake(t: torch.Tensor) -> bool:
    """A FakeTensor, also wrapped (a FunctionalTensor under ``torch.compile``, a functorch
    wrapper): no data. A plain eager tensor or Parameter answers without ``is_fake``'s
    subclass walk (:func:`_plain_eager`)."""
    if _plain_eager(t):
        return False
    return torch._subclasses.fake_tensor.is_fake(t)


def grid_size(device: torch.device, rows: int, groups: int, n: int, block_m: int,
              block_n: int) -> int:
    """Programs of the persistent kernel: the device's SM count (4 off CUDA), at most the
    tile count's upper bound (each group and the padding tail round up one row tile)."""
    programs = sm_count(device) if device.type == "cuda" else _CPU_PROGRAMS
    bound = (cdiv(rows, block_m) + groups + 1) * cdiv(n, block_n)
    return max(1, min(programs, bound))


def _ensure_allocator() -> None:
    """Install a torch-backed allocator for Triton's device-side TMA descriptors when none is
    set (Triton's default raises "no allocator was set"). A user-set allocator is kept."""
    from triton.runtime import _allocation  # private: read where the default is installed

    current = getattr(_allocation, "_allocator", None)
    null = getattr(_allocation, "_NULL_ALLOCATOR", None)
    if current is not None and null is not None and current.get() is not null:
        return
    triton.set_allocator(_torch_alloc)


def _torch_alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Scratch bytes on the current CUDA device from torch's caching allocator (its blocks are
    at least 512-byte aligned, more than the 128 bytes TMA descriptors need)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _install_default_allocator() -> None:
    """Make torch's caching allocator Triton's *default* allocator when none is set.

    Triton keeps the allocator in a ContextVar (``triton.runtime._allocation._allocator``),
    and a thread starts with the default value: a compiled graph's backward runs in autograd's
    CUDA worker thread, where a graph-launched TMA kernel (no te_ops Python runs there to call
    :func:`_ensure_allocator`) would find Triton's raising default. So the ContextVar is
    replaced by one whose default is :func:`_torch_alloc`; ``triton.set_allocator`` keeps
    working (it sets the module's variable), and a user-set allocator is kept."""
    import contextvars

    from triton.runtime import _allocation  # private: where the default lives

    current = getattr(_allocation, "_allocator", None)
    null = getattr(_allocation, "_NULL_ALLOCATOR", None)
    if not isinstance(current, contextvars.ContextVar) or null is None:
        return  # another Triton's layout: the calls before each eager launch remain
    if current.get() is not null:
        return  # set by the user (or already installed)
    _allocation._allocator = contextvars.ContextVar("_allocator", default=_torch_alloc)


if triton is not None:
    _install_default_allocator()


if triton is not None:
    from .grouped_gemm_triton import _group_rows
    from ..kernels.swiglu_triton import _core

    @triton.jit
    def _tile_of(local, tiles_m, tiles_n, GROUP_M: tl.constexpr):
        """(row tile, column tile) of a group's ``local``-th tile in GROUP_M-row-tile bands."""
        band = GROUP_M * tiles_n
        first_m = (local // band) * GROUP_M
        size_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pm = first_m + (local % band) % size_m
        pn = (local % band) // size_m
        return pm, pn

    @triton.jit
    def _load_w(w_desc, w_ptr, g, n0, k0, N_ROWS, K, stride_wg, stride_wn, stride_wk,
                USE_TMA: tl.constexpr, W_KN: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
        """The (BLOCK_K, BLOCK_N) operand tile B[k0:k0+BLOCK_K, n0:n0+BLOCK_N] of group g,
        zeros past K / N_ROWS: B = W[g]^T for fprop (W (G, N, K), k-contiguous), B = W[g]
        for dgrad (``W_KN``: W (G, K, N) as the kernel sees it, n-contiguous)."""
        if USE_TMA:
            if W_KN:
                return w_desc.load([g, k0, n0]).reshape(BLOCK_K, BLOCK_N)
            w = w_desc.load([g, n0, k0]).reshape(BLOCK_N, BLOCK_K)
            return w.T
        else:
            n = n0 + tl.arange(0, BLOCK_N)
            k = k0 + tl.arange(0, BLOCK_K)
            ptr = (w_ptr + tl.cast(g, tl.int64) * stride_wg
                   + k[:, None].to(tl.int64) * stride_wk + n[None, :].to(tl.int64) * stride_wn)
            return tl.load(ptr, mask=(k[:, None] < K) & (n[None, :] < N_ROWS), other=0.0)

    @triton.jit
    def _load_w_pair(w_desc, w_ptr, g, n0, k0, N, K, stride_wg, stride_wn, stride_wk,
                     USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """``PAIRED``: the (BLOCK_K, BLOCK_N) operand tile whose columns are W1[g]'s gate rows
        [n0, n0 + BLOCK_N/2) then its up rows [N + n0, N + n0 + BLOCK_N/2) (W1 (G, 2N, K),
        k-contiguous), transposed; zeros past K and past row N of each half. TMA: one load
        through the (G, 2, N, K) view of W1 (block [1, 2, BLOCK_N/2, BLOCK_K]), reshaped to
        (BLOCK_N, BLOCK_K) (the halves are consecutive in the block: no data movement)."""
        if USE_TMA:
            w = w_desc.load([g, 0, n0, k0]).reshape(BLOCK_N, BLOCK_K)
            return w.T
        else:
            c = tl.arange(0, BLOCK_N)
            j = n0 + c % (BLOCK_N // 2)
            row = (c // (BLOCK_N // 2)).to(tl.int64) * N + j
            k = k0 + tl.arange(0, BLOCK_K)
            ptr = (w_ptr + tl.cast(g, tl.int64) * stride_wg
                   + k[:, None].to(tl.int64) * stride_wk + row[None, :].to(tl.int64) * stride_wn)
            return tl.load(ptr, mask=(k[:, None] < K) & (j < N)[None, :], other=0.0)

    @triton.jit
    def _split_pair(acc, TILE_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """(gate, up): the two (TILE_M, BLOCK_N/2) column halves of a ``PAIRED``
        accumulator."""
        pair = tl.permute(tl.reshape(acc, (TILE_M, 2, BLOCK_N // 2)), (0, 2, 1))
        return tl.split(pair)

    @triton.jit
    def _tile(x_desc, w_desc, x_ptr, w_ptr, h_ptr, a_ptr, p_ptr, g, k_end, end, m0, pn, N,
              K, h_cols, stride_wg, stride_wn, stride_wk, SWIGLU: tl.constexpr,
              HAS_P: tl.constexpr, USE_TMA: tl.constexpr, W_KN: tl.constexpr,
              TILE_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              PAIRED: tl.constexpr):
        """One output tile: rows [m0, m0 + TILE_M) of group ``g`` (rows up to ``end``),
        column tile ``pn``, k-steps up to ``k_end`` (K; 0 for the padding group, which then
        stores zeros). ``PAIRED`` (set with SWIGLU, which needs it): one (TILE_M, BLOCK_N)
        accumulator whose halves are h's gate and up column tiles ``pn`` (BLOCK_N/2 wide),
        one W load and one dot per k-step (:func:`_load_w_pair`), split in the epilogue."""
        rows = m0 + tl.arange(0, TILE_M)
        row_ok = rows < end
        acc = tl.zeros([TILE_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([TILE_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, k_end, BLOCK_K):
            if USE_TMA:
                xa = x_desc.load([m0.to(tl.int32), k0])
            else:
                k = k0 + tl.arange(0, BLOCK_K)
                xa = tl.load(x_ptr + rows[:, None] * K + k[None, :],
                             mask=row_ok[:, None] & (k[None, :] < K), other=0.0)
            if PAIRED:
                wt = _load_w_pair(w_desc, w_ptr, g, pn * (BLOCK_N // 2), k0, N, K, stride_wg,
                                  stride_wn, stride_wk, USE_TMA, BLOCK_N, BLOCK_K)
            else:
                wt = _load_w(w_desc, w_ptr, g, pn * BLOCK_N, k0, N, K, stride_wg, stride_wn,
                             stride_wk, USE_TMA, W_KN, BLOCK_N, BLOCK_K)
            acc = tl.dot(xa, wt, acc)
        if PAIRED:
            gate, up = _split_pair(acc, TILE_M, BLOCK_N)
            _epilogue(gate, up, h_ptr, a_ptr, p_ptr, rows, row_ok, pn, N, h_cols, SWIGLU,
                      HAS_P, BLOCK_N // 2)
        else:
            _epilogue(acc, acc_u, h_ptr, a_ptr, p_ptr, rows, row_ok, pn, N, h_cols, SWIGLU,
                      HAS_P, BLOCK_N)

    @triton.jit
    def _epilogue(acc, acc_u, h_ptr, a_ptr, p_ptr, rows, row_ok, pn, N, h_cols,
                  SWIGLU: tl.constexpr, HAS_P: tl.constexpr, BLOCK_N: tl.constexpr):
        """Store h = acc (SWIGLU: h's gate columns, acc_u its up columns, and a) for the
        tile's ``rows`` where ``row_ok``, column tile ``pn``."""
        cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = row_ok[:, None] & (cols < N)[None, :]
        h_row = h_ptr + rows[:, None] * h_cols
        hg = acc.to(h_ptr.dtype.element_ty)
        tl.store(h_row + cols[None, :], hg, mask=mask)
        if SWIGLU:
            hu = acc_u.to(h_ptr.dtype.element_ty)
            tl.store(h_row + N + cols[None, :], hu, mask=mask)
            up = hu.to(tl.float32)
            _, silu = _core(hg.to(tl.float32), up)
            out = silu * up
            if HAS_P:
                p = tl.load(p_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
                out = out * p[:, None]
            tl.store(a_ptr + rows[:, None] * N + cols[None, :],
                     out.to(a_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _tile_ends(offs_ptr, M, G, tiles_n, BLOCK_M: tl.constexpr, GBLOCK: tl.constexpr):
        """The ``FLAT`` schedule's tile table in registers (int64, GBLOCK >= G lanes): lane
        g < G holds the cumulative count of tiles of groups 0..g; rows clamped as
        :func:`_group_rows`; lanes past G - 1 hold the total. The padding rows are not in the
        table."""
        gi = tl.arange(0, GBLOCK)
        real = gi < G
        end = tl.load(offs_ptr + gi, mask=real, other=0).to(tl.int64)
        end = tl.minimum(tl.maximum(end, 0), M)
        start = tl.load(offs_ptr + gi - 1, mask=(gi > 0) & real, other=0).to(tl.int64)
        start = tl.minimum(tl.maximum(start, 0), end)
        full = (end - start + BLOCK_M - 1) // BLOCK_M
        return tl.cumsum(tl.where(real, full * tiles_n, 0), 0)

    @triton.jit
    def _group_of(ends, tile):
        """(group, its first tile) of ``tile`` in a cumulative tile table."""
        before = ends <= tile
        return tl.sum(before.to(tl.int32), 0), tl.max(tl.where(before, ends, 0), 0)

    @triton.jit
    def _large_kernel(x_ptr, w_ptr, h_ptr, a_ptr, p_ptr, offs_ptr, M, N, K, G, P,
                      stride_wg, stride_wn, stride_wk,
                      SWIGLU: tl.constexpr, HAS_P: tl.constexpr, USE_TMA: tl.constexpr,
                      W_KN: tl.constexpr, FLAT: tl.constexpr, GBLOCK: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, PAIRED: tl.constexpr):
        """Plain (SWIGLU=False): h[m, n] = sum_k x[m, k] W[g, n, k], h (M, N). SWIGLU: N = F
        gate columns, h (M, 2F) gets both halves, a (M, F) = SiLU(gate) * up (* p[m]).
        x (M, K) contiguous; h, a contiguous; P programs; group G = the padding rows.
        FLAT: one ``tl.range(flatten=True)`` loop over this program's tiles of groups
        0..G-1 (the group of a tile: the count of ``_tile_ends`` lanes <= tile, GBLOCK >= G
        lanes), whose k-loop bound is K for every tile, so Triton fuses the two loops; then a
        loop over the padding rows' tiles that stores zeros (no k-step, no read of those
        rows). Else each program walks the groups in order (no table). The tile numbering
        runs round robin over the programs throughout."""
        pid = tl.program_id(0)
        if SWIGLU:
            h_cols = 2 * N
        else:
            h_cols = N
        x_desc = None
        w_desc = None
        if USE_TMA:
            x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1],
                                               block_shape=[BLOCK_M, BLOCK_K])
            if W_KN:
                w_desc = tl.make_tensor_descriptor(w_ptr, shape=[G, K, N],
                                                   strides=[stride_wg, stride_wk, 1],
                                                   block_shape=[1, BLOCK_K, BLOCK_N])
            elif PAIRED:  # W1 (G, 2N, K) as (G, 2, N, K): gate and up rows in one block
                w_desc = tl.make_tensor_descriptor(w_ptr, shape=[G, 2, N, K],
                                                   strides=[stride_wg, N * stride_wn,
                                                            stride_wn, 1],
                                                   block_shape=[1, 2, BLOCK_N // 2, BLOCK_K])
            else:
                w_desc = tl.make_tensor_descriptor(w_ptr, shape=[G, h_cols, K],
                                                   strides=[stride_wg, stride_wn, 1],
                                                   block_shape=[1, BLOCK_N, BLOCK_K])
        if PAIRED:  # h's column tiles (of the gate half; the up tile is its twin)
            COL_N: tl.constexpr = BLOCK_N // 2
        else:
            COL_N: tl.constexpr = BLOCK_N
        tiles_n = tl.cdiv(N, COL_N)
        if FLAT:
            ends = _tile_ends(offs_ptr, M, G, tiles_n, BLOCK_M, GBLOCK)
            n_full = tl.max(ends, 0)
            for tile in tl.range(pid, n_full, P, flatten=True):
                g, base = _group_of(ends, tile)  # g < G: the padding is not in the table
                start, end = _group_rows(offs_ptr, g, G, M)  # clamped
                tiles_m = (end - start + BLOCK_M - 1) // BLOCK_M
                pm, pn = _tile_of((tile - base).to(tl.int32), tiles_m.to(tl.int32), tiles_n,
                                  GROUP_M)
                _tile(x_desc, w_desc, x_ptr, w_ptr, h_ptr, a_ptr, p_ptr, g, K, end,
                      start + pm * BLOCK_M, pn, N, K, h_cols, stride_wg, stride_wn,
                      stride_wk, SWIGLU, HAS_P, USE_TMA, W_KN, BLOCK_M, BLOCK_N, BLOCK_K,
                      PAIRED)
            first = (pid + P - n_full % P) % P  # the tile numbering goes on round robin
            pad_start, pad_end = _group_rows(offs_ptr, G, G, M)
            pad_tiles = ((pad_end - pad_start + BLOCK_M - 1) // BLOCK_M * tiles_n).to(tl.int32)
            for tile in range(first, pad_tiles, P):  # padding rows: zeros, no k-step
                rows = pad_start + (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
                zero = tl.zeros([BLOCK_M, COL_N], dtype=tl.float32)
                _epilogue(zero, zero, h_ptr, a_ptr, p_ptr, rows, rows < pad_end,
                          tile % tiles_n, N, h_cols, SWIGLU, HAS_P, COL_N)
        else:
            tile = pid
            base = 0
            for g in range(0, G + 1):
                start, end = _group_rows(offs_ptr, g, G, M)  # clamped
                tiles_m = ((end - start + BLOCK_M - 1) // BLOCK_M).to(tl.int32)
                count = tiles_m * tiles_n
                k_end = tl.where(g < G, K, 0)  # the padding group: no k-step, zeros
                while tile < base + count:
                    pm, pn = _tile_of(tile - base, tiles_m, tiles_n, GROUP_M)
                    m0 = start + pm * BLOCK_M
                    _tile(x_desc, w_desc, x_ptr, w_ptr, h_ptr, a_ptr, p_ptr, g, k_end,
                          end, m0, pn, N, K, h_cols, stride_wg, stride_wn,
                          stride_wk, SWIGLU, HAS_P, USE_TMA, W_KN, BLOCK_M,
                          BLOCK_N, BLOCK_K, PAIRED)
                    tile += P
                base += count


def _launch(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
            probs: torch.Tensor | None, kind: str, config: dict | None, kernel
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Allocate the outputs and launch ``kernel`` for ``kind`` (``"fprop"``, ``"dgrad"``,
    ``"fc1_swiglu"``): (h, a) for fc1 with the SwiGLU, (y, None) otherwise."""
    m, k = x.shape
    swiglu, dgrad = kind == "fc1_swiglu", kind == "dgrad"
    groups = weights.shape[0]
    n_rows = weights.shape[2] if dgrad else weights.shape[1]
    n = n_rows // 2 if swiglu else n_rows
    h = torch.empty(m, n_rows, device=x.device, dtype=x.dtype)
    a = torch.empty(m, n, device=x.device, dtype=x.dtype) if swiglu else None
    cfg = _resolve(kind, config, groups)  # before the early returns: a bad config always raises
    if m == 0 or n == 0:
        return h, a
    if groups == 0 or k == 0:  # no groups: every row is padding (the kernel would read
        # offsets[0], which is not there); no reduction: zeros (no 0-wide TMA descriptor)
        h.zero_()
        if a is not None:
            a.zero_()
            if probs is not None:  # as the kernel's padding rows: SwiGLU(0, 0) * probs
                a.mul_(probs[:, None])
        return h, a
    x = x.contiguous()  # the kernel's row stride is K (the ops may be called directly)
    probs = None if probs is None else probs.contiguous()
    offsets = offsets.contiguous()  # the kernel reads offs_ptr + g
    if cfg["USE_TMA"] and tma_unsupported_reason(x, weights) is not None:
        cfg["USE_TMA"] = False
    if cfg["USE_TMA"] and x.device.type == "cuda":
        _ensure_allocator()
    grid, rest, kwargs = _launch_plan(x, weights, kind, cfg, probs is not None)
    p = probs if probs is not None else x
    launch(kernel, grid, x, weights, h, h if a is None else a, p, offsets, *rest, **kwargs)
    return h, a


def _launch_plan(x: torch.Tensor, weights: torch.Tensor, kind: str, cfg: dict,
                 has_p: bool) -> tuple[tuple[int], tuple, dict]:
    """(grid, the scalar arguments after the six tensors, the keyword arguments) of
    :func:`_large_kernel` for ``kind`` with the resolved ``cfg`` (its TMA decision made):
    what the eager launch passes."""
    m, k = x.shape
    dgrad = kind == "dgrad"
    groups = weights.shape[0]
    n_rows = weights.shape[2] if dgrad else weights.shape[1]
    n = n_rows // 2 if kind == "fc1_swiglu" else n_rows
    paired = kind == "fc1_swiglu"  # one gate + up accumulator
    col_n = cfg["BLOCK_N"] // 2 if paired else cfg["BLOCK_N"]  # h's column tile
    grid = (grid_size(x.device, m, groups, n, cfg["BLOCK_M"], col_n),)
    # (stride of W along the output columns, along the reduction): dgrad reads W (G, N, K)
    # as (G, K_red=N, N_out=K).
    stride_n, stride_k = ((weights.stride(2), weights.stride(1)) if dgrad
                          else (weights.stride(1), weights.stride(2)))
    rest = (m, n, k, groups, grid[0], weights.stride(0), stride_n, stride_k)
    kwargs = dict(SWIGLU=kind == "fc1_swiglu", HAS_P=has_p, W_KN=dgrad,
                  GBLOCK=next_power_of_2(groups) if cfg["FLAT"] else 1,
                  PAIRED=paired, **cfg)
    return grid, rest, kwargs


def large_fprop(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor
                ) -> torch.Tensor:
    """``y_g = x_g @ W_g^T`` with the persistent kernel.

    Shapes: x (M, K) bf16/fp16 on CUDA, weights (G, N, K) any strides (TMA loads need them
    k-contiguous, else pointer loads), offsets (G,) int32/int64 cumulative group ends on x's
    device -> y (M, N) in x's dtype; rows past ``offsets[-1]`` are zero. Launch parameters:
    :func:`large_config`. Under a ``torch.compile`` trace the call is the op
    ``te_ops::grouped_gemm_large``.

    Raises
    ------
    ValueError
        Shapes, dtypes or devices of the arguments do not match (the message names them).
    RuntimeError
        The kernel cannot run here (not CUDA, dtype, no Triton; the reason is given).
    """
    _check(x, weights, offsets, None, swiglu=False)
    x = x.contiguous()
    if tracing():
        return torch.ops.te_ops.grouped_gemm_large(x, weights, offsets)
    return _launch(x, weights, offsets, None, "fprop", None, _large_kernel)[0]


def large_dgrad(dy: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor
                ) -> torch.Tensor:
    """``dx_g = dy_g @ W_g`` with the persistent kernel (the fprop kernel reading W as
    (G, K_red, N_out), n-contiguous: ``W_KN``).

    Shapes: dy (M, N) bf16/fp16 on CUDA, weights (G, N, K) (TMA loads need them contiguous
    along K, else pointer loads), offsets (G,) int32/int64 cumulative group ends on dy's
    device -> dx (M, K) in dy's dtype; rows past ``offsets[-1]`` are zero. Under a
    ``torch.compile`` trace the call is the op ``te_ops::grouped_dgrad_large``.

    Raises
    ------
    ValueError, RuntimeError
        As :func:`large_fprop` (dy's columns must equal N).
    """
    _check(dy, weights, offsets, None, swiglu=False, dgrad=True)
    dy = dy.contiguous()
    if tracing():
        return torch.ops.te_ops.grouped_dgrad_large(dy, weights, offsets)
    return _launch(dy, weights, offsets, None, "dgrad", None, _large_kernel)[0]


def large_fc1_swiglu(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                     probs: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """fc1's grouped fprop with the (Scaled)SwiGLU in its epilogue (``te_ops.gemm.fc1_swiglu``
    runs it where the Gluon ``fc1_swiglu`` rules row holds but the Gluon kernel's operands rule
    it out at run time: the same bits).

    ``h_g = x_g @ W_g^T``, bitwise :func:`large_fprop`'s with the default config (``PAIRED``:
    the same tiles of rows and k-steps); ``a = SiLU(h[:, :F]) * h[:, F:]`` (times
    ``probs[:, None]``) in fp32 from the rounded h (``swiglu_triton._core``, the Triton SwiGLU
    forward's order of operations: bitwise that kernel's output on h).

    Shapes: x (M, K) bf16/fp16 on CUDA, weights (G, 2F, K) (gate rows first, then up rows),
    offsets (G,) int32/int64 cumulative group ends, probs (M,) any float dtype or ``None`` ->
    (h (M, 2F), a (M, F)) in x's dtype; rows past ``offsets[-1]`` have h = 0 and a computed
    from those zeros. Under a ``torch.compile`` trace the call is the op
    ``te_ops::grouped_fc1_swiglu_large``.

    Raises
    ------
    ValueError, RuntimeError
        As :func:`large_fprop`; also an odd weight row count (no gate/up halves).
    """
    _check(x, weights, offsets, probs, swiglu=True)
    x = x.contiguous()
    probs = None if probs is None else probs.contiguous()
    if tracing():
        return torch.ops.te_ops.grouped_fc1_swiglu_large(x, weights, offsets, probs)
    h, a = _launch(x, weights, offsets, probs, "fc1_swiglu", None, _large_kernel)
    return h, a


def _check(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
           probs: torch.Tensor | None, swiglu: bool, dgrad: bool = False) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (rows, in_features), got shape {tuple(x.shape)}")
    if weights.dim() != 3 or weights.dtype != x.dtype or weights.device != x.device:
        raise ValueError(f"weights must be 3-D (G, N, K) {x.dtype} on {x.device}, got shape "
                         f"{tuple(weights.shape)} {weights.dtype} on {weights.device}")
    if dgrad and weights.shape[1] != x.shape[1]:
        raise ValueError(f"dy has {x.shape[1]} columns, weights (G, N, K) have N="
                         f"{weights.shape[1]}")
    if not dgrad and weights.shape[2] != x.shape[1]:
        raise ValueError(f"x has {x.shape[1]} columns, weights (G, N, K) have K="
                         f"{weights.shape[2]}")
    if swiglu and weights.shape[1] % 2:
        raise ValueError(f"weights (G, 2F, K) must have an even number of rows (gate and up "
                         f"halves), got 2F={weights.shape[1]}")
    check_offsets_and_probs(x, offsets, weights.shape[0], probs)
    why = unsupported_reason(x.device, x.dtype)
    if why is not None:
        raise RuntimeError(f"the large-shape Triton grouped GEMM cannot run: {why}")


if triton is not None:

    @torch.library.triton_op("te_ops::grouped_gemm_large", mutates_args={})
    def _grouped_gemm_large_op(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor
                               ) -> torch.Tensor:
        """:func:`large_fprop` as an op; the body, run on FakeTensors, is also the fake."""
        return _launch(x, weights, offsets, None, "fprop", None,
                       torch.library.wrap_triton(_large_kernel))[0]

    @torch.library.triton_op("te_ops::grouped_dgrad_large", mutates_args={})
    def _grouped_dgrad_large_op(dy: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor
                                ) -> torch.Tensor:
        """:func:`large_dgrad` as an op; the body, run on FakeTensors, is also the fake."""
        return _launch(dy, weights, offsets, None, "dgrad", None,
                       torch.library.wrap_triton(_large_kernel))[0]

    @torch.library.triton_op("te_ops::grouped_fc1_swiglu_large", mutates_args={})
    def _grouped_fc1_swiglu_large_op(x: torch.Tensor, weights: torch.Tensor,
                                     offsets: torch.Tensor, probs: torch.Tensor | None
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`large_fc1_swiglu` as an op; the body, run on FakeTensors, is also the fake."""
        h, a = _launch(x, weights, offsets, probs, "fc1_swiglu", None,
                       torch.library.wrap_triton(_large_kernel))
        return h, a
