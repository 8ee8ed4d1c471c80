"""The Triton SwiGLU kernels against the PyTorch path (CUDA), and their gate (CPU)."""

from __future__ import annotations

import pytest
import torch

from te_ops.basic.swiglu import swiglu_backward, swiglu_forward
from te_ops.kernels import swiglu_triton


def test_gate_names_reason_on_cpu(monkeypatch):
    x = torch.randn(4, 8)
    assert swiglu_triton.unsupported_reason(x, None) is not None
    assert swiglu_triton.use_triton(x, None) is False
    monkeypatch.setenv("TE_OPS_ACTIVATION_BACKEND", "triton")
    with pytest.raises(RuntimeError, match="TE_OPS_ACTIVATION_BACKEND=triton cannot run"):
        swiglu_forward(x)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 37, 1000])
@pytest.mark.parametrize("ffn", [8, 48, 1500])
def test_triton_matches_torch(monkeypatch, dtype, with_probs, rows, ffn):
    if swiglu_triton.triton is None:
        pytest.skip("triton is not installed")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, 2 * ffn, device="cuda", dtype=dtype, generator=gen) * 3
    dy = torch.randn(rows, ffn, device="cuda", dtype=dtype, generator=gen)
    probs = torch.rand(rows, device="cuda", generator=gen) if with_probs else None
    assert swiglu_triton.use_triton(x, None)
    out = swiglu_forward(x, None, probs)
    dx, dp, out2 = swiglu_backward(x, dy, None, probs, with_output=True)
    assert torch.equal(out, out2)  # the fused backward's recompute is bit-identical
    monkeypatch.setenv("TE_OPS_ACTIVATION_BACKEND", "torch")
    ref = swiglu_forward(x.double(), None, None if probs is None else probs.double())
    ref_dx, ref_dp = swiglu_backward(x.double(), dy.double(), None,
                                     None if probs is None else probs.double())
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    scale = max(1.0, ref.abs().max().item() if rows else 1.0)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * scale)
    dscale = max(1.0, ref_dx.abs().max().item() if rows else 1.0)
    torch.testing.assert_close(dx.double(), ref_dx, rtol=tol, atol=tol * dscale)
    if with_probs:
        pscale = max(1.0, ref_dp.abs().max().item() if rows else 1.0)
        torch.testing.assert_close(dp.double(), ref_dp, rtol=tol, atol=tol * pscale * 4)


def test_cpu_reason_names_the_device_not_the_install(monkeypatch):
    """Forced Triton SwiGLU on the CPU without triton said "triton is not installed", which is
    not why it cannot run there: the device comes first."""
    monkeypatch.setattr(swiglu_triton, "triton", None)
    x = torch.randn(4, 8)
    assert swiglu_triton.unsupported_reason(x, None) == "device type cpu is not cuda"
    assert swiglu_triton.unsupported_reason(x.to("meta"), None) == "device type meta is not cuda"
    monkeypatch.setenv("TE_OPS_ACTIVATION_BACKEND", "triton")
    with pytest.raises(RuntimeError, match="triton cannot run: device type cpu is not cuda"):
        swiglu_triton.select_backend(x, None)
