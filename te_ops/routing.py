"""Token routing: sort (token, expert) pairs by expert for a grouped expert block, and add the
expert outputs back in token order.

This module owns the routing math: :func:`sort_by_expert` (the row order, dropless or with a
per-expert capacity), :func:`pick` / :func:`pick_sum` (the masked gathers every routing
direction uses) and :func:`tokens_per_expert`; the functional :func:`permute` /
:func:`unpermute` and the MoE layer's ``Permute`` / ``Combine`` ops (``te_ops/basic/moe.py``)
are built on them.

Everything uses only fixed-shape device ops (stable ``argsort``, ``scatter`` / ``scatter_add_``,
gathers, ``index_add_``): no host sync, no data-dependent shape. They run with every tensor
on the ``meta`` device, inside CUDA graphs and under ``torch.compile(fullgraph=True)``.

Typical use with a top-k router and a te_ops grouped MLP ``experts``::

    routed = te_ops.permute(tokens, top_k_index, top_k_weights, num_experts)
    y = experts(routed.x, routed.split_sizes, routed.probs, routed.split_sizes)
    out = te_ops.unpermute(y, routed.token_index, tokens.shape[0])
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .kernels import gather_triton

__all__ = ["DROP_POLICIES", "ExpertOrder", "PermutedTokens", "capacity_per_expert", "permute",
           "pick", "pick_sum", "sort_by_expert", "tokens_per_expert", "unpermute"]

#: How tokens past an expert's capacity are chosen (Megatron-Core ``moe_token_drop_policy``):
#: ``"probs"`` keeps each expert's highest-weight pairs, ``"position"`` its earliest tokens.
DROP_POLICIES = ("probs", "position")


class PermutedTokens(NamedTuple):
    """The result of :func:`permute` (``S = tokens * top_k`` rows).

    Attributes
    ----------
    x : torch.Tensor
        (S, hidden): the token rows, sorted by expert (stable: within an expert, in order of
        token, then of top-k slot). Rows routed to an id outside ``[0, num_experts)`` come
        last.
    split_sizes : torch.Tensor
        (num_experts,) int64 on x's device: rows per expert (zero for idle experts). Sums to
        ``S`` minus the rows routed to ids outside ``[0, num_experts)`` (padding rows for
        te_ops).
    probs : torch.Tensor
        (S,): the routing weight of each sorted row, in ``top_k_weights``' dtype.
    token_index : torch.Tensor
        (S,) int64: the token each sorted row came from (pass it to :func:`unpermute`).
    """

    x: torch.Tensor
    split_sizes: torch.Tensor
    probs: torch.Tensor
    token_index: torch.Tensor


def _check_tensors(**named: object) -> None:
    """``TypeError`` naming the first argument that is not a tensor (``None`` skipped only
    for ``top_k_weights``, which may be ``None``)."""
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) and not (name == "top_k_weights" and t is None):
            expected = "a torch.Tensor or None" if name == "top_k_weights" else "a torch.Tensor"
            raise TypeError(f"{name} must be {expected}, got {type(t).__name__}")


def _check(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor | None,
           num_experts: int) -> None:
    _check_tensors(x=x, top_k_index=top_k_index, top_k_weights=top_k_weights)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if x.dim() != 2:
        raise ValueError(f"x must have shape (tokens, hidden), got {tuple(x.shape)}")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != x.shape[0]:
        raise ValueError(f"top_k_index must have shape ({x.shape[0]}, top_k), got "
                         f"{tuple(top_k_index.shape)}")
    if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
        raise TypeError(f"top_k_index must have an integer dtype, got {top_k_index.dtype}")
    if top_k_weights is not None:
        if tuple(top_k_weights.shape) != tuple(top_k_index.shape):
            raise ValueError(f"top_k_weights must have top_k_index's shape "
                             f"{tuple(top_k_index.shape)}, got {tuple(top_k_weights.shape)}")
        if not top_k_weights.is_floating_point():
            raise TypeError(f"top_k_weights must have a floating-point dtype, got "
                            f"{top_k_weights.dtype}")
    for name, t in (("top_k_index", top_k_index), ("top_k_weights", top_k_weights)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")


def tokens_per_expert(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert, (num_experts,) int64, from flat expert ids (S,), with no host sync.

    A ``scatter_add_`` into ``num_experts`` zeros (``bincount`` reads the largest id on the host
    on CUDA and has a data-dependent size). Ids outside ``[0, num_experts)`` are not counted.
    """
    ids = expert_ids.long()
    valid = ((ids >= 0) & (ids < num_experts)).long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, ids.clamp(0, num_experts - 1), valid)


