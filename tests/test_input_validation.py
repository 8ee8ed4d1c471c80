"""te_ops used as a new user would (README and docs first, then bad input): split sizes, input
checks, ``fuses_as``, state_dicts, recipes, routing, the main job, the HF integration,
quantizers, compile, main_grad and nesting.

Each test asserts the right value or the right error (naming the argument, the expected and
the actual value); references are independent (``tests/reference.py``: per-expert
``F.linear`` loops in float64)."""

from __future__ import annotations

import pytest
import torch

import te_ops


# --------------------------------------------------------------------------- split sizes
@pytest.mark.parametrize("sizes", [[2**62] * 4, [2**63 - 1, 2**63 - 1, 2, 0]])
def test_device_split_sizes_that_overflow_int64_sum_are_rejected(sizes):
    # Non-negative sizes whose int64 cumsum wraps around to <= rows: the device-side check
    # must catch them (else the GEMMs run with garbage offsets).
    lin = te_ops.GroupedLinear(4, 4, 4)
    with pytest.raises(RuntimeError, match=r"split_sizes must be non-negative and sum to at "
                                           r"most the input's rows \(6\).*TE_OPS_CHECK_SPLIT"):
        lin(torch.randn(6, 4), torch.tensor(sizes))


@pytest.mark.parametrize(("value", "match"), [
    (float("nan"), r"split_sizes\[0\] must be a whole number, got nan"),
    (float("inf"), r"split_sizes\[0\] must be a whole number, got inf"),
    (1e30, r"split_sizes\[0\] must be within int64's range, got 1\.0*\d*e\+30"),
])
def test_eager_split_check_names_non_finite_and_huge_float_sizes(monkeypatch, value, match):
    # With TE_OPS_CHECK_SPLIT_SIZES=1, NaN raised "cannot convert float NaN to integer", inf
    # an OverflowError and 1e30 "must be >= 0, got -9223372036854775808".
    monkeypatch.setenv("TE_OPS_CHECK_SPLIT_SIZES", "1")
    lin = te_ops.GroupedLinear(2, 4, 4)
    with pytest.raises(ValueError, match=match):
        lin(torch.randn(6, 4), torch.tensor([value, 1.0]))


# --------------------------------------------------------------------------- input checks
def test_device_mismatch_hint_names_the_device_not_the_dtype():
    # The hint said "cast the input with x.to(torch.float32)" for an input on another device.
    lin = te_ops.GroupedLinear(2, 4, 4)
    x = torch.randn(6, 4, device="meta")
    with pytest.raises(ValueError, match=r"device cpu, got torch.float32 on meta: move the "
                                         r"input with x.to\('cpu'\) \(or the layer with "
                                         r"\.to\('meta'\)\)"):
        lin(x, [3, 3])
    with pytest.raises(ValueError, match=r"x.to\(torch.float32\) \(or the layer with "
                                         r"\.to\(torch.float64\)\)"):
        lin(torch.randn(6, 4, dtype=torch.float64), [3, 3])


@pytest.mark.parametrize("flag", ["bias", "scale_bias", "single_grouped_weight"])
def test_grouped_linear_flags_must_be_bools(flag):
    # bias="no" built biases (a truthy string); bias=torch.zeros(3) raised torch's
    # "Boolean value of Tensor ... is ambiguous".
    with pytest.raises(TypeError, match=rf"{flag} must be a bool, got str \('no'\)"):
        te_ops.GroupedLinear(2, 4, 4, **{flag: "no"})
    with pytest.raises(TypeError, match=rf"{flag} must be a bool, got Tensor"):
        te_ops.GroupedLinear(2, 4, 4, **{flag: torch.zeros(3)})


def test_bias_false_gives_a_bool_use_bias():
    lin = te_ops.GroupedLinear(2, 4, 4, bias=False)
    assert lin.use_bias is False and lin.has_bias is False and lin.bias is None
    per_expert = te_ops.GroupedLinear(2, 4, 4, bias=False, single_grouped_weight=False)
    assert per_expert.has_bias is False and per_expert.bias0 is None


@pytest.mark.parametrize("bias", [None, 0, 1, 2])
def test_non_bool_bias_is_refused(bias):
    # strict bools, as the recipes' flags: bias=2 was taken as True, None and 0 as False
    with pytest.raises(TypeError, match=rf"bias must be a bool, got {type(bias).__name__}"):
        te_ops.GroupedLinear(2, 4, 4, bias=bias)


