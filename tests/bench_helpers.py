"""Shared checks of the benchmark command-line tests: a bad argument is argparse's usage
error (exit 2) before any work starts, and the launch configs
``experimental/gemm_kernel_ab/large_gemm_triton.py``'s flags hand to each comparison."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def usage_error(capsys: pytest.CaptureFixture[str], main: Callable[[list[str]], object],
                argv: list[str]) -> str:
    """Run a benchmark's ``main(argv)``, which must exit with a usage error
    (``SystemExit`` with code 2); returns what was written to stderr (the message naming the
    flag, the expected and the given value)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def large_gemm_configs(monkeypatch: pytest.MonkeyPatch, bench,
                       argv: list[str]) -> list[tuple[str, object, object]]:
    """``experimental/gemm_kernel_ab/large_gemm_triton.py``'s ``main(argv)`` (the module ``bench``) with CUDA
    faked and ``compare`` replaced by a recorder: ``(gemm, cfg, fused_cfg)`` of each
    comparison, in order (``main`` must return 0)."""
    import torch

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "machine_info", lambda device: {})
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "compare", lambda shape, gemm, args, cfg, fused_cfg: (
        seen.append((gemm, cfg, fused_cfg)), {"bench": "x"})[1])
    assert bench.main(argv) == 0
    return seen
