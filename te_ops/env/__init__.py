"""Every environment variable te_ops reads, declared once.

Variables are read when the fuser plans (each call checks whether they changed), never at
import. A malformed value raises :class:`ValueError` naming the variable, the accepted values
and the value found. ``README.md`` prints the same table (``python -m te_ops.env`` renders it).
"""

from __future__ import annotations

import difflib
import os
import warnings
from dataclasses import dataclass

__all__ = ["EnvVar", "ENV_VARS", "read", "read_bool", "snapshot", "warn_unknown", "markdown_table"]


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: name, default, accepted values and meaning."""

    name: str
    default: str
    choices: tuple[str, ...]
    meaning: str


_BOOL = ("0", "1")

ENV_VARS: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar(
            "TE_OPS_FUSION",
            "1",
            _BOOL,
            "0 turns every registered fusion off (each op runs its unfused forward and backward).",
        ),
        EnvVar(
            "TE_OPS_FUSE_GROUPED_MLP_FORWARD",
            "1",
            _BOOL,
            "0 turns off the fused forward of GroupedLinear -> (Scaled)SwiGLU -> GroupedLinear.",
        ),
        EnvVar(
            "TE_OPS_FUSE_GROUPED_MLP_BACKWARD",
            "1",
            _BOOL,
            "0 turns off the fused backward of GroupedLinear -> (Scaled)SwiGLU -> GroupedLinear.",
        ),
        EnvVar(
            "TE_OPS_GROUPED_GEMM_BACKEND",
            "auto",
            ("auto", "grouped_mm", "loop"),
            "Grouped GEMM backend: auto picks torch._grouped_mm where device, dtype and "
            "alignment allow it, else a per-group loop; a forced backend that cannot run raises "
            "with the reason.",
        ),
        EnvVar(
            "TE_OPS_ACTIVATION_BACKEND",
            "auto",
            ("auto", "torch", "triton"),
            "SwiGLU kernels: auto takes the Triton kernels on CUDA where they apply (halves "
            "layout, fp32/bf16/fp16, contiguous), else PyTorch ops; triton where they cannot "
            "run raises with the reason.",
        ),
        EnvVar(
            "TE_OPS_GRAPH_SAFE",
            "auto",
            ("auto", "0", "1"),
            "1 forces the graph-safe path (no host sync; raises with the reason where a "
            "configuration cannot take it); 0 forbids it (device split sizes are copied to the "
            "host and the per-group loop runs); auto takes it whenever split sizes are a device "
            "tensor and the backend allows.",
        ),
        EnvVar(
            "TE_OPS_QUANTIZED_GEMM",
            "auto",
            ("auto", "native", "emulate"),
            "GEMMs under a low-precision recipe: auto runs torch._scaled_grouped_mm where it "
            "applies (FP8 current scaling, bf16, SM90/SM100), else emulates (dequantize the same "
            "FP8 bytes, GEMM in high precision); native where it cannot run raises with the "
            "reason.",
        ),
        EnvVar(
            "TE_OPS_SAVE_COLUMNWISE_WEIGHTS",
            "1",
            _BOOL,
            "Under a recipe, 1 quantizes the weights both ways in the forward and keeps the "
            "column-wise copy for dgrad (backward does not read the weights again; costs that "
            "copy's memory from forward to backward, 1.3 GiB on 8 experts x 4096 x 14336); 0 "
            "quantizes them for dgrad in the backward. Same bytes either way.",
        ),
        EnvVar(
            "TE_OPS_CHECK_SPLIT_SIZES",
            "0",
            _BOOL,
            "1 replaces the device-side assert on device split sizes with an eager, "
            "host-syncing check (sign, sum) that raises a readable ValueError; the default "
            "checks them on the device without a sync.",
        ),
    )
}


def read(name: str) -> str:
    """Return the current value of a declared variable (its default when unset).

    Raises
    ------
    KeyError
        ``name`` is not a declared te_ops variable.
    ValueError
        The value set is not one of the accepted values; the message names the variable.
    """
    var = ENV_VARS[name]
    value = os.environ.get(name, var.default).strip().lower()
    if value == "":
        value = var.default
    if value not in var.choices:
        raise ValueError(
            f"environment variable {name} must be one of {list(var.choices)}, got {value!r}"
        )
    return value


def read_bool(name: str) -> bool:
    """Read a 0/1 variable as a bool (raises like :func:`read`)."""
    return read(name) == "1"


_WARNED: set[str] = set()


def warn_unknown() -> None:
    """Warn once per name about each set ``TE_OPS_*`` variable that te_ops does not declare
    (a misspelling has no effect otherwise), naming the closest declared one."""
    for name in os.environ:
        if not name.startswith("TE_OPS_") or name in ENV_VARS or name in _WARNED:
            continue
        _WARNED.add(name)
        close = difflib.get_close_matches(name, list(ENV_VARS), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        warnings.warn(
            f"environment variable {name} is not a te_ops variable and has no effect{hint} "
            f"(known: {', '.join(ENV_VARS)})",
            UserWarning, stacklevel=3,
        )


def snapshot() -> tuple[tuple[str, str], ...]:
    """All variables' current values, validated; used as part of the fuser's plan-cache key.
    Also warns about unknown ``TE_OPS_*`` names (:func:`warn_unknown`)."""
    warn_unknown()
    return tuple((name, read(name)) for name in ENV_VARS)


def markdown_table() -> str:
    """The README's environment-variable table."""
    rows = ["| variable | default | values | meaning |", "| --- | --- | --- | --- |"]
    for v in ENV_VARS.values():
        rows.append(f"| `{v.name}` | `{v.default}` | {', '.join(v.choices)} | {v.meaning} |")
    return "\n".join(rows)
