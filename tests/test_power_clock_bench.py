"""``benchmarks/power_clock.py``'s argument checks (CPU; the measurement itself needs CUDA and
NVML and runs in ``scripts/gpu_check.sh``'s ``power`` step)."""

from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
power_clock = pytest.importorskip("power_clock")


@pytest.mark.parametrize("argv, match", [
    (["--steps", "1"], "--steps must be >= 2, got 1"),
    (["--shapes", "E8_T16384_H4096_FF14336,E9_nope"], r"--shapes: unknown \['E9_nope'\]"),
    (["--peers", "torch_grouped_mm,te_ops_nope"], r"--peers: unknown \['te_ops_nope'\]"),
])
def test_usage_errors_name_the_flag(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        power_clock.main(argv)
    assert exc.value.code == 2
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU exit")
def test_without_cuda_exits_2(capsys):
    assert power_clock.main(["--shapes", "E8_T16384_H4096_FF14336"]) == 2
    assert "needs CUDA" in capsys.readouterr().err


def test_nvml_index_follows_cuda_visible_devices(monkeypatch):
    """The lane pinned to GPU 1 (``CUDA_VISIBLE_DEVICES=1``) must read GPU 1's NVML counters:
    stop 18's two-GPU check read GPU 0's (the script then used the CUDA index as NVML's)."""
    import torch
    monkeypatch.setattr(torch.cuda, "_get_nvml_device_index", lambda i: {0: 1}[i], raising=False)
    assert power_clock.nvml_index(0) == 1
    monkeypatch.delattr(torch.cuda, "_get_nvml_device_index", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES='1'"):
        power_clock.nvml_index(0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert power_clock.nvml_index(0) == 0
