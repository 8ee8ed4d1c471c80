"""Stand-ins for the fc1-epilogue dispatch tests (CPU): a backend whose fprop/dgrad run in
the persistent Triton kernel, a Triton activation choice, and an activation op that records
what ``fc1_swiglu_forward`` tells ``explain()``."""

from __future__ import annotations

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
