"""A per-fuser fast path for repeated eager training steps of the fused grouped MLP.

At decode sizes (E64 T256 on an H200) the eager step of ``GroupedLinear -> (Scaled)SwiGLU ->
GroupedLinear`` is host-bound: the GPU work takes ~0.5 ms, the host's Python ~1-1.5 ms. Most of
that Python re-derives, on every step, facts that only change when the call changes: input
checks, plan-cache keys, backend choices, op contexts, saved-context layouts and the flattening
of per-op gradients. This module remembers, per :class:`~te_ops.fuser.OperationFuser`, the last
call that took the fused forward *and* the fused backward (the general path ran it, so every
check passed and every decision was made), together with what the call's result depends on
(its *key*: input, split-size and probs metadata, parameter objects, op settings, environment,
fusion registry). A later call with the same key runs :class:`_FastGroupedMLP`: the same
kernels with the same arguments, in the same order, as ``ForwardGroupedMLP`` /
``BackwardGroupedMLP`` (so the outputs and gradients are bitwise those of the general path),
without the per-call checks and layout objects. Any difference in the key sends the call down
the general path, which raises the same errors as before for bad input and records a new key.

Taken only when all of this holds (else the general path runs, unchanged):

* ``TE_OPS_FAST_STEP=1`` (the default; ``0`` turns the fast path off);
* the fuser is exactly ``GroupedLinear, SwiGLU or ScaledSwiGLU, GroupedLinear`` (these exact
  classes), planned as one fused forward and one fused backward;
* no bias, no ``accumulate_into_main_grad``, no ``delay_wgrad_compute``, no recipe
  (``te_ops.autocast``), no ``torch.autocast`` on the input's device, no
  ``recompute_input=True`` on the activation (the general path recomputes fc1's output);
* grad mode on, every weight requires grad, no functorch transform, not traced by
  ``torch.compile``, not inside a CUDA-graph capture, no saved-tensor hooks
  (``torch.autograd.graph.saved_tensors_hooks``: non-reentrant activation checkpointing,
  offloading), since the fast path saves other tensors than the general path;
* a 2-D input (tokens, in_features) of type ``torch.Tensor``, split sizes as one 1-D device
  tensor passed to fc1 and fc2 (the same object), 1-D probs;
* the grouped GEMM backend is ``grouped_mm`` or ``triton`` (no host read of split sizes).

Autograd sees the same inputs as on the general path (the input, one edge per weight
parameter, probs), so hooks, ``AccumulateGrad`` and DDP behave as before. An in-place change
of a weight between forward and backward raises as before: a single grouped weight is a saved
tensor; per-expert weights whose stack is a free view of one buffer (the normal case, see
``stack_weights``) are not saved one by one (256 saved tensors at 128 experts cost host time
to save and to unpack): the forward records their version counters and the backward compares
them, raising the ``RuntimeError`` autograd raises for a modified saved tensor. The fast path
is graph-safe (no host read), but a CUDA-graph capture takes the general path (host work does
not count in a graph, so the captured graph stays what it was); ``torch.compile`` traces the
general path too.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch

from . import env
from .basic.grouped_linear import GroupedLinear, per_param, stacked
from .basic.swiglu import ScaledSwiGLU, SwiGLU, swiglu_backward, swiglu_forward
from .gemm import fc1_swiglu_reason as fc1_epilogue_reason
from .gemm import large_fused_launch
from .kernels import swiglu_triton
from .gemm import (
    grouped_dgrad,
    grouped_fprop,
    grouped_wgrad,
    stack_weights,
    storage_spans,
)
from .gemm.grouped_gemm_large_bound import BoundLarge, BoundLargeWgrad
from .gemm.grouped_gemm_triton import BoundRows, BoundWgrad
from .gemm.grouped_mlp_triton import BoundFc1Swiglu
from .kernels.split_table import BoundSplitTable
from .kernels.triton_launch import LaunchBatch
from .quantization.autocast import current_recipe
from .tracing import tracing
from .shapes import rows_2d
from .splits import GroupedSplits, make_splits

__all__ = ["FastStep", "record", "fast_step_reason"]

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_VERSION = operator.attrgetter("_version")
_DATA_PTR = torch.Tensor.data_ptr
_CONTIGUOUS = torch.Tensor.is_contiguous
_DTYPE = operator.attrgetter("dtype")
_SIZE = torch.Tensor.size
_FAST_BACKENDS = ("grouped_mm", "triton")
#: The innermost ``torch.autograd.graph.saved_tensors_hooks`` pair (``None`` when none is
#: active); without this torch binding the fast path is never taken.
_TOP_SAVED_TENSORS_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks",
                                   None)


def _op_settings(fc1: GroupedLinear, act: SwiGLU, fc2: GroupedLinear) -> tuple:
    """The op attributes the fast path's math depends on (a user may change them between
    calls; a change sends the call down the general path)."""
    return (fc1.single_grouped_weight, fc1.has_bias, fc1.accumulate_into_main_grad,
            fc1.delay_wgrad_compute, fc2.single_grouped_weight, fc2.has_bias,
            fc2.accumulate_into_main_grad, fc2.delay_wgrad_compute, act.glu_interleave_size,
            act.recompute_input)


def _gemm_calls(backend: Any, batch: LaunchBatch | None = None) -> tuple:
    """``fprop(x, w, splits)``, ``dgrad(dy, w, splits)``, ``wgrad(x, dy, splits)``: the calls
    ``grouped_fprop`` / ``grouped_dgrad`` / ``grouped_wgrad`` make for ``backend`` (no recipe:
    no quantized operand). With a ``batch``, the kinds it runs in Triton are bound call sites
    of the kernels (``BoundRows`` / ``BoundWgrad`` for the few-rows kernels, ``BoundLarge`` /
    ``BoundLargeWgrad`` for the persistent many-rows ones: the eager Triton calls' kernels,
    configs and bits without the per-call argument checks, config, TMA layout decision, grid
    and launch binding, which the call's key proves: a call with that key passed the checks
    on the general path). Without one: always the dispatching calls (their Triton kinds
    become ``torch.compile``'s custom ops while a trace runs)."""
    kinds = backend.triton_kinds if batch is not None else ()
    large = backend.large_kinds if batch is not None else ()

    def bound(kind, call):
        if kind in kinds:
            site = BoundWgrad(batch) if kind == "wgrad" else BoundRows(kind, batch)
        elif kind in large and kind not in backend.gluon_kinds:  # Gluon: the dispatching call
            site = BoundLargeWgrad(batch) if kind == "wgrad" else BoundLarge(kind, batch)
        else:
            return functools.partial(call, backend=backend)

        def run(a, b, splits):
            return site(a, b, splits.offsets)
        return run

    return (bound("fprop", grouped_fprop), bound("dgrad", grouped_dgrad),
            bound("wgrad", grouped_wgrad))


def _activation_calls(backend: Any, interleave: int | None,
                      batch: LaunchBatch | None = None) -> tuple:
    """``forward(h, probs)`` and ``backward(h, dy, probs) -> (dh over h, dprobs, output)``:
    the calls ``swiglu_forward`` / ``swiglu_backward(with_output=True, grad_into_input=True,
    output_into_grad=True)`` make for ``backend`` (Triton with a ``batch``: bound call sites
    of the kernels, without the trace test; the fast path's forward never runs under a trace,
    its backward does under compiled autograd: no ``batch`` gives the dispatching calls for
    that)."""
    if batch is not None and backend.name == "triton":
        return swiglu_triton.BoundForward(batch), swiglu_triton.BoundBackward(batch)

    def forward(h, probs):
        return swiglu_forward(h, interleave, probs, backend)

    def backward(h, dy, probs):
        return swiglu_backward(h, dy, interleave, probs, with_output=True, backend=backend,
                               grad_into_input=True, output_into_grad=True)
    return forward, backward


def _fc1_activation_call(fprop1: Any, act_forward: Any, epilogue: bool,
                         batch: LaunchBatch, large: bool = False) -> Any:
    """``fc1_act(x, w1, splits, probs) -> (h, a)``: fc1's fprop and the activation forward as
    the general path ran them for the recorded call (``epilogue``: one fused Triton launch,
    ``fused/fc1_epilogue.py``, through a bound call site of ``batch``, or with ``large``, fc1's
    fprop in the persistent kernel, ``fc1_epilogue.large_fused_launch``: the Gluon or the
    persistent Triton kernel's fused launch, as the general path; else the two calls)."""
    if epilogue and large:
        def fc1_act(x, w1, splits, probs):
            return large_fused_launch(x, w1, splits.offsets, probs)
    elif epilogue:
        site = BoundFc1Swiglu(batch)

        def fc1_act(x, w1, splits, probs):
            return site(x.contiguous(), w1, splits.offsets,
                        None if probs is None else probs.contiguous())
    else:
        def fc1_act(x, w1, splits, probs):
            h = fprop1(x, w1, splits)
            return h, act_forward(h, probs)
    return fc1_act


def _tensor_meta(t: torch.Tensor) -> tuple:
    return (t.shape, t.dtype, t.device, t.requires_grad)


class FastStep:
    """What one fuser's fast path needs: the key of the recorded call and its decisions.

    Built by :func:`record` after a general-path call; :meth:`run` runs a call with the same
    key, or returns ``None`` (nothing run) for the general path to take it.
    """

    def __init__(self, fuser: Any, key: tuple, registry_version: int, env_snapshot: tuple,
                 weights1: list[torch.Tensor], weights2: list[torch.Tensor],
                 backend1: Any, backend_act: Any, backend2: Any,
                 fc1_epilogue: bool = False) -> None:
        from .fuser import _REGISTRY_VERSION

        self.registry = _REGISTRY_VERSION  # the fuser's counter (a list: read [0] per call)
        self.ops = tuple(fuser.basic_ops)
        self.scaled = type(self.ops[1]) is ScaledSwiGLU
        self.key = key
        self.registry_version = registry_version
        self.env_snapshot = env_snapshot
        self.weights1 = weights1
        self.weights2 = weights2
        self.params = (*weights1, *weights2)
        self.layer1 = _LayerWeights(weights1, self.ops[0].single_grouped_weight, "fc1")
        self.layer2 = _LayerWeights(weights2, self.ops[2].single_grouped_weight, "fc2")
        self.backend1 = backend1
        self.backend_act = backend_act
        self.backend2 = backend2
        # Bound kernel call sites (te_ops/kernels/triton_launch.py): one launch batch per
        # recorded call, checked once per forward and per backward (LaunchBatch.begin).
        self.launches = LaunchBatch()
        self.split_table = BoundSplitTable(self.launches)
        self.fprop1, self.dgrad1, self.wgrad1 = _gemm_calls(backend1, self.launches)
        self.fprop2, self.dgrad2, self.wgrad2 = _gemm_calls(backend2, self.launches)
        self.act_forward, self.act_backward = _activation_calls(
            backend_act, self.ops[1].glu_interleave_size, self.launches)
        self.fc1_act = _fc1_activation_call(self.fprop1, self.act_forward, fc1_epilogue,
                                            self.launches, "fprop" in backend1.large_kinds)
        # The backward's calls while Dynamo traces it (compiled autograd): the dispatching
        # ones, whose Triton kinds are custom ops under a trace (the bound call sites would
        # trace into the direct launcher: a graph break, an error under fullgraph).
        self.traced_backward_calls = (
            *_gemm_calls(backend1)[1:], *_gemm_calls(backend2)[1:],
            _activation_calls(backend_act, self.ops[1].glu_interleave_size)[1])

    def __reduce__(self) -> tuple:
        """A copy of a block (``copy.deepcopy``, ``pickle``, ``torch.save``) holds no recorded
        call: the key holds the parameters' ids, so a copied record could never match the
        copy's parameters, and the bound sites (thread-local launch state, closures) do not
        pickle. The copy's first call takes the general path and records its own."""
        return (_no_fast_step, ())

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def call_key(self, input_: torch.Tensor, extra_inputs: tuple) -> tuple | None:
        """The key of a call (``None`` when its form cannot take the fast path)."""
        fc1, act, fc2 = self.ops
        if self.scaled:
            if len(extra_inputs) != 3:
                return None
            split, probs, split2 = extra_inputs
            if type(probs) is not torch.Tensor:
                return None
            probs_meta = _tensor_meta(probs)
        else:
            if len(extra_inputs) != 2:
                return None
            split, split2 = extra_inputs
            probs_meta = None
        if (split2 is not split or type(split) is not torch.Tensor
                or type(input_) is not torch.Tensor):
            return None
        # The weights' dtype and device as the input checks read them (``.to()`` keeps the
        # Parameter objects): a moved or cast block takes the general path and its errors.
        # Their shapes too (``param.data = t`` keeps the object): the general path's output
        # reshape raises for a new out_features, where the fast path would return the GEMM's
        # other-shaped output (stacking per-expert weights checks the other experts' shapes).
        w1, w2 = self.weights1[0], self.weights2[0]
        return (_tensor_meta(input_), split.shape, split.dtype, split.device, probs_meta,
                tuple(map(id, fc1._parameters.values())),
                tuple(map(id, fc2._parameters.values())), _op_settings(fc1, act, fc2),
                w1.dtype, w1.device, w1.shape, w2.dtype, w2.device, w2.shape,
                self.weights1[-1].shape, self.weights2[-1].shape)

    def run(self, input_: torch.Tensor, extra_inputs: tuple) -> torch.Tensor | None:
        """The fuser's output for this call through :class:`_FastGroupedMLP`, or ``None``
        when the call differs from the recorded one (the caller then takes the general
        path)."""
        if (not torch.is_grad_enabled() or current_recipe() is not None
                or torch._C._are_functorch_transforms_active()
                or self.registry_version != self.registry[0]
                or env.snapshot() != self.env_snapshot):  # values (the same object: fast)
            return None
        device_type = input_.device.type if type(input_) is torch.Tensor else None
        if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
            return None
        # Saved-tensor hooks (non-reentrant checkpointing, offloading) see every saved tensor:
        # under them the general path runs, so a checkpoint's recomputation saves what its
        # original forward saved (torch compares the two).
        if _TOP_SAVED_TENSORS_HOOKS is None or _TOP_SAVED_TENSORS_HOOKS(False) is not None:
            return None
        # CUDA-graph capture takes the general path: host work does not count there, and the
        # captured graph stays the general path's (measured as before; same kernels anyway).
        if device_type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if self.call_key(input_, extra_inputs) != self.key:
            return None
        probs = extra_inputs[1] if self.scaled else None
        if device_type == "cuda":
            self.launches.begin(input_.device)
        try:
            return _APPLY(input_, self, extra_inputs[0], probs, *self.params)
        except (ValueError, _NotFast):
            # A check the key does not cover failed: a weight that does not require grad
            # (``_NotFast``, checked in the forward from autograd's ``needs_input_grad``), or
            # a per-group weight after the first cast or moved alone (the key holds the first
            # weight's dtype and device; stacking the others checks them, as on the general
            # path). The general path then runs (and raises its own error); nothing of the
            # fast forward outlives it.
            return None


def _no_fast_step() -> None:
    """What a pickled :class:`FastStep` loads as: nothing recorded (see ``__reduce__``)."""
    return None


def fast_step_reason(fuser: Any, plan: Any, input_: Any, groups: list, recipe: Any,
                     requires_grad: list[bool]) -> str | None:
    """Why a general-path call of ``fuser`` is not recorded for the fast path (``None``: it
    is). The checks that do not depend on the call's tensors' metadata (which the key
    holds)."""
    if not env.read_bool("TE_OPS_FAST_STEP"):
        return "TE_OPS_FAST_STEP=0"
    ops = fuser.basic_ops
    if len(ops) != 3 or type(ops[0]) is not GroupedLinear or type(ops[2]) is not GroupedLinear \
            or type(ops[1]) not in (SwiGLU, ScaledSwiGLU):
        return "not exactly GroupedLinear, SwiGLU / ScaledSwiGLU, GroupedLinear"
    from .fused.grouped_mlp import BackwardGroupedMLP, ForwardGroupedMLP

    if (len(plan.forward_ops) != 1 or type(plan.forward_ops[0][0]) is not ForwardGroupedMLP
            or len(plan.backward_ops) != 1
            or type(plan.backward_ops[0][0]) is not BackwardGroupedMLP):
        return "not planned as one fused forward and one fused backward"
    fc1, act, fc2 = ops
    if fc1.has_bias or fc2.has_bias:
        return "a bias"
    if (fc1.accumulate_into_main_grad or fc1.delay_wgrad_compute
            or fc2.accumulate_into_main_grad or fc2.delay_wgrad_compute):
        return "main_grad or delayed wgrad"
    if recipe is not None:
        return "a recipe"
    if act.recompute_input:  # the general path implements it (te_ops/fused/fc1_recompute.py)
        return "recompute_input (fc1 recompute)"
    if not all(requires_grad) or tracing() or input_.dim() != 2:
        return "not every op needs grad, or traced, or not a 2-D input"
    if type(ops[1]) is ScaledSwiGLU and (not isinstance(groups[1][0], torch.Tensor)
                                         or groups[1][0].dim() != 1):
        return "probs not a 1-D tensor"
    if not isinstance(groups[0][0], torch.Tensor) or groups[0][0] is not groups[2][0]:
        return "split sizes not one device tensor shared by fc1 and fc2"
    return None


def record(fuser: Any, plan: Any, input_: torch.Tensor, extra_inputs: tuple, groups: list,
           recipe: Any, requires_grad: list[bool], output: torch.Tensor) -> FastStep | None:
    """After a general-path call that ran ``plan``: the fast path for calls like it (``None``
    when this call cannot be repeated on it, see :func:`fast_step_reason`). The backends are
    the ones the call chose, read from its autograd node's op contexts."""
    from .fuser import _REGISTRY_VERSION

    if fast_step_reason(fuser, plan, input_, groups, recipe, requires_grad) is not None:
        return None
    node = output.grad_fn
    ctxs = getattr(node, "op_ctxs", None)
    if ctxs is None:
        return None
    backend1 = ctxs[0].grouped_linear_layout["backend"]
    backend2 = ctxs[2].grouped_linear_layout["backend"]
    if backend1.name not in _FAST_BACKENDS or backend2.name not in _FAST_BACKENDS:
        return None
    backend_act = ctxs[1].swiglu_layout["backend"]
    fc1, act, fc2 = fuser.basic_ops
    weights1, _ = fc1._param_lists()
    weights2, _ = fc2._param_lists()
    if not all(map(_REQUIRES_GRAD, (*weights1, *weights2))):
        return None
    epilogue = fc1_epilogue_reason(backend1, backend_act, recipe, fc1.has_bias,
                                   act.glu_interleave_size,
                                   input_.shape[0] / max(fc1.num_groups, 1), input_.device,
                                   features=(fc1.in_features, fc1.out_features),
                                   dtype=input_.dtype) is None
    step = FastStep(fuser, (), _REGISTRY_VERSION[0], env.snapshot(), list(weights1),
                    list(weights2), backend1, backend_act, backend2, fc1_epilogue=epilogue)
    key = step.call_key(input_, extra_inputs)
    if key is None:
        return None
    step.key = key
    return step


def _save(ctx: Any, tensors: list[torch.Tensor | None], params: list[torch.Tensor]) -> None:
    """``save_for_backward(*tensors, *params)`` with the general path's handling of views
    (see ``te_ops.fuser._FuserFunction.forward``): a view of a tensor that requires grad is
    saved as its base and re-viewed in backward, so an in-place change names the in-place op.
    ``params`` are leaves (never views): saved as they are."""
    ctx.views = [None if t is None or not t._is_view() or not t._base.requires_grad else
                 (t.size(), t.stride(), t.storage_offset()) for t in tensors]
    ctx.save_for_backward(*[t._base if v is not None else t
                            for t, v in zip(tensors, ctx.views)], *params)


#: ``_LayerWeights.check``'s message under a trace (where a runtime assert carries none).
_MODIFIED = ("one of the variables needed for gradient computation has been modified by an "
             "inplace operation: a per-expert weight of the fused grouped MLP (changed in "
             "place between the forward and the backward)")


class _NotFast(Exception):
    """Raised by the fast forward, before any work, for a call the general path must take."""


class _LayerWeights:
    """One GroupedLinear's weight Parameters as the fast path uses them.

    ``stacked()`` is ``stacked(weights, single)`` (the same tensor: the single grouped weight,
    or ``stack_weights``' free (G, out, in) view of adjacent per-expert weights, or its
    stacked copy), without ``stack_weights``' per-call memo key (2 x G ids hashed) once a call
    found the view: then the check is the weights' data pointers (a ``.data`` re-assignment
    moves them), their contiguity (``weight.data = weight.data.t()`` of a square weight keeps
    the pointer and the shape, not the strides), their dtypes and shapes (``weight.data =
    weight.data.view(torch.float16)`` or ``.view(in, out)`` keeps the pointer and the
    contiguity; ``stack_weights`` then raises as on the general path) and weight0's storage
    span (weights re-allocated one by one may sit at the old addresses in storages of their
    own).

    ``to_save(w)``: what the forward keeps for the backward. Per-expert weights stacked as a
    free view: weight0 as the one saved tensor (autograd checks its version counter, which
    GroupedLinear's weights share as slices of one buffer, also under compiled autograd), the
    view itself as a plain reference for dgrad (as ``GroupedLinearSaved.weights_view``) and
    the weights' version counters (autograd's record of in-place changes), which the backward
    compares (``check``) in place of one saved tensor per weight (so a weight with a counter
    of its own, e.g. re-assigned and packed again, is covered too).
    """

    __slots__ = ("weights", "single", "name", "ptrs", "dtypes", "sizes")

    def __init__(self, weights: list[torch.Tensor], single: bool, name: str) -> None:
        self.weights = tuple(weights)
        self.single = single
        self.name = name  # "fc1" / "fc2", for the in-place error
        self.ptrs: list[int] | None = None
        self.dtypes: list[torch.dtype] = []
        self.sizes: list[torch.Size] = []

    def stacked(self) -> torch.Tensor:
        ws = self.weights
        if self.single:
            return ws[0]
        w0 = ws[0]
        n = len(ws)
        if (self.ptrs is not None and list(map(_DATA_PTR, ws)) == self.ptrs
                and all(map(_CONTIGUOUS, ws)) and list(map(_DTYPE, ws)) == self.dtypes
                and list(map(_SIZE, ws)) == self.sizes
                and storage_spans(w0, n * w0.numel() * w0.element_size())):
            return w0.as_strided((n, *w0.shape), (w0.numel(), *w0.stride()))
        w = stack_weights(list(ws), "weight")  # raises ValueError for odd weights
        self.ptrs = list(map(_DATA_PTR, ws)) if w._is_view() else None
        self.dtypes = list(map(_DTYPE, ws))
        self.sizes = list(map(_SIZE, ws))
        return w

    def to_save(self, w: torch.Tensor) -> tuple:
        """``(saved, view, params, versions)`` for the forward stack ``w``: the tensor to
        save (the single grouped weight, or weight0 of a free view; ``None`` for a stacked
        copy), the view for dgrad (``None`` unless a free view), the weights to save (a stacked
        copy's, restacked in backward) and the per-expert weights' versions (``None`` unless a
        free view)."""
        if self.single:
            return w, None, (), None
        if not w._is_view():
            return None, None, self.weights, None
        return self.weights[0], w, (), tuple(map(_VERSION, self.weights))

    def check(self, versions: tuple[int, ...]) -> None:
        """Raise autograd's error for a modified saved tensor when a weight's version moved
        since the forward (``versions``). Under a trace (compiled autograd traces the
        backward) each comparison is a ``torch._check``: a runtime assert in the graph, which
        raises torch's "Runtime assertion failed" ``RuntimeError`` without the weight's name
        (a Python branch on a traced version would break the graph, an error under
        ``fullgraph``)."""
        if tracing():
            for w, v in zip(self.weights, versions):
                torch._check(w._version == v, lambda: _MODIFIED)
            return
        now = tuple(map(_VERSION, self.weights))
        if now == versions:
            return
        moved = [i for i, (a, b) in enumerate(zip(now, versions)) if a != b]
        g = moved[0]
        w = self.weights[g]
        which = f"weight{g}" if len(moved) == 1 else (
            f"weight{g} (and {len(moved) - 1} more of its weights: per-expert weights that "
            f"are slices of one buffer share one version counter, so a change to any of "
            f"them moves all)")
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: {self.name}'s {which} [{w.type()} {list(w.shape)}] is at "
            f"version {now[g]}; expected version {versions[g]} instead (changed in place "
            f"between the forward and the backward)")


