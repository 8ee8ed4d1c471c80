"""Rows a test puts into the GEMM rules table (``te_ops.gemm.rules``) to force or forbid a
kernel where the measured rows would not (tests force kernels through rows, not env vars).
``with_rows(monkeypatch, first=..., last=...)`` puts rows before / after the table for
the test (the dispatch's caches are keyed on ``rules.VERSION``, bumped here)."""

from __future__ import annotations

import math

import torch

from te_ops.gemm import rules
from te_ops.gemm.rules import Rule

_ANY = (0.0, math.inf)
_HALF = (torch.bfloat16, torch.float16, torch.float32)  # any dtype the gate sees

#: The Gluon wgrad at any known row count (its default config below the table's 512).
GLUON_WGRAD_ANY = (Rule("wgrad", "gluon", (0.0, 512.0), "Gluon wgrad: forced by a test"),)
#: wgrad never in the Gluon kernel (torch._grouped_mm where the table's Gluon rows hold).
NO_GLUON_WGRAD = (Rule("wgrad", "grouped_mm", (512.0, math.inf), "Gluon wgrad: off in a test"),)
#: fc1 + SwiGLU fused wherever it can run (after the table: its Gluon row keeps its shapes).
FC1_FUSED_ANY = (
    Rule("fc1_swiglu", "triton_rows", _ANY, "fc1 + SwiGLU epilogue: forced by a test",
         arch=None, dtypes=_HALF),
    Rule("fc1_swiglu", "triton_persistent", _ANY, "fc1 + SwiGLU epilogue: forced by a test",
         arch=None, dtypes=_HALF),
)
#: fc1 + SwiGLU never fused (two launches).
NO_FC1_FUSED = (Rule("fc1_swiglu", "grouped_mm", _ANY, "fc1 + SwiGLU epilogue: off in a test",
                     arch=None, dtypes=_HALF),)


_TABLE = rules.RULES


def with_rows(monkeypatch, first: tuple[Rule, ...] = (), last: tuple[Rule, ...] = ()) -> None:
    """The measured table with ``first`` before and ``last`` after its rows, for this test
    (no rows: the measured table itself)."""
    monkeypatch.setattr(rules, "RULES", (*first, *_TABLE, *last))
    monkeypatch.setattr(rules, "VERSION", [rules.VERSION[0] + 1])


#: The measured table's Gluon fc1 + SwiGLU row (E128 H2048 FF768's fc1).
FC1_GLUON_ROW = next(r for r in _TABLE if r.kind == "fc1_swiglu" and r.kernel == "gluon")

#: fprop / dgrad in the persistent kernels from 1 row per group (after the table: its
#: few-rows and Gluon rows keep their ranges), for small test blocks.
PERSISTENT_FROM_ONE = tuple(
    Rule(kind, "triton_persistent", (1.0, math.inf), "Persistent Triton GEMMs: a test's row")
    for kind in ("fprop", "dgrad"))
#: fprop / dgrad in the Gluon kernel wherever a persistent row would run them (first).
GLUON_FPROP_DGRAD = tuple(
    Rule(kind, "gluon", (1.0, math.inf), "Gluon fprop/dgrad: forced by a test")
    for kind in ("fprop", "dgrad"))
