"""fc1's fprop with the (Scaled)SwiGLU forward in one launch: whether it runs here, and which.

Three kernels compute fc1's output ``h`` and the activation output ``a`` in one launch, each
bit for bit what fc1's fprop followed by the Triton SwiGLU kernel produce:
``grouped_mlp_triton.fc1_swiglu`` (few rows per group, where fc1's fprop runs in the few-rows
Triton kernel), ``fc1_swiglu_gluon`` (the warp-specialized Gluon kernel, where fc1's fprop
runs in the persistent or Gluon kernel) and ``grouped_gemm_large_triton.large_fc1_swiglu``
(the persistent kernel's fused launch: the Gluon launch's stand-in, same bits, where the Gluon
kernel cannot take the operands at run time). The ``fc1_swiglu`` rows of
:data:`te_ops.gemm.rules.RULES` say where the fused launch is measured faster; elsewhere the
two launches run. :func:`fc1_swiglu_reason` is the fused grouped MLP's gate.
"""

from __future__ import annotations

from typing import Any

import torch

from . import fc1_swiglu_gluon, grouped_mlp_triton, rules
from .dispatch import RowGather, as_rows, device_arch, row_gather_reason
from .grouped_gemm_large_triton import large_fc1_swiglu

__all__ = ["fc1_swiglu_reason", "fc1_swiglu_launch", "large_fused_launch", "not_cuda_note",
           "fc1_swiglu_rule"]


#: The fused launches that can stand in for fc1's fprop in each kind of kernel (and the two
#: launches, ``grouped_mm``, which a row may name explicitly).
PERSISTENT = ("gluon", "triton_persistent", "grouped_mm")
FEW_ROWS = ("triton_rows", "grouped_mm")


def fc1_swiglu_rule(in_features: int, out_features: int, rows_per_group: float | None,
                    device: torch.device | None, dtype: torch.dtype | None,
                    kernels: tuple[str, ...] = PERSISTENT) -> rules.Rule | None:
    """The first ``fc1_swiglu`` row of the rules table that holds this call and names one of
    ``kernels`` (:data:`PERSISTENT` where fc1's fprop runs in the persistent / Gluon kernel,
    :data:`FEW_ROWS` where in the few-rows one); ``None``: none, then two launches.
    ``out_features`` is fc1's (2 * ffn); ``device`` / ``dtype`` ``None``: not known (a caller
    whose fc1 fprop already runs in a Triton kernel, so Triton runs here). Only on CUDA, and a
    Gluon row only where this Triton has Gluon."""
    if device is not None and device.type != "cuda":
        return None
    arch = None if device is None else _arch(device)
    return rules.choose("fc1_swiglu", rows_per_group, in_features, out_features,
                        arch=arch, dtype=dtype,
                        available=lambda rule: rule.kernel in kernels and (
                            rule.kernel != "gluon" or fc1_swiglu_gluon.gluon is not None))


def _arch(device: torch.device) -> int | None:
    """The device's compute-capability major; ``None`` without a CUDA runtime (a fake CUDA
    tensor on a CPU-only build: the architecture is not known)."""
    try:
        return device_arch(device)
    except (AssertionError, RuntimeError):
        return None


def fc1_swiglu_reason(backend1: Any, backend_act: Any, recipe: Any, has_bias: bool,
                      interleave: int | None, rows_per_group: float,
                      device: torch.device | None = None,
                      features: tuple[int, int] | None = None,
                      dtype: torch.dtype | None = None) -> str | None:
    """Why fc1's fprop and the activation forward run as two launches (``None``: one).

    ``backend1``: fc1's ``BackendChoice``; ``backend_act``: the activation's
    ``ActivationChoice``; ``rows_per_group``: the call's rows (padding included) over groups;
    ``device``: the call's device (named in the reason where it is not CUDA); ``features``:
    fc1's (in_features, out_features) with ``device`` and ``dtype`` (the call's input dtype),
    which the table's ``fc1_swiglu`` rows are keyed on (``None``: only the few-rows row is
    asked, by rows per group).

    Raises
    ------
    ValueError
        ``features`` is given without ``device`` and ``dtype``.
    """
    if features is not None and (device is None or dtype is None):
        raise ValueError(f"features={features} needs the call's device and dtype (the rules "
                         f"are keyed on them), got device={device}, dtype={dtype}")
    if device is not None and device.type != "cuda":  # the first reason off CUDA
        return (f"fc1's fprop does not run in Triton (backend {backend1.name}"
                f"{not_cuda_note(device)})")
    if recipe is not None:
        return "a recipe (fc1's fprop reads quantized operands)"
    if has_bias:
        return "fc1 has a bias (added between the GEMM and the activation)"
    large = "fprop" in backend1.large_kinds
    if not large and "fprop" not in backend1.triton_kinds:
        return f"fc1's fprop does not run in Triton (backend {backend1.name})"
    if interleave is not None:
        return f"glu_interleave_size={interleave} (the fused kernel takes the halves layout)"
    if backend_act.name != "triton":
        return f"the activation runs in {backend_act.name} ({backend_act.reason})"
    in_features, out_features = features if features is not None else (0, 0)
    rule = fc1_swiglu_rule(in_features, out_features, rows_per_group, device, dtype,
                           PERSISTENT if large else FEW_ROWS)
    kernel = None if rule is None else rule.kernel
    if large:
        if kernel in ("gluon", "triton_persistent"):
            return None
        where = ("the warp-specialized Gluon kernel (gluon_kinds)"
                 if "fprop" in backend1.gluon_kinds else
                 "the persistent many-rows Triton kernel (large_kinds)")
        return (f"fc1's fprop runs in {where} (backend {backend1.name}) and no fc1_swiglu row "
                "of te_ops.gemm.rules holds this call (the fused launch measured no faster "
                "there)")
    if kernel == "triton_rows":
        return None
    return (f"{rows_per_group:g} rows per group: no few-rows fc1_swiglu row of te_ops.gemm.rules "
            "holds (the fused launch measured no faster than the two launches there)")


