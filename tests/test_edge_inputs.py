"""README-driven use on CPU: bad and edge inputs.

Each test is named by the behaviour it checks; values are compared with the float64
per-expert reference of ``tests/reference.py``.
"""

from __future__ import annotations

import re

import pytest
import reference as ref
import torch

import te_ops
from te_ops.fuser import DOUBLE_BACKWARD_ERROR

E, H, FF = 2, 8, 8


def _block(dtype: torch.dtype = torch.float64, bias: bool = False) -> te_ops.Sequential:
    torch.manual_seed(0)
    return te_ops.Sequential(
        te_ops.GroupedLinear(E, H, 2 * FF, bias=bias, dtype=dtype),
        te_ops.ScaledSwiGLU(),
        te_ops.GroupedLinear(E, FF, H, bias=bias, dtype=dtype),
    )


# ---------------------------------------------- second-order gradients are refused, never zero
# The refusing node had no graph edges to the forward's inputs, so torch.autograd.grad with
# respect to an input found it unreachable: torch's "appears to not have been used in the
# graph" error, and with allow_unused=True (torch.autograd.functional.hessian / hvp pass it)
# None, which those functions turned into an all-zero Hessian with no error.

def _split(kind: str):
    return [3, 3] if kind == "list" else torch.tensor([3, 3])


@pytest.mark.parametrize("fusion", ["0", "1"])
@pytest.mark.parametrize("kind", ["list", "tensor"])
def test_functional_hessian_and_hvp_raise_instead_of_zeros(monkeypatch, fusion, kind):
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    blk = _block()
    probs = torch.rand(6, dtype=torch.float64)
    split = _split(kind)

    def f(x):
        return blk(x, split, probs, split).square().sum()

    x = torch.randn(6, H, dtype=torch.float64)
    f(x.requires_grad_()).backward()  # a first call (the plan is cached)
    for fn in (torch.autograd.functional.hessian,
               lambda g, v: torch.autograd.functional.hvp(g, v, torch.ones_like(v))):
        with pytest.raises(RuntimeError, match="create_graph=True") as err:
            fn(f, x.detach())
        assert DOUBLE_BACKWARD_ERROR in str(err.value)