# --------------------------------------------------------------------------- fuses_as
def test_fuses_as_must_name_a_base_class():
    # A SwiGLU subclass declaring fuses_as = GroupedLinear was fused as a GroupedLinear and
    # failed inside the fusion with "'W' object has no attribute 'num_groups'".
    with pytest.raises(TypeError, match=r"W.fuses_as must be one of its base classes .*"
                                        r"got <class 'te_ops.basic.grouped_linear.Grouped"):
        class W(te_ops.SwiGLU):  # noqa: F841
            fuses_as = te_ops.GroupedLinear
    with pytest.raises(TypeError, match=r"V.fuses_as must be one of its base classes"):
        class V(te_ops.SwiGLU):  # noqa: F841
            fuses_as = 3


# --------------------------------------------------------------------------- state_dict
def test_per_expert_checkpoint_of_wrong_shape_into_single_weight_names_the_key():
    # torch.stack raised "stack expects each tensor to be equal size" without a key name.
    src = te_ops.GroupedLinear(2, 16, 64, single_grouped_weight=False)
    dst = te_ops.GroupedLinear(2, 16, 64, single_grouped_weight=True)
    sd = src.state_dict()
    sd["weight0"] = sd["weight0"][:1]
    for strict in (True, False):
        with pytest.raises(RuntimeError, match=r"size mismatch for weight0: copying a param "
                                               r"with shape \(1, 16\).*\(64, 16\)"):
            dst.load_state_dict(sd, strict=strict)


# --------------------------------------------------------------------------- recipes
def _block(**kw):
    return te_ops.Sequential(te_ops.GroupedLinear(2, 64, 128, **kw), te_ops.ScaledSwiGLU(),
                             te_ops.GroupedLinear(2, 64, 64, **kw))


def test_explain_after_a_recipe_call_reports_the_recipe():
    # docs/recipes.md: explain() prints, per GroupedLinear, "recipe <name>: emulated (...)"
    # after a call under the recipe (the recipe is recorded), and a later call without a
    # recipe must not keep that line.
    from te_ops.recipe import Float8CurrentScaling, MXFP8BlockScaling

    blk = _block()
    x, sizes, probs = torch.randn(8, 64), torch.tensor([4, 4]), torch.rand(8)
    with te_ops.autocast(recipe=Float8CurrentScaling()):
        blk(x, sizes, probs, sizes)
    text = blk.explain()
    assert text.count("recipe Float8CurrentScaling: emulated (no FP8 grouped GEMM kernel on "
                      "cpu)") == 2
    with te_ops.autocast(recipe=MXFP8BlockScaling()):
        blk(x, sizes, probs, sizes)
    text = blk.explain()
    assert text.count("recipe MXFP8BlockScaling: emulated") == 2
    assert "Float8CurrentScaling" not in text
    blk(x, sizes, probs, sizes)
    assert "recipe " not in blk.explain()


@pytest.mark.parametrize("enabled", ["no", None, 0])
def test_autocast_enabled_must_be_a_bool(enabled):
    # enabled="no" switched FP8 on (a truthy string).
    with pytest.raises(TypeError, match=rf"enabled must be a bool, got {type(enabled).__name__}"):
        with te_ops.autocast(enabled=enabled):
            pass


def test_autocast_rejects_the_abstract_recipe_base():
    # Recipe() was accepted and the first forward raised a bare NotImplementedError.
    from te_ops.recipe import Recipe

    with pytest.raises(TypeError, match=r"recipe must be a te_ops.recipe.Recipe, got the "
                                        r"abstract base Recipe \(pass an instance such as "
                                        r"Float8CurrentScaling\(\)"):
        with te_ops.autocast(recipe=Recipe()):
            pass


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_recipe_with_unsupported_parameter_dtype_names_autocast_and_the_fix(dtype):
    # The error said "x must be a float32 or bfloat16 tensor" (the quantizer's argument).
    blk = _block(dtype=dtype)
    sizes = [4, 4]
    with te_ops.autocast(), pytest.raises(
            TypeError, match=rf"te_ops.autocast\(recipe=Float8CurrentScaling\(\)\) needs float32 "
                             rf"or bfloat16 parameters and inputs \(input is {dtype}\): cast"):
        blk(torch.randn(8, 64, dtype=dtype), sizes, torch.rand(8, dtype=dtype), sizes)


