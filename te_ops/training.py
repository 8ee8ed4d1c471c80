"""Training-framework integration: Megatron ``main_grad`` and delayed weight gradients.

Every op that produces weight gradients, fused or not, hands them to this module through
:func:`weight_and_bias_grads`; ops never read or write the Megatron attributes themselves.
See docs/training_integration.md for the contract.

Megatron attributes read and written (on each weight ``Parameter``)
-------------------------------------------------------------------
``main_grad`` (read)
    The tensor the weight gradient is added into: the weight's shape (or any shape with the
    same number of elements that can be *viewed* as it), usually fp32 while the weight is
    bf16. Strided views of a larger buffer work as long as that view exists. A parameter with
    ``__fsdp_param__`` and ``get_main_grad()`` (Megatron-FSDP) gets
    ``main_grad = get_main_grad()`` first.
``overwrite_main_grad`` (read, default False)
    Write the gradient over ``main_grad`` instead of adding to it.
``grad_added_to_main_grad`` (written: ``True``)
    Tells Megatron's gradient hook that the gradient is already in ``main_grad``.

What autograd gets for such a weight: ``None``. ``.grad`` stays untouched (no weight-sized
tensor is allocated for it), and autograd still runs the weight's ``AccumulateGrad`` node, so
hooks registered on it (Megatron's "gradient ready" hook on ``grad_fn.next_functions``, and
``register_post_accumulate_grad_hook``) fire as usual (tests/test_training.py checks this).
TransformerEngine returns a weight-shaped dummy instead; with ``None`` nothing has to be
allocated or cleared. Biases keep the ordinary ``.grad`` path.

Delayed wgrad (``delay_wgrad_compute=True``)
--------------------------------------------
Backward computes the input gradient (and the probs gradient) only; the weight and bias
gradients' inputs (the layer's input rows, the output gradient, split metadata) are queued on
the op, and autograd gets ``None`` for its weights and biases. :func:`backward_dw` (called by
``GroupedLinear.backward_dw()`` and ``Sequential.backward_dw()``) drains the queue in order:
weights into ``main_grad`` (under the rules above) or ``.grad``, biases into ``.grad``, each
*added* to what is there, so parameters shared by several ops accumulate all contributions.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from .gemm import BackendChoice, RowGather, grouped_wgrad, grouped_wgrad_into
from .quantization.autocast import quantize_operand
from .splits import GroupedSplits

if TYPE_CHECKING:
    from .basic.grouped_linear import GroupedLinearSaved

__all__ = [
    "WgradPolicy",
    "main_grad_target",
    "weight_and_bias_grads",
    "backward_dw",
    "backward_dw_all",
    "reducing_wrapper",
    "main_grads_restored",
]


@dataclass(eq=False)
class WgradPolicy:
    """How an op's weight gradients leave backward; one per op, shared by its saved contexts.

    Attributes
    ----------
    owner : str
        The op's description, for error messages.
    weight_names, bias_names : list[str]
        Parameter names (``weight0..`` or ``weight``), in the saved layout's order.
    accumulate_into_main_grad, delay_wgrad_compute : bool
        The op's options of those names.
    pending : deque
        Queued wgrad jobs (delayed wgrad), drained by :func:`backward_dw`.
    weights, biases : list[torch.nn.Parameter]
        Set per forward call by :meth:`for_call`: the Parameter objects themselves. Saved
        tensors may come back as other Python objects (``torch.utils.checkpoint``, saved-tensor
        hooks), which lack ``main_grad`` and the other attributes, so these are used instead.
    """

    owner: str
    weight_names: list[str]
    bias_names: list[str]
    accumulate_into_main_grad: bool = False
    delay_wgrad_compute: bool = False
    pending: deque = field(default_factory=deque)
    weights: list[torch.Tensor] = field(default_factory=list)
    biases: list[torch.Tensor] = field(default_factory=list)

    def for_call(self, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> WgradPolicy:
        """A copy for one forward call holding that call's Parameter objects (the queue of
        delayed jobs stays shared).

        Raises
        ------
        RuntimeError
            ``delay_wgrad_compute=True`` on parameters that a data-parallel wrapper reduces
            during backward (:func:`reducing_wrapper`).
        """
        if self.delay_wgrad_compute:  # (called only by forwards that save for backward)
            wrapper = reducing_wrapper([*weights, *biases])
            if wrapper is not None:
                raise RuntimeError(
                    f"{self.owner}: delay_wgrad_compute=True under {wrapper}, which reduces "
                    "gradients during backward; backward_dw() computes them after it, so each "
                    "rank would keep its own unreduced gradient. Use delay_wgrad_compute=False "
                    "with torch's data-parallel wrappers (or run every micro-batch under "
                    "DistributedDataParallel.no_sync() and all-reduce the gradients yourself "
                    "after backward_dw()); Megatron's DDP reduces main_grad after backward_dw() "
                    "(docs/training_integration.md)")
        return replace(self, weights=list(weights), biases=list(biases))


def reducing_wrapper(params: list[torch.Tensor]) -> str | None:
    """The torch data-parallel wrapper that reduces gradients of ``params`` during backward,
    or ``None``: ``DistributedDataParallel`` (inside its forward, gradient sync on, a
    parameter of its module not ignored) or ``FullyShardedDataParallel`` (flattened
    parameters). ``fully_shard`` (FSDP2) is caught in :func:`backward_dw` (its unsharded
    parameters are freed after backward)."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        return None
    ddp = torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()
    if ddp is not None and ddp.require_backward_grad_sync:
        reduced = ddp.__dict__.get("_te_ops_reduced_params")
        if reduced is None:  # the parameters DDP's reducer owns (ignored ones excluded)
            reduced = ddp.__dict__["_te_ops_reduced_params"] = {
                id(p) for p in getattr(ddp, "_module_parameters", ddp.module.parameters())}
        if any(id(p) in reduced for p in trainable):
            return "torch.nn.parallel.DistributedDataParallel"
    if any(getattr(p, "_fsdp_flattened", False) for p in trainable):
        return "torch.distributed.fsdp.FullyShardedDataParallel"
    return None


