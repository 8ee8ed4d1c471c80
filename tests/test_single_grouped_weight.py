"""GroupedLinear's two parameter layouts: one packed (G, out, in) ``weight`` (the default,
``single_grouped_weight=True``) and per-expert ``weight{g}`` (``single_grouped_weight=False``):
same math, bit for bit, and checkpoints of either layout load into either."""

from __future__ import annotations

import copy

import pytest
import reference as ref
import torch
from fusion_env import set_grouped_mlp

import te_ops
from te_ops.gemm.dispatch import stack_weights

E, H, F = 4, 16, 24
SIZES = [5, 0, 7, 6]  # 18 of 20 rows: a zero-token group and two padding rows


def _block(single: bool, bias: bool, dtype=torch.float32) -> te_ops.Sequential:
    kw = {"bias": bias, "single_grouped_weight": single, "dtype": dtype}
    return te_ops.Sequential(te_ops.GroupedLinear(E, H, 2 * F, **kw), te_ops.ScaledSwiGLU(),
                             te_ops.GroupedLinear(E, F, H, **kw))


def _copy_into_single(per_group: te_ops.Sequential, single: te_ops.Sequential) -> None:
    with torch.no_grad():
        for i in (0, 2):
            single[i].weight.copy_(torch.stack(per_group[i].weights()))
            if per_group[i].has_bias:
                single[i].bias.copy_(torch.stack(per_group[i].biases()))


def _run(block, x, probs, sizes, grad):
    x = x.detach().clone().requires_grad_()
    probs = probs.detach().clone().requires_grad_()
    y = block(x, sizes, probs, sizes)
    y.backward(grad)
    return y.detach(), x.grad, probs.grad


def test_parameters_and_state_dict_names():
    lin = te_ops.GroupedLinear(E, H, F, single_grouped_weight=True)
    assert [n for n, _ in lin.named_parameters()] == ["weight", "bias"]
    assert lin.weight.shape == (E, F, H) and lin.bias.shape == (E, F)
    assert "per-expert" not in lin.describe()


def test_packed_layout_is_the_default():
    lin = te_ops.GroupedLinear(E, H, F)
    assert lin.single_grouped_weight is True
    assert [n for n, _ in lin.named_parameters()] == ["weight", "bias"]
    assert list(lin.state_dict()) == ["weight", "bias"]
    assert "single_grouped_weight=True" in repr(lin)


def test_per_expert_layout_names():
    lin = te_ops.GroupedLinear(E, H, F, single_grouped_weight=False)
    assert [n for n, _ in lin.named_parameters()] == (
        [f"weight{g}" for g in range(E)] + [f"bias{g}" for g in range(E)])
    assert all(w.shape == (F, H) for w in lin.weights())
    assert lin.describe().endswith(", per-expert weights)")


