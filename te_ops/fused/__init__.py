"""Fused operations and their registration with the fuser (importing registers them).

:data:`FUSIONS` is the one ordered list of every fusion te_ops registers: within each pass
(joint, forward, backward) the fuser applies them in this order. Adding a fusion is adding a
row here (docs/architecture.md, "Adding a fusion").
"""

from __future__ import annotations

from ..fuser import register_backward_fusion, register_forward_fusion, register_joint_fusion
from .grouped_mlp import (
    BackwardGroupedMLP,
    ForwardGroupedMLP,
    fuse_grouped_mlp_backward,
    fuse_grouped_mlp_forward,
    grouped_mlp_unsupported_reason,
)

__all__ = ["FUSIONS", "BackwardGroupedMLP", "ForwardGroupedMLP",
           "grouped_mlp_unsupported_reason"]

#: (pass, fusion function, name, env toggle), in application order within each pass.
FUSIONS = (
    ("forward", fuse_grouped_mlp_forward, "grouped_mlp_forward",
     "TE_OPS_FUSE_GROUPED_MLP_FORWARD"),
    ("backward", fuse_grouped_mlp_backward, "grouped_mlp_backward",
     "TE_OPS_FUSE_GROUPED_MLP_BACKWARD"),
)

_REGISTER = {"joint": register_joint_fusion, "forward": register_forward_fusion,
             "backward": register_backward_fusion}
for _kind, _func, _name, _env_var in FUSIONS:
    _REGISTER[_kind](_func, name=_name, env_var=_env_var)
