"""Low-precision recipes: which quantizer each GEMM operand gets.

A recipe is a frozen (hashable) dataclass; the fuser puts it in its plan key, so switching recipes
re-plans. Enable one with :func:`te_ops.autocast`. Roles asked for by the ops: ``"input"`` (the
activation a GroupedLinear reads), ``"weight"``, ``"grad_output"``. A role and the copy asked for
name the GEMM the operand feeds (:data:`GEMM_OF_OPERAND`), so a recipe can keep one GEMM in high
precision: its quantizer is then ``None`` and the op passes the tensor on as it is.
See docs/recipes.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from .quantizer import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    Quantizer,
)

__all__ = ["Recipe", "Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling",
           "GEMM_OF_OPERAND"]

_ROLES = ("input", "weight", "grad_output")

#: (role, copy) -> the GEMM that reads it: each GEMM reads a row-wise or column-wise copy of two
#: roles (docs/recipes.md, "Which copy each GEMM reads").
GEMM_OF_OPERAND = {
    ("input", "rowwise"): "fprop", ("weight", "rowwise"): "fprop",
    ("grad_output", "rowwise"): "dgrad", ("weight", "columnwise"): "dgrad",
    ("input", "columnwise"): "wgrad", ("grad_output", "columnwise"): "wgrad",
}
_GEMMS = ("fprop", "dgrad", "wgrad")
_BOOL_FIELDS = ("fast_accumulate_backward", *(f"{g}_high_precision" for g in _GEMMS))


@dataclass(frozen=True)
class Recipe:
    """Base class: a recipe hands out one quantizer per operand role and pass. ``format``
    names its quantizers' format (``"fp8"``, ``"mxfp8"``)."""

    format: ClassVar[str] = ""

    def quantizer(self, role: str, *, rowwise: bool, columnwise: bool) -> Quantizer | None:
        """The quantizer for ``role`` (``"input"``, ``"weight"`` or ``"grad_output"``), or
        ``None`` when every GEMM reading the requested copies runs in high precision
        (:meth:`high_precision_gemms`).

        Raises
        ------
        ValueError
            Unknown ``role``.
        """
        if role not in _ROLES:
            raise ValueError(f"role must be one of {_ROLES}, got {role!r}")
        copies = [c for c, on in (("rowwise", rowwise), ("columnwise", columnwise)) if on]
        keep = self.high_precision_gemms()
        if copies and all(GEMM_OF_OPERAND[role, c] in keep for c in copies):
            return None
        return self._make(role, rowwise=rowwise, columnwise=columnwise)

    def high_precision_gemms(self) -> frozenset[str]:
        """The GEMMs (``"fprop"``, ``"dgrad"``, ``"wgrad"``) this recipe leaves unquantized."""
        return frozenset()

    def _make(self, role: str, *, rowwise: bool, columnwise: bool) -> Quantizer:
        raise NotImplementedError


@dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """FP8 (E4M3) operands with scales from the current tensor's amax, one per row of the
    reduction axis (power-of-two fp32 scales). Forward, dgrad and wgrad each quantize along the
    dim their GEMM reduces (docs/recipes.md).

    Parameters
    ----------
    fast_accumulate_backward : bool
        Let the native dgrad and wgrad FP8 GEMMs use Hopper's fast (reduced-precision)
        accumulation, as the forward does. Default False (as TransformerEngine: backward GEMMs
        accumulate in full precision); True is faster: 1.33x bf16 against 1.20x on the H200's
        E8 H4096 FF14336 step, with the main job's loss within 0.5 % of bf16's on three seeds
        (docs/recipes.md has the numbers).
    fprop_high_precision, dgrad_high_precision, wgrad_high_precision : bool
        Run that GEMM in the parameters' precision, its operands unquantized: the three flags of
        TransformerEngine's ``override_linear_precision=(fprop, dgrad, wgrad)``. Megatron-LM's
        ``--no-fp8-wgrad`` and torchao's ``ROWWISE_WITH_GW_HP`` recipe keep wgrad in high
        precision (the gradient's scale per column over all of an expert's tokens is the
        coarsest scaling of the recipe; docs/recipes.md measures it). Default False. With
        ``wgrad_high_precision`` the input is saved for backward unquantized (no FP8
        column-wise copy).

    Raises
    ------
    TypeError
        A field is not a bool.
    """

    format: ClassVar[str] = "fp8"
    fast_accumulate_backward: bool = False
    fprop_high_precision: bool = False
    dgrad_high_precision: bool = False
    wgrad_high_precision: bool = False

    def __post_init__(self) -> None:
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"Float8CurrentScaling: {name} must be a bool, got "
                                f"{type(value).__name__} ({value!r})")

    def high_precision_gemms(self) -> frozenset[str]:
        return frozenset(g for g in _GEMMS if getattr(self, f"{g}_high_precision"))

    def _make(self, role: str, *, rowwise: bool, columnwise: bool) -> Quantizer:
        q = Float8CurrentScalingQuantizer(rowwise=rowwise, columnwise=columnwise)
        q.fast_accumulate_backward = self.fast_accumulate_backward
        return q


@dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8 per OCP Microscaling Formats v1.0: E4M3 elements, one E8M0 scale per 32 consecutive
    elements along the reduction dim."""

    format: ClassVar[str] = "mxfp8"

    def _make(self, role: str, *, rowwise: bool, columnwise: bool) -> Quantizer:
        return MXFP8Quantizer(rowwise=rowwise, columnwise=columnwise)


@dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """Blockwise FP8, DeepSeek-V3's training recipe (arXiv:2412.19437, section 3.3.2) and
    TransformerEngine's ``Float8BlockScaling`` with its defaults: E4M3 for every tensor,
    activations and output gradients in 1 x 128 tiles along the dim their GEMM reduces
    (TE's ``x_block_scaling_dim=1``, ``grad_block_scaling_dim=1``), weights in 128 x 128
    blocks (``w_block_scaling_dim=2``), one fp32 scale per tile (docs/recipes.md).

    Per GEMM: fprop reads x in 1 x 128 tiles along in_features and W's 128 x 128 blocks;
    dgrad dy in 1 x 128 tiles along out_features and the same W blocks transposed; wgrad x
    and dy in 128 x 1 tiles along each expert's tokens (tiles restart at every expert's first
    row, so none spans two experts). GEMMs accumulate every 128-element reduction block in
    fp32 with the product of the two tiles' scales.

    Parameters
    ----------
    force_pow_2_scales : bool
        Each scale ``448 / amax`` rounded down to a power of two (TE's ``power_2_scale`` of
        its ``fp8_quant_fwd_inp`` / ``fp8_quant_fwd_weight`` / ``fp8_quant_bwd_grad``,
        default True there and here); False keeps the fp32 quotient.
    amax_epsilon : float
        Lower bound of every tile's amax (TE's ``amax_epsilon``, default 0.0); finite, >= 0.

    Raises
    ------
    TypeError
        ``force_pow_2_scales`` is not a bool, or ``amax_epsilon`` not a real number.
    ValueError
        ``amax_epsilon`` is negative or not finite.
    """

    format: ClassVar[str] = "fp8_block"
    force_pow_2_scales: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.force_pow_2_scales, bool):
            raise TypeError("Float8BlockScaling: force_pow_2_scales must be a bool, got "
                            f"{type(self.force_pow_2_scales).__name__} "
                            f"({self.force_pow_2_scales!r})")
        eps = self.amax_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise TypeError(f"Float8BlockScaling: amax_epsilon must be a float, got "
                            f"{type(eps).__name__} ({eps!r})")
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"Float8BlockScaling: amax_epsilon must be finite and >= 0, got "
                             f"{eps!r}")
        object.__setattr__(self, "amax_epsilon", float(eps))

    def _make(self, role: str, *, rowwise: bool, columnwise: bool) -> Quantizer:
        return Float8BlockQuantizer(rowwise=rowwise, columnwise=columnwise,
                                    block_dim=2 if role == "weight" else 1,
                                    force_pow_2_scales=self.force_pow_2_scales,
                                    amax_epsilon=self.amax_epsilon)
