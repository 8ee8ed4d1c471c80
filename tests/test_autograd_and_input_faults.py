"""Autograd and input edge cases of the op framework, each checked against the right value it
names: second-order gradients, subclasses of basic ops, probs that are views, module hooks
inside ``Sequential``, host reads of the loop backend, plans kept per key, environment
variables, layer conventions and the benchmark's graph peers."""

from __future__ import annotations

import pytest
import reference as ref
import torch

import te_ops
from te_ops.fuser import DOUBLE_BACKWARD_ERROR


# ---------------------------------------------------------------- second-order gradients
def _double_backward_mlp(dtype: torch.dtype):
    torch.manual_seed(0)
    fc1 = te_ops.GroupedLinear(2, 16, 64, bias=False, dtype=dtype)
    fc2 = te_ops.GroupedLinear(2, 32, 16, bias=False, dtype=dtype)
    return fc1, fc2, te_ops.Sequential(fc1, te_ops.ScaledSwiGLU(), fc2)


@pytest.mark.parametrize("fusion", ["0", "1"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_double_backward_is_never_silently_detached(monkeypatch, fusion, dtype):
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    fc1, fc2, blk = _double_backward_mlp(dtype)
    x = torch.randn(6, 16, dtype=dtype, requires_grad=True)
    probs = torch.rand(6, dtype=dtype)
    y = blk(x, [3, 3], probs, [3, 3])
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    assert g.requires_grad  # a detached g would make the penalty's gradient silently zero

    # The first-order value is still right.
    w1 = [ref.leaf(w) for w in fc1.weights()]
    w2 = [ref.leaf(w) for w in fc2.weights()]
    x64 = ref.leaf(x)
    y_ref = ref.grouped_mlp(x64, [3, 3], probs.double(), w1, None, w2, None)
    (g_ref,) = torch.autograd.grad(y_ref.sum(), x64, create_graph=True)
    ref.assert_close(g, g_ref, dtype, "dx")

    # The reported run got a weight-grad norm of 0.029 (the reference: 28.7) with no error;
    # te_ops cannot compute the second-order term, so it raises, naming create_graph.
    with pytest.raises(RuntimeError, match="create_graph=True") as err:
        (y.square().mean() + 10 * g.square().sum()).backward()
    assert DOUBLE_BACKWARD_ERROR in str(err.value)


def test_create_graph_first_order_param_grads_are_right():
    lin = te_ops.GroupedLinear(2, 4, 3, dtype=torch.float64)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    y = lin(x, [2, 3])
    grads = torch.autograd.grad(y.square().sum(), [x, lin.weight], create_graph=True)
    x64, w = ref.leaf(x), [ref.leaf(p) for p in lin.weights()]
    b = [ref.leaf(p) for p in lin.biases()]
    y_ref = ref.grouped_linear(x64, w, b, [2, 3])
    expected = torch.autograd.grad(y_ref.square().sum(), [x64, w[0]])
    for got, exp in zip(grads, expected):
        assert got.requires_grad
        ref.assert_close(got, exp, torch.float64)


# ---------------------------------------------------------------- subclasses of basic ops
class ClampedSwiGLU(te_ops.SwiGLU):
    """SwiGLU with the gate clamped at 1 before SiLU: different math from its base."""

    def op_forward(self, ctx, input_, *, recipe=None):
        a, b = input_.chunk(2, dim=-1)
        a = a.clamp(max=1.0)
        if ctx.requires_grad:
            ctx.save_for_backward(input_)
        return torch.nn.functional.silu(a) * b

    def op_backward(self, ctx, grad_output):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            a, b = x.chunk(2, dim=-1)
            out = torch.nn.functional.silu(a.clamp(max=1.0)) * b
            (dx,) = torch.autograd.grad(out, x, grad_output)
        return dx, []


class LoggedSwiGLU(te_ops.SwiGLU):
    """Same math as SwiGLU; declares so."""

    fuses_as = te_ops.SwiGLU


def _subclass_block(act: te_ops.SwiGLU, dtype=torch.float32):
    fc1 = te_ops.GroupedLinear(1, 4, 8, bias=False, dtype=dtype)
    fc2 = te_ops.GroupedLinear(1, 4, 4, bias=False, dtype=dtype)
    with torch.no_grad():
        fc1.weight.zero_()
        fc1.weight[0, 0, 0] = 3.0
        fc1.weight[0, 4, 0] = 1.0
        fc2.weight[0].copy_(torch.eye(4))
    return te_ops.Sequential(fc1, act, fc2)


@pytest.mark.parametrize("fusion", ["0", "1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_subclass_with_other_math_is_not_fused(monkeypatch, fusion, dtype):
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    blk = _subclass_block(ClampedSwiGLU(), dtype)
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=dtype, requires_grad=True)
    y = blk(x, [1], [1])
    # Right value: SiLU(min(3, 1)) * 1 = SiLU(1) = 0.7311 (the fused base SwiGLU gave 2.8577).
    assert y[0, 0].item() == pytest.approx(0.7311, rel=ref.TOLERANCES[dtype] + 1e-4)
    y.sum().backward()
    # d/dx0 of SiLU(clamp(3 x0, max=1)) * x0 at x0 = 1: the clamp is active, so SiLU(1).
    assert x.grad[0, 0].item() == pytest.approx(0.7311, rel=ref.TOLERANCES[dtype] + 1e-4)
    plan = blk.fusers()[0].plan()
    assert not any(op.is_fused_op for op, _ in plan.forward_ops + plan.backward_ops)
    text = blk.explain()
    if fusion == "1":
        assert "ClampedSwiGLU is a subclass of SwiGLU that does not declare fuses_as" in text


def test_subclass_that_declares_fuses_as_is_fused():
    blk = _subclass_block(LoggedSwiGLU())
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]], requires_grad=True)
    y = blk(x, [1], [1])
    assert y[0, 0].item() == pytest.approx(2.8577, rel=1e-4)  # SiLU(3) * 1: base math
    plan = blk.fusers()[0].plan()
    assert [type(op).__name__ for op, _ in plan.forward_ops] == ["ForwardGroupedMLP"]

    class Again(LoggedSwiGLU):  # the declaration is not inherited
        pass

    blk2 = _subclass_block(Again())
    blk2(x, [1], [1])
    plan2 = blk2.fusers()[0].plan()
    assert not any(op.is_fused_op for op, _ in plan2.forward_ops)


