"""GEMM kernels registered with :mod:`te_ops.gemm.registry`: each module of this folder is
imported by the package import and registers itself (``register_kernel(...)`` at its end), so
adding a kernel is adding its file here and one row naming it to ``te_ops.gemm.rules.RULES``.
A module here imports from ``te_ops.gemm.registry`` / ``te_ops.splits`` / torch only (never
the dispatch, nor ``te_ops.ops``). No kernel ships here today: the default dispatch runs the
built-in ones (``te_ops.gemm.dispatch``).
"""

from __future__ import annotations

import importlib
import pkgutil

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