@dataclass(eq=False)
class _WgradJob:
    """What a delayed wgrad needs (tensors kept alive until :func:`backward_dw`)."""

    x: torch.Tensor | None
    dy: torch.Tensor
    splits: GroupedSplits
    backend: BackendChoice
    weights: list[torch.Tensor]
    biases: list[torch.Tensor]
    probs: torch.Tensor | None
    single: bool
    recipe: Any = None  # the forward's low-precision recipe: wgrad quantizes dy with it
    dy_q: Any = None  # dy already quantized column-wise (with its row-wise copy, for dgrad)
    versions: tuple = ()  # (name, tensor, version) of x and probs when queued: see _check_versions

    def __setstate__(self, state: dict) -> None:
        # deepcopy / pickle make new tensors whose version counters start elsewhere: record
        # the copies' versions (the copy holds the values the original job was queued with).
        state["versions"] = tuple((n, t, t._version) for n, t, _ in state.get("versions", ()))
        self.__dict__.update(state)


# ------------------------------------------------------------------------------ main_grad
def main_grad_target(param: torch.Tensor, name: str, shape: tuple[int, ...],
                     owner: str = "") -> torch.Tensor:
    """``param.main_grad`` viewed as ``shape`` (the weight's, or (G, N, K) for a group).

    ``name`` is the parameter's name and ``owner`` the op's description; errors start with
    ``"{owner}: "`` and name ``{name}.main_grad``.

    Raises
    ------
    AttributeError
        ``param`` has no ``main_grad`` (message names the parameter).
    TypeError
        ``main_grad`` is not a floating-point tensor.
    ValueError
        ``main_grad`` is on another device than ``param`` (a meta buffer would drop the
        gradient), wrong number of elements, or its strides do not allow a view as ``shape``;
        the message names the parameter, the expected and the actual value.
    """
    where = f"{owner}: " if owner else ""
    if hasattr(param, "__fsdp_param__") and callable(getattr(param, "get_main_grad", None)):
        param.main_grad = param.get_main_grad()  # Megatron-FSDP allocates it on demand
    main_grad = getattr(param, "main_grad", None)
    if main_grad is None:
        raise AttributeError(
            f"{where}accumulate_into_main_grad=True needs {name}.main_grad (a tensor with "
            f"{name}'s {tuple(param.shape)} elements, e.g. Megatron's fp32 gradient buffer), "
            "got none"
        )
    if not isinstance(main_grad, torch.Tensor) or not main_grad.is_floating_point():
        raise TypeError(f"{where}{name}.main_grad must be a floating-point tensor, got "
                        f"{getattr(main_grad, 'dtype', type(main_grad).__name__)}")
    if main_grad.device != param.device:
        raise ValueError(f"{where}{name}.main_grad must be on {name}'s device {param.device}, "
                         f"got {main_grad.device}")
    if tuple(main_grad.shape) == tuple(shape):
        return main_grad
    numel = 1
    for s in shape:
        numel *= s
    if main_grad.numel() != numel:
        raise ValueError(
            f"{where}{name}.main_grad must have shape {tuple(shape)} ({numel} elements), got shape "
            f"{tuple(main_grad.shape)}"
        )
    try:
        return main_grad.view(shape)
    except RuntimeError as exc:
        raise ValueError(
            f"{where}{name}.main_grad of shape {tuple(main_grad.shape)} and strides "
            f"{tuple(main_grad.stride())} cannot be viewed as {name}'s shape {tuple(shape)} "
            "without a copy; give it the weight's shape or make it contiguous"
        ) from exc


