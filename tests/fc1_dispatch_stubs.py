"""Stand-ins for the fc1-epilogue dispatch tests (CPU): a backend whose fprop/dgrad run in
the persistent Triton kernel, a Triton activation choice, and an activation op that records
what ``fc1_swiglu_choice`` / ``fc1_swiglu_forward`` tell ``explain()``; :func:`fused_fc1`
runs both as the fused grouped-MLP forward does."""

from __future__ import annotations

from te_ops.fused import fc1_epilogue
from te_ops.gemm.dispatch import BackendChoice
from te_ops.kernels.swiglu_triton import ActivationChoice

#: fc1's fprop and dgrad in the persistent many-rows Triton kernel.
LARGE = BackendChoice("triton", "test", True, large_kinds=("fprop", "dgrad"))
#: The activation in the Triton SwiGLU kernels.
ACT = ActivationChoice("triton", "test")


class RecordingAct:
    """A (Scaled)SwiGLU op stand-in: halves layout, the Triton kernels, and the
    ``record_dispatch`` calls kept in ``records`` as (kind, text)."""

    glu_interleave_size = None

    def __init__(self) -> None:
        self.records: list[tuple[str, str]] = []

    def record_dispatch(self, kind: str, text: str) -> None:
        self.records.append((kind, text))

    def select_backend(self, h: object) -> ActivationChoice:
        return ACT


def fused_fc1(fc1, act, x, w, splits, backend1, probs, recipe):
    """``(h, a, activation backend)`` of the fused launch, or ``None`` where the choice says
    two launches (the fused grouped-MLP forward's two steps; ``fc1`` needs ``has_bias`` and
    ``out_features``, its ``in_features`` is taken from ``w``)."""
    if not hasattr(fc1, "in_features"):
        fc1.in_features = w.shape[2]
    backend_act = fc1_epilogue.fc1_swiglu_choice(fc1, act, x, splits, backend1, recipe)
    if backend_act is None:
        return None
    return (*fc1_epilogue.fc1_swiglu_forward(act, x, w, splits, backend1, probs), backend_act)