def test_grouped_linear_subclass_is_not_fused():
    class MyLinear(te_ops.GroupedLinear):
        pass

    blk = te_ops.Sequential(MyLinear(1, 4, 8), te_ops.SwiGLU(), te_ops.GroupedLinear(1, 4, 4))
    blk(torch.randn(2, 4, requires_grad=True), [2], [2])
    assert "fc1: MyLinear is a subclass of GroupedLinear" in blk.explain()


# ---------------------------------------------------------------- probs that are views
def _view_leaf(values, dtype=torch.float32):
    """A leaf that is a view (of a base that does not require grad), as in the report."""
    base = torch.tensor([*values, 0.0], dtype=dtype)
    return base[:len(values)].requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_scale_bias_probs_grad_when_probs_is_a_view(dtype):
    lin = te_ops.GroupedLinear(1, 1, 1, bias=True, scale_bias=True, dtype=dtype)
    with torch.no_grad():
        lin.weight.fill_(1.0)
        lin.bias.fill_(3.0)
    x = torch.tensor([[2.0]], dtype=dtype)
    probs = _view_leaf([0.5], dtype)
    assert probs._is_view() and probs.is_leaf
    y = lin(x, [1], probs)
    assert y.item() == 3.5
    y.sum().backward()
    assert probs.grad is not None and probs.grad.tolist() == [3.0]


