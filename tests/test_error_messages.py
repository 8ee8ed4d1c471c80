"""Errors that name te_ops' own reason, the argument, the expected and the actual value."""

from __future__ import annotations

import json

import pytest
import torch

import te_ops
from te_ops.examples import train_moe


# ------------------------------------------------------------------------------ unpermute
def test_unpermute_num_tokens_too_small_names_it():
    x = torch.randn(5, 4)
    routed = te_ops.permute(x, torch.tensor([[0, 1]] * 5), torch.rand(5, 2), 2)
    y = routed.x
    with pytest.raises(ValueError, match=r"num_tokens must be larger than every token_index "
                                         r"entry .* got num_tokens=3 and token_index in \[0, 4\]"):
        te_ops.unpermute(y, routed.token_index, 3)
    with pytest.raises(ValueError, match=r"num_tokens=0"):
        te_ops.unpermute(y, routed.token_index, 0)
    # neighbours: exactly enough, more than enough (idle rows zero), no rows at all
    out = te_ops.unpermute(y, routed.token_index, 5)
    ref = torch.zeros(5, 4).index_add_(0, routed.token_index, y)
    assert torch.equal(out, ref)
    more = te_ops.unpermute(y, routed.token_index, 7)
    assert torch.equal(more[:5], out) and not more[5:].any()
    assert te_ops.unpermute(y[:0], routed.token_index[:0], 0).shape == (0, 4)


def test_unpermute_negative_token_index_is_named():
    with pytest.raises(ValueError, match=r"token_index in \[-1, 1\]"):
        te_ops.unpermute(torch.ones(2, 3), torch.tensor([-1, 1]), 2)


# ------------------------------------------------------------------------------ bool flags
@pytest.mark.parametrize("name", ["bias", "scale_bias", "single_grouped_weight",
                                  "accumulate_into_main_grad", "delay_wgrad_compute"])
@pytest.mark.parametrize("value", [2, 0, 1, "no", None])
def test_grouped_linear_flags_must_be_bools(name, value):
    with pytest.raises(TypeError, match=rf"{name} must be a bool, got "
                                        rf"{type(value).__name__} \({value!r}\)"):
        te_ops.GroupedLinear(2, 4, 4, **{name: value})


def test_grouped_linear_bool_flags_still_work():
    op = te_ops.GroupedLinear(2, 4, 4, bias=False, single_grouped_weight=True)
    assert not op.has_bias and op.single_grouped_weight


# ------------------------------------------------------------------------------ main job
@pytest.mark.parametrize("argv,message", [
    (["--seq-len", "100000"], "--seq-len must be <= "),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--preset", "long"], "argument --preset: invalid choice: 'long'"),
])
def test_main_job_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        train_moe.parse_args(argv)
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_main_job_longest_seq_len_is_accepted():
    longest = train_moe.corpus_sizes()[1] - 2
    assert train_moe.parse_args(["--seq-len", str(longest)]).seq_len == longest
    with pytest.raises(SystemExit):
        train_moe.parse_args(["--seq-len", str(longest + 1)])


def test_main_job_threads_default_and_metrics_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAIN_MOE_PROGRESS", "0")
    assert train_moe.parse_args([]).threads == 1  # CPU default
    assert train_moe.parse_args(["--threads", "2"]).threads == 2
    before = torch.get_num_threads()
    tiny = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--layers", "1",
            "--d-model", "16", "--heads", "2", "--experts", "2", "--top-k", "1", "--ffn",
            "16", "--eval-every", "2", "--eval-batches", "1", "--out-dir", str(tmp_path)]
    metrics = train_moe.main(tiny)
    assert torch.get_num_threads() == before  # the caller's thread count is restored
    env = json.loads((tmp_path / "metrics.json").read_text())["environment"]
    assert env == metrics["environment"]
    assert env["threads"] == 1
    assert env["torch"] == torch.__version__
    assert env["python"].count(".") == 2 and env["cpu"] and env["cpu_capability"]


# ------------------------------------------------------------------------------ torch.compile
def _compile_block():
    torch.manual_seed(0)
    return te_ops.Sequential(te_ops.GroupedLinear(2, 8, 16), te_ops.ScaledSwiGLU(),
                             te_ops.GroupedLinear(2, 8, 8))


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph_breaks", "fullgraph"])
def test_bad_env_value_under_compile_is_te_ops_error(fullgraph, monkeypatch):
    torch._dynamo.reset()
    blk, sizes = _compile_block(), [2, 4]
    x, p = torch.randn(6, 8), torch.rand(6)
    monkeypatch.setenv("TE_OPS_FUSION", "maybe")
    want = (r"environment variable TE_OPS_FUSION must be one of "
            r"\['0', '1'\], got 'maybe'")
    compiled = torch.compile(lambda x: blk(x, sizes, p, sizes), backend="eager",
                             fullgraph=fullgraph)
    if fullgraph:  # te_ops' reason in the first lines of Dynamo's error
        with pytest.raises(torch._dynamo.exc.Unsupported) as info:
            compiled(x)
        assert str(info.value).find("te_ops: environment variable") < 200
    else:  # te_ops' own exception
        with pytest.raises(ValueError, match=want):
            compiled(x)
    monkeypatch.delenv("TE_OPS_FUSION")
    torch._dynamo.reset()
    torch.testing.assert_close(compiled(x), blk(x, sizes, p, sizes), rtol=0, atol=0)


