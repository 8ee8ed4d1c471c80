"""``Sequential``: a container that fuses runs of te_ops operations.

Consecutive :class:`~te_ops.op.FusibleOperation` modules are grouped into one
:class:`~te_ops.fuser.OperationFuser`; any other ``torch.nn.Module`` runs as it is, taking and
returning one tensor. Extra inputs (split sizes, probs) follow the main input positionally, in
op order: ``block(x, split_sizes, probs, split_sizes)`` for
``Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear)``. An extra input fed by an earlier
op's extra output (:meth:`~te_ops.op.BasicOperation.feed_extra_input`) is not a call input:
the container passes the producer's output to it (inside one fuser, or from one fuser to a
later one) and does not return that output.

Module hooks (``register_forward_pre_hook``, ``register_forward_hook``,
``register_full_backward_hook``, ...) on an op inside the container run: an op with hooks is
taken out of fusion and called through its own ``__call__`` (so a forward hook may replace
the output), and ``explain()`` says so. Global module hooks
(``torch.nn.modules.module.register_module_forward_hook``) do not change fusion and do not
run for the ops inside a fuser.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .fuser import OperationFuser
from .ir import explain, to_dot
from .op import BasicOperation, FusibleOperation, has_hooks
from .quantization.weight_cache import call_flagged
from .signature import CallSignature, FedOutput
from .training import backward_dw_all

__all__ = ["Sequential"]


def _check_plain_module(index: int, module: torch.nn.Module) -> None:
    """A plain module runs as ``module(x)``: a nested te_ops ``Sequential`` that needs extra
    inputs could never get them, so it is refused when the container is built."""
    if isinstance(module, Sequential) and module.num_extra_inputs():
        raise ValueError(
            f"module {index} is a te_ops.Sequential taking {module.num_extra_inputs()} extra "
            "inputs; a nested container runs as a plain module with the main input only, so "
            "it cannot get them: unpack it (te_ops.Sequential(*inner, ...), or inner + outer)")


def _index(idx: Any) -> int:
    """``idx`` as an int (``operator.index``: ints, numpy and 0-d integer tensors), else a
    ``TypeError`` naming it: modules are found by position, not by name (use ``getattr``)."""
    try:
        return operator.index(idx)
    except TypeError:
        raise TypeError(f"idx must be an int or a slice, got {type(idx).__name__} ({idx!r}); "
                        "modules are indexed by position (by name: getattr(block, name))"
                        ) from None


class Sequential(torch.nn.Module):
    """A sequence of modules where te_ops ops are fused.

    Parameters
    ----------
    *modules : torch.nn.Module
        te_ops operations and/or plain modules, registered as submodules ``"0"``, ``"1"``, ...
        (so ``state_dict`` keys are ``"0.weight0"`` and so on); or one ``OrderedDict`` of
        named modules, as ``torch.nn.Sequential`` takes (keys ``"fc1.weight0"``, ...).
        As in ``torch.nn.Sequential``, ``append`` / ``extend`` name new modules by position
        and ``insert`` / ``pop`` / ``del`` renumber all of them.

    Calling
    -------
    ``block(input_, *extra_inputs)`` returns the output, or ``(output, *extra_outputs)`` when an
    op has extra outputs.

    Raises
    ------
    TypeError
        A module is not a ``torch.nn.Module``.
    ValueError
        The number of extra inputs does not match what the ops take.
    """

    def __init__(self, *modules: torch.nn.Module | OrderedDict[str, torch.nn.Module]) -> None:
        super().__init__()
        if len(modules) == 1 and isinstance(modules[0], OrderedDict):
            named = modules[0]
            self._reset(named.values(), names=[str(k) for k in named])
        else:
            self.extend(modules)

    # ------------------------------------------------------------------ container protocol
    def _items(self) -> list[torch.nn.Module]:
        return list(self._modules.values())  # type: ignore[arg-type]

    def _reset(self, modules: Iterable[torch.nn.Module], names: list[str] | None = None) -> None:
        modules = list(modules)
        for i, m in enumerate(modules):
            if not isinstance(m, torch.nn.Module):
                raise TypeError(f"modules[{i}] must be a torch.nn.Module, got {type(m).__name__}")
        names = names if names is not None else [str(i) for i in range(len(modules))]
        before = list(self._modules.items())
        try:
            self._set_modules(zip(names, modules))
        except BaseException:  # a refused module (e.g. a nested block) leaves the old list
            self._set_modules(before)
            raise

    def _set_modules(self, named: Iterable[tuple[str, torch.nn.Module]]) -> None:
        self._modules.clear()
        for name, m in named:
            self.add_module(name, m)
        self.__dict__["_fuser_groups"] = None
        self._groups()  # built now, not inside a torch.compile trace (which would recompile)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[torch.nn.Module]:
        return iter(self._items())

    def __getitem__(self, idx: int | slice) -> Any:
        items = self._items()
        if isinstance(idx, slice):  # keeps the names, as torch.nn.Sequential
            return Sequential(OrderedDict(list(self._modules.items())[idx]))
        idx = _index(idx)
        if not -len(items) <= idx < len(items):
            raise IndexError(f"idx must be in [{-len(items)}, {len(items)}), got {idx}")
        return items[idx]

    def __setitem__(self, idx: int, module: torch.nn.Module) -> None:
        items = self._items()
        idx = _index(idx)
        if not -len(items) <= idx < len(items):
            raise IndexError(f"idx must be in [{-len(items)}, {len(items)}), got {idx}")
        items[idx] = module
        self._reset(items, names=list(self._modules))

    def __delitem__(self, idx: int | slice) -> None:
        items = self._items()
        del items[idx]
        self._reset(items)

    def append(self, module: torch.nn.Module) -> Sequential:
        return self.extend([module])

    def extend(self, modules: Iterable[torch.nn.Module]) -> Sequential:
        names = list(self._modules)
        modules = list(modules)
        names += [str(len(names) + i) for i in range(len(modules))]
        self._reset([*self._items(), *modules], names=names)
        return self

    def insert(self, idx: int, module: torch.nn.Module) -> Sequential:
        items = self._items()
        items.insert(idx, module)
        self._reset(items)
        return self

    def pop(self, idx: int = -1) -> torch.nn.Module:
        items = self._items()
        module = items.pop(idx)
        self._reset(items)
        return module

    def __add__(self, other: Sequential) -> Sequential:
        if not isinstance(other, Sequential):
            raise TypeError(f"other must be a te_ops.Sequential, got {type(other).__name__}")
        return Sequential(*self._items(), *other._items())

    # ------------------------------------------------------------------ fusion
    def _groups(self) -> list[OperationFuser | torch.nn.Module]:
        items = self._items()
        hooked = tuple(i for i, m in enumerate(items)
                       if isinstance(m, FusibleOperation) and has_hooks(m))
        # The modules' identities too: torch.nn.Module's own API (setattr, add_module,
        # set_submodule) replaces entries of _modules without going through this container.
        key = (hooked, tuple(map(id, items)))
        groups = self.__dict__.get("_fuser_groups")
        if groups is not None and self.__dict__.get("_groups_key") == key:
            return groups
        groups = []
        run: list[FusibleOperation] = []
        for i, m in enumerate(items):
            if i in hooked:
                groups.extend([OperationFuser(run)] if run else [])
                run = []
                groups.append(self._hooked_group(i, m))
                continue
            if isinstance(m, FusibleOperation):
                in_run = {id(b) for op in run for b in op.basic_ops}
                if run and any(id(b) in in_run for b in m.basic_ops):
                    groups.append(OperationFuser(run))  # a repeated op starts a new fuser
                    run = []
                run.append(m)
                continue
            if run:
                groups.append(OperationFuser(run))
                run = []
            _check_plain_module(i, m)
            groups.append(m)
        if run:
            groups.append(OperationFuser(run))
        self.__dict__["_fuser_groups"] = groups
        self.__dict__["_groups_key"] = key
        signature = CallSignature(
            [b for g in groups if isinstance(g, OperationFuser) for b in g.basic_ops])
        self.__dict__["_signature"] = signature
        # An output fed both inside its fuser and to a later fuser: that fuser returns it too.
        fuser_of: list[tuple[OperationFuser, int]] = []  # per basic op: (fuser, local index)
        for g in groups:
            if isinstance(g, OperationFuser):
                fuser_of.extend((g, i) for i in range(len(g.basic_ops)))
        for (consumer, _), source in signature.fed.items():
            g, local = fuser_of[source.op]
            if fuser_of[consumer][0] is not g:
                g.signature.also_return(local, source.output)
        # One fuser over every op, called as itself: forward passes it the call's inputs as
        # they are (what the per-op split would rebuild); its returned outputs are ours.
        only = groups[0] if len(groups) == 1 and isinstance(groups[0], OperationFuser) else None
        self.__dict__["_only_fuser"] = (
            (only, signature.total) if only is not None and not hooked else None)
        return groups

    @staticmethod
    def _hooked_group(index: int, op: FusibleOperation) -> OperationFuser:
        """A one-op fuser for an op with hooks; the op's own ``__call__`` runs it (through
        this fuser), so its hooks run."""
        if not isinstance(op, BasicOperation):
            raise TypeError(
                f"modules[{index}] ({type(op).__name__}) is a fused op with module hooks; "
                "a fused op has no __call__ of its own, register the hooks on its basic ops"
            )
        fuser = OperationFuser([op])
        op.__dict__["_standalone_fuser"] = fuser
        return fuser

    def _apply(self, fn, *args, **kwargs):  # .to() / .cuda() make new parameters
        self.__dict__["_fuser_groups"] = None
        out = super()._apply(fn, *args, **kwargs)
        self._groups()  # built now, not inside a torch.compile trace (which would recompile)
        return out

    def signature(self) -> CallSignature:
        """The call signature over every fuser's basic ops (built with the fusers)."""
        self._groups()
        return self.__dict__["_signature"]

    def num_extra_inputs(self) -> int:
        """How many extra inputs follow the main input when calling."""
        return self.signature().total

    def forward(self, input_: torch.Tensor, *extra_inputs: Any,
                is_first_microbatch: bool | None = None) -> Any:
        """Run the ops on ``input_`` and the extra inputs (:meth:`num_extra_inputs`, in op
        order). ``is_first_microbatch`` (TransformerEngine's): under a recipe, ``True``
        quantizes the weights and keeps the copies for the optimizer step's later
        micro-batches, ``False`` reuses them, ``None`` keeps nothing (see
        :mod:`te_ops.quantization.weight_cache`: ``TypeError`` for another value; a flagged
        call is not traced by ``torch.compile``, whose ``fullgraph=True`` raises;
        ``RuntimeError`` during CUDA graph capture and when ``False`` finds no matching
        cache)."""
        if is_first_microbatch is None:
            return self._forward(input_, extra_inputs)
        return call_flagged(is_first_microbatch, self._forward, input_, extra_inputs)

    def _forward(self, input_: torch.Tensor, extra_inputs: tuple) -> Any:
        groups = self._groups()
        only = self.__dict__.get("_only_fuser")  # built by _groups()
        if only is not None and len(extra_inputs) == only[1]:
            return only[0](input_, *extra_inputs)
        signature = self.__dict__["_signature"]  # built by _groups()
        per_op = signature.split(extra_inputs)
        x = input_
        extra_outputs: list[torch.Tensor] = []
        produced: dict[tuple[int, int], Any] = {}  # an op's output fed to a later fuser
        first = 0  # index (in the container's signature) of the fuser's first basic op
        for g in groups:
            if not isinstance(g, OperationFuser):
                x = g(x)
                continue
            extra = []
            for i in range(len(g.basic_ops)):
                for j, v in enumerate(per_op[first + i]):
                    if (i, j) in g.signature.fed:
                        continue  # wired inside the fuser
                    extra.append(produced[(v.op, v.output)] if isinstance(v, FedOutput) else v)
            op = g.basic_ops[0]
            call = op if len(g.basic_ops) == 1 and has_hooks(op) else g
            out = call(x, *extra)
            if g.signature.num_returned:
                x, *more = out
                more = iter(more)
                for i, flags in enumerate(g.returned_outputs):
                    for k, r in enumerate(flags):
                        if r:
                            t = next(more)
                            produced[(first + i, k)] = t
                            if signature.returned[first + i][k]:
                                extra_outputs.append(t)
            else:
                x = out
            first += len(g.basic_ops)
        return (x, *extra_outputs) if extra_outputs else x

    def backward_dw(self) -> None:
        """Run the delayed weight-gradient computation (``delay_wgrad_compute=True``) of every
        op in this container once (see :func:`te_ops.training.backward_dw_all`)."""
        backward_dw_all(self._items())

    # ------------------------------------------------------------------ introspection
    def fusers(self) -> list[OperationFuser]:
        """The fusers this container runs, in order."""
        return [g for g in self._groups() if isinstance(g, OperationFuser)]

    def explain(self, *sample_inputs: Any) -> str:
        """A readable table of the fusion decisions.

        With no arguments it describes the plan of the last call (or, before any call, the plan
        for unknown inputs). With ``(input_, *extra_inputs)`` it plans for that call without
        running it. See :func:`te_ops.ir.explain`.
        """
        return explain(self, *sample_inputs)

    def to_dot(self, *sample_inputs: Any) -> str:
        """Graphviz DOT text of the op graph (see :func:`te_ops.ir.to_dot`); takes the same
        arguments as :meth:`explain`: optionally ``(input_, *extra_inputs)`` of a call."""
        return to_dot(self, *sample_inputs)
