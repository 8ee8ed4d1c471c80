"""The fused grouped MLP forward checks its inputs as the unfused ops do, in their order.

With fc2's weights in another dtype than the block's input, the fused forward runs fc2's
input check (naming the weights' dtype and the fix, not torch's ``expected m1 and m2 to have
the same dtype``); under a recipe it runs fc1's input check before it quantizes the weights,
so an input of another dtype than the weights (or a wrong shape) gets the input check's
``ValueError``, not the recipe's dtype ``TypeError``. Every case below raises the same error
with ``TE_OPS_FUSION`` 1 and 0;
the valid call's output is checked against the float64 reference of ``tests/reference.py``.
"""

from __future__ import annotations

import re

import pytest
import reference as ref
import torch

import te_ops
from te_ops.basic.grouped_linear import stacked

SIZES = [3, 0, 4, 3]
MISMATCH = r"input must match the weights' dtype {w} and device cpu, got {x} on cpu"
RECIPE_DTYPE = r"needs float32 or bfloat16 parameters and inputs \(input is {x}\)"
SHAPE = r"input must have last dim in_features=8, got shape \(10, 7\)"

# (name, input dtype, fc1 dtype, fc2 dtype, input width, recipe, error type, message)
CASES = [
    ("input_vs_weights", torch.float16, torch.float32, torch.float32, 8, True, ValueError,
     MISMATCH.format(w="torch.float32", x="torch.float16")),
    ("weights_fp16_recipe", torch.float32, torch.float16, torch.float16, 8, True, ValueError,
     MISMATCH.format(w="torch.float16", x="torch.float32")),
    ("fc2_fp16_recipe", torch.float32, torch.float32, torch.float16, 8, True, ValueError,
     MISMATCH.format(w="torch.float16", x="torch.float32")),
    ("fc2_fp16", torch.float32, torch.float32, torch.float16, 8, False, ValueError,
     MISMATCH.format(w="torch.float16", x="torch.float32")),
    ("fc2_bf16", torch.float32, torch.float32, torch.bfloat16, 8, False, ValueError,
     MISMATCH.format(w="torch.bfloat16", x="torch.float32")),
    ("fc2_fp64", torch.float32, torch.float32, torch.float64, 8, False, ValueError,
     MISMATCH.format(w="torch.float64", x="torch.float32")),
    ("bad_shape_fp16_recipe", torch.float16, torch.float32, torch.float32, 7, True,
     ValueError, SHAPE),
    ("fp16_everywhere_recipe", torch.float16, torch.float16, torch.float16, 8, True,
     TypeError, RECIPE_DTYPE.format(x="torch.float16")),
    ("fp64_everywhere_recipe", torch.float64, torch.float64, torch.float64, 8, True,
     TypeError, RECIPE_DTYPE.format(x="torch.float64")),
]


def _block(dtype1: torch.dtype, dtype2: torch.dtype) -> te_ops.Sequential:
    torch.manual_seed(0)
    block = te_ops.Sequential(te_ops.GroupedLinear(4, 8, 16), te_ops.ScaledSwiGLU(),
                              te_ops.GroupedLinear(4, 8, 8))
    block[0].to(dtype1)
    block[2].to(dtype2)
    return block


def _call(block, dtype, width, recipe: bool, sizes=SIZES):
    torch.manual_seed(1)
    x = torch.randn(10, width, dtype=dtype, requires_grad=True)
    probs = torch.rand(10, dtype=dtype)
    split = torch.tensor(sizes)
    with te_ops.autocast(enabled=recipe, recipe=te_ops.recipe.Float8CurrentScaling()
                         if recipe else None):
        return block(x, split, probs, split)


@pytest.mark.parametrize("fusion", ["1", "0"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fused_and_unfused_raise_the_same_input_error(case, fusion, monkeypatch):
    _, xdt, dt1, dt2, width, recipe, exc, message = case
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = _block(dt1, dt2)
    with pytest.raises(exc, match=message):
        _call(block, xdt, width, recipe)


@pytest.mark.parametrize("fusion", ["1", "0"])
def test_recipe_dtype_error_comes_before_the_split_size_error(fusion, monkeypatch):
    """An fp16 block under a recipe with bad split sizes: both paths name the dtype first."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = _block(torch.float16, torch.float16)
    with pytest.raises(TypeError, match=RECIPE_DTYPE.format(x="torch.float16")):
        _call(block, torch.float16, 8, True, sizes=[3, 0, 4, 4])


@pytest.mark.parametrize("fusion", ["1", "0"])
def test_valid_call_still_matches_the_reference(fusion, monkeypatch):
    """The checks moved ahead in the fused forward reject nothing valid."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = _block(torch.float32, torch.float32)
    torch.manual_seed(1)
    x = torch.randn(10, 8)
    probs = torch.rand(10)
    split = torch.tensor(SIZES)
    y = block(x, split, probs, split)
    w1 = [ref.leaf(w) for w in stacked(block[0].weights(), False)]
    b1 = [ref.leaf(b) for b in stacked(block[0].biases(), False)]
    w2 = [ref.leaf(w) for w in stacked(block[2].weights(), False)]
    b2 = [ref.leaf(b) for b in stacked(block[2].biases(), False)]
    want = ref.grouped_mlp(ref.leaf(x), SIZES, ref.leaf(probs), w1, b1, w2, b2)
    ref.assert_close(y, want, torch.float32)


def test_messages_name_the_weights_dtype_and_the_fix():
    block = _block(torch.float32, torch.float16)
    with pytest.raises(ValueError) as info:
        _call(block, torch.float32, 8, False)
    assert re.search(r"move the input with x.to\(torch.float16\) \(or the layer with "
                     r".to\(torch.float32\)\)", str(info.value))


@pytest.mark.parametrize("fusion", ["1", "0"])
def test_fc2_on_another_device_names_the_device(fusion, monkeypatch):
    """fc2's weights on another device than the input (``meta`` stands in for a second GPU)."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = _block(torch.float32, torch.float32)
    block[2].to("meta")
    with pytest.raises(ValueError, match=r"input must match the weights' dtype torch.float32 and "
                                         r"device meta, got torch.float32 on cpu: move the "
                                         r"input with x.to\('meta'\)"):
        _call(block, torch.float32, 8, False)
