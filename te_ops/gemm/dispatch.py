"""Grouped GEMM dispatch: fprop, dgrad and wgrad of a grouped linear layer.

For group ``g`` with rows ``x_g`` (m_g, K), weight ``W_g`` (N, K) and output gradient ``dy_g``:

* fprop:  ``y_g  = x_g @ W_g^T``   (m_g, N)
* dgrad:  ``dx_g = dy_g @ W_g``    (m_g, K)
* wgrad:  ``dW_g = dy_g^T @ x_g``  (N, K)

Backends
--------
``grouped_mm``
    ``torch._grouped_mm`` with device offsets: one call for all groups, no host sync
    (graph-safe). Needs a device/dtype the installed torch supports (found by a one-time probe
    per device and dtype, which records torch's own error as the reason) and 16-byte aligned
    rows (``in_features`` and ``out_features`` times the element size divisible by 16). An
    operand of any of the three GEMMs whose own strides or data pointer are not aligned (a
    view of a larger buffer; :func:`grouped_mm_operand_reason`) is copied to an aligned
    tensor first, for every backend but ``loop`` (``explain()`` says so for the forward's
    operands; the values, and so the results, are the aligned operand's).
``loop``
    One ``torch.mm`` per group: runs everywhere, needs the split sizes on the host (a device
    tensor is copied to the host: a sync, so not graph-safe).
``triton``
    te_ops' Triton / Gluon kernels, with device offsets (graph-safe), per GEMM kind where the
    rules table (:mod:`te_ops.gemm.rules`) has a row for the call: the few-rows Triton kernels
    (``grouped_gemm_triton``, ``BackendChoice.triton_kinds``), the persistent many-rows ones
    (``grouped_gemm_large_triton`` / ``grouped_wgrad_large_triton``,
    ``BackendChoice.large_kinds``) and the warp-specialized Gluon ones (``grouped_gemm_gluon``
    for fprop / dgrad of ``large_kinds``, ``grouped_wgrad_gluon`` with the row's launch config,
    ``BackendChoice.gluon_kinds``); the other kinds of the call run in ``torch._grouped_mm``.
    Auto (the default) takes the table's ``auto`` rows (SM90, bfloat16, measured on the H200);
    ``TE_OPS_GROUPED_GEMM_BACKEND=triton`` its ``forced`` rows (bf16 / fp16 on any CUDA GPU:
    every kind in Triton, a wgrad into an fp32 ``main_grad`` in ``torch._grouped_mm`` where
    that runs, ``gemm/wgrad_into.py``).

registered kernels
    Kernels of :mod:`te_ops.gemm.registry`, under auto, per GEMM kind whose first holding and
    available rules row names one, on any device the row's ``device`` / ``arch`` allow (the
    table is read for them only while some kernel is registered; :func:`_with_registered`);
    ``BackendChoice.registered`` says which kinds, ``name`` the backend of the others.

Row gathers
-----------
An A operand (fprop's x, dgrad's dy, either operand of wgrad) may be a :class:`RowGather`:
rows ``src[index]`` of a source tensor (the MoE layer's tokens before the permute, its output
gradient before the combine). Where the call's kind runs in the few-rows Triton kernel, the
kernel reads the rows through the index in its load (no (rows, cols) copy is written);
elsewhere the rows are gathered first (:meth:`RowGather.rows`, a transient copy the GEMM reads
and drops) and the call runs as with a plain operand: :func:`row_gather_reason` says which.
Either way the result is bitwise the one of the gathered copy.

Rows past the split-size sum (padding) are zero in fprop/dgrad outputs for both backends
(``grouped_mm``: only those rows are written, by ``te_ops.kernels.padding``).
``TE_OPS_GROUPED_GEMM_BACKEND`` forces a backend; a forced backend that cannot run raises with
the reason.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch

from .. import env
from ..quantization.gemm import is_quantized, quantized_grouped_gemm
from ..routing import pick
from ..splits import META_LOOP_ERROR, GroupedSplits
from ..tracing import tracing
from .torch_ops import LOOP_GEMMS, grouped_mm, grouped_mm_loop, grouped_mm_loop_host
from . import grouped_gemm_gluon as gluon_gemm_module
from . import registry, rules
from .grouped_gemm_gluon import gluon_grouped_gemm
from .grouped_gemm_large_triton import large_dgrad, large_fprop
from .grouped_gemm_triton import triton_dgrad, triton_fprop, triton_wgrad
from .grouped_gemm_triton import unsupported_reason as triton_unsupported_reason
from .grouped_wgrad_gluon import gluon_unavailable_reason, gluon_unsupported_reason, gluon_wgrad
from .grouped_wgrad_large_triton import large_wgrad
from ..kernels.padding import zero_padding_rows_
from ..kernels.triton_launch import capability

__all__ = [
    "BackendChoice",
    "RowGather",
    "as_rows",
    "row_gather_reason",
    "rows_for",
    "grouped_mm_unsupported_reason",
    "grouped_mm_operand_reason",
    "grouped_mm_operands",
    "grouped_mm_host_sync_reason",
    "select_backend",
    "stack_weights",
    "storage_spans",
    "grouped_fprop",
    "grouped_dgrad",
    "grouped_wgrad",
]

_PROBE_CACHE: dict[tuple[str, int | None, torch.dtype], str | None] = {}


@dataclass(frozen=True)
class BackendChoice:
    """The grouped GEMM backend picked for a call, and why."""

    name: str  # "grouped_mm" | "loop" | "triton"
    reason: str
    graph_safe: bool
    #: With ``name == "triton"``: the GEMM kinds ("fprop", "dgrad", "wgrad") that run in
    #: te_ops' few-rows Triton kernels (``grouped_gemm_triton``); the others run in
    #: ``torch._grouped_mm`` unless in ``large_kinds``.
    triton_kinds: tuple[str, ...] = ()
    #: With ``name == "triton"``: the GEMM kinds that run in the persistent many-rows Triton
    #: kernels (``grouped_gemm_large_triton``).
    large_kinds: tuple[str, ...] = ()
    #: With ``name == "triton"``: the GEMM kinds that run in the warp-specialized Gluon
    #: kernels: fprop / dgrad of ``large_kinds`` instead of the persistent Triton kernel
    #: (``grouped_gemm_gluon``), wgrad (``grouped_wgrad_gluon``): the Gluon rows of
    #: ``te_ops.gemm.rules``.
    gluon_kinds: tuple[str, ...] = ()
    #: With "wgrad" in ``gluon_kinds``: the Gluon wgrad's launch config, a key of
    #: ``grouped_wgrad_gluon.PRESETS`` (the wgrad rules row's ``config``).
    gluon_wgrad_preset: str = "default"
    #: (kind, kernel name) pairs: the GEMM kinds that run in a kernel of
    #: :mod:`te_ops.gemm.registry` (its rules row holds), whatever ``name`` says of the others.
    registered: tuple[tuple[str, str], ...] = ()

    def registered_kernel(self, kind: str) -> registry.Kernel | None:
        """The registered kernel that runs ``kind`` (``None``: a built-in path runs it).

        Raises
        ------
        RuntimeError
            The kernel chosen for ``kind`` was unregistered since.
        """
        for k, name in self.registered:
            if k == kind:
                kernel = registry.get(name)
                if kernel is None:
                    raise RuntimeError(f"the GEMM kernel {name!r} chosen for {kind} is no "
                                       "longer registered (te_ops.gemm.unregister_kernel)")
                return kernel
        return None


class RowGather:
    """A grouped GEMM operand whose row ``m`` is row ``index[m]`` of ``src``.

    An ``index`` entry equal to ``len(src)`` (an empty capacity slot, a dropped pair) is a zero
    row: the values of :func:`te_ops.routing.pick` (``masked=True``; ``masked=False`` promises
    every entry is below ``len(src)``, so the plain gather runs).

    Shapes: ``src`` (S, cols), ``index`` (M,) int64 on ``src``'s device -> rows (M, cols) in
    ``src``'s dtype (``shape``, ``dtype`` and ``device`` are the gathered rows').
    """

    __slots__ = ("src", "index", "masked")

    def __init__(self, src: torch.Tensor, index: torch.Tensor, masked: bool = True) -> None:
        self.src, self.index, self.masked = src, index, masked

    @property
    def shape(self) -> tuple[int, int]:
        return (self.index.shape[0], self.src.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.src.dtype

    @property
    def device(self) -> torch.device:
        return self.src.device

    def rows(self) -> torch.Tensor:
        """The gathered rows, (M, cols), contiguous."""
        return pick(self.src, self.index, masked=self.masked)


def as_rows(t: torch.Tensor | RowGather) -> torch.Tensor:
    """``t``'s rows as a tensor: a :class:`RowGather` gathered (a copy), a tensor itself."""
    return t.rows() if isinstance(t, RowGather) else t


