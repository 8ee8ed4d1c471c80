"""Token routing helpers: sort (token, expert) pairs by expert for a grouped expert block, and
add the expert outputs back in token order.

Both functions use only fixed-shape device ops (a stable ``argsort``, a ``scatter_add_`` count,
gathers and ``index_add_``): no host sync, no data-dependent shape. They run with every tensor
on the ``meta`` device, inside CUDA graphs and under ``torch.compile(fullgraph=True)``.

Typical use with a top-k router and a te_ops grouped MLP ``experts``::

    routed = te_ops.permute(tokens, top_k_index, top_k_weights, num_experts)
    y = experts(routed.x, routed.split_sizes, routed.probs, routed.split_sizes)
    out = te_ops.unpermute(y, routed.token_index, tokens.shape[0])
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["PermutedTokens", "permute", "unpermute"]


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
    top_k = top_k_index.shape[1]
    expert_ids = top_k_index.reshape(-1).long()  # pair i belongs to token i // top_k
    # ids outside [0, num_experts) (e.g. a -1 "dropped" sentinel) sort last, as padding rows
    outside = (expert_ids < 0) | (expert_ids >= num_experts)
    order = torch.argsort(torch.where(outside, num_experts, expert_ids), stable=True)
    token_index = order // top_k
    probs = None if top_k_weights is None else top_k_weights.reshape(-1)[order]
    return PermutedTokens(x[token_index], tokens_per_expert(expert_ids, num_experts), probs,
                          token_index)


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
