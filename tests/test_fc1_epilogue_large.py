"""fc1's fprop with the SwiGLU in its epilogue where fc1's fprop runs in the persistent
many-rows kernel (``large_fc1_swiglu``, ``fused/fc1_epilogue.py``).

CPU (CI): the rule (auto refuses and says why; a rules row takes it; the neighbouring
reasons still come first), the general path's routing to ``large_fc1_swiglu`` and its
``explain()`` line. CUDA: the block (>= 32 rows per group, bf16 on SM90:
fprop and dgrad in the persistent kernels) with the epilogue on (``1``; repeated calls) bitwise equal to the epilogue off, to the fused forward with the unfused
backward and to the unfused ops (outputs and every gradient); CUDA graph replay and
``torch.compile(fullgraph=True)`` of that block bitwise equal to eager.
"""

from __future__ import annotations

import pytest
import torch
from gemm_force import FC1_FUSED_ANY, NO_FC1_FUSED, with_rows
from block_replay import assert_graph_and_compile_match_eager, run_block
from fc1_dispatch_stubs import ACT, LARGE, fused_fc1
from fc1_dispatch_stubs import RecordingAct as _Act
from grouped_cuda_helpers import fc1_block, fc1_block_inputs
from torch._subclasses.fake_tensor import FakeTensorMode

from te_ops.gemm import fc1_swiglu as fc1_swiglu_mod
from te_ops.gemm import fc1_swiglu_reason
from te_ops.kernels.swiglu_triton import ActivationChoice

CUDA = torch.device("cuda")


# ----------------------------------------------------------------------------- CPU: the rule
def test_auto_refuses_the_persistent_case_and_says_why(monkeypatch):
    why = fc1_swiglu_reason(LARGE, ACT, None, False, None, 2048.0)
    assert "persistent many-rows Triton kernel" in why and "no fc1_swiglu row" in why
    with_rows(monkeypatch, last=FC1_FUSED_ANY)  # a measured win would add a row
    assert fc1_swiglu_reason(LARGE, ACT, None, False, None, 2048.0) is None


@pytest.mark.parametrize("args, match", [
    ((LARGE, ACT, None, False, None, 64.0), None),
    ((LARGE, ACT, object(), False, None, 64.0), "a recipe"),
    ((LARGE, ACT, None, True, None, 64.0), "fc1 has a bias"),
    ((LARGE, ACT, None, False, 32, 64.0), "glu_interleave_size=32"),
    ((LARGE, ActivationChoice("torch", "forced"), None, False, None, 64.0),
     "the activation runs in torch"),
])
def test_one_takes_it_where_it_can_run(monkeypatch, args, match):
    with_rows(monkeypatch, last=FC1_FUSED_ANY)
    why = fc1_swiglu_reason(*args)
    assert why is None if match is None else match in why


def test_zero_turns_it_off(monkeypatch):
    with_rows(monkeypatch, first=NO_FC1_FUSED)
    assert "no fc1_swiglu row" in fc1_swiglu_reason(LARGE, ACT, None, False, None, 64.0)


