"""Basic operations: each owns its parameters and one saved-context layout."""

from .bias import Bias
from .grouped_linear import GroupedLinear, GroupedLinearSaved
from .identity import Identity
from .swiglu import ScaledSwiGLU, SwiGLU, SwiGLUSaved

__all__ = [
    "Bias",
    "GroupedLinear",
    "GroupedLinearSaved",
    "Identity",
    "ScaledSwiGLU",
    "SwiGLU",
    "SwiGLUSaved",
]
