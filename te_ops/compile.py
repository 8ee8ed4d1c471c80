"""te_ops under ``torch.compile``: the whole op list as one graph call, and the gate.

While Dynamo traces ``OperationFuser.__call__`` (``torch.compiler.is_compiling()``), the call
goes to :func:`compiled_call`:

* The gate (:func:`compile_unsupported_reason`, computed from facts Dynamo traces and guards)
  names why a call cannot be traced whole; then te_ops calls
  ``torch._dynamo.graph_break(msg=reason)`` (with ``fullgraph=True`` the error carries the
  reason) and runs the call eagerly with a one-time warning. Nothing falls back silently.
* Otherwise the op list enters the graph as one call of :func:`_run_block`, an
  ``allow_in_graph`` function. Dynamo records it as one node; AOTAutograd runs it on fake
  tensors at trace time: the fuser plans then (the plan is baked into the graph), the
  fused/unfused ops and the one ``torch.autograd.Function`` run as Python, and only torch ops
  and te_ops' custom ops (``te_ops/gemm/torch_ops.py``, ``triton_op`` kernels) are
  recorded, forward and backward. The kernels are the same as eager, so results are
  bit-identical.

Guards: Dynamo guards the call's tensors (dtype, device, shape, ``requires_grad``), grad
mode, the split-size kind (tensor / host list; host ints become SymInts after the first
change), the values of every ``TE_OPS_*`` variable (read through ``os.environ``'s dict in the
traced frame, see :func:`_env_value`), the recipe's class and fields, and the ops' identity.
A change retraces.
See docs/torch_compile.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Any

import torch
from torch.nn.utils.stateless import _reparametrize_module

from . import env
from .quantization.autocast import ACTIVE as ACTIVE_RECIPES

__all__ = ["compile_unsupported_reason", "compiled_call", "EAGER_WARNING", "warn_eager_once"]

#: The one-time warning when a te_ops block runs eagerly inside a compiled region.
EAGER_WARNING = "te_ops: {where} runs eagerly under torch.compile (graph break): {reason}"

_WARNED: set[str] = set()


def _basic_ops(module: Any) -> list:
    from .fuser import OperationFuser
    from .op import FusibleOperation
    from .sequential import Sequential

    if isinstance(module, Sequential):
        return [op for f in module.fusers() for op in f.basic_ops]
    if isinstance(module, (OperationFuser, FusibleOperation)):
        return list(module.basic_ops)
    raise TypeError(
        "module: expected a te_ops.Sequential, OperationFuser or te_ops operation, got "
        f"{type(module).__name__}"
    )


def _call_reasons(basic_ops: list, input_: Any, extra_inputs: tuple,
                  recipe: Any = None) -> list[str]:
    """Why one call cannot be traced whole, from facts Dynamo can trace and guard (types, op
    attributes, an environment variable, a plain list): the gate runs in the traced frame."""
    reasons = []
    for op in basic_ops:
        if getattr(op, "accumulate_into_main_grad", False):
            reasons.append(f"{type(op).__name__}(accumulate_into_main_grad=True) adds weight "
                           "gradients into param.main_grad, a tensor outside the graph's "
                           "inputs (run the block eagerly or in a CUDA graph)")
        if getattr(op, "delay_wgrad_compute", False):
            reasons.append(f"{type(op).__name__}(delay_wgrad_compute=True) keeps backward "
                           "state in Python for a later backward_dw() call")
    active = recipe if recipe is not None else _active_recipe()
    if active is not None:
        for f in dataclasses.fields(active):
            value = getattr(active, f.name)
            if not isinstance(value, (bool, int, float, str, type(None))):
                reasons.append(f"the recipe {type(active).__name__}'s field {f.name} is a "
                               f"{type(value).__name__}, not a constant the trace can guard")
    if not isinstance(input_, torch.Tensor):
        reasons.append(f"the input is a {type(input_).__name__}, not a tensor")
    if (_env_value("TE_OPS_CHECK_SPLIT_SIZES") == "1"
            and any(isinstance(v, torch.Tensor) for v in extra_inputs)):
        reasons.append("TE_OPS_CHECK_SPLIT_SIZES=1 reads device split sizes on the host "
                       "(a data-dependent check the trace cannot make)")
    return reasons


def _env_value(name: str) -> str | None:
    """``name``'s value, read so that Dynamo guards it: through ``os.environ``'s underlying
    dict (torch 2.13's Dynamo does not guard ``os.environ.get``, but guards a dict lookup),
    so a changed ``TE_OPS_*`` value retraces."""
    data = getattr(os.environ, "_data", None)
    if not isinstance(data, dict):  # not CPython's POSIX os.environ
        return os.environ.get(name)
    value = data.get(name.encode())
    return None if value is None else value.decode()


def _active_recipe() -> Any:
    """The innermost enabled ``te_ops.autocast`` recipe, read from the plain list Dynamo can
    trace and guard (the ContextVar behind ``current_recipe()`` is not traceable)."""
    return ACTIVE_RECIPES[-1] if ACTIVE_RECIPES else None


def _recipe_key(recipe: Any) -> tuple | None:
    """The recipe as graph constants: (module, class name, ((field, value), ...)). Reading
    the fields in the traced frame makes Dynamo guard their values, so an equal new recipe
    object reuses the graph and a different one retraces."""
    if recipe is None:
        return None
    cls = type(recipe)
    return (cls.__module__, cls.__qualname__,
            tuple((f.name, getattr(recipe, f.name)) for f in dataclasses.fields(recipe)))


def _recipe_from_key(key: tuple | None) -> Any:
    if key is None:
        return None
    from .quantization.recipe import Recipe

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
    reasons = _call_reasons(_basic_ops(module), input_, tuple(inputs[1:]))
    return "; ".join(reasons) if reasons else None


def warn_eager_once(where: str, reason: str) -> None:
    """Warn once per (where, reason) that a te_ops call runs eagerly under torch.compile."""
    key = f"{where}\0{reason}"
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(EAGER_WARNING.format(where=where, reason=reason), RuntimeWarning,
                  stacklevel=3)


def compiled_call(fuser: Any, input_: Any, extra_inputs: tuple, recipe: Any) -> Any:
    """``OperationFuser.__call__`` while ``torch.compile`` traces it.

    Traceable call: the whole op list enters the graph as one call of an ``allow_in_graph``
    function (:func:`_run_block`); AOTAutograd runs te_ops' Python (planning, fused and unfused
    ops, the one autograd function) on fake tensors at trace time and records only torch ops
    and te_ops' custom ops. Otherwise: an explicit graph break carrying the gate's reason, and
    the call runs eagerly (warned once).
    """
    reason = _trace_reason(fuser, input_, extra_inputs, recipe)
    if reason is not None:
        torch._dynamo.graph_break(msg=f"te_ops: {reason}")
        return _run_eagerly(fuser, reason, input_, extra_inputs, recipe)
    params = [p for op in fuser.basic_ops for p in op._parameters.values()]
    env_values = tuple(_env_value(name) for name in env.ENV_VARS)
    key = tuple(id(op) for op in fuser.basic_ops)
    recipe_key = _recipe_key(recipe if recipe is not None else _active_recipe())
    return _run_block(input_, key, recipe_key, len(params), env_values, *params,
                      *extra_inputs)


def _fuser_for(key: tuple[int, ...]) -> Any:
    """The fuser of the traced call's basic ops (kept on the first op, so it lives as long as
    the ops; its plans are separate from the eager fuser's)."""
    from .fuser import OperationFuser
    from .op import LIVE_BASIC_OPS

    ops = [LIVE_BASIC_OPS.get(i) for i in key]
    if any(op is None for op in ops):
        raise RuntimeError("te_ops: a traced block's basic op no longer exists")
    cache = ops[0].__dict__.setdefault("_compile_fusers", {})
    fuser = cache.get(key)
    if fuser is None:
        fuser = cache[key] = OperationFuser(ops)
    return fuser