# --------------------------------------------------------------------------- routing
def test_permute_treats_negative_expert_ids_as_padding():
    # A -1 "dropped" id raised torch's "index -1 is out of bounds for dimension 0 with size 4"
    # on CPU (a device assert on CUDA); argsort also put it first, ahead of expert 0's rows.
    torch.manual_seed(0)
    x = torch.randn(5, 3, dtype=torch.float64)
    idx = torch.tensor([[1, -1], [0, 2], [-1, -1], [2, 0], [3, 1]])
    w = torch.rand(5, 2, dtype=torch.float64)
    routed = te_ops.permute(x, idx, w, 4)
    assert routed.split_sizes.tolist() == [2, 2, 2, 1]
    valid = [(t, k) for t in range(5) for k in range(2) if idx[t, k] >= 0]
    want = sorted(valid, key=lambda p: (idx[p].item(), p))  # by expert, then token, slot
    n = len(want)
    assert routed.token_index[:n].tolist() == [t for t, _ in want]
    torch.testing.assert_close(routed.probs[:n], torch.stack([w[p] for p in want]))
    assert sorted(routed.token_index[n:].tolist()) == [0, 2, 2]  # the -1 rows, last


# --------------------------------------------------------------------------- the main job
@pytest.mark.parametrize(("argv", "message"), [
    # --recipe was silently ignored with --hf-model (the HF comparison has no recipe)
    (["--hf-model", "mixtral", "--recipe", "fp8"], "--recipe fp8 does not apply to --hf-model"),
    # a traceback from the model ("d_model=128 must be divisible by heads=3")
    (["--heads", "3"], "--d-model (128) must be divisible by --heads, got 3"),
])
def test_train_moe_rejects_flag_combinations_it_cannot_run(capsys, argv, message):
    from te_ops.examples.train_moe import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_train_moe_seq_len_longer_than_the_split_names_the_flag():
    # torch raised "random_ expects 'from' to be less than 'to', but got from=0 >= to=-53381".
    from te_ops.examples.train_moe import sample_batch

    with pytest.raises(ValueError, match=r"--seq-len 100 must be below 49: the split has 50"):
        sample_batch(torch.zeros(50, dtype=torch.uint8), 2, 100, torch.Generator())


# --------------------------------------------------------------------------- HF integration
def _hf():
    pytest.importorskip("transformers", minversion="5.0")
    from te_ops.integrations import transformers as te_hf

    return te_hf


def test_to_hf_state_dict_rejects_a_block_that_is_not_an_hf_grouped_mlp():
    # fc1 with 2 experts and fc2 with 3 gave a state dict; a plain module raised
    # "'Linear' object is not iterable".
    te_hf = _hf()
    blk = te_ops.Sequential(te_ops.GroupedLinear(2, 8, 16, bias=False), te_ops.ScaledSwiGLU(),
                            te_ops.GroupedLinear(3, 8, 8, bias=False))
    with pytest.raises(ValueError, match=r"fc1 must be GroupedLinear\(E, H, 2I\) and fc2 "
                                         r"GroupedLinear\(E, I, H\); got fc1 \(2, 8, 16\) and "
                                         r"fc2 \(3, 8, 8\)"):
        te_hf.to_hf_state_dict(blk)
    blk = te_ops.Sequential(te_ops.GroupedLinear(2, 8, 16, bias=False), te_ops.ScaledSwiGLU(),
                            te_ops.GroupedLinear(2, 8, 6, bias=False))
    with pytest.raises(ValueError, match=r"fc2 \(2, 8, 6\)"):
        te_hf.to_hf_state_dict(blk, "w1_w3_w2")
    with pytest.raises(ValueError, match=r"block must be a te_ops.Sequential.*got Linear"):
        te_hf.to_hf_state_dict(torch.nn.Linear(2, 2))