class ExpertOrder(NamedTuple):
    """Where each (token, top-k slot) pair goes: the result of :func:`sort_by_expert`.

    ``T`` tokens, ``k`` = top_k, ``S = T * k`` pairs (pair ``p`` is token ``p // k``'s slot
    ``p % k``), ``R`` rows: ``S`` dropless, ``num_experts * capacity`` with a capacity.

    Attributes
    ----------
    pair_index : torch.Tensor
        (R,) int64: the pair each row holds; ``S`` for an empty row (an expert below capacity).
    row_index : torch.Tensor
        (T, k) int64: the row each pair went to; ``R`` for a pair dropped past capacity.
    split_sizes : torch.Tensor
        (num_experts,) int64: rows per expert (dropless: the pairs routed to it, ids outside
        ``[0, num_experts)`` not counted, their rows last; capacity: ``capacity`` each).
    tokens_per_expert : torch.Tensor
        (num_experts,) int64: pairs routed to each expert, before any drop.
    dropped : torch.Tensor
        () int64: pairs dropped past capacity (zero dropless).
    """

    pair_index: torch.Tensor
    row_index: torch.Tensor
    split_sizes: torch.Tensor
    tokens_per_expert: torch.Tensor
    dropped: torch.Tensor


def capacity_per_expert(num_tokens: int, top_k: int, num_experts: int,
                        capacity_factor: float) -> int:
    """Rows per expert in capacity mode: ``ceil(capacity_factor * num_tokens * top_k /
    num_experts)`` (Megatron-Core ``get_capacity``; GShard / Switch "expert capacity"), at
    least 1. Depends on shapes only, so every routing of a batch gets the same static shape."""
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def sort_by_expert(top_k_index: torch.Tensor, num_experts: int, *,
                   capacity: int | None = None, top_k_weights: torch.Tensor | None = None,
                   drop_policy: str = "probs") -> ExpertOrder:
    """The row order of a grouped expert block for ``top_k_index``'s routing.

    Dropless (``capacity=None``): pairs sorted by expert, stable (within an expert in pair
    order), ``R = S`` rows; ids outside ``[0, num_experts)`` sort last as padding rows.
    With ``capacity``: expert ``e`` owns rows ``[e * capacity, (e + 1) * capacity)``; its pairs
    fill them in the ``drop_policy`` order (``"probs"``: highest ``top_k_weights`` first, ties
    in pair order; ``"position"``: pair order), the rest are dropped (``row_index == R``);
    rows left empty have ``pair_index == S``.

    Parameters
    ----------
    top_k_index : torch.Tensor
        (T, k) integer expert ids.
    num_experts : int
    capacity : int or None
        Rows per expert (see :func:`capacity_per_expert`); ``None``: dropless.
    top_k_weights : torch.Tensor or None
        (T, k) float weights; needed by ``drop_policy="probs"`` with a capacity.
    drop_policy : str
        One of :data:`DROP_POLICIES`.

    Returns
    -------
    ExpertOrder

    Raises
    ------
    ValueError
        Bad ``capacity``, ``drop_policy``, or ``"probs"`` without ``top_k_weights``; capacity
        mode with ids outside ``[0, num_experts)`` is not checked (no host read): such pairs
        are dropped (and counted in ``dropped``).
    """
    num_tokens, top_k = top_k_index.shape
    pairs = num_tokens * top_k
    ids = top_k_index.reshape(-1).long()
    counts = tokens_per_expert(ids, num_experts)
    device = ids.device
    if capacity is None:
        # ids outside [0, num_experts) (e.g. a -1 "dropped" sentinel) sort last, as padding rows
        outside = (ids < 0) | (ids >= num_experts)
        order = torch.argsort(torch.where(outside, num_experts, ids), stable=True)
        rows = torch.arange(pairs, device=device)
        row_index = torch.empty_like(order).scatter_(0, order, rows)
        return ExpertOrder(order, row_index.view(num_tokens, top_k), counts, counts,
                           torch.zeros((), dtype=torch.int64, device=device))
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive int or None, got {capacity!r}")
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
    valid = (ids >= 0) & (ids < num_experts)
    key = torch.where(valid, ids, num_experts)  # ids outside [0, num_experts) sort last
    if drop_policy == "probs":
        if top_k_weights is None:
            raise ValueError("top_k_weights must be given with drop_policy='probs' and a "
                             "capacity (the weights decide which pairs are kept), got None")
        first = torch.argsort(top_k_weights.reshape(-1), descending=True, stable=True)
        order = first[torch.argsort(key[first], stable=True)]
    else:
        order = torch.argsort(key, stable=True)
    sorted_ids = ids[order].clamp(0, num_experts - 1)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(pairs, device=device) - starts[sorted_ids]
    keep = valid[order] & (rank < capacity)
    num_rows = num_experts * capacity
    dest = torch.where(keep, sorted_ids * capacity + rank, num_rows)
    row_index = torch.empty_like(order).scatter_(0, order, dest)
    # dropped pairs land in one spare slot past the rows, cut off after the scatter
    pair_index = torch.full((num_rows + 1,), pairs, dtype=torch.int64, device=device)
    pair_index = pair_index.scatter_(0, dest, order)[:num_rows]
    split_sizes = torch.full((num_experts,), capacity, dtype=torch.int64, device=device)
    dropped = pairs - keep.sum()
    return ExpertOrder(pair_index, row_index.view(num_tokens, top_k), split_sizes, counts,
                       dropped)


