"""Whether te_ops runs under a ``torch.compile`` trace: the ground floor every layer may ask.

Under a trace, te_ops' kernels and GEMM backends call their ``torch.library`` custom ops
instead of launching directly (a custom-op call costs host time in eager mode, so eager calls
launch directly).
"""

from __future__ import annotations

import torch

__all__ = ["tracing"]


def tracing() -> bool:
    """Whether te_ops runs under a ``torch.compile`` trace (Dynamo, or fake/proxy tensors of
    AOTAutograd): then custom ops replace direct torch and Triton calls."""
    if torch.compiler.is_compiling():
        return True
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
