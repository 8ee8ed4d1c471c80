"""Fused operations and their registration with the fuser (importing registers them)."""

from .grouped_mlp import (
    BackwardGroupedMLP,
    ForwardGroupedMLP,
    grouped_mlp_unsupported_reason,
)

__all__ = ["BackwardGroupedMLP", "ForwardGroupedMLP", "grouped_mlp_unsupported_reason"]