@pytest.mark.parametrize("kind", ["list", "tensor"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fusion", ["0", "1"])
def test_matches_per_group_parameters_bitwise_and_reference(monkeypatch, kind, bias, fusion):
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    torch.manual_seed(0)
    per_group, single = _block(False, bias), _block(True, bias)
    _copy_into_single(per_group, single)
    x, probs = torch.randn(20, H), torch.rand(20)
    grad = torch.randn(20, H)
    sizes = SIZES if kind == "list" else torch.tensor(SIZES)
    y1, dx1, dp1 = _run(per_group, x, probs, sizes, grad)
    y2, dx2, dp2 = _run(single, x, probs, sizes, grad)
    assert torch.equal(y1, y2) and torch.equal(dx1, dx2) and torch.equal(dp1, dp2)
    for i in (0, 2):
        assert torch.equal(torch.stack([w.grad for w in per_group[i].weights()]),
                           single[i].weight.grad)
        if bias:
            assert torch.equal(torch.stack([b.grad for b in per_group[i].biases()]),
                               single[i].bias.grad)
    fc1, fc2 = single[0], single[2]
    expected = ref.grouped_mlp(
        x.double(), SIZES, probs.double(), list(fc1.weight.detach().double()),
        list(fc1.bias.detach().double()) if bias else None, list(fc2.weight.detach().double()),
        list(fc2.bias.detach().double()) if bias else None)
    ref.assert_close(y2, expected, torch.float32)
    assert (y2[18:] == 0).all() and (dx2[18:] == 0).all()


def test_fused_and_unfused_halves_interchange(monkeypatch):
    torch.manual_seed(0)
    single = _block(True, True, torch.bfloat16)
    x = torch.randn(20, H, dtype=torch.bfloat16)
    probs, grad = torch.rand(20), torch.randn(20, H, dtype=torch.bfloat16)
    results = []
    for fwd, bwd in (("0", "0"), ("1", "0"), ("0", "1"), ("1", "1")):
        set_grouped_mlp(monkeypatch, fwd, bwd)
        for p in single.parameters():
            p.grad = None
        out = _run(single, x, probs, torch.tensor(SIZES), grad)
        results.append((*out, *(p.grad.clone() for p in single.parameters())))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_meta_device_graph_safe(monkeypatch):
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "1")
    block = te_ops.Sequential(
        te_ops.GroupedLinear(E, H, 2 * F, single_grouped_weight=True, device="meta",
                             dtype=torch.bfloat16),
        te_ops.ScaledSwiGLU(),
        te_ops.GroupedLinear(E, F, H, single_grouped_weight=True, device="meta",
                             dtype=torch.bfloat16))
    x = torch.empty(20, H, device="meta", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.empty(20, device="meta", requires_grad=True)
    sizes = torch.empty(E, device="meta", dtype=torch.int64)
    block(x, sizes, probs, sizes).sum().backward()
    assert block[0].weight.grad.shape == (E, 2 * F, H)


@pytest.mark.cuda
def test_cuda_graph_replay_matches_eager():
    from te_ops.graphs import make_graphed_callable

    torch.manual_seed(0)
    dev, T = torch.device("cuda"), 256
    kw = {"single_grouped_weight": True, "device": dev, "dtype": torch.bfloat16}

    def make():
        torch.manual_seed(1)
        return te_ops.Sequential(te_ops.GroupedLinear(8, 64, 256, **kw), te_ops.ScaledSwiGLU(),
                                 te_ops.GroupedLinear(8, 128, 64, **kw))

    graphed_block, eager_block = make(), make()
    x = torch.randn(T, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(T, device=dev, requires_grad=True)
    sizes = torch.full((8,), T // 8, device=dev)
    graphed = make_graphed_callable(graphed_block, (x, sizes, probs, sizes))
    for routing in ([32] * 8, [0, 100, 0, 56, 0, 50, 0, 0], [10, 0, 20, 0, 30, 0, 40, 50]):
        sizes = torch.tensor(routing, device=dev)
        for block in (graphed_block, eager_block):
            for p in block.parameters():
                p.grad = None
        xs = [x.detach().clone().requires_grad_() for _ in range(2)]
        ps = [probs.detach().clone().requires_grad_() for _ in range(2)]
        y_graph = graphed(xs[0], sizes, ps[0], sizes)
        y_graph.backward(torch.ones_like(y_graph))
        y_eager = eager_block(xs[1], sizes, ps[1], sizes)
        y_eager.backward(torch.ones_like(y_eager))
        assert torch.equal(y_graph, y_eager)
        assert torch.equal(xs[0].grad, xs[1].grad) and torch.equal(ps[0].grad, ps[1].grad)
        for a, b in zip(graphed_block.parameters(), eager_block.parameters()):
            assert torch.equal(a.grad, b.grad)
        assert (y_graph[sum(routing):] == 0).all()


@pytest.mark.cuda
def test_cuda_graph_without_grad_clone_hands_out_the_static_buffer():
    from te_ops.graphs import make_graphed_callable

    dev, T = torch.device("cuda"), 128
    kw = {"single_grouped_weight": True, "device": dev, "dtype": torch.bfloat16}
    torch.manual_seed(1)
    block = te_ops.Sequential(te_ops.GroupedLinear(4, 64, 128, **kw), te_ops.ScaledSwiGLU(),
                              te_ops.GroupedLinear(4, 64, 64, **kw))
    twin = copy.deepcopy(block)
    x = torch.randn(T, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(T, device=dev, requires_grad=True)
    sizes = torch.tensor([32, 0, 64, 32], device=dev)
    graphed = make_graphed_callable(block, (x, sizes, probs, sizes), clone_param_grads=False)
    ptrs = []
    for _ in range(2):
        for p in (*block.parameters(), *twin.parameters()):
            p.grad = None
        graphed(x, sizes, probs, sizes).sum().backward()
        twin(x, sizes, probs, sizes).sum().backward()
        for a, b in zip(block.parameters(), twin.parameters()):
            assert torch.equal(a.grad, b.grad)
        ptrs.append([p.grad.data_ptr() for p in block.parameters()])
    assert ptrs[0] == ptrs[1]  # the same static buffers, step after step


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("src_single, dst_single", [(True, False), (False, True), (True, True),
                                                    (False, False)],
                         ids=["packed_to_per_expert", "per_expert_to_packed", "packed",
                              "per_expert"])
def test_state_dict_of_either_layout_loads_into_either(src_single, dst_single, bias):
    torch.manual_seed(0)
    src = _block(src_single, bias)
    torch.manual_seed(1)
    dst = _block(dst_single, bias)
    dst.load_state_dict(src.state_dict())  # strict: every key converted
    for i in (0, 2):
        for get in (te_ops.GroupedLinear.weights, te_ops.GroupedLinear.biases):
            a, b = get(src[i]), get(dst[i])
            if a:
                assert torch.equal(torch.stack(a) if not src_single else a[0],
                                   torch.stack(b) if not dst_single else b[0])
    x, probs, grad = torch.randn(20, H), torch.rand(20), torch.randn(20, H)
    sizes = torch.tensor(SIZES)
    for u, v in zip(_run(src, x, probs, sizes, grad), _run(dst, x, probs, sizes, grad)):
        assert torch.equal(u, v)
    if not dst_single:  # loading copies in place: per-expert weights stay one buffer
        assert stack_weights(dst[0].weights()).data_ptr() == dst[0].weights()[0].data_ptr()
