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
    rows (``in_features`` and ``out_features`` times the element size divisible by 16).
``loop``
    One ``torch.mm`` per group: runs everywhere, needs the split sizes on the host (a device
    tensor is copied to the host: a sync, so not graph-safe).
``triton``
    te_ops' Triton kernels for few rows per group (``kernels/grouped_gemm_triton.py``), with
    device offsets (graph-safe). Auto picks it only where it was measured faster than
    ``torch._grouped_mm`` on the H200, per GEMM kind (``BackendChoice.triton_kinds``): CUDA
    SM90, bfloat16, rows (padding included) per group on average at most
    ``grouped_gemm_triton.MAX_ROWS_PER_GROUP[kind]`` (the caller passes ``rows_per_group``);
    the other kinds of the call run in ``torch._grouped_mm``. For many rows per group, the
    persistent Triton kernels (``kernels/grouped_gemm_large_triton.py``,
    ``BackendChoice.large_kinds``): auto runs fprop and dgrad there on SM90 in bfloat16 at
    ``grouped_gemm_large_triton.MIN_ROWS_PER_GROUP`` rows per group or more where
    ``torch._grouped_mm`` can run (measured 1.00-1.22x ``torch._grouped_mm`` per GEMM on the
    issue-10 shapes), and wgrad at ``WGRAD_ROWS_PER_GROUP`` (64-256) rows per group (measured
    1.01-1.09x there; at parity, 0.96-1.07x, on the issue-10 shapes); of those, the (kind,
    features, rows per group) that ``grouped_gemm_gluon.GLUON_RULE`` lists (measured shapes
    only) run in the warp-specialized Gluon fprop/dgrad kernel (same bits). At
    ``grouped_wgrad_gluon.MID_MIN_ROWS_PER_GROUP`` (512) rows per group or more, wgrad runs in
    the warp-specialized Gluon wgrad (``kernels/grouped_wgrad_gluon.py``; ``TE_OPS_GLUON_WGRAD``):
    with its 4-stage config ``MID_ROWS_CONFIG`` below ``MIN_ROWS_PER_GROUP`` (1024; measured
    1.12-1.21x ``torch._grouped_mm`` at 512), with the default config from there (measured
    1.04-1.13x; ``BackendChoice.gluon_wgrad_preset``). Both are ``BackendChoice.gluon_kinds``.
    Forced, all three kinds
    run in Triton, for bf16/fp16 on any CUDA GPU: the persistent kernels (wgrad too) at
    ``FORCED_MIN_ROWS_PER_GROUP`` rows per group or more, the few-rows kernels below (a wgrad
    into an fp32 ``main_grad`` stays ``torch._grouped_mm`` where that runs,
    ``kernels/wgrad_into.py``).

Rows past the split-size sum (padding) are zero in fprop/dgrad outputs for both backends
(``grouped_mm``: only those rows are written, by ``kernels.padding``).
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
from ..splits import META_LOOP_ERROR, GroupedSplits
from .compiled_ops import grouped_mm, grouped_mm_loop, grouped_mm_loop_host, tracing
from .grouped_gemm_gluon import GLUON_RULE, gluon_grouped_gemm
from .grouped_gemm_gluon import gluon_kinds as gluon_gemm_kinds
from .grouped_gemm_large_triton import (
    FORCED_MIN_ROWS_PER_GROUP,
    MIN_ROWS_PER_GROUP,
    WGRAD_ROWS_PER_GROUP,
    large_dgrad,
    large_fprop,
    large_kinds,
)
from .grouped_gemm_triton import (
    MAX_ROWS_PER_GROUP,
    triton_dgrad,
    triton_fprop,
    triton_kinds,
    triton_wgrad,
)
from .grouped_gemm_triton import unsupported_reason as triton_unsupported_reason
from .grouped_wgrad_gluon import MID_MIN_ROWS_PER_GROUP as GLUON_WGRAD_MID_MIN_ROWS_PER_GROUP
from .grouped_wgrad_gluon import MIN_ROWS_PER_GROUP as GLUON_WGRAD_MIN_ROWS_PER_GROUP
from .grouped_wgrad_gluon import gluon_kinds as gluon_wgrad_kinds
from .grouped_wgrad_gluon import (
    gluon_unavailable_reason,
    gluon_unsupported_reason,
    gluon_wgrad,
    gluon_wgrad_preset,
)
from .grouped_wgrad_large_triton import large_wgrad
from .padding import zero_padding_rows_

