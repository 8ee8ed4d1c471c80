"""CPU checks of training-loop integration and input validation: missing probs, checkpoints
of another layout or expert count, module surgery, torch.func transforms, in-place changes
before ``backward_dw``, training flags; values against the independent fp64 reference."""

from __future__ import annotations

import pytest
import reference as ref
import torch

import te_ops

E, H, FF = 4, 16, 24


def _block(scale_bias: bool = False) -> te_ops.Sequential:
    torch.manual_seed(0)
    return te_ops.Sequential(
        te_ops.GroupedLinear(E, H, 2 * FF, scale_bias=scale_bias), te_ops.ScaledSwiGLU(),
        te_ops.GroupedLinear(E, FF, H, scale_bias=scale_bias))


@pytest.mark.parametrize("fusion", ["0", "1"])
@pytest.mark.parametrize("kind", ["list", "tensor"])
@pytest.mark.parametrize("missing, scale_bias, name", [
    (1, False, "probs"), (0, True, "fc1 probs"), (1, True, "probs"), (2, True, "fc2 probs")])
def test_missing_probs_is_an_error_on_the_fused_path_too(monkeypatch, fusion, kind, missing,
                                                         scale_bias, name):
    """``probs=None`` for a ScaledSwiGLU (or a ``scale_bias`` GroupedLinear) raises on the
    fused path as on the unfused one, instead of running an unscaled SwiGLU (scale 1): a
    forgotten router weight would give a silently wrong output."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = _block(scale_bias)
    split = ref.split_arg([3, 0, 5, 4], kind, "cpu")
    x = torch.randn(12, H)
    probs = [torch.rand(12) for _ in range(3 if scale_bias else 1)]
    probs[missing if scale_bias else 0] = None
    args = (split, probs[0], probs[1], split, probs[2]) if scale_bias else (
        split, probs[0], split)
    word = name if fusion == "1" else "probs"  # the unfused ops name their own input "probs"
    with pytest.raises(TypeError, match=f"{word} must be a torch.Tensor of shape \\(12,\\), "
                                        "got NoneType"):
        block(x, *args)


@pytest.mark.parametrize("fusion", ["0", "1"])
def test_given_probs_still_match_the_reference(monkeypatch, fusion):
    """The neighbour of the case above: with probs given, fused and unfused match fp64."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = _block()
    split = torch.tensor([3, 0, 5, 4])
    x = torch.randn(12, H)
    probs = torch.rand(12)
    y = block(x, split, probs, split)
    w1 = [ref.leaf(w) for w in block[0].weights()]
    w2 = [ref.leaf(w) for w in block[2].weights()]
    b1 = [ref.leaf(b) for b in block[0].biases()]
    b2 = [ref.leaf(b) for b in block[2].biases()]
    expected = ref.grouped_mlp(ref.leaf(x), [3, 0, 5, 4], ref.leaf(probs), w1, b1, w2, b2)
    ref.assert_close(y, expected, torch.float32, "y")


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("src_groups, drop, words", [
    (4, "weight3", ["weight3", "num_groups=4", "missing"]),
    (2, None, ["num_groups=4", "weight2", "weight3", "missing"]),
])
@pytest.mark.filterwarnings("ignore:load_state_dict")
def test_per_expert_checkpoint_of_other_expert_count_into_single_weight_names_the_experts(
        strict, src_groups, drop, words):
    """A per-expert checkpoint that cannot be stacked into ``single_grouped_weight`` (an
    expert missing, fewer experts): the error says which experts the layer expects and which
    the checkpoint lacks (not "missing 'weight', unexpected 'weight0', 'weight1', ...", keys
    the layer does accept). (More experts than the layer: experts
    0..G-1 load and the rest are unexpected keys, as for a per-expert layer.)"""
    src = te_ops.GroupedLinear(src_groups, H, FF, single_grouped_weight=False)
    state = src.state_dict()
    if drop:
        state.pop(drop)
    dst = te_ops.GroupedLinear(4, H, FF, single_grouped_weight=True)
    before = dst.weight.detach().clone()
    with pytest.raises(RuntimeError, match="single_grouped_weight") as info:
        dst.load_state_dict(state, strict=strict)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert torch.equal(dst.weight, before)


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("src_groups", [2, 8])
@pytest.mark.filterwarnings("ignore:load_state_dict")
def test_single_weight_checkpoint_of_other_expert_count_into_per_expert_names_the_count(
        strict, src_groups):
    """The reverse: a stacked (experts, out, in) ``weight`` whose expert count is not the
    layer's ``num_groups`` names both counts (it was "missing weight0..., unexpected
    'weight'")."""
    src = te_ops.GroupedLinear(src_groups, H, FF, single_grouped_weight=True)
    dst = te_ops.GroupedLinear(4, H, FF, single_grouped_weight=False)
    before = [w.detach().clone() for w in dst.weights()]
    with pytest.raises(RuntimeError, match=f"weight of shape \\({src_groups}, {FF}, {H}\\).*"
                                f"{src_groups} experts.*num_groups=4"):
        dst.load_state_dict(src.state_dict(), strict=strict)
    assert all(torch.equal(w, b) for w, b in zip(dst.weights(), before))


