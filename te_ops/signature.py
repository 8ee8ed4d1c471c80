"""The call signature of a run of basic ops: which extra input feeds which op.

A call is ``block(x, *extra_inputs)``; the extra inputs follow the main input in op order,
each op taking ``num_extra_inputs`` of them (``split_sizes``, ``probs``, ...). One
:class:`CallSignature`, computed once per fuser (and per container), answers every question
about that layout: the per-op counts and names, where extra input ``k`` goes (op ``i``, slot
``j``), how to split a call's extra inputs per op (with the one error message for a wrong
count), and which inputs come from one source. The fuser, ``Sequential``, ``te_ops.graphs``
and ``te_ops.ir`` all use it.

Fed extra inputs: an op may declare that one of its extra inputs is fed by a named extra
output of an earlier op (:meth:`te_ops.op.BasicOperation.feed_extra_input`, e.g. the MoE
layer's fc1 ``split_sizes`` fed by ``Permute``'s ``split_sizes``). When the producer is one of
the signature's ops, that slot is not a call input: :meth:`CallSignature.split` puts a
:class:`FedOutput` marker there, which the fuser replaces by the producer's output when it runs,
and the producer's output is *internal* (not returned by the call). See docs/architecture.md,
"Extra outputs that feed later ops".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CallSignature", "FedOutput", "Slot", "same_source", "source_classes"]


@dataclass(frozen=True)
class FedOutput:
    """Marks an extra input fed by extra output ``output`` (named ``name``) of basic op ``op``
    of the same signature (indices into its op list)."""

    op: int
    output: int
    name: str | None = None


def same_source(a: Any, b: Any) -> bool:
    """Whether two extra inputs come from one source: the same tensor object, two tensors that
    alias the same memory exactly (same device, dtype, address, shape and strides, e.g. ``t``
    and ``t.detach()``, as reentrant activation checkpointing passes them), equal host lists
    (two tensors with equal values in different memory are *not* one source: telling would
    need a sync), or two :class:`FedOutput` markers of the same producer output."""
    if a is b:
        return True
    if isinstance(a, FedOutput) or isinstance(b, FedOutput):
        return a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _same_memory(a, b)
    return False


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype:  # the cheap test first (e.g. probs vs split sizes)
        return False
    if torch.compiler.is_compiling() or a.device.type == "meta":
        return False  # no addresses to compare (fake / meta tensors)
    if (a.device, a.shape, a.stride()) != (b.device, b.shape, b.stride()):
        return False
    try:
        return a.data_ptr() == b.data_ptr()
    except RuntimeError:  # tensors without storage (functional / fake wrappers)
        return False


def source_classes(flat_extra: Sequence[Any]) -> tuple[int, ...]:
    """For each extra input, the index of the first one from the same source."""
    classes: list[int] = []
    for i, value in enumerate(flat_extra):
        classes.append(next((classes[j] for j in range(i)
                             if same_source(value, flat_extra[j])), i))
    return tuple(classes)


@dataclass(frozen=True)
class Slot:
    """Extra input ``position`` of a call feeds slot ``slot`` of basic op ``op``."""

    position: int
    op: int
    slot: int
    name: str | None


class CallSignature:
    """Where each extra input of a call goes, for a list of basic ops.

    Parameters
    ----------
    ops : sequence of BasicOperation
        The basic ops in call order.

    Attributes
    ----------
    op_counts : list[int]
        ``num_extra_inputs`` per op.
    counts : list[int]
        Per op, how many of its extra inputs the *call* gives (``op_counts`` less the slots fed
        by an earlier op of this list).
    names : list[list[str | None]]
        Per op, the name of each extra input (``BasicOperation.extra_input_names``; ``None``
        where unnamed).
    slots : list[Slot]
        One per extra input of a call, in call order (fed slots are not call inputs).
    fed : dict[tuple[int, int], FedOutput]
        ``(op, slot)`` -> the earlier op's extra output that feeds it.
    returned : list[list[bool]]
        Per op, per extra output, whether the call returns it (it feeds no op of this list).

    Raises
    ------
    ValueError
        An op's extra input is fed by an op that comes after it (or by itself).
    """

    def __init__(self, ops: Sequence[Any]) -> None:
        self.op_types = [type(op).__name__ for op in ops]
        self.op_counts = [int(getattr(op, "num_extra_inputs", 0) or 0) for op in ops]
        self.names: list[list[str | None]] = []
        for op, n in zip(ops, self.op_counts):
            declared = list(op.extra_input_names()) if n else []
            self.names.append((declared + [None] * n)[:n])
        position = {id(op): i for i, op in enumerate(ops)}
        self.fed: dict[tuple[int, int], FedOutput] = {}
        for i, op in enumerate(ops):
            feeds = op.extra_input_feeds() if hasattr(op, "extra_input_feeds") else {}
            for j, (producer, k) in feeds.items():
                p = position.get(id(producer))
                if p is None:
                    continue  # the producer is outside this op list: a call input here
                if p >= i:
                    raise ValueError(
                        f"ops: {type(op).__name__} (op {i})'s extra input "
                        f"{self.names[i][j] or j!r} is fed by {type(producer).__name__} (op "
                        f"{p}), which does not run before it; a fed input needs its producer "
                        "earlier in the same op list")
                self.fed[(i, j)] = FedOutput(p, k, producer.extra_output_names()[k])
        self.counts = [n - sum((i, j) in self.fed for j in range(n))
                       for i, n in enumerate(self.op_counts)]
        consumed = {(f.op, f.output) for f in self.fed.values()}
        self.returned = [[(i, k) not in consumed
                          for k in range(int(getattr(op, "num_extra_outputs", 0) or 0))]
                         for i, op in enumerate(ops)]
        self.slots: list[Slot] = []
        for i, names in enumerate(self.names):
            for j, name in enumerate(names):
                if (i, j) not in self.fed:
                    self.slots.append(Slot(len(self.slots), i, j, name))

    def also_return(self, op: int, output: int) -> None:
        """Return extra output ``output`` of op ``op`` even though it feeds an op of this list
        (a container whose later fuser takes it too)."""
        self.returned[op][output] = True

    @property
    def num_returned(self) -> int:
        """How many extra outputs a call returns after the main output."""
        return sum(map(sum, self.returned))

    @property
    def total(self) -> int:
        """How many extra inputs follow the main input."""
        return sum(self.counts)

    def label(self, position: int) -> str:
        """A readable name for extra input ``position``: its name or ``extra input j``."""
        slot = self.slots[position]
        return slot.name or f"extra input {slot.slot}"

    def split(self, extra_inputs: Sequence[Any], *, allow_missing: bool = False,
              what: str = "extra_inputs") -> list[tuple[Any, ...]]:
        """The call's extra inputs grouped per op.

        With ``allow_missing`` an empty ``extra_inputs`` gives ``None`` for every input.

        Raises
        ------
        ValueError
            Not as many extra inputs as the ops take; the message names ``what``, the
            expected count per op and the count given.
        """
        if len(extra_inputs) != self.total and not (allow_missing and not extra_inputs):
            per_op = [f"{t}:{n}" for t, n in zip(self.op_types, self.counts) if n]
            raise ValueError(
                f"{what}: expected {self.total} extra inputs after the main input "
                f"({', '.join(per_op) or 'none'}), got {len(extra_inputs)}"
            )
        groups: list[tuple[Any, ...]] = []
        pos = 0
        for i, n in enumerate(self.op_counts):
            group = []
            for j in range(n):
                fed = self.fed.get((i, j))
                if fed is not None:
                    group.append(fed)
                else:
                    group.append(extra_inputs[pos] if extra_inputs else None)
                    pos += 1
            groups.append(tuple(group))
        return groups

    def source_classes(self, extra_inputs: Sequence[Any] | None) -> tuple[int, ...]:
        """For each extra input, the first one from the same source (:func:`same_source`);
        without sample inputs every input is its own source."""
        if not extra_inputs:
            return tuple(range(self.total))
        return source_classes(list(extra_inputs))
