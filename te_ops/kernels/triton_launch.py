"""The one eager launch of te_ops' Triton kernels, and the grid helpers their wrappers use.

:func:`launch` is ``kernel[grid](*args, **kwargs)`` on the device of the tensor arguments,
made from a cache of compiled kernels after the first launch of each call key, so a repeated
call skips ``JITFunction.run``'s per-call work. Under ``torch.compile`` the kernels are
``torch.library`` custom ops / ``triton_op`` kernels with fake kernels (e.g.
``te_ops/gemm/torch_ops.py``): the traced graph launches them (``wrap_triton``'s kernel objects,
which this module launches the normal way), not this cache.

``kernel[grid](*args, **kwargs)`` runs ``JITFunction.run`` on every call: it binds the
arguments to the signature, computes the specialization of every argument (dtype and 16-byte
alignment of tensors; 1 / multiple-of-16 / width of integers), hashes it with the options into
a cache key, looks the compiled kernel up, builds launch metadata for the launch hooks and
finally calls the compiled kernel's launcher. At decode sizes (E64 T256 on an H200) the step
makes eight such launches and is host-bound, so that work is a measurable part of the step
(about 0.7 ms of a 3 ms step under cProfile on an H200).

:class:`DirectLauncher` keeps, per call key, the compiled kernel that the first (normal)
launch returned, and later calls with the same key call its launcher directly with the same
arguments the normal launch passes (Triton 3.x: ``CompiledKernel.run(grid_x, grid_y, grid_z,
stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *bound_args)``,
bound arguments in signature order, constexprs included). The key is at least as fine as
Triton's own: the grid, the current device, every positional argument (tensors by dtype and
16-byte alignment, an unaligned one taking the normal launch; Python scalars by type and exact
value), the keyword arguments (constexprs and options such as ``num_warps``, by type and
value) and the runtime options ``JITFunction.run`` adds (``debug``, ``instrumentation_mode``
and, in later Triton, ``fpsan_homomorphic_casts``; read from Triton 3.6.0, the version the
H200 machine's torch bundles, and 3.9.0), so a key hit is a call that Triton would have
served from the same compiled kernel. A launcher keeps at most :data:`MAX_KEYS` keys (emptied
when full: every distinct integer value is a key).

The normal launch (``kernel[grid](*args, **kwargs)``) runs instead whenever the shortcut does not
apply: the kernel is not a plain ``triton.runtime.jit.JITFunction`` (``wrap_triton`` under
``torch.compile``, the interpreter under ``TRITON_INTERPRET=1``, Gluon's ``GluonJITFunction``,
whose launch layout this cache has not been checked against), it has pre-run hooks,
a global value it read changed since compilation (``JITFunction.run`` raises then), a launch
hook (e.g. the Triton profiler) is installed, an argument is of another kind or a tensor is not
16-byte aligned, a keyword value is not an int, bool, float, ``None`` or string (a tensor, a
tuple, a ``tl.dtype``), the grid is not a tuple (a callable ``grid(meta)``), a keyword
argument does not name a parameter or an option, or the compilation was asynchronous
(Triton's debug mode and instrumentation options are part of the key, so turning them on
compiles and launches the normal way). :meth:`DirectLauncher.stats` says how many launches took
which way and why the last fallback happened.
"""

from __future__ import annotations

import functools
import operator
import threading
from typing import Any

import torch

try:  # Triton is optional: CPU-only installs have no use for it
    import triton
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    JITFunction = None

__all__ = ["MAX_KEYS", "DirectLauncher", "capability", "cdiv", "direct_launcher", "launch",
           "next_power_of_2", "sm_count", "unsupported_reason"]

#: Options ``JITFunction.run`` accepts besides the kernel's parameters (the compile options of
#: the CUDA backend that te_ops passes); any other keyword takes the normal launch.
_OPTIONS = frozenset(("num_warps", "num_stages", "num_ctas", "maxnreg"))


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
#: Per CUDA device index: (the capability function that read it, (major, minor)).
_CAPABILITIES: dict[int, tuple[Any, tuple[int, int]]] = {}


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
    _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count


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
    and process (see :func:`sm_count`; the dispatch asks on every call). Read again when
    ``torch.cuda.get_device_capability`` is replaced (a test simulating another GPU).

    Raises
    ------
    ValueError
        ``device`` is not a CUDA device.
    """
    read = torch.cuda.get_device_capability
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    try:
        index = _cuda_index_of(device)
    except (AssertionError, RuntimeError):  # no CUDA runtime (fake CUDA tensors)
        return tuple(read(device))
    cached = _CAPABILITIES.get(index)
    if cached is None or cached[0] is not read:
        cached = _CAPABILITIES[index] = (read, tuple(read(index)))
    return cached[1]


def _cached_property(device: torch.device, table: dict) -> Any:
    """``table[index of device]``, reading the device's properties on the first ask."""
    index = _cuda_index_of(device)
    value = table.get(index)
    if value is None:
        _read_properties(index)
        value = table[index]
    return value


