"""Fused operations; importing this package registers them with the fuser.

Each fused module registers its own fusion functions at its end
(``register_forward_fusion(...)`` / ``register_backward_fusion(...)`` /
``register_joint_fusion(...)`` of :mod:`te_ops.fuser`); the import lines below, one per
module, are the registration order, and so the order in which the fuser applies them within
each pass (docs/architecture.md, "Adding a fusion"). :data:`FUSIONS` lists what they
registered: (pass, fusion function, name; ``TE_OPS_FUSION_OFF`` takes the names).
"""

from __future__ import annotations

from ..fuser import registered_fusions
from .grouped_mlp import (
    BackwardGroupedMLP,
    ForwardGroupedMLP,
    grouped_mlp_unsupported_reason,
)
from .moe_routing import BackwardFC2Combine, ForwardPermuteFC1  # after grouped_mlp: it extends

__all__ = ["FUSIONS", "BackwardFC2Combine", "BackwardGroupedMLP", "ForwardGroupedMLP",
           "ForwardPermuteFC1", "grouped_mlp_unsupported_reason"]

#: (pass, fusion function, name), in application order within each pass.
FUSIONS = tuple((f.kind, f.func, f.name) for f in registered_fusions())
