"""The collectives of expert parallelism (EP), over a ``torch.distributed`` process group.

The EP ops (``te_ops/basic/ep.py``) and the router's group-wide balancing statistics call
these, never ``torch.distributed`` directly. Each is a functional collective
(``torch.ops._c10d_functional``: the op, then ``wait_tensor``): the same call runs eagerly on
gloo (CPU) and NCCL (CUDA), is recorded by ``torch.compile`` as a graph node, runs on ``meta``
tensors through its meta kernel (a shape-only run: no process group is touched) and, on NCCL,
is captured by CUDA graphs. On a one-rank group each returns its input unchanged and launches
nothing (a one-rank collective is the identity; Megatron-Core's ``all_to_all`` and
``gather_from_sequence_parallel_region`` mappings skip it likewise). Their autograd is the
ops' own (the backward of an all-to-all is the all-to-all with the split lists swapped), so
nothing here is differentiable.

:func:`device_splits_unavailable_reason` is the gate of the other dropless transport, torch's
symmetric-memory ``all_to_all_vdev_2d`` (split sizes read on the device, no host read): it
names why that transport is not taken for a call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GroupRef", "check_group", "backend", "group_name", "all_to_all", "all_gather",
           "all_reduce_sum", "device_splits_unavailable_reason"]


class GroupRef:
    """A process group held by an op: deep copies of the op share the group (a
    ``ProcessGroup`` cannot be copied); pickling raises."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict) -> GroupRef:
        return self

    def __reduce__(self) -> Any:
        raise TypeError("a torch.distributed process group cannot be pickled; build the "
                        "expert-parallel layer again in the new process")


def check_group(group: Any, name: str = "ep_group") -> tuple[int, int]:
    """``(size, rank)`` of ``group`` for this process.

    Raises
    ------
    RuntimeError
        ``torch.distributed`` is not initialized (``init_process_group`` first).
    TypeError
        ``group`` is not a ``torch.distributed.ProcessGroup``.
    ValueError
        This process is not a member of ``group``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{name}: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group first")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed.ProcessGroup (e.g. "
                        f"dist.new_group(ranks)), got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{name}: this process (global rank {dist.get_rank()}) is not a "
                         f"member of the group")
    return dist.get_world_size(group), rank


def backend(group: dist.ProcessGroup) -> str:
    """The group's backend name (``"gloo"``, ``"nccl"``, ...)."""
    return str(dist.get_backend(group))


def group_name(group: dist.ProcessGroup) -> str:
    """The name the functional collectives address ``group`` by."""
    return group.group_name


def _wait(t: torch.Tensor) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(t)


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
               group: dist.ProcessGroup) -> torch.Tensor:
    """``torch.distributed.all_to_all_single`` along dim 0: rows
    ``[sum(input_splits[:d]), sum(input_splits[:d + 1]))`` of ``x`` go to rank ``d``; the
    result holds ``output_splits[s]`` rows from each rank ``s``, in rank order.

    Shapes
    ------
    x (sum(input_splits), ...) -> (sum(output_splits), ...), x's dtype and device (``x``
    itself on a one-rank group).
    """
    if group.size() == 1:
        if list(output_splits) != list(input_splits):
            raise ValueError(f"output_splits must equal input_splits on a one-rank group, got "
                             f"{list(output_splits)} and {list(input_splits)}")
        return x
    out = torch.ops._c10d_functional.all_to_all_single(
        x.contiguous(), output_splits, input_splits, group_name(group))
    return _wait(out)


def all_gather(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """Every rank's ``x`` stacked in rank order: (size, *x.shape). ``size`` is the group's
    (one rank: a view of ``x``)."""
    if size == 1:
        return x.unsqueeze(0)
    out = torch.ops._c10d_functional.all_gather_into_tensor(
        x.contiguous(), size, group_name(group))
    return _wait(out).view(size, *x.shape)


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of every rank's ``x`` (a new tensor; ``x`` itself on a one-rank group)."""
    if group.size() == 1:
        return x
    out = torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", group_name(group))
    return _wait(out)


def device_splits_unavailable_reason(group: dist.ProcessGroup, device: torch.device) -> str:
    """Why the dropless dispatch does not exchange rows with split sizes kept on the device
    (torch's symmetric-memory ``all_to_all_vdev_2d``, NVSHMEM) for rows on ``device`` over
    ``group``; it then sends them with ``all_to_all_single``, whose split lists are read on
    the host once per step.

    Returns
    -------
    str
        The first condition that fails: a device other than CUDA, a backend other than NCCL,
        torch without symmetric memory or NVSHMEM, and, where all of those hold, that te_ops
        has no ``all_to_all_vdev_2d`` transport (it needs symmetric buffers sized for the
        worst-case receive, ``ep_size * tokens * top_k`` rows, registered per shape).
    """
    if device.type != "cuda":
        return (f"the rows are on {device.type}: torch's symmetric-memory all_to_all_vdev_2d "
                "runs on CUDA tensors only")
    name = backend(group)
    if name != "nccl":
        return (f"the group's backend is {name}: torch's symmetric-memory "
                "all_to_all_vdev_2d needs an NCCL group")
    try:
        from torch.distributed import _symmetric_memory as symm_mem
    except ImportError as exc:
        return f"torch has no symmetric memory ({exc})"
    available = getattr(symm_mem, "is_nvshmem_available", None)
    if available is None or not available():
        return ("NVSHMEM is not available to torch (torch.distributed._symmetric_memory."
                "is_nvshmem_available() is False or missing)")
    return ("te_ops has no all_to_all_vdev_2d transport: it needs symmetric receive buffers "
            "sized for the worst case (ep_size * tokens * top_k rows) registered per shape")
