"""The Sequential container: the list protocol, state dicts, plain modules in the middle,
standalone ops, dtype conversion."""

from __future__ import annotations

import pytest
import reference as ref
import torch
from reference import assert_close, split_arg

import te_ops
from te_ops.gemm.dispatch import stack_weights

G, K, F = 3, 16, 16
SIZES, ROWS = [3, 0, 5], 10


def _block(device, dtype=torch.float32, single: bool = True):
    return te_ops.Sequential(
        te_ops.GroupedLinear(G, K, 2 * F, single_grouped_weight=single, device=device,
                             dtype=dtype),
        te_ops.ScaledSwiGLU(),
        te_ops.GroupedLinear(G, F, K, single_grouped_weight=single, device=device, dtype=dtype),
    )


def _inputs(device, dtype=torch.float32):
    x = torch.randn(ROWS, K, device=device, dtype=dtype, requires_grad=True)
    probs = (torch.rand(ROWS, device=device) + 0.5).to(dtype).requires_grad_()
    return x, probs


def _run(module, x, *extra):
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    extra = [e.detach().requires_grad_() if isinstance(e, torch.Tensor) and e.is_floating_point()
             else e for e in extra]
    y = module(x, *extra)
    torch.manual_seed(7)
    y.backward(torch.randn_like(y))
    grads = [x.grad] + [e.grad for e in extra if isinstance(e, torch.Tensor)
                        and e.is_floating_point()]
    return y.detach(), grads, {n: p.grad for n, p in module.named_parameters()}


# --------------------------------------------------------------------------- container
def test_len_iter_index(device):
    block = _block(device)
    assert len(block) == 3
    mods = list(block)
    assert [type(m) for m in mods] == [te_ops.GroupedLinear, te_ops.ScaledSwiGLU,
                                       te_ops.GroupedLinear]
    assert block[0] is mods[0] and block[-1] is mods[2]
    with pytest.raises(IndexError, match=r"idx must be in \[-3, 3\), got 3"):
        block[3]


def test_slice_returns_sequential_sharing_modules(device):
    block = _block(device)
    head = block[:2]
    assert isinstance(head, te_ops.Sequential) and len(head) == 2
    assert head[0] is block[0] and head[1] is block[1]
    x, probs = _inputs(device)
    ss = split_arg(SIZES, "tensor", device)
    with torch.no_grad():
        h = head(x, ss, probs)
        expected = block[1](block[0](x, ss), probs)
    assert torch.equal(h, expected)


def test_append_extend_insert_pop_setitem_delitem(device):
    block = te_ops.Sequential(te_ops.GroupedLinear(G, K, 2 * F, device=device))
    assert block.num_extra_inputs() == 1
    assert block.append(te_ops.ScaledSwiGLU()) is block
    assert block.num_extra_inputs() == 2
    block.extend([te_ops.GroupedLinear(G, F, K, device=device)])
    assert len(block) == 3 and block.num_extra_inputs() == 3
    x, probs = _inputs(device)
    ss = split_arg(SIZES, "list", device)
    y = block(x, ss, probs, ss)
    assert y.shape == (ROWS, K)

    block.insert(1, te_ops.Identity())
    assert type(block[1]) is te_ops.Identity and len(block) == 4
    torch.testing.assert_close(block(x, ss, probs, ss), y, rtol=0, atol=0)
    popped = block.pop(1)
    assert type(popped) is te_ops.Identity and len(block) == 3
    last = block.pop()
    assert isinstance(last, te_ops.GroupedLinear) and block.num_extra_inputs() == 2

    block[1] = te_ops.SwiGLU()
    assert type(block[1]) is te_ops.SwiGLU and block.num_extra_inputs() == 1
    assert block(x, ss).shape == (ROWS, F)
    del block[1]
    assert len(block) == 1 and block(x, ss).shape == (ROWS, 2 * F)
    assert list(dict(block.named_children())) == ["0"]


def test_add(device):
    a = te_ops.Sequential(te_ops.GroupedLinear(G, K, 2 * F, device=device))
    b = te_ops.Sequential(te_ops.ScaledSwiGLU(), te_ops.GroupedLinear(G, F, K, device=device))
    c = a + b
    assert isinstance(c, te_ops.Sequential) and len(c) == 3 and len(a) == 1 and len(b) == 2
    assert c[0] is a[0] and c[2] is b[1]
    assert len(c.fusers()) == 1 and len(c.fusers()[0].basic_ops) == 3
    with pytest.raises(TypeError, match=r"other must be a te_ops.Sequential, got Identity"):
        a + torch.nn.Identity()