def unsupported_reason(kernel: Any) -> str | None:
    """Why ``kernel`` is always launched the normal way (``None``: the direct launch applies
    to it, call by call)."""
    if JITFunction is None:
        return "triton is not installed"
    if type(kernel) is not JITFunction:
        return f"{type(kernel).__name__} is not a plain triton JITFunction"
    missing = [a for a in ("arg_names", "pre_run_hooks", "used_global_vals")
               if not hasattr(kernel, a)]
    if missing:
        return f"this triton's JITFunction has no {missing} (launch layout not known)"
    return None


class _Runtime:
    """What a direct launch reads from Triton per call (a seam for tests without a GPU)."""

    def knobs(self) -> Any:
        return triton.knobs

    def device(self) -> int:
        return torch._C._cuda_getDevice()  # torch.cuda.current_device() without its re-init

    def stream(self, device: int) -> int:
        return triton.runtime.driver.active.get_current_stream(device)


def _idle(hook: Any) -> bool:
    """Whether a Triton launch hook does nothing (``None``, or a hook chain without calls)."""
    return hook is None or (type(getattr(hook, "calls", None)) is list and not hook.calls)


_MISSING = object()


def _globals_changed(used: dict) -> bool:
    """Whether a global value a compiled kernel read differs now (``JITFunction.run``'s
    check: ``used_global_vals`` maps (name, id of the globals dict) to (value, that dict))."""
    return any(gdict.get(name, _MISSING) != val for (name, _), (val, gdict) in used.items())


_SCALARS = (int, bool, float, type(None))
#: Types of keyword values (constexprs, options) the key takes: hashable, compared by value
#: and type; a tensor, tuple, list or ``tl.dtype`` by keyword takes the normal launch.
_KW_SCALARS = frozenset((*_SCALARS, str))

#: Most call keys one launcher keeps; a further key empties the cache first (each distinct
#: integer value is a key, e.g. every row count of a run whose token count varies, so an
#: unbounded cache would grow for the life of the process).
MAX_KEYS = 1024
_DTYPE = operator.attrgetter("dtype")
_DATA_PTR = torch.Tensor.data_ptr


