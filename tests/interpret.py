"""Shared pieces of the tests that run te_ops' Triton kernels through Triton's CPU interpreter.

Each such test file holds a script (a string) that imports te_ops, runs kernels and prints
``ok``; :func:`run_interpreted` runs it in a fresh process with ``TRITON_INTERPRET=1`` (the
variable must be set before triton is imported, hence the subprocess).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
import torch


def interpreter_marks(cuda_tests: str) -> list:
    """Skip marks: no triton installed, or a GPU present (then ``cuda_tests``, a test file
    name, runs the compiled kernels instead; the H200 box's Triton interpreter cannot run
    loops over device-loaded group bounds)."""
    return [
        pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                           reason="triton is not installed"),
        pytest.mark.skipif(torch.cuda.is_available(),
                           reason=f"CUDA present: {cuda_tests} runs the kernels"),
    ]


def run_interpreted(script: str) -> None:
    """Run ``script`` under ``TRITON_INTERPRET=1`` with the repository on ``PYTHONPATH``;
    assert it exits 0 and prints ``ok`` last (the assertion message is its stderr tail)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
