"""Auto dispatch of the warp-specialized Gluon wgrad (``BackendChoice.gluon_kinds``, the
Gluon wgrad rows of ``te_ops.gemm.rules``; kernel tests: ``tests/test_gluon_wgrad.py``).

CPU (CI): (the rule itself: tests/test_gemm_rules.py) that it is not read off CUDA, the choice's kinds and reason, and the per-call route (operands the kernel cannot take
run ``torch._grouped_mm``, checked against the fp64 reference). CUDA (SM90): a block at >= 1024
rows per group takes it (``explain()`` says so), matches the fp64 per-expert reference, gives
the same bits fused and unfused and with the kernel off (it is bitwise ``torch._grouped_mm``);
with a Gluon wgrad row at few rows, CUDA-graph replay and ``torch.compile(fullgraph=
True)`` of a block equal eager bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from gemm_force import GLUON_WGRAD_ANY, NO_GLUON_WGRAD, with_rows
from block_replay import (
    assert_block_matches_reference,
    assert_graph_and_compile_match_eager,
    run_block,
    run_block_params_first,
)
from reference import assert_close

import te_ops
from te_ops.gemm import dispatch as grouped_gemm
from te_ops.gemm import grouped_wgrad_gluon as gw
from te_ops.gemm import rules
from te_ops.splits import make_splits

CUDA = torch.device("cuda")


def test_not_read_off_cuda_or_when_forced(monkeypatch):
    """The row rule is asked only where auto dispatch runs (CUDA, SM90, bfloat16)."""
    seen = []
    monkeypatch.setattr(grouped_gemm, "gemm_rules", lambda *a: seen.append(a) or {})
    choice = grouped_gemm.select_backend(torch.device("cpu"), torch.bfloat16, 256, 256, True,
                                         rows_per_group=4096.0)
    assert seen == [] and choice.gluon_kinds == ()
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "grouped_mm")
    grouped_gemm.select_backend(torch.device("meta"), torch.bfloat16, 256, 256, True,
                                rows_per_group=4096.0)
    assert seen == []


def test_choice_kinds_reason_and_per_call_route(monkeypatch):
    """A choice with the Gluon wgrad and the persistent fprop/dgrad (the E8 / E32 case): the
    kinds, a reason naming the rule; wgrad on operands the kernel cannot take (here: CPU
    tensors) runs torch._grouped_mm, against the fp64 per-group reference."""
    monkeypatch.setattr(grouped_gemm, "large_auto_reason", lambda *a: None)
    cpu = torch.device("cpu")
    picks = {"wgrad": next(r for r in rules.RULES if r.kind == "wgrad" and r.kernel == "gluon"
                           and r.config == "default")}
    choice = grouped_gemm._select_backend(cpu, torch.float32, 16, 256, True, "auto", "auto",
                                          (), ("fprop", "dgrad"), ("wgrad",), picks)
    assert choice.name == "triton" and choice.gluon_kinds == ("wgrad",)
    assert choice.large_kinds == ("fprop", "dgrad") and choice.triton_kinds == ()
    assert "wgrad in the warp-specialized Gluon wgrad" in choice.reason
    assert "the default config 1.04-1.13x torch._grouped_mm" in choice.reason
    assert "in torch._grouped_mm" not in choice.reason.split("; ")[-1]
    sizes = [3, 0, 5]
    x, dy = torch.randn(10, 16), torch.randn(10, 256)
    splits = make_splits(torch.tensor(sizes), 3, 10, cpu)
    want = torch.zeros(3, 256, 16, dtype=torch.float64)
    start = 0
    for g, m in enumerate(sizes):
        want[g] = dy[start:start + m].double().t() @ x[start:start + m].double()
        start += m
    assert_close(grouped_gemm.grouped_wgrad(x, dy, splits, choice), want, torch.float32,
                 "wgrad")


def test_gluon_takes_wgrad_from_the_other_families(monkeypatch):
    """A Gluon wgrad row put first (tests/gemm_force.py) at 128 rows per group (the
    persistent wgrad's window) or at few rows: the Gluon kernel takes wgrad, the others keep
    the rest."""
    monkeypatch.setattr(grouped_gemm, "large_auto_reason", lambda *a: None)
    monkeypatch.setattr(grouped_gemm, "triton_auto_reason", lambda *a: None)
    cpu = torch.device("cpu")
    both = grouped_gemm._select_backend(cpu, torch.bfloat16, 16, 256, True, "auto", "auto",
                                        ("wgrad",), ("fprop", "dgrad", "wgrad"), ("wgrad",))
    assert both.gluon_kinds == ("wgrad",) and both.triton_kinds == ()
    assert both.large_kinds == ("fprop", "dgrad")


# ---------------------------------------------------------------------------------- CUDA
def _needs_gluon_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon wgrad is dispatched on SM90 only")
    if gw.gluon is None:
        pytest.skip("no Gluon in the installed Triton")


def _block(experts=4, hidden=256, ffn=384, seed=0):
    torch.manual_seed(seed)
    kw = {"bias": False, "device": CUDA, "dtype": torch.bfloat16}
    return te_ops.Sequential(te_ops.GroupedLinear(experts, hidden, 2 * ffn, **kw),
                             te_ops.ScaledSwiGLU(),
                             te_ops.GroupedLinear(experts, ffn, hidden, **kw))


@pytest.mark.cuda
def test_block_at_many_rows_takes_it_and_matches_reference(monkeypatch):
    """4 experts, 4136 rows (1034 per group: one skewed, one empty group, 40 padding rows of
    NaN): auto runs wgrad in the Gluon kernel; outputs and gradients match the fp64
    reference; fused == unfused and == the kernel off (torch._grouped_mm), bit for bit."""
    _needs_gluon_sm90()
    sizes = [2500, 0, 1200, 396]
    rows, hidden = 4136, 256
    x = torch.randn(rows, hidden, device=CUDA, dtype=torch.bfloat16)
    x[sum(sizes):] = float("nan")
    probs = torch.rand(rows, device=CUDA, dtype=torch.bfloat16)
    split = torch.tensor(sizes, device=CUDA)
    dy = torch.randn(rows, hidden, device=CUDA, dtype=torch.bfloat16)
    outs = {}
    for fusion, mode in (("1", "auto"), ("0", "auto"), ("1", "0")):
        monkeypatch.setenv("TE_OPS_FUSION", fusion)
        with_rows(monkeypatch, first=NO_GLUON_WGRAD if mode == "0" else ())
        block = _block()
        outs[fusion, mode] = run_block(block, x, split, probs, dy)[0]
        assert ("warp-specialized Gluon wgrad" in block.explain()) == (mode == "auto")
    for key in (("0", "auto"), ("1", "0")):
        for i, (a, b) in enumerate(zip(outs["1", "auto"], outs[key])):
            assert torch.equal(a, b), f"tensor {i}: {key} differs"
    assert_block_matches_reference(_block(), x, probs, sizes, dy, outs["1", "auto"])


@pytest.mark.cuda
def test_block_graph_replay_and_compile_bitwise_equal_to_eager(monkeypatch):
    """The Gluon wgrad at any row count (a rules row put first): the block captured in one CUDA graph and
    replayed with new split sizes, and compiled with fullgraph=True (the op
    ``te_ops::grouped_wgrad_gluon``): bitwise the eager values."""
    _needs_gluon_sm90()
    with_rows(monkeypatch, first=GLUON_WGRAD_ANY)
    rows, hidden = 512, 256
    gen = torch.Generator(device=CUDA).manual_seed(3)
    x = torch.randn(rows, hidden, device=CUDA, dtype=torch.bfloat16, generator=gen)
    probs = torch.rand(rows, device=CUDA, generator=gen)
    dy = torch.randn(rows, hidden, device=CUDA, dtype=torch.bfloat16, generator=gen)
    split = torch.tensor([200, 0, 180, 100], device=CUDA)
    assert_graph_and_compile_match_eager(_block(), x, split, probs, dy, [10, 300, 0, 170],
                                         "warp-specialized Gluon wgrad")


def test_gluon_wgrad_with_the_gluon_fprop_dgrad_rule(monkeypatch):
    """Both Gluon families in one choice (a Gluon wgrad row and a Gluon fprop/dgrad row): wgrad in the Gluon wgrad, dgrad in the Gluon fprop/dgrad kernel (a subset of the
    persistent kinds), fprop in the persistent Triton kernel; the reason names each."""
    monkeypatch.setattr(grouped_gemm, "large_auto_reason", lambda *a: None)
    cpu = torch.device("cpu")
    choice = grouped_gemm._select_backend(cpu, torch.bfloat16, 2048, 1536, True, "auto",
                                          "auto", (), ("fprop", "dgrad"), ("dgrad", "wgrad"))
    assert choice.large_kinds == ("fprop", "dgrad")
    assert set(choice.gluon_kinds) == {"dgrad", "wgrad"}
    assert "wgrad in the warp-specialized Gluon wgrad" in choice.reason
    assert "of those, dgrad in the warp-specialized Gluon kernel" in choice.reason
    assert "in torch._grouped_mm" not in choice.reason.split("; ")[-1]


def test_block_helpers_on_cpu():
    """``block_replay``'s run and fp64 reference check (used by the CUDA block tests here
    and in test_large_gemm_dispatch) on a CPU block with padding rows and an empty group."""
    torch.manual_seed(0)
    block = te_ops.Sequential(te_ops.GroupedLinear(3, 16, 24, bias=False),
                              te_ops.ScaledSwiGLU(), te_ops.GroupedLinear(3, 12, 16, bias=False))
    sizes = [5, 0, 7]
    x, probs, dy = torch.randn(14, 16), torch.rand(14), torch.randn(14, 16)
    got, _ = run_block(block, x, torch.tensor(sizes), probs, dy)
    assert len(got) == 3 + 2  # x, probs, split; two packed weights
    assert_block_matches_reference(block, x, probs, sizes, dy, got)
    bad = [t.clone() for t in got]
    bad[3][0, 0] += 1.0
    with pytest.raises(AssertionError):
        assert_block_matches_reference(block, x, probs, sizes, dy, bad)


def test_block_helpers_take_a_plain_swiglu_block_on_cpu():
    """``run_block`` on a block without probs (plain SwiGLU) calls ``block(x, split, split)``
    and gives ``None`` for probs.grad; ``run_block_params_first`` then leaves it out."""
    torch.manual_seed(0)
    block = te_ops.Sequential(te_ops.GroupedLinear(3, 16, 24, bias=False), te_ops.SwiGLU(),
                              te_ops.GroupedLinear(3, 12, 16, bias=False))
    x, probs, dy = torch.randn(12, 16), torch.rand(12), torch.randn(12, 16)
    split = torch.tensor([5, 0, 7])
    got, _ = run_block(block, x, split, probs, dy)
    assert got[2] is None and len(got) == 3 + 2
    first, _ = run_block_params_first(block, x, split, probs, dy)
    assert len(first) == 2 + 2
    assert all(torch.equal(a, b) for a, b in zip(first, got[:2] + got[3:]))
