"""The grouped GEMM rules: one table of measured ranges, pure Python (no device needed).

Each :class:`Rule` row is a box: a GEMM ``kind`` (``fprop`` / ``dgrad`` / ``wgrad`` of a
grouped linear, or ``fc1_swiglu``: fc1's fprop with the (Scaled)SwiGLU forward in one launch),
the GPU architecture (compute-capability major), the operand dtypes, a range of average rows
per group (padding included) and ranges of the layer's ``in_features`` / ``out_features``.
:func:`choose` returns the first row whose box holds the call and whose kernel can run here
(``available``); no row means ``torch._grouped_mm`` for a GEMM kind (the loop backend where
that cannot run) and two launches (fc1's GEMM, then the activation) for ``fc1_swiglu``. A row
holds on its ``device`` type (``"cuda"`` unless it says otherwise; ``None``: any device) and,
on CUDA, its ``arch``; a row may name a kernel registered with :mod:`te_ops.gemm.registry`.

Every range is half-open, ``lo <= value < hi``; :func:`at_most`, :func:`above` and
:func:`between` write closed / open edges exactly. A row holds where it was measured faster
(``why`` names the section of docs/performance.md with the numbers). Rows measured at single
shapes (the warp-specialized Gluon kernels) span, on each axis, the open interval up to the
nearest measured points on either side (:data:`MEASURED_ROWS`, :data:`MEASURED_IN`,
:data:`MEASURED_OUT`: the benchmark shapes' values), closed at the measured value where it is
the largest or smallest measured one (no extrapolation): so at every measured shape exactly
the measured decision holds, and between measured shapes the nearest measurement's.

``auto`` rows apply to the default dispatch; ``forced`` rows to
``TE_OPS_GROUPED_GEMM_BACKEND=triton`` (every GEMM kind in te_ops' Triton kernels, any CUDA
GPU, bf16 / fp16).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from . import registry as _registry
from .registry import BUILTIN_KERNELS, registered_kernels

__all__ = ["Rule", "RULES", "KINDS", "KERNELS", "kernel_names", "choose", "at_most", "above", "between",
           "around", "override", "rules_text", "SECTIONS", "MEASURED_ROWS", "MEASURED_IN", "MEASURED_OUT"]

INF = math.inf

#: The GEMM kinds a rule decides.
KINDS = ("fprop", "dgrad", "wgrad", "fc1_swiglu")

#: The built-in kernels a rule names: ``triton_rows`` (``grouped_gemm_triton``, few rows per
#: group; ``grouped_mlp_triton.fc1_swiglu`` for ``fc1_swiglu``), ``triton_persistent``
#: (``grouped_gemm_large_triton`` / ``grouped_wgrad_large_triton``), ``gluon`` (the
#: warp-specialized ``grouped_gemm_gluon`` / ``grouped_wgrad_gluon`` / ``fc1_swiglu_gluon``),
#: ``grouped_mm`` (``torch._grouped_mm``; for ``fc1_swiglu``: the two launches), which no row
#: of the table needs (it is what no row means) but :func:`override` can put first. A row may
#: also name a kernel of :mod:`te_ops.gemm.registry` (:func:`kernel_names`).
KERNELS = BUILTIN_KERNELS

#: The sections of docs/performance.md the rows cite (a row's ``why`` starts with its section's
#: name): the measurements, with the commit, the command and the versions.
SECTIONS = ("Few-rows Triton GEMMs", "Persistent Triton GEMMs", "Gluon fprop/dgrad",
            "Gluon wgrad", "fc1 + SwiGLU epilogue")

_BF16 = (torch.bfloat16,)
_HALF = (torch.bfloat16, torch.float16)


def at_most(x: float) -> tuple[float, float]:
    """The range ``0 <= value <= x``."""
    return (0.0, math.nextafter(x, INF))


def above(x: float) -> tuple[float, float]:
    """The range ``value > x``."""
    return (math.nextafter(x, INF), INF)


def between(lo: float, hi: float) -> tuple[float, float]:
    """The open range ``lo < value < hi``."""
    return (math.nextafter(lo, INF), hi)


def around(value: float, measured: tuple[float, ...]) -> tuple[float, float]:
    """The range from the nearest measured point below ``value`` to the nearest above, both
    open; closed at ``value`` itself where it is the smallest or largest of ``measured``."""
    if value not in measured:
        raise ValueError(f"value must be one of the measured points {measured}, got {value}")
    below = [m for m in measured if m < value]
    over = [m for m in measured if m > value]
    lo = math.nextafter(max(below), INF) if below else value
    hi = min(over) if over else math.nextafter(value, INF)
    return (lo, hi)


#: Average rows per group of the benchmark shapes (E64 T256, E128 T16384, E128 T65536,
#: E32 T32768, E8 T16384).
MEASURED_ROWS = (4.0, 128.0, 512.0, 1024.0, 2048.0)
#: in_features / out_features of the benchmark shapes' fc1 and fc2 layers (H2048 FF768,
#: H7168 FF2048, H4096 FF14336; fc1's out is 2 * FF).
MEASURED_IN = (768, 2048, 4096, 7168, 14336)
MEASURED_OUT = (1536, 2048, 4096, 7168, 28672)

_ALL = (0, INF)


@dataclass(frozen=True)
class Rule:
    """One row of the rules table: where ``kernel`` (with launch config ``config``) runs
    ``kind`` (one GEMM kind, or a tuple of kinds sharing the box), and the measurement
    (``why``: the docs/performance.md section) that says so.

    ``rows``, ``in_features``, ``out_features``: half-open ranges ``(lo, hi)``; ``device``:
    the torch device type the row holds on (``"cuda"``, the default; ``None``: any device
    type, CPU and meta included); ``arch``: on CUDA, the compute-capability major (``None``:
    any CUDA GPU); a row with an ``arch`` holds on CUDA devices only. ``mode``: ``"auto"``
    (the default dispatch) or ``"forced"`` (``TE_OPS_GROUPED_GEMM_BACKEND=triton``).
    ``kernel``: a built-in kernel (:data:`KERNELS`) or a registered one's name, checked when
    the row is consulted (the kernel's module may register after the table is built).
    """

    kind: str | tuple[str, ...]
    kernel: str
    rows: tuple[float, float]
    why: str
    in_features: tuple[float, float] = _ALL
    out_features: tuple[float, float] = _ALL
    arch: int | None = 9
    dtypes: tuple[torch.dtype, ...] = _BF16
    mode: str = "auto"
    config: str = "default"
    device: str | None = "cuda"

    def __post_init__(self) -> None:
        kinds = self.kinds
        if (not isinstance(kinds, tuple) or not kinds
                or any(k not in KINDS for k in kinds) or len(set(kinds)) != len(kinds)):
            raise ValueError(f"Rule kind must be one of {KINDS} or a tuple of distinct ones, "
                             f"got {self.kind!r}")
        if not isinstance(self.kernel, str) or not self.kernel:
            raise ValueError(f"Rule kernel must be a kernel's name, got {self.kernel!r}")
        if self.mode not in ("auto", "forced"):
            raise ValueError(f"Rule mode must be 'auto' or 'forced', got {self.mode!r}")
        for name in ("rows", "in_features", "out_features"):
            lo, hi = getattr(self, name)
            if not lo < hi:
                raise ValueError(f"Rule {name} must be a range (lo, hi) with lo < hi, got "
                                 f"{(lo, hi)}")

    @property
    def kinds(self) -> tuple[str, ...]:
        """The GEMM kinds this row covers (``kind`` as a tuple)."""
        return (self.kind,) if isinstance(self.kind, str) else self.kind

    def holds(self, mode: str, arch: int | None, dtype: torch.dtype | None, kind: str,
              rows: float, in_features: int, out_features: int,
              device: str | None = None) -> bool:
        """Whether this row's box holds the call (``arch`` / ``dtype`` / ``device`` (a device
        type) ``None``: not known, any row's). On a known non-CUDA device only rows with
        ``arch=None`` and that device (or ``device=None``) hold."""
        return (kind in self.kinds and self.mode == mode
                and (device is None or self.device is None or self.device == device)
                and (device in (None, "cuda") or self.arch is None)
                and (arch is None or self.arch is None or self.arch == arch)
                and (dtype is None or dtype in self.dtypes)
                and self.in_features[0] <= in_features < self.in_features[1]
                and self.out_features[0] <= out_features < self.out_features[1]
                # rows last: under torch.compile a traced row count's comparison is a guard,
                # so only rows whose other columns hold compare it
                and self.rows[0] <= rows < self.rows[1])


def _gluon_point(kind: str, rows: float, in_features: int, out_features: int, why: str
                 ) -> Rule:
    """A Gluon row around one measured (rows per group, in_features, out_features) point."""
    return Rule(kind, "gluon", around(rows, MEASURED_ROWS), why,
                in_features=around(in_features, MEASURED_IN),
                out_features=around(out_features, MEASURED_OUT))


_GLUON_E128 = ("Gluon fprop/dgrad: E128 T65536 H2048 FF768 (512 rows per group), the warp-"
               "specialized kernel 1.03-1.06x the persistent Triton kernel, same bits; the "
               "edges are the nearest measured points (128 and 1024 rows per group)")
_GLUON_E8 = ("Gluon fprop/dgrad: E8 T16384 H4096 FF14336 (2048 rows per group), 1.006-1.026x "
             "the persistent Triton kernel in two runs, same bits; edges: the nearest measured "
             "points (1024 rows per group; 2048 is the largest measured)")
_GLUON_E32 = ("Gluon fprop/dgrad: E32 T32768 H7168 FF2048 (1024 rows per group), 1.008-1.037x "
              "the persistent Triton kernel in two runs, same bits (E32's fc1 fprop and fc2 "
              "dgrad measured no faster: not listed); edges: the nearest measured points (512 "
              "and 2048 rows per group)")

#: The table. Order matters: the first row that holds and whose kernel is available wins.
RULES: tuple[Rule, ...] = (
    # -- fc1 + SwiGLU in one launch (auto) ------------------------------------------------
    Rule("fc1_swiglu", "triton_rows", at_most(8),
         "fc1 + SwiGLU epilogue: few rows per group, fused launch 1.02-1.08x the two launches "
         "at 2-8 rows per group (E64 / E128 H2048 FF768); fc1's fprop runs in the few-rows "
         "Triton kernel only up to 8",
         arch=None, dtypes=_HALF),
    Rule("fc1_swiglu", "gluon", around(512.0, MEASURED_ROWS),
         "fc1 + SwiGLU epilogue: E128 T65536 H2048 FF768's fc1 (2048 -> 1536, 512 rows per "
         "group), the Gluon fused launch 1.090x the two launches (1.000x at the power cap); "
         "E32 (1.006x) and E8 (0.99-1.01x at the cap) not taken; edges: the nearest measured "
         "points (128 and 1024 rows per group)",
         in_features=around(2048, MEASURED_IN), out_features=around(1536, MEASURED_OUT)),
    # -- Gluon fprop / dgrad (inside the persistent kernel's range) -----------------------
    _gluon_point("fprop", 512.0, 768, 2048, _GLUON_E128 + " (fc2 fprop)"),
    _gluon_point("dgrad", 512.0, 768, 2048, _GLUON_E128 + " (fc2 dgrad)"),
    _gluon_point("fprop", 512.0, 2048, 1536, _GLUON_E128 + " (fc1 fprop)"),
    _gluon_point("dgrad", 512.0, 2048, 1536, _GLUON_E128 + " (fc1 dgrad)"),
    _gluon_point("fprop", 2048.0, 4096, 28672, _GLUON_E8 + " (fc1 fprop)"),
    _gluon_point("dgrad", 2048.0, 4096, 28672, _GLUON_E8 + " (fc1 dgrad)"),
    _gluon_point("fprop", 2048.0, 14336, 4096, _GLUON_E8 + " (fc2 fprop)"),
    _gluon_point("dgrad", 2048.0, 14336, 4096, _GLUON_E8 + " (fc2 dgrad)"),
    _gluon_point("dgrad", 1024.0, 7168, 4096, _GLUON_E32 + " (fc1 dgrad)"),
    _gluon_point("fprop", 1024.0, 2048, 7168, _GLUON_E32 + " (fc2 fprop)"),
    # -- few rows per group: te_ops' Triton kernels ---------------------------------------
    Rule("fprop", "triton_rows", at_most(8),
         "Few-rows Triton GEMMs: faster than torch._grouped_mm up to 8 rows per group (of 1, "
         "2, 4, 8, 16, 32 measured; E64 / E128 H2048 FF768)"),
    Rule("dgrad", "triton_rows", at_most(4),
         "Few-rows Triton GEMMs: 1.10-1.60x torch._grouped_mm at 4 rows per group, not faster "
         "at 8"),
    Rule("wgrad", "triton_rows", at_most(32),
         "Few-rows Triton GEMMs: wgrad (write-bound) faster up to 32 rows per group"),
    # -- many rows per group: the persistent Triton kernels -------------------------------
    Rule("fprop", "triton_persistent", (32.0, INF),
         "Persistent Triton GEMMs: 1.00-1.62x torch._grouped_mm from 32 to 2048 rows per "
         "group, bitwise equal"),
    Rule("dgrad", "triton_persistent", (32.0, INF),
         "Persistent Triton GEMMs: as fprop, 32 to 2048 rows per group"),
    Rule("wgrad", "triton_persistent", (64.0, math.nextafter(256.0, INF)),
         "Persistent Triton GEMMs: wgrad 1.01-1.09x torch._grouped_mm at 64-256 rows per "
         "group; parity (0.96-1.07x) at 512-2048"),
    # -- Gluon wgrad -----------------------------------------------------------------------
    Rule("wgrad", "gluon", (512.0, 1024.0),
         "Gluon wgrad: the 4-stage mid_rows config 1.12-1.21x torch._grouped_mm and "
         "1.06-1.09x the default config at 512 rows per group (E128 T65536)",
         config="mid_rows"),
    Rule("wgrad", "gluon", (1024.0, INF),
         "Gluon wgrad: the default config 1.04-1.13x torch._grouped_mm at 1024 and 2048 rows "
         "per group (E32, E8), where mid_rows measured 0.97x it"),
    # -- TE_OPS_GROUPED_GEMM_BACKEND=triton: every kind in Triton, any CUDA GPU -----------
    Rule(("fprop", "dgrad", "wgrad"), "triton_persistent", (512.0, INF),
         "Persistent Triton GEMMs: forced, the persistent kernels from 512 rows per group "
         "(the few-rows kernels measured slower than them there)",
         arch=None, dtypes=_HALF, mode="forced"),
    Rule(("fprop", "dgrad", "wgrad"), "triton_rows", (0.0, 512.0),
         "Few-rows Triton GEMMs: forced, below 512 rows per group",
         arch=None, dtypes=_HALF, mode="forced"),
)


def kernel_names() -> tuple[str, ...]:
    """The kernels a row may name: the built-in ones and the registered ones."""
    return (*BUILTIN_KERNELS, *registered_kernels())


def choose(kind: str, rows: float | None, in_features: int, out_features: int, *,
           arch: int | None, dtype: torch.dtype | None, mode: str = "auto",
           available: Callable[[Rule], bool] | None = None,
           table: tuple[Rule, ...] | None = None, device: str | None = None) -> Rule | None:
    """The first row of ``table`` (default :data:`RULES`) that holds this call and whose kernel
    ``available`` accepts (default: every kernel); ``None`` when no row does or ``rows`` is
    not known (``None``). ``arch`` / ``dtype`` / ``device`` (the device type) ``None``: not
    known (any row's holds).

    Raises
    ------
    ValueError
        ``kind`` is not one of :data:`KINDS`, or a row that holds names a kernel that is
        neither built-in nor registered.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if rows is None:
        return None
    for rule in RULES if table is None else table:
        if not rule.holds(mode, arch, dtype, kind, rows, in_features, out_features, device):
            continue
        if rule.kernel not in BUILTIN_KERNELS and _registry.get(rule.kernel) is None:
            raise ValueError(f"a rules row names kernel {rule.kernel!r}, which is neither "
                             f"built-in nor registered (te_ops.gemm.register_kernel); known: "
                             f"{kernel_names()}")
        if available is None or available(rule):
            return rule
    return None


#: Bumped by :func:`override`; the dispatch's caches are keyed on it.
VERSION = [0]


@contextmanager
def override(*rows: Rule) -> Iterator[None]:
    """Put ``rows`` in front of the table while the block runs (tests and benchmarks: force a
    kernel where the measured rules would not run it)."""
    global RULES
    saved = RULES
    RULES = (*rows, *saved)
    VERSION[0] += 1
    try:
        yield
    finally:
        RULES = saved
        VERSION[0] += 1


def _range_text(r: tuple[float, float]) -> str:
    """``[lo, hi)`` with ``(`` / ``]`` where an edge is an open / closed one of a whole number
    (``above(128)``: ``(128, ...``; ``at_most(8)``: ``..., 8]``)."""
    lo, hi = (float(v) for v in r)
    down = math.nextafter(lo, -INF)
    left = f"({down:g}" if not lo.is_integer() and down.is_integer() else f"[{lo:g}"
    if hi == INF:
        return f"{left}, inf)"
    down = math.nextafter(hi, -INF)
    right = f"{down:g}]" if not hi.is_integer() and down.is_integer() else f"{hi:g})"
    return f"{left}, {right}"


def rules_text(table: tuple[Rule, ...] | None = None) -> str:
    """The table as text, one row a line (the README and docs print it)."""
    lines = []
    for r in RULES if table is None else table:
        arch = ("any" if r.arch is None else f"sm{r.arch}x") if r.device == "cuda" else (
            r.device or "*")
        dtypes = "/".join(str(d).removeprefix("torch.") for d in r.dtypes)
        kinds = "/".join(r.kinds)
        lines.append(f"{r.mode:6} {arch:5} {dtypes:16} {kinds:10} rows {_range_text(r.rows):16}"
                     f" in {_range_text(r.in_features):14} out {_range_text(r.out_features):14}"
                     f" -> {r.kernel}" + (f" ({r.config})" if r.config != "default" else ""))
    return "\n".join(lines)
