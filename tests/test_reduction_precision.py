"""Every gradient reduction keeps at least the parameters' precision: float64 blocks sum their
bias and probs gradients in float64 (against a float64 torch reference, to ~1e-13), float32 /
bfloat16 ones in float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import te_ops

F64 = torch.float64
ROWS = 4096  # enough rows that a float32 sum is off by ~1e-7 relative


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_bias_grad_float64_is_summed_in_float64():
    g = torch.Generator().manual_seed(0)
    op = te_ops.Bias(8, dtype=F64)
    x = torch.randn(ROWS, 8, generator=g, dtype=F64)
    dy = 1 + torch.rand(ROWS, 8, generator=g, dtype=F64) * 1e-3
    te_ops.Sequential(op)(x).backward(dy)
    assert op.bias.grad.dtype == F64
    assert _rel(op.bias.grad, dy.sum(0)) < 1e-13  # float32 summation: ~1e-7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_grad_low_precision_sums_in_float32(dtype):
    g = torch.Generator().manual_seed(1)
    op = te_ops.Bias(8, dtype=dtype)
    dy = torch.randn(ROWS, 8, generator=g).to(dtype)
    te_ops.Sequential(op)(torch.zeros(ROWS, 8, dtype=dtype)).backward(dy)
    assert op.bias.grad.dtype == dtype
    assert torch.equal(op.bias.grad, dy.float().sum(0).to(dtype))


@pytest.mark.parametrize("single", [False, True], ids=["per_group", "single_weight"])
@pytest.mark.parametrize("scale_bias", [False, True], ids=["bias", "scale_bias"])
def test_grouped_linear_bias_and_probs_grads_float64(single, scale_bias):
    g = torch.Generator().manual_seed(2)
    sizes = [1500, 0, 2596]
    op = te_ops.GroupedLinear(3, 4, 5, bias=True, scale_bias=scale_bias,
                              single_grouped_weight=single, dtype=F64)
    x = torch.randn(ROWS, 4, generator=g, dtype=F64)
    probs = torch.rand(ROWS, generator=g, dtype=F64).requires_grad_()
    dy = 1 + torch.rand(ROWS, 5, generator=g, dtype=F64) * 1e-3
    extra = (sizes, probs) if scale_bias else (sizes,)
    te_ops.Sequential(op)(x, *extra).backward(dy)
    weights = [w.detach() for w in op.weights()] if not single else list(op.weight.detach())
    biases = list(op.bias.detach()) if single else [getattr(op, f"bias{e}") for e in range(3)]
    ref_bias, ref_probs = [], []
    for e, (lo, hi) in enumerate(zip([0, 1500, 1500], [1500, 1500, ROWS])):
        d = dy[lo:hi]
        p = probs.detach()[lo:hi]
        ref_bias.append((d * p[:, None]).sum(0) if scale_bias else d.sum(0))
        ref_probs.append((d * biases[e].detach()).sum(-1))
        assert weights[e].dtype == F64
    grads = list(op.bias.grad) if single else [getattr(op, f"bias{e}").grad for e in range(3)]
    for got, ref in zip(grads, ref_bias):
        assert got.dtype == F64
        if ref.abs().max() > 0:
            assert _rel(got, ref) < 1e-13
        else:
            assert got.abs().max() == 0
    if scale_bias:
        ref_p = torch.cat(ref_probs)  # only the bias is scaled by probs: rowsum(bias * dy)
        assert probs.grad.dtype == F64
        assert _rel(probs.grad, ref_p) < 1e-13


def test_scaled_swiglu_probs_grad_float64():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(ROWS, 2 * 64, generator=g, dtype=F64).requires_grad_()
    probs = torch.rand(ROWS, generator=g, dtype=F64).requires_grad_()
    dy = torch.randn(ROWS, 64, generator=g, dtype=F64)
    te_ops.Sequential(te_ops.ScaledSwiGLU())(x, probs).backward(dy)
    xr, pr = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    a, b = xr.chunk(2, -1)
    (F.silu(a) * b * pr[:, None]).backward(dy)
    assert probs.grad.dtype == F64
    assert _rel(probs.grad, pr.grad) < 1e-13
    assert _rel(x.grad, xr.grad) < 1e-13
