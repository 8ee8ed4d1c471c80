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
    """One environment variable: name, default, accepted values (empty: a comma-separated
    list its reader checks, e.g. fusion names) and meaning."""

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
            "TE_OPS_FUSION_OFF",
            "",
            (),
            "Registered fusions to turn off (each op of such a window runs unfused): "
            "grouped_mlp_forward, grouped_mlp_backward (GroupedLinear -> "
            "(Scaled)SwiGLU -> GroupedLinear), permute_fc1_forward (fc1 reads the tokens "
            "through the row index), fc2_combine_backward (fc2's GEMMs read the output "
            "gradient through it), or a fusion you registered; an unknown name raises.",
        ),
        EnvVar(
            "TE_OPS_GROUPED_GEMM_BACKEND",
            "auto",
            ("auto", "grouped_mm", "loop", "triton"),
            "Grouped GEMM backend: auto picks torch._grouped_mm where device, dtype and "
            "alignment allow it, with te_ops' Triton / Gluon GEMMs where the rules table "
            "(te_ops/gemm/rules.py) measured them faster, else a per-group loop; grouped_mm "
            "keeps Triton off; triton runs all three high-precision GEMMs in te_ops' Triton "
            "kernels (FP8 GEMMs under a recipe stay torch._scaled_grouped_mm); a forced backend "
            "that cannot run raises with the reason.",
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
            "host and the per-group loop runs; raises where TE_OPS_GROUPED_GEMM_BACKEND forces a "
            "backend that would take it); auto takes it whenever split sizes are a device "
            "tensor and the backend allows.",
        ),
        EnvVar(
            "TE_OPS_QUANTIZED_GEMM",
            "auto",
            ("auto", "native", "emulate"),
            "GEMMs under a low-precision recipe: auto runs torch._scaled_grouped_mm where it "
            "applies (FP8 current scaling, bf16, SM90/SM100) and te_ops' Triton kernels for "
            "blockwise FP8 (bf16, SM90), else emulates (the same FP8 bytes: dequantized, GEMM in "
            "high precision; blockwise: fp32 products per 128-block); native where it cannot "
            "run raises with the reason.",
        ),
        EnvVar(
            "TE_OPS_CHECK_SPLIT_SIZES",
            "0",
            _BOOL,
            "1 replaces the device-side assert on device split sizes with an eager, "
            "host-syncing check (sign, sum) that raises a readable ValueError; the default "
            "checks them on the device without a sync (CPU tensors, whose values need no "
            "sync to read, get an error naming the values either way).",
        ),
    )
}


def read(name: str) -> str:
    """Return the current value of a declared variable (its default when unset).

    The environment is read on every call; only the parsing of a value already seen is
    remembered (per name and raw string), so a changed variable takes effect at once.

    Raises
    ------
    KeyError
        ``name`` is not a declared te_ops variable.
    ValueError
        The value set is not one of the accepted values; the message names the variable.
    """
    var = ENV_VARS[name]
    raw = _raw_value(name)
    parsed = _PARSED.get((name, raw))
    if parsed is not None and parsed[0] is var:
        return parsed[1]
    text = os.environ.get(name) if isinstance(raw, bytes) else raw
    value = var.default if text is None else text.strip().lower()
    if value == "":
        value = var.default
    if var.choices and value not in var.choices:
        raise ValueError(
            f"environment variable {name} must be one of {list(var.choices)}, got {value!r}"
        )
    if len(_PARSED) >= 256:  # bounded: a loop setting ever-new values cannot grow it
        _PARSED.clear()
    _PARSED[(name, raw)] = (var, value)
    return value


#: Valid values already parsed, by (name, raw value as the environment stores it, or None
#: when unset): the declaration they were checked against and the value.
_PARSED: dict[tuple[str, str | bytes | None], tuple[EnvVar, str]] = {}


def read_bool(name: str) -> bool:
    """Read a 0/1 variable as a bool (raises like :func:`read`)."""
    return read(name) == "1"


_WARNED: set[str] = set()


def _environ_names() -> tuple:
    """The names set in the environment, in order (C-level: the raw keys when available)."""
    data = getattr(os.environ, "_data", None)
    return tuple(data) if isinstance(data, dict) else tuple(os.environ)


def _raw_value(name: str) -> str | bytes | None:
    """One variable's raw value (``None`` when unset); a key of :data:`_PARSED`."""
    data = getattr(os.environ, "_data", None)
    encode = getattr(os.environ, "encodekey", None)
    if isinstance(data, dict) and encode is not None:
        key = _ENCODED_ONE.get(name)
        if key is None or key[0] is not encode:
            key = _ENCODED_ONE[name] = (encode, encode(name))
        return data.get(key[1])  # bytes on POSIX: decoded only when not parsed before
    return os.environ.get(name)


#: One declared name encoded as ``os.environ`` stores it: (encoder, encoded name).
_ENCODED_ONE: dict[str, tuple] = {}


