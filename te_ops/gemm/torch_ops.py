"""``torch.library`` custom ops that te_ops traces instead of calling torch directly.

Only used while ``torch.compile`` traces a te_ops block (:func:`te_ops.tracing.tracing`); eager calls go
straight to torch (a custom-op call costs host time, ~0.2 ms per call measured on the H200).

``te_ops::grouped_mm``
    ``torch._grouped_mm(a, b, offs=offs)`` with te_ops' own fake kernel. torch 2.13's fake /
    meta kernel for ``_grouped_mm`` accepts bfloat16 only on CPU, although the CPU kernel runs
    float32 and float16 too; the fake here computes the shape for every dtype:
    ``a`` (M, K) x ``b`` (G, K, N) -> (M, N); ``a`` (K, M) x ``b`` (M, N) -> (G, K, N), ``G`` =
    ``offs.shape[0]``. Output dtype = ``a.dtype``, fresh storage (no alias of an input).
``te_ops::grouped_mm_loop``
    The loop backend (one ``torch.mm`` per group) with device split sizes: the op copies the
    (G,) sizes to the host when it runs (a sync, as the eager loop backend), so a trace never
    reads device values. ``kind`` is ``"fprop"`` (x, weights), ``"dgrad"`` (dy, weights) or
    ``"wgrad"`` (x, dy); shapes as in :mod:`te_ops.gemm.dispatch`.
``te_ops::grouped_mm_loop_host``
    The same with host split sizes as a ``SymInt[]`` (no sync; one graph for every
    distribution once the sizes are symbolic).
"""

from __future__ import annotations

import torch

from ..tracing import tracing

__all__ = ["LOOP_GEMMS", "grouped_mm", "grouped_mm_loop", "grouped_mm_loop_host", "loop_dgrad",
           "loop_fprop", "loop_wgrad"]


@torch.library.custom_op("te_ops::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


@_grouped_mm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if a.dim() == 2 and b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[2])
    if a.dim() == 2 and b.dim() == 2:
        return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])
    raise RuntimeError(
        f"te_ops::grouped_mm: expected (2-D, 3-D) or (2-D, 2-D) operands, got {a.dim()}-D and "
        f"{b.dim()}-D"
    )


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)``; through ``te_ops::grouped_mm`` while tracing."""
    if tracing():
        return _grouped_mm_op(a, b, offs)
    return torch._grouped_mm(a, b, offs=offs)


@torch.library.custom_op("te_ops::grouped_mm_loop", mutates_args=())
def grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, split_sizes: torch.Tensor,
                    kind: str) -> torch.Tensor:
    return LOOP_GEMMS[kind](a, b, [int(v) for v in split_sizes.tolist()])


@grouped_mm_loop.register_fake
def _(a: torch.Tensor, b: torch.Tensor, split_sizes: torch.Tensor, kind: str) -> torch.Tensor:
    return _loop_fake(a, b, split_sizes.shape[0], kind)


def _loop_fake(a: torch.Tensor, b: torch.Tensor, num_groups: int, kind: str) -> torch.Tensor:
    if kind == "fprop":
        return a.new_empty(a.shape[0], b.shape[1])
    if kind == "dgrad":
        return a.new_empty(a.shape[0], b.shape[2])
    if kind == "wgrad":
        return a.new_empty(num_groups, b.shape[1], a.shape[1])
    raise ValueError(f"kind must be 'fprop', 'dgrad' or 'wgrad', got {kind!r}")


@torch.library.custom_op("te_ops::grouped_mm_loop_host", mutates_args=())
def grouped_mm_loop_host(a: torch.Tensor, b: torch.Tensor, sizes: list[int],
                         kind: str) -> torch.Tensor:
    return LOOP_GEMMS[kind](a, b, list(sizes))


@grouped_mm_loop_host.register_fake
def _(a: torch.Tensor, b: torch.Tensor, sizes: list[int], kind: str) -> torch.Tensor:
    return _loop_fake(a, b, len(sizes), kind)


def loop_fprop(x: torch.Tensor, weights: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """x (M, K), weights (G, N, K), host sizes -> (M, N), one ``torch.mm`` per group."""
    out = x.new_zeros(x.shape[0], weights.shape[1])
    start = 0
    for g, m in enumerate(sizes):
        if m:
            torch.mm(x[start:start + m], weights[g].t(), out=out[start:start + m])
        start += m
    return out


def loop_dgrad(dy: torch.Tensor, weights: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """dy (M, N), weights (G, N, K), host sizes -> (M, K)."""
    out = dy.new_zeros(dy.shape[0], weights.shape[2])
    start = 0
    for g, m in enumerate(sizes):
        if m:
            torch.mm(dy[start:start + m], weights[g], out=out[start:start + m])
        start += m
    return out


def loop_wgrad(x: torch.Tensor, dy: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """x (M, K), dy (M, N), host sizes -> (G, N, K)."""
    out = x.new_zeros(len(sizes), dy.shape[1], x.shape[1])
    start = 0
    for g, m in enumerate(sizes):
        if m:
            torch.mm(dy[start:start + m].t(), x[start:start + m], out=out[g])
        start += m
    return out


LOOP_GEMMS = {"fprop": loop_fprop, "dgrad": loop_dgrad, "wgrad": loop_wgrad}
