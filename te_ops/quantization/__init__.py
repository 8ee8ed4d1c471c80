"""Low precision: recipes, quantizers, quantized storage, quantize kernels and the scaled
grouped GEMMs (see docs/recipes.md).

``gemm/dispatch.py`` sends :class:`QuantizedTensorStorage` operands to
:mod:`te_ops.quantization.gemm`; ops ask the recipe for quantizers through
:func:`quantize_operand` and never branch on the format.
"""

from __future__ import annotations

from . import recipe
from .autocast import autocast, current_recipe, quantize_operand
from .quantizer import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    QuantizedTensorStorage,
    Quantizer,
)
from .recipe import Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, Recipe

__all__ = [
    "Float8BlockQuantizer",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Float8CurrentScalingQuantizer",
    "MXFP8BlockScaling",
    "MXFP8Quantizer",
    "QuantizedTensorStorage",
    "Quantizer",
    "Recipe",
    "autocast",
    "current_recipe",
    "quantize_operand",
    "recipe",
]
