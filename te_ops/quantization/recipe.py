"""Low-precision recipes: which quantizer each GEMM operand gets.

A recipe is a frozen (hashable) dataclass; the fuser puts it in its plan key, so switching recipes
re-plans. Enable one with :func:`te_ops.autocast`. Roles asked for by the ops: ``"input"`` (the
activation a GroupedLinear reads), ``"weight"``, ``"grad_output"``. See docs/recipes.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from .quantizer import Float8CurrentScalingQuantizer, MXFP8Quantizer, Quantizer

__all__ = ["Recipe", "Float8CurrentScaling", "MXFP8BlockScaling"]

_ROLES = ("input", "weight", "grad_output")


@dataclass(frozen=True)
class Recipe:
    """Base class: a recipe hands out one quantizer per operand role and pass."""

    def quantizer(self, role: str, *, rowwise: bool, columnwise: bool) -> Quantizer:
        """The quantizer for ``role`` (``"input"``, ``"weight"`` or ``"grad_output"``).

        Raises
        ------
        ValueError
            Unknown ``role``.
        """
        if role not in _ROLES:
            raise ValueError(f"role must be one of {_ROLES}, got {role!r}")
        return self._make(rowwise=rowwise, columnwise=columnwise)

    def _make(self, *, rowwise: bool, columnwise: bool) -> Quantizer:
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
        accumulate in full precision); True is faster (docs/recipes.md has the numbers).
    """

    fast_accumulate_backward: bool = False

    def __post_init__(self) -> None:
        flag = self.fast_accumulate_backward
        if not isinstance(flag, (bool, int)):
            raise TypeError("fast_accumulate_backward must be a bool, got "
                            f"{type(flag).__name__} ({flag!r})")
        object.__setattr__(self, "fast_accumulate_backward", bool(flag))

    def _make(self, *, rowwise: bool, columnwise: bool) -> Quantizer:
        q = Float8CurrentScalingQuantizer(rowwise=rowwise, columnwise=columnwise)
        q.fast_accumulate_backward = self.fast_accumulate_backward
        return q


@dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8 per OCP Microscaling Formats v1.0: E4M3 elements, one E8M0 scale per 32 consecutive
    elements along the reduction dim."""

    def _make(self, *, rowwise: bool, columnwise: bool) -> Quantizer:
        return MXFP8Quantizer(rowwise=rowwise, columnwise=columnwise)