def test_from_hf_experts_names_the_expert_whose_shapes_differ():
    # torch.stack raised "stack expects each tensor to be equal size".
    te_hf = _hf()

    def mlp(inter):
        m = torch.nn.Module()
        m.w1 = torch.nn.Linear(8, inter, bias=False)
        m.w3 = torch.nn.Linear(8, 4, bias=False)
        m.w2 = torch.nn.Linear(4, 8, bias=False)
        m.act_fn = torch.nn.SiLU()
        return m

    experts = torch.nn.ModuleList([mlp(4), mlp(5)])
    with pytest.raises(ValueError, match=r"expert 1 \(Module\) has w1/w3/w2 weight shapes "
                                         r"\(\(5, 8\), \(4, 8\), \(8, 4\)\)"):
        te_hf.from_hf_experts(experts)
    assert te_hf.unsupported_reason(torch.nn.ModuleList([mlp(4), mlp(4)])) is None


# ---------------------------------------------------------------- in-place inputs, saved views
@pytest.mark.parametrize("fusion", ["1", "0"])
@pytest.mark.parametrize("which", ["input", "input_3d", "probs"])
def test_input_modified_in_place_before_backward_names_the_inplace_op(monkeypatch, fusion,
                                                                       which):
    # The fuser saved a view of the input made inside its autograd Function (grad mode off), so
    # an in-place change before backward raised torch's "A view was created in no_grad mode"
    # instead of the version-counter error naming the in-place op (as nn.Linear does). Now
    # views are saved through their base and re-viewed in backward; fused and unfused, for the
    # input (2-D and 3-D, reshaped inside) and for probs.
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    blk = _block()
    shape = (2, 3, 64) if which == "input_3d" else (6, 64)
    x = torch.randn(*shape, requires_grad=True)
    x_in = x * 1
    probs = torch.rand(6, requires_grad=True)
    probs_in = probs * 1
    sizes = torch.tensor([3, 3])
    y = blk(x_in, sizes, probs_in, sizes)
    with torch.no_grad():
        (probs_in if which == "probs" else x_in).add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_saved_views_give_the_reference_grads():
    # Saving a view's base and re-viewing it in backward changes no value: 3-D input with
    # a non-contiguous (transposed) layout, against the per-expert float64 reference loop.
    torch.manual_seed(3)
    blk = _block().double()
    x = torch.randn(64, 6, dtype=torch.float64).t().requires_grad_()  # (6, 64), strided
    probs = torch.rand(6, dtype=torch.float64)
    sizes = [2, 4]
    y = blk(x, torch.tensor(sizes), probs, torch.tensor(sizes))
    y.square().sum().backward()
    fc1, fc2 = blk[0], blk[2]
    x_ref = x.detach().clone().requires_grad_()
    outs = []
    for g, rows in enumerate((slice(0, 2), slice(2, 6))):
        h = torch.nn.functional.linear(x_ref[rows], fc1.weight[g],
                                       None if fc1.bias is None else fc1.bias[g])
        a, b = h.chunk(2, dim=-1)
        act = torch.nn.functional.silu(a) * b * probs[rows, None]
        outs.append(torch.nn.functional.linear(act, fc2.weight[g],
                                               None if fc2.bias is None else fc2.bias[g]))
    torch.cat(outs).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sizes", [[2, 3], torch.tensor([2, 3])])
def test_quantizer_takes_split_sizes_as_a_list_or_tensor(sizes):
    # The public quantizer's splits only took the internal GroupedSplits: a list or tensor of
    # split sizes raised "'list' object has no attribute 'num_groups'".
    from te_ops.quantization import Float8CurrentScalingQuantizer

    torch.manual_seed(1)
    x = torch.randn(5, 32) * torch.logspace(-2, 2, 32)
    q = Float8CurrentScalingQuantizer(rowwise=False, columnwise=True)(x, sizes)
    # per (expert, column) power-of-two scale over the expert's rows: 2^floor(log2(448/amax))
    for g, rows in enumerate((slice(0, 2), slice(2, 5))):
        amax = x[rows].abs().amax(0).double()
        scale = torch.exp2(torch.floor(torch.log2(448.0 / amax)))
        torch.testing.assert_close(q.columnwise_scale_inv[g].double(), 1.0 / scale,
                                   rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"splits must be a GroupedSplits, a list of ints or a "
                                        r"1-D tensor of split sizes, got Tensor of shape \(\)"):
        Float8CurrentScalingQuantizer(columnwise=True)(x, torch.tensor(5))


# --------------------------------------------------------------------------- recipes
_RECIPES = [te_ops.recipe.Float8CurrentScaling(), te_ops.recipe.MXFP8BlockScaling()]


