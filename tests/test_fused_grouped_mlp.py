"""The fused grouped MLP (``GroupedLinear -> (Scaled)SwiGLU -> GroupedLinear``).

* All four combinations of fused/unfused forward and fused/unfused backward give bit-identical
  outputs and gradients, and each matches the independent fp64 reference (``reference.py``).
* The fusion really happens when enabled (the fuser's plan holds the fused ops) and not when
  turned off.
* Gates: chains that do not match are not fused, run correctly unfused, and the reason shows in
  ``grouped_mlp_unsupported_reason``, the plan's notes and ``Sequential.explain()``.
* Saved memory: the fused forward does not save fc2's input.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, replace

import pytest
import reference as ref
import torch
from fusion_env import set_grouped_mlp

import te_ops
from te_ops.fused.grouped_mlp import (
    BackwardGroupedMLP,
    ForwardGroupedMLP,
    grouped_mlp_unsupported_reason,
)
from te_ops.fuser import PlanInfo

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
COMBOS = list(itertools.product((True, False), repeat=2))  # (forward fused, backward fused)


# ---------------------------------------------------------------------------- building blocks
@dataclass(frozen=True)
class Case:
    """One expert-block configuration. ``lead`` is the input's leading shape (rows = prod)."""

    groups: int = 3
    hidden: int = 8
    ffn: int = 8
    out: int = 8
    sizes: tuple[int, ...] = (3, 0, 5)
    lead: tuple[int, ...] = (8,)
    bias1: bool = True
    bias2: bool = True
    scale_bias1: bool = False
    scale_bias2: bool = False
    scaled: bool = True
    interleave: int | None = None

    @property
    def rows(self) -> int:
        n = 1
        for d in self.lead:
            n *= d
        return n


BASE = Case()
CASES = {
    "base": BASE,
    "zero_token_groups": replace(BASE, groups=4, sizes=(0, 4, 0, 3), lead=(7,)),
    "padding_rows": replace(BASE, sizes=(2, 0, 3), lead=(9,)),
    "all_padding": replace(BASE, sizes=(0, 0, 0), lead=(4,)),
    "empty_batch": replace(BASE, sizes=(0, 0, 0), lead=(0,)),
    "empty_batch_interleave": replace(BASE, sizes=(0, 0, 0), lead=(0,), interleave=2),
    "one_group": replace(BASE, groups=1, sizes=(6,), lead=(6,)),
    "no_bias": replace(BASE, bias1=False, bias2=False),
    "bias_fc1_only": replace(BASE, bias2=False),
    "plain_swiglu": replace(BASE, scaled=False),
    "plain_swiglu_padding": replace(BASE, scaled=False, sizes=(1, 2, 2), lead=(7,)),
    "scale_bias": replace(BASE, scale_bias1=True, scale_bias2=True, sizes=(2, 3, 1), lead=(8,)),
    "scale_bias_fc2_plain_swiglu": replace(BASE, scaled=False, scale_bias2=True),
    "interleave_2": replace(BASE, interleave=2),
    "interleave_4_padding": replace(BASE, interleave=4, ffn=16, sizes=(4, 1, 0), lead=(6,)),
    "nd_input_t1h": replace(BASE, lead=(8, 1)),
    "nd_input_padding": replace(BASE, lead=(2, 5), sizes=(3, 3, 1), scale_bias2=True),
    "loop_backend_odd_dims": replace(BASE, hidden=6, ffn=5, out=3, sizes=(2, 2, 3), lead=(8,)),
}


def make_block(case: Case, dtype: torch.dtype, recompute: bool = False,
               single: bool = True) -> te_ops.Sequential:
    """fc1 -> (Scaled)SwiGLU -> fc2 of ``case`` in ``dtype``; ``recompute``: the activation's
    ``recompute_input`` (``tests/test_fc1_recompute.py``); ``single``: the parameter layout
    (``single_grouped_weight``)."""
    act = (te_ops.ScaledSwiGLU if case.scaled else te_ops.SwiGLU)(
        glu_interleave_size=case.interleave, recompute_input=recompute)
    return te_ops.Sequential(
        te_ops.GroupedLinear(case.groups, case.hidden, 2 * case.ffn, bias=case.bias1,
                             scale_bias=case.scale_bias1, single_grouped_weight=single,
                             dtype=dtype),
        act,
        te_ops.GroupedLinear(case.groups, case.ffn, case.out, bias=case.bias2,
                             scale_bias=case.scale_bias2, single_grouped_weight=single,
                             dtype=dtype),
    )