def _main_grad_targets(policy: WgradPolicy, weights: list[torch.Tensor], single: bool,
                       group_shape: tuple[int, ...]) -> tuple[list[Any], list[bool]]:
    """Per group: the (N, K) target (``None`` for frozen weights) and whether to add."""
    names, owner = policy.weight_names, policy.owner
    if single:
        w = weights[0]
        if not w.requires_grad:
            return [None] * w.shape[0], [True] * w.shape[0]
        target = main_grad_target(w, names[0], tuple(w.shape), owner)
        add = not getattr(w, "overwrite_main_grad", False)
        return list(target.unbind(0)), [add] * w.shape[0]
    targets = [main_grad_target(w, n, group_shape, owner) if w.requires_grad else None
               for w, n in zip(weights, names)]
    return targets, [not getattr(w, "overwrite_main_grad", False) for w in weights]


def per_param(grad: torch.Tensor, single: bool) -> list[torch.Tensor]:
    """Split a (G, ...) gradient the way the parameters are held (one tensor, or per group)."""
    return [grad] if single else list(grad.unbind(0))


def group_bias_grad(dy: torch.Tensor, splits: GroupedSplits,
                    probs: torch.Tensor | None) -> torch.Tensor:
    """Per-group sum of ``dy`` rows (times ``probs`` when given): shape (G, N).

    Computed as ``onehot(group)^T @ dy``: deterministic (no atomics), fp32 accumulation inside
    the GEMM. Padding rows are zeroed first, so garbage there cannot leak into the sums.
    """
    onehot = splits.group_onehot(dy.dtype)
    if probs is not None:
        onehot = onehot * splits.zero_padding(probs).to(dy.dtype).unsqueeze(0)
    return onehot @ splits.zero_padding(dy)


def _weight_grads(policy: WgradPolicy, job: _WgradJob) -> list[torch.Tensor | None]:
    """Weight grads of one job: into ``main_grad`` (returning ``None``s), or plain tensors."""
    weights = job.weights
    if not any(map(_REQUIRES_GRAD, weights)):
        return [None] * len(weights)
    dy = job.dy_q if job.dy_q is not None else quantize_operand(
        job.recipe, "grad_output", job.dy, job.splits, columnwise=True)
    if policy.accumulate_into_main_grad:
        group_shape = tuple(weights[0].shape[-2:])
        targets, add = _main_grad_targets(policy, weights, job.single, group_shape)
        grouped_wgrad_into(targets, job.x, dy, job.splits, job.backend, add)
        for w in weights:
            if w.requires_grad:
                w.grad_added_to_main_grad = True
        return [None] * len(weights)
    grads = per_param(grouped_wgrad(job.x, dy, job.splits, job.backend), job.single)
    if all(map(_REQUIRES_GRAD, weights)):  # the common case: no per-weight pass
        return grads
    return [g if w.requires_grad else None for g, w in zip(grads, weights)]


def _bias_grads(job: _WgradJob) -> list[torch.Tensor | None]:
    if not any(map(_REQUIRES_GRAD, job.biases)):
        return [None] * len(job.biases)
    grads = per_param(group_bias_grad(job.dy, job.splits, job.probs), job.single)
    if all(map(_REQUIRES_GRAD, job.biases)):
        return grads
    return [g if b.requires_grad else None for g, b in zip(grads, job.biases)]