def not_cuda_note(device: torch.device | None) -> str:
    """``"; te_ops' Triton kernels run on CUDA only, this call is on cpu"`` for a device that
    is not CUDA (an empty string else): why a fused Triton launch cannot run there."""
    if device is None or device.type == "cuda":
        return ""
    return f"; te_ops' Triton kernels run on CUDA only, this call is on {device.type}"


def fc1_swiglu_launch(backend1: Any, x2d: torch.Tensor, weights: torch.Tensor,
                      offsets: torch.Tensor, probs: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``(h, a, note)`` from the fused launch of the kernel fc1's fprop runs in
    (``backend1``): the Gluon / persistent one (``large_kinds``) or the few-rows one; ``note``
    says which, for ``explain()``. Shapes: x2d (rows, in), weights (G, 2F, in), probs (rows,)
    or ``None`` -> h (rows, 2F), a (rows, F). ``x2d`` may be a :class:`~te_ops.gemm.RowGather`
    (fc1's input rows gathered from the tokens): the few-rows kernel reads the rows through its
    index; the persistent / Gluon launches read the gathered copy (the note says so)."""
    if "fprop" in backend1.large_kinds:
        gathered = isinstance(x2d, RowGather)
        x2d = as_rows(x2d)
        why = "the fc1_swiglu row of te_ops.gemm.rules that holds names this kernel"
        if _gluon_shape(x2d, weights):
            # what gluon_fc1_dispatched checks before it launches (on the contiguous x)
            x2d = x2d.contiguous()
            why = fc1_swiglu_gluon.gluon_fc1_unsupported_reason(x2d, weights)
            why = None if why is None else f"the Gluon kernel cannot take the operands: {why}"
        if why is None:
            note = ("one launch for fc1's fprop and the activation (the warp-specialized Gluon "
                    "kernel, gluon_fc1_swiglu: an fc1_swiglu row of te_ops.gemm.rules)")
        else:
            note = ("one Triton launch for fc1's fprop and the activation (the persistent "
                    f"many-rows kernel, large_fc1_swiglu; {why})")
        if gathered:
            note += "; its input rows gathered into a transient copy first (" + (
                row_gather_reason(backend1, "fprop") or "") + ")"
        h, a = large_fused_launch(x2d, weights, offsets, probs)
        return h, a, note
    if isinstance(x2d, RowGather):
        h, a = grouped_mlp_triton.fc1_swiglu(x2d.src, weights, offsets, probs, a_rows=x2d.index)
        return h, a, ("one Triton launch for fc1's fprop and the activation, its input rows "
                      "gathered by index in the kernel's load")
    h, a = grouped_mlp_triton.fc1_swiglu(x2d, weights, offsets, probs)
    return h, a, "one Triton launch for fc1's fprop and the activation"


def _gluon_shape(x2d: torch.Tensor, weights: torch.Tensor) -> bool:
    rule = fc1_swiglu_rule(weights.shape[2], weights.shape[1],
                           x2d.shape[0] / max(weights.shape[0], 1), x2d.device, x2d.dtype)
    return rule is not None and rule.kernel == "gluon"



def large_fused_launch(x2d: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                       probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, a)`` of the fused launch where fc1's fprop runs in the persistent kernel: the
    Gluon kernel where the table's Gluon ``fc1_swiglu`` row holds (``gluon_fc1_dispatched``:
    the persistent Triton kernel's fused launch, same bits, where its operands rule it out at
    run time), else ``large_fc1_swiglu``. Shapes as :func:`fc1_swiglu_launch`."""
    if _gluon_shape(x2d, weights):
        return fc1_swiglu_gluon.gluon_fc1_dispatched(x2d, weights, offsets, probs)
    return large_fc1_swiglu(x2d, weights, offsets, probs)