def _mlp(num_groups: int = 3, hidden: int = 32, ffn: int = 32) -> te_ops.Sequential:
    torch.manual_seed(3)
    return te_ops.Sequential(te_ops.GroupedLinear(num_groups, hidden, 2 * ffn),
                             te_ops.ScaledSwiGLU(),
                             te_ops.GroupedLinear(num_groups, ffn, hidden))


def _grads(block, x, probs, sizes, call):
    """Output, input/probs gradients and parameter gradients of one ``call`` under autocast."""
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    probs = probs.detach().requires_grad_(True)
    y = call(block, x, sizes, probs)
    y.square().sum().backward()
    return [y.detach(), x.grad, probs.grad] + [p.grad for p in block.parameters()]


@pytest.mark.parametrize("recipe", _RECIPES, ids=["fp8", "mxfp8"])
@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("sizes", [[5, 0, 7], "tensor"])
def test_te_ops_checkpoint_keeps_the_recipe_for_the_recomputation(recipe, use_reentrant, sizes):
    # torch.utils.checkpoint recomputes outside te_ops.autocast: use_reentrant=False raised
    # "A different number of tensors was saved", use_reentrant=True (Megatron's style) silently
    # gave the gradients of the unquantized block. te_ops.checkpoint re-enters the recipe.
    block = _mlp()
    x, probs = torch.randn(14, 32), torch.rand(14)
    sizes = torch.tensor([5, 0, 7]) if sizes == "tensor" else sizes

    def plain(b, x, s, p):
        with te_ops.autocast(recipe=recipe):
            return b(x, s, p, s)

    def ckpt(b, x, s, p):
        with te_ops.autocast(recipe=recipe):
            return te_ops.checkpoint(b, x, s, p, s, use_reentrant=use_reentrant)

    expected = _grads(block, x, probs, sizes, plain)
    got = _grads(block, x, probs, sizes, ckpt)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # and the quantized gradients really differ from the high-precision ones (the test can fail)
    hp = _grads(block, x, probs, sizes, lambda b, x, s, p: b(x, s, p, s))
    assert not torch.equal(hp[1], expected[1])


def test_te_ops_checkpoint_without_a_recipe_matches_torch_checkpoint():
    block = _mlp()
    x, probs, sizes = torch.randn(9, 32), torch.rand(9), [2, 3, 4]
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    expected = _grads(block, x, probs, sizes,
                      lambda b, x, s, p: torch_checkpoint(b, x, s, p, s, use_reentrant=False))
    got = _grads(block, x, probs, sizes,
                 lambda b, x, s, p: te_ops.checkpoint(b, x, s, p, s))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_recipe_fast_accumulate_backward_must_be_a_bool():
    # fast_accumulate_backward="no" was taken as True (a truthy string).
    with pytest.raises(TypeError, match=r"fast_accumulate_backward must be a bool, got str "
                                        r"\('no'\)"):
        te_ops.recipe.Float8CurrentScaling(fast_accumulate_backward="no")
    # strict bools (the recipe is part of the plan key): 1 is refused too, naming the type
    with pytest.raises(TypeError, match=r"fast_accumulate_backward must be a bool, got int"):
        te_ops.recipe.Float8CurrentScaling(fast_accumulate_backward=1)
    assert te_ops.recipe.Float8CurrentScaling(True).fast_accumulate_backward is True


# --------------------------------------------------------------------------- quantizers
_QUANTIZERS = ["Float8CurrentScalingQuantizer", "MXFP8Quantizer"]


@pytest.mark.parametrize("name", _QUANTIZERS)
@pytest.mark.parametrize("flag", ["rowwise", "columnwise"])
def test_quantizer_flags_must_be_bools(name, flag):
    # rowwise="no" made a row-wise quantizer (a truthy string).
    cls = getattr(te_ops.quantization, name)
    with pytest.raises(TypeError, match=rf"{flag} must be a bool, got str \('no'\)"):
        cls(**{flag: "no"})


@pytest.mark.parametrize("name", _QUANTIZERS)
def test_quantizer_rejects_a_0d_tensor_naming_x(name):
    # A 0-d tensor raised "IndexError: tuple index out of range".
    q = getattr(te_ops.quantization, name)()
    with pytest.raises(ValueError, match=r"x must have at least one dim \(\.\.\., K\).*0-d"):
        q(torch.tensor(3.0))


