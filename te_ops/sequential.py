"""``Sequential``: a container that fuses runs of te_ops operations.

Consecutive :class:`~te_ops.op.FusibleOperation` modules are grouped into one
:class:`~te_ops.fuser.OperationFuser`; any other ``torch.nn.Module`` runs as it is, taking and
returning one tensor. Extra inputs (split sizes, probs) follow the main input positionally, in
op order: ``block(x, split_sizes, probs, split_sizes)`` for
``Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .fuser import OperationFuser
from .op import FusibleOperation

__all__ = ["Sequential"]


class Sequential(torch.nn.Module):
    """A sequence of modules where te_ops ops are fused.

    Parameters
    ----------
    *modules : torch.nn.Module
        te_ops operations and/or plain modules, registered as submodules ``"0"``, ``"1"``, ...
        (so ``state_dict`` keys are ``"0.weight0"`` and so on).

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

    def __init__(self, *modules: torch.nn.Module) -> None:
        super().__init__()
        self.extend(modules)

    # ------------------------------------------------------------------ container protocol
    def _items(self) -> list[torch.nn.Module]:
        return list(self._modules.values())  # type: ignore[arg-type]

    def _reset(self, modules: Iterable[torch.nn.Module]) -> None:
        modules = list(modules)
        for i, m in enumerate(modules):
            if not isinstance(m, torch.nn.Module):
                raise TypeError(f"modules[{i}] must be a torch.nn.Module, got {type(m).__name__}")
        self._modules.clear()
        for i, m in enumerate(modules):
            self._modules[str(i)] = m
        self.__dict__["_fuser_groups"] = None

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[torch.nn.Module]:
        return iter(self._items())

    def __getitem__(self, idx: int | slice) -> Any:
        items = self._items()
        if isinstance(idx, slice):
            return Sequential(*items[idx])
        if not -len(items) <= idx < len(items):
            raise IndexError(f"idx must be in [{-len(items)}, {len(items)}), got {idx}")
        return items[idx]

    def __setitem__(self, idx: int, module: torch.nn.Module) -> None:
        items = self._items()
        if not -len(items) <= idx < len(items):
            raise IndexError(f"idx must be in [{-len(items)}, {len(items)}), got {idx}")
        items[idx] = module
        self._reset(items)

    def __delitem__(self, idx: int | slice) -> None:
        items = self._items()
        del items[idx]
        self._reset(items)

    def append(self, module: torch.nn.Module) -> Sequential:
        self._reset([*self._items(), module])
        return self

    def extend(self, modules: Iterable[torch.nn.Module]) -> Sequential:
        self._reset([*self._items(), *modules])
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
        groups = self.__dict__.get("_fuser_groups")
        if groups is not None:
            return groups
        groups = []
        run: list[FusibleOperation] = []
        for m in self._items():
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
            groups.append(m)
        if run:
            groups.append(OperationFuser(run))
        self.__dict__["_fuser_groups"] = groups
        return groups

    def _apply(self, fn, *args, **kwargs):  # .to() / .cuda() make new parameters
        self.__dict__["_fuser_groups"] = None
        return super()._apply(fn, *args, **kwargs)

    def num_extra_inputs(self) -> int:
        """How many extra inputs follow the main input when calling."""
        return sum(sum(g.num_extra_inputs) for g in self._groups()
                   if isinstance(g, OperationFuser))

    def forward(self, input_: torch.Tensor, *extra_inputs: Any) -> Any:
        expected = self.num_extra_inputs()
        if len(extra_inputs) != expected:
            raise ValueError(
                f"extra_inputs: expected {expected} extra inputs after the main input, "
                f"got {len(extra_inputs)}"
            )
        x = input_
        pos = 0
        extra_outputs: list[torch.Tensor] = []
        for g in self._groups():
            if not isinstance(g, OperationFuser):
                x = g(x)
                continue
            n = sum(g.num_extra_inputs)
            out = g(x, *extra_inputs[pos:pos + n])
            pos += n
            if sum(g.num_extra_outputs):
                x, *more = out
                extra_outputs.extend(more)
            else:
                x = out
        return (x, *extra_outputs) if extra_outputs else x

    def backward_dw(self) -> None:
        """Run the delayed weight-gradient computation (``delay_wgrad_compute=True``) of every
        op in this container once (see :func:`te_ops.training.backward_dw_all`)."""
        from .training import backward_dw_all

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
        from .ir import explain

        return explain(self, *sample_inputs)

    def to_dot(self, *extra_inputs: Any) -> str:
        """Graphviz DOT text of the op graph (see :func:`te_ops.ir.to_dot`).

        Sample extra inputs, when given, let channels fed by the same split sizes share a node.
        """
        from .ir import to_dot

        return to_dot(self, *extra_inputs)