def test_fusion_off_with_an_unknown_name_names_the_variable_and_the_fusions(monkeypatch):
    blk, sizes = _compile_block(), [2, 4]
    x, p = torch.randn(6, 8), torch.rand(6)
    monkeypatch.setenv("TE_OPS_FUSION_OFF", "grouped_mlp_forward,grouped_mlp_fwd")
    with pytest.raises(ValueError, match=r"environment variable TE_OPS_FUSION_OFF names "
                                         r"\['grouped_mlp_fwd'\], which are not registered "
                                         r"fusions \(registered: .*'grouped_mlp_forward'.*"
                                         r"comma-separated.*did you mean grouped_mlp_forward\?"):
        blk(x, sizes, p, sizes)
    for fullgraph in (False, True):  # compiled: the same message, raised before the trace
        torch._dynamo.reset()
        compiled = torch.compile(lambda x: blk(x, sizes, p, sizes), backend="eager",
                                 fullgraph=fullgraph)
        with pytest.raises(torch._dynamo.exc.Unsupported if fullgraph else ValueError,
                           match=r"TE_OPS_FUSION_OFF names \['grouped_mlp_fwd'\]"):
            compiled(x)
    monkeypatch.setenv("TE_OPS_FUSION_OFF", "grouped_mlp_forward")
    blk(x, sizes, p, sizes)
    torch._dynamo.reset()


@pytest.mark.parametrize("name,instead", [
    ("TE_OPS_FUSE_GROUPED_MLP_FORWARD", "TE_OPS_FUSION_OFF=grouped_mlp_forward"),
    ("TE_OPS_FUSE_GROUPED_MLP_BACKWARD", "TE_OPS_FUSION_OFF=grouped_mlp_backward"),
    ("TE_OPS_FUSE_PERMUTE_FC1", "TE_OPS_FUSION_OFF=permute_fc1_forward"),
    ("TE_OPS_FUSE_FC2_COMBINE", "TE_OPS_FUSION_OFF=fc2_combine_backward"),
])
def test_a_replaced_fusion_variable_raises_naming_its_replacement(monkeypatch, name, instead):
    blk, sizes = _compile_block(), [2, 4]
    x, p = torch.randn(6, 8), torch.rand(6)
    monkeypatch.setenv(name, "0")
    want = (rf"environment variable {name} \(set to '0'\) is no longer read: fusions are on "
            rf"by default \(unset it\), and {instead} turns that fusion off")
    with pytest.raises(ValueError, match=want):
        blk(x, sizes, p, sizes)
    for fullgraph in (False, True):  # compiled: raised before the trace, not inside it
        torch._dynamo.reset()
        compiled = torch.compile(lambda x: blk(x, sizes, p, sizes), backend="eager",
                                 fullgraph=fullgraph)
        with pytest.raises(torch._dynamo.exc.Unsupported if fullgraph else ValueError,
                           match=want):
            compiled(x)
    torch._dynamo.reset()
    monkeypatch.setenv(name, " ")  # empty: the default, as for every variable
    blk(x, sizes, p, sizes)
    monkeypatch.delenv(name)
    blk(x, sizes, p, sizes)


def test_autocast_inside_fullgraph_compile_names_te_ops_autocast():
    torch._dynamo.reset()
    blk, sizes = _compile_block(), [2, 4]
    x, p = torch.randn(6, 8), torch.rand(6)
    recipe = te_ops.recipe.Float8CurrentScaling()

    def f(x):
        with te_ops.autocast(recipe=recipe):
            return blk(x, sizes, p, sizes)

    with pytest.raises(torch._dynamo.exc.Unsupported,
                       match="te_ops.autocast inside a torch.compile'd function: enter "
                             "te_ops.autocast outside the compiled function"):
        torch.compile(f, backend="eager", fullgraph=True)(x)
    torch._dynamo.reset()
    # without fullgraph the autocast block runs eagerly, under its recipe
    got = torch.compile(f, backend="eager")(x)
    torch.testing.assert_close(got, f(x), rtol=0, atol=0)
    # entered outside the compiled function: traced under the recipe
    torch._dynamo.reset()
    with te_ops.autocast(recipe=recipe):
        outside = torch.compile(lambda x: blk(x, sizes, p, sizes), backend="eager",
                                fullgraph=True)(x)
    torch.testing.assert_close(outside, f(x), rtol=0, atol=0)


# ------------------------------------------------------------------------------ retained graph
@pytest.mark.parametrize("warm_calls", [0, 3], ids=["first_call", "fast_path"])
def test_second_backward_after_fused_backward_names_the_switch(warm_calls):
    blk, sizes = _compile_block(), [2, 4]
    x, p = torch.randn(6, 8, requires_grad=True), torch.rand(6, requires_grad=True)
    for _ in range(warm_calls):  # later calls reuse the cached plan
        blk(x, sizes, p, sizes).sum().backward()
    y = blk(x, sizes, p, sizes)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"te_ops: second backward through a retained graph"
                                           r".*TE_OPS_FUSION_OFF=grouped_mlp_backward"):
        y.sum().backward()


def test_second_backward_with_unfused_backward_works(monkeypatch):
    monkeypatch.setenv("TE_OPS_FUSION_OFF", "grouped_mlp_backward")
    blk, sizes = _compile_block(), [2, 4]
    x = torch.randn(6, 8, requires_grad=True)
    p = torch.rand(6)
    y = blk(x, sizes, p, sizes)
    y.sum().backward(retain_graph=True)
    once = x.grad.clone()
    y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * once, rtol=0, atol=0)
