"""Public home of the low-precision recipes (``te_ops.recipe.Float8CurrentScaling``, ...);
defined in :mod:`te_ops.quantization.recipe`."""

from __future__ import annotations

from .quantization.recipe import (
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    Recipe,
)

__all__ = ["Recipe", "Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling"]