@torch._dynamo.allow_in_graph
def _run_block(input_, key, recipe_key, num_params, env_values, *rest):
    """The whole op list as one graph call (run by AOTAutograd on fake tensors at trace time):
    the basic ops named by ``key`` (their ids) run through a fuser, with their parameters
    replaced by the graph's parameter inputs."""
    del env_values  # a graph constant: a changed TE_OPS_* value retraces (guarded)
    fuser = _fuser_for(key)
    params, extra = rest[:num_params], rest[num_params:]
    it = iter(params)
    with contextlib.ExitStack() as stack:
        for op in fuser.basic_ops:
            swap = {n: next(it) for n in op._parameters}
            stack.enter_context(_reparametrize_module(op, swap))
        return fuser._run(input_, *extra, recipe=_recipe_from_key(recipe_key))


def _trace_reason(fuser: Any, input_: Any, extra_inputs: tuple, recipe: Any) -> str | None:
    reasons = _call_reasons(fuser.basic_ops, input_, extra_inputs, recipe)
    return "; ".join(reasons) if reasons else None


@torch._dynamo.disable
def _run_eagerly(fuser: Any, reason: str, input_: Any, extra_inputs: tuple, recipe: Any) -> Any:
    names = "/".join(type(op).__name__ for op in fuser.basic_ops)
    warn_eager_once(f"the op list {names}", reason)
    return fuser(input_, *extra_inputs, recipe=recipe)
