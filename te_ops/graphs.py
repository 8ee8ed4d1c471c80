"""CUDA graphs for te_ops blocks: the graph-safety gate and a capture helper.

A te_ops block is *graph-safe* when its forward and backward never synchronize the host with
the device: split sizes stay on the device, offsets come from ``cumsum``, group ids from
``searchsorted`` and every shape is known on the host (see ``docs/graph_safety.md``). Then the
whole block, forward and backward, can be captured once in a CUDA graph and replayed every step
while the routing (split sizes, probs) and the token values change.

* :func:`graph_safe_unsupported_reason` says whether a call would take the graph-safe path
  and, if not, why (a string). It asks the grouped GEMM dispatch
  (:func:`te_ops.gemm.select_backend`) the same question every
  :class:`~te_ops.basic.GroupedLinear` call asks, so it honours ``TE_OPS_GRAPH_SAFE`` and
  ``TE_OPS_GROUPED_GEMM_BACKEND`` exactly as the ops do.
* :func:`make_graphed_callable` checks the gate, runs the block eagerly (one-time probes, the
  fuser plan, and a check under ``torch.cuda.set_sync_debug_mode("error")``), then captures
  forward and backward with :func:`torch.cuda.make_graphed_callables` and returns a callable
  with the block's signature that copies new inputs into static buffers and replays.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from . import env
from .basic.grouped_linear import GroupedLinear
from .gemm import grouped_mm_host_sync_reason, select_backend
from .moe import MoE
from .op import BasicOperation, FusibleOperation
from .sequential import Sequential
from .signature import CallSignature, FedOutput
from .training import main_grads_restored

__all__ = ["graph_safe_unsupported_reason", "make_graphed_callable", "GraphedCallable"]


# ---------------------------------------------------------------------------------- the gate
def _basic_ops_with_index(module: torch.nn.Module) -> list[tuple[int, BasicOperation]]:
    """(position in the container, basic op) in call order; non-fusible modules are skipped.
    For a ``te_ops.MoE``: the ops of its one ``Sequential`` (router to combine)."""
    if isinstance(module, MoE):
        module = module.block
    if isinstance(module, Sequential):
        items = list(module)
    elif isinstance(module, FusibleOperation):
        items = [module]
    else:
        raise TypeError(
            "module must be a te_ops.Sequential, a te_ops.MoE or a te_ops operation, got "
            f"{type(module).__name__}"
        )
    return [(i, b) for i, m in enumerate(items) if isinstance(m, FusibleOperation)
            for b in m.basic_ops]


def _grouped_linear_reason(op: GroupedLinear, input_: torch.Tensor, split_sizes: Any
                           ) -> str | None:
    if op.delay_wgrad_compute:
        return ("delay_wgrad_compute=True queues the weight-gradient work in Python for "
                "backward_dw(), which a graph replay does not run")
    if isinstance(split_sizes, FedOutput):
        pass  # made on the input's device by an earlier op of the block
    elif not isinstance(split_sizes, torch.Tensor):
        return ("split_sizes is a host list; pass a 1-D integer tensor on the input's device "
                f"({input_.device})")
    elif split_sizes.device != input_.device:
        return (f"split_sizes is on {split_sizes.device}, not on the input's device "
                f"{input_.device}")
    try:
        choice = select_backend(input_.device, input_.dtype, op.in_features, op.out_features,
                                device_split_sizes=True)
    except RuntimeError as exc:  # TE_OPS_GRAPH_SAFE=1 or a forced backend that cannot run
        return str(exc)
    if choice.graph_safe:
        return None
    if choice.name == "grouped_mm":
        why = grouped_mm_host_sync_reason(input_.device, input_.dtype) or choice.reason
        return f"the grouped_mm backend is not graph-safe here: {why}"
    return f"the per-group loop backend copies split sizes to the host: {choice.reason}"


def graph_safe_unsupported_reason(module: torch.nn.Module, input_: torch.Tensor,
                                  *extra_inputs: Any) -> str | None:
    """Why ``module(input_, *extra_inputs)`` would not be graph-safe (``None`` when it would be).

    A call is graph-safe when every :class:`~te_ops.basic.GroupedLinear` in it gets its split
    sizes as a tensor on the input's device and the grouped GEMM dispatch picks a graph-safe
    backend for the input's dtype and device (``torch._grouped_mm`` with device offsets; see
    :func:`te_ops.gemm.select_backend`, which also applies
    ``TE_OPS_GRAPH_SAFE`` and ``TE_OPS_GROUPED_GEMM_BACKEND``), every tensor extra input lives
    on the input's device, no op reads a device value on the host
    (:meth:`~te_ops.op.BasicOperation.host_sync_reason`: e.g. the dropless expert-parallel
    dispatch) and ``TE_OPS_CHECK_SPLIT_SIZES`` is off. Nothing runs on the device
    except the grouped GEMM backend's one-time probe.

    Ops are assumed to keep the input's dtype and device (te_ops ops do). Modules in a
    ``Sequential`` that are not te_ops operations are not inspected: their graph safety is the
    caller's responsibility (``make_graphed_callable`` checks the whole block for host syncs
    on the GPU).

    A ``te_ops.MoE`` is checked as its one ``Sequential`` (router to combine; the ops feed
    each other every extra input) and its shared experts.

    Parameters
    ----------
    module : te_ops.Sequential, te_ops.MoE or te_ops operation
    input_ : torch.Tensor
        The main input (only its dtype and device are read).
    *extra_inputs :
        The extra inputs, positionally as the module takes them
        (``split_sizes, probs, split_sizes`` for ``GroupedLinear -> ScaledSwiGLU ->
        GroupedLinear``).

    Returns
    -------
    str or None
        The first reason found, naming the op by its position in the container, e.g.
        ``"op 0 (GroupedLinear(groups=8, 256->1024)): split_sizes is a host list; ..."``.

    Raises
    ------
    TypeError
        ``module`` is not a te_ops module or ``input_`` is not a tensor.
    ValueError
        The number of extra inputs does not match what the module takes; an environment
        variable has a bad value.
    """
    if not isinstance(input_, torch.Tensor):
        raise TypeError(f"input_ must be a torch.Tensor, got {type(input_).__name__}")
    if isinstance(module, MoE):
        return _moe_reason(module, input_, extra_inputs)
    ops = _basic_ops_with_index(module)
    signature = CallSignature([op for _, op in ops])
    groups = signature.split(extra_inputs)
    if env.read_bool("TE_OPS_CHECK_SPLIT_SIZES"):
        return ("TE_OPS_CHECK_SPLIT_SIZES=1 copies device split sizes to the host to check "
                "them (a host sync); unset it to check them on the device")
    for i, ((pos, op), extras) in enumerate(zip(ops, groups)):
        where = f"op {pos} ({op.describe()})"
        names = [signature.names[i][j] or f"extra input {j}" for j in range(len(extras))]
        # A fed input (FedOutput) is made on the device by an earlier op of the block: the
        # ops' own meta-device proof covers it.
        for name, value in zip(names, extras):
            if isinstance(value, torch.Tensor) and value.device != input_.device:
                return f"{where}: {name} is on {value.device}, not on {input_.device}"
        host_read = op.host_sync_reason()
        if host_read is not None:
            return f"{where}: {host_read}"
        if isinstance(op, GroupedLinear):
            reason = _grouped_linear_reason(op, input_, extras[0])
            if reason is not None:
                return f"{where}: {reason}"
        else:
            for name, value in zip(names, extras):
                if not isinstance(value, (torch.Tensor, FedOutput)):
                    return (f"{where}: {name} is a {type(value).__name__}, not a tensor on "
                            f"{input_.device}")
    return None


def _moe_reason(moe: Any, input_: torch.Tensor, extra_inputs: tuple[Any, ...]) -> str | None:
    """:func:`graph_safe_unsupported_reason` of a ``te_ops.MoE``: its one ``Sequential``
    (every extra input fed inside it) and its shared experts (one group of all the tokens,
    split sizes made on the input's device)."""
    if extra_inputs:
        raise ValueError(f"extra_inputs: te_ops.MoE takes the tokens only (its ops feed each "
                         f"other), got {len(extra_inputs)} extra inputs")
    reason = graph_safe_unsupported_reason(moe.block, input_)
    if reason is not None or moe.shared_experts is None:
        return reason
    sizes = torch.empty(1, dtype=torch.int64, device=input_.device)  # as MoE.forward makes
    reason = graph_safe_unsupported_reason(moe.shared_experts, input_, sizes, sizes)
    return None if reason is None else f"shared experts: {reason}"


# ------------------------------------------------------------------------ the capture helper
class _LeafGradGuard(torch.autograd.Function):
    """Identity on leaf tensors whose backward hands autograd gradients it may keep.

    ``torch.cuda.make_graphed_callables`` returns gradients that are views of the backward
    graph's static buffers. Autograd's ``AccumulateGrad`` *adopts* such a tensor as ``.grad``
    when the leaf has none, so the next replay would overwrite that ``.grad`` in place (and a
    second backward would add the buffer to itself): pytorch/pytorch#181723. Routed through
    this function, the gradients of leaves without a ``.grad`` are copied (one copy per
    underlying buffer, e.g. one for all weights of a GroupedLinear, not one per weight); when
    a leaf has a ``.grad``, autograd adds into it in place and keeps nothing.
    """

    @staticmethod
    def forward(ctx, *leaves: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.leaves = leaves
        ctx.set_materialize_grads(False)  # None stays None (weights that use main_grad)
        return tuple(t.detach() for t in leaves)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        copies: dict[int, Any] = {}
        out: list[torch.Tensor | None] = []
        for g, leaf in zip(grads, ctx.leaves):
            out.append(g if g is None or leaf.grad is not None else _copy_of(g, copies))
        return tuple(out)


def _copy_of(grad: torch.Tensor, copies: dict[int, Any]) -> torch.Tensor:
    """``grad`` re-viewed on a copy of its storage; the storage is copied once per ``copies``."""
    storage = grad.untyped_storage()
    key = storage.data_ptr()
    if (key not in copies and grad.storage_offset() == 0 and grad.is_contiguous()
            and grad.numel() * grad.element_size() == storage.nbytes()):
        # The gradient is its whole buffer (an input's, e.g. x or probs): one clone instead
        # of the five ops below (about 36 us of host per leaf in the E64 graphed step's
        # profile).
        out = grad.clone()
        copies[key] = out.untyped_storage()
        return out
    if key not in copies:
        raw = torch.empty(0, dtype=torch.uint8, device=grad.device).set_(storage)
        copies[key] = raw.clone().untyped_storage()
    view = torch.empty(0, dtype=grad.dtype, device=grad.device)
    return view.set_(copies[key], grad.storage_offset(), grad.size(), grad.stride())


def _check_sample_inputs(sample_inputs: Any) -> tuple[torch.Tensor, ...]:
    """Type checks of ``sample_inputs`` and, when CUDA is available, their devices."""
    if not isinstance(sample_inputs, (tuple, list)) or not sample_inputs:
        raise TypeError(
            "sample_inputs must be a non-empty tuple (input_, *extra_inputs), got "
            f"{type(sample_inputs).__name__}"
        )
    for i, value in enumerate(sample_inputs):
        if isinstance(value, (list, tuple)):
            raise ValueError(
                f"sample_inputs[{i}] is a host {type(value).__name__}; a CUDA graph cannot "
                "take host values that change between replays: pass split sizes as a 1-D "
                "integer tensor on the GPU (e.g. torch.tensor(sizes, device='cuda'))"
            )
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"sample_inputs[{i}] must be a torch.Tensor, got {type(value).__name__}"
            )
    if not torch.cuda.is_available():
        raise RuntimeError("make_graphed_callable needs CUDA (torch.cuda.is_available() is "
                           "False)")
    for i, value in enumerate(sample_inputs):
        if value.device.type != "cuda":
            raise ValueError(
                f"sample_inputs[{i}] is on {value.device}; make_graphed_callable captures a "
                "CUDA graph and needs every input on a CUDA device"
            )
    return tuple(sample_inputs)


def _sync_check(run) -> None:
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        run()
    except RuntimeError as exc:
        if "synchronizing" not in str(exc):
            raise
        raise RuntimeError(
            "the module synchronized the host with the device during an eager forward+backward "
            "(torch.cuda.set_sync_debug_mode('error') raised), so it cannot be captured in a "
            f"CUDA graph: {exc}. See docs/graph_safety.md; pass check_sync=False to skip "
            "this check."
        ) from exc
    finally:
        torch.cuda.set_sync_debug_mode(previous)


class GraphedCallable:
    """A te_ops block captured in CUDA graphs (forward and backward); see
    :func:`make_graphed_callable`.

    Attributes
    ----------
    module : torch.nn.Module
        The captured module (still callable eagerly).
    static_inputs : tuple[torch.Tensor, ...]
        The graph's input buffers, one per argument. Filling them in place and passing them
        back avoids the copy.
    """

    def __init__(self, module: torch.nn.Module, static_inputs: tuple[torch.Tensor, ...],
                 arg_map: list[int], params: tuple[torch.nn.Parameter, ...], graphed,
                 clone_param_grads: bool = True) -> None:
        self.module = module
        self.static_inputs = static_inputs
        self._arg_map = arg_map
        self._params = params
        self._all_params = tuple(module.parameters())
        self._param_layouts = tuple(map(_layout, self._all_params))
        self._graphed = graphed
        self.clone_param_grads = clone_param_grads

    def _check_inputs(self, inputs: tuple[Any, ...]) -> None:
        grad_enabled = torch.is_grad_enabled()
        if len(inputs) != len(self.static_inputs):
            raise ValueError(
                f"inputs: the graph was captured with {len(self.static_inputs)} inputs, got "
                f"{len(inputs)}"
            )
        for i, (value, static) in enumerate(zip(inputs, self.static_inputs)):
            if not isinstance(value, torch.Tensor):
                hint = (" (pass split sizes as a tensor on the GPU)"
                        if isinstance(value, (list, tuple)) else "")
                raise TypeError(
                    f"inputs[{i}] must be a torch.Tensor, got {type(value).__name__}{hint}"
                )
            if (value.shape != static.shape or value.dtype != static.dtype
                    or value.device != static.device):
                raise ValueError(
                    f"inputs[{i}] must match the captured buffer: shape "
                    f"{tuple(static.shape)}, {static.dtype} on {static.device}; got shape "
                    f"{tuple(value.shape)}, {value.dtype} on {value.device} (a CUDA graph has "
                    "fixed shapes: keep the token count fixed and pad)"
                )
            if grad_enabled and value.requires_grad != static.requires_grad:
                raise ValueError(
                    f"inputs[{i}].requires_grad must be {static.requires_grad} as at capture, "
                    f"got {value.requires_grad}"
                )
        for i, first in enumerate(self._arg_map):
            if first != i and inputs[i] is not inputs[first]:
                raise ValueError(
                    f"inputs[{i}] must be the same tensor object as inputs[{first}], as at "
                    "capture (the graph has one buffer for both, e.g. fc1's and fc2's "
                    "split sizes)"
                )

    def check_parameters(self) -> None:
        """Raise ``RuntimeError`` when the module's parameters were replaced since capture.

        The graphs read the parameters' storage captured at the time: in-place updates
        (optimizers, ``load_state_dict``) are seen, replaced tensors (``p.data = ...``, a new
        ``Parameter``, ``module.to(...)``) are not, nor is ``p.data = p.data.view(dtype or
        shape)`` at the same address: each parameter's address, dtype, shape and strides are
        compared with the captured ones.
        """
        current = tuple(self.module.parameters())
        if len(current) != len(self._all_params) or any(
            a is not b for a, b in zip(current, self._all_params)
        ):
            raise RuntimeError("the module's parameters were replaced since capture; capture "
                               "again with make_graphed_callable")
        if tuple(map(_layout, self._all_params)) != self._param_layouts:
            raise RuntimeError("a parameter's storage, dtype, shape or strides changed since "
                               "capture (p.data = ..., .to() or .view()); capture again with "
                               "make_graphed_callable")

    def __call__(self, *inputs: torch.Tensor) -> Any:
        """Copy ``inputs`` into the static buffers, replay forward, return the outputs.

        The outputs are the forward graph's static buffers (overwritten by the next replay;
        clone what you keep). Calling backward on them replays the backward graph; parameter
        gradients accumulate into ``.grad`` as in eager mode.
        """
        self._check_inputs(inputs)
        unique = [inputs[i] for i, first in enumerate(self._arg_map) if first == i]
        params: Sequence[torch.Tensor] = self._params
        if torch.is_grad_enabled():
            if self.clone_param_grads:
                unique, params = self._guard(unique, params)
            else:
                unique, _ = self._guard(unique, ())
        return self._graphed(*unique, *params)

    @staticmethod
    def _guard(unique: list[torch.Tensor], params: Sequence[torch.Tensor]):
        leaves = [(k, t) for k, t in enumerate(unique) if t.requires_grad and t.is_leaf]
        if not leaves and not params:
            return unique, params
        guarded = _LeafGradGuard.apply(*(t for _, t in leaves), *params)
        unique = list(unique)
        for (k, _), g in zip(leaves, guarded):
            unique[k] = g
        return unique, guarded[len(leaves):]

    def __repr__(self) -> str:
        shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in self.static_inputs)
        return f"GraphedCallable({type(self.module).__name__}, inputs=[{shapes}])"


