"""The operation fuser: runs a list of basic ops as one ``torch.autograd.Function``.

One execution path per call: traced by ``torch.compile`` the whole op list is one graph call
(:func:`compiled_call`); eager, every call (training or ``no_grad``, fused or unfused plan)
is one :class:`_FuserFunction` call with the call's cached plan.

Forward walks the *forward plan* (basic ops with runs replaced by forward-fused ops); backward
walks the *backward plan* in reverse. The two plans are made independently, so a fused forward
can be followed by the unfused backward and the reverse: every op reads and writes its own
saved context (see ``docs/saved_context.md``).

Fusion functions are registered in three passes, applied in this order:

* joint (``register_joint_fusion``): the result is used for forward *and* backward;
* forward-only (``register_forward_fusion``) on the joint result;
* backward-only (``register_backward_fusion``) on the joint result.

A fusion function has the signature ``func(ops, *, recipe, info) -> ops``: ``ops`` is a list of
:class:`~te_ops.op.FusibleOperation`, ``info`` a :class:`PlanInfo` describing this call's input
(dtype, device, extra inputs) and collecting the reasons a fusion did not apply
(``info.note(reason)``), which ``Sequential.explain()`` prints.

The plan is cached and recomputed when the recipe type, which ops need grad, the environment
toggles (``te_ops.env``) or the kind of inputs (dtype, device, split-size kind and sharing)
change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import operator
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.utils.stateless import _reparametrize_module

from . import env
from .call_scope import close_call_scope, open_call_scope
from .activation_checkpoint import check_recomputation
from .compile import (
    active_recipe,
    call_reasons,
    check_env_eagerly,
    env_value,
    recipe_from_key,
    recipe_key,
    warn_eager_once,
)
from .double_backward import graph_anchors
from .func_transforms import check_no_func_transform
from .op import (
    LIVE_BASIC_OPS,
    BasicOperation,
    FusibleOperation,
    OperationContext,
    set_fuser_class,
)
from .quantization.autocast import current_recipe
from .signature import CallSignature, FedOutput, same_source
from .splits import close_host_read_scope, open_host_read_scope

__all__ = [
    "OperationFuser",
    "PlanInfo",
    "Fusion",
    "register_joint_fusion",
    "register_forward_fusion",
    "register_backward_fusion",
    "registered_fusions",
    "fusions_off",
    "unregister_fusion",
    "fusible_as",
    "match_window",
]

FusionFunc = Callable[..., list[FusibleOperation]]
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


@dataclass
class Fusion:
    """A registered fusion: its pass, its name (what ``TE_OPS_FUSION_OFF`` lists to turn it
    off) and the function."""

    kind: str  # "joint" | "forward" | "backward"
    name: str
    func: FusionFunc


_FUSIONS: list[Fusion] = []
#: Bumped on every (un)registration; part of the plan-cache key.
_REGISTRY_VERSION = [0]
#: Plans kept per fuser (one per call kind: train / no_grad eval / dtypes ...), least recently
#: used dropped first.
MAX_CACHED_PLANS = 16


def _register(kind: str, func: FusionFunc, prepend: bool, name: str | None) -> Fusion:
    name = name if name is not None else getattr(func, "__name__", repr(func))
    if not isinstance(name, str) or not name.strip() or "," in name:
        raise ValueError(f"name must be a non-empty str without commas (TE_OPS_FUSION_OFF "
                         f"lists names separated by commas), got {name!r}")
    fusion = Fusion(kind=kind, name=name.strip().lower(), func=func)
    if prepend:
        _FUSIONS.insert(0, fusion)
    else:
        _FUSIONS.append(fusion)
    _REGISTRY_VERSION[0] += 1
    return fusion


def register_joint_fusion(func: FusionFunc, prepend: bool = False, *,
                          name: str | None = None) -> Fusion:
    """Register a fusion whose result is used for both forward and backward.

    ``name`` (default: the function's name) is what ``TE_OPS_FUSION_OFF`` lists to turn it
    off; it is kept stripped and lower-cased (the variable's names are read so), and fusions
    that share a name are switched off together.

    Raises
    ------
    ValueError
        ``name`` is empty or holds a comma.
    """
    return _register("joint", func, prepend, name)


def register_forward_fusion(func: FusionFunc, prepend: bool = False, *,
                            name: str | None = None) -> Fusion:
    """Register a forward-only fusion (``name`` as :func:`register_joint_fusion`)."""
    return _register("forward", func, prepend, name)


def register_backward_fusion(func: FusionFunc, prepend: bool = False, *,
                             name: str | None = None) -> Fusion:
    """Register a backward-only fusion (``name`` as :func:`register_joint_fusion`)."""
    return _register("backward", func, prepend, name)


def unregister_fusion(fusion: Fusion) -> None:
    """Remove a fusion registered earlier (used by tests)."""
    _FUSIONS.remove(fusion)
    _REGISTRY_VERSION[0] += 1


def registered_fusions() -> list[Fusion]:
    """The registered fusions, in application order within each pass."""
    return list(_FUSIONS)


def _mismatch(op: FusibleOperation, classes: tuple[type, ...]) -> tuple[str, str] | None:
    """``None`` when a fusion written for ``classes`` may take ``op``; else (kind, text) with
    kind ``"subclass"`` (a subclass that does not declare ``fuses_as``) or ``"other"``."""
    names = " / ".join(c.__name__ for c in classes)
    kind = type(op)
    if op.is_fused_op:
        return "other", f"{kind.__name__} (already fused), not {names}"
    if kind in classes or kind.__dict__.get("fuses_as") in classes:
        return None
    base = next((c for c in classes if isinstance(op, c)), None)
    if base is not None:
        return "subclass", (f"{kind.__name__} is a subclass of {base.__name__} that does not "
                            f"declare fuses_as = {base.__name__} (its math may differ from "
                            "what the fusion computes)")
    return "other", f"{kind.__name__}, not {names}"


def fusible_as(op: FusibleOperation, classes: type | tuple[type, ...]) -> str | None:
    """Whether a fusion written for ``classes`` may take ``op``: ``None`` when it may, else why
    not (a string for ``info.note``).

    A fusion reproduces the math of the exact classes it was written for, so it takes ``op``
    when ``type(op)`` is one of ``classes``, or when ``type(op)`` declares in its own class body
    ``fuses_as = C`` for one of them (:attr:`te_ops.op.BasicOperation.fuses_as`). A fused op is
    never taken again.
    """
    found = _mismatch(op, classes if isinstance(classes, tuple) else (classes,))
    return None if found is None else found[1]


def match_window(ops: Sequence[FusibleOperation], start: int,
                 pattern: Sequence[tuple[str, type | tuple[type, ...]]]
                 ) -> tuple[list[FusibleOperation] | None, str | None]:
    """Match ``pattern`` against ``ops[start:start + len(pattern)]``.

    Parameters
    ----------
    ops : the op list a fusion function receives.
    start : where the window starts.
    pattern : one ``(role, classes)`` pair per op, e.g.
        ``[("fc1", GroupedLinear), ("the activation", (SwiGLU, ScaledSwiGLU)), ...]``;
        each op is checked with :func:`fusible_as`.

    Returns
    -------
    (window, None)
        The matched ops.
    (None, reason)
        The first op matches (or is a subclass that does not declare ``fuses_as``) but the
        window does not: ``reason`` says which op and why, for ``info.note``.
    (None, None)
        Nothing worth a note: the first op is not of the pattern's first class, or the list
        ends before the pattern does.
    """
    window = list(ops[start:start + len(pattern)])
    for k, (role, classes) in enumerate(pattern):
        if k >= len(window):
            return None, None
        found = _mismatch(window[k], classes if isinstance(classes, tuple) else (classes,))
        if found is None:
            continue
        kind, text = found
        if kind == "subclass":
            return None, f"{role}: {text}"
        return None, (f"the op after {pattern[k - 1][0]} is {text}" if k else None)
    return window, None


def _extra_input_signature(value: Any) -> tuple:
    if value is None:
        return ("none",)
    if isinstance(value, FedOutput):
        return ("fed", value.op, value.output)
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.device.type, value.dim())
    if isinstance(value, (list, tuple)):
        return ("list", len(value))
    return (type(value).__name__,)


@dataclass
class PlanInfo:
    """What a fusion function may know about the call it plans for.

    Attributes
    ----------
    dtype, device : the main input's dtype and device (``None`` when planning without input).
    basic_ops : the fuser's basic ops, in order.
    extra_inputs : per basic op, the extra inputs of this call (``None`` entries when unknown;
        a :class:`~te_ops.signature.FedOutput` marker where an earlier op's extra output feeds
        the slot, two markers of one output being one source).
    requires_grad : per basic op, whether it takes part in backward.
    notes : (fusion name, reason) pairs recorded by fusions that did not apply.
    recipe : the low-precision recipe of the call (``None``: the parameters' precision).
    """

    dtype: torch.dtype | None
    device: torch.device | None
    basic_ops: list[BasicOperation]
    extra_inputs: list[tuple[Any, ...]]
    requires_grad: list[bool]
    notes: list[tuple[str, str]] = field(default_factory=list)
    _current: str = ""
    recipe: Any = None

    def index(self, op: BasicOperation) -> int:
        """Position of a basic op in the fuser."""
        for i, candidate in enumerate(self.basic_ops):
            if candidate is op:
                return i
        raise ValueError(f"op {type(op).__name__} is not one of this fuser's basic ops")

    def same_source(self, a: Any, b: Any) -> bool:
        """Whether two extra inputs come from one source (see :func:`same_source`)."""
        return same_source(a, b)

    def note(self, reason: str) -> None:
        """Record why the running fusion did not apply somewhere (shown by ``explain()``)."""
        self.notes.append((self._current, reason))


@dataclass
class _Plan:
    forward_ops: list[tuple[FusibleOperation, list[int]]]
    backward_ops: list[tuple[FusibleOperation, list[int]]]
    info: PlanInfo


def fusions_off() -> frozenset[str]:
    """The fusion names ``TE_OPS_FUSION_OFF`` lists (comma-separated; blanks ignored).

    Raises
    ------
    ValueError
        A listed name is not a registered fusion's; the message names the variable, the name
        and the registered ones.
    """
    names = _fusion_names(env.read("TE_OPS_FUSION_OFF"))
    message = _unknown_fusions_message(names)
    if message is not None:
        raise ValueError(message)
    return names


def _fusion_names(text: str | None) -> frozenset[str]:
    return frozenset(n.strip() for n in (text or "").lower().split(",") if n.strip())


def _unknown_fusions_message(names: frozenset[str], closest: bool = True) -> str | None:
    """The error for names that no registered fusion has (``None``: all known); ``closest``
    adds the nearest registered names (not while Dynamo traces: difflib does not trace)."""
    registered = [f.name for f in _FUSIONS]
    unknown = sorted(names - set(registered))
    if not unknown:
        return None
    close = ([m for n in unknown for m in difflib.get_close_matches(n, registered, n=1)]
             if closest else [])
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return (f"environment variable TE_OPS_FUSION_OFF names {unknown}, which are not "
            f"registered fusions (registered: {registered}; names are comma-separated, and a "
            f"fusion of your own must be registered before the call){hint}")


@torch._dynamo.disable
def _fusions_off_eagerly() -> None:
    fusions_off()


def _run_pass(kind: str, ops: list[FusibleOperation], recipe: Any, info: PlanInfo,
              enabled: bool, off_names: frozenset[str]) -> list[FusibleOperation]:
    for fusion in _FUSIONS:
        if fusion.kind != kind:
            continue
        info._current = fusion.name
        off = ("TE_OPS_FUSION=0 turns every fusion off" if not enabled
               else f"TE_OPS_FUSION_OFF lists {fusion.name}" if fusion.name in off_names
               else None)
        if off is None:
            ops = fusion.func(ops, recipe=recipe, info=info)
        elif _would_fuse(fusion, ops, recipe, info):  # noted only where its pattern is
            info.note(off)
    info._current = ""
    return ops


def _would_fuse(fusion: Fusion, ops: list[FusibleOperation], recipe: Any, info: PlanInfo
                ) -> bool:
    """Whether ``fusion`` (switched off) finds its pattern in ``ops``: it would replace an op,
    or it notes why not. It runs on a scratch copy of ``info``; its result and notes are
    discarded."""
    scratch = dataclasses.replace(info, notes=[])
    fused = fusion.func(list(ops), recipe=recipe, info=scratch)
    return (bool(scratch.notes) or len(fused) != len(ops)
            or any(a is not b for a, b in zip(fused, ops)))


class OperationFuser:
    """Runs basic ops, fused where registered fusions apply, in one autograd function.

    Parameters
    ----------
    ops : sequence of BasicOperation
        The ops in order. Their extra inputs follow the main input positionally when calling.

    Calling
    -------
    ``fuser(input_, *extra_inputs)`` returns the main output, or ``(output, *extra_outputs)``
    when any op has extra outputs that feed no later op of the fuser (an extra input fed by an
    earlier op's output, :meth:`~te_ops.op.BasicOperation.feed_extra_input`, is not a call
    input, and that output is not returned).

    Raises
    ------
    TypeError
        ``ops`` holds something that is not a BasicOperation.
    ValueError
        The number of extra inputs does not match the ops' ``num_extra_inputs``.
    """

    def __init__(self, ops: Sequence[FusibleOperation]) -> None:
        basic: list[BasicOperation] = []
        for i, op in enumerate(ops):
            if not isinstance(op, FusibleOperation):
                raise TypeError(f"ops[{i}] must be a te_ops FusibleOperation, got {type(op)}")
            basic.extend(op.basic_ops)
        for i, op in enumerate(basic):
            first = next(j for j, other in enumerate(basic) if other is op)
            if first != i:
                raise ValueError(
                    f"ops: basic op {i} ({type(op).__name__}) is the same object as op {first}; "
                    "one fuser runs each op instance once (te_ops.Sequential puts a repeated "
                    "op in a fuser of its own)"
                )
        self.basic_ops = basic
        self.signature = CallSignature(basic)
        self.num_extra_inputs = self.signature.counts
        self.num_extra_outputs = [op.num_extra_outputs for op in basic]
        #: Per op, per extra output, whether a call returns it (see CallSignature.returned).
        self.returned_outputs = self.signature.returned
        self._plans: OrderedDict[Any, _Plan] = OrderedDict()
        self._plan: _Plan | None = None  # the last call's plan (what explain() shows)

    # ------------------------------------------------------------------ planning
    def _plan_for(self, input_: torch.Tensor | None, extra_inputs: list[tuple[Any, ...]],
                  requires_grad: list[bool], recipe: Any, remember: bool = True) -> _Plan:
        """The plan for such a call: from the cache (one plan per key, the
        :data:`MAX_CACHED_PLANS` most recently used) or made now. ``remember`` makes it the
        plan of the last call (``explain()``'s default)."""
        flat_extra = [v for group in extra_inputs for v in group]
        key = (
            recipe,  # a frozen dataclass: its type and settings
            tuple(requires_grad),
            env.snapshot(),
            None if input_ is None else (input_.dtype, input_.device.type),
            tuple(_extra_input_signature(v) for v in flat_extra),
            self.signature.source_classes(flat_extra),
            _REGISTRY_VERSION[0],  # (un)registering a fusion replans
        )
        plan = self._plans.get(key)
        if plan is None:
            plan = self._make_plan(input_, extra_inputs, requires_grad, recipe)
            self._plans[key] = plan
            while len(self._plans) > MAX_CACHED_PLANS:
                self._plans.popitem(last=False)
        self._plans.move_to_end(key)
        if remember:
            self._plan = plan
        return plan

    def _make_plan(self, input_: torch.Tensor | None, extra_inputs: list[tuple[Any, ...]],
                   requires_grad: list[bool], recipe: Any) -> _Plan:
        info = PlanInfo(
            dtype=None if input_ is None else input_.dtype,
            device=None if input_ is None else input_.device,
            basic_ops=self.basic_ops,
            extra_inputs=extra_inputs,
            requires_grad=requires_grad,
            recipe=recipe,
        )
        enabled = env.read_bool("TE_OPS_FUSION")
        off = fusions_off()
        joint = _run_pass("joint", list(self.basic_ops), recipe, info, enabled, off)
        forward = _run_pass("forward", list(joint), recipe, info, enabled, off)
        backward = _run_pass("backward", list(joint), recipe, info, enabled, off)
        # The plan must not keep the call's tensors alive.
        info.extra_inputs = [tuple(_extra_input_signature(v) for v in g) for g in extra_inputs]
        return _Plan(self._with_indices(forward), self._with_indices(backward), info)

    def _with_indices(self, ops: list[FusibleOperation]
                      ) -> list[tuple[FusibleOperation, list[int]]]:
        ids = {id(op): i for i, op in enumerate(self.basic_ops)}
        out = []
        expected = 0
        for op in ops:
            idx = [ids[id(b)] for b in op.basic_ops]
            if idx != list(range(expected, expected + len(idx))):
                raise RuntimeError(
                    f"fusion produced ops out of order: {type(op).__name__} covers basic ops "
                    f"{idx}, expected to start at {expected}"
                )
            expected += len(idx)
            out.append((op, idx))
        if expected != len(self.basic_ops):
            raise RuntimeError(
                f"fusion dropped ops: plan covers {expected} of {len(self.basic_ops)} basic ops"
            )
        return out

    def plan(self, input_: torch.Tensor | None = None, *extra_inputs: Any,
             recipe: Any = None) -> _Plan:
        """The plan this fuser would use for such a call (for ``explain()``); runs nothing
        and leaves the last call's plan (``explain()`` without inputs) as it is. Without an
        input: the last call's plan, or one for unknown inputs."""
        if self._plan is not None and input_ is None:
            return self._plan
        groups = self._split_extra_inputs(extra_inputs, allow_missing=True)
        requires_grad = [True] * len(self.basic_ops)
        recipe = current_recipe() if recipe is None else recipe
        return self._plan_for(input_, groups, requires_grad, recipe, remember=False)

    def _split_extra_inputs(self, extra_inputs: Sequence[Any],
                            allow_missing: bool = False) -> list[tuple[Any, ...]]:
        return self.signature.split(extra_inputs, allow_missing=allow_missing)

    # ------------------------------------------------------------------ running
    def _params(self) -> list[list[torch.nn.Parameter]]:
        """Each basic op's parameters, cached while every op's parameter dict is unchanged."""
        return self._params_and_flat()[0]

    def _params_and_flat(self) -> tuple[list[list[torch.nn.Parameter]],
                                        list[torch.nn.Parameter]]:
        """:meth:`_params` and the same parameters in one flat list (both cached; do not
        modify them)."""
        if any("parametrizations" in op._modules for op in self.basic_ops):
            # torch.nn.utils.parametrize: the computed tensors (new every call), so autograd
            # differentiates through the parametrization (GroupedLinear.computed_parameters)
            per_op = [op.computed_parameters() if "parametrizations" in op._modules
                      else list(op.parameters()) for op in self.basic_ops]
            return per_op, [p for ps in per_op for p in ps]
        key = tuple(tuple(map(id, op._parameters.values())) for op in self.basic_ops)
        cached = self.__dict__.get("_params_cache")
        if cached is None or cached[0] != key:
            per_op = [list(op.parameters()) for op in self.basic_ops]
            cached = (key, per_op, [p for ps in per_op for p in ps])
            self.__dict__["_params_cache"] = cached
        return cached[1], cached[2]

    def __call__(self, input_: torch.Tensor, *extra_inputs: Any, recipe: Any = None) -> Any:
        """Run the ops on ``input_`` (two branches: traced by ``torch.compile``, the whole op
        list as one graph call, :func:`compiled_call`; else eager, one
        :class:`_FuserFunction` call, with or without grad)."""
        if torch.compiler.is_compiling():
            return compiled_call(self, input_, extra_inputs, recipe)
        # a checkpoint's recomputation must run under its first forward's recipe
        check_recomputation(self, current_recipe() if recipe is None else recipe)
        return self._run(input_, *extra_inputs, recipe=recipe)

    def _run(self, input_: torch.Tensor, *extra_inputs: Any, recipe: Any = None) -> Any:
        if any("parametrizations" in op._modules for op in self.basic_ops):
            # torch.nn.utils.parametrize: each parametrized weight is computed once for the
            # call, the one tensor the autograd function takes and the ops read
            with torch.nn.utils.parametrize.cached():
                return self._run_call(input_, *extra_inputs, recipe=recipe)
        return self._run_call(input_, *extra_inputs, recipe=recipe)

    def _run_call(self, input_: torch.Tensor, *extra_inputs: Any, recipe: Any = None) -> Any:
        if not isinstance(input_, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(input_).__name__}")
        _check_autocast(input_)
        groups = self._split_extra_inputs(extra_inputs)
        recipe = current_recipe() if recipe is None else recipe  # te_ops.autocast
        params, flat_params = self._params_and_flat()
        flat_extra = [v for g in groups for v in g]

        grad_enabled = torch.is_grad_enabled()
        needs = [
            grad_enabled
            and (any(map(_REQUIRES_GRAD, ps))
                 or any(isinstance(v, torch.Tensor) and v.requires_grad for v in g))
            for ps, g in zip(params, groups)
        ]
        input_grad = grad_enabled and input_.requires_grad
        first = next((i for i, n in enumerate(needs) if n), len(needs))
        if input_grad:
            first = 0
        requires_grad = [i >= first for i in range(len(self.basic_ops))]
        # Remembered for explain() once the forward ran: a call that raises (bad input) must
        # not leave its plan there beside the records of the last call that did run.
        plan = self._plan_for(input_, groups, requires_grad, recipe, remember=False)
        # A fed input requires grad when its producer takes part in backward.
        extra_grad = [tuple(requires_grad[v.op] if isinstance(v, FedOutput) else
                            grad_enabled and isinstance(v, torch.Tensor) and v.requires_grad
                            for v in g) for g in groups]

        # Function.apply's Python wrapper walks every argument (functorch's dead-wrapper
        # unwrapping: one generator step per parameter, 128+ with per-expert weights); it
        # matters only under functorch transforms, so the C apply is called directly without.
        if torch._C._are_functorch_transforms_active():
            check_no_func_transform()  # grad / jvp / vmap: a te_ops error, not torch's
            apply = _FuserFunction.apply
        else:
            apply = _APPLY
        # The parameters and extra inputs are Function inputs only for their autograd edges
        # (the ops read their own parameters, and the extra inputs from ``groups``): a call
        # where nothing takes part in backward (no_grad, a frozen block) passes none of them.
        edges = (*flat_params, *flat_extra) if any(requires_grad) else ()
        outputs = apply(
            input_, self, plan, recipe, requires_grad, input_grad, extra_grad,
            tuple(map(len, params)), groups, *edges,
        )
        self._plan = plan
        return outputs if self.signature.num_returned else outputs[0]


set_fuser_class(OperationFuser)  # a lone op's forward runs through one


# ------------------------------------------------------------------ compiled branch
def compiled_call(fuser: OperationFuser, input_: Any, extra_inputs: tuple, recipe: Any) -> Any:
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
    params = [p for op in fuser.basic_ops for _, p in _traced_params(op)]
    env_values = tuple(env_value(name) for name in env.ENV_VARS)
    check_env_eagerly(env_values)  # a bad TE_OPS_* value: te_ops' own error, raised eagerly
    off = _unknown_fusions_message(_fusion_names(env_values[_FUSION_OFF_INDEX]), closest=False)
    if off is not None:  # likewise for a name TE_OPS_FUSION_OFF lists that is no fusion's
        torch._dynamo.graph_break(msg=f"te_ops: {off}")
        _fusions_off_eagerly()
    key = tuple(id(op) for op in fuser.basic_ops)
    recipe_constants = recipe_key(recipe if recipe is not None else active_recipe())
    return _run_block(input_, key, recipe_constants, len(params), env_values, *params,
                      *extra_inputs)


#: Where ``TE_OPS_FUSION_OFF`` sits among the values of ``env.ENV_VARS`` (the traced call's
#: ``env_values``).
_FUSION_OFF_INDEX = list(env.ENV_VARS).index("TE_OPS_FUSION_OFF")


def _fuser_for(key: tuple[int, ...]) -> Any:
    """The fuser of the traced call's basic ops (kept on the first op, so it lives as long as
    the ops; its plans are separate from the eager fuser's)."""
    ops = [LIVE_BASIC_OPS.get(i) for i in key]
    if any(op is None for op in ops):
        raise RuntimeError("te_ops: a traced block's basic op no longer exists")
    cache = ops[0].__dict__.setdefault("_compile_fusers", {})
    fuser = cache.get(key)
    if fuser is None:
        fuser = cache[key] = OperationFuser(ops)
    return fuser


def _traced_params(op: Any) -> list[tuple[str, Any]]:
    """(name, tensor) of the parameters a traced call takes as graph inputs: the op's own, or
    for an op with ``torch.nn.utils.parametrize`` parametrizations every parameter under it
    (``parametrizations.weight.original``, the parametrization's own), so the trace computes
    the parametrized weight from graph inputs and differentiates through it."""
    if "parametrizations" in op._modules:
        return list(op.named_parameters())
    return list(op._parameters.items())


@torch._dynamo.allow_in_graph
def _run_block(input_, key, recipe_constants, num_params, env_values, *rest):
    """The whole op list as one graph call (run by AOTAutograd on fake tensors at trace time):
    the basic ops named by ``key`` (their ids) run through a fuser, with their parameters
    replaced by the graph's parameter inputs."""
    del env_values  # a graph constant: a changed TE_OPS_* value retraces (guarded)
    fuser = _fuser_for(key)
    params, extra = rest[:num_params], rest[num_params:]
    it = iter(params)
    with contextlib.ExitStack() as stack:
        for op in fuser.basic_ops:
            swap = {n: next(it) for n, _ in _traced_params(op)}
            stack.enter_context(_reparametrize_module(op, swap))
        return fuser._run(input_, *extra, recipe=recipe_from_key(recipe_constants))


def _trace_reason(fuser: Any, input_: Any, extra_inputs: tuple, recipe: Any) -> str | None:
    reasons = call_reasons(fuser.basic_ops, input_, extra_inputs, recipe)
    return "; ".join(reasons) if reasons else None


@torch._dynamo.disable
def _run_eagerly(fuser: Any, reason: str, input_: Any, extra_inputs: tuple, recipe: Any) -> Any:
    names = "/".join(type(op).__name__ for op in fuser.basic_ops)
    warn_eager_once(f"the op list {names}", reason)
    return fuser(input_, *extra_inputs, recipe=recipe)


def _check_autocast(input_: torch.Tensor) -> None:
    """te_ops ops compute in their parameters' dtype; under ``torch.autocast`` to another
    dtype they would silently not follow it, so they raise instead.

    Raises
    ------
    RuntimeError
        ``torch.autocast`` is on for the input's device with a dtype other than the input's;
        the message names autocast and the fix.
    """
    device_type = input_.device.type
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return
    dtype = torch.get_autocast_dtype(device_type)
    if input_.dtype != dtype:
        raise RuntimeError(
            f"te_ops ops do not follow torch.autocast: autocast to {dtype} is on for "
            f"{device_type} but the input is {input_.dtype}. Run the te_ops block in one "
            f"dtype instead: cast its parameters and input (e.g. block.to({dtype}) and "
            f"x.to({dtype})), or call it inside torch.autocast({device_type!r}, enabled=False)"
        )


def _forward_ops(plan: _Plan, ctxs: list[OperationContext], input_: torch.Tensor,
                 groups: list[tuple[Any, ...]], recipe: Any, returned: list[list[bool]]):
    token = open_host_read_scope()  # ops fed by one split-size tensor copy it to the host once
    call = open_call_scope()  # per-call host caches (te_ops/call_scope.py)
    try:
        return _walk_forward(plan, ctxs, input_, groups, recipe, returned)
    finally:
        close_call_scope(call)
        close_host_read_scope(token)


def _fed(group: tuple[Any, ...], produced: dict[tuple[int, int], Any]) -> tuple[Any, ...]:
    """``group`` with each :class:`FedOutput` marker replaced by the output it names (``None``
    while not produced yet: a fused op covering producer and consumer wires it itself)."""
    if not any(isinstance(v, FedOutput) for v in group):
        return group
    return tuple(produced.get((v.op, v.output)) if isinstance(v, FedOutput) else v
                 for v in group)


def _walk_forward(plan: _Plan, ctxs: list[OperationContext], input_: torch.Tensor,
                  groups: list[tuple[Any, ...]], recipe: Any, returned: list[list[bool]]):
    x = input_
    extra_out: list[torch.Tensor] = []
    produced: dict[tuple[int, int], Any] = {}  # (op, output) -> an extra output of this call
    for op, idx in plan.forward_ops:
        x, op_extra = op.fuser_forward(
            [ctxs[i] for i in idx], x,
            basic_op_extra_inputs=[_fed(groups[i], produced) for i in idx], recipe=recipe,
        )
        for i, outs in zip(idx, op_extra):
            if len(outs) != plan.info.basic_ops[i].num_extra_outputs:
                raise RuntimeError(
                    f"{type(op).__name__} returned {len(outs)} extra outputs for basic op {i}, "
                    f"expected {plan.info.basic_ops[i].num_extra_outputs}"
                )
            for k, t in enumerate(outs):
                produced[(i, k)] = t
                if returned[i][k]:
                    extra_out.append(t)
    return x, extra_out


DOUBLE_BACKWARD_ERROR = (
    "te_ops does not compute higher-order gradients: a gradient taken with "
    "create_graph=True through a te_ops block cannot be differentiated again (the fused and "
    "unfused backward passes are not themselves differentiable). Compute the gradient "
    "penalty with a plain PyTorch implementation of the block instead."
)


def _refuse_double_backward(grads: tuple, anchors: Sequence[torch.Tensor] = ()) -> tuple:
    """Gradients for a backward under ``create_graph=True``: the same values, but marked as
    requiring grad through a node that raises :data:`DOUBLE_BACKWARD_ERROR` when
    differentiated, so a second-order gradient is never silently zero (a detached first-order
    gradient would make it so). ``anchors`` (``te_ops.double_backward.graph_anchors`` of the
    backward's context, taken before the backward ran) give that node edges to the forward's
    inputs, so ``torch.autograd.grad`` with respect to them
    (``torch.autograd.functional.hessian``) raises too."""
    positions = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
    if not positions:
        return grads
    marked = [grads[i].detach().requires_grad_(grads[i].is_floating_point())
              for i in positions]
    err = torch._C._functions.DelayedError(DOUBLE_BACKWARD_ERROR, len(marked) + len(anchors))
    wrapped = err(*marked, *anchors)
    wrapped = (wrapped if isinstance(wrapped, tuple) else (wrapped,))[:len(marked)]
    out = list(grads)
    for i, g in zip(positions, wrapped):
        out[i] = g
    return tuple(out)


def unpack_saved(ctx: Any, overwrote_input: bool) -> tuple:
    """``ctx.saved_tensors``; where an earlier backward of this node wrote over a saved
    activation (``overwrote_input``: the fused grouped-MLP backward puts dh over h), torch's
    in-place error is re-raised naming te_ops' reason and the switch that avoids it."""
    try:
        return ctx.saved_tensors
    except RuntimeError as exc:
        if not overwrote_input or "modified by an inplace operation" not in str(exc):
            raise
        raise RuntimeError(
            "te_ops: second backward through a retained graph (retain_graph=True) of a block "
            "whose fused grouped-MLP backward already ran: it writes the activation's gradient "
            "over the saved activation to save memory, so the graph cannot be backpropagated "
            "again. Set TE_OPS_FUSION_OFF=grouped_mlp_backward (unfused backward, keeps it) or run "
            f"the forward again (torch: {exc})") from exc


class _FuserFunction(torch.autograd.Function):
    """One autograd node for the whole op list."""

    @staticmethod
    def forward(ctx, input_, fuser, plan, recipe, requires_grad, input_grad, extra_grad,
                param_counts, groups, *params_and_extra):
        # ``groups``: the extra inputs per basic op, as split by the caller (the same objects
        # as the flat tail of ``params_and_extra``, which autograd sees as inputs; empty when
        # nothing takes part in backward).
        op_ctxs = [OperationContext() for _ in fuser.basic_ops]
        for i, c in enumerate(op_ctxs):
            c.requires_grad = requires_grad[i]
            c.input_requires_grad = requires_grad[i] if i else input_grad
            c.extra_inputs_requires_grad = extra_grad[i]
        out, extra_out = _forward_ops(plan, op_ctxs, input_, groups, recipe,
                                      fuser.returned_outputs)

        to_save: list[torch.Tensor | None] = []
        ranges = []
        for c in op_ctxs:
            saved = tuple(c.to_save or ())
            ranges.append((len(to_save), len(to_save) + len(saved)))
            to_save.extend(saved)
            c.to_save = None
        # A view made here (grad mode is off) of a tensor the caller may modify in place would
        # unpack as torch's "view created in no_grad mode" error: save its base and re-view it
        # in backward, so the version counter names the in-place op (as nn.Linear's does).
        # Views of tensors that need no grad (split offsets, the ops' own buffers) are saved
        # as they are: that error needs a base that requires grad.
        ctx.views = [None if t is None or not t._is_view() or not t._base.requires_grad else
                     (t.size(), t.stride(), t.storage_offset()) for t in to_save]
        ctx.save_for_backward(*[t._base if v is not None else t
                                for t, v in zip(to_save, ctx.views)])
        ctx.ranges = ranges
        ctx.op_ctxs = op_ctxs
        ctx.plan = plan
        ctx.fuser = fuser
        ctx.param_counts = param_counts
        ctx.extra_shapes = [v.shape if isinstance(v, torch.Tensor) else None
                            for g in groups for v in g]
        for t in extra_out:
            if not t.is_floating_point():
                ctx.mark_non_differentiable(t)
        # Not a view of an op's buffer: FSDP2 warns about (and in-place ops mishandle) views.
        return (out.detach(), *extra_out)

    @staticmethod
    def backward(ctx, *grad_outputs):
        create_graph = torch.is_grad_enabled()
        # Before the backward: it may bump a saved tensor's version (the fused backward's h),
        # after which the saved tensors no longer unpack.
        anchors = graph_anchors(ctx) if create_graph else ()
        with torch.no_grad():
            grads = _FuserFunction._backward(ctx, *grad_outputs)
        return _refuse_double_backward(grads, anchors) if create_graph else grads

    @staticmethod
    def _backward(ctx, grad_output, *grad_extra_outputs):
        fuser: OperationFuser = ctx.fuser
        overwrote = any(getattr(c, "overwrote_input", False) for c in ctx.op_ctxs)
        saved = [t if v is None else t.as_strided(*v)
                 for t, v in zip(unpack_saved(ctx, overwrote), ctx.views)]
        for c, (a, b) in zip(ctx.op_ctxs, ctx.ranges):
            c.saved_tensors = saved[a:b]
        # Gradients of each op's extra outputs: the caller's for returned outputs; for the
        # internal ones (fed to a later op) the sum of the consumers' input gradients, added
        # below as the consumers' backward runs (consumers come later, so run first).
        returned_grads = iter(grad_extra_outputs)
        grad_extra_groups: list[list] = [[next(returned_grads) if r else None for r in flags]
                                         for flags in fuser.returned_outputs]
        fed = fuser.signature.fed

        n_ops = len(fuser.basic_ops)
        grad_params: list[list[torch.Tensor | None]] = [[] for _ in range(n_ops)]
        grad_extra: list[list[torch.Tensor | None]] = [[] for _ in range(n_ops)]
        dx = grad_output
        for op, idx in reversed(ctx.plan.backward_ops):
            if not any(ctx.op_ctxs[i].requires_grad for i in idx):
                dx = None  # ops before the first one that needs grad
                break
            dx, op_grad_params, op_grad_extra = op.fuser_backward(
                [ctx.op_ctxs[i] for i in idx], dx,
                basic_op_grad_extra_outputs=[tuple(grad_extra_groups[i]) for i in idx],
            )
            for j, i in enumerate(idx):
                grad_params[i] = list(op_grad_params[j])
                grad_extra[i] = list(op_grad_extra[j])
                for slot, g in enumerate(grad_extra[i]):
                    source = fed.get((i, slot))
                    if source is None or g is None or source.op in idx:
                        continue
                    have = grad_extra_groups[source.op][source.output]
                    grad_extra_groups[source.op][source.output] = g if have is None else have + g
                    grad_extra[i][slot] = None  # not a Function input
        for c in ctx.op_ctxs:  # free activations as soon as possible
            c.saved_tensors = ()

        flat_grad_params = []
        for i, n in enumerate(ctx.param_counts):  # the forward's parameters
            op = fuser.basic_ops[i]
            gp = grad_params[i] or [None] * n
            if len(gp) != n:
                raise RuntimeError(
                    f"{type(op).__name__} returned {len(gp)} parameter grads, expected {n}"
                )
            flat_grad_params.extend(gp)
        flat_grad_extra = []
        for i, n in enumerate(fuser.signature.op_counts):
            ge = grad_extra[i] or [None] * n
            flat_grad_extra.extend(None if (i, j) in fed else g for j, g in enumerate(ge))
        # Gradients of extra tensor inputs take their input's shape (e.g. (B, S) probs).
        flat_grad_extra = [None if shape is None or g is None else
                           g if g.shape == shape else g.reshape(shape)
                           for g, shape in zip(flat_grad_extra, ctx.extra_shapes)]
        return (dx, *[None] * 8, *flat_grad_params, *flat_grad_extra)


#: ``torch._C._FunctionBase.apply`` bound to :class:`_FuserFunction`: what
#: ``torch.autograd.Function.apply`` calls when no functorch transform is active (its Python
#: part then only rebuilds the argument tuple; ``_FuserFunction`` has no ``setup_context``).
_APPLY = super(torch.autograd.Function, _FuserFunction).apply
