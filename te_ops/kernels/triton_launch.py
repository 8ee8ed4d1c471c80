"""The one eager launch of te_ops' Triton kernels, and the grid helpers their wrappers use.

:func:`launch` is ``kernel[grid](*args, **kwargs)`` (Triton's own ``JITFunction.run``: argument
binding, specialization, the compiled-kernel cache) run on the device of the tensor arguments.
Under ``torch.compile`` the kernels are ``torch.library`` custom ops / ``triton_op`` kernels
with fake kernels (``torch.library`` custom ops, e.g. ``te_ops/gemm/torch_ops.py``): the traced graph launches them, not this
module.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["capability", "cdiv", "launch", "next_power_of_2", "sm_count"]


def cdiv(x: int, y: int) -> int:
    """``ceil(x / y)`` for launch grids: ``triton.cdiv``'s formula as a plain function (in
    Triton 3.6 ``triton.cdiv`` is a ``constexpr_function``, whose host-side call costs a few
    microseconds of wrapping per launch)."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= ``n`` (``n >= 1``): ``triton.next_power_of_2``'s bit steps
    as a plain function (see :func:`cdiv`)."""
    n -= 1
    n |= n >> 1
    n |= n >> 2
    n |= n >> 4
    n |= n >> 8
    n |= n >> 16
    n |= n >> 32
    return n + 1


_SM_COUNTS: dict[int, int] = {}
_CAPABILITIES: dict[int, tuple[int, int]] = {}


def _cuda_index_of(device: torch.device) -> int:
    """The index of CUDA ``device`` (the current device's for ``cuda`` without one).

    Raises
    ------
    ValueError
        ``device`` is not a CUDA device (its ``None`` index would read as the current CUDA
        device: another device's facts).
    """
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


def _read_properties(index: int) -> None:
    props = torch.cuda.get_device_properties(index)
    _SM_COUNTS[index] = props.multi_processor_count
    _CAPABILITIES[index] = (props.major, props.minor)


def sm_count(device: torch.device) -> int:
    """The multiprocessor count of CUDA ``device`` (``torch.cuda.get_device_properties``,
    read once per device and process: a persistent kernel's grid asks on every launch, and
    torch's call costs microseconds of device-index and property lookups).

    Raises
    ------
    ValueError
        ``device`` is not a CUDA device.
    """
    return _cached_property(device, _SM_COUNTS)


def capability(device: torch.device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability(device)`` of CUDA ``device``, read once per device
    and process (see :func:`sm_count`).

    Raises
    ------
    ValueError
        ``device`` is not a CUDA device.
    """
    return _cached_property(device, _CAPABILITIES)


def _cached_property(device: torch.device, table: dict) -> Any:
    """``table[index of device]``, reading the device's properties on the first ask."""
    index = _cuda_index_of(device)
    value = table.get(index)
    if value is None:
        _read_properties(index)
        value = table[index]
    return value


def _current_device() -> int:
    """The current CUDA device's index (the C call; CUDA is initialised once a CUDA tensor
    exists, which is when te_ops launches)."""
    return torch._C._cuda_getDevice()


def _cuda_index(args: tuple) -> int | None:
    """The CUDA device index of the first tensor among ``args`` (``None``: it is not a CUDA
    tensor, or there is none). te_ops' kernels take their tensors first, all on one device."""
    for a in args:
        if isinstance(a, torch.Tensor):
            index = a.get_device()
            return index if index >= 0 and a.is_cuda else None
    return None


def launch(kernel: Any, grid: tuple, *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)`` on the device of the tensor arguments.

    Triton launches on the *current* CUDA device and its current stream; when the tensors
    live on another device (``cuda:1`` while ``cuda:0`` is current) the launch runs with
    their device made current for its duration, so it goes to that device and that
    device's current stream."""
    index = _cuda_index(args)
    if index is not None and index != _current_device():
        with torch.cuda.device(index):
            kernel[grid](*args, **kwargs)
        return
    kernel[grid](*args, **kwargs)