@dataclass
class Inputs:
    """The leaves of one call (cloned per run so every run has fresh ``.grad``)."""

    x: torch.Tensor
    probs: dict[str, torch.Tensor]
    split1: list[int] | torch.Tensor
    split2: list[int] | torch.Tensor
    dy: torch.Tensor


def make_inputs(case: Case, dtype: torch.dtype, split_kind: str,
                x_requires_grad: bool = True) -> Inputs:
    x = torch.randn(*case.lead, case.hidden, dtype=dtype)
    probs = {}
    if case.scale_bias1:
        probs["probs1"] = torch.rand(case.rows, dtype=dtype)
    if case.scaled:
        probs["probs"] = torch.rand(case.rows, dtype=dtype)
    if case.scale_bias2:
        probs["probs2"] = torch.rand(case.rows, dtype=dtype)
    split = ref.split_arg(case.sizes, split_kind, "cpu")
    x.requires_grad_(x_requires_grad)
    return Inputs(x, probs, split, split, torch.randn(*case.lead, case.out, dtype=dtype))


def extra_args(case: Case, inp: Inputs, leaves: dict[str, torch.Tensor]) -> list:
    args: list = [inp.split1]
    if case.scale_bias1:
        args.append(leaves["probs1"])
    if case.scaled:
        args.append(leaves["probs"])
    args.append(inp.split2)
    if case.scale_bias2:
        args.append(leaves["probs2"])
    return args


