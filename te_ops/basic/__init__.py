"""Basic operations: each owns its parameters and one saved-context layout."""

from .bias import Bias
from .ep import AllToAllCombine, AllToAllDispatch
from .grouped_linear import GroupedLinear, GroupedLinearSaved
from .identity import Identity
from .moe import Combine, Permute, Router
from .swiglu import ScaledSwiGLU, SwiGLU, SwiGLUSaved

__all__ = [
    "AllToAllCombine",
    "AllToAllDispatch",
    "Bias",
    "Combine",
    "GroupedLinear",
    "GroupedLinearSaved",
    "Identity",
    "Permute",
    "Router",
    "ScaledSwiGLU",
    "SwiGLU",
    "SwiGLUSaved",
]
