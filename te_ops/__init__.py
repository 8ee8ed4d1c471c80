"""te_ops: an operation-fuser framework for PyTorch mixture-of-experts expert blocks."""

from . import (  # importing fused registers the fusions
    env,
    fused,
    graphs,
    ir,
    quantization,
    recipe,
    training,
)
from .activation_checkpoint import checkpoint, checkpoint_context_fn
from .basic import (
    AllToAllCombine,
    AllToAllDispatch,
    Bias,
    Combine,
    GroupedLinear,
    Identity,
    Permute,
    Router,
    ScaledSwiGLU,
    SwiGLU,
)
from .compile import compile_unsupported_reason
from .fuser import (
    OperationFuser,
    register_backward_fusion,
    register_forward_fusion,
    register_joint_fusion,
)
from .grouped_tensor import GroupedTensor, GroupedTensorStorage
from .moe import MoE
from .op import BasicOperation, FusedOperation, FusibleOperation, OperationContext
from .quantization import autocast
from .routing import PermutedTokens, permute, unpermute
from .sequential import Sequential

__all__ = [
    "AllToAllCombine",
    "AllToAllDispatch",
    "Bias",
    "Combine",
    "BasicOperation",
    "FusedOperation",
    "FusibleOperation",
    "GroupedLinear",
    "GroupedTensor",
    "GroupedTensorStorage",
    "Identity",
    "MoE",
    "OperationContext",
    "OperationFuser",
    "Permute",
    "PermutedTokens",
    "Router",
    "ScaledSwiGLU",
    "Sequential",
    "SwiGLU",
    "autocast",
    "checkpoint",
    "checkpoint_context_fn",
    "compile_unsupported_reason",
    "env",
    "fused",
    "graphs",
    "ir",
    "quantization",
    "recipe",
    "permute",
    "register_backward_fusion",
    "register_forward_fusion",
    "register_joint_fusion",
    "training",
    "unpermute",
]

__version__ = "0.1.0"
