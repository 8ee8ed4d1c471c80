"""The GEMM kernel registry: kernels that the dispatch runs through its generic path.

A kernel module calls :func:`register_kernel` with its name and one callable per GEMM kind it
runs; a row of :data:`te_ops.gemm.rules.RULES` naming that ``kernel`` then sends the calls its
box holds to it (docs/architecture.md, "Adding a GEMM backend"). Kernel modules in
``te_ops/gemm/backends/`` are imported (so registered) by the package import. The built-in
Triton / Gluon kernels (``triton_rows``, ``triton_persistent``, ``gluon``) and ``grouped_mm``
keep their own paths in :mod:`te_ops.gemm.dispatch` and are not in this registry.

Callables (``splits``: a :class:`te_ops.splits.GroupedSplits`; operands as the caller holds
them, not copied to 16-byte alignment):

* ``fprop(x (M, K), weights (G, N, K), splits) -> (M, N)``
* ``dgrad(dy (M, N), weights (G, N, K), splits) -> (M, K)``
* ``wgrad(x (M, K), dy (M, N), splits) -> (G, N, K)`` (zero for empty groups)

fprop / dgrad write zeros into padding rows (rows past the split-size sum).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Kernel", "register_kernel", "unregister_kernel", "registered_kernels",
           "BUILTIN_KERNELS", "VERSION"]

#: The kernels with their own dispatch path (not registered here).
BUILTIN_KERNELS = ("triton_rows", "triton_persistent", "gluon", "grouped_mm")
_GEMM_KINDS = ("fprop", "dgrad", "wgrad")

#: Bumped on every (un)registration; the dispatch's caches are keyed on it.
VERSION = [0]


@dataclass(frozen=True)
class Kernel:
    """A registered GEMM kernel.

    ``unavailable_reason(device, dtype, in_features, out_features)``: why it cannot run this
    call (``None`` when it can); the dispatch skips a row whose kernel gives a reason.
    ``graph_safe``: whether it runs with device split sizes without a host sync.
    """

    name: str
    fprop: Callable | None
    dgrad: Callable | None
    wgrad: Callable | None
    unavailable_reason: Callable[[torch.device, torch.dtype, int, int], str | None] | None
    graph_safe: bool
    description: str

    def runs(self, kind: str) -> Callable | None:
        """The callable for ``kind`` (``None``: this kernel does not run it)."""
        return getattr(self, kind)


_KERNELS: dict[str, Kernel] = {}


def register_kernel(name: str, *, fprop: Callable | None = None, dgrad: Callable | None = None,
                    wgrad: Callable | None = None,
                    unavailable_reason: Callable[..., str | None] | None = None,
                    graph_safe: bool = False, description: str = "") -> Kernel:
    """Register a GEMM kernel under ``name`` (the rules rows' ``kernel``).

    Parameters
    ----------
    name : str
        A new name: not a built-in kernel's (:data:`BUILTIN_KERNELS`) nor a registered one's.
    fprop, dgrad, wgrad : callable, optional
        The GEMM kinds it runs (signatures in the module docstring); at least one.
    unavailable_reason : callable, optional
        ``(device, dtype, in_features, out_features) -> str | None``; default: runs anywhere.
    graph_safe : bool
        Whether it needs no host sync with device split sizes (default False).
    description : str
        A few words for ``explain()`` (default: the name).

    Raises
    ------
    ValueError
        ``name`` is taken or not a non-empty string, or no GEMM kind is given.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if name in BUILTIN_KERNELS or name in _KERNELS:
        raise ValueError(f"name {name!r} is taken (built-in: {BUILTIN_KERNELS}; registered: "
                         f"{tuple(_KERNELS)})")
    if fprop is None and dgrad is None and wgrad is None:
        raise ValueError(f"kernel {name!r} must run at least one of fprop, dgrad, wgrad")
    kernel = Kernel(name, fprop, dgrad, wgrad, unavailable_reason, graph_safe,
                    description or name)
    _KERNELS[name] = kernel
    VERSION[0] += 1
    return kernel


def unregister_kernel(name: str) -> None:
    """Remove a kernel registered earlier (tests).

    Raises
    ------
    KeyError
        No kernel ``name`` is registered.
    """
    if name not in _KERNELS:
        raise KeyError(f"no GEMM kernel {name!r} is registered (registered: {tuple(_KERNELS)})")
    del _KERNELS[name]
    VERSION[0] += 1


def registered_kernels() -> dict[str, Kernel]:
    """The registered kernels by name (a copy)."""
    return dict(_KERNELS)


def has_kernels() -> bool:
    """Whether any kernel is registered (the dispatch reads the rules for them only then)."""
    return bool(_KERNELS)


def get(name: str) -> Kernel | None:
    """The registered kernel ``name`` (``None``: not registered, or built-in)."""
    return _KERNELS.get(name)