def test_general_path_launches_the_persistent_kernel(monkeypatch):
    """the fused fc1 launch with fc1's fprop in the persistent kernel and ``1``: one call of
    ``large_fc1_swiglu`` (not the few-rows kernel), recorded for ``explain()``; under auto
    none, and the reason recorded."""
    calls = []
    monkeypatch.setattr(fc1_swiglu_mod, "large_fc1_swiglu",
                        lambda x, w, off, p: (calls.append((x, w, off, p)), ("h", "a"))[1])
    monkeypatch.setattr(fc1_swiglu_mod.grouped_mlp_triton, "fc1_swiglu",
                        lambda *a: pytest.fail("the few-rows kernel ran"))
    fc1 = type("Fc1", (), {"has_bias": False, "out_features": 8})()
    act = _Act()
    cuda = torch.device("cuda")
    with FakeTensorMode():  # operands on a (fake) CUDA device, as the general path has them
        splits = type("S", (), {"num_rows": 128, "num_groups": 2,
                                "offsets": torch.tensor([64, 128], device=cuda)})()
        x, w = torch.zeros(128, 4, device=cuda), torch.zeros(2, 8, 4, device=cuda)
        p = torch.ones(128, device=cuda)
        with_rows(monkeypatch, last=FC1_FUSED_ANY)
        assert fused_fc1(fc1, act, x, w, splits, LARGE, p, None) == \
            ("h", "a", ACT)
        assert calls[0][0] is x and calls[0][1] is w and calls[0][3] is p
        assert "persistent many-rows kernel, large_fc1_swiglu" in act.records[-1][1]
        with_rows(monkeypatch)
        assert fused_fc1(fc1, act, x, w, splits, LARGE, p, None) is None
    assert act.records[-1][1].startswith("not used: fc1's fprop runs in the persistent")
    assert len(calls) == 1


# ---------------------------------------------------------------------------- CUDA: the block
_run = run_block  # [y, x.grad, probs.grad, *parameter grads], grad_fn name


#: 4 groups, 280 of 300 rows (70 per group on average: fprop in the persistent kernel under
#: auto on SM90 bf16), an empty group, a skewed one and 20 padding rows.
SIZES, ROWS = [150, 0, 47, 83], 300


def _needs_persistent_fprop():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("auto runs fc1's fprop in the persistent kernel on SM90 only")


@pytest.mark.cuda
def test_block_with_the_persistent_epilogue_bitwise_equal_to_two_launches(monkeypatch):
    """``1`` (three calls); against ``0``, the fused forward with the
    unfused backward and the unfused ops: outputs and every gradient bit for bit."""
    _needs_persistent_fprop()
    x, split, probs, dy = fc1_block_inputs(SIZES, ROWS)
    with_rows(monkeypatch)
    auto = fc1_block()
    _run(auto, x, split, probs, dy)
    assert "not used: fc1's fprop runs in the persistent many-rows" in auto.explain()
    with_rows(monkeypatch, last=FC1_FUSED_ANY)
    block = fc1_block()
    runs = [_run(block, x, split, probs, dy) for _ in range(3)]
    assert runs[-1][1] == "_FuserFunctionBackward"
    assert "persistent many-rows kernel, large_fc1_swiglu" in block.explain()
    with_rows(monkeypatch, first=NO_FC1_FUSED)
    off = _run(fc1_block(), x, split, probs, dy)[0]
    monkeypatch.setenv("TE_OPS_FUSION_OFF", "grouped_mlp_backward")
    with_rows(monkeypatch, last=FC1_FUSED_ANY)
    fwd_only = _run(fc1_block(), x, split, probs, dy)[0]
    monkeypatch.setenv("TE_OPS_FUSION", "0")
    unfused = _run(fc1_block(), x, split, probs, dy)[0]
    for got in [r[0] for r in runs] + [fwd_only, unfused]:
        assert all(torch.equal(a, b) for a, b in zip(got, off))


@pytest.mark.cuda
def test_block_graph_replay_and_compile_bitwise_equal_to_eager(monkeypatch):
    """The block with the persistent epilogue captured in a CUDA graph (replayed with new
    split sizes, same rows) and under ``torch.compile(fullgraph=True)`` (one frame, no graph
    break; the op ``te_ops::grouped_fc1_swiglu_large``): bitwise the eager values."""
    _needs_persistent_fprop()
    with_rows(monkeypatch, last=FC1_FUSED_ANY)
    x, split, probs, dy = fc1_block_inputs(SIZES, ROWS)
    assert_graph_and_compile_match_eager(fc1_block(), x, split, probs, dy, [10, 90, 0, 180],
                                         "persistent many-rows kernel, large_fc1_swiglu")
