"""Behaviour a new user ran into: double backward, N-D probs, copies, numpy split sizes."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import reference as ref
import torch

import te_ops
from te_ops.gemm.dispatch import stack_weights


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
    torch.manual_seed(0)  # per-expert weights: still slices of one buffer in the copy
    blk = te_ops.Sequential(te_ops.GroupedLinear(4, 16, 32, single_grouped_weight=False),
                            te_ops.SwiGLU(),
                            te_ops.GroupedLinear(4, 16, 16, single_grouped_weight=False))
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


@pytest.mark.parametrize("frozen", [0, 1])
@pytest.mark.parametrize("fusion", ["0", "1"])
def test_freezing_one_expert_keeps_the_others_gradients(monkeypatch, frozen, fusion):
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    torch.manual_seed(0)
    blk = te_ops.Sequential(te_ops.GroupedLinear(3, 16, 32, single_grouped_weight=False),
                            te_ops.ScaledSwiGLU(),
                            te_ops.GroupedLinear(3, 16, 16, single_grouped_weight=False))
    fc1 = blk[0]
    fc1.weights()[frozen].requires_grad_(False)
    fc1.biases()[frozen].requires_grad_(False)
    x, probs = torch.randn(10, 16), torch.rand(10)
    leaves = {"x": ref.leaf(x), "probs": ref.leaf(probs)}
    leaves.update({f"w{g}": ref.leaf(w.detach()) for g, w in enumerate(fc1.weights())})
    leaves.update({f"b{g}": ref.leaf(b.detach()) for g, b in enumerate(fc1.biases())})
    fc2 = blk[2]

    def fn(t):
        return ref.grouped_mlp(
            t["x"], [4, 1, 5], t["probs"], [t[f"w{g}"] for g in range(3)],
            [t[f"b{g}"] for g in range(3)], [w.detach().double() for w in fc2.weights()],
            [b.detach().double() for b in fc2.biases()])

    grad = torch.randn(10, 16)
    _, expected = ref.forward_backward(fn, leaves, grad)
    y = blk(x, torch.tensor([4, 1, 5]), probs, torch.tensor([4, 1, 5]))
    y.backward(grad)
    for g in range(3):
        w, b = fc1.weights()[g], fc1.biases()[g]
        if g == frozen:
            assert w.grad is None and b.grad is None
        else:
            ref.assert_close(w.grad, expected[f"w{g}"], torch.float32)
            ref.assert_close(b.grad, expected[f"b{g}"], torch.float32)


def test_one_op_instance_twice_in_a_sequential():
    torch.manual_seed(0)
    lin = te_ops.GroupedLinear(3, 16, 16)
    seq = te_ops.Sequential(lin, lin)
    assert len(seq.fusers()) == 2
    x = torch.randn(9, 16, requires_grad=True)
    y = seq(x, [4, 0, 5], [4, 0, 5])
    y.backward(torch.ones_like(y))
    x2 = x.detach().clone().requires_grad_()
    lin2 = copy.deepcopy(lin)
    for p in lin2.parameters():
        p.grad = None
    y2 = lin2(lin2(x2, [4, 0, 5]), [4, 0, 5])
    y2.backward(torch.ones_like(y2))
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)
    assert torch.equal(lin.weight.grad, lin2.weight.grad)


def test_fuser_rejects_a_repeated_op_instance():
    lin = te_ops.GroupedLinear(2, 16, 16)
    with pytest.raises(ValueError, match="basic op 1 .* is the same object as op 0"):
        te_ops.OperationFuser([lin, lin])
