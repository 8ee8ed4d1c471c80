"""te_ops.permute / te_ops.unpermute against a plain per-token loop; meta device; compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import te_ops

H, FF = 8, 12


def routing(tokens: int, experts: int, top_k: int, *, seed: int = 0, idle: tuple[int, ...] = ()):
    """x (tokens, H), top-k ids (distinct per token, never in ``idle``), weights; fp64."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(experts) if e not in idle])
    ids = torch.stack([allowed[torch.randperm(allowed.numel(), generator=g)[:top_k]]
                       for _ in range(tokens)]) if tokens else torch.zeros(0, top_k).long()
    x = torch.randn(tokens, H, generator=g, dtype=torch.float64)
    w = torch.rand(tokens, top_k, generator=g, dtype=torch.float64)
    return x.requires_grad_(), ids, w.requires_grad_()


def loop_reference(x, ids, w, w1, w2):
    """Per token, per slot: w * (SiLU(a) * b) @ W2[e]^T with [a, b] = x @ W1[e]^T."""
    out = torch.zeros_like(x)
    rows = []
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            a, b = F.linear(x[t], w1[e]).chunk(2)
            rows.append(w[t, k] * F.linear(F.silu(a) * b, w2[e]))
            out = out.index_put((torch.tensor([t]),), rows[-1], accumulate=True)
    return out


@pytest.mark.parametrize("tokens,experts,top_k,idle", [
    (7, 4, 1, ()), (7, 4, 2, (1,)), (5, 6, 3, (0, 5)), (1, 3, 2, (2,)), (0, 4, 2, ())])
def test_permute_expert_block_unpermute_matches_loop(tokens, experts, top_k, idle):
    x, ids, w = routing(tokens, experts, top_k, idle=idle)
    block = te_ops.Sequential(
        te_ops.GroupedLinear(experts, H, 2 * FF, bias=False, dtype=torch.float64),
        te_ops.ScaledSwiGLU(),
        te_ops.GroupedLinear(experts, FF, H, bias=False, dtype=torch.float64))
    routed = te_ops.permute(x, ids, w, experts)
    counts = torch.tensor([(ids == e).sum() for e in range(experts)])
    assert routed.split_sizes.dtype == torch.int64 and torch.equal(routed.split_sizes, counts)
    for e in idle:
        assert routed.split_sizes[e] == 0
    y = block(routed.x, routed.split_sizes, routed.probs, routed.split_sizes)
    out = te_ops.unpermute(y, routed.token_index, tokens)

    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    w1 = block[0].weight.detach().clone().requires_grad_()  # (E, 2F, H)
    w2 = block[2].weight.detach().clone().requires_grad_()
    ref = loop_reference(x_ref, ids, w_ref, w1, w2)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    if tokens == 0:
        return
    dy = torch.randn_like(ref)
    (out * dy).sum().backward()
    (ref * dy).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block[0].weight.grad, w1.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block[2].weight.grad, w2.grad, rtol=1e-12, atol=1e-12)
    for e in idle:  # idle experts: zero gradients, not None
        assert block[0].weight.grad[e].abs().max() == 0


def test_permute_order_is_stable_by_expert_then_token():
    ids = torch.tensor([[2, 0], [0, 2], [1, 0]])
    w = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]])
    x = torch.arange(3.0).unsqueeze(1)
    routed = te_ops.permute(x, ids, w, 4)
    assert routed.token_index.tolist() == [0, 1, 2, 2, 0, 1]
    assert routed.probs.tolist() == pytest.approx([0.2, 0.3, 0.6, 0.5, 0.1, 0.4])
    assert routed.split_sizes.tolist() == [3, 1, 2, 0]
    assert routed.x[:, 0].tolist() == [0, 1, 2, 2, 0, 1]
    assert te_ops.unpermute(routed.x, routed.token_index, 3)[:, 0].tolist() == [0, 2, 4]


def test_ids_past_num_experts_sort_last_and_are_not_counted():
    ids = torch.tensor([[4, 0], [1, 4]])  # 4 == num_experts: an expert-parallel sentinel
    routed = te_ops.permute(torch.randn(2, 3), ids, torch.rand(2, 2), 4)
    assert routed.split_sizes.tolist() == [1, 1, 0, 0]
    assert routed.token_index.tolist() == [0, 1, 0, 1]


