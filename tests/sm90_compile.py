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
    return _compile(triton, GPUTarget, src, {"num_warps": num_warps, "num_stages": num_stages},
                    registers_fail=False)



def for_nesting(ttgir: str) -> int:
    """Deepest nesting of ``scf.for`` loops in a TTGIR listing (1: no loop inside a loop, e.g. a
    flattened tile loop). A brace count, independent of
    ``experimental/gemm_kernel_ab/large_gemm_triton.py``'s copy (the tests check the kernels
    with it, not the benchmark)."""
    stack, deepest = [], 0
    for line in ttgir.splitlines():
        for ch in line:
            if ch == "{":
                stack.append("scf.for " in line)
            elif ch == "}" and stack:
                stack.pop()
        deepest = max(deepest, sum(stack))
    return deepest

def _compile(triton: Any, target: Any, src: Any, options: dict[str, int],
             registers_fail: bool) -> Any:
    """``triton.compile(src)`` for ``cuda:90``; a ptxas error skips the calling test (no sm_90
    assembler here) unless it is "insufficient registers" and ``registers_fail``."""
    try:
        return triton.compile(src, target=target("cuda", 90, 32), options=options)
    except RuntimeError as exc:  # pragma: no cover - e.g. no ptxas in this install
        message = str(exc).lower()
        if "ptxas" in message and not (registers_fail and "insufficient registers" in message):
            pytest.skip(f"cannot assemble for sm_90 here: {str(exc)[:200]}")
        raise


def skip_without_gluon(module: Any) -> None:
    """Skip the calling test where Triton is missing or the kernel ``module`` found no
    ``triton.experimental.gluon`` (its ``gluon`` attribute is None)."""
    pytest.importorskip("triton")
    if module.gluon is None:
        pytest.skip("no triton.experimental.gluon in this Triton")


def compile_gluon_for_sm90(fn: Any, signature: dict[str, str], constexprs: dict[str, Any],
                           num_warps: int, maxnreg: int) -> Any:
    """``triton.compile`` of the Gluon kernel ``fn`` for ``cuda:90`` (call
    :func:`skip_without_gluon` first) with ``signature`` and ``constexprs`` as in
    :func:`compile_for_sm90`, ``num_warps`` and the register cap ``maxnreg``. Skips where no
    sm_90 assembler is installed; a ptxas "insufficient registers" error fails the test."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    src = GluonASTSource(fn, {**signature, **{k: "constexpr" for k in constexprs}},
                         constexprs=constexprs)
    return _compile(triton, GPUTarget, src, {"num_warps": num_warps, "maxnreg": maxnreg},
                    registers_fail=True)
