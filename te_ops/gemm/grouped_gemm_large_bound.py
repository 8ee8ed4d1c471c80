"""Bound call sites of the persistent many-rows Triton GEMMs for repeated eager calls.

``te_ops.fast_step`` repeats a recorded call of the fused grouped MLP: its key proves the
operands' shapes, dtypes and device unchanged since a call that passed every argument check
on the general path. :class:`BoundLarge` (fprop, dgrad: ``grouped_gemm_large_triton``) and
:class:`BoundLargeWgrad` (the flat wgrad: ``grouped_wgrad_large_triton``) are the
counterparts of the few-rows kernels' ``BoundRows`` / ``BoundWgrad`` for these kernels: the
resolved launch config, the TMA decision of the operands' layout, the grid (the SM count),
the scalar and keyword arguments and the compiled kernel's binding
(:class:`~te_ops.kernels.triton_launch.BoundLaunch`) are worked out on the first call (and
again when the weights' strides change); a later call allocates the output and launches.
Same kernel, config and arguments as the eager entry points (``large_fprop``,
``large_dgrad``, ``large_wgrad``), so the outputs are the same bits.

What a call re-checks, since the key does not cover it: the operands' base pointers. The TMA
loads need them 16-byte aligned (a view with a storage offset may not be); where the plan
has TMA loads and a pointer is not aligned, the call takes the eager entry point, which then
picks pointer loads, as the general path does. A plan without TMA loads (the layout rules
them out) launches whatever the pointers (the bound launch takes Triton's normal launch for
an unaligned tensor).
"""

from __future__ import annotations

import functools
import operator

import torch

from . import grouped_gemm_large_triton as large
from . import grouped_wgrad_large_triton as large_w
from ..kernels.triton_launch import BoundLaunch, LaunchBatch

__all__ = ["BoundLarge", "BoundLargeWgrad"]

_DATA_PTR = torch.Tensor.data_ptr


def _misaligned(*tensors: torch.Tensor) -> bool:
    """Whether a base pointer among ``tensors`` is not 16-byte aligned."""
    return bool(functools.reduce(operator.or_, map(_DATA_PTR, tensors)) & 15)


class BoundLarge:
    """:func:`~te_ops.gemm.grouped_gemm_large_triton.large_fprop` (``kind="fprop"``) or
    ``large_dgrad`` for the repeated eager calls of one call site, without their argument
    checks (the caller's key proves them, see the module docstring).

    Shapes: ``a`` (M, R) (x for fprop, dy for dgrad), ``weights`` (G, N, K), ``offsets``
    (G,) -> (M, N) for fprop, (M, K) for dgrad, in a's dtype; rows past ``offsets[-1]``
    zero.

    Raises
    ------
    ValueError
        ``kind`` is not ``"fprop"`` or ``"dgrad"`` (at construction).
    """

    def __init__(self, kind: str, batch: LaunchBatch) -> None:
        if kind not in ("fprop", "dgrad"):
            raise ValueError(f"kind must be 'fprop' or 'dgrad', got {kind!r}")
        self.kind = kind
        self.batch = batch
        self.general = large.large_fprop if kind == "fprop" else large.large_dgrad
        self.plan: tuple | None = None

    def __call__(self, a: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor
                 ) -> torch.Tensor:
        a = a.contiguous()  # the kernel's row stride is R (as the eager call)
        plan = self.plan
        if plan is None or weights.stride() != plan[0]:
            plan = self.plan = self._plan(a, weights)
        _, shape, dtype, device, tma, bound = plan
        if tma and _misaligned(a, weights):
            return self.general(a, weights, offsets)
        out = torch.empty(shape, dtype=dtype, device=device)
        if bound is None:  # nothing to compute (no rows or columns), or zeros
            return out if 0 in shape else out.zero_()
        if tma and device.type == "cuda":  # Triton's TMA descriptor scratch (as the eager call)
            large._ensure_allocator()
        bound(a, weights, out, out, a, offsets.contiguous())
        return out

    def _plan(self, a: torch.Tensor, w: torch.Tensor) -> tuple:
        """(weight strides, output shape, dtype, device, TMA loads?, bound launch or None):
        what ``large._launch`` computes for operands of this layout."""
        m, k = a.shape
        groups = w.shape[0]
        n = w.shape[2] if self.kind == "dgrad" else w.shape[1]
        cfg = large._resolve(self.kind, None, groups)
        shape = (m, n)
        if m == 0 or n == 0 or groups == 0 or k == 0:  # the eager call's early returns
            return w.stride(), shape, a.dtype, a.device, False, None
        if cfg["USE_TMA"] and large._tma_layout_reason(a, w) is not None:
            cfg["USE_TMA"] = False
        grid, rest, kwargs = large._launch_plan(a, w, self.kind, cfg, False)
        bound = BoundLaunch(large._large_kernel, grid, rest, kwargs, self.batch)
        return w.stride(), shape, a.dtype, a.device, bool(cfg["USE_TMA"]), bound


class BoundLargeWgrad:
    """:func:`~te_ops.gemm.grouped_wgrad_large_triton.large_wgrad` (without ``out``) for
    the repeated eager calls of one call site (as :class:`BoundLarge`). The default config
    runs the flat schedule, whose group order is the kernel's own (no torch kernel per call).

    Shapes: ``x`` (M, K), ``dy`` (M, N), ``offsets`` (G,) -> dW (G, N, K) in x's dtype.
    """

    def __init__(self, batch: LaunchBatch) -> None:
        self.batch = batch
        self.general = large_w.large_wgrad
        self.plan: tuple | None = None

    def __call__(self, x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor
                 ) -> torch.Tensor:
        x = x.contiguous()
        dy = dy.contiguous()
        plan = self.plan
        if plan is None:
            plan = self.plan = self._plan(x, dy, offsets)
        shape, dtype, device, tma, bound = plan
        if bound is None:  # no rows, columns or groups: zeros (as the eager call)
            return torch.zeros(shape, dtype=dtype, device=device)
        if bound is False or (tma and _misaligned(x, dy)):
            # not the flat schedule (not bound), or a base pointer the TMA loads cannot
            # take: the eager call (which then picks pointer loads)
            return self.general(x, dy, offsets)
        out = torch.empty(shape, dtype=dtype, device=device)
        if tma and device.type == "cuda":
            large._ensure_allocator()
        bound(x, dy, out, offsets.contiguous())
        return out

    def _plan(self, x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor) -> tuple:
        """(output shape, dtype, device, TMA loads?, bound launch): what ``large_w._launch``
        computes for operands of this layout (``None`` for empty operands, ``False`` for a
        schedule other than the flat one: the eager call runs)."""
        m, k = x.shape
        n = dy.shape[1]
        groups = offsets.shape[0]
        shape = (groups, n, k)
        if m == 0 or n == 0 or k == 0 or groups == 0:
            return shape, x.dtype, x.device, False, None
        tma = large_w._tma_layout_reason(x, dy) is None
        flat, cfg, grid = large_w._launch_plan(x, dy, groups, tma, False, None)
        if not flat:
            return shape, x.dtype, x.device, False, False
        bound = BoundLaunch(large_w._wgrad_flat_kernel, grid, (m, n, k, groups, grid[0]),
                            cfg, self.batch)
        return shape, x.dtype, x.device, bool(cfg["USE_TMA"]), bound
