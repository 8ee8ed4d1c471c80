"""The grouped MLP on CUDA at realistic magnitudes (the dispatched kernels on their real path).

Inputs ~ N(0, 1), weights at ``GroupedLinear``'s init scale, probs ~ U(0, 1), device split
sizes with padding rows (the Triton padding-row kernel and the in-place activation backward
run): all four fused x unfused combinations are bitwise equal and match the fp64 reference
(``reference.py``) at the dtype's tolerance. The fused backward writes dh over the saved
activation input, so a second backward through a retained graph must raise.
"""

from __future__ import annotations

import itertools

import pytest
import reference as ref
import torch
from fusion_env import set_grouped_mlp

import te_ops

pytestmark = pytest.mark.cuda

E, H, FF = 4, 256, 128
SIZES = [70, 0, 130, 61]  # 261 real rows of 300: 39 padding rows
ROWS = 300


def _block(dtype: torch.dtype, bias: bool) -> te_ops.Sequential:
    kw = {"bias": bias, "device": "cuda", "dtype": dtype}
    return te_ops.Sequential(te_ops.GroupedLinear(E, H, 2 * FF, **kw), te_ops.ScaledSwiGLU(),
                             te_ops.GroupedLinear(E, FF, H, **kw))


def _inputs(dtype: torch.dtype):
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(ROWS, H, device="cuda", dtype=dtype, generator=gen)
    probs = torch.rand(ROWS, device="cuda", generator=gen)
    dy = torch.randn(ROWS, H, device="cuda", dtype=dtype, generator=gen)
    split = torch.tensor(SIZES, device="cuda")
    return x, probs, dy, split


def _run(blk, x, probs, dy, split):
    xl = x.clone().requires_grad_()
    pl = probs.clone().requires_grad_()
    y = blk(xl, split, pl, split)
    y.backward(dy)
    grads = {"x": xl.grad, "probs": pl.grad}
    grads.update({n: p.grad for n, p in blk.named_parameters()})
    return y.detach(), grads


def _reference(blk, x, probs, dy):
    return ref.block_forward_backward(blk, E, SIZES, x, probs, dy)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_four_combinations_bitwise_and_vs_fp64(monkeypatch, dtype, bias):
    torch.manual_seed(0)
    master = _block(dtype, bias)
    x, probs, dy, split = _inputs(dtype)
    results = {}
    for fwd, bwd in itertools.product((True, False), repeat=2):
        set_grouped_mlp(monkeypatch, fwd, bwd)
        blk = _block(dtype, bias)
        blk.load_state_dict(master.state_dict())
        torch.cuda.empty_cache()  # fresh allocations: padding rows start as whatever is there
        results[fwd, bwd] = _run(blk, x, probs, dy, split)
    y_ref, g_ref = _reference(master, x, probs, dy)
    base_y, base_g = results[False, False]
    for combo, (y, grads) in results.items():
        assert torch.equal(y, base_y), f"{combo}: output differs from unfused"
        for k, g in grads.items():
            assert torch.equal(g, base_g[k]), f"{combo}: grad {k} differs from unfused"
        assert torch.count_nonzero(y[sum(SIZES):]) == 0, "padding rows of the output"
        assert torch.count_nonzero(grads["x"][sum(SIZES):]) == 0, "padding rows of x.grad"
        ref.assert_close(y, y_ref, dtype, f"{combo}: output")
        for k, g in g_ref.items():
            ref.assert_close(grads[k], g, dtype, f"{combo}: grad {k}")


def test_second_backward_through_retained_graph_raises(monkeypatch):
    """The fused backward reuses the activation input's buffer for dh; a second backward must
    not silently read it."""
    blk = _block(torch.bfloat16, False)
    x, probs, dy, split = _inputs(torch.bfloat16)
    x.requires_grad_()
    y = blk(x, split, probs, split)
    y.backward(dy, retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace operation"):
        y.backward(dy)


def test_second_backward_unfused_still_works(monkeypatch):
    monkeypatch.setenv("TE_OPS_FUSION_OFF", "grouped_mlp_backward")
    blk = _block(torch.bfloat16, False)
    x, probs, dy, split = _inputs(torch.bfloat16)
    x.requires_grad_()
    y = blk(x, split, probs, split)
    y.backward(dy, retain_graph=True)
    first = x.grad.clone()
    y.backward(dy)
    torch.testing.assert_close(x.grad, 2 * first)