@pytest.mark.parametrize("fusion", ["0", "1"])
@pytest.mark.parametrize("leaf", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grad_of_first_order_grad_wrt_inputs_and_weights_raises(monkeypatch, fusion, leaf,
                                                                dtype):
    # float32: the fused backward runs torch._grouped_mm and bumps h's version, after which
    # the saved tensors (and so a non-leaf input's edge) no longer unpack
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    blk = _block(dtype)
    probs = torch.rand(6, dtype=dtype, requires_grad=True)
    x0 = torch.randn(6, H, dtype=dtype, requires_grad=True)
    x = x0 if leaf else x0 * 2  # a non-leaf input (saved for fc1's wgrad)
    y = blk(x, [3, 3], probs, [3, 3])
    gx, gw = torch.autograd.grad(y.square().sum(), [x, blk[0].weight], create_graph=True)
    # The first-order values are still right.
    w1 = [ref.leaf(w) for w in blk[0].weights()]
    w2 = [ref.leaf(w) for w in blk[2].weights()]
    x64 = ref.leaf(x)
    y_ref = ref.grouped_mlp(x64, [3, 3], probs.detach(), w1, None, w2, None)
    gx_ref, gw_ref = torch.autograd.grad(y_ref.square().sum(), [x64, w1[0]])
    ref.assert_close(gx, gx_ref, dtype, "dx")
    ref.assert_close(gw, gw_ref, dtype, "dweight0")
    for first in (gx, gw):
        for wrt in (x, x0, blk[0].weight, blk[2].weight, probs):
            with pytest.raises(RuntimeError, match="create_graph=True"):
                torch.autograd.grad(first.sum(), wrt, retain_graph=True, allow_unused=True)


def test_repeated_call_grad_of_first_order_grad_raises():
    """A repeated call (float32, device split sizes, the cached plan) refuses the same
    way."""
    blk = _block(torch.float32)
    probs = torch.rand(6, requires_grad=True)
    x = torch.randn(6, H, requires_grad=True)
    split = torch.tensor([3, 3])
    blk(x, split, probs, split).sum().backward()
    for x_in in (x, x * 2):  # a leaf, and a non-leaf input (reached through the saved x)
        y = blk(x_in, split, probs, split)
        assert type(y.grad_fn).__name__ == "_FuserFunctionBackward"
        (gx,) = torch.autograd.grad(y.sum(), x_in, create_graph=True)
        for wrt in (x_in, x, blk[0].weight, blk[2].weight):
            with pytest.raises(RuntimeError, match="create_graph=True"):
                torch.autograd.grad(gx.sum(), wrt, retain_graph=True, allow_unused=True)
    (gx,) = torch.autograd.grad(blk(x, split, probs, split).sum(), x, create_graph=True)
    for wrt in (x, blk[0].weight, blk[2].weight):
        with pytest.raises(RuntimeError, match="create_graph=True"):
            torch.autograd.grad(gx.sum(), wrt, retain_graph=True, allow_unused=True)


# ------------------------------------------- misspelled variable names are caught in any case
# A name that was not exactly "TE_OPS_" + something (te_ops_fusion, TE_OPSFUSION) got no warning
# at all, and TE_OPS_graph_safe got one without the closest name (compared case-sensitively);
# each has no effect, so the user's setting was silently ignored.

# (the cases are in tests/test_autograd_and_input_faults.py::test_misspelled_variable_warns_with_closest_name)


@pytest.mark.parametrize("name", ["TRAIN_MOE_PROGRESS", "MY_TE_OPS_FUSION", "TEX_OPS"])
def test_other_variables_get_no_warning(monkeypatch, recwarn, name):
    from te_ops import env

    monkeypatch.setattr(env, "_WARNED", set())
    monkeypatch.setenv(name, "0")
    te_ops.GroupedLinear(1, 2, 2)(torch.randn(2, 2), [2])
    assert not [w for w in recwarn if "not a te_ops variable" in str(w.message)]


# ------------------------------------ a refused container edit leaves the container unchanged
# Sequential refuses a nested block that takes extra inputs before it replaces its module
# list: append / insert / item assignment raise and leave the module out (else every later
# call would raise the same error, and len() and state_dict() would change).

def _nested_and_outer():
    inner = te_ops.Sequential(te_ops.GroupedLinear(2, 4, 4))  # takes split sizes
    outer = te_ops.Sequential(torch.nn.Identity(), te_ops.GroupedLinear(2, 4, 4))
    return inner, outer


@pytest.mark.parametrize("edit", ["append", "extend", "insert", "setitem"])
def test_refused_module_leaves_the_container_as_it_was(edit):
    inner, outer = _nested_and_outer()
    keys = list(outer.state_dict())
    x = torch.randn(3, 4)
    before = outer(x, [1, 2])
    do = {"append": lambda: outer.append(inner), "extend": lambda: outer.extend([inner]),
          "insert": lambda: outer.insert(0, inner),
          "setitem": lambda: outer.__setitem__(0, inner)}[edit]
    with pytest.raises(ValueError, match="te_ops.Sequential taking 1 extra inputs"):
        do()
    assert [type(m) for m in outer] == [torch.nn.Identity, te_ops.GroupedLinear]
    assert list(outer.state_dict()) == keys
    assert torch.equal(outer(x, [1, 2]), before)


@pytest.mark.parametrize("idx", ["0", 1.0, None])
def test_non_integer_index_names_the_argument(idx):
    _, outer = _nested_and_outer()
    with pytest.raises(TypeError, match=r"idx must be an int or a slice, got"):
        outer[idx]
    with pytest.raises(TypeError, match=r"idx must be an int or a slice, got"):
        outer[idx] = torch.nn.Identity()
    assert outer[torch.tensor(1)] is outer[1]  # an integer 0-d tensor is an index


# ------------------------------------------------- routing helpers name a non-tensor argument
# te_ops.permute / unpermute raised AttributeError ("'list' object has no attribute 'shape'")
# for an argument that is not a tensor, where the block's own ops raise TypeError naming it.

@pytest.mark.parametrize("which", ["x", "top_k_index", "top_k_weights"])
def test_permute_names_a_non_tensor_argument(which):
    args = {"x": torch.randn(3, 4), "top_k_index": torch.tensor([[0, 1], [1, 0], [0, 0]]),
            "top_k_weights": torch.rand(3, 2)}
    args[which] = args[which].tolist()
    expected = "a torch.Tensor or None" if which == "top_k_weights" else "a torch.Tensor"
    with pytest.raises(TypeError, match=f"^{which} must be {expected}, got list"):
        te_ops.permute(args["x"], args["top_k_index"], args["top_k_weights"], 2)


def test_permute_without_weights_and_unpermute_round_trip():
    x = torch.randn(3, 4)
    routed = te_ops.permute(x, torch.tensor([[1], [0], [1]]), None, 2)
    assert routed.probs is None and routed.split_sizes.tolist() == [1, 2]
    torch.testing.assert_close(te_ops.unpermute(routed.x, routed.token_index, 3), x,
                               rtol=0, atol=0)


@pytest.mark.parametrize("which", ["y", "token_index"])
def test_unpermute_names_a_non_tensor_argument(which):
    args = {"y": torch.randn(2, 4), "token_index": torch.tensor([0, 1])}
    args[which] = args[which].tolist()
    with pytest.raises(TypeError, match=f"^{which} must be a torch.Tensor, got list"):
        te_ops.unpermute(args["y"], args["token_index"], 2)


# ------------------------------------------- the main job's flags fail as a parser error
# --hf-model without transformers raised ModuleNotFoundError deep in the run, --lr -1
# torch's "Invalid learning rate" traceback, --compile-backend with a typo torch's
# InvalidBackend after the model was built, and --aux-coef -1 trained with a rewarded
# imbalance without a word.

@pytest.mark.parametrize("argv,match", [
    (["--lr", "-1"], "--lr must be > 0, got -1.0"),
    (["--lr", "nan"], "--lr must be > 0, got nan"),
    (["--aux-coef", "-0.5"], "--aux-coef must be >= 0"),
    (["--compile", "--compile-backend", "inductr"], "--compile-backend must be a torch.compile "
                                                     "backend.*got 'inductr'"),
])
def test_main_job_bad_flags_are_parser_errors(capsys, argv, match):
    from te_ops.examples import train_moe

    with pytest.raises(SystemExit) as exit_:
        train_moe.parse_args(argv)
    assert exit_.value.code == 2
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.parametrize("version,match", [
    (None, "needs transformers>=5, which is not installed: pip install 'te_ops\\[hf\\]'"),
    ("4.57.1", "needs transformers>=5, got 4.57.1"),
])
def test_hf_model_without_transformers_5_is_a_parser_error(monkeypatch, capsys, version,
                                                            match):
    from importlib import metadata

    from te_ops.examples import train_moe

    def fake_version(name):
        if version is None:
            raise metadata.PackageNotFoundError(name)
        return version

    monkeypatch.setattr(metadata, "version", fake_version)
    with pytest.raises(SystemExit):
        train_moe.parse_args(["--hf-model", "mixtral"])
    assert re.search(match, capsys.readouterr().err)


def test_main_job_good_flags_still_parse():
    from te_ops.examples import train_moe

    args = train_moe.parse_args(["--aux-coef", "0", "--compile", "--compile-backend",
                                 "aot_eager", "--lr", "1e-3"])
    assert (args.aux_coef, args.compile_backend, args.lr) == (0.0, "aot_eager", 1e-3)


# ------------------------------------------------------- parameter dtype errors name the value
# GroupedLinear(dtype="float32") said "dtype must be one of (torch.float32, ...), got float32"
# (the string printed like the dtype it names); Bias(dtype=...) had no check at all (torch's
# "zeros(): argument 'dtype' must be torch.dtype, not str", or "Only Tensors of floating point
# ... can require gradients" for torch.int8).

@pytest.mark.parametrize("make", [lambda **k: te_ops.GroupedLinear(2, 4, 4, **k),
                                  lambda **k: te_ops.Bias(4, **k)], ids=["GroupedLinear", "Bias"])
@pytest.mark.parametrize("dtype,got", [("float32", "got str 'float32'"),
                                       (torch.int8, "got torch.int8"),
                                       (torch.complex64, "got torch.complex64")])
def test_parameter_dtype_errors_name_the_value(make, dtype, got):
    with pytest.raises(ValueError, match=re.escape(f"dtype must be one of (torch.float32, "
                                                   f"torch.bfloat16, torch.float16, "
                                                   f"torch.float64), {got}")):
        make(dtype=dtype)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float64])