def rows_for(t: torch.Tensor | RowGather, backend: BackendChoice, kinds: tuple[str, ...]
             ) -> torch.Tensor | RowGather:
    """The operand that the GEMMs ``kinds`` (e.g. ``("dgrad", "wgrad")``, both reading ``t``)
    get: ``t`` itself where each of them takes a row index (:func:`row_gather_reason` is
    ``None``) or ``t`` is a tensor; otherwise ``t`` gathered once into the copy that all of them
    read (instead of one transient copy per GEMM)."""
    if isinstance(t, RowGather) and any(row_gather_reason(backend, k) is not None
                                        for k in kinds):
        return t.rows()
    return t


def row_gather_reason(backend: BackendChoice, kind: str) -> str | None:
    """Why a :class:`RowGather` operand of GEMM ``kind`` is gathered into a copy before the GEMM
    (``None``: the kernel gathers the rows in its A load). Only te_ops' few-rows Triton kernels
    (``triton_kinds``) take a row index; the persistent Triton and Gluon kernels read their
    operands through tile descriptors of a plain row-major tensor, ``torch._grouped_mm`` and
    the loop backend take plain tensors."""
    if backend.registered and any(k == kind for k, _ in backend.registered):
        return f"{kind} runs in a registered kernel, which takes plain operands"
    if kind in backend.triton_kinds:
        return None
    where = ("the persistent / Gluon Triton kernel" if kind in backend.large_kinds
             else "torch._grouped_mm" if backend.name in ("grouped_mm", "triton")
             else f"the {backend.name} backend")
    return (f"{kind} runs in {where}, which takes no row index: the rows are gathered into a "
            f"transient copy first")


