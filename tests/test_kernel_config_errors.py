"""CPU checks of the epilogue variables' ``explain()``
text and the benchmark flags of the fused kernels' launch configs."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from bench_helpers import usage_error

import te_ops
from te_ops.gemm import grouped_gemm_large_triton as L

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experimental", "gemm_kernel_ab"))

import large_gemm_triton as bench  # noqa: E402


@pytest.mark.parametrize("bias", [False, True])
def test_explain_names_the_device_where_the_epilogue_cannot_run(monkeypatch, bias):
    """On CPU the fc1 epilogue needs te_ops' Triton kernels, which run on CUDA only:
    ``explain()`` says so (not only that the GEMM runs in another backend), and first (the
    README's quick start has biases: its explain() gave the bias as the reason, which
    removing does not change on CPU)."""
    block = te_ops.Sequential(te_ops.GroupedLinear(2, 8, 16, bias=bias),
                              te_ops.ScaledSwiGLU(), te_ops.GroupedLinear(2, 8, 8, bias=bias))
    split = torch.tensor([2, 1])
    x = torch.randn(3, 8, requires_grad=True)
    block(x, split, torch.rand(3, requires_grad=True), split).sum().backward()
    text = block.explain()
    fc1 = next(line for line in text.splitlines() if "fc1 SwiGLU epilogue" in line)
    assert "not used" in fc1 and "CUDA only" in fc1 and "on cpu" in fc1, fc1


@pytest.mark.parametrize("flag, config, words", [
    ("--fused-config", '{"BLOCK_N": "x"}', ["--fused-config", "BLOCK_N", "int", "'x'"]),
    ("--fused-config", '{"PAIRED": "yes"}', ["--fused-config", "PAIRED", "bool", "'yes'"]),
    ("--fused-config", '{"num_warps": 0}', ["--fused-config", "num_warps", ">= 1", "0"]),
    ("--config-override", '{"BLOCK_M": 64.5}', ["--config-override", "BLOCK_M", "64.5"]),
    ("--fused-variants", '{"v": {"FOO": 1}}', ["--fused-variants 'v'", "FOO"]),
    ("--fused-variants", '{"v": {"BLOCK_K": true}}', ["--fused-variants 'v'", "BLOCK_K",
                                                      "True"]),
])
def test_large_gemm_bad_launch_configs_are_usage_errors(capsys, monkeypatch, flag, config,
                                                        words):
    """A launch config value of the wrong type or below 1 is a usage error naming the flag
    (and the variant), the key, what was expected and what was given, not a ``TypeError``
    from the checks or a failure deep in Triton; a bad ``--fused-variants`` config names
    ``--fused-variants``, not ``--fused-config``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # never reached
    err = usage_error(capsys, bench.main, ["--gemms", "fc1", flag, config])
    for word in words:
        assert word in err, err


@pytest.mark.parametrize("resolve, key, value", [
    (lambda c: L._resolve("fprop", c, 4), "BLOCK_N", "256"),
    (lambda c: L._resolve("fc1_swiglu", c, 4), "USE_TMA", 1.0),
    (lambda c: L._resolve("dgrad", c, 4), "GROUP_M", -8),
])
def test_kernel_config_value_errors_name_key_expected_and_got(resolve, key, value):
    with pytest.raises(ValueError, match=f"config {key} must be .*got {value!r}"):
        resolve({key: value})


def test_kernel_configs_keep_accepting_their_defaults_and_sweeps():
    for kind in ("fprop", "dgrad", "fc1_swiglu"):
        assert L._resolve(kind, dict(L.large_config(kind)), 4) == L.large_config(kind)
    for cfg in bench.SWEEP:
        L._resolve("fprop", cfg, 4)


