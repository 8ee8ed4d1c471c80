"""Activation checkpointing that keeps the ``te_ops.autocast`` recipe for the recomputation.

``torch.utils.checkpoint.checkpoint`` re-runs the forward during backward, outside any
``te_ops.autocast`` block (it restores torch's autocast and RNG state, not te_ops'). Under a
low-precision recipe the recomputed forward would then run in high precision: with
``use_reentrant=False`` torch raises ``CheckpointError`` (a different number of tensors saved),
with ``use_reentrant=True`` (Megatron's checkpointing is reentrant) backward silently computes
the gradients of the unquantized block. :func:`checkpoint` runs both the forward and the
recomputation under the recipe that was active at the call, as TransformerEngine's own
``checkpoint`` restores its FP8 state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

from .quantization.autocast import autocast, current_recipe

__all__ = ["checkpoint"]


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
