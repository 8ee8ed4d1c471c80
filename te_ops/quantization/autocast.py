"""``te_ops.autocast``: the context manager that turns a recipe on for the ops run inside it."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .recipe import Float8CurrentScaling, Recipe

__all__ = ["autocast", "current_recipe", "quantize_operand", "swiglu_output_operand"]

_RECIPE: contextvars.ContextVar[Recipe | None] = contextvars.ContextVar("te_ops_recipe",
                                                                        default=None)

#: The enabled recipes of the open ``autocast`` blocks, innermost last (a plain list that
#: torch.compile can read and guard; the ContextVar above is the source of truth).
ACTIVE: list[Recipe | None] = []


@contextmanager
def autocast(enabled: bool = True, recipe: Recipe | None = None) -> Iterator[None]:
    """Run te_ops blocks with a low-precision recipe (as TransformerEngine's ``autocast``).

    The fuser reads the recipe when it plans a call (it is part of the plan key); the backward
    uses the recipe the forward ran with, wherever ``backward()`` is called.

    Parameters
    ----------
    enabled : bool
        False runs in the parameters' precision (and switches off an enclosing autocast).
    recipe : Recipe, optional
        Default :class:`~te_ops.recipe.Float8CurrentScaling`.

    Raises
    ------
    TypeError
        ``recipe`` is not a :class:`~te_ops.recipe.Recipe`.
    """
    if not isinstance(enabled, bool):
        hint = " (pass a recipe by keyword: autocast(recipe=...))" * isinstance(enabled, Recipe)
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__} ({enabled!r})"
                        f"{hint}")
    if recipe is None:
        recipe = Float8CurrentScaling()
    if not isinstance(recipe, Recipe) or type(recipe) is Recipe:
        got = "the abstract base Recipe" if type(recipe) is Recipe else type(recipe).__name__
        raise TypeError(f"recipe must be a te_ops.recipe.Recipe, got {got} (pass an "
                        "instance such as Float8CurrentScaling() or MXFP8BlockScaling())")
    if torch.compiler.is_compiling():  # Dynamo cannot trace the ContextVar below
        torch._dynamo.graph_break(msg=(
            "te_ops.autocast inside a torch.compile'd function: enter te_ops.autocast outside "
            "the compiled function (te_ops calls inside read its recipe at trace time), or "
            "compile without fullgraph=True to run the autocast block eagerly"))
    token = _RECIPE.set(recipe if enabled else None)
    ACTIVE.append(recipe if enabled else None)
    try:
        yield
    finally:
        ACTIVE.pop()
        _RECIPE.reset(token)


def current_recipe() -> Recipe | None:
    """The recipe of the innermost enabled :func:`autocast`, else ``None``."""
    return _RECIPE.get()


def check_operand_dtype(recipe: Recipe, role: str, tensor: Any) -> None:
    """Raise ``TypeError`` (naming ``role``, its dtype and the fix) when ``recipe`` cannot
    quantize ``tensor``: only float32 and bfloat16 tensors are taken."""
    dtype = getattr(tensor, "dtype", None)
    if isinstance(tensor, torch.Tensor) and dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"te_ops.autocast(recipe={type(recipe).__name__}()) needs float32 or "
                        f"bfloat16 parameters and inputs ({role} is {dtype}): cast the block "
                        "and its input with .to(torch.bfloat16) or .to(torch.float32)")


def quantize_operand(recipe: Recipe | None, role: str, tensor: Any, splits: Any = None, *,
                     rowwise: bool = False, columnwise: bool = False, **options: Any) -> Any:
    """``tensor`` quantized by ``recipe``'s quantizer for ``role`` (``tensor`` itself without a
    recipe, or when the recipe keeps the GEMM reading this copy in high precision). The ops
    call this and never look at the recipe's format. ``options`` go to the quantizer's call
    (``columnwise_amax``, ``record_columnwise_amax``: :class:`~te_ops.quantization.Quantizer`)."""
    if recipe is None:
        return tensor
    check_operand_dtype(recipe, role, tensor)
    quantizer = recipe.quantizer(role, rowwise=rowwise, columnwise=columnwise)
    return tensor if quantizer is None else quantizer(tensor, splits, **options)


def swiglu_output_operand(recipe: Recipe | None, h2d: torch.Tensor,
                          probs: torch.Tensor | None) -> Any:
    """fprop's row-wise operand of ``SiLU(h2d[:, :F]) * h2d[:, F:] (* probs[:, None])`` made
    straight from the activation's input (h2d (rows, 2F), probs (rows,)) where ``recipe``'s
    quantizer has a kernel for it (FP8 current scaling on CUDA: ``fp8_swiglu``); the same
    storage and bytes as :func:`quantize_operand` on the activation output gives. ``None``
    without a recipe, where fprop runs in high precision, or where no such kernel applies
    (then the caller runs the activation and quantizes its output)."""
    if recipe is None:
        return None
    check_operand_dtype(recipe, "input", h2d)
    quantizer = recipe.quantizer("input", rowwise=True, columnwise=False)
    return None if quantizer is None else quantizer.quantize_swiglu_rows(h2d, probs)
