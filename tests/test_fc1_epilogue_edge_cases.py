"""Edge cases of the fc1 SwiGLU epilogue on the CPU: a call without a recipe drops the previous
call's recipe record from ``explain()``, and the fused fc1 + SwiGLU and the few-rows Triton
fprop / dgrad name the weights when they hold no group.
"""

from __future__ import annotations

import pytest
import torch

import te_ops


def _fake_choice(fc1, act, x2d, splits, backend1, recipe):
    """``fc1_swiglu_choice`` as the CUDA gate answers it, on the CPU: not used under a
    recipe, else the activation's backend."""
    if recipe is not None:
        return None
    return act.select_backend(x2d.new_empty(0, fc1.out_features))


def _fake_launch(act, x2d, weights, splits, backend1, probs):
    """The fused launch's values from torch ops: fc1's GEMM, then the activation."""
    from te_ops.basic.swiglu import swiglu_forward
    from te_ops.gemm.dispatch import grouped_fprop

    h = grouped_fprop(x2d, weights, splits, backend1)
    return h, swiglu_forward(h, None, probs, act.select_backend(h))


def test_epilogue_call_drops_an_earlier_calls_recipe_record(monkeypatch):
    """After a call under a recipe, a call that takes the fc1 SwiGLU epilogue (no recipe)
    must not leave the recipe's note on fc1 in ``explain()`` (the unfused fc1 fprop drops it
    in ``forward_math``, which the epilogue skips)."""
    from te_ops.fused import grouped_mlp
    from te_ops.quantization import Float8CurrentScaling

    monkeypatch.setattr(grouped_mlp, "fc1_swiglu_choice", _fake_choice)
    monkeypatch.setattr(grouped_mlp, "fc1_swiglu_forward", _fake_launch)
    torch.manual_seed(0)
    block = te_ops.Sequential(te_ops.GroupedLinear(4, 32, 64, bias=False),
                              te_ops.ScaledSwiGLU(),
                              te_ops.GroupedLinear(4, 32, 32, bias=False))
    splits = torch.tensor([10, 0, 14, 8])
    probs = torch.rand(32)
    x = torch.randn(32, 32)
    with te_ops.autocast(enabled=True, recipe=Float8CurrentScaling()):
        block(x, splits, probs, splits)
    assert any(k.startswith("recipe ") for k in block[0].__dict__["_dispatch_records"])
    block(x, splits, probs, splits)  # no recipe: the (fake) epilogue runs fc1's fprop
    records = block[0].__dict__["_dispatch_records"]
    assert not any(k.startswith("recipe ") for k in records), records
    assert "Float8CurrentScaling" not in block.explain().split("dispatch:")[1].splitlines()[3]


def test_fc1_swiglu_without_groups_names_the_weights(monkeypatch):
    """``fc1_swiglu`` with G = 0 groups (weights (0, 2F, K), offsets (0,)) raised
    ZeroDivisionError from its config (rows / groups), and the kernel would read the empty
    offsets; a clear ValueError names the argument and the value."""
    from te_ops.gemm import grouped_mlp_triton as gm

    monkeypatch.setattr(gm, "unsupported_reason", lambda *a: None)  # as on a GPU
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    w = torch.randn(0, 16, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"weights .*at least one group.*G=0"):
        gm.fc1_swiglu(x, w, torch.zeros(0, dtype=torch.int32))


@pytest.mark.parametrize("kind", ["fprop", "dgrad"])
def test_triton_rows_without_groups_names_the_weights(monkeypatch, kind):
    """The same input kind for the Triton grouped fprop / dgrad (G = 0)."""
    from te_ops.gemm import grouped_gemm_triton as tg

    monkeypatch.setattr(tg, "unsupported_reason", lambda *a: None)  # as on a GPU
    w = torch.randn(0, 16, 8, dtype=torch.bfloat16)
    a = torch.randn(4, 8 if kind == "fprop" else 16, dtype=torch.bfloat16)
    call = tg.triton_fprop if kind == "fprop" else tg.triton_dgrad
    with pytest.raises(ValueError, match=r"weights .*at least one group.*G=0"):
        call(a, w, torch.zeros(0, dtype=torch.int32))
