"""``is_first_microbatch``: quantized weights kept across the micro-batches of one optimizer
step (te_ops/quantization/weight_cache.py). The oracle is the same block run without the flag
(each call quantizes the weights): a cached step must equal it bit for bit, and must not
quantize a weight."""

from __future__ import annotations

import pytest
import torch
from fusion_env import set_grouped_mlp

import te_ops
import te_ops.basic.grouped_linear as grouped_linear

E, H, F = 4, 64, 32
SIZES = torch.tensor([5, 0, 7, 4])
RECIPES = {
    "fp8": te_ops.recipe.Float8CurrentScaling(),
    "fp8fast": te_ops.recipe.Float8CurrentScaling(fast_accumulate_backward=True),
    "mxfp8": te_ops.recipe.MXFP8BlockScaling(),
    "block": te_ops.recipe.Float8BlockScaling(),
}


def make_block(single: bool = True) -> te_ops.Sequential:
    torch.manual_seed(1)
    return te_ops.Sequential(
        te_ops.GroupedLinear(E, H, 2 * F, bias=False, single_grouped_weight=single),
        te_ops.ScaledSwiGLU(),
        te_ops.GroupedLinear(E, F, H, bias=False, single_grouped_weight=single))


@pytest.fixture
def weight_quantizes(monkeypatch):
    """The (rowwise, columnwise) flags of every weight quantize the ops ask a recipe for."""
    calls = []
    orig = grouped_linear.quantize_operand

    def counting(recipe, role, tensor, *args, **kwargs):
        if role == "weight" and recipe is not None:
            calls.append((bool(kwargs.get("rowwise")), bool(kwargs.get("columnwise"))))
        return orig(recipe, role, tensor, *args, **kwargs)

    monkeypatch.setattr(grouped_linear, "quantize_operand", counting)
    return calls