def test_planned_explain_says_why_the_epilogues_are_not_used_on_cpu():
    """``explain(sample inputs)`` (what the main job prints: planned, nothing run) names the
    fc1 epilogue on CPU and why it is not used, as ``explain()`` after a call does."""
    block = te_ops.Sequential(te_ops.GroupedLinear(2, 8, 16, bias=False),
                              te_ops.ScaledSwiGLU(), te_ops.GroupedLinear(2, 8, 8, bias=False))
    split = torch.tensor([2, 1])
    text = block.explain(torch.randn(3, 8), split, torch.rand(3), split)
    for kind in ("fc1 SwiGLU epilogue: not used",):
        line = next((ln for ln in text.splitlines() if kind in ln), None)
        assert line is not None and "CUDA only" in line and "on cpu" in line, text


@pytest.mark.parametrize("argv, words", [
    (["--rows", "x"], ["--rows", "ints >= 1", "'x'"]),
    (["--rows", "4,0"], ["--rows", "ints >= 1", "[4, 0]"]),
    (["--rounds", "0"], ["--rounds", ">= 1", "got 0"]),
])
def test_fc1_epilogue_bench_bad_arguments(capsys, argv, words):
    """``benchmarks/fc1_epilogue.py``: a bad ``--rows`` / ``--rounds`` is a usage error
    naming the flag before the CUDA check (not a ``ValueError`` traceback, nor accepted)."""
    import fc1_epilogue

    err = usage_error(capsys, fc1_epilogue.main, argv)
    for word in words:
        assert word in err, err


@pytest.mark.parametrize("flag", ["--config-override", "--fused-config"])
def test_large_gemm_override_with_sweep_is_a_usage_error(capsys, monkeypatch, flag):
    """``--sweep`` times the sweep's fastest config in place of ``--config-override`` /
    ``--fused-config``: given together, the override would be dropped silently."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # never reached
    err = usage_error(capsys, bench.main, ["--sweep", flag, '{"FLAT": false}'])
    assert f"{flag} has no effect with --sweep" in err and '{"FLAT": false}' in err, err


@pytest.mark.parametrize("argv, words", [
    (["--gemms", "fc2", "--fused-variants", '{"v": {"FLAT": false}}'],
     ["--fused-variants applies to --gemms fc1 only", "'fc2'"]),
    (["--gemms", "fc1_dgrad", "--fused-config", '{"FLAT": false}'],
     ["--fused-config applies to --gemms fc1 only", "'fc1_dgrad'"]),
])
def test_large_gemm_kernel_flags_without_their_gemm_are_usage_errors(capsys, monkeypatch, argv,
                                                                      words):
    """``--fused-config`` / ``--fused-variants`` time only under fc1: without that GEMM the
    flag did nothing, silently."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # never reached
    err = usage_error(capsys, bench.main, argv)
    for word in words:
        assert word in err, err


@pytest.mark.parametrize("forward, backward", [("0", "0"), ("1", "0"), ("0", "1")])
def test_explain_drops_an_earlier_calls_epilogue_decision_when_the_activation_ran_unfused(
        monkeypatch, forward, backward):
    """``explain()`` after a call tells what that call ran: after a fused call, a call with
    the fused forward (or backward) off ran the activation unfused, so the earlier call's
    epilogue decision for that half (on CUDA possibly "one Triton launch ...") is not shown."""
    block = te_ops.Sequential(te_ops.GroupedLinear(2, 8, 16, bias=False),
                              te_ops.ScaledSwiGLU(), te_ops.GroupedLinear(2, 8, 8, bias=False))
    split = torch.tensor([2, 1])

    def call():
        x = torch.randn(3, 8, requires_grad=True)
        block(x, split, torch.rand(3, requires_grad=True), split).sum().backward()
        return block.explain()

    text = call()
    assert "fc1 SwiGLU epilogue" in text
    monkeypatch.setenv("TE_OPS_FUSE_GROUPED_MLP_FORWARD", forward)
    monkeypatch.setenv("TE_OPS_FUSE_GROUPED_MLP_BACKWARD", backward)
    text = call()
    assert ("fc1 SwiGLU epilogue" in text) == (forward == "1"), text
