"""The operation classes every te_ops op derives from.

* :class:`BasicOperation` owns parameters and state and defines the math of one step
  (``op_forward`` / ``op_backward``, or ``fuser_forward`` / ``fuser_backward`` when it takes extra
  tensor inputs or gives extra outputs).
* :class:`FusedOperation` is stateless: it stands in for a run of consecutive basic ops in the
  forward pass, the backward pass, or both, and reads and writes the *basic ops'* contexts.
* :class:`OperationContext` is the per-basic-op autograd context.

The semantics follow TransformerEngine's ``transformer_engine.pytorch.ops`` (op_forward /
fuser_forward split, one context per basic op, extra inputs and outputs per op).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from .quantization.weight_cache import call_flagged

__all__ = ["OperationContext", "FusibleOperation", "BasicOperation", "FusedOperation",
           "HOOKS_NOTE", "has_hooks", "set_fuser_class"]

#: Why an op with hooks runs alone (shown by ``explain()``).
HOOKS_NOTE = ("has module hooks: it runs alone, unfused, through its own __call__ so the "
              "hooks run")

#: The class that runs an op called on its own (``[fuser class]``): ``te_ops.fuser`` sits above
#: this module and names its ``OperationFuser`` here when imported (``import te_ops`` does).
_FUSER_CLASS: list[Callable[[list[Any]], Any]] = []


def set_fuser_class(cls: Callable[[list[Any]], Any]) -> None:
    """Name the class that runs a lone op (``te_ops.fuser.OperationFuser``, on its import)."""
    _FUSER_CLASS[:] = [cls]


def has_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` has forward, forward-pre or backward hooks of its own."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


class OperationContext:
    """Autograd context of one basic op.

    Attributes
    ----------
    requires_grad : bool
        Whether this op takes part in the backward pass; when False the op saves nothing.
    input_requires_grad : bool
        Whether the op must compute the gradient of its main input (False only for the first op
        of a fuser whose input does not require grad).
    saved_tensors : tuple[torch.Tensor | None, ...]
        What ``save_for_backward`` was given, available in the backward pass.
    extra_inputs_requires_grad : tuple[bool, ...]
        Per extra input of this op, whether the *caller's* tensor requires grad (with grad
        mode on). Ops must test this, not ``.requires_grad`` of a tensor they reshaped: inside
        the fuser's autograd function grad mode is off, so a reshape (or a view of a view)
        does not carry the flag.
    """

    def __init__(self) -> None:
        self.to_save: tuple[torch.Tensor | None, ...] | None = None
        self.saved_tensors: tuple[torch.Tensor | None, ...] = ()
        self.requires_grad: bool = True
        self.input_requires_grad: bool = True
        self.extra_inputs_requires_grad: tuple[bool, ...] = ()

    def extra_input_requires_grad(self, index: int) -> bool:
        """Whether the caller's extra input ``index`` of this op requires grad."""
        flags = self.extra_inputs_requires_grad
        return index < len(flags) and flags[index]

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None:
        """Register tensors to keep for the backward pass (``None`` entries are allowed)."""
        self.to_save = tensors


