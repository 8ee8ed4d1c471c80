"""Grouped GEMMs: the only place that picks a grouped GEMM kernel.

:mod:`te_ops.gemm.rules` holds the measured rules (one table of ranges);
:mod:`te_ops.gemm.dispatch` turns them into a :class:`BackendChoice` per grouped linear call and
runs fprop / dgrad / wgrad; :func:`fc1_swiglu_reason` / :func:`fc1_swiglu_launch` answer and run
fc1 + SwiGLU in one launch for the fused grouped MLP. The Triton / Gluon kernel modules beside
them are imported by the dispatch only; no kernel imports the dispatch. Further kernels
register with :func:`register_kernel` (:mod:`te_ops.gemm.registry`; the modules of
``te_ops/gemm/backends/`` are imported here) and run where a rules row names them.
"""

from .dispatch import (
    BackendChoice,
    RowGather,
    as_rows,
    grouped_dgrad,
    grouped_fprop,
    grouped_mm_host_sync_reason,
    grouped_mm_operand_reason,
    grouped_mm_operands,
    grouped_mm_unsupported_reason,
    grouped_wgrad,
    row_gather_reason,
    rows_for,
    select_backend,
    stack_weights,
    storage_spans,
)
from .fc1_swiglu import fc1_swiglu_launch, fc1_swiglu_reason, large_fused_launch
from .registry import register_kernel, registered_kernels, unregister_kernel
from .wgrad_into import grouped_wgrad_into
from . import backends  # noqa: E402,F401  (registers the kernels of te_ops/gemm/backends/)

__all__ = ["BackendChoice", "RowGather", "as_rows", "row_gather_reason", "rows_for", "fc1_swiglu_launch",
           "fc1_swiglu_reason", "grouped_dgrad",
           "grouped_fprop", "grouped_mm_host_sync_reason", "grouped_mm_operand_reason",
           "grouped_mm_operands", "grouped_mm_unsupported_reason",
           "grouped_wgrad", "grouped_wgrad_into", "large_fused_launch", "register_kernel",
           "registered_kernels", "select_backend", "stack_weights", "storage_spans",
           "unregister_kernel"]