def _layout(p: torch.Tensor) -> tuple:
    """What the captured kernels read a parameter through: address, dtype, shape, strides
    (``p.data = p.data.view(torch.float16)`` keeps the address)."""
    return p.data_ptr(), p.dtype, p.shape, p.stride()


def make_graphed_callable(module: torch.nn.Module, sample_inputs: Sequence[torch.Tensor], *,
                          num_warmup_iters: int = 3, pool: Any = None,
                          check_sync: bool = True,
                          clone_param_grads: bool = True) -> GraphedCallable:
    """Capture ``module``'s forward and backward in CUDA graphs; return a replaying callable.

    Builds on :func:`torch.cuda.make_graphed_callables` (side-stream warm-up, static buffers,
    one autograd node that replays the forward graph and, in backward, the backward graph).
    Before that it

    1. checks :func:`graph_safe_unsupported_reason` and raises with the reason;
    2. runs the module eagerly once (one-time grouped GEMM probes and the fuser plan must
       exist before capture), then once more under
       ``torch.cuda.set_sync_debug_mode("error")`` (``check_sync=True``), which turns any host
       sync, also in modules te_ops cannot inspect, into a clear error instead of a failed
       capture. Both runs use ``torch.autograd.grad``, so no ``.grad`` is touched;
    3. collects cyclic garbage and keeps Python's collector off during warm-up and capture: a
       collection inside a capture that frees an earlier capture's graph invalidates it.

    Parameters
    ----------
    module : te_ops.Sequential, te_ops.MoE or te_ops operation
        On a CUDA device. Its parameters are read by the graphs where they are now: update them
        in place (optimizers do), never replace them. Buffers the forward adds to
        (``te_ops.MoE``'s ``router.expert_load``) are restored after the eager and warm-up
        runs, so only replays count.
    sample_inputs : tuple of torch.Tensor
        ``(input_, *extra_inputs)`` as the module is called (``(x,)`` for a ``te_ops.MoE``,
        whose outputs are ``(y, aux_loss)``), all CUDA tensors: split sizes as
        1-D integer tensors (pass the *same* tensor object wherever the block reuses one, e.g.
        fc1's and fc2's split sizes, so the fused path applies). Copied into static buffers;
        ``requires_grad`` of each must match the real inputs.
    num_warmup_iters : int
        Side-stream warm-up iterations of ``torch.cuda.make_graphed_callables``.
    pool : optional
        A memory-pool handle (``torch.cuda.graph_pool_handle()``) to share with other graphs.
    check_sync : bool
        Run the eager sync check of step 2.
    clone_param_grads : bool
        True (default): a parameter whose ``.grad`` is ``None`` gets a copy of the graph's
        static gradient buffer, so gradients keep PyTorch's usual lifetime (accumulation over
        micro-batches is right; pytorch/pytorch#181723). False skips that copy (one read and
        write of every weight gradient per step, measurable for large experts): ``.grad`` then
        *is* the static buffer and the next replay overwrites it, which is only right when
        every step's gradients are consumed (optimizer step, all-reduce) before the next
        replay and ``.grad`` is reset to ``None`` in between (no accumulation).
        TransformerEngine's ``make_graphed_callables`` offers the same trade-off.

    Returns
    -------
    GraphedCallable
        ``graphed(input_, *extra_inputs)`` with the module's signature; inputs must have the
        captured shapes, dtypes and devices.

    Shapes
    ------
    Fixed at capture: the token count (rows of ``input_``) included. Routings change through
    the *values* of the split sizes (which may sum to fewer than the rows: the tail is padding,
    zero in the output and the input gradient) and of the probs. A ``te_ops.MoE`` routes
    inside the graph: each replay routes its own tokens (dropless or with a capacity).

    Limits
    ------
    * Outputs are static buffers overwritten by the next replay: clone what you keep. Run each
      replay's backward before the next replay's forward (one in flight).
    * Gradients that flow to non-leaf inputs are static buffers too; autograd consumes them at
      once, but ``retain_grad()`` or hooks that keep them must clone. Leaf inputs and
      parameters get ordinary ``.grad`` tensors (see :class:`_LeafGradGuard`).
    * The graphs hold the parameters, their storage and a private memory pool (activations,
      gradients) until the callable is dropped.
    * No RNG is used by te_ops; a module with dropout would need torch's graph-safe RNG
      handling (``torch.cuda.graph`` registers the default generator) and is untested here.
    * Bad split sizes (negative, or summing past the rows) trip a device-side assert during
      replay, which ends the CUDA context: validate the routing upstream.
    * No double backward; autocast only with ``cache_enabled=False`` (as torch's helper).

    Raises
    ------
    TypeError
        ``module`` is not a te_ops module; ``sample_inputs`` is not a tuple of tensors.
    ValueError
        A sample input is a host list or not on CUDA; the call is not graph-safe (the message
        gives :func:`graph_safe_unsupported_reason`); ``num_warmup_iters`` < 1.
    RuntimeError
        CUDA is not available; the eager check saw a host sync.
    """
    _basic_ops_with_index(module)  # TypeError for non-te_ops modules
    if isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int) \
            or num_warmup_iters < 1:
        raise ValueError(f"num_warmup_iters must be an int >= 1, got {num_warmup_iters!r}")
    samples = _check_sample_inputs(sample_inputs)
    reason = graph_safe_unsupported_reason(module, *samples)
    if reason is not None:
        raise ValueError(f"module is not graph-safe for these inputs: {reason}")

    # One static buffer per distinct sample tensor; repeated tensors (fc1/fc2 split sizes) stay
    # one object, so the fuser sees one source and the fused path applies.
    arg_map: list[int] = []
    for i, t in enumerate(samples):
        arg_map.append(next(j for j in range(i + 1) if samples[j] is t))
    static_inputs: list[torch.Tensor] = []
    for i, t in enumerate(samples):
        if arg_map[i] == i:
            static_inputs.append(t.detach().clone().requires_grad_(t.requires_grad))
        else:
            static_inputs.append(static_inputs[arg_map[i]])
    unique = [t for i, t in enumerate(static_inputs) if arg_map[i] == i]
    params = tuple(p for p in module.parameters() if p.requires_grad)
    positions = [_unique_index(arg_map, i) for i in range(len(arg_map))]

    def call(*flat: torch.Tensor) -> Any:
        # ``flat`` is (*distinct inputs, *params): the params ride along only so that
        # torch.cuda.make_graphed_callables returns their gradients.
        return module(*(flat[k] for k in positions))

    def eager_step() -> None:
        out = call(*unique)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(o, torch.Tensor) and o.requires_grad]
        wrt = [t for t in (*unique, *params) if t.requires_grad]
        if outs and wrt:
            torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs],
                                allow_unused=True)

    # Warm-up runs must not leave gradients in Megatron main_grad buffers, nor counts in
    # buffers the forward adds to (te_ops.MoE's router.expert_load); weights that add into
    # main_grad get no autograd gradient (None), hence allow_unused_input.
    with main_grads_restored(module), _buffers_restored(module):
        eager_step()
        if check_sync:
            _sync_check(eager_step)
        torch.cuda.synchronize()

        with _gc_paused():
            graphed = torch.cuda.make_graphed_callables(
                call, (*unique, *params), num_warmup_iters=num_warmup_iters, pool=pool,
                allow_unused_input=True,
            )
        torch.cuda.synchronize()
    return GraphedCallable(module, tuple(static_inputs), arg_map, params, graphed,
                           clone_param_grads)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Collect cyclic garbage now, then keep Python's collector off until the block ends (its
    previous state restored, also on an error).

    A collection during a capture may free an unreachable CUDA graph of an earlier capture:
    ``torch.cuda.make_graphed_callables`` keeps its graphs in an autograd Function class it
    defines per call, and a class is always in a reference cycle, so only the collector frees
    them. Destroying a graph while a stream captures invalidates that capture (the next launch
    raises "operation failed due to a previous error during capture"), and
    ``torch.cuda.graph`` no longer collects before capturing unless
    ``torch.compiler.config.force_cudagraph_gc`` is set."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def _buffers_restored(module: torch.nn.Module) -> Iterator[None]:
    """On exit every floating-point or integer buffer of ``module`` holds its values from
    before, restored in place (same storage: a captured graph keeps writing into it)."""
    saved = [(b, b.clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, copy in saved:
                b.copy_(copy)


def _unique_index(arg_map: list[int], i: int) -> int:
    """Position of argument ``i``'s buffer among the distinct buffers."""
    first = arg_map[i]
    return sum(1 for j in range(first) if arg_map[j] == j)

