"""The extension points run end to end as docs/architecture.md describes them: a fusion
(tests/extension_bias_pair.py, registered with one ``register_forward_fusion`` call) and a GEMM
backend (tests/extension_loop_mm.py, registered with ``register_kernel`` and picked through one
rules row), each registered for its test only; results bitwise the default path's."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import te_ops
from extension_bias_pair import ForwardBiasPair, fuse_bias_pair_forward
from extension_loop_mm import REGISTRATION
from gemm_force import with_rows
from te_ops.fuser import register_forward_fusion, registered_fusions, unregister_fusion
from te_ops.gemm import register_kernel, registered_kernels, rules, select_backend, unregister_kernel

#: The backend's one rules row: all three GEMM kinds, any device, float32.
LOOP_MM_ROWS = (rules.Rule(("fprop", "dgrad", "wgrad"), "loop_mm", (0.0, math.inf),
                           "loop_mm: a test's row", arch=None, device=None,
                           dtypes=(torch.float32,)),)


@pytest.fixture
def loop_mm(monkeypatch):
    register_kernel("loop_mm", **REGISTRATION)
    with_rows(monkeypatch, first=LOOP_MM_ROWS)
    yield
    unregister_kernel("loop_mm")


def _bias_run(block, x):
    x = x.clone().requires_grad_()
    y = block(x)
    y.backward(torch.ones_like(y) * 0.5)
    return [y.detach(), x.grad, *(p.grad for p in block.parameters())]


def test_bias_pair_fusion_is_bitwise_the_unfused_bias_ops():
    torch.manual_seed(0)
    block = te_ops.Sequential(te_ops.Bias(7), te_ops.Bias(7))
    for p in block.parameters():
        p.data.normal_()
    twin = copy.deepcopy(block)
    x = torch.randn(5, 7)
    unfused = _bias_run(twin, x)
    assert "ForwardBiasPair" not in twin.explain()
    fusion = register_forward_fusion(fuse_bias_pair_forward, name="bias_pair_forward")
    try:
        fused = _bias_run(block, x)
        assert "ForwardBiasPair (ops 0-1)" in block.explain()
        assert any(isinstance(op, ForwardBiasPair)
                   for op, _ in block.fusers()[0]._plan.forward_ops)
        with pytest.raises(ValueError, match="last dim size=7"):
            block(torch.randn(5, 6))
    finally:
        unregister_fusion(fusion)
    for a, b in zip(fused, unfused):
        assert torch.equal(a, b)


def test_bias_pair_fusion_is_gone_after_unregistering():
    assert "bias_pair_forward" not in [f.name for f in registered_fusions()]
    block = te_ops.Sequential(te_ops.Bias(3), te_ops.Bias(3))
    block(torch.randn(2, 3))
    assert "ForwardBiasPair" not in block.explain()


def test_an_off_fusion_toggle_is_noted_only_where_its_pattern_is(monkeypatch):
    monkeypatch.setenv("TE_OPS_FUSION_OFF", "grouped_mlp_forward")
    bias = te_ops.Sequential(te_ops.Bias(3), te_ops.Bias(3))
    bias(torch.randn(2, 3))
    off = ("grouped_mlp_forward", "TE_OPS_FUSION_OFF lists grouped_mlp_forward")
    assert off not in _notes(bias)
    mlp = _mlp()
    split = torch.tensor([2, 2, 0])
    mlp(torch.randn(4, 16), split, split)
    assert off in _notes(mlp)


def _notes(block):
    return list(block.fusers()[0]._plan.info.notes)


def _mlp():
    torch.manual_seed(0)
    return te_ops.Sequential(te_ops.GroupedLinear(3, 16, 32), te_ops.SwiGLU(),
                             te_ops.GroupedLinear(3, 16, 8))


def _mlp_run(block, x, split, dy):
    x = x.clone().requires_grad_()
    y = block(x, split, split)
    y.backward(dy)
    return [y.detach(), x.grad, *(p.grad for p in block.parameters())]


def test_loop_mm_needs_its_registration_and_its_row(monkeypatch):
    cpu = torch.device("cpu")
    assert "loop_mm" not in registered_kernels()
    assert select_backend(cpu, torch.float32, 16, 32, True, 4.0).registered == ()
    with pytest.raises(ValueError, match="names kernel 'loop_mm', which is neither built-in"):
        with rules.override(*LOOP_MM_ROWS):
            register_kernel("other", fprop=REGISTRATION["fprop"])  # any registered kernel
            try:
                select_backend(cpu, torch.float32, 16, 32, True, 4.0)
            finally:
                unregister_kernel("other")


def test_loop_mm_is_picked_inside_its_row_only(loop_mm):
    cpu = torch.device("cpu")
    choice = select_backend(cpu, torch.float32, 16, 32, True, 4.0)
    assert dict(choice.registered) == dict.fromkeys(("fprop", "dgrad", "wgrad"), "loop_mm")
    assert "in the registered kernel loop_mm" in choice.reason and not choice.graph_safe
    assert select_backend(cpu, torch.float64, 16, 32, True, 4.0).registered == ()  # dtype
    assert select_backend(cpu, torch.float32, 16, 32, True, None).registered == ()  # rows?
    # its unavailable_reason is asked: not on meta
    assert select_backend(torch.device("meta"), torch.float32, 16, 32, False, 4.0
                          ).registered == ()


@pytest.mark.parametrize("split", [[5, 0, 7], [4, 4, 2]], ids=["empty-group", "padding"])
@pytest.mark.parametrize("fusion", ["0", "1"])
def test_loop_mm_is_bitwise_the_default_backend(monkeypatch, split, fusion):
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = _mlp()
    twin = copy.deepcopy(block)
    x, dy, sizes = torch.randn(12, 16), torch.randn(12, 8), torch.tensor(split)
    default = _mlp_run(twin, x, sizes, dy)
    assert "loop_mm" not in twin.explain()
    register_kernel("loop_mm", **REGISTRATION)
    try:
        with rules.override(*LOOP_MM_ROWS):
            picked = _mlp_run(block, x, sizes, dy)
            text = block.explain()
    finally:
        unregister_kernel("loop_mm")
    assert "fprop/dgrad/wgrad in the registered kernel loop_mm" in text
    for a, b in zip(picked, default):
        assert torch.equal(a, b)


def test_register_kernel_rejects_bad_registrations():
    with pytest.raises(ValueError, match="name 'gluon' is taken"):
        register_kernel("gluon", fprop=REGISTRATION["fprop"])
    with pytest.raises(ValueError, match="must run at least one of fprop, dgrad, wgrad"):
        register_kernel("nothing")
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        register_kernel("", fprop=REGISTRATION["fprop"])
    with pytest.raises(KeyError, match="no GEMM kernel 'loop_mm' is registered"):
        unregister_kernel("loop_mm")
    register_kernel("loop_mm", **REGISTRATION)
    try:
        with pytest.raises(ValueError, match="name 'loop_mm' is taken"):
            register_kernel("loop_mm", **REGISTRATION)
    finally:
        unregister_kernel("loop_mm")


def test_a_choice_whose_kernel_was_unregistered_raises(loop_mm):
    choice = select_backend(torch.device("cpu"), torch.float32, 16, 32, True, 4.0)
    unregister_kernel("loop_mm")
    try:
        with pytest.raises(RuntimeError, match="'loop_mm' chosen for fprop is no longer"):
            choice.registered_kernel("fprop")
    finally:
        register_kernel("loop_mm", **REGISTRATION)  # the fixture unregisters it