def probe_settled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the ``torch._grouped_mm`` probe for ``device`` and ``dtype`` ran (before it
    has, e.g. inside a CUDA graph capture, a choice may differ from the settled one, so
    callers keep only choices made after it)."""
    return (device.type, device.index, dtype) in _PROBE_CACHE


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> str | None:
    key = (device.type, device.index, dtype)
    if key in _PROBE_CACHE:
        return _PROBE_CACHE[key]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "torch._grouped_mm was not probed before CUDA graph capture (run once eagerly)"
    if tracing():  # probe with real tensors, outside the fake/proxy modes of a trace
        from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

        with torch._subclasses.fake_tensor.unset_fake_temporarily(), \
                disable_proxy_modes_tracing():
            reason = _run_probe(device, dtype)
    else:
        reason = _run_probe(device, dtype)
    _PROBE_CACHE[key] = reason
    return reason


def _run_probe(device: torch.device, dtype: torch.dtype) -> str | None:
    # Meta takes the dtypes of the CPU kernel and runs te_ops' fake kernel (``grouped_mm``):
    # torch 2.13's own meta kernel takes bfloat16 only, the CPU kernel float32/float16 too.
    where = "cpu (meta takes the CPU kernel's dtypes)" if device.type == "meta" else device.type
    if device.type == "meta":
        device = torch.device("cpu")
    try:
        a = torch.zeros(32, 16, device=device, dtype=dtype)
        b = torch.zeros(2, 16, 16, device=device, dtype=dtype)
        offs = torch.arange(1, 3, device=device, dtype=torch.int32) * 16
        torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
        torch._grouped_mm(a.t(), a[:, :16], offs=offs)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        return f"torch._grouped_mm does not run for {dtype} on {where}: " + (
            str(exc).splitlines()[0][:200]
        )
    return None


def grouped_mm_unsupported_reason(device: torch.device, dtype: torch.dtype, in_features: int,
                                  out_features: int) -> str | None:
    """Why ``torch._grouped_mm`` cannot run this grouped linear (``None`` when it can)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    elem = dtype.itemsize
    for name, dim in (("in_features", in_features), ("out_features", out_features)):
        if (dim * elem) % 16:
            return (f"{name}={dim} x {elem} bytes is not a multiple of 16 bytes "
                    "(torch._grouped_mm needs 16-byte aligned rows)")
    return _probe_grouped_mm(device, dtype)


def grouped_mm_operand_reason(name: str, t: torch.Tensor) -> str | None:
    """Why ``torch._grouped_mm`` cannot read the operand ``t`` as it is (``None`` when it can).

    ``torch._grouped_mm`` takes a 2-D / 3-D operand whose last two dims are row- or
    column-major (one unit stride, the other at least that dim's size) with the other stride
    a multiple of 16 bytes; te_ops also asks a 3-D operand's batch stride and the data
    pointer to be 16-byte aligned (what the CUDA kernels' TMA descriptors need). Views of a
    larger buffer (``torch.split``, a checkpoint loader's slices, expanded gradients) can fail
    that where ``in_features`` / ``out_features`` pass :func:`grouped_mm_unsupported_reason`.
    The data pointer is not checked while tracing (fake tensors have none).
    """
    if t.dim() < 2 or t.numel() == 0:
        return None
    elem = t.element_size()
    if t.is_contiguous() and t.size(-1) * elem % 16 == 0:  # the common case, checked fast
        return _pointer_reason(name, t)
    (rows, cols), (rs, cs) = t.shape[-2:], t.stride()[-2:]
    if not ((cs == 1 and rs >= max(1, cols) and rs * elem % 16 == 0)
            or (rs == 1 and cs >= max(1, rows) and cs * elem % 16 == 0)):
        return (f"{name} has strides {tuple(t.stride())} for shape {tuple(t.shape)}: not a "
                f"row- or column-major matrix with a 16-byte aligned leading stride")
    if t.dim() == 3 and t.shape[0] > 1 and t.stride(0) * elem % 16:
        return f"{name}'s batch stride {t.stride(0)} x {elem} bytes is not 16-byte aligned"
    return _pointer_reason(name, t)


def _pointer_reason(name: str, t: torch.Tensor) -> str | None:
    try:
        offset = t.data_ptr() % 16  # meta tensors: 0
    except RuntimeError:  # fake tensors while tracing have no data pointer
        return None
    return f"{name}'s data pointer is {offset} bytes past a 16-byte boundary" if offset else None


def grouped_mm_operands(*named: tuple[str, torch.Tensor]
                        ) -> tuple[list[torch.Tensor], list[str]]:
    """The operands as a grouped GEMM reads them: each one that
    :func:`grouped_mm_operand_reason` rejects is copied to a new contiguous (so 16-byte
    aligned) tensor, the others are returned as they are; and the reasons of the copied
    ones. Same values, so the GEMM's result is the one it gives aligned operands."""
    out, reasons = [], []
    for name, t in named:
        reason = grouped_mm_operand_reason(name, t)
        if reason is not None:
            t = t.clone(memory_format=torch.contiguous_format)
            reasons.append(reason)
        out.append(t)
    return out, reasons