def run(blk: te_ops.Sequential, case: Case, inp: Inputs
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """Forward + backward of ``blk``; returns the output and every gradient by name."""
    leaves = {"x": inp.x.detach().clone().requires_grad_(inp.x.requires_grad)}
    leaves.update({k: v.detach().clone().requires_grad_(True) for k, v in inp.probs.items()})
    y = blk(leaves["x"], *extra_args(case, inp, leaves))
    y.backward(inp.dy)
    grads = {k: v.grad for k, v in leaves.items()}
    grads.update({name: p.grad for name, p in blk.named_parameters()})
    return y.detach(), grads


def plan_types(blk: te_ops.Sequential) -> tuple[set[type], set[type]]:
    plan = blk.fusers()[0]._plan
    assert plan is not None
    return ({type(op) for op, _ in plan.forward_ops}, {type(op) for op, _ in plan.backward_ops})


def notes(blk: te_ops.Sequential) -> list[tuple[str, str]]:
    return list(blk.fusers()[0]._plan.info.notes)


def packed_grads(grads: dict[str, torch.Tensor | None], groups: int
                 ) -> dict[str, torch.Tensor | None]:
    """Per-expert gradients (``"0.weight3"``) as the packed layout's (G, ...) ones
    (``"0.weight"``); other entries as they are."""
    out: dict[str, torch.Tensor | None] = {}
    for k, v in grads.items():
        m = re.fullmatch(r"(\d+\.(?:weight|bias))(\d+)", k)
        if m is None:
            out[k] = v
        elif m.group(2) == "0":
            parts = [grads[f"{m.group(1)}{g}"] for g in range(groups)]
            out[m.group(1)] = None if parts[0] is None else torch.stack(parts)
    return out


def assert_bitwise(a: tuple, b: tuple, what: str) -> None:
    (ya, ga), (yb, gb) = a, b
    assert torch.equal(ya, yb), f"{what}: outputs differ"
    assert ga.keys() == gb.keys()
    for k in ga:
        if ga[k] is None or gb[k] is None:
            assert ga[k] is None and gb[k] is None, f"{what}: grad {k} is None on one side only"
        else:
            assert torch.equal(ga[k], gb[k]), (
                f"{what}: grad {k} differs (max abs diff "
                f"{(ga[k].double() - gb[k].double()).abs().max().item()})")


def reference_result(case: Case, blk: te_ops.Sequential, inp: Inputs,
                     sizes2: tuple[int, ...] | None = None):
    """fp64 output and gradients of the same block, by the independent reference."""
    fc1, _, fc2 = list(blk)
    leaves = {"x": ref.leaf(inp.x)}
    leaves.update({k: ref.leaf(v) for k, v in inp.probs.items()})
    leaves.update({f"0.{n}": ref.leaf(p) for n, p in fc1.named_parameters()})
    leaves.update({f"2.{n}": ref.leaf(p) for n, p in fc2.named_parameters()})

    def params(lv, prefix, kind, n):
        return ref.expert_params(lv, f"{prefix}.", kind, n)

    def fn(lv):
        h = ref.grouped_linear(lv["x"], params(lv, 0, "weight", fc1.num_groups),
                               params(lv, 0, "bias", fc1.num_groups), list(case.sizes),
                               lv.get("probs1"))
        if case.scaled:
            a = ref.scaled_swiglu(h, lv["probs"], case.interleave)
        else:
            a = ref.swiglu(h, case.interleave)
        return ref.grouped_linear(a, params(lv, 2, "weight", fc2.num_groups),
                                  params(lv, 2, "bias", fc2.num_groups),
                                  list(sizes2 or case.sizes), lv.get("probs2"))

    return ref.forward_backward(fn, leaves, inp.dy)


def assert_matches_reference(result, expected, dtype: torch.dtype, what: str) -> None:
    y, grads = result
    y_ref, g_ref = expected
    ref.assert_close(y, y_ref, dtype, f"{what}: output")
    for k, g in g_ref.items():
        if grads[k] is None:  # frozen parameter / input without grad
            continue
        ref.assert_close(grads[k], g, dtype, f"{what}: grad {k}")


def set_combo(monkeypatch: pytest.MonkeyPatch, fwd: bool, bwd: bool) -> None:
    set_grouped_mlp(monkeypatch, fwd, bwd)


# ---------------------------------------------------------------------------- four combinations
@pytest.mark.parametrize("split_kind", ["list", "tensor"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case_name", list(CASES))
def test_four_combinations_bit_identical(monkeypatch, case_name, dtype, split_kind):
    case = CASES[case_name]
    torch.manual_seed(0)
    master = make_block(case, dtype)
    inp = make_inputs(case, dtype, split_kind)
    results = {}
    for single in (True, False):  # both parameter layouts, loaded from the packed master
        for fwd, bwd in COMBOS:
            set_combo(monkeypatch, fwd, bwd)
            torch.manual_seed(1)  # a different init, overwritten by the state dict
            blk = make_block(case, dtype, single=single)
            blk.load_state_dict(master.state_dict())
            out, grads = run(blk, case, inp)
            if not single:
                grads = packed_grads(grads, case.groups)
            results[single, fwd, bwd] = (out, grads)
            fwd_types, bwd_types = plan_types(blk)
            assert (ForwardGroupedMLP in fwd_types) == fwd, (fwd, bwd, fwd_types)
            assert (BackwardGroupedMLP in bwd_types) == bwd, (fwd, bwd, bwd_types)

    expected = reference_result(case, master, inp)
    for combo, result in results.items():
        assert_bitwise(result, results[True, False, False], f"{combo} vs unfused packed")
        assert_matches_reference(result, expected, dtype, f"{combo}")
    # every leaf and parameter got a gradient
    assert all(g is not None for g in results[True, True, True][1].values())


def test_fusion_off_globally(monkeypatch):
    case = CASES["padding_rows"]
    torch.manual_seed(0)
    master = make_block(case, torch.float32)
    inp = make_inputs(case, torch.float32, "tensor")
    fused = run(master, case, inp)
    assert plan_types(master) == ({ForwardGroupedMLP}, {BackwardGroupedMLP})
    assert notes(master) == []

    monkeypatch.setenv("TE_OPS_FUSION", "0")
    blk = make_block(case, torch.float32)
    blk.load_state_dict(master.state_dict())
    unfused = run(blk, case, inp)
    fwd_types, bwd_types = plan_types(blk)
    assert ForwardGroupedMLP not in fwd_types and BackwardGroupedMLP not in bwd_types
    assert ("grouped_mlp_forward", "TE_OPS_FUSION=0 turns every fusion off") in notes(blk)
    assert ("grouped_mlp_backward", "TE_OPS_FUSION=0 turns every fusion off") in notes(blk)
    assert_bitwise(fused, unfused, "TE_OPS_FUSION=1 vs 0")


@pytest.mark.parametrize("fusion", ["grouped_mlp_forward", "grouped_mlp_backward"])
def test_per_fusion_toggle_is_noted(monkeypatch, fusion):
    monkeypatch.setenv("TE_OPS_FUSION_OFF", f" {fusion}, ")  # blanks and empty entries ignored
    torch.manual_seed(0)
    blk = make_block(BASE, torch.float32)
    run(blk, BASE, make_inputs(BASE, torch.float32, "list"))
    assert (fusion, f"TE_OPS_FUSION_OFF lists {fusion}") in notes(blk)


def test_plan_follows_env_changes_on_one_module(monkeypatch):
    """The plan is cached but recomputed when a toggle changes between calls."""
    torch.manual_seed(0)
    blk = make_block(BASE, torch.float32)
    inp = make_inputs(BASE, torch.float32, "tensor")
    first = run(blk, BASE, inp)
    assert plan_types(blk) == ({ForwardGroupedMLP}, {BackwardGroupedMLP})
    monkeypatch.setenv("TE_OPS_FUSION_OFF", "grouped_mlp_forward")
    blk.zero_grad(set_to_none=True)
    second = run(blk, BASE, inp)
    fwd_types, bwd_types = plan_types(blk)
    assert ForwardGroupedMLP not in fwd_types and BackwardGroupedMLP in bwd_types
    assert_bitwise(first, second, "before/after toggle")


# ---------------------------------------------------------------------------- gates
def _explain_or_skip(blk: te_ops.Sequential, *sample) -> str | None:
    if not hasattr(blk, "explain"):
        return None
    try:
        return blk.explain(*sample)
    except ImportError:  # te_ops.ir not available
        return None


def _assert_reason(blk: te_ops.Sequential, fusion: str, fragment: str) -> None:
    reasons = [r for name, r in notes(blk) if name == fusion]
    assert any(fragment in r for r in reasons), (fragment, notes(blk))
    text = _explain_or_skip(blk)
    if text is not None:
        assert fragment in text, text


def _unfused_twin(monkeypatch, blk: te_ops.Sequential, build) -> te_ops.Sequential:
    """A copy of ``blk`` (same state) that runs with every fusion off, for bitwise checks."""
    with monkeypatch.context() as m:
        m.setenv("TE_OPS_FUSION", "0")
        twin = build()
        twin.load_state_dict(blk.state_dict())
    return twin


def test_wrong_dims_reason_direct():
    fc1 = te_ops.GroupedLinear(2, 8, 16)
    act = te_ops.SwiGLU()
    fc2 = te_ops.GroupedLinear(2, 6, 8)
    sizes = [3, 4]
    info = PlanInfo(dtype=torch.float32, device=torch.device("cpu"), basic_ops=[fc1, act, fc2],
                    extra_inputs=[(sizes,), (), (sizes,)], requires_grad=[True] * 3)
    reason = grouped_mlp_unsupported_reason(fc1, act, fc2, info)
    assert reason == "fc1.out_features=16 != 2 * fc2.in_features=12"
    good = te_ops.GroupedLinear(2, 8, 8)
    info.basic_ops = [fc1, act, good]
    assert grouped_mlp_unsupported_reason(fc1, act, good, info) is None


def test_wrong_dims_chain_is_planned_unfused_with_reason():
    """fc1 out=16 but fc2 in=6: the plan says why; running fails on fc2's input shape."""
    torch.manual_seed(0)
    blk = te_ops.Sequential(te_ops.GroupedLinear(2, 8, 16), te_ops.SwiGLU(),
                            te_ops.GroupedLinear(2, 6, 8))
    x = torch.randn(7, 8, requires_grad=True)
    sizes = [3, 4]
    plan = blk.fusers()[0].plan(x, sizes, sizes)
    assert not any(op.is_fused_op for op, _ in plan.forward_ops + plan.backward_ops)
    reason = "fc1.out_features=16 != 2 * fc2.in_features=12"
    assert any(reason in r for _, r in plan.info.notes), plan.info.notes
    text = _explain_or_skip(blk, x, sizes, sizes)
    if text is not None:
        assert reason in text
    with pytest.raises(ValueError, match="in_features=6"):
        blk(x, sizes, sizes)


@pytest.mark.parametrize("middle,fragment", [
    ("bias_after_act", "the op after the activation is Bias, not GroupedLinear"),
    ("identity_before_act", "the op after fc1 is Identity, not SwiGLU / ScaledSwiGLU"),
])
def test_broken_pattern_runs_unfused(monkeypatch, middle, fragment):
    """fc1 -> SwiGLU -> Bias -> fc2 (or fc1 -> Identity -> SwiGLU -> fc2): not fused, correct."""
    g, h, f = 3, 8, 8

    def build():
        ops = [te_ops.GroupedLinear(g, h, 2 * f), te_ops.SwiGLU(), te_ops.GroupedLinear(g, f, h)]
        if middle == "bias_after_act":
            ops.insert(2, te_ops.Bias(f))
        else:
            ops.insert(1, te_ops.Identity())
        return te_ops.Sequential(*ops)

    torch.manual_seed(0)
    blk = build()
    if middle == "bias_after_act":
        with torch.no_grad():
            blk[2].bias.normal_()
    sizes = [2, 0, 5]
    x = torch.randn(9, h, requires_grad=True)
    dy = torch.randn(9, h)
    y = blk(x, sizes, sizes)
    y.backward(dy)
    fwd_types, bwd_types = plan_types(blk)
    assert ForwardGroupedMLP not in fwd_types and BackwardGroupedMLP not in bwd_types
    _assert_reason(blk, "grouped_mlp_forward", fragment)
    _assert_reason(blk, "grouped_mlp_backward", fragment)

    twin = _unfused_twin(monkeypatch, blk, build)
    x2 = x.detach().clone().requires_grad_(True)
    with monkeypatch.context() as m:
        m.setenv("TE_OPS_FUSION", "0")
        y2 = twin(x2, sizes, sizes)
        y2.backward(dy)
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)

    fc1, fc2 = blk[0], blk[len(blk) - 1]
    leaves = {"x": ref.leaf(x)}
    for prefix, op in (("1", fc1), ("2", fc2)):
        leaves.update({f"{prefix}.{n}": ref.leaf(p) for n, p in op.named_parameters()})
    bias_vec = ref.leaf(blk[2].bias) if middle == "bias_after_act" else None

    def fn(lv):
        hh = ref.grouped_linear(lv["x"], ref.expert_params(lv, "1.", "weight", g),
                                ref.expert_params(lv, "1.", "bias", g), sizes)
        a = ref.swiglu(hh)
        if bias_vec is not None:
            a = ref.bias(a, bias_vec)
        return ref.grouped_linear(a, ref.expert_params(lv, "2.", "weight", g),
                                  ref.expert_params(lv, "2.", "bias", g), sizes)

    y_ref, g_ref = ref.forward_backward(fn, leaves, dy)
    ref.assert_close(y, y_ref, torch.float32, "output")
    ref.assert_close(x.grad, g_ref["x"], torch.float32, "grad x")
    ref.assert_close(fc1.weight.grad, g_ref["1.weight"], torch.float32, "fc1 weight")
    ref.assert_close(fc2.bias.grad, g_ref["2.bias"], torch.float32, "fc2 bias")


def test_different_group_counts_not_fused(monkeypatch):
    case = replace(BASE, groups=2, sizes=(3, 5))
    sizes2 = (2, 2, 4)

    def build():
        return te_ops.Sequential(te_ops.GroupedLinear(2, 8, 16), te_ops.ScaledSwiGLU(),
                                 te_ops.GroupedLinear(3, 8, 8))

    torch.manual_seed(0)
    blk = build()
    inp = make_inputs(case, torch.float32, "list")
    inp.split2 = list(sizes2)
    result = run(blk, case, inp)
    fwd_types, bwd_types = plan_types(blk)
    assert ForwardGroupedMLP not in fwd_types and BackwardGroupedMLP not in bwd_types
    _assert_reason(blk, "grouped_mlp_forward", "fc1 has 2 groups, fc2 has 3")

    with monkeypatch.context() as m:
        m.setenv("TE_OPS_FUSION", "0")
        twin = build()
        twin.load_state_dict(blk.state_dict())
        assert_bitwise(result, run(twin, case, inp), "gate vs all-off")
    expected = reference_result(case, blk, inp, sizes2=sizes2)
    assert_matches_reference(result, expected, torch.float32, "different group counts")


def test_float64_not_fused():
    torch.manual_seed(0)
    blk = make_block(BASE, torch.float64)
    inp = make_inputs(BASE, torch.float64, "tensor")
    result = run(blk, BASE, inp)
    fwd_types, bwd_types = plan_types(blk)
    assert ForwardGroupedMLP not in fwd_types and BackwardGroupedMLP not in bwd_types
    _assert_reason(blk, "grouped_mlp_forward", "dtype torch.float64 is not one of")
    _assert_reason(blk, "grouped_mlp_backward", "dtype torch.float64 is not one of")
    assert_matches_reference(result, reference_result(BASE, blk, inp), torch.float64, "fp64")


SOURCE_FRAGMENT = "fc1 and fc2 split sizes are not the same source"


@pytest.mark.parametrize("source,fused", [
    ("same_tensor", True),
    ("equal_lists", True),
    ("equal_tensors", False),
    ("list_and_tensor", False),
])
def test_split_size_sources(monkeypatch, source, fused):
    sizes = list(BASE.sizes)
    torch.manual_seed(0)
    blk = make_block(BASE, torch.float32)
    inp = make_inputs(BASE, torch.float32, "list")
    if source == "same_tensor":
        inp.split1 = inp.split2 = torch.tensor(sizes)
    elif source == "equal_lists":
        inp.split1, inp.split2 = list(sizes), list(sizes)
        assert inp.split1 is not inp.split2
    elif source == "equal_tensors":
        inp.split1, inp.split2 = torch.tensor(sizes), torch.tensor(sizes)
    else:
        inp.split1, inp.split2 = list(sizes), torch.tensor(sizes)
    result = run(blk, BASE, inp)
    fwd_types, bwd_types = plan_types(blk)
    assert (ForwardGroupedMLP in fwd_types) == fused
    assert (BackwardGroupedMLP in bwd_types) == fused
    if not fused:
        _assert_reason(blk, "grouped_mlp_forward", SOURCE_FRAGMENT)
        _assert_reason(blk, "grouped_mlp_backward", SOURCE_FRAGMENT)
    else:
        assert notes(blk) == []

    with monkeypatch.context() as m:
        m.setenv("TE_OPS_FUSION", "0")
        twin = make_block(BASE, torch.float32)
        twin.load_state_dict(blk.state_dict())
        assert_bitwise(result, run(twin, BASE, inp), f"{source}: default vs all-off")
    assert_matches_reference(result, reference_result(BASE, blk, inp), torch.float32, source)


def test_split_source_change_replans():
    """Same module: a shared tensor fuses; two equal tensors on the next call do not."""
    torch.manual_seed(0)
    blk = make_block(BASE, torch.float32)
    inp = make_inputs(BASE, torch.float32, "tensor")
    run(blk, BASE, inp)
    assert plan_types(blk)[0] == {ForwardGroupedMLP}
    inp.split2 = inp.split1.clone()
    blk.zero_grad(set_to_none=True)
    run(blk, BASE, inp)
    assert ForwardGroupedMLP not in plan_types(blk)[0]
    _assert_reason(blk, "grouped_mlp_forward", SOURCE_FRAGMENT)


@pytest.mark.parametrize("scaled", [True, False], ids=["scaled_swiglu", "swiglu"])
def test_backward_not_fused_when_fc1_needs_no_grad(monkeypatch, scaled):
    """x without grad and fc1 frozen: fc1 is out of backward, so only the forward is fused."""
    case = replace(BASE, scaled=scaled, sizes=(2, 0, 4))

    def build():
        blk = make_block(case, torch.float32)
        for p in blk[0].parameters():
            p.requires_grad_(False)
        return blk

    torch.manual_seed(0)
    blk = build()
    inp = make_inputs(case, torch.float32, "tensor", x_requires_grad=False)
    result = run(blk, case, inp)
    fwd_types, bwd_types = plan_types(blk)
    assert ForwardGroupedMLP in fwd_types
    assert BackwardGroupedMLP not in bwd_types
    fragment = "not every op of the chain takes part in backward"
    _assert_reason(blk, "grouped_mlp_backward", fragment)
    assert not any(name == "grouped_mlp_forward" for name, _ in notes(blk))
    y, grads = result
    assert grads["x"] is None
    assert all(grads[f"0.{n}"] is None for n, _ in blk[0].named_parameters())
    assert all(grads[f"2.{n}"] is not None for n, _ in blk[2].named_parameters())
    if scaled:
        assert grads["probs"] is not None

    with monkeypatch.context() as m:
        m.setenv("TE_OPS_FUSION", "0")
        twin = build()
        twin.load_state_dict(blk.state_dict())
        assert_bitwise(result, run(twin, case, inp), "partly fused vs all-off")
    assert_matches_reference(result, reference_result(case, blk, inp), torch.float32,
                             "fc1 frozen")


def test_backward_fused_when_only_fc1_params_frozen(monkeypatch):
    """fc1 frozen but x needs grad: the whole chain is in backward, so it is fused."""
    torch.manual_seed(0)
    blk = make_block(BASE, torch.float32)
    for p in blk[0].parameters():
        p.requires_grad_(False)
    inp = make_inputs(BASE, torch.float32, "list")
    result = run(blk, BASE, inp)
    assert plan_types(blk) == ({ForwardGroupedMLP}, {BackwardGroupedMLP})
    assert all(result[1][f"0.{n}"] is None for n, _ in blk[0].named_parameters())
    assert result[1]["x"] is not None
    with monkeypatch.context() as m:
        m.setenv("TE_OPS_FUSION", "0")
        twin = make_block(BASE, torch.float32)
        twin.load_state_dict(blk.state_dict())
        for p in twin[0].parameters():
            p.requires_grad_(False)
        assert_bitwise(result, run(twin, BASE, inp), "fc1 frozen: fused vs all-off")


# ---------------------------------------------------------------------------- saved memory
def _saved_bytes(blk: te_ops.Sequential, case: Case, inp: Inputs) -> dict[str, int]:
    """Bytes handed to ``save_for_backward`` during one forward, floating point and integer.

    Every pack-hook call counts (no de-duplication), so the same tensor saved by two ops counts
    twice in both plans alike.
    """
    total = {"float": 0, "int": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        total["float" if t.is_floating_point() else "int"] += t.numel() * t.element_size()
        return t

    leaves = {"x": inp.x.detach().clone().requires_grad_(True)}
    leaves.update({k: v.detach().clone().requires_grad_(True) for k, v in inp.probs.items()})
    args = extra_args(case, inp, leaves)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = blk(leaves["x"], *args)
    y.backward(inp.dy)  # the saved context still works
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case_name", ["base", "padding_rows", "nd_input_padding", "scale_bias",
                                       "plain_swiglu", "interleave_4_padding"])
def test_fused_forward_does_not_save_fc2_input(monkeypatch, case_name, dtype):
    """Fused forward saves exactly fc2's input (tokens x ffn activations) fewer bytes.

    The integer split-size metadata is not part of that count: the unfused fc2 also saves its
    input storage's split sizes / base offsets, so the fused forward saves fewer integer bytes
    too (checked as ``<``).
    """
    case = CASES[case_name]
    torch.manual_seed(0)
    master = make_block(case, dtype)
    inp = make_inputs(case, dtype, "tensor")
    saved = {}
    for fwd in (True, False):
        set_combo(monkeypatch, fwd, True)
        blk = make_block(case, dtype)
        blk.load_state_dict(master.state_dict())
        saved[fwd] = _saved_bytes(blk, case, inp)
        assert (ForwardGroupedMLP in plan_types(blk)[0]) == fwd
    elem = torch.empty((), dtype=dtype).element_size()
    assert saved[False]["float"] - saved[True]["float"] == case.rows * case.ffn * elem, saved
    assert saved[True]["int"] <= saved[False]["int"], saved