def weight_and_bias_grads(saved: GroupedLinearSaved, dy2d: torch.Tensor, dy_q: Any = None
                          ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """The weight and bias gradients a GroupedLinear returns to autograd.

    Without a policy (or with both options off) they are the plain gradients. With
    ``accumulate_into_main_grad`` the weight gradients go into ``main_grad`` and autograd gets
    ``None`` for the weights. With ``delay_wgrad_compute`` nothing is computed: the job is
    queued for :func:`backward_dw` and autograd gets ``None`` for weights and biases.

    Shapes: ``dy2d`` (rows, out_features) or a :class:`~te_ops.gemm.RowGather` of those rows
    (no bias then: the bias gradient sums plain rows); the saved input (rows, in_features).
    """
    policy: WgradPolicy = saved.training or _PLAIN
    need_x = any(map(_REQUIRES_GRAD, policy.weights or saved.weights))
    job = _WgradJob(
        x=saved.wgrad_input() if need_x else None, dy=dy2d, splits=saved.splits,
        backend=saved.backend, weights=list(policy.weights or saved.weights),
        biases=list(policy.biases or saved.biases),
        probs=saved.probs, single=saved.single, recipe=saved.recipe, dy_q=dy_q,
    )
    if policy.delay_wgrad_compute:
        x = job.x.src if isinstance(job.x, RowGather) else job.x  # a gather reads its source
        job.versions = tuple((name, t, t._version) for name, t in
                             (("input", x), ("probs", job.probs))
                             if isinstance(t, torch.Tensor))
        policy.pending.append(job)
        return [None] * len(job.weights), [None] * len(job.biases)
    return _weight_grads(policy, job), _bias_grads(job)


#: The policy of ops without main_grad / delayed wgrad (never queues: its queue stays empty).
_PLAIN = WgradPolicy("GroupedLinear", [], [])
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _add_to_grad(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    if grad is None:
        return
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad.clone() if grad._base is not None else grad
    else:
        param.grad.add_(grad)


def backward_dw(policy: WgradPolicy) -> None:
    """Run every queued (delayed) weight-gradient job of one op, oldest first.

    Weights: into ``main_grad`` when the op accumulates there (``overwrite_main_grad`` is
    honoured), else added to ``.grad``. Biases: added to ``.grad``. No-op with an empty queue.
    """
    with torch.no_grad():
        while policy.pending:
            job = policy.pending.popleft()
            _check_versions(policy, job)
            _check_storage(policy, job)
            for w, g in zip(job.weights, _weight_grads(policy, job)):
                _add_to_grad(w, g)
            for b, g in zip(job.biases, _bias_grads(job)):
                _add_to_grad(b, g)


def _check_versions(policy: WgradPolicy, job: _WgradJob) -> None:
    """Raise autograd's in-place error where a tensor a queued job reads (the layer's input,
    ``scale_bias`` probs) changed in place after it was queued (a reused activation buffer
    would otherwise give wrong weight gradients silently)."""
    for name, t, version in job.versions:
        if t._version != version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: the {name} of {policy.owner} {tuple(t.shape)}, kept for "
                f"backward_dw() (delay_wgrad_compute=True), is at version {t._version}; "
                f"expected version {version} (call backward_dw() before changing it)")


def _check_storage(policy: WgradPolicy, job: _WgradJob) -> None:
    """Raise where a parameter a queued job writes has had its storage freed since the forward
    (``torch.distributed.fsdp.fully_shard`` frees the unsharded parameters after backward, once
    it has reduce-scattered their gradients: a gradient added now would be lost)."""
    for p in (*job.weights, *job.biases):
        if p.requires_grad and p.numel() and p.untyped_storage().size() == 0:
            raise RuntimeError(
                f"{policy.owner}: backward_dw() (delay_wgrad_compute=True) found the storage of a "
                f"parameter {tuple(p.shape)} freed since the forward: "
                "torch.distributed.fsdp.fully_shard resharded it after backward, having reduced "
                "its gradient already, so the delayed gradient would be lost. Use "
                "delay_wgrad_compute=False under fully_shard (docs/training_integration.md)")


def backward_dw_all(modules: Any) -> None:
    """Call ``backward_dw()`` once on every distinct module of ``modules`` that has it (the basic
    ops of fused ops included)."""
    seen: set[int] = set()
    for module in modules:
        for op in getattr(module, "basic_ops", [module]):
            if id(op) in seen or not callable(getattr(op, "backward_dw", None)):
                continue
            seen.add(id(op))
            op.backward_dw()


@contextmanager
def main_grads_restored(module: torch.nn.Module) -> Iterator[None]:
    """Inside, forward/backward runs may write ``main_grad`` (e.g. the eager and warm-up runs
    of CUDA graph capture); on exit every parameter's ``main_grad`` holds its values from
    before (restored in place, same storage, so a captured graph keeps writing into it) and
    ``grad_added_to_main_grad`` its old value. Costs one copy of each ``main_grad``."""
    saved = []
    for p in module.parameters():
        mg = getattr(p, "main_grad", None)
        if isinstance(mg, torch.Tensor):
            saved.append((p, mg, mg.clone(), getattr(p, "grad_added_to_main_grad", None)))
    try:
        yield
    finally:
        with torch.no_grad():
            for p, mg, copy, flag in saved:
                mg.copy_(copy)
                if flag is None:
                    if hasattr(p, "grad_added_to_main_grad"):
                        del p.grad_added_to_main_grad
                else:
                    p.grad_added_to_main_grad = flag
