"""fc1's grouped fprop with the (Scaled)SwiGLU in its epilogue: one Triton launch for both.

At decode sizes the fused grouped MLP's forward runs fc1's fprop (``grouped_gemm_triton``'s
``_rows_kernel``), then the SwiGLU forward (``swiglu_triton``'s ``_fwd_kernel``) over the fc1
output ``h`` it just wrote. This kernel does both in one pass: program ``(g, f-tile, s)``
computes, for group ``g``'s row blocks ``s, s + SPLIT, ...``, the gate tile
``h[:, f0:f0+BJ]`` and the up tile ``h[:, F+f0:F+f0+BJ]`` of ``h_g = x_g @ W1_g^T``, stores
both (the activation's saved input) and the activation output
``a = SiLU(gate) * up (* probs)`` of the same columns.

Bits. ``h`` is the plain fprop's result bit for bit: each output element accumulates the same
k-steps (``BLOCK_R`` columns of x at a time, in order) with ``tl.dot`` into an fp32 tile of the
same ``BLOCK_M`` rows (``BLOCK_J = 32`` columns, where the plain fprop's tiles have 64; the
CUDA tests compare the bits), and is rounded to the output dtype once. ``a`` is computed from
the *rounded* ``h`` values with the SwiGLU kernel's own function (``swiglu_triton._core``), the
same fp32 operations in the same order, so it equals the unfused SwiGLU's output bit for bit.
The padding rows past ``offsets[-1]`` get ``h = 0`` (one extra program column, group index
``G``, as in the plain fprop) and ``a`` from those zeros (``SiLU(0) * 0 * p``, as the unfused
SwiGLU computes it).

Row gather (``a_rows``, the constexpr ``A_ROWS``): x is an (S, K) source and row m of fc1's
input is ``x[a_rows[m]]``, read in the kernel's load as ``grouped_gemm_triton``'s fprop reads a
gathered operand (the MoE layer's permuted tokens: no (rows, K) copy is written).

Layout: the halves layout only (``glu_interleave_size=None``: gate = first half of fc1's
outputs, up = second half), which is all the Triton SwiGLU kernels take; the interleaved layout
keeps the two launches (:func:`unsupported_reason`).

Registered as the ``torch.library.triton_op`` ``te_ops::grouped_fc1_swiglu`` (the body, run on
FakeTensors, is the fake kernel), so it compiles under ``torch.compile(fullgraph=True)`` and
captures in a CUDA graph; eager calls launch through ``triton_launch.launch``. Which calls take
it is decided in ``te_ops/gemm/fc1_swiglu.py`` (the few-rows ``fc1_swiglu`` row of
:mod:`te_ops.gemm.rules`).
"""

from __future__ import annotations

import torch

from ..tracing import tracing
from .grouped_gemm_triton import check_offsets_and_probs, check_row_index, rows_config
from .grouped_gemm_triton import unsupported_reason as gemm_unsupported_reason
from ..kernels.triton_launch import cdiv, launch

try:  # Triton is optional: CPU-only installs have no use for it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

__all__ = ["unsupported_reason", "fc1_swiglu",
           "fc1_swiglu_config"]

def unsupported_reason(device: torch.device, dtype: torch.dtype,
                       interleave: int | None) -> str | None:
    """Why the fused fc1 + SwiGLU kernel cannot run (``None`` when it can): not CUDA, dtype
    not bf16/fp16 or no Triton (the grouped GEMM kernels' gate), or an interleaved GLU
    layout (the SwiGLU kernels take the halves layout only)."""
    why = gemm_unsupported_reason(device, dtype)
    if why is not None:
        return why
    if interleave is not None:
        return (f"glu_interleave_size={interleave} (the fused kernel, like the Triton SwiGLU "
                "kernels, takes the halves layout only)")
    return None