def grouped_mm_host_sync_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``torch._grouped_mm`` would sync with the host here (``None`` when it does not).

    On CUDA, torch's native grouped kernel covers bf16 on SM90 (Hopper) and SM100 (datacenter
    Blackwell) only (``_grouped_mm_cuda``'s fast path); other dtypes, other GPUs (SM80, SM110,
    SM120) and ROCm take a fallback that copies the offsets to the host (seen on an H200 with
    torch 2.11: float16 and float32 calls trip ``torch.cuda.set_sync_debug_mode("error")``).
    CPU and meta have no host/device boundary.
    """
    if device.type != "cuda":
        return None
    if dtype != torch.bfloat16:
        return (f"torch._grouped_mm on CUDA has a native kernel for bfloat16 only; for {dtype} "
                "it falls back to a loop that copies the offsets to the host")
    if torch.version.hip:
        return ("torch._grouped_mm on ROCm may take a fallback that copies the offsets to the "
                "host; not treated as graph-safe")
    major, minor = capability(device)
    if major not in (9, 10):
        return (f"torch._grouped_mm has a native kernel for SM90 and SM100 only, not "
                f"SM{major}{minor}; its fallback copies the offsets to the host")
    return None


def device_arch(device: torch.device) -> int | None:
    """The CUDA compute-capability major of ``device`` (the rules table's ``arch``); ``None``
    off CUDA."""
    if device.type != "cuda":
        return None
    return capability(device)[0]


def _available(out_features: int):
    """Which rules' kernels this install can run for a layer of ``out_features``: the Gluon
    fprop / dgrad need Gluon; the Gluon wgrad also Triton 3.6's Gluon API and ``out_features``
    a multiple of its tile (``grouped_wgrad_gluon.gluon_unavailable_reason``)."""
    def available(rule: rules.Rule) -> bool:
        if rule.kernel != "gluon":
            return True
        if "wgrad" in rule.kinds:
            return gluon_unavailable_reason(out_features) is None
        return gluon_gemm_module.gluon is not None
    return available


def gemm_rules(device: torch.device, dtype: torch.dtype, in_features: int, out_features: int,
               rows_per_group: float | None, mode: str) -> dict[str, rules.Rule | None]:
    """The rules table's row per GEMM kind (fprop, dgrad, wgrad) for this call (``None``:
    ``torch._grouped_mm``); ``mode`` ``"auto"`` or ``"forced"``."""
    arch = device_arch(device)
    # remembered for plain row counts (not a traced one: hashing it would specialize it)
    key = ((arch, dtype, in_features, out_features, rows_per_group, mode, rules.VERSION[0],
            gluon_gemm_module.gluon is None, gluon_unavailable_reason(out_features))
           if type(rows_per_group) in (float, int) else None)
    picks = _PICKS.get(key) if key is not None else None
    if picks is None:
        available = _available(out_features)
        picks = {k: rules.choose(k, rows_per_group, in_features, out_features, arch=arch,
                                 dtype=dtype, mode=mode, available=available) for k in _KINDS}
        if key is not None:
            if len(_PICKS) >= 1024:
                _PICKS.clear()
            _PICKS[key] = picks
    return picks


#: gemm_rules' answers per (arch, dtype, features, rows per group, mode, table version).
_PICKS: dict[tuple, dict[str, rules.Rule | None]] = {}


_KINDS = ("fprop", "dgrad", "wgrad")


def select_backend(device: torch.device, dtype: torch.dtype, in_features: int,
                   out_features: int, device_split_sizes: bool,
                   rows_per_group: float | None = None) -> BackendChoice:
    """Pick the grouped GEMM backend for one grouped linear call.

    Under auto (``TE_OPS_GROUPED_GEMM_BACKEND`` unset) on CUDA where the measured rules can
    apply (:func:`_measured_on`), each GEMM kind runs in the kernel of its row of
    :data:`te_ops.gemm.rules.RULES` (``torch._grouped_mm`` where none holds); on any device,
    a kind whose first holding row names a registered kernel runs in it.

    Parameters
    ----------
    device_split_sizes : bool
        Whether the split sizes are a device tensor (the loop backend then needs a host sync).
    rows_per_group : float, optional
        The call's rows (padding included) over its groups; ``None`` (not known, e.g. when
        planning) keeps auto off the ``triton`` backend.

    Raises
    ------
    RuntimeError
        ``TE_OPS_GROUPED_GEMM_BACKEND`` forces ``grouped_mm`` where it cannot run, or
        ``TE_OPS_GRAPH_SAFE=1`` forces the graph-safe path where it cannot be taken, or
        ``TE_OPS_GRAPH_SAFE=0`` forbids it where a forced backend takes it; the message gives
        the reason.
    """
    forced = env.read("TE_OPS_GROUPED_GEMM_BACKEND")
    graph_safe = env.read("TE_OPS_GRAPH_SAFE")
    # Only where the rules can apply (CUDA, and the measured device and dtype): a comparison of
    # a traced (symbolic) row count is a guard, a recompile where a dynamic count crosses it.
    auto = forced == "auto" and device.type == "cuda" and _measured_on(device, dtype)
    mode = ("auto" if auto else "forced" if forced == "triton" and device.type == "cuda"
            else None)
    picks = (gemm_rules(device, dtype, in_features, out_features, rows_per_group, mode)
             if mode else {})
    kernel = {k: r.kernel for k, r in picks.items() if r is not None}
    kinds = tuple(k for k in _KINDS if kernel.get(k) == "triton_rows")
    # the Gluon fprop / dgrad replace the persistent Triton kernel's launch (same bits)
    large = tuple(k for k in _KINDS if kernel.get(k) == "triton_persistent"
                  or (k != "wgrad" and kernel.get(k) == "gluon"))
    gluon = tuple(k for k in _KINDS if kernel.get(k) == "gluon")
    key = (device, dtype, in_features, out_features, device_split_sizes, forced, graph_safe,
           kinds, large, gluon, picks.get("wgrad"), rules.VERSION[0])
    choice = _CHOICES.get(key)
    if choice is None:
        choice = _select_backend(device, dtype, in_features, out_features, device_split_sizes,
                                 forced, graph_safe, kinds, large, gluon, picks)
        if probe_settled(device, dtype):
            if len(_CHOICES) >= 256:
                _CHOICES.clear()
            _CHOICES[key] = choice
    if forced == "auto" and registry.has_kernels():
        choice = _with_registered(choice, device, dtype, in_features, out_features,
                                  rows_per_group, device_split_sizes, graph_safe == "1")
    if (choice.name == "loop" and device_split_sizes and device.type == "meta"
            and not tracing() and len(choice.registered) < len(_KINDS)):
        raise RuntimeError(META_LOOP_ERROR)  # refused here, so explain() shows the call's error
    return choice


def _with_registered(choice: BackendChoice, device: torch.device, dtype: torch.dtype,
                     in_features: int, out_features: int, rows_per_group: float | None,
                     device_split_sizes: bool, graph_safe_only: bool) -> BackendChoice:
    """``choice`` with the GEMM kinds whose first holding rules row names a registered kernel
    (:mod:`te_ops.gemm.registry`) sent to it. The rows are read in table order on every
    device their ``device`` / ``arch`` allow; a built-in kernel's row counts where the built-in
    path takes it (CUDA, where the measured rules apply, its kernel available), so a built-in
    row before a registered one keeps its kinds. A registered kernel is skipped where its
    ``unavailable_reason`` gives a reason, or under ``TE_OPS_GRAPH_SAFE=1`` where it is not
    graph-safe."""
    arch = device_arch(device)
    builtin_ok = device.type == "cuda" and _measured_on(device, dtype)
    builtin_available = _available(out_features)

    def available(rule: rules.Rule) -> bool:
        kernel = registry.get(rule.kernel)
        if kernel is None:
            return builtin_ok and builtin_available(rule)
        if (any(kernel.runs(k) is None for k in rule.kinds)
                or (graph_safe_only and not kernel.graph_safe)):
            return False
        return (kernel.unavailable_reason is None
                or kernel.unavailable_reason(device, dtype, in_features, out_features) is None)

    picks = {k: rules.choose(k, rows_per_group, in_features, out_features, arch=arch,
                             dtype=dtype, device=device.type, available=available)
             for k in _KINDS}
    mine = {k: r for k, r in picks.items() if r is not None and registry.get(r.kernel)}
    if not mine:
        return choice
    by_kernel: dict[str, list[str]] = {}
    for k, r in mine.items():
        by_kernel.setdefault(r.kernel, []).append(k)
    parts = [f"{'/'.join(kinds)} in the registered kernel {name} "
             f"({registry.get(name).description}; rules: "
             f"{'; '.join(dict.fromkeys(mine[k].why for k in kinds))})"
             for name, kinds in by_kernel.items()]
    if len(mine) < len(_KINDS):
        parts.append(f"the other kinds: {choice.name} ({choice.reason})")
    graph_safe = (device_split_sizes
                  and all(registry.get(r.kernel).graph_safe for r in mine.values())
                  and (choice.graph_safe or len(mine) == len(_KINDS)))

    def rest(kinds: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(k for k in kinds if k not in mine)

    return dataclasses.replace(choice, reason="; ".join(parts), graph_safe=graph_safe,
                               triton_kinds=rest(choice.triton_kinds),
                               large_kinds=rest(choice.large_kinds),
                               gluon_kinds=rest(choice.gluon_kinds),
                               registered=tuple((k, r.kernel) for k, r in mine.items()))


#: select_backend's choices, per (device, dtype, features, split-size kind, env values, rules
#: rows); an entry is made only once the probe of its device and dtype is settled, and never
#: for a call that raises.
_CHOICES: dict[tuple, BackendChoice] = {}


def _select_backend(device: torch.device, dtype: torch.dtype, in_features: int,
                    out_features: int, device_split_sizes: bool, forced: str,
                    graph_safe: str, kinds: tuple[str, ...] = (),
                    large: tuple[str, ...] = (), gluon: tuple[str, ...] = (),
                    picks: dict[str, rules.Rule | None] | None = None) -> BackendChoice:
    picks = picks or {}
    reason = grouped_mm_unsupported_reason(device, dtype, in_features, out_features)
    sync_reason = grouped_mm_host_sync_reason(device, dtype)
    mm_graph_safe = device_split_sizes and sync_reason is None
    auto_triton = None if forced != "auto" else triton_auto_reason(device, dtype, kinds)
    auto_large = None if forced != "auto" else large_auto_reason(device, dtype, large)
    if forced == "triton":
        why = triton_unsupported_reason(device, dtype)
        if why is not None:
            raise RuntimeError(f"TE_OPS_GROUPED_GEMM_BACKEND=triton cannot run: {why}")
        choice = BackendChoice(
            "triton", "forced by TE_OPS_GROUPED_GEMM_BACKEND: " + (
                f"{'/'.join(large)} in the persistent many-rows kernels (the forced rows of "
                "te_ops.gemm.rules: from 512 rows per group)"
                if large else "fprop/dgrad/wgrad in the few-rows Triton kernels (the forced "
                "rows of te_ops.gemm.rules: below 512 rows per group, or not known yet)")
            + "; wgrad into an fp32 main_grad in torch._grouped_mm where it runs",
            graph_safe=device_split_sizes,
            triton_kinds=tuple(k for k in _KINDS if k not in large),
            large_kinds=large)
    elif forced == "grouped_mm":
        if reason is not None:
            raise RuntimeError(f"TE_OPS_GROUPED_GEMM_BACKEND=grouped_mm cannot run: {reason}")
        choice = BackendChoice("grouped_mm", "forced by TE_OPS_GROUPED_GEMM_BACKEND",
                               graph_safe=mm_graph_safe)
    elif forced == "loop":
        choice = BackendChoice("loop", "forced by TE_OPS_GROUPED_GEMM_BACKEND", False)
    elif graph_safe == "0" and device_split_sizes:
        choice = BackendChoice("loop", "TE_OPS_GRAPH_SAFE=0 forbids the graph-safe path", False)
    elif reason is None and ((auto_triton is None and kinds)
                             or (auto_large is None and large) or "wgrad" in gluon):
        # A kind runs in one kernel: its row of the rules table. The Gluon wgrad comes first;
        # the Gluon fprop / dgrad replace the persistent Triton kernel's (a subset of ``big``).
        wgrad_gluon = tuple(k for k in gluon if k == "wgrad")
        small = tuple(k for k in kinds if k not in wgrad_gluon) if auto_triton is None else ()
        big = (tuple(k for k in large if k not in small + wgrad_gluon)
               if auto_large is None else ())
        in_gluon = tuple(k for k in gluon if k in big and k != "wgrad")
        rest = [k for k in _KINDS if k not in small + big + wgrad_gluon]
        # a wgrad into an fp32 main_grad runs torch._grouped_mm (out_dtype) where it can
        # (gemm/wgrad_into.py): said on the part that holds wgrad
        mg = ", wgrad into an fp32 main_grad in torch._grouped_mm where it runs"
        def rules_text(kinds: tuple[str, ...]) -> str:
            whys = list(dict.fromkeys(picks[k].why for k in kinds if picks.get(k)))
            return f"rules: {'; '.join(whys)}" if whys else "rules of te_ops.gemm.rules"

        parts = []
        if wgrad_gluon:
            config = picks["wgrad"].config if picks.get("wgrad") else "default"
            parts.append(f"wgrad in the warp-specialized Gluon wgrad (launch config {config!r}; "
                         f"{rules_text(wgrad_gluon)}; a call whose operands are not 16-byte "
                         f"aligned runs torch._grouped_mm{mg})")
        if small:
            parts.append(f"{'/'.join(small)} in Triton (few rows per group; {rules_text(small)}"
                         f"{mg if 'wgrad' in small else ''})")
        if big:
            parts.append(f"{'/'.join(big)} in the persistent Triton grouped GEMM (many rows per "
                         f"group; {rules_text(tuple(k for k in big if k not in in_gluon))}"
                         f"{mg if 'wgrad' in big else ''})")
        if in_gluon:
            parts.append(f"of those, {'/'.join(in_gluon)} in the warp-specialized Gluon kernel "
                         f"({in_features} -> {out_features} features, same bits; "
                         f"{rules_text(in_gluon)})")
        if rest:
            parts.append(f"{'/'.join(rest)} in torch._grouped_mm")
        preset = (picks["wgrad"].config if wgrad_gluon and picks.get("wgrad") else "default")
        choice = BackendChoice("triton", "; ".join(parts), graph_safe=mm_graph_safe,
                               triton_kinds=small, large_kinds=big,
                               gluon_kinds=in_gluon + wgrad_gluon,
                               gluon_wgrad_preset=preset)
    elif reason is None:
        why = "device, dtype and alignment allow it"
        if device.type == "cuda" and auto_triton is not None and auto_large is not None:
            why += f"; triton not taken: {auto_triton}" + (
                f"; {auto_large}" if auto_large != auto_triton else "")
        choice = BackendChoice("grouped_mm", why, graph_safe=mm_graph_safe)
    else:
        choice = BackendChoice("loop", reason, False)
    if graph_safe == "0" and choice.graph_safe:  # only a forced backend gets here
        raise RuntimeError(
            f"TE_OPS_GRAPH_SAFE=0 forbids the graph-safe path, but TE_OPS_GROUPED_GEMM_BACKEND="
            f"{forced} keeps the device split sizes on the device (graph-safe): unset one of "
            "the two, or pass split sizes as a host list")
    if graph_safe == "1" and not choice.graph_safe:
        raise RuntimeError(
            "TE_OPS_GRAPH_SAFE=1 but the graph-safe path is unsupported: "
            + _graph_safe_reason(choice, device_split_sizes, sync_reason)
        )
    return choice


def triton_auto_reason(device: torch.device, dtype: torch.dtype, kinds: tuple[str, ...]
                       ) -> str | None:
    """Why auto dispatch runs no GEMM kind in the few-rows Triton kernels (``None`` when it
    runs some): not where the rules were measured, or no ``triton_rows`` row holds."""
    why = _measured_on_reason(device, dtype)
    if why is not None:
        return why
    if not kinds:
        return ("no few-rows row of te_ops.gemm.rules holds (more rows per group, or not "
                "known), where torch._grouped_mm was measured as fast or faster")
    return None


def _measured_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the measured rules can apply on ``device`` for ``dtype`` (remembered per device
    and dtype: :func:`select_backend` asks on every call)."""
    key = (device.type, device.index, dtype)
    applies = _MEASURED_ON.get(key)
    if applies is None:
        applies = _MEASURED_ON[key] = _measured_on_reason(device, dtype) is None
    return applies


