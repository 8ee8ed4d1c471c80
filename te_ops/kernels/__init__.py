"""Non-GEMM kernels: the SwiGLU kernels, padding-row zeroing, split tables, the Triton launcher.

Grouped GEMM kernels and the choice between them live in :mod:`te_ops.gemm`.
"""