__all__ = [
    "BackendChoice",
    "grouped_mm_unsupported_reason",
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
    #: (``grouped_gemm_gluon``: measured shapes only, ``GLUON_RULE``), wgrad
    #: (``grouped_wgrad_gluon``: ``MID_MIN_ROWS_PER_GROUP``, ``TE_OPS_GLUON_WGRAD``).
    gluon_kinds: tuple[str, ...] = ()
    #: With "wgrad" in ``gluon_kinds``: the Gluon wgrad's launch config, a key of
    #: ``grouped_wgrad_gluon.PRESETS`` (``gluon_wgrad_preset``: decided once per choice).
    gluon_wgrad_preset: str = "default"


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
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return (f"torch._grouped_mm has a native kernel for SM90 and SM100 only, not "
                f"SM{major}{minor}; its fallback copies the offsets to the host")
    return None


def select_backend(device: torch.device, dtype: torch.dtype, in_features: int,
                   out_features: int, device_split_sizes: bool,
                   rows_per_group: float | None = None) -> BackendChoice:
    """Pick the grouped GEMM backend for one grouped linear call.

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
    # Only where the rule can apply (CUDA, and the measured device and dtype): a comparison of
    # a traced (symbolic) row count is a guard, a recompile where a dynamic count crosses it.
    auto = forced == "auto" and device.type == "cuda" and _measured_on(device, dtype)
    kinds = triton_kinds(rows_per_group) if auto else ()
    large = (large_kinds(rows_per_group) if auto else
             large_kinds(rows_per_group, forced=True) if forced == "triton"
             and device.type == "cuda" else ())
    gluon_mode = env.read("TE_OPS_GLUON_WGRAD") if auto else None
    wgrad_gluon = gluon_wgrad_kinds(rows_per_group, out_features, gluon_mode) if auto else ()
    gluon = (gluon_gemm_kinds(in_features, out_features, rows_per_group, large) + wgrad_gluon
             if auto else ())
    # TE_OPS_GLUON_WGRAD=1 where the kernel can never run: the reason says why
    gluon_why = (gluon_unavailable_reason(out_features) if gluon_mode == "1"
                 and not wgrad_gluon else None)
    # the Gluon wgrad's launch config (name, why) for this row count
    preset = gluon_wgrad_preset(rows_per_group) if wgrad_gluon else None
    # the mode too: the reason text names it (auto and 1 give the same kinds at many rows)
    key = (device, dtype, in_features, out_features, device_split_sizes, forced, graph_safe,
           kinds, large, gluon, gluon_mode if wgrad_gluon else None, gluon_why, preset)
    choice = _CHOICES.get(key)
    if choice is None:
        choice = _select_backend(device, dtype, in_features, out_features, device_split_sizes,
                                 forced, graph_safe, kinds, large, gluon, preset)
        if gluon_why is not None:
            choice = dataclasses.replace(choice, reason=f"{choice.reason}; "
                                         f"TE_OPS_GLUON_WGRAD=1 not taken: {gluon_why}")
        if (device.type, device.index, dtype) in _PROBE_CACHE:  # only settled probes
            if len(_CHOICES) >= 256:
                _CHOICES.clear()
            _CHOICES[key] = choice
    if (choice.name == "loop" and device_split_sizes and device.type == "meta"
            and not tracing()):  # refused here, so explain() shows the call's error
        raise RuntimeError(META_LOOP_ERROR)
    return choice


#: select_backend's choices, per (device, dtype, features, split-size kind, env values); an
#: entry is made only once the probe of its device and dtype is settled, and never for a call
#: that raises.
_CHOICES: dict[tuple, BackendChoice] = {}


def _select_backend(device: torch.device, dtype: torch.dtype, in_features: int,
                    out_features: int, device_split_sizes: bool, forced: str,
                    graph_safe: str, kinds: tuple[str, ...] = (),
                    large: tuple[str, ...] = (), gluon: tuple[str, ...] = (),
                    wgrad_preset: tuple[str, str] | None = None) -> BackendChoice:
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
                f"{'/'.join(large)} in the persistent many-rows kernels (>= "
                f"FORCED_MIN_ROWS_PER_GROUP={FORCED_MIN_ROWS_PER_GROUP} rows per group)"
                if large else "fprop/dgrad/wgrad in the few-rows Triton kernels (< "
                f"FORCED_MIN_ROWS_PER_GROUP={FORCED_MIN_ROWS_PER_GROUP} rows per group, or "
                "not known yet)") + "; wgrad into an fp32 main_grad in torch._grouped_mm "
            "where it runs",
            graph_safe=device_split_sizes,
            triton_kinds=tuple(k for k in ("fprop", "dgrad", "wgrad") if k not in large),
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
        # Both rules can hold at once (at 32 rows per group: the few-rows wgrad, the
        # persistent fprop/dgrad); a kind never runs in both. The Gluon wgrad (asked for only
        # where auto runs on SM90 in bfloat16) comes first; the Gluon fprop / dgrad replace
        # the persistent Triton kernel's (a subset of ``big``).
        wgrad_gluon = tuple(k for k in gluon if k == "wgrad")
        small = tuple(k for k in kinds if k not in wgrad_gluon) if auto_triton is None else ()
        big = (tuple(k for k in large if k not in small + wgrad_gluon)
               if auto_large is None else ())
        rest = [k for k in ("fprop", "dgrad", "wgrad") if k not in small + big + wgrad_gluon]
        parts = []
        # a wgrad into an fp32 main_grad runs torch._grouped_mm (out_dtype) where it can
        # (kernels/wgrad_into.py): said on the part that holds wgrad
        mg = ", wgrad into an fp32 main_grad in torch._grouped_mm where it runs"
        preset, preset_why = wgrad_preset or gluon_wgrad_preset(
            float(GLUON_WGRAD_MIN_ROWS_PER_GROUP))
        if wgrad_gluon:
            parts.append("wgrad in the warp-specialized Gluon wgrad (SM90, bfloat16, "
                         "out_features % 128 == 0, TE_OPS_GLUON_WGRAD="
                         f"{env.read('TE_OPS_GLUON_WGRAD')}: auto at >= "
                         f"GLUON_WGRAD_MID_MIN_ROWS_PER_GROUP="
                         f"{GLUON_WGRAD_MID_MIN_ROWS_PER_GROUP} rows per group, measured faster "
                         "than torch._grouped_mm there; launch config "
                         f"{preset!r}: {preset_why}; a "
                         "call whose operands are not 16-byte aligned runs torch._grouped_mm"
                         f"{mg})")
        if small:
            parts.append(f"{'/'.join(small)} in Triton (few rows per group, SM90, bfloat16: "
                         "measured faster than torch._grouped_mm there, rule "
                         f"MAX_ROWS_PER_GROUP={MAX_ROWS_PER_GROUP}"
                         f"{mg if 'wgrad' in small else ''})")
        if big:
            parts.append(f"{'/'.join(big)} in the persistent Triton grouped GEMM (many rows "
                         "per group, SM90, bfloat16: measured faster than torch._grouped_mm "
                         f"there, rule MIN_ROWS_PER_GROUP={MIN_ROWS_PER_GROUP}, "
                         f"WGRAD_ROWS_PER_GROUP={WGRAD_ROWS_PER_GROUP}"
                         f"{mg if 'wgrad' in big else ''})")
        in_gluon = tuple(k for k in gluon if k in big and k != "wgrad")
        if in_gluon:
            parts.append(f"of those, {'/'.join(in_gluon)} in the warp-specialized Gluon kernel "
                         f"({in_features} -> {out_features} features at the rows per group "
                         "where it measured faster than the persistent Triton kernel in two "
                         "runs, same bits, rule "
                         f"GLUON_RULE={_gluon_rule_text(in_features, out_features)})")
        if rest:
            parts.append(f"{'/'.join(rest)} in torch._grouped_mm")
        choice = BackendChoice("triton", "; ".join(parts), graph_safe=mm_graph_safe,
                               triton_kinds=small, large_kinds=big,
                               gluon_kinds=in_gluon + wgrad_gluon,
                               gluon_wgrad_preset=preset if wgrad_gluon else "default")
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


def _gluon_rule_text(in_features: int, out_features: int) -> str:
    """``GLUON_RULE``'s entries of these features, as ``kind@rows`` (for ``explain()``)."""
    return ",".join(f"{kind}@{rows:g}" for (kind, i, o), rows in GLUON_RULE.items()
                    if (i, o) == (in_features, out_features))


def triton_auto_reason(device: torch.device, dtype: torch.dtype, kinds: tuple[str, ...]
                       ) -> str | None:
    """Why auto dispatch does not take the ``triton`` backend (``None`` when it does): the
    measured rule (docs/benchmarks.md, ``benchmarks/triton_grouped_gemm.py``)."""
    why = _measured_on_reason(device, dtype)
    if why is not None:
        return why
    if not kinds:
        return (f"more rows per group than MAX_ROWS_PER_GROUP={MAX_ROWS_PER_GROUP} (or not "
                "known), where torch._grouped_mm was measured as fast or faster")
    return None


def _measured_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the measured Triton rules can apply on ``device`` for ``dtype`` (remembered per
    device and dtype: :func:`select_backend` asks on every call)."""
    key = (device.type, device.index, dtype)
    applies = _MEASURED_ON.get(key)
    if applies is None:
        applies = _MEASURED_ON[key] = _measured_on_reason(device, dtype) is None
    return applies


_MEASURED_ON: dict[tuple[str, int | None, torch.dtype], bool] = {}


def _measured_on_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the measured Triton rules do not apply here: Triton cannot run, or the device and
    dtype are not the ones measured (SM90, bfloat16)."""
    why = triton_unsupported_reason(device, dtype)
    if why is not None:
        return why
    if dtype != torch.bfloat16:
        return f"auto takes the Triton GEMMs for bfloat16 only (measured), not {dtype}"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"measured faster on SM90 only, not SM{major}{minor}"
    return None


def large_auto_reason(device: torch.device, dtype: torch.dtype, large: tuple[str, ...]
                      ) -> str | None:
    """Why auto dispatch does not take the persistent many-rows Triton kernels (``None``
    when it does): the measured rule (docs/benchmarks.md, ``benchmarks/large_gemm_triton.py``).
    """
    why = _measured_on_reason(device, dtype)
    if why is not None:
        return why
    if not large:
        return (f"fewer rows per group than MIN_ROWS_PER_GROUP={MIN_ROWS_PER_GROUP} (or not "
                "known), where the persistent Triton kernel was not measured faster")
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
                  backend: BackendChoice) -> torch.Tensor:
    """``y_g = x_g @ W_g^T`` for every group.

    Shapes: x (M, K), weights (G, N, K) → y (M, N), same dtype as x; padding rows are zero.
    Quantized operands (a recipe's ``QuantizedTensorStorage``) go to the scaled GEMMs of
    ``te_ops.quantization.gemm`` (same for dgrad and wgrad).
    """
    if is_quantized(x):
        return quantized_grouped_gemm("fprop", x, weights, splits, backend, grouped_fprop)
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

    Shapes: dy (M, N), weights (G, N, K) → dx (M, K); padding rows are zero.
    """
    if is_quantized(dy):
        return quantized_grouped_gemm("dgrad", dy, weights, splits, backend, grouped_dgrad)
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

    Shapes: x (M, K), dy (M, N) → dW (G, N, K), dtype of x. Padding rows do not contribute.
    """
    if is_quantized(x):
        return quantized_grouped_gemm("wgrad", x, dy, splits, backend, grouped_wgrad)
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


