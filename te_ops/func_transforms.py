"""The error for a block called under a ``torch.func`` transform.

The fuser runs as one ``torch.autograd.Function`` without a ``setup_context`` / functorch
rule, so ``torch.func.grad`` (and ``vjp``, ``jacrev``, ``hessian``), ``jvp`` (``jacfwd``),
``vmap`` and ``functionalize`` cannot run it; torch's own error names ``setup_context`` but
neither te_ops nor a way out. (``torch.compile`` is not affected: its AOTAutograd
functionalizes through a tensor mode, not this transform stack.)
"""

from __future__ import annotations

import torch

__all__ = ["check_no_func_transform"]

_REFUSED = {"Grad": "grad", "Jvp": "jvp", "Vmap": "vmap", "Functionalize": "functionalize"}


def check_no_func_transform() -> None:
    """Raise where a ``torch.func`` transform (grad, jvp, vmap, functionalize) is active.

    Raises
    ------
    RuntimeError
        Naming the active transforms and the supported route: ``torch.func.functional_call``
        without a transform, gradients by ``torch.autograd.grad`` or ``backward()``.
    """
    stack = torch._C._functorch.get_interpreter_stack() or []
    active = [_REFUSED[i.key().name] for i in stack if i.key().name in _REFUSED]
    if active:
        names = ", ".join(f"torch.func.{n}" for n in dict.fromkeys(active))
        raise RuntimeError(
            f"te_ops blocks do not run under torch.func transforms (active: {names}; grad "
            "also stands for vjp / jacrev / hessian, jvp for jacfwd): the fuser's "
            "autograd.Function has no functorch rule. Call "
            "torch.func.functional_call(block, params, args) without a transform and take "
            "gradients with torch.autograd.grad or backward()")