class FusibleOperation(torch.nn.Module):
    """Base of basic and fused operations: one step the fuser can run."""

    @property
    def is_fused_op(self) -> bool:
        raise NotImplementedError

    def fuser_forward(
        self,
        basic_op_ctxs: list[OperationContext],
        input_: torch.Tensor,
        *,
        basic_op_extra_inputs: list[tuple[Any, ...]],
        recipe: Any = None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
        """Forward pass over the covered basic ops.

        Returns the main output and, per covered basic op, a tuple of its extra outputs.
        """
        raise NotImplementedError(f"{type(self).__name__} has no forward implementation")

    def fuser_backward(
        self,
        basic_op_ctxs: list[OperationContext],
        grad_output: torch.Tensor,
        *,
        basic_op_grad_extra_outputs: list[tuple[torch.Tensor | None, ...]],
    ) -> tuple[
        torch.Tensor | None,
        list[list[torch.Tensor | None]],
        list[list[torch.Tensor | None]],
    ]:
        """Backward pass over the covered basic ops.

        Returns the gradient of the main input, per covered basic op the list of parameter
        gradients (in ``parameters()`` order) and per covered basic op the list of gradients of
        its extra inputs (``None`` for non-differentiable ones such as split sizes).
        """
        raise NotImplementedError(f"{type(self).__name__} has no backward implementation")


#: Every live basic op by ``id()``: a traced te_ops call names its ops by id (a graph constant).
LIVE_BASIC_OPS: weakref.WeakValueDictionary[int, BasicOperation] = weakref.WeakValueDictionary()


class BasicOperation(FusibleOperation):
    """One step of math with its own parameters.

    Subclasses without extra inputs/outputs implement :meth:`op_forward` and
    :meth:`op_backward`; others override :meth:`fuser_forward` / :meth:`fuser_backward`.
    Calling a basic op directly (``op(x, *extra_inputs)``) runs it through a one-op fuser.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        LIVE_BASIC_OPS[id(self)] = self  # torch.compile finds the op by id (te_ops/compile.py)

    #: Host state a copy (deepcopy, pickle) does not take: torch.compile's per-op fusers hold
    #: the trace's stand-ins of the parameters (they neither pickle nor deep-copy; a copy
    #: traces again), and the quantized weights of ``is_first_microbatch`` belong to this
    #: op's parameters (a copy's own first micro-batch makes its own).
    _NOT_COPIED = ("_compile_fusers", "_weight_cache")

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        return {k: v for k, v in state.items() if k not in self._NOT_COPIED}

    def __setstate__(self, state: dict) -> None:  # deepcopy / pickle do not call __init__
        state = {k: v for k, v in state.items() if k not in self._NOT_COPIED}
        super().__setstate__(state)
        LIVE_BASIC_OPS[id(self)] = self

    #: Number of extra tensor (or split-size list) inputs that follow the main input.
    num_extra_inputs: int = 0
    #: Number of extra tensor outputs that follow the main output.
    num_extra_outputs: int = 0
    #: Fusions take an op only when its type is the exact class they were written for, since
    #: a subclass may change the math. A subclass that keeps its base class's forward and
    #: backward math (it only adds state, logging, a different init...) declares so by setting
    #: ``fuses_as = Base`` in its own class body; the declaration is not inherited (a further
    #: subclass must repeat it). See :func:`te_ops.fuser.fusible_as`.
    fuses_as: ClassVar[type | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        base = cls.__dict__.get("fuses_as")
        if base is not None and not (isinstance(base, type) and base is not cls
                                     and issubclass(cls, base)):
            raise TypeError(
                f"{cls.__name__}.fuses_as must be one of its base classes (the op whose math "
                f"it keeps), got {base!r}"
            )

    @property
    def is_fused_op(self) -> bool:
        return False

    @property
    def basic_ops(self) -> list[BasicOperation]:
        return [self]

    def op_forward(
        self, ctx: OperationContext, input_: torch.Tensor, *, recipe: Any = None
    ) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}.op_forward")

    def op_backward(
        self, ctx: OperationContext, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        raise NotImplementedError(f"{type(self).__name__}.op_backward")

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, recipe=None):
        if self.num_extra_inputs or self.num_extra_outputs:
            raise NotImplementedError(
                f"{type(self).__name__} has extra inputs/outputs and must override fuser_forward"
            )
        return self.op_forward(basic_op_ctxs[0], input_, recipe=recipe), [()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        grad_input, grad_params = self.op_backward(basic_op_ctxs[0], grad_output)
        return grad_input, [grad_params], [[]]

    def extra_input_names(self) -> list[str | None]:
        """What each extra input is (e.g. ``"split_sizes"``), ``None`` where unnamed; used in
        ``explain()``, the op graph and the graph-safety gate's messages."""
        return [None] * self.num_extra_inputs

    def extra_output_names(self) -> list[str | None]:
        """What each extra output is (e.g. ``"split_sizes"``), ``None`` where unnamed; a later
        op's extra input is fed by one by name (:meth:`feed_extra_input`)."""
        return [None] * self.num_extra_outputs

    def feed_extra_input(self, slot: str | int, producer: BasicOperation,
                         output: str | int) -> BasicOperation:
        """Declare that extra input ``slot`` of this op is fed by extra output ``output`` of
        ``producer``, an op that runs earlier in the same ``Sequential``.

        In a container holding both ops the slot is then no longer a call input: the fuser
        passes the producer's output, autograd flows back through it (this op's gradient of
        the slot is added to the gradient of the producer's output) and the producer's output
        is internal (not returned). Where the producer is not in the container (this op called
        on its own, or in a container without it) the slot is a call input.

        Parameters
        ----------
        slot : str or int
            The extra input, by name (:meth:`extra_input_names`) or index.
        producer : BasicOperation
            The op whose extra output feeds it.
        output : str or int
            The producer's extra output, by name (:meth:`extra_output_names`) or index.

        Returns
        -------
        BasicOperation
            ``self``.

        Raises
        ------
        TypeError
            ``producer`` is not a BasicOperation.
        ValueError
            ``slot`` or ``output`` names no extra input / output of its op, or ``producer`` is
            ``self``.
        """
        if not isinstance(producer, BasicOperation):
            raise TypeError(f"producer must be a te_ops BasicOperation, got "
                            f"{type(producer).__name__}")
        if producer is self:
            raise ValueError(f"producer must be another op, got {type(self).__name__} itself")
        j = _resolve(slot, self.extra_input_names(), self.num_extra_inputs, "slot",
                     f"{type(self).__name__}'s extra inputs")
        k = _resolve(output, producer.extra_output_names(), producer.num_extra_outputs,
                     "output", f"{type(producer).__name__}'s extra outputs")
        self.__dict__.setdefault("_extra_input_feeds", {})[j] = (producer, k)
        return self

    def extra_input_feeds(self) -> dict[int, tuple[BasicOperation, int]]:
        """Declared feeds: extra input index -> (producer op, its extra output index)."""
        return dict(self.__dict__.get("_extra_input_feeds", {}))

    def unsupported_reason(self, input_: torch.Tensor) -> str | None:
        """Why this op cannot run on ``input_``'s dtype/device (``None`` when it can)."""
        return None

    def host_sync_reason(self) -> str | None:
        """Why every call of this op reads a device value on the host (``None``: it never
        does, the default). The ``torch.compile`` gate and the graph-safety gate report it."""
        return None

    def describe(self) -> str:
        """One-line description for ``explain()``."""
        return type(self).__name__

    def dispatch_notes(self, info: Any) -> list[str]:
        """Kernel-dispatch decisions this op would take for a plan (``explain(sample)``)."""
        return []

    def record_dispatch(self, kind: str, decision: str) -> None:
        """Record a kernel-dispatch decision the op just made (``kind``: e.g. ``"grouped GEMM
        backend"``); ``explain()`` without sample inputs reports these: what ran."""
        self.__dict__.setdefault("_dispatch_records", {})[kind] = decision

    def dispatch_records(self) -> list[str]:
        """The decisions of the last call, as ``"kind: decision"`` lines (``[]`` before)."""
        return [f"{k}: {v}" for k, v in self.__dict__.get("_dispatch_records", {}).items()]

    def forward(self, input_: torch.Tensor, *extra_inputs: Any,
                is_first_microbatch: bool | None = None) -> Any:
        """This op alone on ``input_`` and its extra inputs; ``is_first_microbatch`` as
        :meth:`te_ops.Sequential.forward` takes it."""
        fuser = self.__dict__.get("_standalone_fuser")
        if fuser is None:
            fuser = _FUSER_CLASS[0]([self])
            self.__dict__["_standalone_fuser"] = fuser
        if is_first_microbatch is None:
            return fuser(input_, *extra_inputs)
        return call_flagged(is_first_microbatch, fuser, input_, *extra_inputs)


def _resolve(which: str | int, names: list[str | None], count: int, arg: str,
             what: str) -> int:
    """Index of extra input / output ``which`` (a name or an index) among ``names``."""
    if isinstance(which, str):
        if which in names:
            return names.index(which)
    elif isinstance(which, int) and not isinstance(which, bool) and 0 <= which < count:
        return which
    raise ValueError(f"{arg} must name one of {what} {names} (or be an index below {count}), "
                     f"got {which!r}")


def fed_from(producer: BasicOperation, outputs: Sequence[Any], ops: Sequence[BasicOperation],
             groups: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The extra inputs ``groups`` of ``ops`` with every slot that ``producer`` feeds
    (:meth:`BasicOperation.feed_extra_input`) set to its output in ``outputs``: what a fused op
    covering producer and consumers does with the ``None`` the fuser leaves in such a slot."""
    wired = []
    for op, group in zip(ops, groups):
        feeds = op.extra_input_feeds()
        wired.append(tuple(outputs[feeds[j][1]] if j in feeds and feeds[j][0] is producer
                           else v for j, v in enumerate(group)))
    return wired


class FusedOperation(FusibleOperation):
    """A stateless stand-in for consecutive basic ops.

    Parameters
    ----------
    basic_ops : sequence of BasicOperation
        The ops it covers, in order. They are not registered as submodules (the fused op owns no
        state); gradients are returned to them through their contexts.
    """

    def __init__(self, basic_ops: Sequence[BasicOperation]) -> None:
        super().__init__()
        if not basic_ops:
            raise ValueError("basic_ops must hold at least one BasicOperation, got an empty list")
        self.__dict__["_basic_ops"] = tuple(basic_ops)

    @property
    def is_fused_op(self) -> bool:
        return True

    @property
    def basic_ops(self) -> list[BasicOperation]:
        return list(self.__dict__["_basic_ops"])

    def describe(self) -> str:
        return type(self).__name__