def test_bias_parameter_dtypes_still_build(dtype):
    op = te_ops.Bias(4, dtype=dtype)
    assert op.bias.dtype == (dtype or torch.get_default_dtype())
    x = torch.randn(3, 4, dtype=op.bias.dtype)
    torch.testing.assert_close(op(x), x + op.bias, rtol=0, atol=0)


# ------------------------------------------- bad split sizes in a CPU tensor name the values
# The device check said only "split_sizes must be non-negative and sum to at most the input's
# rows (10); set TE_OPS_CHECK_SPLIT_SIZES=1 ...", also on the CPU, where the values are in host
# memory and naming them costs no sync. Now a SplitSizesError (ValueError and RuntimeError)
# names them, in every path (fused, unfused, a repeated call, a GroupedLinear alone).

@pytest.mark.parametrize("sizes,match", [
    ([3, 0, 4, 4], r"rows \(10\), got sum 11 \(sizes \[3, 0, 4, 4\]\)"),
    ([3, -1, 5, 3], r"split_sizes\[1\] is -1 \(sizes \[3, -1, 5, 3\]\)"),
    ([3.0, 0.0, 4.5, 2.0], r"split_sizes\[2\] is 4.5, not a whole number"),
    ([3.0, 0.0, float("nan"), 2.0], r"split_sizes\[2\] is nan, not a whole number"),
    ([2**62, 2**62, 0, 0], r"got sum 9223372036854775808"),  # wraps int64 in a cumsum
])
@pytest.mark.parametrize("fusion", ["0", "1"])
def test_bad_cpu_split_sizes_name_the_values(monkeypatch, sizes, match, fusion):
    from te_ops.splits import SplitSizesError

    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    torch.manual_seed(0)
    blk = te_ops.Sequential(te_ops.GroupedLinear(4, H, 2 * FF, bias=False),
                            te_ops.ScaledSwiGLU(),
                            te_ops.GroupedLinear(4, FF, H, bias=False))
    x, probs = torch.randn(10, H, requires_grad=True), torch.rand(10)
    good = torch.tensor([3, 0, 4, 3])
    for _ in range(2):  # the second call reuses the cached plan (fused, tensor sizes)
        first = blk(x, good, probs, good)
        first.sum().backward()
    bad = torch.tensor(sizes)
    for call in (lambda: blk(x, bad, probs, bad),
                 lambda: te_ops.GroupedLinear(4, H, H)(x, bad)):
        with pytest.raises(SplitSizesError, match=match) as err:
            call()
        assert isinstance(err.value, ValueError) and isinstance(err.value, RuntimeError)
        assert "split_sizes must be" in str(err.value)
    again = blk(x, good, probs, good)  # nothing was left half-done
    assert torch.equal(again, first)


