"""Ahead-of-time compile of a Triton kernel for SM90 on a machine without a GPU (the tests of
te_ops' Hopper kernels: wgmma, TMA, loop structure, shared memory).

``compile_for_sm90`` skips the calling test where Triton, its ahead-of-time compile API or an
sm_90 assembler is missing, and returns the compiled kernel (``.asm["ttir" | "ttgir" |
"ptx"]``, ``.metadata.shared`` in bytes). Checked with Triton 3.6.0 (the H200 machine's).
"""

from __future__ import annotations

from typing import Any

import pytest


def compile_for_sm90(fn: Any, signature: dict[str, str], constexprs: dict[str, Any],
                     num_warps: int = 8, num_stages: int = 3) -> Any:
    """``triton.compile`` of ``fn`` for ``cuda:90`` with ``signature`` (argument name ->
    Triton type) and ``constexprs`` (their names are added to the signature as
    ``"constexpr"``)."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:  # pragma: no cover - depends on the Triton version
        pytest.skip(f"no ahead-of-time compile API: {exc}")
    src = ASTSource(fn, {**signature, **{k: "constexpr" for k in constexprs}},
                    constexprs=constexprs)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    except RuntimeError as exc:  # pragma: no cover - e.g. no ptxas in this install
        if "ptxas" in str(exc).lower():
            pytest.skip(f"cannot assemble for sm_90 here: {str(exc)[:200]}")
        raise