@pytest.mark.parametrize("single", [True, False], ids=["packed", "per_expert"])
def test_state_dict_keys_and_round_trip(device, single):
    block = _block(device, single=single)
    keys = list(block.state_dict())
    if single:
        assert keys == ["0.weight", "0.bias", "2.weight", "2.bias"]
    else:
        assert keys == ([f"0.weight{g}" for g in range(G)] + [f"0.bias{g}" for g in range(G)]
                        + [f"2.weight{g}" for g in range(G)] + [f"2.bias{g}" for g in range(G)])
    other = _block(device, single=single)
    assert not torch.equal(other[0].weights()[0], block[0].weights()[0])
    other.load_state_dict(block.state_dict())
    for (n1, p1), (n2, p2) in zip(block.named_parameters(), other.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    # loading copies in place: per-expert weights stay adjacent slices of one buffer
    for lin in (other[0], other[2]):
        assert stack_weights(lin.weights()).data_ptr() == lin.weights()[0].data_ptr()
    x, probs = _inputs(device)
    ss = split_arg(SIZES, "tensor", device)
    a, b = _run(block, x, ss, probs, ss), _run(other, x, ss, probs, ss)
    assert torch.equal(a[0], b[0])
    for ga, gb in zip(a[1], b[1]):
        assert torch.equal(ga, gb)
    for n in a[2]:
        assert torch.equal(a[2][n], b[2][n])


class _Double(torch.nn.Module):
    """A plain (non-fusible) module: x * 2."""

    def forward(self, x):
        return x * 2


@pytest.mark.parametrize("middle", ["identity", "lambda", "linear"])
def test_plain_module_in_the_middle(device, middle):
    plain = {"identity": torch.nn.Identity(), "lambda": _Double(),
             "linear": torch.nn.Linear(2 * F, 2 * F, device=device)}[middle]
    block = te_ops.Sequential(te_ops.GroupedLinear(G, K, 2 * F, device=device), plain,
                              te_ops.ScaledSwiGLU(), te_ops.GroupedLinear(G, F, K, device=device))
    fusers = block.fusers()
    assert len(fusers) == 2
    assert [type(op) for op in fusers[0].basic_ops] == [te_ops.GroupedLinear]
    assert [type(op) for op in fusers[1].basic_ops] == [te_ops.ScaledSwiGLU, te_ops.GroupedLinear]
    if middle == "linear":
        assert "1.weight" in block.state_dict() and "1.bias" in block.state_dict()

    x, probs = _inputs(device)
    ss = split_arg(SIZES, "list", device)
    y = block(x, ss, probs, ss)
    dy = torch.randn_like(y)
    y.backward(dy)

    def fn(t):
        h = ref.grouped_linear(t["x"], ref.expert_params(t, "0.", "weight", G),
                               ref.expert_params(t, "0.", "bias", G), SIZES)
        if middle == "lambda":
            h = h * 2
        elif middle == "linear":
            h = torch.nn.functional.linear(h, t["1.weight"], t["1.bias"])
        h = ref.scaled_swiglu(h, t["probs"])
        return ref.grouped_linear(h, ref.expert_params(t, "3.", "weight", G),
                                  ref.expert_params(t, "3.", "bias", G), SIZES)

    ref.assert_module_matches_reference(block, fn, x, probs, y, dy, torch.float32)


@pytest.mark.parametrize("kind", ["list", "tensor"])
def test_standalone_op_equals_sequential(device, kind):
    ss = split_arg(SIZES, kind, device)
    x, probs = _inputs(device)
    lin = te_ops.GroupedLinear(G, K, 2 * F, scale_bias=True, device=device)
    alone = _run(lin, x, ss, probs)
    wrapped = _run(te_ops.Sequential(lin), x, ss, probs)
    assert torch.equal(alone[0], wrapped[0])
    for a, b in zip(alone[1], wrapped[1]):
        assert torch.equal(a, b)
    for n in alone[2]:
        assert torch.equal(alone[2][n], wrapped[2]["0." + n])

    act = te_ops.ScaledSwiGLU()
    h = torch.randn(ROWS, 2 * F, device=device)
    alone = _run(act, h, probs)
    wrapped = _run(te_ops.Sequential(act), h, probs)
    assert torch.equal(alone[0], wrapped[0])
    for a, b in zip(alone[1], wrapped[1]):
        assert torch.equal(a, b)


def test_ops_chained_standalone_equal_the_block(device, monkeypatch):
    """Three standalone calls equal the unfused block, bit for bit."""
    monkeypatch.setenv("TE_OPS_FUSION", "0")
    block = _block(device)
    x, probs = _inputs(device)
    ss = split_arg(SIZES, "tensor", device)
    with torch.no_grad():
        chained = block[2](block[1](block[0](x, ss), probs), ss)
        assert torch.equal(block(x, ss, probs, ss), chained)


# --------------------------------------------------------------------------- dtype conversion
@pytest.mark.parametrize("convert", ["to", "double", "half_then_double"])
def test_to_float64_keeps_weights_adjacent(device, convert):
    block = _block(device, single=False)  # per-expert: still slices of one buffer after it
    lin = block[0]
    params_before = list(block.parameters())
    if convert == "to":
        out = block.to(torch.float64)
    elif convert == "double":
        out = block.double()
    else:
        out = block.half().double()
    assert out is block
    assert [p is q for p, q in zip(block.parameters(), params_before)] == [True] * len(
        params_before), "conversion must keep the Parameter objects (optimizers hold them)"
    for m in (block[0], block[2]):
        for params in (m.weights(), m.biases()):
            assert all(p.dtype == torch.float64 for p in params)
            stacked = stack_weights(params)
            assert stacked.data_ptr() == params[0].data_ptr()
            assert stacked._is_view()
            step = params[0].numel() * params[0].element_size()
            assert [p.data_ptr() - params[0].data_ptr() for p in params] == [
                g * step for g in range(len(params))]
            with torch.no_grad():  # a view: writes through
                stacked[1].add_(1.0)
                assert torch.equal(params[1], stacked[1])
                stacked[1].sub_(1.0)
    assert lin.weight0.dtype == torch.float64

    x, probs = _inputs(device, torch.float64)
    ss = split_arg(SIZES, "tensor", device)
    y = block(x, ss, probs, ss)
    dy = torch.randn_like(y)
    y.backward(dy)

    def fn(t):
        return ref.grouped_mlp(t["x"], SIZES, t["probs"],
                               ref.expert_params(t, "0.", "weight", G),
                               ref.expert_params(t, "0.", "bias", G),
                               ref.expert_params(t, "2.", "weight", G),
                               ref.expert_params(t, "2.", "bias", G))

    assert y.dtype == torch.float64
    ref.assert_module_matches_reference(block, fn, x, probs, y, dy, torch.float64)


def test_standalone_grouped_linear_to_float64(device):
    lin = te_ops.GroupedLinear(G, K, F, single_grouped_weight=False, device=device)
    before = [w.detach().clone() for w in lin.weights()]
    lin.to(torch.float64)
    assert stack_weights(lin.weights()).data_ptr() == lin.weight0.data_ptr()
    for w, b in zip(lin.weights(), before):
        assert w.dtype == torch.float64 and torch.equal(w, b.double())
    x = torch.randn(ROWS, K, device=device, dtype=torch.float64)
    y = lin(x, SIZES)
    expected = ref.grouped_linear(x, [w.detach() for w in lin.weights()],
                                  [b.detach() for b in lin.biases()], SIZES)
    assert_close(y, expected, torch.float64, "output")


def test_one_fuser_block_passes_its_inputs_straight_through(monkeypatch):
    """A block that is one fuser over all its ops hands the call's inputs to it unchanged;
    a wrong count still raises the split's error, and an op given a hook afterwards runs
    through the per-op path (its hook runs)."""
    torch.manual_seed(0)
    block = te_ops.Sequential(te_ops.GroupedLinear(2, 4, 6, bias=False), te_ops.ScaledSwiGLU(),
                              te_ops.GroupedLinear(2, 3, 4, bias=False))
    fuser = block.fusers()[0]
    x, probs, split = torch.randn(5, 4), torch.rand(5), torch.tensor([2, 3])
    seen = []
    call = type(fuser).__call__
    monkeypatch.setattr(type(fuser), "__call__",
                        lambda self, *a, **k: seen.append(a) or call(self, *a, **k))
    out = block(x, split, probs, split)
    assert len(seen) == 1 and seen[0][0] is x and seen[0][1:] == (split, probs, split)
    with pytest.raises(ValueError, match="expected 3 extra inputs"):
        block(x, split, probs)
    hooked = []
    block[1].register_forward_hook(lambda *a: hooked.append(1))
    again = block(x, split, probs, split)
    assert hooked == [1] and torch.equal(again, out)