def fc1_swiglu_config(rows_per_group: float, ffn: int, groups: int,
                      rows: int) -> dict[str, int]:
    """Launch parameters. ``BLOCK_M`` and ``BLOCK_R`` are the plain fprop's
    (:func:`grouped_gemm_triton.rows_config`: they fix the accumulation order, so ``h`` keeps
    its bits), as are the warps and stages. ``BLOCK_J = 32`` gate columns (each program also
    takes the 32 matching up columns: the plain fprop's 64 columns per program) and up to
    ``SPLIT = 8`` programs per (group, column tile): the fastest bitwise-equal variant of
    ``experimental/gemm_kernel_ab/fc1_epilogue.py --sweep`` at 2, 4 and 8 rows per group on
    E64 and E128 fc1 (H200; 1.02-1.08x the two launches, where the fprop's own tiles, 64 gate
    columns and ``SPLIT = 4``, gave 0.97-1.08x; docs/performance.md "fc1 + SwiGLU epilogue")."""
    cfg = rows_config("fprop", rows_per_group, 2 * ffn, groups, rows)
    cfg["BLOCK_J"] = 32
    cfg["SPLIT"] = max(1, min(8, -(-rows // cfg["BLOCK_M"])))
    return cfg


if triton is not None:
    from .grouped_gemm_triton import _group_rows, _source_rows
    from ..kernels.swiglu_triton import _core

    @triton.jit
    def _fc1_swiglu_kernel(x_ptr, w_ptr, h_ptr, a_ptr, p_ptr, offs_ptr, x_rows_ptr, M, F, K,
                           G, X_SRC, stride_wg, stride_wf, stride_wk, HAS_P: tl.constexpr,
                           A_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr,
                           BLOCK_R: tl.constexpr, SPLIT: tl.constexpr):
        """h[m, c] = sum_k x[m, k] * W[g, c, k] for c in a gate tile and its up tile (c + F),
        rows m of group g; a[m, c] = SiLU(h_gate) * h_up (* p[m]) from the rounded h. x (M, K)
        (with ``A_ROWS``: row m is row ``x_rows[m]`` of an (X_SRC, K) source), h (M, 2F),
        a (M, F) contiguous; g == G: the padding rows (h = 0)."""
        g = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
        col_ok = cols < F
        start, end = _group_rows(offs_ptr, g, G, M)
        rk = tl.arange(0, BLOCK_R)
        w_base = w_ptr + g.to(tl.int64) * stride_wg
        for m0 in range(start + tl.program_id(2) * BLOCK_M, end, SPLIT * BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < end
            acc_g = tl.zeros([BLOCK_M, BLOCK_J], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_J], dtype=tl.float32)
            if g < G:
                src, src_ok = _source_rows(x_rows_ptr, rows, row_ok, X_SRC, A_ROWS)
                for r0 in range(0, K, BLOCK_R):
                    r = r0 + rk
                    r_ok = r < K
                    xa = tl.load(x_ptr + src[:, None] * K + r[None, :],
                                 mask=src_ok[:, None] & r_ok[None, :], other=0.0)
                    w_mask = r_ok[:, None] & col_ok[None, :]
                    wg = tl.load(w_base + r[:, None] * stride_wk + cols[None, :] * stride_wf,
                                 mask=w_mask, other=0.0)
                    wu = tl.load(w_base + r[:, None] * stride_wk
                                 + (cols + F)[None, :] * stride_wf, mask=w_mask, other=0.0)
                    acc_g = tl.dot(xa, wg, acc_g)
                    acc_u = tl.dot(xa, wu, acc_u)
            mask = row_ok[:, None] & col_ok[None, :]
            h_row = h_ptr + rows[:, None].to(tl.int64) * (2 * F)
            hg = acc_g.to(h_ptr.dtype.element_ty)
            hu = acc_u.to(h_ptr.dtype.element_ty)
            tl.store(h_row + cols[None, :], hg, mask=mask)
            tl.store(h_row + F + cols[None, :], hu, mask=mask)
            gate = hg.to(tl.float32)
            up = hu.to(tl.float32)
            _, silu = _core(gate, up)
            out = silu * up
            if HAS_P:
                p = tl.load(p_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
                out = out * p[:, None]
            tl.store(a_ptr + rows[:, None].to(tl.int64) * F + cols[None, :],
                     out.to(a_ptr.dtype.element_ty), mask=mask)


def _grid(m: int, ffn: int, groups: int, config: dict[str, int] | None
          ) -> tuple[dict[str, int], tuple[int, int, int]]:
    """Launch parameters and grid of ``_fc1_swiglu_kernel``."""
    cfg = dict(config or fc1_swiglu_config(m / groups, ffn, groups, m))
    cfg.setdefault("SPLIT", 1)
    return cfg, (groups + 1, cdiv(ffn, cfg["BLOCK_J"]), cfg["SPLIT"])


def _launch(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
            probs: torch.Tensor | None, config: dict[str, int] | None, kernel,
            a_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    m = x.shape[0] if a_rows is None else a_rows.shape[0]
    k = x.shape[1]
    groups, two_f = weights.shape[0], weights.shape[1]
    ffn = two_f // 2
    h = torch.empty(m, two_f, device=x.device, dtype=x.dtype)
    a = torch.empty(m, ffn, device=x.device, dtype=x.dtype)
    if m == 0 or ffn == 0:
        return h, a
    cfg, grid = _grid(m, ffn, groups, config)
    offsets = offsets.contiguous()  # the kernel reads offs_ptr + g
    p = probs if probs is not None else x
    rows = offsets if a_rows is None else a_rows.contiguous()  # unread without A_ROWS
    launch(kernel, grid, x, weights, h, a, p, offsets, rows, m, ffn, k, groups, x.shape[0],
           weights.stride(0), weights.stride(1), weights.stride(2), HAS_P=probs is not None,
           A_ROWS=a_rows is not None, **cfg)
    return h, a


def fc1_swiglu(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
               probs: torch.Tensor | None = None,
               config: dict[str, int] | None = None,
               a_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fc1's grouped fprop and the (Scaled)SwiGLU forward in one launch.

    ``h_g = x_g @ W_g^T``; ``a = SiLU(h[:, :F]) * h[:, F:]`` (times ``probs[:, None]``),
    computed in fp32 from the rounded ``h`` (the formula and bits of
    ``te_ops.basic.swiglu.swiglu_forward``).

    Shapes: x (M, K) bf16/fp16 on CUDA, weights (G, 2F, K) any strides, offsets (G,)
    int32/int64 cumulative group ends on x's device, probs (M,) any float dtype or ``None``
    -> (h (M, 2F), a (M, F)) in x's dtype; rows past ``offsets[-1]`` have h = 0. With
    ``a_rows`` (M,) int32/int64, x is an (S, K) source and row m of fc1's input is
    ``x[a_rows[m]]`` (zeros where ``a_rows[m] >= S``), gathered in the kernel's load.
    ``config`` overrides :func:`fc1_swiglu_config` (benchmarks). Under a ``torch.compile``
    trace the call is the op ``te_ops::grouped_fc1_swiglu``.

    Raises
    ------
    ValueError
        Shapes, dtypes or devices of the arguments do not match (the message names them), or
        the weights have no group (G = 0).
    RuntimeError
        The kernel cannot run here (not CUDA, dtype, no Triton; the reason is given).
    """
    _check(x, weights, offsets, probs, a_rows)
    x = x.contiguous()
    probs = None if probs is None else probs.contiguous()
    if tracing() and config is None:
        return torch.ops.te_ops.grouped_fc1_swiglu(x, weights, offsets, probs, a_rows)
    return _launch(x, weights, offsets, probs, config, _fc1_swiglu_kernel, a_rows)


def _check(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
           probs: torch.Tensor | None, a_rows: torch.Tensor | None = None) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (rows, in_features), got shape {tuple(x.shape)}")
    if weights.dim() != 3 or weights.dtype != x.dtype or weights.device != x.device:
        raise ValueError(f"weights must be 3-D (G, 2F, K) {x.dtype} on {x.device}, got shape "
                         f"{tuple(weights.shape)} {weights.dtype} on {weights.device}")
    if weights.shape[2] != x.shape[1]:
        raise ValueError(f"x has {x.shape[1]} columns, weights (G, 2F, K) have K="
                         f"{weights.shape[2]}")
    if weights.shape[1] % 2:
        raise ValueError(f"weights (G, 2F, K) must have an even number of rows (gate and up "
                         f"halves), got 2F={weights.shape[1]}")
    if weights.shape[0] == 0:  # the kernel reads offsets[0] and offsets[G - 1]
        raise ValueError("weights (G, 2F, K) must have at least one group, got G=0")
    check_row_index("a_rows", a_rows, x.device)
    # probs: one per row of fc1's input (a_rows' length with a gather; only the rows and the
    # device of the first argument are read)
    check_offsets_and_probs(x if a_rows is None else a_rows, offsets, weights.shape[0], probs)
    why = unsupported_reason(x.device, x.dtype, None)
    if why is not None:
        raise RuntimeError(f"the fused fc1 + SwiGLU kernel cannot run: {why}")


if triton is not None:

    @torch.library.triton_op("te_ops::grouped_fc1_swiglu", mutates_args={})
    def _grouped_fc1_swiglu_op(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                               probs: torch.Tensor | None,
                               a_rows: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`fc1_swiglu` as an op; the body, run on FakeTensors, is also the fake."""
        return _launch(x, weights, offsets, probs, None,
                       torch.library.wrap_triton(_fc1_swiglu_kernel), a_rows)