@pytest.mark.parametrize("name", _QUANTIZERS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, "float32"])
def test_dequantize_rejects_a_non_floating_dtype(name, dtype):
    # dequantize(torch.int32) returned an int tensor (every value truncated).
    x = torch.randn(4, 32)
    stored = getattr(te_ops.quantization, name)()(x)
    with pytest.raises(TypeError, match=r"dtype must be a floating torch.dtype, got"):
        stored.dequantize(dtype)


@pytest.mark.parametrize("name", _QUANTIZERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizer_noncontiguous_input_matches_contiguous(name, dtype):
    # Public quantizers on transposed views (row-wise, column-wise, per-group column-wise):
    # same bytes and scales as on the contiguous copy; dequantized within E4M3's precision.
    cls = getattr(te_ops.quantization, name)
    torch.manual_seed(0)
    x = torch.randn(70, 37, dtype=dtype).t()
    for kwargs, splits in (({}, None), ({"rowwise": False, "columnwise": True}, [10, 0, 27])):
        a = cls(**kwargs)(x, splits)
        b = cls(**kwargs)(x.contiguous(), splits)
        for field in ("rowwise_data", "rowwise_scale_inv", "columnwise_data",
                      "columnwise_scale_inv"):
            fa, fb = getattr(a, field), getattr(b, field)
            assert (fa is None) == (fb is None)
            if fa is not None:
                assert torch.equal(fa.view(torch.uint8) if fa.element_size() == 1 else fa,
                                   fb.view(torch.uint8) if fb.element_size() == 1 else fb)
        err = (a.dequantize().double() - x.double()).norm() / x.double().norm()
        assert err < 0.05, f"relative dequantization error {err:.3g}"


# --------------------------------------------------------------------------- split-size aliases
def _plan_forward(block) -> str:
    text = block.explain()
    return text.splitlines()[5]  # the first op's row of the plan table


@pytest.mark.parametrize("alias", ["detach", "view", "reentrant_checkpoint"])
def test_split_sizes_aliasing_one_tensor_keep_the_fused_mlp(recwarn, alias):
    # Reentrant checkpointing (Megatron's) detaches every tensor argument, so the one split-size
    # tensor passed to fc1 and fc2 arrived as two objects: the fused grouped MLP was dropped with
    # a "two different tensor objects" warning. Aliases of the same memory are one source.
    block = _mlp()
    x, probs = torch.randn(9, 32, requires_grad=True), torch.rand(9, requires_grad=True)
    s = torch.tensor([2, 3, 4])
    if alias == "reentrant_checkpoint":
        y = torch.utils.checkpoint.checkpoint(block, x, s, probs, s, use_reentrant=True)
    else:
        y = block(x, s, probs, s.detach() if alias == "detach" else s.view(3))
    y.square().sum().backward()
    assert "ForwardGroupedMLP" in _plan_forward(block) and "BackwardGroupedMLP" in \
        _plan_forward(block)
    assert not [w for w in recwarn if "different tensor objects" in str(w.message)]
    # same values as the per-expert float64 reference
    import reference as ref

    xr, pr = ref.leaf(x), ref.leaf(probs)
    leaves = [ref.leaf(getattr(block[i], kind))
              for i, kind in ((0, "weight"), (0, "bias"), (2, "weight"), (2, "bias"))]
    w1, b1, w2, b2 = (list(t.unbind(0)) for t in leaves)
    yr = ref.grouped_mlp(xr, [2, 3, 4], pr, w1, b1, w2, b2)
    yr.square().sum().backward()
    ref.assert_close(y, yr, torch.float32, "y")
    ref.assert_close(x.grad, xr.grad, torch.float32, "x.grad")
    ref.assert_close(block[2].weight.grad, leaves[2].grad, torch.float32, "fc2.weight.grad")


@pytest.mark.parametrize("other", ["clone", "offset_view", "other_strides"])
def test_split_sizes_in_different_memory_are_still_two_sources(other):
    # The alias rule must not merge tensors that merely hold equal values, or views of other
    # elements of one buffer (same start, other strides).
    block = _mlp()
    buf = torch.tensor([2, 2, 3, 3, 4, 4])
    s = buf[::2]
    s2 = {"clone": s.clone(), "offset_view": buf[1::2], "other_strides": buf[:3]}[other]
    with pytest.warns(UserWarning, match="different tensor objects"):
        block(torch.randn(9, 32), s, torch.rand(9), s2)
    assert "ForwardGroupedMLP" not in _plan_forward(block)


# --------------------------------------------------------------------------- compile
def _recipe_grads(block, fn, recipe):
    torch.manual_seed(4)
    x, probs, s = torch.randn(9, 32), torch.rand(9), torch.tensor([2, 3, 4])
    return _grads(block, x, probs, s, lambda b, x, s, p: _under(recipe, fn, x, s, p))


def _under(recipe, fn, x, s, p):
    with te_ops.autocast(enabled=recipe is not None, recipe=recipe):
        return fn(x, s, p, s)


def test_fp8_block_compiles_with_inductor_on_cpu():
    # Under Float8CurrentScaling, torch.compile's default backend (inductor) compiles on CPU:
    # the power-of-two scale is fp32 frexp arithmetic (frexp of a float64 quotient fails with
    # "CppCompileError: no match for operator- (VectorizedN<int, 2>, Vectorized<int>)").
    recipe = te_ops.recipe.Float8CurrentScaling()
    block = _mlp()
    torch._dynamo.reset()
    expected = _recipe_grads(block, block, recipe)
    got = _recipe_grads(block, torch.compile(block, fullgraph=True), recipe)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


@pytest.mark.parametrize("recipe", [None, te_ops.recipe.Float8CurrentScaling()],
                         ids=["none", "fp8"])
def test_te_ops_checkpoint_under_torch_compile_fullgraph(recipe):
    # te_ops.checkpoint read the recipe's ContextVar, which dynamo cannot trace.
    block = _mlp()
    torch._dynamo.reset()
    expected = _recipe_grads(block, block, recipe)
    compiled = torch.compile(lambda *a: te_ops.checkpoint(block, *a), fullgraph=True,
                             backend="aot_eager")
    got = _recipe_grads(block, compiled, recipe)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_pow2_scale_matches_the_formula_at_power_of_two_boundaries():
    # The fp32 rewrite of 2^floor(log2(448 / amax)) against exact host arithmetic, on the
    # values where floor(log2) changes (448 * 2^k and its fp32 neighbours), subnormals and the
    # clamp range.
    import math

    from te_ops.quantization.numerics import pow2_scale_from_amax

    k = torch.arange(-150, 128, dtype=torch.int32)
    edges = torch.cat([torch.ldexp(torch.full(k.shape, 448.0), k),
                       torch.ldexp(torch.ones(k.shape), k)])
    edges = edges[torch.isfinite(edges) & (edges > 0)]
    vals = torch.cat([edges, torch.nextafter(edges, torch.tensor(math.inf)),
                      torch.nextafter(edges, torch.tensor(0.0)), torch.tensor([1e-45, 3.4e38])])
    vals = vals[vals > 0]
    got = pow2_scale_from_amax(vals)
    for v, g in zip(vals.tolist(), got.tolist()):
        q = 448.0 / v  # float64 quotient of two fp32 values: never rounds onto a power of two
        e = max(-126, min(127, math.floor(math.log2(q))))
        while 2.0 ** (e + 1) <= q and e < 127:  # guard log2 rounding
            e += 1
        while 2.0 ** e > q and e > -126:
            e -= 1
        assert g == 2.0 ** e, (v, g, 2.0 ** e)
    assert pow2_scale_from_amax(torch.zeros(3)).tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("recipe", _RECIPES, ids=["fp8", "mxfp8"])
def test_checkpoint_context_fn_gives_torch_checkpoint_the_recipe(recipe):
    # For checkpoint calls the user does not own (HF's activation checkpointing):
    # torch.utils.checkpoint(..., context_fn=te_ops.checkpoint_context_fn).
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    block = _mlp()
    x, probs, sizes = torch.randn(9, 32), torch.rand(9), torch.tensor([4, 0, 5])

    def plain(b, x, s, p):
        with te_ops.autocast(recipe=recipe):
            return b(x, s, p, s)

    def ckpt(b, x, s, p):
        with te_ops.autocast(recipe=recipe):
            return torch_checkpoint(b, x, s, p, s, use_reentrant=False,
                                    context_fn=te_ops.checkpoint_context_fn)

    expected = _grads(block, x, probs, sizes, plain)
    got = _grads(block, x, probs, sizes, ckpt)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# --------------------------------------------------------------------------- main_grad
@pytest.mark.parametrize("single", [False, True])
@pytest.mark.parametrize("delay", [False, True])
def test_main_grad_on_another_device_is_rejected_naming_the_parameter(single, delay):
    # A main_grad on the meta device was "accumulated into" silently: the gradient was lost.
    lin = te_ops.GroupedLinear(2, 16, 8, accumulate_into_main_grad=True,
                               delay_wgrad_compute=delay, single_grouped_weight=single)
    for p in lin.parameters():
        p.main_grad = torch.zeros(p.shape, device="meta")
    name = "weight" if single else "weight0"
    x = torch.randn(6, 16, requires_grad=True)
    with pytest.raises(ValueError, match=rf"{name}\.main_grad must be on {name}'s device cpu, "
                                         r"got meta"):
        lin(x, [2, 4]).sum().backward()
        lin.backward_dw()


# --------------------------------------------------------------------------- nesting
def test_nested_sequential_that_needs_extra_inputs_is_refused_with_the_fix():
    # te_ops.Sequential(te_ops.Sequential(GroupedLinear), SwiGLU)(x, sizes) raised "expected 0
    # extra inputs after the main input (none), got 1" at call time.
    inner = te_ops.Sequential(te_ops.GroupedLinear(2, 16, 8))
    with pytest.raises(ValueError, match=r"module 0 is a te_ops.Sequential taking 1 extra "
                                         r"inputs.*unpack it"):
        te_ops.Sequential(inner, te_ops.SwiGLU())
    outer = te_ops.Sequential(te_ops.SwiGLU())
    with pytest.raises(ValueError, match=r"module 1 is a te_ops.Sequential"):
        outer.append(inner)
    # a nested container without extra inputs runs as before; unpacking gives the fix
    torch.manual_seed(0)
    x = torch.randn(6, 16)
    nested = te_ops.Sequential(te_ops.Sequential(te_ops.SwiGLU()), te_ops.Identity())
    torch.testing.assert_close(nested(x), torch.nn.functional.silu(x[:, :8]) * x[:, 8:])
    flat = te_ops.Sequential(*inner, te_ops.SwiGLU())
    w, b = list(inner[0].weight), list(inner[0].bias)
    h = torch.cat([torch.nn.functional.linear(x[:2], w[0], b[0]),
                   torch.nn.functional.linear(x[2:], w[1], b[1])])
    torch.testing.assert_close(flat(x, [2, 4]), torch.nn.functional.silu(h[:, :4]) * h[:, 4:])


def test_autocast_with_the_recipe_passed_positionally_says_to_pass_it_by_keyword():
    # autocast(Float8CurrentScaling()) fills `enabled` (TransformerEngine's order too); the
    # error named only `enabled`.
    with pytest.raises(TypeError, match=r"enabled must be a bool, got Float8CurrentScaling .*"
                                        r"pass a recipe by keyword: autocast\(recipe=\.\.\.\)"):
        with te_ops.autocast(te_ops.recipe.Float8CurrentScaling()):
            pass


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_te_ops_checkpoint_with_main_grad_and_delayed_wgrad_under_a_recipe(use_reentrant):
    # Megatron's combination: reentrant checkpointing, main_grad, delayed wgrad, FP8.
    recipe = te_ops.recipe.Float8CurrentScaling()
    results = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        kw = {"accumulate_into_main_grad": True, "delay_wgrad_compute": True}
        block = te_ops.Sequential(te_ops.GroupedLinear(3, 32, 64, **kw), te_ops.ScaledSwiGLU(),
                                  te_ops.GroupedLinear(3, 32, 32, **kw))
        for name, p in block.named_parameters():
            if "weight" in name:
                p.main_grad = torch.zeros_like(p)
        x = torch.randn(9, 32, requires_grad=True)
        probs, s = torch.rand(9, requires_grad=True), torch.tensor([2, 3, 4])
        with te_ops.autocast(recipe=recipe):
            y = (te_ops.checkpoint(block, x, s, probs, s, use_reentrant=use_reentrant) if ckpt
                 else block(x, s, probs, s))
        y.square().sum().backward()
        block.backward_dw()
        results.append([x.grad, probs.grad] + [p.main_grad if "weight" in n else p.grad
                                               for n, p in block.named_parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