def loop_fprop(x: torch.Tensor, weights: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """x (M, K), weights (G, N, K), host sizes -> (M, N), one ``torch.mm`` per group."""
    out = x.new_zeros(x.shape[0], weights.shape[1])
    start = 0
    for g, m in enumerate(sizes):
        if m:
            torch.mm(x[start:start + m], weights[g].t(), out=out[start:start + m])
        start += m
    return out


def loop_dgrad(dy: torch.Tensor, weights: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """dy (M, N), weights (G, N, K), host sizes -> (M, K)."""
    out = dy.new_zeros(dy.shape[0], weights.shape[2])
    start = 0
    for g, m in enumerate(sizes):
        if m:
            torch.mm(dy[start:start + m], weights[g], out=out[start:start + m])
        start += m
    return out


def loop_wgrad(x: torch.Tensor, dy: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """x (M, K), dy (M, N), host sizes -> (G, N, K)."""
    out = x.new_zeros(len(sizes), dy.shape[1], x.shape[1])
    start = 0
    for g, m in enumerate(sizes):
        if m:
            torch.mm(dy[start:start + m].t(), x[start:start + m], out=out[g])
        start += m
    return out


LOOP_GEMMS = {"fprop": loop_fprop, "dgrad": loop_dgrad, "wgrad": loop_wgrad}