class _FastGroupedMLP(torch.autograd.Function):
    """The fused grouped MLP forward and backward of a recorded call (see module docstring):
    the calls of ``ForwardGroupedMLP.fuser_forward`` and ``BackwardGroupedMLP.fuser_backward``
    without a recipe, a bias or a training policy."""

    @staticmethod
    def forward(ctx, input_, step, split_sizes, probs, *params):
        if False in ctx.needs_input_grad[4:]:  # a weight that does not require grad
            raise _NotFast
        fc1, act, fc2 = step.ops
        rows = input_.shape[0]
        splits = make_splits(split_sizes, fc1.num_groups, rows, input_.device,
                             table=step.split_table)
        x2d = rows_2d(input_, fc1.in_features)  # the input itself when contiguous
        w1 = step.layer1.stacked()
        h, a = step.fc1_act(x2d, w1, splits, probs)
        w2 = step.layer2.stacked()
        y = step.fprop2(a, w2, splits)
        # The weights for dgrad: a single grouped weight (saved), per-expert weights' free
        # view (a plain reference; weight0 saved and every weight's version counter compared
        # in backward, in place of one saved tensor per weight: _LayerWeights.to_save), or the
        # per-expert weights themselves when their stack was a copy (restacked in backward).
        save1, ctx.w1_view, params1, versions1 = step.layer1.to_save(w1)
        save2, ctx.w2_view, params2, versions2 = step.layer2.to_save(w2)
        _save(ctx, [x2d, h, probs, *splits.to_tensors(), save1, save2], [*params1, *params2])
        ctx.step = step
        ctx.n1 = len(params1)
        ctx.versions = (versions1, versions2)
        ctx.rows = rows
        ctx.has_padding = splits.has_padding
        return y.detach()

    @staticmethod
    def backward(ctx, grad_output):
        from .double_backward import graph_anchors
        from .fuser import _refuse_double_backward

        create_graph = torch.is_grad_enabled()
        anchors = graph_anchors(ctx) if create_graph else ()  # before h's version moves
        with torch.no_grad():
            grads = _fast_backward(ctx, grad_output)
        return _refuse_double_backward(grads, anchors) if create_graph else grads