def test_permute_without_weights_gives_no_probs():
    routed = te_ops.permute(torch.randn(3, 2), torch.tensor([[1], [0], [1]]), None, 2)
    assert routed.probs is None and routed.split_sizes.tolist() == [1, 2]


def _meta_block(experts):
    return te_ops.Sequential(
        te_ops.GroupedLinear(experts, 32, 64, bias=False, device="meta", dtype=torch.bfloat16),
        te_ops.ScaledSwiGLU(),
        te_ops.GroupedLinear(experts, 32, 32, bias=False, device="meta", dtype=torch.bfloat16))


def test_meta_device_routing_and_block_read_no_device_value(monkeypatch):
    """The graph-safety proof of tests/test_graph_safety.py, with routing on both sides."""
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "1")
    x = torch.empty(16, 32, device="meta", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.empty(16, 2, device="meta", dtype=torch.int64)
    w = torch.empty(16, 2, device="meta", dtype=torch.float32, requires_grad=True)
    block = _meta_block(4)
    routed = te_ops.permute(x, ids, w, 4)
    y = block(routed.x, routed.split_sizes, routed.probs, routed.split_sizes)
    out = te_ops.unpermute(y, routed.token_index, 16)
    out.backward(torch.empty_like(out))
    assert out.shape == (16, 32) and out.device.type == "meta"
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_routing_compiles_fullgraph(backend):
    torch._dynamo.reset()

    def route(x, ids, w):
        routed = te_ops.permute(x, ids, w, 4)
        y = routed.x * routed.probs.unsqueeze(-1) + routed.split_sizes.sum()
        return te_ops.unpermute(y, routed.token_index, x.shape[0])

    x = torch.randn(6, 3, requires_grad=True)
    ids = torch.tensor([[0, 3], [3, 1], [1, 0], [0, 1], [3, 0], [1, 3]])
    w = torch.rand(6, 2, requires_grad=True)
    compiled = torch.compile(route, fullgraph=True, backend=backend)
    out = compiled(x, ids, w)
    ref = route(x, ids, w)
    torch.testing.assert_close(out, ref)
    gx, gw = torch.autograd.grad(out.sum(), (x, w))
    rx, rw = torch.autograd.grad(ref.sum(), (x, w))
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)


@pytest.mark.parametrize("call,match", [
    (lambda: te_ops.permute(torch.randn(3, 2), torch.zeros(3, 1).long(), None, 0),
     "num_experts must be a positive int"),
    (lambda: te_ops.permute(torch.randn(3), torch.zeros(3, 1).long(), None, 2),
     r"x must have shape \(tokens, hidden\)"),
    (lambda: te_ops.permute(torch.randn(3, 2), torch.zeros(4, 1).long(), None, 2),
     r"top_k_index must have shape \(3, top_k\)"),
    (lambda: te_ops.permute(torch.randn(3, 2), torch.zeros(3, 1), None, 2),
     "top_k_index must have an integer dtype"),
    (lambda: te_ops.permute(torch.randn(3, 2), torch.zeros(3, 1).long(), torch.rand(3, 2), 2),
     r"top_k_weights must have top_k_index's shape \(3, 1\), got \(3, 2\)"),
    (lambda: te_ops.permute(torch.randn(3, 2), torch.zeros(3, 1).long(),
                            torch.ones(3, 1).long(), 2),
     "top_k_weights must have a floating-point dtype"),
    (lambda: te_ops.permute(torch.randn(3, 2), torch.zeros(3, 1, device="meta").long(), None,
                            2), "top_k_index must be on x's device"),
    (lambda: te_ops.unpermute(torch.randn(3, 2), torch.zeros(2).long(), 3),
     "y must have shape"),
    (lambda: te_ops.unpermute(torch.randn(3, 2), torch.zeros(3).long(), -1),
     "num_tokens must be a non-negative int, got -1"),
])
def test_routing_errors_name_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