def step(block, recipe, flag="unset", seed=0):
    """One micro-batch fwd+bwd: output, input grad and weight grads."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(16, H, generator=gen, requires_grad=True)
    probs = torch.rand(16, generator=gen)
    for p in block.parameters():
        p.grad = None
    kwargs = {} if flag == "unset" else {"is_first_microbatch": flag}
    with te_ops.autocast(enabled=recipe is not None, recipe=recipe):
        y = block(x, SIZES, probs, SIZES, **kwargs)
    y.square().sum().backward()
    return [y.detach(), x.grad, *(p.grad for p in block.parameters())]


def assert_bitwise(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("single", [True, False], ids=["packed", "per_expert"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_later_microbatches_quantize_no_weight_and_equal_uncached_bitwise(
        name, fused, single, monkeypatch, weight_quantizes):
    set_grouped_mlp(monkeypatch, fused, fused)
    recipe = RECIPES[name]
    plain, cached = make_block(single), make_block(single)
    for seed, flag in enumerate([True, False, False]):
        want = step(plain, recipe, seed=seed)
        weight_quantizes.clear()
        got = step(cached, recipe, flag, seed=seed)
        assert_bitwise(got, want)
        if flag:  # fprop and dgrad copies of both layers, as without the flag
            assert sorted(weight_quantizes) == [(False, True)] * 2 + [(True, False)] * 2
        else:
            assert weight_quantizes == []


def test_true_after_an_optimizer_step_quantizes_the_new_weights(weight_quantizes):
    recipe = RECIPES["fp8"]
    plain, cached = make_block(), make_block()
    opts = [torch.optim.SGD(b.parameters(), lr=0.1) for b in (plain, cached)]
    for flag in (True, False):
        step(plain, recipe)
        step(cached, recipe, flag)
    for opt in opts:
        opt.step()
    want = step(plain, recipe, seed=3)
    weight_quantizes.clear()
    assert_bitwise(step(cached, recipe, True, seed=3), want)
    assert len(weight_quantizes) == 4
    assert_bitwise(step(cached, recipe, False, seed=4), step(plain, recipe, seed=4))


def test_false_after_an_in_place_update_raises_and_names_the_fix():
    block = make_block()
    step(block, RECIPES["fp8"], True)
    torch.optim.SGD(block.parameters(), lr=0.1).step()
    with pytest.raises(RuntimeError, match=r"is_first_microbatch=False.*written in place.*"
                                           r"version .* -> .*is_first_microbatch=True"):
        step(block, RECIPES["fp8"], False)


def _new_parameter(block):
    fc1 = block[0]
    fc1.weight = torch.nn.Parameter(fc1.weight.detach().clone())


def _assign_load(block):
    block.load_state_dict({k: v.clone() for k, v in block.state_dict().items()}, assign=True)


def _data_assigned(block):
    block[0].weight.data = block[0].weight.detach().clone()


@pytest.mark.parametrize("change, why", [
    (_new_parameter, "is another tensor object"),
    (_assign_load, "is another tensor object"),
    (_data_assigned, "moved to other memory"),
    (lambda b: b.load_state_dict(b.state_dict()), "was written in place"),
], ids=["new_parameter", "load_assign", "data_assigned", "load_copy"])
def test_false_after_the_weights_were_replaced_raises_naming_the_weight(change, why):
    block = make_block()
    step(block, RECIPES["fp8"], True)
    change(block)
    with pytest.raises(RuntimeError, match=r"GroupedLinear.*its weight " + why):
        step(block, RECIPES["fp8"], False)


def test_false_with_computed_weights_raises():
    class Scaled(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    block = make_block()
    torch.nn.utils.parametrize.register_parametrization(block[0], "weight", Scaled())
    step(block, RECIPES["fp8"], True)
    with pytest.raises(RuntimeError, match="its weight is another tensor object"):
        step(block, RECIPES["fp8"], False)


@pytest.mark.parametrize("copy_kind", ["deepcopy", "pickle"])
def test_a_copy_does_not_take_the_cache(copy_kind):
    import copy
    import pickle

    block = make_block()
    step(block, RECIPES["fp8"], True)
    clone = (copy.deepcopy(block) if copy_kind == "deepcopy"
             else pickle.loads(pickle.dumps(block)))
    with pytest.raises(RuntimeError, match="no quantized weights are cached"):
        step(clone, RECIPES["fp8"], False)
    assert_bitwise(step(clone, RECIPES["fp8"], True), step(block, RECIPES["fp8"], False))


def test_false_without_a_cache_raises():
    with pytest.raises(RuntimeError, match="no quantized weights are cached"):
        step(make_block(), RECIPES["fp8"], False)


def test_false_under_another_recipe_raises():
    block = make_block()
    step(block, RECIPES["fp8"], True)
    with pytest.raises(RuntimeError, match="recipe or the weights' shapes"):
        step(block, RECIPES["mxfp8"], False)


@pytest.mark.parametrize("bad", [1, 0, "True", torch.tensor(True)])
def test_flag_of_another_type_raises_naming_it(bad):
    with pytest.raises(TypeError, match=r"is_first_microbatch must be None, True or False, "
                                        r"got " + type(bad).__name__):
        step(make_block(), RECIPES["fp8"], bad)


def test_flag_without_a_recipe_changes_nothing(weight_quantizes):
    plain, flagged = make_block(), make_block()
    for seed, flag in enumerate([True, False]):
        assert_bitwise(step(flagged, None, flag, seed=seed), step(plain, None, seed=seed))
    assert weight_quantizes == []


def test_unflagged_call_neither_uses_nor_drops_the_cache(weight_quantizes):
    recipe = RECIPES["fp8"]
    block = make_block()
    step(block, recipe, True)
    weight_quantizes.clear()
    step(block, recipe)  # e.g. an evaluation call in between
    assert len(weight_quantizes) == 4
    weight_quantizes.clear()
    step(block, recipe, False)
    assert weight_quantizes == []


def test_under_activation_checkpointing_dgrads_copy_is_made_once(weight_quantizes):
    recipe = RECIPES["fp8"]
    plain, block = make_block(), make_block()
    counts = []
    for seed, flag in enumerate([True, False, False]):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(16, H, generator=gen, requires_grad=True)
        probs = torch.rand(16, generator=gen)
        weight_quantizes.clear()
        with te_ops.autocast(recipe=recipe):
            y = te_ops.checkpoint(block, x, SIZES, probs, SIZES, is_first_microbatch=flag)
        y.square().sum().backward()
        counts.append(sorted(weight_quantizes))
        got = [y.detach(), x.grad, *(p.grad for p in block.parameters())]
        for p in block.parameters():
            p.grad = None
        assert_bitwise(got, step(plain, recipe, seed=seed))
    # the first: fprop's copies in the forward and again in the recompute, dgrad's once
    assert counts == [[(False, True)] * 2 + [(True, False)] * 4, [], []]


def test_standalone_op_takes_the_flag(weight_quantizes):
    torch.manual_seed(2)
    op = te_ops.GroupedLinear(E, H, F, bias=False)
    x = torch.randn(16, H)
    with te_ops.autocast(recipe=RECIPES["fp8"]):
        want = op(x, SIZES)
        op(x, SIZES, is_first_microbatch=True)
        weight_quantizes.clear()
        got = op(x, SIZES, is_first_microbatch=False)
    assert torch.equal(got, want)
    assert weight_quantizes == []


def test_moe_layer_takes_the_flag_for_routed_and_shared_experts(weight_quantizes):
    def layer():
        torch.manual_seed(3)
        return te_ops.MoE(H, F, E, 2, shared_ffn_hidden_size=F)

    plain, cached = layer(), layer()
    x = torch.randn(12, H)
    with te_ops.autocast(recipe=RECIPES["fp8"]):
        want = plain(x)[0]
        weight_quantizes.clear()
        first = cached(x, is_first_microbatch=True)[0]
        n_first = len(weight_quantizes)
        weight_quantizes.clear()
        second = cached(x, is_first_microbatch=False)[0]
    assert torch.equal(first, want) and torch.equal(second, want)
    assert n_first == 4 and weight_quantizes == []  # fc1 and fc2, routed and shared


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_flag_under_torch_compile_without_fullgraph_runs_the_call_eagerly(backend,
                                                                          weight_quantizes):
    recipe = RECIPES["fp8"]
    plain, block = make_block(), make_block()
    moe = te_ops.MoE(H, F, E, 2)
    x = torch.randn(16, H)
    probs = torch.rand(16)
    torch._dynamo.reset()

    @torch.compile(backend=backend)
    def run(x, flag):
        return block(x, SIZES, probs, SIZES, is_first_microbatch=flag) * 2

    @torch.compile(backend=backend)
    def run_moe(x, flag):
        return moe(x, is_first_microbatch=flag)[0] * 2

    with te_ops.autocast(recipe=recipe):
        with pytest.raises(RuntimeError, match="no quantized weights are cached"):
            run_moe(x, False)  # the check runs: the flag is not dropped by the trace
        want = plain(x, SIZES, probs, SIZES) * 2
        weight_quantizes.clear()
        run(x, True)
        assert len(weight_quantizes) == 2  # fprop's copies, made eagerly
        weight_quantizes.clear()
        got = run(x, False)
    assert torch.equal(got, want)
    assert weight_quantizes == []


def test_flag_under_torch_compile_fullgraph_raises():
    block = make_block()
    x = torch.randn(16, H)
    probs = torch.rand(16)

    @torch.compile(fullgraph=True, backend="eager")
    def run(x):
        return block(x, SIZES, probs, SIZES, is_first_microbatch=True)

    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported,
                       match="is_first_microbatch is an eager feature"):
        run(x)


def test_flag_during_cuda_graph_capture_raises(monkeypatch):
    # No GPU here: the capture state is what the check reads.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="during CUDA graph capture.*is_first_microbatch=None"):
        step(make_block(), RECIPES["fp8"], False)
