"""CPU side of the SwiGLU -> FP8 row-wise path (``quantization/fp8_swiglu.py``).

* ``swiglu_output_operand`` is ``None`` (the fused forward then runs the activation and
  quantizes its output) without a recipe, with fprop kept in high precision, under MXFP8, and
  where the kernel cannot run (CPU; odd or too long rows and probs on another device, through
  ``fp8_swiglu.shape_reason``; ``ENABLED = False``); under a recipe it checks the input dtype.
* ``Quantizer.rowwise_storage`` builds the storage a row-wise-only call returns (same fields).
* ``GroupedLinear.forward_operands`` refuses a row-wise-only ``input_operand`` where the call
  keeps x's column-wise copy, naming the argument.
* ``swiglu_fp8_rows`` raises with the reason where it cannot run.
"""

from __future__ import annotations

import pytest
import torch

import te_ops
from te_ops.op import OperationContext
from te_ops.quantization import Float8CurrentScalingQuantizer, fp8_swiglu
from te_ops.quantization.autocast import swiglu_output_operand
from te_ops.recipe import Float8CurrentScaling, MXFP8BlockScaling
from te_ops.splits import make_splits


@pytest.mark.parametrize("recipe", [None, Float8CurrentScaling(),
                                    Float8CurrentScaling(fprop_high_precision=True),
                                    MXFP8BlockScaling()])
def test_swiglu_output_operand_none_where_no_kernel(recipe):
    h = torch.randn(6, 8, dtype=torch.bfloat16)
    assert swiglu_output_operand(recipe, h, torch.rand(6)) is None


def test_swiglu_output_operand_checks_dtype():
    with pytest.raises(TypeError, match="input is torch.float16"):
        swiglu_output_operand(Float8CurrentScaling(), torch.zeros(2, 4, dtype=torch.float16),
                              None)


def test_unsupported_reasons():
    h = torch.zeros(2, 8, dtype=torch.bfloat16)
    assert fp8_swiglu.unsupported_reason(h, None) == "device type cpu is not cuda"
    with pytest.raises(ValueError, match="swiglu_fp8_rows cannot take this input: device"):
        fp8_swiglu.swiglu_fp8_rows(h, None)
    q = Float8CurrentScalingQuantizer(rowwise=True)
    assert q.quantize_swiglu_rows(h, None) is None
    assert Float8CurrentScalingQuantizer(rowwise=True, columnwise=True).quantize_swiglu_rows(
        h, None) is None


def test_shape_reasons():
    assert "odd" in fp8_swiglu.shape_reason(torch.zeros(2, 7), None)
    long = torch.zeros(1, 2 * fp8_swiglu.MAX_FFN + 2)
    assert "above" in fp8_swiglu.shape_reason(long, None)
    assert fp8_swiglu.shape_reason(torch.zeros(2, 8), torch.zeros(2)) is None
    assert "probs on meta" in fp8_swiglu.shape_reason(torch.zeros(2, 8),
                                                      torch.zeros(2, device="meta"))


def test_disabled_gives_none(monkeypatch):
    monkeypatch.setattr(fp8_swiglu, "unsupported_reason", lambda h, p: None)
    monkeypatch.setattr(fp8_swiglu, "ENABLED", False)
    assert Float8CurrentScalingQuantizer(rowwise=True).quantize_swiglu_rows(
        torch.zeros(2, 8), None) is None


def test_rowwise_storage_matches_the_call():
    x = torch.randn(5, 16, dtype=torch.bfloat16) * 3
    q = Float8CurrentScalingQuantizer(rowwise=True)
    ref = q(x)
    got = q.rowwise_storage(ref.rowwise_data, ref.rowwise_scale_inv, x.dtype)
    for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv",
                 "columnwise_amax", "shape", "quantizer", "num_groups", "dtype",
                 "split_sizes", "base_offsets"):
        a, b = getattr(got, name, "absent"), getattr(ref, name, "absent")
        if isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), name


def test_forward_operands_refuses_rowwise_operand_when_x_is_kept():
    fc = te_ops.GroupedLinear(2, 16, 8, bias=False)
    ctx = OperationContext()
    ctx.requires_grad = True
    x = torch.randn(4, 16)
    splits = make_splits([1, 3], 2, 4, x.device)
    recipe = Float8CurrentScaling()
    a_q = Float8CurrentScalingQuantizer(rowwise=True)(x)
    with pytest.raises(ValueError, match="input_operand is a row-wise copy only"):
        fc.forward_operands(ctx, x, splits, recipe, save_input=True, input_operand=a_q)
    x_in, _ = fc.forward_operands(ctx, None, splits, recipe, save_input=False,
                                  input_operand=a_q)
    assert x_in is a_q
