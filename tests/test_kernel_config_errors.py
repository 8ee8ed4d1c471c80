"""CPU checks of the epilogue variables' ``explain()`` text and of the fused kernels' launch
config checks."""

from __future__ import annotations

import pytest
import torch
from fusion_env import set_grouped_mlp

import te_ops
from te_ops.gemm import grouped_gemm_large_triton as L


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


@pytest.mark.parametrize("resolve, key, value", [
    (lambda c: L._resolve("fprop", c, 4), "BLOCK_N", "256"),
    (lambda c: L._resolve("fc1_swiglu", c, 4), "USE_TMA", 1.0),
    (lambda c: L._resolve("dgrad", c, 4), "GROUP_M", -8),
])
def test_kernel_config_value_errors_name_key_expected_and_got(resolve, key, value):
    with pytest.raises(ValueError, match=f"config {key} must be .*got {value!r}"):
        resolve({key: value})


def test_kernel_configs_keep_accepting_their_defaults():
    for kind in ("fprop", "dgrad", "fc1_swiglu"):
        assert L._resolve(kind, dict(L.large_config(kind)), 4) == L.large_config(kind)


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
    set_grouped_mlp(monkeypatch, forward, backward)
    text = call()
    assert ("fc1 SwiGLU epilogue" in text) == (forward == "1"), text