def pick(src: torch.Tensor, index: torch.Tensor, *, masked: bool = True) -> torch.Tensor:
    """``src[index]`` where ``index`` lies in ``[0, len(src)]``; ``index == len(src)`` (an
    empty row, a dropped pair) gives zeros when ``masked`` (without it every index must be
    below ``len(src)`` and the plain gather runs: one pass instead of a gather and a
    ``where``). A gather: deterministic, unlike a scatter-add.

    Shapes: src (S, ...), index any shape -> (*index.shape, *src.shape[1:]). A masked gather of
    a 2-D ``src`` by a 1-D ``index`` on its device runs in one Triton pass on CUDA
    (:mod:`te_ops.kernels.gather_triton`, the same values; not where ``src`` needs a graph:
    the kernel has no autograd); elsewhere torch's gather and ``where``."""
    if not masked:
        return src[index]
    if index.dim() == 1 and gather_triton.unsupported_reason(src, index) is None:
        return gather_triton.gather_rows_sum(src, index)
    n = src.shape[0]
    valid = index < n
    taken = src[index.clamp(max=max(n - 1, 0))]
    return torch.where(valid.view(*valid.shape, *([1] * (src.dim() - 1))), taken,
                       taken.new_zeros(()))


def pick_sum(src: torch.Tensor, index: torch.Tensor, *, masked: bool = True) -> torch.Tensor:
    """``pick(src, index, masked=masked).sum(1)``: each output row the sum of the ``K`` rows
    its index row names (the combine of a token's top-k expert rows), in a fixed order.

    Shapes: src (S, H), index (M, K) int64 in ``[0, S]`` -> (M, H) in ``src``'s dtype. On CUDA
    (float32 / bfloat16 / float16, ``index`` on ``src``'s device, no graph through ``src``) one
    Triton pass (:mod:`te_ops.kernels.gather_triton`: fp32
    sum in ``j`` order, one rounding; an entry ``S`` adds nothing, so ``masked`` needs no
    extra pass); elsewhere torch's gather, ``where`` and ``sum`` (bf16 / fp16 summed in fp32
    as well, so the two agree to the last bit or within it)."""
    if index.dim() == 2 and gather_triton.unsupported_reason(src, index) is None:
        return gather_triton.gather_rows_sum(src, index)
    return pick(src, index, masked=masked).sum(1)


