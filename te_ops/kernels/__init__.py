"""Kernels and their dispatch: the only place that knows about devices and backends."""

from .grouped_gemm import BackendChoice, grouped_mm_unsupported_reason, select_backend

__all__ = ["BackendChoice", "grouped_mm_unsupported_reason", "select_backend"]
