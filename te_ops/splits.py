"""Split sizes: validation and the device-side metadata derived from them.

A grouped op splits the rows (tokens) of its input into ``num_groups`` consecutive groups of
``split_sizes[i]`` rows. Split sizes come as a host ``list[int]`` or a 1-D integer tensor on the
input's device. They may sum to fewer than the rows: the rows past the sum are padding (a
fixed-capacity buffer, as in expert-parallel or CUDA-graph use).

Host lists are checked at once. Device tensors are checked without a host sync
(``torch._assert_async``, a device-side assert) unless ``TE_OPS_CHECK_SPLIT_SIZES=1`` asks for an
eager, host-syncing check with a readable error. CPU tensors (outside a ``torch.compile`` trace)
hold their values in host memory: reading them is no sync, so their error names the values
(:class:`SplitSizesError`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import numbers
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from . import env
from .kernels.split_table import split_table

__all__ = ["GroupedSplits", "SplitSizesError", "make_splits", "check_split_sizes_type",
           "host_values", "host_read_scope", "open_host_read_scope", "close_host_read_scope",
           "META_LOOP_ERROR"]

#: Why device split sizes on the meta device cannot reach the host (the per-group loop
#: backend's read): raised by the read, and by the backend choice for such a call.
META_LOOP_ERROR = ("split_sizes on the meta device have no values to copy to the host; this "
                   "path (the per-group loop backend) is not graph-safe")

#: Host copies of device split sizes made during one fuser forward, by ``id`` of the caller's
#: tensor (the tensor is kept alive by the call), so ops fed by one tensor read it once.
_HOST_COPIES: contextvars.ContextVar[dict[int, list[int]] | None] = contextvars.ContextVar(
    "te_ops_host_split_copies", default=None)


@contextlib.contextmanager
def host_read_scope() -> Iterator[None]:
    """Within this scope (one fuser forward), device split sizes copied to the host by the
    loop backend are copied once per caller's tensor, whichever op asks first."""
    token = open_host_read_scope()
    try:
        yield
    finally:
        close_host_read_scope(token)


def open_host_read_scope() -> contextvars.Token:
    """:func:`host_read_scope` without the context manager (the fuser's per-step path):
    open it; pass the token to :func:`close_host_read_scope` in a ``finally``."""
    return _HOST_COPIES.set({})


def close_host_read_scope(token: contextvars.Token) -> None:
    """Close a scope opened by :func:`open_host_read_scope`."""
    _HOST_COPIES.reset(token)

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def host_values(t: torch.Tensor, *, source: torch.Tensor | None = None) -> list[int]:
    """``t``'s values as host ints (a device-to-host copy: a host sync on a GPU).

    Within a :func:`host_read_scope` (one fuser forward) the copy is shared by ``source``, a
    tensor the call keeps alive (its ``id`` is the key): ops fed by one tensor read it once.
    ``source=None``: not shared."""
    shared = _HOST_COPIES.get()
    key = id(source) if source is not None else None
    if shared is not None and key in shared:
        return shared[key]
    values = [int(v) for v in t.tolist()]
    if shared is not None and key is not None:
        shared[key] = values
    return values