def _getter(positions: list[int]):
    """A function returning the tuple of the arguments at ``positions``."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        i = positions[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*positions)


def _args_plan(types: tuple) -> tuple | None:
    """For positional arguments of these types: getters of the tensors and of the scalars
    (``None``: an argument of a kind this cache does not key)."""
    tensors = [i for i, t in enumerate(types) if issubclass(t, torch.Tensor)]
    scalars = [i for i, t in enumerate(types) if t in _SCALARS]
    if len(tensors) + len(scalars) != len(types):
        return None
    return _getter(tensors), _getter(scalars)


class DirectLauncher:
    """Launch ``kernel`` (a ``@triton.jit`` function) as ``kernel[grid](*args, **kwargs)``
    does, from a cache of compiled kernels after the first launch of each call key (see the
    module docstring).

    Parameters
    ----------
    kernel
        The ``@triton.jit`` function.
    runtime
        Where the per-call Triton state is read (tests pass a stand-in); default: Triton's.
    """

    def __init__(self, kernel: Any, runtime: Any = None) -> None:
        self.kernel = kernel
        self.runtime = runtime or _Runtime()
        self.reason = unsupported_reason(kernel) if runtime is None else None
        self.names = tuple(getattr(kernel, "arg_names", ()))
        self.cache: dict[tuple, tuple | None] = {}
        self.plans: dict[tuple, tuple | None] = {}
        self.direct = 0
        self.normal = 0
        self.last_fallback: str | None = self.reason

    def stats(self) -> dict[str, Any]:
        """Launch counts: ``direct`` (from the cache), ``normal`` (``JITFunction.run``),
        ``keys`` cached, ``last_fallback`` (why the last normal launch was one)."""
        return {"direct": self.direct, "normal": self.normal, "keys": len(self.cache),
                "last_fallback": self.last_fallback}

    def _fallback(self, why: str, grid: tuple, args: tuple, kwargs: dict) -> Any:
        self.normal += 1
        self.last_fallback = why
        return self.kernel[grid](*args, **kwargs)

    def __call__(self, grid: tuple, *args: Any, **kwargs: Any) -> None:
        """Launch on ``grid`` (a tuple of 1-3 ints; another grid, e.g. a callable, takes the
        normal launch) with the kernel's arguments."""
        self.run(grid, args, kwargs)

    def run(self, grid: tuple, args: tuple, kwargs: dict) -> None:
        """:meth:`__call__` with the arguments as a tuple and a dict (no repacking)."""
        if self.reason is not None:
            return self._fallback(self.reason, grid, args, kwargs)
        if type(grid) is not tuple:  # a callable grid(meta) or a list: Triton's own handling
            return self._fallback("a grid that is not a tuple", grid, args, kwargs)
        kernel = self.kernel
        if kernel.pre_run_hooks:
            return self._fallback("pre-run hooks", grid, args, kwargs)
        if kernel.used_global_vals and _globals_changed(kernel.used_global_vals):
            # JITFunction.run raises for a global changed since compilation.
            return self._fallback("a global value changed", grid, args, kwargs)
        knobs = self.runtime.knobs()
        rt = knobs.runtime
        if not (_idle(rt.launch_enter_hook) and _idle(rt.launch_exit_hook)):
            return self._fallback("a launch hook is installed", grid, args, kwargs)
        types = tuple(map(type, args))
        plan = self.plans.get(types, False)
        if plan is False:
            plan = self.plans[types] = _args_plan(types)
        if plan is None:
            return self._fallback("an argument of another kind", grid, args, kwargs)
        tensors = plan[0](args)
        if tensors and functools.reduce(operator.or_, map(_DATA_PTR, tensors)) & 15:
            # Triton specializes on each pointer's 16-byte alignment; te_ops' buffers are
            # aligned, so an unaligned one launches the normal way rather than widen the key.
            return self._fallback("a tensor not 16-byte aligned", grid, args, kwargs)
        if getattr(rt, "add_stages_inspection_hook", None) is not None:
            return self._fallback("a stages inspection hook is installed", grid, args, kwargs)
        kw_types = tuple(map(type, kwargs.values()))
        if not _KW_SCALARS.issuperset(kw_types):
            # Triton keys a keyword tensor by dtype and alignment, which this key would not
            # (and it would keep the tensor alive); other values may be unhashable.
            return self._fallback("a keyword argument of another kind", grid, args, kwargs)
        device = self.runtime.device()
        comp = knobs.compilation
        # Values with their types: True == 1 == 1.0 (one hash), which Triton compiles apart.
        key = (grid, device, types, plan[1](args), tuple(map(_DTYPE, tensors)),
               tuple(kwargs.items()), kw_types, rt.debug,
               getattr(comp, "instrumentation_mode", None),
               getattr(comp, "fpsan_homomorphic_casts", None))
        entry = self.cache.get(key, False)
        if entry is False:
            compiled = self._fallback("first launch of this key", grid, args, kwargs)
            if len(self.cache) >= MAX_KEYS:
                self.cache.clear()
            self.cache[key] = self._entry(compiled, len(args), kwargs)
            return None
        if entry is None:
            return self._fallback("this key cannot be launched directly", grid, args, kwargs)
        compiled, tail = entry
        self.direct += 1
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], g1, g2, self.runtime.stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *args, *tail)
        return None

    def _entry(self, compiled: Any, n_args: int, kwargs: dict) -> tuple | None:
        """(compiled kernel, the bound values after the positional ones), or ``None`` when
        this key must always take the normal launch."""
        if (compiled is None or hasattr(compiled, "result")
                or not all(hasattr(compiled, a) for a in ("run", "function",
                                                           "packed_metadata"))):
            return None  # asynchronous or unknown compilation result
        rest = self.names[n_args:]
        if any(name not in kwargs for name in rest):
            return None  # a parameter left to its default
        if any(k not in rest and k not in _OPTIONS for k in kwargs):
            return None  # a keyword this launcher does not know how JITFunction.run binds
        return compiled, tuple(kwargs[name] for name in rest)


_LAUNCHERS: dict[int, DirectLauncher] = {}


def direct_launcher(kernel: Any) -> DirectLauncher:
    """The shared :class:`DirectLauncher` of ``kernel`` (made on first use)."""
    launcher = _LAUNCHERS.get(id(kernel))
    if launcher is None or launcher.kernel is not kernel:
        launcher = _LAUNCHERS[id(kernel)] = DirectLauncher(kernel)
    return launcher


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
    """``kernel[grid](*args, **kwargs)`` on the device of the tensor arguments, through the
    kernel's shared :class:`DirectLauncher` when ``kernel`` is a plain ``JITFunction`` (other
    kernel objects, e.g. ``wrap_triton``'s under ``torch.compile``, launch the normal way).

    Triton launches on the *current* CUDA device and its current stream; when the tensors
    live on another device (``cuda:1`` while ``cuda:0`` is current) the launch runs with
    their device made current for its duration, so it goes to that device and that
    device's current stream."""
    index = _cuda_index(args)
    if index is not None and index != _current_device():
        with torch.cuda.device(index):
            _launch_here(kernel, grid, args, kwargs)
        return
    _launch_here(kernel, grid, args, kwargs)


def _launch_here(kernel: Any, grid: tuple, args: tuple, kwargs: dict) -> None:
    if type(kernel) is not JITFunction or JITFunction is None:
        kernel[grid](*args, **kwargs)
        return
    launcher = _LAUNCHERS.get(id(kernel))
    if launcher is None or launcher.kernel is not kernel:
        launcher = direct_launcher(kernel)
    launcher.run(grid, args, kwargs)
