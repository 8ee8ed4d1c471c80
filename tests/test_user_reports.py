"""Behaviour a new user ran into: double backward, N-D probs, copies, numpy split sizes."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import reference as ref
import torch

import te_ops
from te_ops.kernels.grouped_gemm import stack_weights


def _packed(lin: te_ops.GroupedLinear) -> bool:
    return stack_weights(lin.weights()).data_ptr() == lin.weight0.data_ptr()


def test_double_backward_raises_instead_of_returning_wrong_grads():
    blk = te_ops.Sequential(te_ops.GroupedLinear(1, 8, 8, bias=False), te_ops.SwiGLU())
    x = torch.randn(4, 8, requires_grad=True)
    (g,) = torch.autograd.grad(blk(x, [4]).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|differentiate"):
        g.pow(2).sum().backward()


@pytest.mark.parametrize("fusion", ["0", "1"])
def test_nd_input_takes_nd_probs(monkeypatch, fusion):
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    torch.manual_seed(0)
    blk = te_ops.Sequential(te_ops.GroupedLinear(3, 16, 32), te_ops.ScaledSwiGLU(),
                            te_ops.GroupedLinear(3, 16, 16, scale_bias=True))
    x = torch.randn(2, 5, 16, requires_grad=True)
    probs_nd = torch.rand(2, 5, requires_grad=True)
    ss = torch.tensor([4, 0, 5])
    y = blk(x, ss, probs_nd, ss, probs_nd)
    y.backward(torch.ones_like(y))
    assert probs_nd.grad.shape == (2, 5)
    x2 = x.detach().clone().requires_grad_()
    probs_flat = probs_nd.detach().reshape(10).clone().requires_grad_()
    y2 = blk(x2.view(10, 16), ss, probs_flat, ss, probs_flat)
    y2.backward(torch.ones_like(y2))
    assert torch.equal(y.reshape(10, 16), y2)
    assert torch.equal(probs_nd.grad.reshape(10), probs_flat.grad)
    assert torch.equal(x.grad, x2.grad)
    fc1, fc2 = blk[0], blk[2]
    expected = ref.grouped_mlp(
        x.detach().double().reshape(10, 16), [4, 0, 5], probs_flat.detach().double(),
        [w.double() for w in fc1.weights()], [b.double() for b in fc1.biases()],
        [w.double() for w in fc2.weights()], [b.double() for b in fc2.biases()],
        fc2_probs=probs_flat.detach().double())
    ref.assert_close(y2.detach(), expected, torch.float32)


def test_probs_of_wrong_nd_shape_names_both_shapes():
    lin = te_ops.GroupedLinear(2, 16, 16, scale_bias=True)
    expected = r"probs must have shape \(10,\) or \(2, 5\), got \(5, 2\)"
    with pytest.raises(ValueError, match=expected):
        lin(torch.randn(2, 5, 16), [5, 5], torch.rand(5, 2))


@pytest.mark.parametrize("clone", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))])
def test_copies_keep_weights_packed_and_equal(clone):
    torch.manual_seed(0)
    blk = te_ops.Sequential(te_ops.GroupedLinear(4, 16, 32), te_ops.SwiGLU(),
                            te_ops.GroupedLinear(4, 16, 16))
    twin = clone(blk)
    assert _packed(twin[0]) and _packed(twin[2])
    assert twin[0].weight0 is not blk[0].weight0
    x = torch.randn(12, 16)
    assert torch.equal(blk(x, [3, 3, 3, 3], [3, 3, 3, 3]), twin(x, [3, 3, 3, 3], [3, 3, 3, 3]))


def test_numpy_integer_split_sizes_are_accepted():
    torch.manual_seed(0)
    lin = te_ops.GroupedLinear(3, 16, 16)
    x = torch.randn(9, 16)
    sizes = np.array([4, 0, 5])
    assert torch.equal(lin(x, list(sizes)), lin(x, [4, 0, 5]))


def test_meta_loop_backend_says_why(monkeypatch):
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "loop")
    lin = te_ops.GroupedLinear(2, 16, 16, device="meta")
    with pytest.raises(RuntimeError, match="meta device have no values"):
        lin(torch.empty(8, 16, device="meta"), torch.empty(2, dtype=torch.int64, device="meta"))