@pytest.mark.parametrize("strided", [False, True])
def test_probs_grad_follows_callers_tensor_whatever_its_strides(strided):
    lin = te_ops.GroupedLinear(2, 3, 2, scale_bias=True, dtype=torch.float64)
    x = torch.randn(4, 3, dtype=torch.float64)
    if strided:  # a non-contiguous leaf (stride 2)
        probs = torch.rand(8, dtype=torch.float64)[::2].requires_grad_()
    else:
        probs = torch.rand(2, 4, dtype=torch.float64)[1].requires_grad_()
    y = lin(x, [1, 3], probs)
    dy = torch.randn_like(y)
    y.backward(dy)
    p64 = ref.leaf(probs)
    w = [ref.leaf(p) for p in lin.weights()]
    b = [ref.leaf(p) for p in lin.biases()]
    y_ref = ref.grouped_linear(x, w, b, [1, 3], p64)
    (g_ref,) = torch.autograd.grad(y_ref, p64, dy)
    ref.assert_close(probs.grad, g_ref, torch.float64, "probs.grad")


@pytest.mark.parametrize("fusion", ["0", "1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mlp_dprobs_with_shared_view_probs(monkeypatch, fusion, dtype):
    """probs feeds ScaledSwiGLU and fc2's scale_bias: dprobs = SiLU(1) + 3 = 3.7311."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    fc1 = te_ops.GroupedLinear(1, 1, 2, bias=False, dtype=dtype)
    fc2 = te_ops.GroupedLinear(1, 1, 1, bias=True, scale_bias=True, dtype=dtype)
    with torch.no_grad():
        fc1.weight.fill_(1.0)  # h = [1, 1]: a = 1, b = 1
        fc2.weight.fill_(1.0)
        fc2.bias.fill_(3.0)
    blk = te_ops.Sequential(fc1, te_ops.ScaledSwiGLU(), fc2)
    x = torch.tensor([[1.0]], dtype=dtype)
    probs = _view_leaf([0.5], dtype)
    y = blk(x, [1], probs, [1], probs)
    y.sum().backward()
    assert probs.grad.item() == pytest.approx(3.7311, abs=1e-4)


# ---------------------------------------------------------------- hooks inside Sequential
def _hook_block(dtype=torch.float32):
    torch.manual_seed(0)
    return te_ops.Sequential(te_ops.GroupedLinear(2, 4, 8, dtype=dtype), te_ops.ScaledSwiGLU(),
                             te_ops.GroupedLinear(2, 4, 4, dtype=dtype))


@pytest.mark.parametrize("fusion", ["0", "1"])
@pytest.mark.parametrize("where", [0, 1, 2])
def test_forward_hook_runs_and_its_replacement_output_is_used(monkeypatch, fusion, where):
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    blk = _hook_block()
    x = torch.randn(5, 4, requires_grad=True)
    probs = torch.rand(5)
    sizes = torch.tensor([2, 3])
    y0 = blk(x, sizes, probs, sizes)  # fused plan cached before the hook is added
    calls = []

    def hook(module, args, output):
        calls.append(type(module).__name__)
        return output * 2

    handle = blk[where].register_forward_hook(hook)
    y = blk(x, sizes, probs, sizes)
    assert len(calls) == 1
    if where == 2:
        torch.testing.assert_close(y, 2 * y0)
    else:  # doubled inside the chain: the output changes, and matches a manual rerun
        assert not torch.allclose(y, y0)
    y.sum().backward()
    assert x.grad is not None
    text = blk.explain()
    assert "has module hooks: it runs alone, unfused" in text
    assert "ForwardGroupedMLP" not in text

    handle.remove()  # fused again once the hook is gone
    y1 = blk(x, sizes, probs, sizes)
    torch.testing.assert_close(y1, y0)
    if fusion == "1":
        assert "ForwardGroupedMLP" in blk.explain()


def test_pre_hook_and_backward_hook_run():
    blk = _hook_block()
    seen = []
    blk[0].register_forward_pre_hook(lambda m, args: (args[0] * 0, *args[1:]))
    blk[2].register_full_backward_hook(lambda m, gin, gout: seen.append(gout[0].shape))
    x = torch.randn(5, 4, requires_grad=True)
    probs = torch.rand(5)
    y = blk(x, [2, 3], probs, [2, 3])
    # fc1 sees zeros: its output is its bias, so y does not depend on x
    y.sum().backward()
    assert seen == [torch.Size([5, 4])]
    assert torch.count_nonzero(x.grad) == 0


# ---------------------------------------------------------------- loop backend host reads
@pytest.mark.parametrize("fusion", ["0", "1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loop_backend_reads_device_split_sizes_once_per_block(monkeypatch, fusion, dtype):
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "loop")
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    torch.manual_seed(0)
    blk = te_ops.Sequential(te_ops.GroupedLinear(2, 6, 12, dtype=dtype), te_ops.ScaledSwiGLU(),
                            te_ops.GroupedLinear(2, 6, 6, dtype=dtype))
    x = torch.randn(5, 6, dtype=dtype, requires_grad=True)
    probs = torch.rand(5, dtype=dtype, requires_grad=True)
    sizes = torch.tensor([2, 3])
    reads = []
    tolist = torch.Tensor.tolist

    def counting_tolist(self):
        reads.append(tuple(self.shape))
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    y = blk(x, sizes, probs, sizes)
    y.sum().backward()
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    assert reads == [(2,)]  # was 6 (one per GEMM)

    # Same values as the reference.
    w1, b1 = [ref.leaf(p) for p in blk[0].weights()], [ref.leaf(p) for p in blk[0].biases()]
    w2, b2 = [ref.leaf(p) for p in blk[2].weights()], [ref.leaf(p) for p in blk[2].biases()]
    y_ref = ref.grouped_mlp(ref.leaf(x), [2, 3], ref.leaf(probs), w1, b1, w2, b2)
    ref.assert_close(y, y_ref, dtype, "y")


def test_two_split_tensors_are_read_once_each(monkeypatch):
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "loop")
    lin1, lin2 = te_ops.GroupedLinear(2, 4, 4), te_ops.GroupedLinear(2, 4, 4)
    blk = te_ops.Sequential(lin1, lin2)
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or tolist(t))
    x = torch.randn(5, 4, requires_grad=True)
    blk(x, torch.tensor([2, 3]), torch.tensor([4, 1])).sum().backward()
    assert len(reads) == 2


# ---------------------------------------------------------------- plans kept per key
def test_alternating_train_and_no_grad_eval_plans_twice(monkeypatch):
    from te_ops import fuser as fuser_mod

    calls = []
    real = fuser_mod.OperationFuser._make_plan
    monkeypatch.setattr(fuser_mod.OperationFuser, "_make_plan",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    blk = _hook_block()
    x = torch.randn(5, 4)
    probs = torch.rand(5)
    sizes = torch.tensor([2, 3])
    for _ in range(5):
        blk(x, sizes, probs, sizes).sum().backward()
        with torch.no_grad():
            blk(x, sizes, probs, sizes)
    assert len(calls) == 2  # was 10: one per call
    # explain(sample) plans without replacing the last call's plan
    last = blk.fusers()[0]._plan
    assert last.info.requires_grad == [False, False, False]
    blk.explain(x, sizes, probs, sizes)  # planned for grad: not the last call's key
    assert blk.fusers()[0]._plan is last


def test_plan_cache_is_bounded(monkeypatch):
    from te_ops import fuser as fuser_mod

    monkeypatch.setattr(fuser_mod, "MAX_CACHED_PLANS", 2)
    lin = te_ops.GroupedLinear(2, 4, 4)
    x = torch.randn(3, 4)
    lin(x, [1, 2])
    with torch.no_grad():
        lin(x, [1, 2])
    lin(x, torch.tensor([1, 2]))
    fuser = lin.__dict__["_standalone_fuser"]
    assert len(fuser._plans) == 2
    assert [p.info.requires_grad for p in fuser._plans.values()] == [[False], [True]]


# ---------------------------------------------------------------- env variables
def test_example_variable_is_not_a_library_variable(monkeypatch):
    from te_ops import env

    assert "TE_OPS_EXAMPLE_PROGRESS" not in env.ENV_VARS
    monkeypatch.setattr(env, "_WARNED", set())
    monkeypatch.setenv("TE_OPS_EXAMPLE_PROGRESS", "no")  # unknown to te_ops: a warning, no error
    monkeypatch.setenv("TRAIN_MOE_PROGRESS", "no")  # the example's own: te_ops ignores it
    lin = te_ops.GroupedLinear(1, 2, 2)
    with pytest.warns(UserWarning, match="TE_OPS_EXAMPLE_PROGRESS is not a te_ops variable"):
        y = lin(torch.randn(2, 2), [2])
    assert y.shape == (2, 2)
    text = te_ops.ir.explain(lin)
    assert "PROGRESS" not in text and "env: defaults" in text


def test_example_progress_variable_is_checked_by_the_example(monkeypatch):
    from te_ops.examples import train_moe

    monkeypatch.setenv("TRAIN_MOE_PROGRESS", "0")
    assert train_moe.show_progress() is False
    monkeypatch.setenv("TRAIN_MOE_PROGRESS", "no")
    with pytest.raises(ValueError, match="TRAIN_MOE_PROGRESS"):
        train_moe.show_progress()


@pytest.mark.parametrize("name,closest", [
    ("TE_OPS_FUSION_OF", "TE_OPS_FUSION_OFF"),
    ("TE_OPS_FUSIONS", "TE_OPS_FUSION"),
    # any case or spacing of "TE_OPS" counts, matched to the
    # closest name ignoring case (before: no warning, or one naming no variable)
    ("TE_OPS_graph_safe", "TE_OPS_GRAPH_SAFE"),
    ("te_ops_fusion", "TE_OPS_FUSION"),
    ("TE_OPSFUSION", "TE_OPS_FUSION"),
    ("TeOps_Graph_Safe", "TE_OPS_GRAPH_SAFE"),
    ("TE_OPS_FUSON", "TE_OPS_FUSION"),
])
def test_misspelled_variable_warns_with_closest_name(monkeypatch, name, closest):
    from te_ops import env

    monkeypatch.setattr(env, "_WARNED", set())
    monkeypatch.setenv(name, "0")
    lin = te_ops.GroupedLinear(1, 2, 2)
    with pytest.warns(UserWarning, match=f"{name} is not a te_ops variable.*did you mean "
                                         f"{closest}\\?"):
        lin(torch.randn(2, 2), [2])


# ---------------------------------------------------------------- conventions
@pytest.mark.parametrize("single", [False, True])
def test_no_bias_attributes_are_none_and_flag_is_public(single):
    lin = te_ops.GroupedLinear(3, 4, 5, bias=False, single_grouped_weight=single)
    names = ["bias"] if single else ["bias0", "bias1", "bias2"]
    for n in names:
        assert getattr(lin, n) is None
    assert lin.use_bias is False and lin.has_bias is False
    assert not any("bias" in k for k in lin.state_dict())
    y = lin(torch.randn(4, 4), [1, 2, 1])
    assert y.shape == (4, 5)
    with_bias = te_ops.GroupedLinear(3, 4, 5, single_grouped_weight=single)
    assert with_bias.use_bias is True
    # biases follow torch.nn.Linear's init (documented in reset_parameters), not TE's zeros
    bound = 1 / 4 ** 0.5
    assert all(b.abs().max() <= bound and torch.count_nonzero(b) for b in with_bias.biases())


@pytest.mark.parametrize("cls", [te_ops.SwiGLU, te_ops.ScaledSwiGLU])
def test_interleave_positional_and_zero_means_halves(cls):
    assert cls(32).glu_interleave_size == 32
    assert cls(0).glu_interleave_size is None
    assert cls(glu_interleave_size=None).glu_interleave_size is None


@pytest.mark.parametrize("src_single,dst_single", [(False, True), (True, False)])
@pytest.mark.parametrize("bias", [True, False])
def test_load_state_dict_of_the_other_weight_layout(src_single, dst_single, bias):
    torch.manual_seed(0)
    src = te_ops.GroupedLinear(3, 4, 5, bias=bias, single_grouped_weight=src_single)
    with torch.no_grad():
        for b in src.biases():
            b.normal_()
    dst = te_ops.GroupedLinear(3, 4, 5, bias=bias, single_grouped_weight=dst_single)
    dst.load_state_dict(src.state_dict())  # strict
    x = torch.randn(6, 4)
    torch.testing.assert_close(dst(x, [2, 3, 1]), src(x, [2, 3, 1]), rtol=0, atol=0)
    # inside a Sequential (prefixed keys), with strict=False
    seq_src = te_ops.Sequential(src)
    seq_dst = te_ops.Sequential(te_ops.GroupedLinear(3, 4, 5, bias=bias,
                                                     single_grouped_weight=dst_single))
    result = seq_dst.load_state_dict(seq_src.state_dict(), strict=False)
    assert not result.missing_keys and not result.unexpected_keys
    torch.testing.assert_close(seq_dst(x, [2, 3, 1]), src(x, [2, 3, 1]), rtol=0, atol=0)


def test_load_state_dict_strict_false_that_loads_nothing_warns():
    lin = te_ops.GroupedLinear(2, 4, 4)
    wrong = {"weight_a": torch.zeros(4, 4), "bias_b": torch.zeros(4)}
    with pytest.warns(UserWarning, match="loaded nothing"):
        lin.load_state_dict(wrong, strict=False)


@pytest.mark.parametrize("fusion", ["0", "1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_split_sizes_as_histc_counts(monkeypatch, fusion, dtype):
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    blk = _hook_block(dtype)
    expert_ids = torch.tensor([0, 1, 1, 0, 1])
    counts = torch.histc(expert_ids.float(), bins=2, min=0, max=1)  # float32, as torchtitan
    x = torch.randn(5, 4, dtype=dtype)
    order = torch.argsort(expert_ids, stable=True)
    probs = torch.rand(5, dtype=dtype)
    y = blk(x[order], counts, probs, counts)
    y_int = blk(x[order], torch.tensor([2, 3]), probs, torch.tensor([2, 3]))
    torch.testing.assert_close(y, y_int, rtol=0, atol=0)


def test_sequential_takes_an_ordered_dict_of_named_ops():
    from collections import OrderedDict

    torch.manual_seed(0)
    named = te_ops.Sequential(OrderedDict([
        ("fc1", te_ops.GroupedLinear(2, 4, 8)), ("act", te_ops.ScaledSwiGLU()),
        ("fc2", te_ops.GroupedLinear(2, 4, 4))]))
    assert list(dict(named.named_children())) == ["fc1", "act", "fc2"]
    assert "fc1.weight" in named.state_dict() and "fc2.bias" in named.state_dict()
    plain = te_ops.Sequential(*[te_ops.GroupedLinear(2, 4, 8), te_ops.ScaledSwiGLU(),
                                te_ops.GroupedLinear(2, 4, 4)])
    plain.load_state_dict({k.replace("fc1", "0").replace("fc2", "2"): v
                           for k, v in named.state_dict().items()})
    x, probs, sizes = torch.randn(5, 4), torch.rand(5), torch.tensor([2, 3])
    torch.testing.assert_close(named(x, sizes, probs, sizes), plain(x, sizes, probs, sizes))
    assert "fc1" in named.explain() and "fc2" in named.explain()
    assert list(dict(named[1:].named_children())) == ["act", "fc2"]  # slices keep names
    named.append(te_ops.Identity())
    assert list(dict(named.named_children())) == ["fc1", "act", "fc2", "3"]


def test_autocast_raises_naming_autocast():
    blk = _hook_block()
    x, probs, sizes = torch.randn(5, 4), torch.rand(5), torch.tensor([2, 3])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match=r"te_ops ops do not follow torch.autocast: "
                                               r"autocast to torch.bfloat16"):
            blk(x, sizes, probs, sizes)
        # the fix the message names: one dtype for block and input
        y = blk.to(torch.bfloat16)(x.to(torch.bfloat16), sizes, probs.bfloat16(), sizes)
    assert y.dtype == torch.bfloat16
    with torch.autocast("cpu", enabled=False):
        blk.float()(x, sizes, probs, sizes)


def test_dtype_mismatch_says_which_dtype_to_cast_to():
    lin = te_ops.GroupedLinear(1, 4, 4)
    with pytest.raises(ValueError, match=r"x.to\(torch.float32\)"):
        lin(torch.randn(2, 4, dtype=torch.bfloat16), [2])


def test_equal_split_tensors_as_two_objects_warn_once():
    import warnings

    blk = _hook_block()
    x, probs, sizes = torch.randn(5, 4), torch.rand(5), torch.tensor([2, 3])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            blk(x, sizes, probs, sizes.clone()).sum().backward()
    texts = [str(w.message) for w in caught if "two different tensor objects" in str(w.message)]
    assert len(texts) == 1 and "pass the same tensor object" in texts[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        blk(x, sizes, probs, sizes)  # the fix: no warning, fused
    assert "ForwardGroupedMLP" in blk.explain()


def test_python_m_te_ops_env_runs_without_runtime_warning():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "te_ops.env"],
                         cwd=root, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(root), "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert "RuntimeWarning" not in out.stderr
    assert out.stdout.startswith("| variable | default | values | meaning |")


# ---------------------------------------------------------------- benchmarks
def test_every_graph_peer_is_skipped_on_cpu():
    import importlib.util
    import sys
    import types
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "grouped_mlp.py"
    spec = importlib.util.spec_from_file_location("bench_grouped_mlp", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(path.parent))
        del sys.modules[spec.name]
    problem = types.SimpleNamespace(device=torch.device("cpu"))
    graph_peers = [n for n in bench.PEER_CLASSES if "graph" in n]
    assert "te_ops_graph" in graph_peers
    for name in graph_peers:
        assert bench.skip_reason(name, problem) == ("CUDA graphs need a CUDA device (running "
                                                    "with --device cpu)"), name
    assert bench.skip_reason("te_ops", problem) is None


# ---------------------------------------------------------------- seams
def test_import_te_ops_does_not_import_networkx():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("import sys, te_ops; assert 'networkx' not in sys.modules, 'networkx imported'; "
            "te_ops.ir.build_graph(te_ops.Sequential(te_ops.SwiGLU())); "
            "assert 'networkx' in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, timeout=120, env={"PYTHONPATH": str(root), "PATH": ""})
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("fusion", ["0", "1"])
def test_dispatch_decisions_are_made_once_and_reported_as_run(monkeypatch, fusion):
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    blk = _hook_block()
    x = torch.randn(5, 4, requires_grad=True)
    probs, sizes = torch.rand(5), torch.tensor([2, 3])
    y = blk(x, sizes, probs, sizes)
    # Changing the toggles between forward and backward does not change the kernels: the
    # backward reads the forward's saved choices (re-choosing here would raise on CPU).
    monkeypatch.setenv("TE_OPS_ACTIVATION_BACKEND", "triton")
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "loop")
    y.sum().backward()
    monkeypatch.delenv("TE_OPS_ACTIVATION_BACKEND")
    monkeypatch.delenv("TE_OPS_GROUPED_GEMM_BACKEND")
    text = blk.explain()
    from te_ops.kernels import swiglu_triton

    why = swiglu_triton.unsupported_reason(torch.empty(2, 8), None)
    assert f"activation backend: torch ({why})" in text
    assert "grouped GEMM backend: grouped_mm" in text
    from te_ops.splits import GroupedSplits

    assert not hasattr(GroupedSplits, "graph_safe") and GroupedSplits.on_device


def test_one_call_signature_object_per_fuser_and_container():
    from te_ops.signature import CallSignature, Slot

    blk = te_ops.Sequential(te_ops.GroupedLinear(2, 4, 8), te_ops.ScaledSwiGLU(),
                            te_ops.GroupedLinear(2, 4, 4, scale_bias=True))
    sig = blk.signature()
    assert isinstance(sig, CallSignature) and sig.total == 4 == blk.num_extra_inputs()
    assert sig.slots == [Slot(0, 0, 0, "split_sizes"), Slot(1, 1, 0, "probs"),
                         Slot(2, 2, 0, "split_sizes"), Slot(3, 2, 1, "probs")]
    sizes, probs = torch.tensor([2, 3]), torch.rand(5)
    assert sig.source_classes([sizes, probs, sizes, probs]) == (0, 1, 0, 1)
    assert sig.source_classes([[2, 3], probs, [2, 3], probs.clone()]) == (0, 1, 0, 3)
    assert blk.fusers()[0].signature.counts == [1, 1, 2]
    with pytest.raises(ValueError, match=r"extra_inputs: expected 4 extra inputs after the main "
                                         r"input \(GroupedLinear:1, ScaledSwiGLU:1, "
                                         r"GroupedLinear:2\), got 1"):
        blk(torch.randn(5, 4), sizes)


def test_fusions_are_one_ordered_list():
    from te_ops.fused import FUSIONS
    from te_ops.fuser import registered_fusions

    names = [name for _, _, name in FUSIONS]
    assert [f.name for f in registered_fusions() if f.name in names] == names


@pytest.mark.parametrize("fusion", ["0", "1"])
def test_split_metadata_is_saved_once_per_op(monkeypatch, fusion):
    """Each GroupedLinear context saves the caller's split-size tensor once (not a second time
    through the input's storage or base_offsets)."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    from te_ops.op import OperationContext

    per_ctx = []
    real = OperationContext.save_for_backward

    def spy(self, *tensors):
        per_ctx.append(tensors)
        real(self, *tensors)

    monkeypatch.setattr(OperationContext, "save_for_backward", spy)
    blk = _hook_block()
    x = torch.randn(5, 4, requires_grad=True)
    sizes, probs = torch.tensor([2, 3]), torch.rand(5)
    y = blk(x, sizes, probs, sizes)
    linear_ctxs = [t for t in per_ctx if any(v is sizes for v in t)]
    assert len(linear_ctxs) == 2  # fc1 and fc2
    for tensors in linear_ctxs:
        ids = [id(v) for v in tensors if v is not None]
        assert len(ids) == len(set(ids)), "a tensor saved twice by one op"
    y.sum().backward()  # the storage gets its split metadata back from the splits
    w = [ref.leaf(p) for p in blk[0].weights()]
    b = [ref.leaf(p) for p in blk[0].biases()]
    x64 = ref.leaf(x)
    h = ref.grouped_linear(x64, w, b, [2, 3])
    w2 = [ref.leaf(p) for p in blk[2].weights()]
    b2 = [ref.leaf(p) for p in blk[2].biases()]
    y_ref = ref.grouped_linear(ref.scaled_swiglu(h, probs.double()), w2, b2, [2, 3])
    (g_ref,) = torch.autograd.grad(y_ref.sum(), x64)
    ref.assert_close(x.grad, g_ref, torch.float32, "dx")


def test_explain_and_to_dot_take_the_same_arguments_and_keep_the_plan():
    blk = _hook_block()
    x, probs, sizes = torch.randn(5, 4), torch.rand(5), torch.tensor([2, 3])
    blk(x, sizes, probs, sizes)
    last = blk.fusers()[0]._plan
    with pytest.warns(UserWarning, match="two different tensor objects"):
        text = blk.explain(x, sizes, probs, sizes.clone())
        dot = blk.to_dot(x, sizes, probs, sizes.clone())
    assert "fc1 and fc2 split sizes are not the same source" in text
    assert "cluster_fuser0_fwd0" not in dot  # planned unfused for that sample
    assert blk.fusers()[0]._plan is last  # the cached plan of the last call is kept
    assert "cluster_fuser0_fwd0" in blk.to_dot()  # the last call's plan: fused
    assert "fewer than 3 ops" not in te_ops.Sequential(te_ops.GroupedLinear(1, 2, 2)).explain()