@dataclass
class GroupedSplits:
    """Split sizes of one grouped op and what is derived from them, on the device.

    Attributes
    ----------
    num_groups : int
        Number of groups (experts).
    num_rows : int
        Rows of the grouped input (tokens, including padding rows).
    host_sizes : list[int] | None
        Split sizes on the host, when given as a list (``None`` for device split sizes).
    split_sizes : torch.Tensor
        Shape (num_groups,), int64, on the input's device.
    offsets : torch.Tensor
        Shape (num_groups,), int32: cumulative end row of each group (``torch._grouped_mm``'s
        ``offs``).
    base_offsets : torch.Tensor
        Shape (num_groups + 1,), int64: start row of each group, then the total.
    group_ids : torch.Tensor
        Shape (num_rows,), int64: the group of each row; padding rows get ``num_groups``.
        Computed on first use (held as ``_group_ids``, ``None`` until then): ops without a
        bias never need it, and it is the only (rows,)-sized tensor the metadata holds.
    has_padding : bool | None
        False when the host knows the sizes sum to ``num_rows`` (host lists, and CPU tensors
        outside a ``torch.compile`` trace); None when unknown (other devices).
    host_copy : list[int] | None
        Device split sizes once copied to the host (by the loop backend); saved with the op's
        layout so the backward does not read them again.
    source : torch.Tensor | None
        The caller's device split-size tensor (for sharing one host copy per forward).
    """

    num_groups: int
    num_rows: int
    host_sizes: list[int] | None
    split_sizes: torch.Tensor
    offsets: torch.Tensor
    base_offsets: torch.Tensor
    _group_ids: torch.Tensor | None
    has_padding: bool | None
    host_copy: list[int] | None = None
    source: torch.Tensor | None = field(default=None, repr=False)

    @property
    def group_ids(self) -> torch.Tensor:
        """Shape (num_rows,), int64: the group of each row (padding rows: ``num_groups``)."""
        if self._group_ids is None:
            self._group_ids = _row_groups(self.base_offsets, self.num_rows)
        return self._group_ids

    @property
    def on_device(self) -> bool:
        """True when the split sizes were given as a device tensor (no host list). Whether a
        call is graph-safe also depends on the backend: see ``BackendChoice.graph_safe``."""
        return self.host_sizes is None

    def sizes_on_host(self) -> list[int]:
        """Split sizes as a host list; copies from the device (a host sync) when needed:
        at most once per object, and once per caller's tensor within a
        :func:`host_read_scope`."""
        if self.host_sizes is not None:
            return self.host_sizes
        if self.host_copy is not None:
            return self.host_copy
        if self.split_sizes.device.type == "meta":
            raise RuntimeError(META_LOOP_ERROR)
        self.host_copy = host_values(self.split_sizes, source=self.source)
        return self.host_copy

    def padding_rows(self) -> torch.Tensor:
        """Shape (num_rows, 1) bool: True for padding rows (cached: ops sharing splits share it)."""
        cached = self.__dict__.get("_padding_rows")
        if cached is None:
            cached = (self.group_ids >= self.num_groups).unsqueeze(-1)
            self.__dict__["_padding_rows"] = cached
        return cached

    def zero_padding(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` with its padding rows set to zero (a copy; ``t`` itself when the host knows
        there is no padding). Guards sums over rows against garbage (even NaN) in padding."""
        if self.has_padding is False:
            return t
        mask = self.padding_rows()
        return t.masked_fill(mask if t.dim() == 2 else mask.squeeze(-1), 0)

    def group_onehot(self, dtype: torch.dtype) -> torch.Tensor:
        """Shape (num_groups, num_rows): 1 where row r is in group g (padding rows: all 0).

        Cached per dtype, so ops sharing these splits build it once.
        """
        key = f"_onehot_{dtype}"
        cached = self.__dict__.get(key)
        if cached is None:
            groups = torch.arange(self.num_groups, device=self.group_ids.device)
            cached = (self.group_ids.unsqueeze(0) == groups.unsqueeze(1)).to(dtype)
            self.__dict__[key] = cached
        return cached

    def derived(self, key: str, build: Callable[[], Any]) -> Any:
        """A value derived from these splits, built by ``build()`` once per ``key`` and kept
        with them (e.g. quantization's group-aligned column layout, ``layout.splits_layout``:
        the column-wise quantize calls and wgrad GEMMs of one step that share these splits
        build it once). The layers above own what they derive; this class only holds it."""
        key = f"_derived_{key}"
        cached = self.__dict__.get(key)
        if cached is None:
            cached = self.__dict__[key] = build()
        return cached

    def to_tensors(self) -> list[torch.Tensor]:
        """The device tensors, for ``save_for_backward`` (group ids: ``None`` if not built)."""
        return [self.split_sizes, self.offsets, self.base_offsets, self._group_ids]

    @classmethod
    def from_tensors(cls, tensors, *, num_groups: int, num_rows: int,
                     host_sizes: list[int] | None, has_padding: bool | None,
                     host_copy: list[int] | None = None) -> GroupedSplits:
        """Rebuild from :meth:`to_tensors` output."""
        split_sizes, offsets, base_offsets, group_ids = tensors
        return cls(num_groups, num_rows, host_sizes, split_sizes, offsets, base_offsets,
                   group_ids, has_padding, host_copy)


def check_split_sizes_type(split_sizes, num_groups: int, device: torch.device,
                           name: str = "split_sizes") -> None:
    """Check kind, length, dtype and device of split sizes (no host sync).

    Raises
    ------
    TypeError
        Not a list/tuple of ints or an integer tensor.
    ValueError
        Wrong length, wrong number of dimensions, negative host entries, or wrong device.
    """
    if isinstance(split_sizes, torch.Tensor):
        if split_sizes.dim() != 1:
            raise ValueError(
                f"{name} must be a 1-D tensor, got shape {tuple(split_sizes.shape)}"
            )
        if split_sizes.dtype not in _INT_DTYPES and not split_sizes.is_floating_point():
            raise TypeError(
                f"{name} must have an integer dtype (or a floating dtype holding whole "
                f"numbers, e.g. torch.histc counts), got {split_sizes.dtype}"
            )
        if split_sizes.numel() != num_groups:
            raise ValueError(
                f"{name} must have num_groups={num_groups} entries, got {split_sizes.numel()}"
            )
        if split_sizes.device != device:
            raise ValueError(
                f"{name} must be on the input's device {device}, got {split_sizes.device}"
            )
        return
    if not isinstance(split_sizes, (list, tuple)):
        raise TypeError(
            f"{name} must be a list of ints or a 1-D integer tensor, got "
            f"{type(split_sizes).__name__}"
        )
    if split_sizes and all(isinstance(v, torch.Tensor) for v in split_sizes):
        raise TypeError(
            f"{name} must be a list of ints or one 1-D tensor, got a {type(split_sizes).__name__}"
            f" of {len(split_sizes)} tensors: pass one tensor (e.g. torch.stack({name})), "
            "which keeps the sizes on the device without a host read per entry"
        )
    if len(split_sizes) != num_groups:
        raise ValueError(
            f"{name} must have num_groups={num_groups} entries, got {len(split_sizes)}"
        )
    for i, v in enumerate(split_sizes):
        if isinstance(v, bool) or not isinstance(v, (numbers.Integral, torch.SymInt)):
            raise TypeError(f"{name}[{i}] must be an int, got {type(v).__name__} ({v!r})")
        if v < 0:
            raise ValueError(f"{name}[{i}] must be >= 0, got {v}")


def make_splits(split_sizes, num_groups: int, num_rows: int, device: torch.device,
                name: str = "split_sizes", table=split_table) -> GroupedSplits:
    """Validate split sizes and derive offsets and per-row group ids on ``device``.

    Parameters
    ----------
    split_sizes : list[int] | torch.Tensor
        Rows per group; a tensor must be 1-D, on ``device``, integer or floating holding
        whole numbers (cast to int64 on the device; checked like integer sizes).
    num_groups : int
    num_rows : int
        Rows of the input (``x.shape[0]``); the sizes may sum to fewer (padding rows).
    device : torch.device
        The input's device.
    table : callable
        :func:`~te_ops.kernels.split_table.split_table` or a stand-in with its signature and
        values.

    Raises
    ------
    TypeError, ValueError
        As :func:`check_split_sizes_type`; also ``ValueError`` when a host list sums past
        ``num_rows`` (or, with ``TE_OPS_CHECK_SPLIT_SIZES=1``, a device tensor does).
    RuntimeError
        From the device-side assert when device split sizes are negative or sum past
        ``num_rows`` (on CUDA this surfaces asynchronously, as a device assert); for a CPU
        tensor a :class:`SplitSizesError` (a ``ValueError`` and a ``RuntimeError``) naming the
        values.
    """
    check_split_sizes_type(split_sizes, num_groups, device, name)
    if isinstance(split_sizes, torch.Tensor):
        host_sizes = None
        check_host = env.read_bool("TE_OPS_CHECK_SPLIT_SIZES")
        # offsets (int64 and int32), int64 sizes and the validity flag: one Triton launch on
        # CUDA, torch ops elsewhere (te_ops/kernels/split_table.py).
        base_offsets, ends, sizes, offsets, valid = table(split_sizes, num_rows,
                                                          check=not check_host)
        if check_host:
            if split_sizes.is_floating_point():
                _check_whole(split_sizes.tolist(), name)
            _check_host(sizes.tolist(), num_rows, name)
        elif _host_visible(split_sizes):
            if not bool(valid):  # a CPU tensor's flag is in host memory: no sync
                raise SplitSizesError(_cpu_check_message(name, split_sizes, num_rows))
        else:
            torch._assert_async(
                valid, _device_check_message(name, split_sizes.is_floating_point(), num_rows))
        # On the CPU (eager) the total is in host memory: reading it is no sync, and knowing
        # there is no padding spares every padding-row pass of the step.
        has_padding = _cpu_has_padding(ends, num_rows)
    else:
        # SymInts (torch.compile's symbolic host split sizes) stay symbolic: int() would
        # specialize the graph to one distribution.
        host_sizes = [v if isinstance(v, torch.SymInt) else int(v) for v in split_sizes]
        _check_host(host_sizes, num_rows, name)
        sizes = _host_tensor(host_sizes, device)
        has_padding = sum(host_sizes) < num_rows
        ends = torch.cumsum(sizes, 0)
        base_offsets = torch.cat([ends.new_zeros(1), ends])
        offsets = ends.to(torch.int32)
    return GroupedSplits(
        num_groups=num_groups,
        num_rows=num_rows,
        host_sizes=host_sizes,
        split_sizes=sizes,
        offsets=offsets,
        base_offsets=base_offsets,
        _group_ids=None,
        has_padding=has_padding,
        source=split_sizes if host_sizes is None else None,
    )


class SplitSizesError(ValueError, RuntimeError):
    """Device split sizes found invalid on the host (a CPU tensor, where reading the values is
    no sync): a ``ValueError`` like the host-list checks' and a ``RuntimeError`` like the
    device-side assert raises on other devices, so code that catches either still does."""


def _host_visible(split_sizes: torch.Tensor) -> bool:
    """Whether the values of device split sizes can be read without a sync: a CPU tensor
    outside a ``torch.compile`` trace (whose fake tensors have no values)."""
    from .tracing import tracing

    return split_sizes.device.type == "cpu" and not tracing()


def _cpu_check_message(name: str, split_sizes: torch.Tensor, num_rows: int) -> str:
    """The device check's message with the values named (for a CPU tensor: no sync); the
    first offending entry, else the total."""
    floating = split_sizes.is_floating_point()
    values = split_sizes.tolist()
    head = (f"{name} must be {'whole, ' if floating else ''}non-negative and sum to at most "
            f"the input's rows ({num_rows})")
    for i, v in enumerate(values):
        if floating and (not math.isfinite(v) or v != int(v)):
            return f"{head}; {name}[{i}] is {v}, not a whole number (sizes {values})"
        if v < 0:
            return f"{head}; {name}[{i}] is {v} (sizes {values})"
    return (f"{head}, got sum {sum(int(v) for v in values)} (sizes {values}); on other "
            "devices this check runs on the device and names no values unless "
            "TE_OPS_CHECK_SPLIT_SIZES=1")


def _device_check_message(name: str, floating: bool, num_rows: int) -> str:
    """The device-side assert's message (made once per name, kind and row count; a SymInt
    row count of a torch.compile trace is not hashable, so that text is made each time)."""
    if isinstance(num_rows, int):
        return _cached_check_message(name, floating, num_rows)
    return _cached_check_message.__wrapped__(name, floating, num_rows)


@functools.lru_cache(maxsize=256)
def _cached_check_message(name: str, floating: bool, num_rows: int) -> str:
    return (f"{name} must be {'whole, ' if floating else ''}non-negative and sum to at most "
            f"the input's rows ({num_rows}); set TE_OPS_CHECK_SPLIT_SIZES=1 for an eager check "
            "that names the values")


def _cpu_has_padding(ends: torch.Tensor, num_rows: int) -> bool | None:
    """Whether the rows past the sizes' total exist, for a CPU tensor outside a trace (the
    total is in host memory: no sync); ``None`` (unknown) on other devices or when traced."""
    from .tracing import tracing

    if ends.device.type != "cpu" or tracing():
        return None
    return (int(ends[-1]) if ends.numel() else 0) < num_rows  # no groups: every row pads


def _host_tensor(host_sizes: list, device: torch.device) -> torch.Tensor:
    """(G,) int64 on ``device`` from host ints, or from SymInts while traced."""
    if any(isinstance(v, torch.SymInt) for v in host_sizes):
        return torch.stack([torch.scalar_tensor(v, dtype=torch.int64, device=device)
                            for v in host_sizes])
    return torch.tensor(host_sizes, dtype=torch.int64, device=device)


def _check_whole(sizes: list[float], name: str) -> None:
    for i, v in enumerate(sizes):
        if not math.isfinite(v) or v != int(v):
            raise ValueError(f"{name}[{i}] must be a whole number, got {v}")
        if abs(v) >= 2**63:
            raise ValueError(f"{name}[{i}] must be within int64's range, got {v}")


def _row_groups(base_offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Shape (num_rows,) int64: the number of group ends <= each row index (= its group;
    padding rows: G), from ``base_offsets`` (G + 1,): the group starts, then the total.

    The search runs over ``base_offsets`` itself (storage offset 0, first entry 0 in every
    ``GroupedSplits``), not its ends view ``base_offsets[1:]``, and takes one off for the
    leading 0 (the same values for every row index >= 0): inductor's
    ``searchsorted`` lowering in torch 2.11 ignores the storage offset of a sliced boundaries
    tensor and searched from the table's first entry (pytorch/pytorch#182343), which gave
    compiled CUDA blocks the wrong bias rows and blockwise-FP8 tiles."""
    rows = torch.arange(num_rows, device=base_offsets.device, dtype=torch.int64)
    if base_offsets.device.type == "cpu":
        # Same values as searchsorted(right=True); on a loaded 2-core host torch's CPU
        # searchsorted spent milliseconds in its thread pool for a few hundred rows.
        return (rows.unsqueeze(1) >= base_offsets[1:].unsqueeze(0)).sum(1)
    return torch.searchsorted(base_offsets, rows, right=True) - 1


def _check_host(sizes: list[int], num_rows: int, name: str) -> None:
    for i, v in enumerate(sizes):
        if v < 0:
            raise ValueError(f"{name}[{i}] must be >= 0, got {v}")
    total = sum(sizes)
    if total > num_rows:
        raise ValueError(
            f"{name} must sum to at most the input's rows ({num_rows}), got sum {total} "
            f"(sizes {sizes})"
        )
