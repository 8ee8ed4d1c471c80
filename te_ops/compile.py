"""te_ops under ``torch.compile``: the gate that names why a block is not traced whole.

Status (see ``docs/torch_compile.md``): the te_ops op list does not yet trace as one graph.
Under ``torch.compile`` every te_ops fuser call asks :func:`compile_unsupported_reason`, calls
``torch._dynamo.graph_break(msg=reason)`` (so ``fullgraph=True`` raises an error carrying the
reason) and runs the op list eagerly, outside the graph, with a one-time warning per reason.
The code around the block (router, attention, loss) still compiles, in the graphs on either
side of the break. Nothing falls back silently.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

__all__ = ["compile_unsupported_reason", "EAGER_WARNING", "TRACE_REASON", "warn_eager_once"]

#: Why no te_ops fuser call is traced whole today (the last, always-present reason).
TRACE_REASON = (
    "te_ops runs its op list eagerly under torch.compile: the fuser's planning (the "
    "te_ops.autocast recipe held in a ContextVar, TE_OPS_* reads, the plan cache) and the ops' "
    "saved-context objects are Python that Dynamo does not trace, and the whole-block custom "
    "ops that would hide them (issue 8) are not built yet"
)

#: The one-time warning when a te_ops block runs eagerly inside a compiled region.
EAGER_WARNING = "te_ops: {where} runs eagerly under torch.compile (graph break): {reason}"

_WARNED: set[str] = set()


def _check_module(module: Any) -> None:
    from .fuser import OperationFuser
    from .op import FusibleOperation
    from .sequential import Sequential

    if not isinstance(module, (OperationFuser, Sequential, FusibleOperation)):
        raise TypeError(
            "module: expected a te_ops.Sequential, OperationFuser or te_ops operation, got "
            f"{type(module).__name__}"
        )


def _call_reasons(input_: Any, extra_inputs: tuple) -> list[str]:
    """Configuration-specific reasons for one call, from facts Dynamo can trace (types,
    dtypes, devices): the gate runs inside the traced frame, before the graph break."""
    reasons = []
    if any(isinstance(v, (list, tuple)) for v in extra_inputs):
        reasons.append("split sizes given as a host list (SymInt[] split sizes are not "
                       "wired through the ops yet)")
    if (isinstance(input_, torch.Tensor) and input_.device.type == "cpu"
            and input_.dtype == torch.float32):
        reasons.append("float32 on CPU: torch._grouped_mm's own fake kernel takes bfloat16 "
                       "only, and te_ops has no grouped-GEMM custom op with its own fake yet")
    return reasons


def compile_unsupported_reason(module: Any, *inputs: Any) -> str | None:
    """Why ``module`` called on ``inputs`` cannot be traced whole by ``torch.compile``.

    Parameters
    ----------
    module:
        A ``te_ops.Sequential``, an ``OperationFuser`` or a te_ops operation.
    *inputs:
        The call's main input (a tensor of shape (..., in_features)) and its extra inputs
        (split sizes, probs), as passed to ``module``. May be omitted.

    Returns
    -------
    str or None
        One line naming every reason, most specific first; ``None`` when the call traces
        whole (never today: the last reason is :data:`TRACE_REASON`).

    Raises
    ------
    TypeError
        ``module`` is not a te_ops module.
    """
    _check_module(module)
    input_ = inputs[0] if inputs else None
    reasons = _call_reasons(input_, tuple(inputs[1:]))
    reasons.append(TRACE_REASON)
    return "; ".join(reasons)


def warn_eager_once(where: str, reason: str) -> None:
    """Warn once per (where, reason) that a te_ops call runs eagerly under torch.compile."""
    key = f"{where}\0{reason}"
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(EAGER_WARNING.format(where=where, reason=reason), RuntimeWarning,
                  stacklevel=3)


def graph_break_for(fuser: Any, input_: Any, extra_inputs: tuple, recipe: Any) -> Any:
    """Called by ``OperationFuser.__call__`` while Dynamo traces: an explicit graph break
    carrying the gate's reason, then the call runs eagerly (warned once)."""
    reason = compile_unsupported_reason(fuser, input_, *extra_inputs)
    torch._dynamo.graph_break(msg=f"te_ops: {reason}")
    return _run_eagerly(fuser, reason, input_, extra_inputs, recipe)


@torch._dynamo.disable
def _run_eagerly(fuser: Any, reason: str, input_: Any, extra_inputs: tuple, recipe: Any) -> Any:
    names = "/".join(type(op).__name__ for op in fuser.basic_ops)
    warn_eager_once(f"the op list {names}", reason)
    return fuser(input_, *extra_inputs, recipe=recipe)
