"""Triton grouped GEMMs for few rows per group (the MoE decode regime), with device offsets.

With a handful of tokens per expert, a grouped linear layer's GEMMs are bound by the weight
bytes (fprop and dgrad read every ``W_g``, wgrad writes every ``dW_g``), not by math. Tiles
made for large M waste that bandwidth. These kernels give each program one group and one
tile of weight columns and loop over the group's rows in small row blocks, so each weight
tile is read (or each weight-gradient tile written) once per row block, by many programs at
a time.

For group ``g`` (rows ``offsets[g-1]:offsets[g]``, ``offsets[-1]`` the total):

* fprop  ``y_g  = x_g @ W_g^T``  x (M, K), W (G, N, K) -> (M, N)
* dgrad  ``dx_g = dy_g @ W_g``   dy (M, N), W (G, N, K) -> (M, K)
* wgrad  ``dW_g = dy_g^T @ x_g`` x (M, K), dy (M, N) -> (G, N, K), zero for empty groups

bf16 / fp16 operands, fp32 accumulation, outputs in the operands' dtype. fprop and dgrad share
one kernel (``_rows_kernel``: ``out_g = a_g @ B_g`` with ``B_g`` given by strides, so ``W_g^T``
is a free view); one extra program column (group index ``G``) writes zeros to the padding rows
past ``offsets[-1]``, so no separate fill runs. Split sizes are read on the device only: no
host sync, launch sizes known on the host, so the calls are graph-safe.

Row gather (``a_rows`` / ``x_rows`` / ``dy_rows``, the constexpr switches ``A_ROWS``,
``X_ROWS``, ``DY_ROWS``): the row-major operand's row ``m`` is row ``index[m]`` of a source
``(S, cols)`` tensor, read straight from the source in the operand's load (an index ``>= S``,
an empty capacity slot or a dropped pair, reads zeros: the values of
:func:`te_ops.routing.pick`). The MoE layer's permuted tokens (fc1's fprop and wgrad input) and
its combine gradient (fc2's dgrad and wgrad ``dy``) are then never written as a (rows, cols)
copy. The tiles hold the values the gathered copy would hold, in the same positions, so the
outputs equal the kernel's on ``index_select``-ed operands bit for bit.

Registered as ``torch.library.triton_op`` (``te_ops::grouped_gemm_rows``,
``te_ops::grouped_wgrad_rows``): under ``torch.compile`` the calls go through them (the body,
run on FakeTensors, is the fake kernel); eager calls launch the kernels directly (a custom-op
dispatch costs host time). Dispatch lives in :mod:`te_ops.gemm.dispatch` (backend
``triton``); where it runs, in the ``triton_rows`` rows of :mod:`te_ops.gemm.rules`.
"""

from __future__ import annotations

import torch

from ..tracing import tracing
from ..kernels.triton_launch import cdiv, launch

try:  # Triton is optional: CPU-only installs have no use for it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

__all__ = ["unsupported_reason", "triton_fprop", "check_row_index",
           "triton_dgrad", "triton_wgrad", "rows_config", "wgrad_config"]

_DTYPES = (torch.bfloat16, torch.float16)  # fp32 would take TF32 inside tl.dot


