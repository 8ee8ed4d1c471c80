"""te_ops: an operation-fuser framework for PyTorch mixture-of-experts expert blocks."""

from . import env, fused, graphs, ir, training  # importing fused registers the fusions
from .basic import Bias, GroupedLinear, Identity, ScaledSwiGLU, SwiGLU
from .fuser import (
    OperationFuser,
    register_backward_fusion,
    register_forward_fusion,
    register_joint_fusion,
)
from .grouped_tensor import GroupedTensor, GroupedTensorStorage
from .op import BasicOperation, FusedOperation, FusibleOperation, OperationContext
from .sequential import Sequential

__all__ = [
    "Bias",
    "BasicOperation",
    "FusedOperation",
    "FusibleOperation",
    "GroupedLinear",
    "GroupedTensor",
    "GroupedTensorStorage",
    "Identity",
    "OperationContext",
    "OperationFuser",
    "ScaledSwiGLU",
    "Sequential",
    "SwiGLU",
    "env",
    "fused",
    "graphs",
    "ir",
    "register_backward_fusion",
    "register_forward_fusion",
    "register_joint_fusion",
    "training",
]

__version__ = "0.1.0"