# --------------------------------------------- explain() after a call that raised
# A call that raised on bad input (here: a float64 input to float32 weights) still became
# "the last call" for explain(): its plan (input float64, every fusion off because of float64)
# was shown beside the dispatch records of the previous call that did run, naming a wrong
# reason for a call that never ran.

@pytest.mark.parametrize("bad", ["dtype", "width", "splits"])
def test_explain_after_a_failed_call_shows_the_last_call_that_ran(bad):
    blk = _block(torch.float32, bias=True)
    x, probs, split = torch.randn(6, H), torch.rand(6), torch.tensor([3, 3])
    assert "planned without a call" in blk.explain()
    args = {"dtype": (x.double(), split, probs, split),
            "width": (torch.randn(6, H + 1), split, probs, split),
            "splits": (x, torch.tensor([3, 4]), probs, torch.tensor([3, 4]))}[bad]
    with pytest.raises((ValueError, RuntimeError)):
        blk(*args)
    assert "planned without a call" in blk.explain()  # nothing ran yet
    blk(x, split, probs, split)
    before = blk.explain()
    assert "input float32 on cpu" in before and "ForwardGroupedMLP" in before
    with pytest.raises((ValueError, RuntimeError)):
        blk(*args)
    assert blk.explain() == before
    with torch.no_grad():  # a call that runs (another plan) is the last call again
        blk(x, [3, 3], probs, [3, 3])
    assert blk.explain() != before


# ------------------------------------------------------------ use_te_ops names a non-module
def test_use_te_ops_names_a_non_module_model():
    pytest.importorskip("transformers")
    from te_ops.integrations.transformers import use_te_ops

    for bad in (None, "mistralai/Mixtral-8x7B-v0.1"):  # e.g. a checkpoint name, not a model
        with pytest.raises(TypeError, match=f"model must be a torch.nn.Module .*got "
                                            f"{type(bad).__name__}"):
            use_te_ops(bad)


def test_double_backward_gap_is_as_documented():
    """The README's one gap: a non-leaf input the forward did not keep (here a transposed
    view, copied to contiguous rows) is unreachable from the refusing node. If this starts
    raising te_ops' error, drop the gap from the README's support matrix."""
    blk = _block()
    probs = torch.rand(6, dtype=torch.float64)
    x = torch.randn(H, 6, dtype=torch.float64, requires_grad=True)
    xt = x.t()
    y = blk(xt, [3, 3], probs, [3, 3])
    (g,) = torch.autograd.grad(y.square().sum(), xt, create_graph=True)
    assert torch.autograd.grad(g.sum(), xt, allow_unused=True) == (None,)
    with pytest.raises(RuntimeError, match="create_graph=True"):  # through the weights
        torch.autograd.grad(g.sum(), blk[0].weight, allow_unused=True)


# ------------------------------------------------------------- print(block) shows the options
# GroupedLinear's repr left out accumulate_into_main_grad and delay_wgrad_compute, which change
# where the weight gradients go (main_grad / backward_dw() instead of .grad): a printed model
# did not show why .grad stayed None.

def test_repr_names_main_grad_and_delayed_wgrad_when_set():
    plain = repr(te_ops.GroupedLinear(2, 4, 4))
    assert "main_grad" not in plain and "delay" not in plain
    text = repr(te_ops.GroupedLinear(2, 4, 4, accumulate_into_main_grad=True,
                                     delay_wgrad_compute=True))
    assert text.endswith("accumulate_into_main_grad=True, delay_wgrad_compute=True)")
