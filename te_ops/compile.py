"""te_ops under ``torch.compile``: the gate, and the facts the traced call reads.

While Dynamo traces ``OperationFuser.__call__`` (``torch.compiler.is_compiling()``), the call
takes the fuser's compiled branch (``te_ops.fuser.compiled_call``, which sits above this
module and uses it):

* The gate (:func:`compile_unsupported_reason`, computed from facts Dynamo traces and guards)
  names why a call cannot be traced whole; then te_ops calls
  ``torch._dynamo.graph_break(msg=reason)`` (with ``fullgraph=True`` the error carries the
  reason) and runs the call eagerly with a one-time warning. Nothing falls back silently.
* Otherwise the op list enters the graph as one call of ``te_ops.fuser._run_block``, an
  ``allow_in_graph`` function. Dynamo records it as one node; AOTAutograd runs it on fake
  tensors at trace time: the fuser plans then (the plan is baked into the graph), the
  fused/unfused ops and the one ``torch.autograd.Function`` run as Python, and only torch ops
  and te_ops' custom ops (``te_ops/gemm/torch_ops.py``, ``triton_op`` kernels) are
  recorded, forward and backward. The kernels are the same as eager, so results are
  bit-identical.

Guards: Dynamo guards the call's tensors (dtype, device, shape, ``requires_grad``; token
counts 0 and 1 are specialized, a graph each), grad mode, the split-size kind (tensor / host
list; a host int becomes a SymInt at the first call that changes it), the values of every
``TE_OPS_*`` variable (read through ``os.environ``'s dict in the traced frame, see
:func:`env_value`), the recipe's class and fields, and the ops' identity. A change retraces.
See docs/torch_compile.md.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import torch

from . import env
from .op import BasicOperation, FusibleOperation
from .quantization.autocast import ACTIVE as ACTIVE_RECIPES
from .quantization.recipe import Recipe

__all__ = ["compile_unsupported_reason", "call_reasons", "env_value", "active_recipe",
           "recipe_key", "recipe_from_key", "EAGER_WARNING", "warn_eager_once"]

#: The one-time warning when a te_ops block runs eagerly inside a compiled region.
EAGER_WARNING = "te_ops: {where} runs eagerly under torch.compile (graph break): {reason}"

_WARNED: set[str] = set()


def _basic_ops(module: Any) -> list:
    """The basic ops of a te_ops operation, an ``OperationFuser`` (a ``basic_ops`` list) or a
    ``te_ops.Sequential`` (its ``fusers()``); both sit above this module."""
    if isinstance(module, FusibleOperation):
        return list(module.basic_ops)
    fusers = getattr(type(module), "fusers", None)
    if callable(fusers):
        return [op for f in module.fusers() for op in f.basic_ops]
    ops = getattr(module, "basic_ops", None)
    if isinstance(ops, list) and all(isinstance(op, BasicOperation) for op in ops):
        return list(ops)
    raise TypeError(
        "module: expected a te_ops.Sequential, OperationFuser or te_ops operation, got "
        f"{type(module).__name__}"
    )


def call_reasons(basic_ops: list, input_: Any, extra_inputs: tuple,
                  recipe: Any = None) -> list[str]:
    """Why one call cannot be traced whole, from facts Dynamo can trace and guard (types, op
    attributes, an environment variable, a plain list): the gate runs in the traced frame."""
    reasons = []
    for op in basic_ops:
        host_read = op.host_sync_reason()
        if host_read is not None:
            reasons.append(host_read)
        if getattr(op, "accumulate_into_main_grad", False):
            reasons.append(f"{type(op).__name__}(accumulate_into_main_grad=True) adds weight "
                           "gradients into param.main_grad, a tensor outside the graph's "
                           "inputs (run the block eagerly or in a CUDA graph)")
        if getattr(op, "delay_wgrad_compute", False):
            reasons.append(f"{type(op).__name__}(delay_wgrad_compute=True) keeps backward "
                           "state in Python for a later backward_dw() call")
    active = recipe if recipe is not None else active_recipe()
    if active is not None:
        for f in dataclasses.fields(active):
            value = getattr(active, f.name)
            if not isinstance(value, (bool, int, float, str, type(None))):
                reasons.append(f"the recipe {type(active).__name__}'s field {f.name} is a "
                               f"{type(value).__name__}, not a constant the trace can guard")
    if not isinstance(input_, torch.Tensor):
        reasons.append(f"the input is a {type(input_).__name__}, not a tensor")
    if (env_value("TE_OPS_CHECK_SPLIT_SIZES") == "1"
            and (any(isinstance(v, torch.Tensor) for v in extra_inputs)
                 or any(op.extra_input_feeds() for op in basic_ops))):  # fed: device tensors
        reasons.append("TE_OPS_CHECK_SPLIT_SIZES=1 reads device split sizes on the host "
                       "(a data-dependent check the trace cannot make)")
    return reasons


def env_value(name: str) -> str | None:
    """``name``'s value, read so that Dynamo guards it: through ``os.environ``'s underlying
    dict (torch 2.13's Dynamo does not guard ``os.environ.get``, but guards a dict lookup),
    so a changed ``TE_OPS_*`` value retraces."""
    data = getattr(os.environ, "_data", None)
    if not isinstance(data, dict):  # not CPython's POSIX os.environ
        return os.environ.get(name)
    value = data.get(name.encode())
    return None if value is None else value.decode()


def active_recipe() -> Any:
    """The innermost enabled ``te_ops.autocast`` recipe, read from the plain list Dynamo can
    trace and guard (the ContextVar behind ``current_recipe()`` is not traceable)."""
    return ACTIVE_RECIPES[-1] if ACTIVE_RECIPES else None


def recipe_key(recipe: Any) -> tuple | None:
    """The recipe as graph constants: (module, class name, ((field, value), ...)). Reading
    the fields in the traced frame makes Dynamo guard their values, so an equal new recipe
    object reuses the graph and a different one retraces."""
    if recipe is None:
        return None
    cls = type(recipe)
    return (cls.__module__, cls.__qualname__,
            tuple((f.name, getattr(recipe, f.name)) for f in dataclasses.fields(recipe)))


def recipe_from_key(key: tuple | None) -> Any:
    if key is None:
        return None
    module, qualname, fields = key
    todo = [Recipe]
    while todo:
        cls = todo.pop()
        if cls.__module__ == module and cls.__qualname__ == qualname:
            return cls(**dict(fields))
        todo.extend(cls.__subclasses__())
    raise RuntimeError(f"te_ops: recipe class {module}.{qualname} not found")


def compile_unsupported_reason(module: Any, *inputs: Any) -> str | None:
    """Why ``module`` called on ``inputs`` cannot be traced whole by ``torch.compile``
    (under the current ``te_ops.autocast`` and ``TE_OPS_*`` settings).

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
        One line naming every reason; ``None`` when the call traces whole.

    Raises
    ------
    TypeError
        ``module`` is not a te_ops module.
    """
    input_ = inputs[0] if inputs else None
    reasons = call_reasons(_basic_ops(module), input_, tuple(inputs[1:]))
    return "; ".join(reasons) if reasons else None


def warn_eager_once(where: str, reason: str) -> None:
    """Warn once per (where, reason) that a te_ops call runs eagerly under torch.compile."""
    key = f"{where}\0{reason}"
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(EAGER_WARNING.format(where=where, reason=reason), RuntimeWarning,
                  stacklevel=3)


def check_env_eagerly(env_values: tuple) -> None:
    """Raise ``env.read``'s ValueError (naming the variable) outside the trace where a
    ``TE_OPS_*`` value in ``env_values`` (one per ``env.ENV_VARS`` entry, in order) is not
    accepted, and ``env.warn_unknown``'s where a variable of ``env.REPLACED`` is set: inside
    the traced call either would surface deep in a fake-tensor error."""
    for (name, var), value in zip(env.ENV_VARS.items(), env_values):
        text = var.default if value is None or not value.strip() else value.strip().lower()
        if var.choices and text not in var.choices:  # lists (no choices): their reader checks
            torch._dynamo.graph_break(msg=f"te_ops: environment variable {name} must be one of "
                                          f"{list(var.choices)}, got {text!r}")
            _read_env(name)
    for name in env.REPLACED:
        if (env_value(name) or "").strip():
            torch._dynamo.graph_break(msg=f"te_ops: {env.replaced_message(name)}")
            _warn_unknown_eagerly()


@torch._dynamo.disable
def _read_env(name: str) -> None:
    env.read(name)


@torch._dynamo.disable
def _warn_unknown_eagerly() -> None:
    env.warn_unknown()