def _raw_values() -> tuple[tuple[EnvVar, ...], tuple]:
    """The declarations and their raw values (``None`` when unset), read from the environment
    now; through CPython's ``os.environ._data`` and encoded names when it has them (one C-level
    pass), else through ``os.environ.get``."""
    names = tuple(ENV_VARS)  # the declarations may change (tests declare their own)
    data = getattr(os.environ, "_data", None)
    encode = getattr(os.environ, "encodekey", None)
    if isinstance(data, dict) and encode is not None:
        keys = _ENCODED.get((encode, names))
        if keys is None:
            keys = _ENCODED[(encode, names)] = tuple(map(encode, names))
        return tuple(ENV_VARS.values()), tuple(map(data.get, keys))
    return tuple(ENV_VARS.values()), tuple(map(os.environ.get, names))


#: The declared names encoded as ``os.environ`` stores them, per (encoder, names).
_ENCODED: dict[tuple, tuple] = {}


#: What :func:`warn_unknown` and :func:`snapshot` last saw: the environment's names and the
#: ``_WARNED`` set they were checked against; the declared variables' raw values and the
#: snapshot made from them.
_SEEN: dict[str, object] = {"names": None, "warned": None, "raw": None, "snapshot": None}


#: Variables te_ops no longer reads, with what replaced them; setting one raises (it would
#: otherwise have no effect).
REPLACED: dict[str, str] = {
    "TE_OPS_FUSE_GROUPED_MLP_FORWARD": "TE_OPS_FUSION_OFF=grouped_mlp_forward",
    "TE_OPS_FUSE_GROUPED_MLP_BACKWARD": "TE_OPS_FUSION_OFF=grouped_mlp_backward",
    "TE_OPS_FUSE_PERMUTE_FC1": "TE_OPS_FUSION_OFF=permute_fc1_forward",
    "TE_OPS_FUSE_FC2_COMBINE": "TE_OPS_FUSION_OFF=fc2_combine_backward",
}


def replaced_message(name: str) -> str:
    """The error for a set variable of :data:`REPLACED`: its value and what to use instead."""
    return (f"environment variable {name} (set to {os.environ.get(name, '')!r}) is no longer "
            f"read: fusions are on by default (unset it), and {REPLACED[name]} turns that "
            f"fusion off (several fusions: their names comma-separated)")


def warn_unknown() -> None:
    """Warn once per name about each set variable that looks like a te_ops one but that te_ops
    does not declare (a misspelling has no effect otherwise), naming the closest declared one;
    raise ``ValueError`` for a set variable of :data:`REPLACED`, naming what replaced it.
    "Looks like": the name starts with ``TE_OPS`` in any case, with or without separators
    (``TE_OPS_FUSON``, ``te_ops_fusion``, ``TE_OPSFUSION``).

    The names are scanned again only when the set of names in the environment changed since
    the last call (checked as one tuple comparison; the fuser calls this every step)."""
    names = (_environ_names(), tuple(ENV_VARS))
    if names == _SEEN["names"] and _SEEN["warned"] is _WARNED:
        return
    for name in os.environ:
        if name in REPLACED:
            if os.environ[name].strip():  # an empty value means the default, as everywhere
                raise ValueError(replaced_message(name))
            continue
        if name in ENV_VARS or name in _WARNED or not _normalized(name).startswith("TEOPS"):
            continue
        _WARNED.add(name)
        hint = _closest_hint(name)
        warnings.warn(
            f"environment variable {name} is not a te_ops variable and has no effect{hint} "
            f"(known: {', '.join(ENV_VARS)})",
            UserWarning, stacklevel=3,
        )
    _SEEN["names"], _SEEN["warned"] = names, _WARNED


def _normalized(name: str) -> str:
    """``name`` upper-cased with everything but letters and digits dropped, so that
    ``te_ops_fusion``, ``TE_OPSFUSION`` and ``TE-OPS-FUSION`` all read ``TEOPSFUSION``."""
    return "".join(c for c in name.upper() if c.isalnum())


def _closest_hint(name: str) -> str:
    """``"; did you mean X?"`` for the declared name closest to ``name`` (compared without
    case and separators, as a variable name is easily mistyped), or ``""``."""
    declared = {_normalized(n): n for n in ENV_VARS}
    close = difflib.get_close_matches(_normalized(name), list(declared), n=1, cutoff=0.6)
    return f"; did you mean {declared[close[0]]}?" if close else ""


def snapshot() -> tuple[tuple[str, str], ...]:
    """All variables' current values, validated; used as part of the fuser's plan-cache key.
    Also warns about unknown ``TE_OPS_*`` names (:func:`warn_unknown`). Read afresh on every
    call; the parsed tuple is reused while the raw values are unchanged."""
    warn_unknown()
    raw = _raw_values()
    if raw == _SEEN["raw"]:
        return _SEEN["snapshot"]  # type: ignore[return-value]
    snap = tuple((var.name, read(var.name)) for var in raw[0])
    _SEEN["raw"], _SEEN["snapshot"] = raw, snap
    return snap


def markdown_table() -> str:
    """The README's environment-variable table."""
    rows = ["| variable | default | values | meaning |", "| --- | --- | --- | --- |"]
    for v in ENV_VARS.values():
        values = ", ".join(v.choices) if v.choices else "comma-separated names"
        default = f"`{v.default}`" if v.default else "empty"
        rows.append(f"| `{v.name}` | {default} | {values} | {v.meaning} |")
    return "\n".join(rows)
