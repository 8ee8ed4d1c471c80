"""Activation checkpointing that keeps the ``te_ops.autocast`` recipe for the recomputation.

``torch.utils.checkpoint.checkpoint`` re-runs the forward during backward, outside any
``te_ops.autocast`` block (it restores torch's autocast and RNG state, not te_ops'). Under a
low-precision recipe the recomputed forward would then run in high precision: with
``use_reentrant=False`` torch raises ``CheckpointError`` (a different number of tensors saved),
with ``use_reentrant=True`` (Megatron's checkpointing is reentrant) backward would compute the
gradients of the unquantized block: :func:`check_recomputation` (called by every eager te_ops
call) raises instead, naming :func:`checkpoint`. :func:`checkpoint` runs both the forward and the
recomputation under the recipe that was active at the call, as TransformerEngine's own
``checkpoint`` restores its FP8 state. Where the checkpoint call belongs to someone else (Hugging
Face's ``activation_checkpointing_enable``, non-reentrant), pass :func:`checkpoint_context_fn`
as its ``context_fn``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
import torch.utils.checkpoint

from .quantization.autocast import autocast, current_recipe

__all__ = ["check_recomputation", "checkpoint", "checkpoint_context_fn"]

_FORWARD_RECIPE = "_te_ops_forward_recipe"  # in the block's __dict__: its last forward's recipe


def check_recomputation(block: Any, recipe: Any) -> None:
    """Remember the recipe of a forward that runs outside backward; refuse a forward that runs
    inside backward (an activation checkpoint's recomputation) without a recipe when the
    block's last forward had one.

    ``torch.utils.checkpoint`` restores torch's autocast and RNG state, not
    ``te_ops.autocast``'s recipe: its recomputation runs in the parameters' precision and, with
    ``use_reentrant=True``, backward would give the unquantized block's gradients with no error.

    Parameters
    ----------
    block : object
        The te_ops block being called (its ``__dict__`` keeps the recipe).
    recipe : Recipe or None
        The recipe this call runs with (``te_ops.autocast``'s or the call's own).

    Raises
    ------
    RuntimeError
        A recomputation without a recipe of a forward that ran under one.
    """
    if torch._C._current_graph_task_id() == -1:  # not inside a backward
        block.__dict__[_FORWARD_RECIPE] = recipe
        return
    first = block.__dict__.get(_FORWARD_RECIPE)
    if first is not None and recipe is None:
        raise RuntimeError(
            f"te_ops: a forward is being recomputed during backward (activation checkpointing) "
            f"without te_ops.autocast, but it first ran under te_ops.autocast(recipe="
            f"{type(first).__name__}()); torch.utils.checkpoint does not restore te_ops' recipe, "
            "so the gradients would be the unquantized block's. Use te_ops.checkpoint(function, "
            "*args, use_reentrant=...) instead, or pass context_fn=te_ops.checkpoint_context_fn "
            "to torch.utils.checkpoint.checkpoint(..., use_reentrant=False)")


def checkpoint(function: Callable[..., Any], *args: Any, use_reentrant: bool = False,
               **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, ...)`` with the current
    ``te_ops.autocast`` recipe (or none) re-entered around the recomputation.

    Parameters
    ----------
    function : callable
        E.g. a ``te_ops.Sequential`` block or a model layer holding one.
    *args, **kwargs
        Passed to ``torch.utils.checkpoint.checkpoint`` (``use_reentrant`` defaults to False,
        as torch recommends; both modes keep the recipe).

    Returns
    -------
    What ``function(*args)`` returns; gradients equal those of the uncheckpointed call under
    the same recipe, bit for bit.
    """
    if torch.compiler.is_compiling():
        # Dynamo traces the checkpointed region once (the recomputation is part of the compiled
        # graph, planned under the recipe of the trace), and cannot trace the ContextVar.
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant,
                                                 **kwargs)
    recipe = current_recipe()

    def run(*inner: Any, **inner_kwargs: Any) -> Any:
        with autocast(enabled=recipe is not None, recipe=recipe):
            return function(*inner, **inner_kwargs)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=use_reentrant, **kwargs)


class _RecipeContext:
    """Re-enterable ``te_ops.autocast(recipe)`` (``None``: recipe off)."""

    def __init__(self, recipe: Any) -> None:
        self.recipe = recipe
        self._open: list[Any] = []

    def __enter__(self) -> None:
        cm = autocast(enabled=self.recipe is not None, recipe=self.recipe)
        cm.__enter__()
        self._open.append(cm)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool | None:
        return self._open.pop().__exit__(exc_type, exc, tb)


def checkpoint_context_fn() -> tuple[contextlib.AbstractContextManager,
                                     contextlib.AbstractContextManager]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``:
    torch calls it at each checkpointed forward; it returns (no-op forward context, the
    ``te_ops.autocast`` recipe active at that call for the recomputation).

    Example: ``model.activation_checkpointing_enable(activation_checkpointing_kwargs={
    "use_reentrant": False, "context_fn": te_ops.checkpoint_context_fn})`` (transformers 5).
    """
    return contextlib.nullcontext(), _RecipeContext(current_recipe())