def _fast_backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
    step = ctx.step
    if tracing():  # compiled autograd traces this backward
        dgrad1_fn, wgrad1_fn, dgrad2_fn, wgrad2_fn, act_fn = step.traced_backward_calls
    else:
        if grad_output.is_cuda:
            step.launches.begin(grad_output.device)
        dgrad1_fn, wgrad1_fn, dgrad2_fn, wgrad2_fn, act_fn = (
            step.dgrad1, step.wgrad1, step.dgrad2, step.wgrad2, step.act_backward)
    fc1, _, fc2 = step.ops
    versions1, versions2 = ctx.versions
    if versions1 is not None:
        step.layer1.check(versions1)
    if versions2 is not None:
        step.layer2.check(versions2)
    dy = rows_2d(grad_output, fc2.out_features)  # e.g. the expanded gradient of out.sum()
    saved = ctx.saved_tensors
    x, h, probs, *split_tensors, w1, w2 = [
        t if v is None else t.as_strided(*v) for t, v in zip(saved, ctx.views)]
    splits = GroupedSplits.from_tensors(split_tensors, num_groups=fc1.num_groups,
                                        num_rows=ctx.rows, host_sizes=None,
                                        has_padding=ctx.has_padding)
    params = saved[len(ctx.views):]
    n1 = ctx.n1
    single1, single2 = fc1.single_grouped_weight, fc2.single_grouped_weight
    if ctx.w2_view is not None:
        w2 = ctx.w2_view
    elif w2 is None:
        w2 = stacked(list(params[n1:]), single2)
    dgrad2 = dgrad2_fn(dy, w2, splits)
    # One activation-backward pass: dh over h, the activation output over dgrad2 (as the
    # fused backward; h's version is bumped, so a retained graph's second backward
    # raises).
    dh, gprobs, act_out = act_fn(h, dgrad2, probs)
    del dgrad2
    w2 = None
    torch.autograd.graph.increment_version(h)
    del h
    grads2 = per_param(wgrad2_fn(act_out, dy, splits), single2)
    act_out = None
    dx = None
    if ctx.needs_input_grad[0]:
        if ctx.w1_view is not None:
            w1 = ctx.w1_view
        elif w1 is None:
            w1 = stacked(list(params[:n1]), single1)
        dx = dgrad1_fn(dh, w1, splits)
    w1 = ctx.w1_view = ctx.w2_view = None
    grads1 = per_param(wgrad1_fn(x, dh, splits), single1)
    return (dx, None, None, gprobs, *grads1, *grads2)


#: ``_FastGroupedMLP``'s C-level apply (as ``te_ops.fuser._APPLY``: no functorch transform is
#: active when the fast path runs).
_APPLY = super(torch.autograd.Function, _FastGroupedMLP).apply