_MEASURED_ON: dict[tuple[str, int | None, torch.dtype], bool] = {}


def _measured_on_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the measured rules do not apply here: Triton cannot run, or no auto row of the
    rules table is for this architecture and dtype."""
    why = triton_unsupported_reason(device, dtype)
    if why is not None:
        return why
    arch = device_arch(device)
    auto_rows = [r for r in rules.RULES if r.mode == "auto"
                 and any(k in _KINDS for k in r.kinds)]
    if not any(dtype in r.dtypes for r in auto_rows):
        return f"auto takes the Triton GEMMs for bfloat16 only (measured), not {dtype}"
    if not any(r.arch is None or r.arch == arch for r in auto_rows):
        minor = capability(device)[1]
        return f"measured faster on SM90 only, not SM{arch}{minor}"
    return None


def large_auto_reason(device: torch.device, dtype: torch.dtype, large: tuple[str, ...]
                      ) -> str | None:
    """Why auto dispatch runs no GEMM kind in the persistent many-rows kernels (``None`` when
    it runs some): not where the rules were measured, or no persistent row holds."""
    why = _measured_on_reason(device, dtype)
    if why is not None:
        return why
    if not large:
        return ("no persistent-kernel row of te_ops.gemm.rules holds (fewer rows per group, "
                "or not known), where the persistent Triton kernel was not measured faster")
    return None


def _graph_safe_reason(choice: BackendChoice, device_split_sizes: bool,
                       sync_reason: str | None) -> str:
    if not device_split_sizes:
        return "split sizes are a host list (pass a 1-D integer tensor on the device)"
    if choice.name == "loop":
        return f"the loop backend copies split sizes to the host ({choice.reason})"
    return sync_reason or choice.reason


def stack_weights(weights: list[torch.Tensor], prefix: str | None = None) -> torch.Tensor:
    """The (num_groups, *shape) stacked tensor, e.g. (G, N, K) weights.

    No copy when the tensors are adjacent slices of one buffer. ``prefix``: the parameters'
    name stem for errors (``"weight"``: ``weight3``; default ``weights[3]``).

    Raises
    ------
    ValueError
        A tensor's shape, dtype or device differs from the first's (the message names it).

    :class:`~te_ops.basic.GroupedLinear` allocates its weights as consecutive slices of one
    buffer, so this is normally a free view; otherwise (weights replaced, or on ``meta``) it
    stacks them (a copy).
    """
    w0 = weights[0]
    n = len(weights)
    step = w0.numel() * w0.element_size()
    if w0.device.type != "meta" and w0.is_contiguous() and not tracing():
        # Checked every call (parameters can be re-pointed), with C-level loops: the host cost
        # matters at 64-128 experts. The memo (per tensor ids; no tensor is kept alive by it)
        # holds the data pointers, dtypes and shapes of a stack found adjacent and uniform;
        # all three are compared every call (``w.data = w.data.view(torch.float16)`` or
        # ``.view(in, out)`` of one weight keeps its pointer), and so are contiguity and
        # weight0's storage span (``w.data = w.data.t()`` of a square weight keeps its data
        # pointer and shape, not its strides; weights re-allocated one by one can get the old
        # slices' addresses in storages of their own).
        start = w0.data_ptr()
        ptrs = list(map(torch.Tensor.data_ptr, weights))
        meta = list(map(_DTYPE_SHAPE, weights))
        key = tuple(map(id, weights))
        if all(map(torch.Tensor.is_contiguous, weights)) and storage_spans(w0, n * step) and (
            _STACK_MEMO.get(key) == (ptrs, meta) or (
                ptrs == list(range(start, start + n * step, step))
                and set(meta) == {(w0.dtype, w0.shape)}
                and _remember(key, (ptrs, meta)))):
            return w0.as_strided((n, *w0.shape), (w0.numel(), *w0.stride()))

    def name(i: int) -> str:
        return f"{prefix}{i}" if prefix else f"weights[{i}]"

    for i, w in enumerate(weights):
        if w.shape != w0.shape:
            raise ValueError(f"{name(i)} has shape {tuple(w.shape)}, expected "
                             f"{tuple(w0.shape)} as {name(0)}: the per-group parameters must "
                             f"all have one shape")
        if w.dtype != w0.dtype or w.device != w0.device:
            # torch.stack would promote the dtype (or fail on devices) without naming it.
            raise ValueError(f"{name(i)} is {w.dtype} on {w.device}, expected {w0.dtype} on "
                             f"{w0.device} as {name(0)}: the per-group parameters must all "
                             f"have one dtype and device (was one cast or moved alone?)")
    return torch.stack(weights)


_STACK_MEMO: dict[tuple, tuple[list, list]] = {}
_DTYPE_SHAPE = operator.attrgetter("dtype", "shape")


def storage_spans(w0: torch.Tensor, nbytes: int) -> bool:
    """Whether ``w0``'s storage holds ``nbytes`` bytes from ``w0``'s first element (the
    (G, ...) view from it stays inside the storage)."""
    return w0.untyped_storage().nbytes() >= w0.storage_offset() * w0.element_size() + nbytes


def _remember(key: tuple, value: tuple[list, list]) -> bool:
    if len(_STACK_MEMO) >= 256:
        _STACK_MEMO.clear()
    _STACK_MEMO[key] = value
    return True


def _zero_padding(out: torch.Tensor, splits: GroupedSplits) -> torch.Tensor:
    if splits.has_padding is False:
        return out
    # Only the rows past the device-side total are written (see kernels/padding.py); the
    # shared padding mask is built only if the mask path runs.
    return zero_padding_rows_(out, splits.offsets, splits.padding_rows)


def grouped_fprop(x: torch.Tensor, weights: torch.Tensor, splits: GroupedSplits,
                  backend: BackendChoice, aligned: bool = False) -> torch.Tensor:
    """``y_g = x_g @ W_g^T`` for every group.

    Shapes: x (M, K) (or a :class:`RowGather` of M rows), weights (G, N, K) → y (M, N), same
    dtype as x; padding rows are zero.
    Quantized operands (a recipe's ``QuantizedTensorStorage``) go to the scaled GEMMs of
    ``te_ops.quantization.gemm`` (same for dgrad and wgrad). ``aligned``: the plain operands
    come from :func:`grouped_mm_operands` already (the caller recorded its reasons), so they
    are not checked again.
    """
    if isinstance(x, RowGather):
        if row_gather_reason(backend, "fprop") is None:
            return triton_fprop(x.src, weights, splits.offsets, a_rows=x.index)
        x = x.rows()
    if is_quantized(x):
        return quantized_grouped_gemm("fprop", x, weights, splits, backend, grouped_fprop)
    if backend.registered and (kernel := backend.registered_kernel("fprop")) is not None:
        return kernel.fprop(x, weights, splits)
    if backend.name != "loop" and not aligned:  # misaligned views are copied
        (x, weights), _ = grouped_mm_operands(("x", x), ("weights", weights))
    if "fprop" in backend.triton_kinds:
        return triton_fprop(x, weights, splits.offsets)
    if "fprop" in backend.large_kinds:
        if "fprop" in backend.gluon_kinds:
            return gluon_grouped_gemm(x, weights, splits.offsets, dgrad=False)
        return large_fprop(x, weights, splits.offsets)
    if backend.name in ("grouped_mm", "triton"):
        if x.shape[0] == 0:  # _grouped_mm rejects empty operands with zero strides
            return x.new_zeros(0, weights.shape[1])
        out = grouped_mm(x, weights.transpose(-2, -1), splits.offsets)
        return _zero_padding(out, splits)
    return _loop("fprop", x, weights, splits)


def grouped_dgrad(dy: torch.Tensor, weights: torch.Tensor, splits: GroupedSplits,
                  backend: BackendChoice) -> torch.Tensor:
    """``dx_g = dy_g @ W_g`` for every group.

    Shapes: dy (M, N) (or a :class:`RowGather`), weights (G, N, K) → dx (M, K); padding rows
    are zero.
    """
    if isinstance(dy, RowGather):
        if row_gather_reason(backend, "dgrad") is None:
            return triton_dgrad(dy.src, weights, splits.offsets, a_rows=dy.index)
        dy = dy.rows()
    if is_quantized(dy):
        return quantized_grouped_gemm("dgrad", dy, weights, splits, backend, grouped_dgrad)
    if backend.registered and (kernel := backend.registered_kernel("dgrad")) is not None:
        return kernel.dgrad(dy, weights, splits)
    if backend.name != "loop":
        (dy, weights), _ = grouped_mm_operands(("dy", dy), ("weights", weights))
    if "dgrad" in backend.triton_kinds:
        return triton_dgrad(dy, weights, splits.offsets)
    if "dgrad" in backend.large_kinds:
        if "dgrad" in backend.gluon_kinds:
            return gluon_grouped_gemm(dy, weights, splits.offsets, dgrad=True)
        return large_dgrad(dy, weights, splits.offsets)
    if backend.name in ("grouped_mm", "triton"):
        if dy.shape[0] == 0:  # e.g. the zero-stride grad of an empty batch's .sum()
            return dy.new_zeros(0, weights.shape[2])
        out = grouped_mm(dy, weights, splits.offsets)
        return _zero_padding(out, splits)
    return _loop("dgrad", dy, weights, splits)


def grouped_wgrad(x: torch.Tensor, dy: torch.Tensor, splits: GroupedSplits,
                  backend: BackendChoice) -> torch.Tensor:
    """``dW_g = dy_g^T @ x_g`` for every group (zero for empty groups).

    Shapes: x (M, K), dy (M, N) (either a :class:`RowGather`) → dW (G, N, K), dtype of x.
    Padding rows do not contribute.
    """
    if isinstance(x, RowGather) or isinstance(dy, RowGather):
        if row_gather_reason(backend, "wgrad") is None and not (is_quantized(x)
                                                                 or is_quantized(dy)):
            xs, x_rows = (x.src, x.index) if isinstance(x, RowGather) else (x, None)
            ds, dy_rows = (dy.src, dy.index) if isinstance(dy, RowGather) else (dy, None)
            return triton_wgrad(xs, ds, splits.offsets, x_rows=x_rows, dy_rows=dy_rows)
        x, dy = as_rows(x), as_rows(dy)
    if is_quantized(x):
        return quantized_grouped_gemm("wgrad", x, dy, splits, backend, grouped_wgrad)
    if backend.registered and (kernel := backend.registered_kernel("wgrad")) is not None:
        return kernel.wgrad(x, dy, splits)
    if backend.name != "loop":
        (x, dy), _ = grouped_mm_operands(("x", x), ("dy", dy))
    if "wgrad" in backend.gluon_kinds:
        x, dy = x.contiguous(), dy.contiguous()
        if gluon_unsupported_reason(x, dy) is None:  # else (a misaligned base) _grouped_mm
            return gluon_wgrad(x, dy, splits.offsets, preset=backend.gluon_wgrad_preset)
    if "wgrad" in backend.triton_kinds:
        return triton_wgrad(x, dy, splits.offsets)
    if "wgrad" in backend.large_kinds:
        return large_wgrad(x, dy, splits.offsets)
    if backend.name in ("grouped_mm", "triton"):
        if x.shape[0] == 0:
            return x.new_zeros(splits.num_groups, dy.shape[1], x.shape[1])
        return grouped_mm(dy.t(), x, splits.offsets)
    return _loop("wgrad", x, dy, splits)


def _loop(kind: str, a: torch.Tensor, b: torch.Tensor, splits: GroupedSplits) -> torch.Tensor:
    """The loop backend. Traced with device split sizes, it runs as the custom op
    ``te_ops::grouped_mm_loop`` (the host read happens inside the op, at run time); with host
    split sizes (SymInts) as ``te_ops::grouped_mm_loop_host``, so the graph is not
    specialized to which groups are empty."""
    if tracing():
        if splits.host_sizes is None:
            return grouped_mm_loop(a, b, splits.split_sizes, kind)
        return grouped_mm_loop_host(a, b, list(splits.host_sizes), kind)
    return LOOP_GEMMS[kind](a, b, splits.sizes_on_host())
