"""SwiGLU at extreme gate values: what SwiGLU's docstring states (signed zero below about
-88.72 in fp32, NaN at -inf), on the torch path against torch's own ``silu``, and (CUDA) the
Triton kernel against the torch path at the same values: the same zeros below the overflow,
the same NaN / inf at infinite gates, equal within the dtype's rounding elsewhere (the kernel's
``exp`` and the probs sum's order are not torch's, so not bit for bit)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import te_ops
from te_ops.basic.swiglu import swiglu_backward, swiglu_forward

GATES = [-1e4, -104.0, -100.0, -90.0, -88.8, -88.73, -88.72, -88.0, -87.4, -87.3, -80.0,
         -20.0, -1.0, 0.0, 1.0, 20.0, 88.8, 1e4]


def _x(gates, device="cpu", dtype=torch.float32):
    a = torch.tensor(gates, dtype=dtype, device=device)
    b = torch.linspace(0.5, 2.0, len(gates), dtype=dtype, device=device)
    return torch.stack([a, b], -1).reshape(len(gates), 2)  # (rows, 2F) with F = 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_extreme_gates_follow_torch_silu(dtype, monkeypatch):
    monkeypatch.setenv("TE_OPS_ACTIVATION_BACKEND", "torch")
    x = _x(GATES, dtype=dtype).requires_grad_()
    op = te_ops.Sequential(te_ops.SwiGLU())
    y = op(x)
    dy = torch.ones_like(y)
    y.backward(dy)
    xr = x.detach().clone().requires_grad_()
    compute = torch.promote_types(dtype, torch.float32)
    a, b = xr[:, :1].to(compute), xr[:, 1:].to(compute)
    ref = (F.silu(a) * b).to(dtype)
    ref.backward(dy)
    assert torch.equal(y, ref)
    assert torch.equal(x.grad, xr.grad)
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()


def test_fp32_gate_below_overflow_is_signed_zero():
    x = _x([-88.73, -90.0, -1e4])
    y = swiglu_forward(x)
    assert torch.equal(y, torch.zeros_like(y)) and torch.signbit(y).all()
    dx, _ = swiglu_backward(x, torch.ones_like(y))
    assert torch.equal(dx, torch.zeros_like(dx))
    # fp64 keeps the representable value there
    y64 = swiglu_forward(x[:2].double())
    assert (y64 < 0).all() and (y64 > -1e-36).all()


def test_infinite_gates():
    y = swiglu_forward(_x([-float("inf"), float("inf")]))
    assert torch.isnan(y[0]).all() and torch.isinf(y[1]).all()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_matches_torch_path_at_extreme_gates(dtype, monkeypatch):
    from te_ops.kernels import swiglu_triton

    gates = GATES + [-float("inf"), float("inf")]
    x = _x(gates, "cuda", dtype).repeat(1, 16)  # F = 16: contiguous halves
    x = torch.cat([x[:, 0::2], x[:, 1::2]], -1).contiguous()
    probs = torch.rand(x.shape[0], device="cuda")
    dy = torch.ones(x.shape[0], 16, device="cuda", dtype=dtype)
    assert swiglu_triton.use_triton(x, None)
    monkeypatch.setenv("TE_OPS_ACTIVATION_BACKEND", "triton")
    got = (swiglu_forward(x, None, probs), *swiglu_backward(x, dy, None, probs))
    monkeypatch.setenv("TE_OPS_ACTIVATION_BACKEND", "torch")
    want = (swiglu_forward(x, None, probs), *swiglu_backward(x, dy, None, probs))
    gate = x[:, 0].float()  # exp(-a) overflows in fp32 below -88.72: SiLU(a) is a signed zero
    overflow = (gate <= -88.73) & torch.isfinite(gate)
    for g, w, name in zip(got, want, ("out", "grad_x", "grad_probs")):
        torch.testing.assert_close(g, w, equal_nan=True, msg=name)
        assert torch.equal(torch.isnan(g), torch.isnan(w)), name
        assert torch.equal(torch.isinf(g), torch.isinf(w)), name
    for g, w in zip(got[:2], want[:2]):  # out and grad_x: exact zeros on both paths
        assert (g[overflow] == 0).all() and (w[overflow] == 0).all()