def unsupported_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the Triton grouped GEMMs cannot run for ``dtype`` operands on ``device``
    (``None`` when they can)."""
    # The device and dtype first: they are what the caller can change (a CPU run must not be
    # told that installing triton would help).
    if device.type != "cuda":
        return f"device type {device.type} is not cuda (the Triton grouped GEMMs need a GPU)"
    if dtype not in _DTYPES:
        return f"dtype {dtype} is not one of {list(_DTYPES)}"
    if triton is None:
        return "triton is not installed"
    return None


def rows_config(kind: str, rows_per_group: float, j: int, groups: int,
                rows: int) -> dict[str, int]:
    """Launch parameters of the fprop (``kind="fprop"``) or dgrad kernel for ``rows`` rows in
    ``groups`` groups (``rows_per_group`` on average) and ``j`` output columns.

    ``BLOCK_J`` / ``BLOCK_R``: the fastest of a decode sweep on the H200 (E64 H2048 FF768,
    4 rows per group; experimental/gemm_kernel_ab/): fprop 64 / 128 (fc1 1.05x, fc2 1.12x
    over 32 / 256), dgrad 128 / 64 (fc1 1.08x, fc2 1.60x over 64 / 128, 32 columns on fc2);
    outputs equal bit for bit (the same k-steps in the same order). Warps and stages: 4 / 3,
    which no swept variant beat (docs/performance.md "Few-rows Triton GEMMs"). Up to
    ``SPLIT = 4`` programs share one (group, column tile), each taking every SPLIT-th row
    block (a skewed group's rows in parallel; its weight tile then comes from L2)."""
    block_m = 16 if rows_per_group <= 16 else 32 if rows_per_group <= 32 else 64
    if kind == "fprop":
        block_j, block_r = 64, 128
    else:
        block_j, block_r = 128, 64
    split = max(1, min(4, -(-rows // block_m)))
    return {"BLOCK_M": block_m, "BLOCK_J": block_j, "BLOCK_R": block_r, "SPLIT": split,
            "num_warps": 4, "num_stages": 3}


def wgrad_config(rows_per_group: float, n: int, k: int) -> dict[str, int]:
    """Launch parameters of the wgrad kernel (the fastest of the same sweep)."""
    block_m = 16 if rows_per_group <= 16 else 32
    return {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4,
            "num_stages": 3}


def _check(name: str, t: torch.Tensor, dim: int, dtype: torch.dtype, device: torch.device
           ) -> None:
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if t.dtype != dtype or t.device != device:
        raise ValueError(f"{name} must be {dtype} on {device}, got {t.dtype} on {t.device}")


def check_offsets_and_probs(x: torch.Tensor, offsets: torch.Tensor, groups: int,
                            probs: torch.Tensor | None) -> None:
    """The argument checks the fc1 + SwiGLU and persistent kernels share: ``offsets`` int32 /
    int64 of shape (groups,) on x's device, ``probs`` (None or) of shape (rows,) there.

    Raises
    ------
    ValueError
        Naming the argument, the expected and the actual shape / dtype / device.
    """
    if (offsets.dim() != 1 or offsets.shape[0] != groups or offsets.device != x.device
            or offsets.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"offsets must be int32/int64 of shape ({groups},) on {x.device}, got "
                         f"{offsets.dtype} {tuple(offsets.shape)} on {offsets.device}")
    if probs is not None and (probs.shape != (x.shape[0],) or probs.device != x.device):
        raise ValueError(f"probs must have shape ({x.shape[0]},) on {x.device}, got "
                         f"{tuple(probs.shape)} on {probs.device}")


def _check_offsets(offsets: torch.Tensor, groups: int, device: torch.device,
                   dtype: torch.dtype) -> None:
    if offsets.dim() != 1 or offsets.shape[0] != groups:
        raise ValueError(f"offsets must have shape ({groups},) (one end row per group), got "
                         f"{tuple(offsets.shape)}")
    if offsets.device != device or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offsets must be int32/int64 on {device}, got {offsets.dtype} on "
                         f"{offsets.device}")
    why = unsupported_reason(device, dtype)
    if why is not None:
        raise RuntimeError(f"the Triton grouped GEMMs cannot run: {why}")


if triton is not None:

    @triton.jit
    def _group_rows(offs_ptr, g, G, M):
        """Rows [start, end) of program group ``g`` (int64); ``g == G`` is the padding tail.
        Clamped to ``0 <= start <= end <= M``: offsets past M, negative or decreasing (bad
        device split sizes, not checkable without a sync) never address memory outside the
        operands, and no group has a negative row count."""
        prev = tl.maximum(g - 1, 0)
        start = tl.load(offs_ptr + prev).to(tl.int64)
        start = tl.where(g == 0, 0, start)
        end = tl.load(offs_ptr + tl.minimum(g, G - 1)).to(tl.int64)
        end = tl.minimum(tl.maximum(tl.where(g == G, M, end), 0), M)
        return tl.minimum(tl.maximum(start, 0), end), end

    @triton.jit
    def _source_rows(rows_ptr, rows, row_ok, S, GATHER: tl.constexpr):
        """(source row, whether it is read) of each operand row: ``rows`` itself, or with
        ``GATHER`` the int32/int64 index ``rows_ptr[rows]``, read only where it lies in
        ``[0, S)`` (anything else reads zeros)."""
        if GATHER:
            src = tl.load(rows_ptr + rows, mask=row_ok, other=0).to(tl.int64)
            ok = row_ok & (src >= 0) & (src < S)
        else:
            src = rows
            ok = row_ok
        return src, ok

    @triton.jit
    def _rows_kernel(a_ptr, b_ptr, out_ptr, offs_ptr, a_rows_ptr, M, J, R, G, A_SRC,
                     stride_bg, stride_br, stride_bj, A_ROWS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr,
                     SPLIT: tl.constexpr):
        """out[m, j] = sum_r a[m, r] * B[g, r, j] for the rows m of group g; a (M, R) and
        out (M, J) contiguous (with ``A_ROWS``: row m of a is row ``a_rows[m]`` of an
        (A_SRC, R) source). Program (g, j-tile, s) takes the group's row blocks s,
        s + SPLIT, ...; g == G zeroes the padding rows."""
        g = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
        col_ok = cols < J
        start, end = _group_rows(offs_ptr, g, G, M)
        rk = tl.arange(0, BLOCK_R)
        b_base = b_ptr + g.to(tl.int64) * stride_bg
        for m0 in range(start + tl.program_id(2) * BLOCK_M, end, SPLIT * BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < end
            acc = tl.zeros([BLOCK_M, BLOCK_J], dtype=tl.float32)
            if g < G:
                src, src_ok = _source_rows(a_rows_ptr, rows, row_ok, A_SRC, A_ROWS)
                for r0 in range(0, R, BLOCK_R):
                    r = r0 + rk
                    r_ok = r < R
                    a = tl.load(a_ptr + src[:, None] * R + r[None, :],
                                mask=src_ok[:, None] & r_ok[None, :], other=0.0)
                    b = tl.load(b_base + r[:, None] * stride_br + cols[None, :] * stride_bj,
                                mask=r_ok[:, None] & col_ok[None, :], other=0.0)
                    acc = tl.dot(a, b, acc)
            tl.store(out_ptr + rows[:, None] * J + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _wgrad_kernel(x_ptr, dy_ptr, out_ptr, offs_ptr, x_rows_ptr, dy_rows_ptr, M, N, K, G,
                      X_SRC, DY_SRC, X_ROWS: tl.constexpr, DY_ROWS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[g, n, k] = sum over group g's rows m of dy[m, n] * x[m, k]; x (M, K), dy (M, N),
        out (G, N, K) contiguous (with ``X_ROWS`` / ``DY_ROWS``: row m of x / dy is row
        ``x_rows[m]`` / ``dy_rows[m]`` of an (X_SRC, K) / (DY_SRC, N) source). Program
        (g, n-tile, k-tile) writes its tile once (zeros for an empty group)."""
        g = tl.program_id(0)
        ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
        n_ok = ns < N
        k_ok = ks < K
        start, end = _group_rows(offs_ptr, g, G, M)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < end
            d_src, d_ok = _source_rows(dy_rows_ptr, rows, row_ok, DY_SRC, DY_ROWS)
            x_src, x_ok = _source_rows(x_rows_ptr, rows, row_ok, X_SRC, X_ROWS)
            dyt = tl.load(dy_ptr + d_src[None, :] * N + ns[:, None],
                          mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            x = tl.load(x_ptr + x_src[:, None] * K + ks[None, :],
                        mask=x_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(dyt, x, acc)
        out = out_ptr + g.to(tl.int64) * N * K + ns[:, None].to(tl.int64) * K + ks[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


def _rows_grid(kind: str, m: int, j: int, groups: int, config: dict[str, int] | None
               ) -> tuple[dict[str, int], tuple[int, int, int]]:
    """Launch parameters and grid of ``_rows_kernel`` (the eager launch and the bound site
    share them, so both run the same tiles)."""
    cfg = dict(config or rows_config(kind, m / groups, j, groups, m))
    cfg.setdefault("SPLIT", 1)
    return cfg, (groups + 1, cdiv(j, cfg["BLOCK_J"]), cfg["SPLIT"])


def _wgrad_grid(m: int, n: int, k: int, groups: int, config: dict[str, int] | None
                ) -> tuple[dict[str, int], tuple[int, int, int]]:
    """Launch parameters and grid of ``_wgrad_kernel`` (as :func:`_rows_grid`)."""
    cfg = dict(config or wgrad_config(m / groups, n, k))
    return cfg, (groups, cdiv(n, cfg["BLOCK_N"]), cdiv(k, cfg["BLOCK_K"]))


def _rows_launch(kind: str, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, j: int,
                 strides: tuple[int, int, int], config: dict[str, int] | None,
                 kernel, a_rows: torch.Tensor | None = None) -> torch.Tensor:
    """out (M, j) = per-group a_g @ B_g, B_g[r, c] at ``b + g*s0 + r*s1 + c*s2``; with
    ``a_rows`` (M,) row m of a is ``a[a_rows[m]]`` (zeros for an index past a's rows)."""
    m = a.shape[0] if a_rows is None else a_rows.shape[0]
    r = a.shape[1]
    groups = offsets.shape[0]
    out = torch.empty(m, j, device=a.device, dtype=a.dtype)
    if m == 0 or j == 0:
        return out
    cfg, grid = _rows_grid(kind, m, j, groups, config)
    offsets = offsets.contiguous()  # the kernel reads offs_ptr + g
    rows = offsets if a_rows is None else a_rows.contiguous()  # unread without A_ROWS
    launch(kernel, grid, a, b, out, offsets, rows, m, j, r, groups, a.shape[0], *strides,
           A_ROWS=a_rows is not None, **cfg)
    return out


def _wgrad_launch(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor,
                  config: dict[str, int] | None, kernel, x_rows: torch.Tensor | None = None,
                  dy_rows: torch.Tensor | None = None) -> torch.Tensor:
    """(G, N, K) per-group dy_g^T @ x_g; with ``x_rows`` / ``dy_rows`` (M,) row m of x / dy
    is ``x[x_rows[m]]`` / ``dy[dy_rows[m]]`` (zeros for an index past the source's rows)."""
    m = _gathered_rows(x, x_rows, dy, dy_rows)
    k, n = x.shape[1], dy.shape[1]
    groups = offsets.shape[0]
    out = torch.empty(groups, n, k, device=x.device, dtype=x.dtype)
    if out.numel() == 0:
        return out
    cfg, grid = _wgrad_grid(m, n, k, groups, config)
    offsets = offsets.contiguous()  # the kernel reads offs_ptr + g
    xr = offsets if x_rows is None else x_rows.contiguous()  # unread without X_ROWS
    dr = offsets if dy_rows is None else dy_rows.contiguous()
    launch(kernel, grid, x, dy, out, offsets, xr, dr, m, n, k, groups, x.shape[0], dy.shape[0],
           X_ROWS=x_rows is not None, DY_ROWS=dy_rows is not None, **cfg)
    return out


def _gathered_rows(x: torch.Tensor, x_rows: torch.Tensor | None, dy: torch.Tensor,
                   dy_rows: torch.Tensor | None) -> int:
    """The wgrad's rows M: x's (or ``x_rows``' length), which dy's must match."""
    m = x.shape[0] if x_rows is None else x_rows.shape[0]
    m_dy = dy.shape[0] if dy_rows is None else dy_rows.shape[0]
    if m != m_dy:
        raise ValueError(f"x and dy must have the same rows (after their row gathers), got "
                         f"{m} and {m_dy}")
    return m


def _fprop(x, weights, offsets, config=None, kernel=None, a_rows=None):
    w = weights
    return _rows_launch("fprop", x.contiguous(), w, offsets, w.shape[1],
                        (w.stride(0), w.stride(2), w.stride(1)), config,
                        kernel or _rows_kernel, a_rows)


def _dgrad(dy, weights, offsets, config=None, kernel=None, a_rows=None):
    w = weights
    return _rows_launch("dgrad", dy.contiguous(), w, offsets, w.shape[2],
                        (w.stride(0), w.stride(1), w.stride(2)), config,
                        kernel or _rows_kernel, a_rows)


def check_row_index(name: str, index: torch.Tensor | None, device: torch.device) -> None:
    """A row gather's index: ``None``, or a 1-D int32 / int64 tensor on ``device``.

    Raises
    ------
    ValueError
        Naming ``name``, the expected and the actual dims / dtype / device.
    """
    if index is None:
        return
    if (index.dim() != 1 or index.dtype not in (torch.int32, torch.int64)
            or index.device != device):
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor on {device} (one source row "
                         f"per operand row), got {index.dtype} {tuple(index.shape)} on "
                         f"{index.device}")


def triton_fprop(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                 config: dict[str, int] | None = None,
                 a_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``y_g = x_g @ W_g^T``: x (M, K), weights (G, N, K) any strides, offsets (G,) int32/int64
    cumulative group ends on x's device -> y (M, N) in x's dtype; rows past ``offsets[-1]``
    are zero. ``a_rows`` (M,) int32/int64: x is an (S, K) source and row m of the operand is
    ``x[a_rows[m]]`` (zeros where ``a_rows[m] >= S``), gathered in the kernel's load.
    ``config`` overrides :func:`rows_config` (benchmarks).

    Raises
    ------
    ValueError
        Shapes, dtypes or devices of the arguments do not match (the message names them), or
        the weights have no group (G = 0).
    RuntimeError
        The kernels cannot run here (not CUDA, dtype, no Triton; the reason is given).
    """
    return _rows_call("fprop", "x", x, weights, offsets, config, a_rows)


def triton_dgrad(dy: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                 config: dict[str, int] | None = None,
                 a_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``dx_g = dy_g @ W_g``: dy (M, N), weights (G, N, K) -> dx (M, K); padding rows zero;
    ``a_rows`` gathers dy's rows as :func:`triton_fprop` gathers x's.

    Raises
    ------
    ValueError, RuntimeError
        As :func:`triton_fprop`.
    """
    return _rows_call("dgrad", "dy", dy, weights, offsets, config, a_rows)


def _rows_call(kind: str, name: str, a: torch.Tensor, weights: torch.Tensor,
               offsets: torch.Tensor, config: dict[str, int] | None,
               a_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Checks and dispatch of :func:`triton_fprop` / :func:`triton_dgrad` (``a`` is x or dy,
    called ``name`` in errors; its columns must match the weights' K or N)."""
    _check("weights", weights, 3, a.dtype, a.device)
    if weights.shape[0] == 0:  # the kernel reads offsets[0] and offsets[G - 1]
        raise ValueError("weights (G, N, K) must have at least one group, got G=0")
    _check(name, a, 2, a.dtype, a.device)
    dim, label = (2, "K") if kind == "fprop" else (1, "N")
    if a.shape[1] != weights.shape[dim]:
        raise ValueError(f"{name} has {a.shape[1]} columns, weights (G, N, K) have {label}="
                         f"{weights.shape[dim]}")
    check_row_index("a_rows", a_rows, a.device)
    _check_offsets(offsets, weights.shape[0], a.device, a.dtype)
    if tracing() and config is None:
        return torch.ops.te_ops.grouped_gemm_rows(a, weights, offsets, kind, a_rows)
    return (_fprop if kind == "fprop" else _dgrad)(a, weights, offsets, config, None, a_rows)


def triton_wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor,
                 config: dict[str, int] | None = None, x_rows: torch.Tensor | None = None,
                 dy_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``dW_g = dy_g^T @ x_g``: x (M, K), dy (M, N) -> (G, N, K) in x's dtype, G =
    ``offsets.shape[0]``; zero for empty groups; rows past ``offsets[-1]`` do not contribute.
    ``x_rows`` / ``dy_rows`` (M,) int32/int64: x / dy is an (S, K) / (S', N) source whose rows
    the kernel gathers in its load (as :func:`triton_fprop`'s ``a_rows``).

    Raises
    ------
    ValueError
        As :func:`triton_fprop` (x and dy must have the same rows, after their gathers).
    """
    _check("x", x, 2, x.dtype, x.device)
    _check("dy", dy, 2, x.dtype, x.device)
    check_row_index("x_rows", x_rows, x.device)
    check_row_index("dy_rows", dy_rows, x.device)
    _gathered_rows(x, x_rows, dy, dy_rows)
    if offsets.dim() != 1:
        raise ValueError(f"offsets must be 1-D (one end row per group), got shape "
                         f"{tuple(offsets.shape)}")
    _check_offsets(offsets, offsets.shape[0], x.device, x.dtype)
    if tracing() and config is None:
        return torch.ops.te_ops.grouped_wgrad_rows(x, dy, offsets, x_rows, dy_rows)
    return _wgrad_launch(x.contiguous(), dy.contiguous(), offsets, config, _wgrad_kernel,
                         x_rows, dy_rows)


if triton is not None:

    @torch.library.triton_op("te_ops::grouped_gemm_rows", mutates_args={})
    def _grouped_gemm_rows_op(a: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                              kind: str, a_rows: torch.Tensor | None = None) -> torch.Tensor:
        """fprop (``kind="fprop"``) or dgrad of :func:`triton_fprop` / :func:`triton_dgrad`
        as an op; the body, run on FakeTensors, is also the fake kernel."""
        fn = _fprop if kind == "fprop" else _dgrad
        return fn(a, weights, offsets, None, torch.library.wrap_triton(_rows_kernel), a_rows)

    @torch.library.triton_op("te_ops::grouped_wgrad_rows", mutates_args={})
    def _grouped_wgrad_rows_op(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor,
                               x_rows: torch.Tensor | None = None,
                               dy_rows: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`triton_wgrad` as an op."""
        return _wgrad_launch(x.contiguous(), dy.contiguous(), offsets, None,
                             torch.library.wrap_triton(_wgrad_kernel), x_rows, dy_rows)
