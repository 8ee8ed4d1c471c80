"""Opt-in fc1 recompute: ``(Scaled)SwiGLU(recompute_input=True)`` (te_ops/fused/fc1_recompute.py).

* With the option on, every fused / unfused forward x backward pairing gives outputs and
  gradients bitwise equal to the option off (same kernels), and matches the fp64 reference.
* The fused forward then saves no activation at all: only probs and split tensors.
* Where the option cannot be honoured (unfused forward, the fused gate refusing, a recipe, fc1
  frozen, no GroupedLinear before the activation) h is saved, ``explain()`` names the reason and
  a warning is given once per op and reason.
* ``torch.compile(fullgraph=True)`` and the meta-device proof run
  it, the weights' in-place check still raises, main_grad / delayed wgrad stay right.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import test_fused_grouped_mlp as base
import torch

import te_ops
from te_ops.fused import BackwardGroupedMLP, ForwardGroupedMLP
from te_ops.fused.fc1_recompute import NO_INPUT_REASON, RECIPE_REASON, UNFUSED_REASON

CASES = ["base", "zero_token_groups", "padding_rows", "empty_batch", "one_group", "no_bias",
         "plain_swiglu_padding", "scale_bias", "interleave_4_padding", "nd_input_padding",
         "loop_backend_odd_dims"]


def twin(master: te_ops.Sequential, case: base.Case, dtype: torch.dtype,
         recompute: bool) -> te_ops.Sequential:
    torch.manual_seed(1)  # another init, overwritten by the state dict
    blk = base.make_block(case, dtype, recompute)
    blk.load_state_dict(master.state_dict())
    return blk


def recompute_record(blk: te_ops.Sequential) -> str:
    return next(r for r in blk[1].dispatch_records() if r.startswith("fc1 recompute"))


# ---------------------------------------------------------------------------- values
@pytest.mark.parametrize("split_kind", ["list", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case_name", CASES)
def test_four_combinations_bitwise_equal_to_option_off(monkeypatch, case_name, dtype,
                                                       split_kind):
    case = base.CASES[case_name]
    torch.manual_seed(0)
    master = base.make_block(case, dtype, False)
    inp = base.make_inputs(case, dtype, split_kind)
    base.set_combo(monkeypatch, False, False)
    off = base.run(twin(master, case, dtype, False), case, inp)
    expected = base.reference_result(case, master, inp)
    for fwd, bwd in base.COMBOS:
        base.set_combo(monkeypatch, fwd, bwd)
        blk = twin(master, case, dtype, True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = base.run(blk, case, inp)
        fwd_types, bwd_types = base.plan_types(blk)
        assert (ForwardGroupedMLP in fwd_types) == fwd and (BackwardGroupedMLP in bwd_types) == bwd
        # honoured exactly when the forward is fused (warned otherwise)
        assert recompute_record(blk).startswith("fc1 recompute: on" if fwd else
                                                "fc1 recompute: off"), recompute_record(blk)
        assert any("recompute_input=True is not honoured" in str(w.message)
                   for w in caught) == (not fwd)
        base.assert_bitwise(got, off, f"recompute on, {(fwd, bwd)} vs option off, unfused")
        base.assert_matches_reference(got, expected, dtype, f"recompute on {(fwd, bwd)}")


def _saved_activation_bytes(blk, case, inp) -> tuple[int, int]:
    """(floating, integer) bytes saved for backward, counted once per storage, leaving out
    the parameters, the input and the caller's probs (as benchmarks/memory_report.py)."""
    leaves = {"x": inp.x.detach().clone().requires_grad_(True)}
    leaves.update({k: v.detach().clone().requires_grad_(True) for k, v in inp.probs.items()})
    own = {t.untyped_storage().data_ptr() for t in (*blk.parameters(), *leaves.values())}
    seen: dict[int, tuple[bool, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            seen[ptr] = (t.is_floating_point(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = blk(leaves["x"], *base.extra_args(case, inp, leaves))
    y.backward(inp.dy)
    return (sum(n for f, n in seen.values() if f), sum(n for f, n in seen.values() if not f))


@pytest.mark.parametrize("case_name", ["base", "padding_rows", "scale_bias", "plain_swiglu",
                                       "nd_input_padding", "no_bias"])
def test_fused_forward_saves_no_activation(monkeypatch, case_name):
    """Option off, fused: h (rows x 2F) is the only floating-point activation saved; on: none
    (only integer split tensors remain, and the group ids with a bias)."""
    case = replace(base.CASES[case_name], lead=(64,), sizes=(20, 0, 30), ffn=16)
    if case_name == "nd_input_padding":
        case = replace(case, lead=(4, 16))
    torch.manual_seed(0)
    master = base.make_block(case, torch.float32, False)
    inp = base.make_inputs(case, torch.float32, "tensor")
    base.set_combo(monkeypatch, True, True)
    off = _saved_activation_bytes(twin(master, case, torch.float32, False), case, inp)
    on = _saved_activation_bytes(twin(master, case, torch.float32, True), case, inp)
    assert off[0] == case.rows * 2 * case.ffn * 4, off
    assert on[0] == 0, on
    assert on[1] == off[1], (on, off)  # the same split tensors


def test_second_backward_through_retained_graph_recomputes(monkeypatch):
    """The fused backward writes dh over the recomputed h, not over a saved tensor: a second
    backward (retain_graph=True) recomputes h again and gives the same gradients."""
    case = base.BASE
    torch.manual_seed(0)
    blk = base.make_block(case, torch.float32, True)
    inp = base.make_inputs(case, torch.float32, "tensor")
    x = inp.x.detach().clone().requires_grad_(True)
    probs = inp.probs["probs"].detach().clone().requires_grad_(True)
    y = blk(x, inp.split1, probs, inp.split2)
    y.backward(inp.dy, retain_graph=True)
    first = [x.grad.clone(), probs.grad.clone()] + [p.grad.clone() for p in blk.parameters()]
    for t in (x, probs, *blk.parameters()):
        t.grad = None
    y.backward(inp.dy)
    second = [x.grad, probs.grad] + [p.grad for p in blk.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("single", [True, False], ids=["packed", "per_expert"])
def test_in_place_weight_change_between_forward_and_backward_raises(single, monkeypatch):
    case = base.BASE
    torch.manual_seed(0)
    blk = base.make_block(case, torch.float32, True, single=single)
    inp = base.make_inputs(case, torch.float32, "tensor")
    y = blk(inp.x, inp.split1, inp.probs["probs"].requires_grad_(True), inp.split2)
    with torch.no_grad():
        (blk[0].weight[1] if single else blk[0].weight1).add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(inp.dy)


# ---------------------------------------------------------------------------- not honoured
def _call(blk, case, inp, **kw):
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inp.probs.items()}
    x = inp.x.detach().clone().requires_grad_(True)
    y = blk(x, *base.extra_args(case, inp, leaves))
    y.backward(inp.dy)
    return y


def _explain(blk) -> str:
    return blk.explain()


@pytest.mark.parametrize("name,value", [("TE_OPS_FUSION", "0"),
                                        ("TE_OPS_FUSION_OFF", "grouped_mlp_forward")])
def test_unfused_forward_saves_h_warns_once_and_explains(monkeypatch, name, value):
    case = base.BASE
    monkeypatch.setenv(name, value)
    torch.manual_seed(0)
    blk = base.make_block(case, torch.float32, True)
    inp = base.make_inputs(case, torch.float32, "tensor")
    with pytest.warns(UserWarning, match="recompute_input=True is not honoured.*ran unfused"):
        _call(blk, case, inp)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per op and reason
        _call(blk, case, inp)
    assert "fc1 recompute: off, h is saved: the activation ran unfused" in _explain(blk)


def test_fused_gate_refusal_is_noted_with_the_recompute_reason(monkeypatch):
    """fc1 and fc2 fed by different split-size lists: the fused gate refuses, and the plan
    notes say recompute_input is not honoured."""
    case = base.BASE
    torch.manual_seed(0)
    blk = base.make_block(case, torch.float32, True)
    inp = replace(base.make_inputs(case, torch.float32, "list"), split2=[3, 1, 4])
    with pytest.warns(UserWarning, match="not honoured"):
        _call(blk, case, inp)
    text = _explain(blk)
    assert "fc1 and fc2 split sizes are not the same source" in text
    assert f"recompute_input not honoured, h is saved: {UNFUSED_REASON}" in text


def test_no_grouped_linear_before_the_activation():
    act = te_ops.ScaledSwiGLU(recompute_input=True)
    blk = te_ops.Sequential(te_ops.Identity(), act)
    x = torch.randn(5, 8, requires_grad=True)
    probs = torch.rand(5, requires_grad=True)
    with pytest.warns(UserWarning, match="not honoured.*ran unfused"):
        blk(x, probs).sum().backward()
    ref_y = te_ops.ScaledSwiGLU()(x, probs)
    assert torch.equal(blk(x, probs), ref_y)
    assert UNFUSED_REASON in _explain(blk)


def test_recipe_saves_h_and_says_why(monkeypatch):
    case = replace(base.BASE, hidden=32, ffn=32, out=32, lead=(16,), sizes=(5, 0, 9))
    torch.manual_seed(0)
    master = base.make_block(case, torch.bfloat16, False)
    inp = base.make_inputs(case, torch.bfloat16, "tensor")
    recipe = te_ops.recipe.Float8CurrentScaling()
    blk = twin(master, case, torch.bfloat16, True)
    with te_ops.autocast(recipe=recipe):
        with pytest.warns(UserWarning, match="not honoured.*a recipe"):
            got = base.run(blk, case, inp)
        want = base.run(twin(master, case, torch.bfloat16, False), case, inp)
        text = blk.explain(inp.x, *base.extra_args(case, inp, inp.probs))
    base.assert_bitwise(got, want, "recipe: option on vs off")
    assert f"fc1 recompute: off, h is saved: {RECIPE_REASON}" in recompute_record(blk)
    assert RECIPE_REASON in text


def test_frozen_fc1_weights_save_h(monkeypatch):
    case = base.BASE
    torch.manual_seed(0)
    master = base.make_block(case, torch.float32, False)
    inp = base.make_inputs(case, torch.float32, "tensor")
    results = []
    for recompute in (True, False):
        blk = twin(master, case, torch.float32, recompute)
        for p in blk[0].parameters():
            p.requires_grad_(False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results.append(base.run(blk, case, inp))
        assert any(NO_INPUT_REASON in str(w.message) for w in caught) == recompute
    base.assert_bitwise(results[0], results[1], "fc1 frozen: option on vs off")


def test_bad_option_type_names_the_argument():
    with pytest.raises(TypeError, match="recompute_input must be a bool, got str"):
        te_ops.SwiGLU(recompute_input="yes")
    with pytest.raises(TypeError, match="recompute_input must be a bool, got int"):
        te_ops.ScaledSwiGLU(recompute_input=1)
    assert "recompute_input=True" in repr(te_ops.ScaledSwiGLU(recompute_input=True))


def test_context_without_input_or_recompute_raises():
    saved = te_ops.basic.SwiGLUSaved(None, None)
    with pytest.raises(RuntimeError, match="no input and no way to recompute it"):
        saved.input()


def test_explain_before_any_call_says_where_it_is_honoured():
    blk = base.make_block(base.BASE, torch.float32, True)
    assert "fc1 recompute: requested (recompute_input=True)" in blk.explain()


# ---------------------------------------------------------------------------- integration
@pytest.mark.parametrize("option", ["delay_wgrad_compute", "accumulate_into_main_grad"])
def test_main_grad_and_delayed_wgrad(monkeypatch, option):
    torch.manual_seed(0)
    results = []
    for recompute in (True, False):
        torch.manual_seed(0)
        blk = te_ops.Sequential(
            te_ops.GroupedLinear(3, 8, 16, **{option: True}),
            te_ops.ScaledSwiGLU(recompute_input=recompute),
            te_ops.GroupedLinear(3, 8, 8, **{option: True}))
        main = {}
        for name, p in blk.named_parameters():
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
            p.grad_added_to_main_grad = False
            main[name] = p.main_grad
        torch.manual_seed(1)
        x = torch.randn(10, 8, requires_grad=True)
        probs = torch.rand(10, requires_grad=True)
        split = torch.tensor([3, 2, 5])
        blk(x, split, probs, split).backward(torch.randn(10, 8))
        if option == "delay_wgrad_compute":
            assert all(p.grad is None for p in blk.parameters())
            blk.backward_dw()
        grads = {n: (p.grad, main[n].clone()) for n, p in blk.named_parameters()}
        results.append((x.grad, probs.grad, grads))
    (x1, p1, g1), (x2, p2, g2) = results
    assert torch.equal(x1, x2) and torch.equal(p1, p2)
    for name in g1:
        for a, b in zip(g1[name], g2[name]):
            assert (a is None and b is None) or torch.equal(a, b), name
    moved = [n for n in g1 if (g1[n][0] is not None) or g1[n][1].abs().sum() > 0]
    assert moved == list(g1)  # every parameter got its gradient somewhere


def test_torch_compile_fullgraph_bit_exact(monkeypatch):
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    blk = te_ops.Sequential(te_ops.GroupedLinear(4, 16, 64), te_ops.ScaledSwiGLU(
        recompute_input=True), te_ops.GroupedLinear(4, 32, 16))

    def fn(x, s, p):
        return blk(x, s, p, s)

    cnt = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True, backend=cnt)
    for sizes in ([3, 0, 5, 2], [1, 1, 1, 7]):
        x = torch.randn(12, 16)
        probs = torch.rand(12)
        split = torch.tensor(sizes)
        outs = []
        for f in (fn, compiled):
            xx, pp = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
            y = f(xx, split, pp)
            y.backward(torch.ones_like(y))
            outs.append([y.detach(), xx.grad, pp.grad, *[p.grad.clone() for p in
                                                         blk.parameters()]])
            blk.zero_grad(set_to_none=True)
        assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert cnt.frame_count == 1
    assert recompute_record(blk).startswith("fc1 recompute: on")


def test_meta_forward_backward_reads_no_device_value(monkeypatch):
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "1")
    blk = te_ops.Sequential(
        te_ops.GroupedLinear(4, 32, 96, device="meta", dtype=torch.bfloat16),
        te_ops.ScaledSwiGLU(recompute_input=True),
        te_ops.GroupedLinear(4, 48, 32, device="meta", dtype=torch.bfloat16))
    x = torch.empty(64, 32, device="meta", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.empty(64, device="meta", requires_grad=True)
    sizes = torch.empty(4, device="meta", dtype=torch.int64)
    y = blk(x, sizes, probs, sizes)
    y.backward(torch.empty_like(y))
    assert x.grad is not None and x.grad.shape == x.shape
    assert all(p.grad is not None for p in blk.parameters())
    assert recompute_record(blk).startswith("fc1 recompute: on")


# ---------------------------------------------------------------------------- benchmarks
def _bench(name: str):
    import importlib
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    return importlib.import_module(name)


def test_memory_report_rows_with_the_option(capsys):
    rows = _bench("memory_report").main(["--experts", "3", "--tokens", "64", "--hidden", "16",
                                         "--ffn", "16", "--no-bias"])
    on = [r for r in rows if r["recompute_input"]]
    off_fused = [r for r in rows if not r["recompute_input"] and r["forward"] ==
                 "ForwardGroupedMLP"]
    assert len(on) == 2 and all(r["forward"] == "ForwardGroupedMLP" for r in on)
    h_bytes = 64 * 2 * 16 * 4  # tokens x 2F fp32: what the option takes out
    for r in on:
        assert off_fused[0]["saved_bytes"] - r["saved_bytes"] == h_bytes, (r, off_fused)
        assert r["saved_vs_unfused"] < 0.6


def test_recompute_layers_smoke(capsys):
    bench = _bench("recompute_layers")
    assert bench.main(["--device", "cpu", "--shape", "E4_T256_H64_FF64", "--layers", "2",
                       "--iters", "1", "--warmup", "0"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    import json

    rows = [json.loads(line) for line in lines]
    assert [r["recompute_input"] for r in rows] == [False, True]
    assert rows[0]["saved_mib_per_block"] == 256 * 128 * 2 / 2**20  # h, bf16
    assert rows[1]["saved_mib_per_block"] == 0