@pytest.mark.parametrize("single", [False, True])
def test_layout_conversion_with_matching_expert_count_still_loads(single):
    """The neighbour: same expert count, other layout, loads every expert exactly."""
    src = te_ops.GroupedLinear(4, H, FF, single_grouped_weight=not single)
    dst = te_ops.GroupedLinear(4, H, FF, single_grouped_weight=single)
    dst.load_state_dict(src.state_dict())
    got = dst.weight if single else torch.stack(dst.weights())
    expected = src.weight if not single else torch.stack(src.weights())
    assert torch.equal(got, expected)


def _swap(block: te_ops.Sequential, how: str, new: torch.nn.Module) -> None:
    if how == "setattr":
        setattr(block, "2", new)
    elif how == "add_module":
        block.add_module("2", new)
    elif how == "register_module":
        block.register_module("2", new)
    elif how == "set_submodule":
        block.set_submodule("2", new)
    else:
        block._modules["2"] = new


@pytest.mark.parametrize("fusion", ["0", "1"])
@pytest.mark.parametrize("how", ["setattr", "add_module", "register_module", "set_submodule",
                                 "_modules"])
def test_op_swapped_in_by_module_surgery_is_the_op_that_runs(monkeypatch, fusion, how):
    """Replacing an op through torch.nn.Module's own API (``setattr``, ``add_module``,
    ``set_submodule``: what model-surgery tools use) after a first call: the container
    rebuilds its fusers when its modules change, so the output never comes from cached
    fusers of weights no longer in the model."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = _block()
    split = torch.tensor([3, 0, 5, 4])
    x = torch.randn(12, H, requires_grad=True)
    probs = torch.rand(12, requires_grad=True)
    block(x, split, probs, split).sum().backward()
    torch.manual_seed(5)
    new = te_ops.GroupedLinear(E, FF, H)
    _swap(block, how, new)
    assert block[2] is new
    y = block(x, split, probs, split)
    w1 = [ref.leaf(w) for w in block[0].weights()]
    b1 = [ref.leaf(b) for b in block[0].biases()]
    w2 = [ref.leaf(w) for w in new.weights()]
    b2 = [ref.leaf(b) for b in new.biases()]
    expected = ref.grouped_mlp(ref.leaf(x), [3, 0, 5, 4], ref.leaf(probs), w1, b1, w2, b2)
    ref.assert_close(y, expected, torch.float32, "y")
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    (dw,) = torch.autograd.grad(expected, [w2[0]], grad_out.double())
    ref.assert_close(new.weight.grad, dw, torch.float32, "new fc2 weight grad")


@pytest.mark.parametrize("transform", ["grad", "vmap", "jvp", "functionalize"])
def test_torch_func_transforms_are_refused_naming_te_ops_and_the_alternative(transform):
    """``torch.func.grad`` / ``vmap`` / ``jvp`` / ``functionalize`` over a block: the error
    names the transform, te_ops and the supported route (``torch.func.functional_call`` with
    ``torch.autograd.grad``), not torch's "autograd.Function ... must override the
    setup_context staticmethod", which names neither te_ops nor a way out."""
    block = _block()
    split = [3, 0, 5, 4]
    x = torch.randn(12, H)
    probs = torch.rand(12)

    def run(inp: torch.Tensor) -> torch.Tensor:
        return block(inp, split, probs, split).sum()

    calls = {"grad": lambda: torch.func.grad(run)(x),
             "vmap": lambda: torch.func.vmap(run)(x.unsqueeze(0)),
             "jvp": lambda: torch.func.jvp(run, (x,), (torch.ones_like(x),)),
             "functionalize": lambda: torch.func.functionalize(run)(x)}
    with pytest.raises(RuntimeError, match=f"te_ops.*torch.func.*{transform}.*functional_call"):
        calls[transform]()