def permute(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor | None,
            num_experts: int) -> PermutedTokens:
    """Sort each token's top-k (token, expert) pairs by expert.

    Parameters
    ----------
    x : torch.Tensor
        (tokens, hidden), any dtype.
    top_k_index : torch.Tensor
        (tokens, top_k) integer expert ids in ``[0, num_experts)``; an id outside that range
        (an expert-parallel "not on this rank" id ``>= num_experts``, or a ``-1`` "dropped"
        sentinel) is sorted last and not counted in ``split_sizes``, so te_ops treats its row
        as padding (zero output and gradient).
    top_k_weights : torch.Tensor or None
        (tokens, top_k) float routing weights; ``None`` gives ``probs=None``.
    num_experts : int
        Number of experts (length of ``split_sizes``).

    Returns
    -------
    PermutedTokens
        ``(x (S, hidden), split_sizes (E,) int64, probs (S,), token_index (S,) int64)`` with
        ``S = tokens * top_k``; all on x's device. Gradients flow to ``x`` and
        ``top_k_weights`` through the gathers.

    Raises
    ------
    ValueError, TypeError
        Shapes, dtypes or devices that do not fit, or an argument that is not a tensor; the
        message names the argument.
    """
    _check(x, top_k_index, top_k_weights, num_experts)
    order = sort_by_expert(top_k_index, num_experts)
    token_index = order.pair_index // top_k_index.shape[1]
    probs = None if top_k_weights is None else top_k_weights.reshape(-1)[order.pair_index]
    return PermutedTokens(x[token_index], order.split_sizes, probs, token_index)


def unpermute(y: torch.Tensor, token_index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sum expert outputs back into token order: ``out[token_index[i]] += y[i]``.

    Parameters
    ----------
    y : torch.Tensor
        (S, hidden): expert outputs in :func:`permute`'s row order (routing weights already
        applied, e.g. by ``ScaledSwiGLU``).
    token_index : torch.Tensor
        (S,) int64, :attr:`PermutedTokens.token_index`.
    num_tokens : int
        Rows of the output.

    Returns
    -------
    torch.Tensor
        (num_tokens, hidden) in ``y``'s dtype; tokens with no rows are zero. Accumulates with
        ``index_add_`` in ``y``'s dtype (on CUDA the order of the adds is not deterministic).

    Raises
    ------
    ValueError
        ``y`` and ``token_index`` of different lengths, bad ``num_tokens``, or (on the CPU)
        ``num_tokens`` not above every ``token_index`` entry (on CUDA that is a device-side
        assertion of ``index_add_``).
    TypeError
        ``y`` or ``token_index`` not a tensor, or ``token_index`` not int64 / int32.
    """
    _check_tensors(y=y, token_index=token_index)
    if y.dim() != 2 or token_index.dim() != 1 or y.shape[0] != token_index.shape[0]:
        raise ValueError(f"y must have shape (S, hidden) and token_index (S,), got "
                         f"y {tuple(y.shape)} and token_index {tuple(token_index.shape)}")
    if token_index.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"token_index must have dtype torch.int64 or torch.int32, got "
                        f"{token_index.dtype}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, torch.SymInt)) or (
            num_tokens < 0):
        raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
    if (token_index.device.type == "cpu" and token_index.numel()
            and not torch.compiler.is_compiling()):  # on CUDA: index_add_'s device assertion
        low, high = int(token_index.min()), int(token_index.max())  # (no sync on the CPU)
        if low < 0 or high >= num_tokens:
            raise ValueError(
                f"num_tokens must be larger than every token_index entry (the tokens given to "
                f"permute), got num_tokens={num_tokens} and token_index in [{low}, {high}]")
    out = y.new_zeros(num_tokens, y.shape[1])
    return out.index_add_(0, token_index, y)