def test_functional_call_with_autograd_grad_matches_the_reference():
    """The route the error names: functional_call with other parameters, gradients by
    ``torch.autograd.grad``, against fp64."""
    block = _block()
    torch.manual_seed(3)
    params = {k: torch.randn_like(v, requires_grad=True) * 0.1
              for k, v in block.named_parameters()}
    split = [3, 0, 5, 4]
    x = torch.randn(12, H)
    probs = torch.rand(12)
    y = torch.func.functional_call(block, params, (x, split, probs, split))
    grad_out = torch.randn_like(y)
    (dw,) = torch.autograd.grad(y, [params["2.weight"]], grad_out)
    leaves = {k: ref.leaf(v) for k, v in params.items()}
    expected = ref.grouped_mlp(
        ref.leaf(x), split, ref.leaf(probs), ref.expert_params(leaves, "0.", "weight", E),
        ref.expert_params(leaves, "0.", "bias", E), ref.expert_params(leaves, "2.", "weight", E),
        ref.expert_params(leaves, "2.", "bias", E))
    ref.assert_close(y, expected, torch.float32, "y")
    (dw_ref,) = torch.autograd.grad(expected, [leaves["2.weight"]], grad_out.double())
    ref.assert_close(dw, dw_ref, torch.float32, "2.weight grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.bool])
def test_unpermute_names_a_token_index_of_the_wrong_dtype(dtype):
    """``unpermute`` passed a non-int64/int32 ``token_index`` to ``index_add_``, whose error
    ("Expected dtype int32/int64 for index but got: Float") names no argument."""
    with pytest.raises(TypeError, match=f"token_index must have dtype torch.int64 or "
                                        f"torch.int32, got {dtype}"):
        te_ops.unpermute(torch.randn(4, H), torch.zeros(4, dtype=dtype), 2)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_unpermute_sums_rows_into_tokens_like_a_loop(dtype):
    """The neighbour: int64 and int32 token indices give the per-token sum (fp64 loop)."""
    y = torch.randn(5, H)
    index = torch.tensor([2, 0, 2, 1, 0], dtype=dtype)
    out = te_ops.unpermute(y, index, 4)
    expected = torch.zeros(4, H, dtype=torch.float64)
    for row, token in enumerate(index.tolist()):
        expected[token] += y[row].double()
    ref.assert_close(out, expected, torch.float32, "unpermute")


def _delayed_block(scale_bias: bool = False, single: bool = True) -> te_ops.Sequential:
    torch.manual_seed(0)
    kw = {"delay_wgrad_compute": True, "single_grouped_weight": single}
    return te_ops.Sequential(
        te_ops.GroupedLinear(E, H, 2 * FF, **kw), te_ops.ScaledSwiGLU(),
        te_ops.GroupedLinear(E, FF, H, scale_bias=scale_bias, **kw))


@pytest.mark.parametrize("fusion", ["0", "1"])
@pytest.mark.parametrize("kind", ["list", "tensor"])
def test_input_changed_in_place_before_backward_dw_raises(monkeypatch, fusion, kind):
    """With ``delay_wgrad_compute`` the layer input is kept for ``backward_dw()``; an in-place
    change of it after backward (a reused activation buffer) raises autograd's in-place error,
    naming the op and backward_dw, instead of giving silently wrong weight gradients."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = _delayed_block()
    split = ref.split_arg([3, 0, 5, 4], kind, "cpu")
    x = torch.randn(12, H, requires_grad=True)
    inp = x * 1.0  # an activation, as a previous layer's output
    block(inp, split, torch.rand(12), split).sum().backward()
    with torch.no_grad():
        inp.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*GroupedLinear"
                                           ".*backward_dw"):
        block.backward_dw()


@pytest.mark.parametrize("fusion", ["0", "1"])
def test_scale_bias_probs_changed_in_place_before_backward_dw_raises(monkeypatch, fusion):
    """The bias gradient of a ``scale_bias`` layer reads probs at ``backward_dw()``: same."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = _delayed_block(scale_bias=True)
    split = torch.tensor([3, 0, 5, 4])
    probs = torch.rand(12)
    block(torch.randn(12, H), split, torch.rand(12), split, probs).sum().backward()
    probs.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*probs"):
        block.backward_dw()


@pytest.mark.parametrize("single", [True, False], ids=["packed", "per_expert"])
@pytest.mark.parametrize("fusion", ["0", "1"])
def test_backward_dw_with_untouched_inputs_matches_the_reference(monkeypatch, fusion, single):
    """The neighbour: inputs left alone (changed only after backward_dw) give the fp64
    gradients, over two queued micro-batches (fc2's experts 0 and 3), in both layouts."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = _delayed_block(single=single)
    split = [3, 0, 5, 4]
    expected = [torch.zeros(H, FF, dtype=torch.float64) for _ in range(2)]
    inputs = []
    for seed in range(2):
        torch.manual_seed(10 + seed)
        inp, probs = torch.randn(12, H), torch.rand(12)
        inputs.append(inp)
        block(inp, split, probs, split).sum().backward()
        w1 = [ref.leaf(w) for w in block[0].weights()]
        b1 = [ref.leaf(b) for b in block[0].biases()]
        w2 = [ref.leaf(w) for w in block[2].weights()]
        b2 = [ref.leaf(b) for b in block[2].biases()]
        w2_experts = list(w2[0].unbind(0)) if single else w2
        out = ref.grouped_mlp(ref.leaf(inp), split, ref.leaf(probs), w1, b1, w2_experts, b2)
        grads = torch.autograd.grad(out.sum(), [w2_experts[0], w2_experts[3]])
        expected = [e + g for e, g in zip(expected, grads)]
    block.backward_dw()
    for inp in inputs:
        inp.mul_(2)  # after backward_dw: nothing queued reads it any more
    got = block[2].weight.grad if single else [block[2].weight0.grad, None, None,
                                               block[2].weight3.grad]
    ref.assert_close(got[0], expected[0], torch.float32, "fc2 expert 0 weight grad")
    ref.assert_close(got[3], expected[1], torch.float32, "fc2 expert 3 weight grad")


@pytest.mark.parametrize("flag", ["accumulate_into_main_grad", "delay_wgrad_compute"])
@pytest.mark.parametrize("value, shown", [("no", "str \\('no'\\)"), (torch.zeros(3), "Tensor")])
def test_training_flags_must_be_bools(flag, value, shown):
    """``accumulate_into_main_grad="no"`` (or ``delay_wgrad_compute="no"``) turned the option
    on (a truthy string): the other flags were checked, these two were not."""
    with pytest.raises(TypeError, match=rf"{flag} must be a bool, got {shown}"):
        te_ops.GroupedLinear(2, 4, 4, **{flag: value})


@pytest.mark.parametrize("flag", ["accumulate_into_main_grad", "delay_wgrad_compute"])
@pytest.mark.parametrize("value", [False])
def test_falsy_training_flags_stay_off(flag, value):
    """The neighbour: False keeps working (0 and None are refused as non-bools,
    tests/test_error_messages.py); off means a plain ``.grad``."""
    lin = te_ops.GroupedLinear(2, 4, 4, **{flag: value})
    assert getattr(lin, flag) is False
    x = torch.randn(3, 4)
    lin(x, [2, 1]).sum().backward()
    expected = x[:2].sum(0).double()
    ref.assert_close(lin.weight.grad[0], expected.expand(4, 4), torch.float32, "weight grad")


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_block_copied_with_queued_wgrad_jobs_runs_them(how):
    """The in-place check above must not fire for a copy: ``copy.deepcopy`` / ``pickle`` of a
    block with queued jobs make new tensors (whose version counters start elsewhere); the
    copy's ``backward_dw()`` gives the original's gradients."""
    import copy
    import pickle

    block = _delayed_block()
    split = [3, 0, 5, 4]
    block(torch.randn(12, H), split, torch.rand(12), split).sum().backward()
    clone = copy.deepcopy(block) if how == "deepcopy" else pickle.loads(pickle.dumps(block))
    clone.backward_dw()
    block.backward_dw()
    for mine, theirs in zip(block.parameters(), clone.parameters()):
        assert torch.equal(mine.grad, theirs.grad)


@pytest.mark.filterwarnings("ignore:load_state_dict")
def test_dense_checkpoint_into_per_expert_layer_is_not_called_a_stacked_one():
    """A dense layer's 2-D ``weight`` (upcycling a dense checkpoint, ``strict=False``) is not
    a stacked per-expert weight: no expert-count error, torch's missing / unexpected keys."""
    dense = torch.nn.Linear(H, FF)
    layer = te_ops.GroupedLinear(E, H, FF, single_grouped_weight=False)
    result = layer.load_state_dict(dense.state_dict(), strict=False)
    assert sorted(result.unexpected_keys) == ["bias", "weight"]
    assert len(result.missing_keys) == 2 * E
