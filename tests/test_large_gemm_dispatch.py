"""Auto dispatch of the persistent many-rows Triton grouped GEMMs (``large_kinds``).

CPU (CI): (the rule itself: tests/test_gemm_rules.py; kinds at and above the threshold, none when the
row count is not known), the reason auto gives where it does not take them (CPU, dtype), and a
mixed choice routing each GEMM kind (wgrad in ``torch._grouped_mm`` against the fp64
reference; fprop / dgrad to the Triton kernels, which refuse a CPU tensor with their reason).
The forced rule (``TE_OPS_GROUPED_GEMM_BACKEND=triton``: all three kinds, wgrad too, in the
persistent kernels at many rows). CUDA: a block at >= 512 rows per group takes them
(``explain()`` says so), matches the fp64 reference, fused equals unfused bit for bit (auto
and forced); with the threshold lowered, the existing
compile (fullgraph, default and reduce-overhead) and CUDA-graph replay checks run on them
bitwise equal to eager.
"""

from __future__ import annotations

import os

import pytest
import torch
from gemm_force import PERSISTENT_FROM_ONE, with_rows
import torch.nn.functional as F
from block_replay import assert_block_matches_reference
from reference import assert_close

import te_ops
from te_ops.gemm import dispatch as grouped_gemm
from te_ops.gemm import grouped_gemm_large_triton as lg
from te_ops.gemm.dispatch import grouped_dgrad, grouped_fprop, grouped_wgrad
from te_ops.splits import make_splits

CUDA = torch.device("cuda")


# ----------------------------------------------------------------------------------- CPU
def test_wgrad_window_choice_routes_wgrad_and_explains(monkeypatch):
    """At 128 rows per group one choice carries all three kinds in the persistent kernels;
    the reason names both rules, and wgrad is routed to the persistent wgrad (which refuses
    the CPU tensor with its own reason)."""
    monkeypatch.setattr(grouped_gemm, "large_auto_reason", lambda *a: None)
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    picks = grouped_gemm.gemm_rules(CUDA, torch.bfloat16, 16, 32, 128.0, "auto")
    assert {k: r.kernel for k, r in picks.items()} == dict.fromkeys(
        ("fprop", "dgrad", "wgrad"), "triton_persistent")
    choice = grouped_gemm._select_backend(cpu, torch.bfloat16, 16, 32, True, "auto", "auto",
                                          (), ("fprop", "dgrad", "wgrad"), (), picks)
    assert choice.large_kinds == ("fprop", "dgrad", "wgrad") and choice.triton_kinds == ()
    assert "wgrad 1.01-1.09x torch._grouped_mm at 64-256 rows per group" in choice.reason
    assert "wgrad in torch._grouped_mm" not in choice.reason
    x, dy = torch.randn(10, 16, dtype=torch.bfloat16), torch.randn(10, 32, dtype=torch.bfloat16)
    splits = make_splits(torch.tensor([3, 0, 5]), 3, 10, cpu)
    with pytest.raises(RuntimeError, match="large-shape Triton grouped wgrad cannot run"):
        grouped_gemm.grouped_wgrad(x, dy, splits, choice)


def test_forced_choice_splits_kinds_between_the_kernel_families(monkeypatch):
    """TE_OPS_GROUPED_GEMM_BACKEND=triton: the persistent kernels for every kind at many rows
    (the reason says so), the few-rows kernels otherwise; wgrad then routes to the persistent
    wgrad (which refuses the CPU tensor with its reason)."""
    monkeypatch.setattr(grouped_gemm, "triton_unsupported_reason", lambda *a: None)
    cpu = torch.device("cpu")
    many = grouped_gemm._select_backend(cpu, torch.bfloat16, 16, 32, True, "triton", "auto",
                                        (), ("fprop", "dgrad", "wgrad"))
    assert many.large_kinds == ("fprop", "dgrad", "wgrad") and many.triton_kinds == ()
    assert "persistent many-rows kernels" in many.reason
    few = grouped_gemm._select_backend(cpu, torch.bfloat16, 16, 32, True, "triton", "auto")
    assert few.triton_kinds == ("fprop", "dgrad", "wgrad") and few.large_kinds == ()
    splits = make_splits(torch.tensor([3, 0, 5]), 3, 10, cpu)
    x, dy = torch.randn(10, 16, dtype=torch.bfloat16), torch.randn(10, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="cannot run: device type cpu is not cuda"):
        grouped_wgrad(x, dy, splits, many)


def test_auto_does_not_take_them_on_cpu_or_off_bf16():
    choice = grouped_gemm.select_backend(torch.device("cpu"), torch.bfloat16, 64, 64, True,
                                         rows_per_group=4096.0)
    assert choice.name == "grouped_mm" and choice.large_kinds == ()
    reason = grouped_gemm.large_auto_reason(torch.device("cpu"), torch.bfloat16, ("fprop",))
    assert "device type cpu is not cuda" in reason
    reason = grouped_gemm.large_auto_reason(CUDA, torch.float32, ("fprop",))
    assert "torch.float32" in reason


def test_mixed_choice_routes_each_gemm_kind(monkeypatch):
    """The rule satisfied (Triton's availability faked on CPU): the choice names the kinds
    and why; wgrad outside ``large_kinds`` runs in torch._grouped_mm (fp64 reference),
    fprop / dgrad go to the persistent kernels, which refuse the CPU tensor with the reason."""
    monkeypatch.setattr(grouped_gemm, "large_auto_reason", lambda *a: None)
    cpu = torch.device("cpu")
    choice = grouped_gemm._select_backend(cpu, torch.float32, 16, 32, True, "auto", "auto",
                                          (), ("fprop", "dgrad"))
    assert choice.name == "triton" and choice.large_kinds == ("fprop", "dgrad")
    assert choice.triton_kinds == ()
    assert "fprop/dgrad in the persistent Triton grouped GEMM" in choice.reason
    assert "wgrad in torch._grouped_mm" in choice.reason
    sizes = [3, 0, 5]
    x, dy = torch.randn(10, 16), torch.randn(10, 32)
    splits = make_splits(torch.tensor(sizes), 3, 10, cpu)
    want = torch.zeros(3, 32, 16, dtype=torch.float64)
    start = 0
    for g, n in enumerate(sizes):
        want[g] = dy[start:start + n].double().t() @ x[start:start + n].double()
        start += n
    assert_close(grouped_wgrad(x, dy, splits, choice), want, torch.float32, "wgrad")
    w = torch.randn(3, 32, 16)
    with pytest.raises(RuntimeError, match="large-shape Triton grouped GEMM cannot run"):
        grouped_fprop(x, w, splits, choice)
    with pytest.raises(RuntimeError, match="large-shape Triton grouped GEMM cannot run"):
        grouped_dgrad(dy, w, splits, choice)


# ---------------------------------------------------------------------------------- CUDA
def _needs_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("auto takes the persistent kernels on SM90 only")


def _block(experts, hidden, ffn, seed=0):
    torch.manual_seed(seed)
    kw = {"bias": False, "device": CUDA, "dtype": torch.bfloat16}
    return te_ops.Sequential(te_ops.GroupedLinear(experts, hidden, 2 * ffn, **kw),
                             te_ops.ScaledSwiGLU(),
                             te_ops.GroupedLinear(experts, ffn, hidden, **kw))


def _run(block, x, probs, splits, dy):
    x = x.detach().clone().requires_grad_(True)
    probs = probs.detach().clone().requires_grad_(True)
    y = block(x, splits, probs, splits)
    y.backward(dy)
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    return [y.detach(), x.grad, probs.grad, *grads]


@pytest.mark.cuda
def test_block_at_many_rows_matches_reference_and_fused_equals_unfused(monkeypatch):
    """4 experts, 2600 rows (one skewed, one empty group, 40 padding rows): auto takes the
    persistent kernels for fprop and dgrad; output and all gradients match the fp64
    per-expert reference; fused and unfused give the same bits (same kernels)."""
    if os.environ.get("TE_OPS_GROUPED_GEMM_BACKEND") != "triton":
        _needs_sm90()
    sizes = [1500, 0, 700, 360]
    rows, hidden, ffn = 2600, 256, 384
    x = torch.randn(rows, hidden, device=CUDA, dtype=torch.bfloat16)
    x[sum(sizes):] = float("nan")  # padding rows: garbage
    probs = torch.rand(rows, device=CUDA, dtype=torch.bfloat16)
    splits = torch.tensor(sizes, device=CUDA)
    dy = torch.randn(rows, hidden, device=CUDA, dtype=torch.bfloat16)
    outs = {}
    for fusion in ("1", "0"):
        monkeypatch.setenv("TE_OPS_FUSION", fusion)
        block = _block(4, hidden, ffn)
        outs[fusion] = _run(block, x, probs, splits, dy)
        text = block.explain()
        assert ("persistent Triton grouped GEMM" in text
                or "persistent many-rows kernels" in text), text
    for i, (a, b) in enumerate(zip(outs["1"], outs["0"])):
        assert torch.equal(a, b), f"tensor {i}: fused != unfused"
    assert_block_matches_reference(_block(4, hidden, ffn), x, probs, sizes, dy, outs["1"])


@pytest.mark.cuda
def test_forced_triton_block_at_many_rows_matches_reference(monkeypatch):
    """TE_OPS_GROUPED_GEMM_BACKEND=triton at >= 512 rows per group (the forced rows):
    all six GEMMs in the persistent kernels (wgrad included); same checks as auto."""
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "triton")
    test_block_at_many_rows_matches_reference_and_fused_equals_unfused(monkeypatch)


@pytest.mark.cuda
def test_large_gemms_against_fp64_at_realistic_magnitudes():
    """The dispatching calls (auto, many rows): fprop and dgrad against F.linear in fp64 with
    x ~ N(0, 1), weights at init scale, a 4096-column reduction."""
    _needs_sm90()
    sizes = [900, 0, 1300, 600]
    rows, k, n = 2900, 4096, 512
    choice = grouped_gemm.select_backend(CUDA, torch.bfloat16, k, n, True,
                                         rows_per_group=rows / 4)
    assert choice.large_kinds == ("fprop", "dgrad")
    x = torch.randn(rows, k, device=CUDA, dtype=torch.bfloat16)
    dy = torch.randn(rows, n, device=CUDA, dtype=torch.bfloat16)
    w = (torch.randn(4, n, k, device=CUDA) * k ** -0.5).to(torch.bfloat16)
    splits = make_splits(torch.tensor(sizes, device=x.device), 4, rows, x.device)
    y = grouped_fprop(x, w, splits, choice)
    dx = grouped_dgrad(dy, w, splits, choice)
    start = 0
    for g, m in enumerate(sizes):
        sl = slice(start, start + m)
        assert_close(y[sl], F.linear(x[sl].double(), w[g].double()), torch.bfloat16, "y")
        assert_close(dx[sl], dy[sl].double() @ w[g].double(), torch.bfloat16, "dx")
        start += m
    assert not y[start:].any() and not dx[start:].any()


@pytest.mark.cuda
@pytest.mark.parametrize("fusion", ["1", "0"], ids=["fused", "unfused"])
def test_existing_compile_and_graph_checks_on_the_large_kernels(fusion, monkeypatch):
    """The rule lowered to 1 row so the existing small test blocks take the persistent
    kernels: compiled (fullgraph; default and reduce-overhead) and CUDA-graph replay bitwise
    equal to eager."""
    _needs_sm90()
    import test_cuda_graphs
    import test_torch_compile_cuda

    with_rows(monkeypatch, last=PERSISTENT_FROM_ONE)
    block = test_torch_compile_cuda._block(fusion, monkeypatch)
    # 64 rows per group: above the few-rows rows (which hold first), like the compile test's T=256 over 4 experts and the graph test's 1024 over 8
    x = torch.randn(256, block[0].in_features, device=CUDA, dtype=torch.bfloat16)
    sizes = torch.tensor([64] * 4, device=CUDA)
    block(x, sizes, torch.rand(256, device=CUDA), sizes)
    assert "persistent Triton grouped GEMM" in block.explain()
    for mode in ("default", "reduce-overhead"):
        test_torch_compile_cuda._check_compiled_bitwise(block, mode)
    test_cuda_graphs.test_replay_matches_eager_bitwise(monkeypatch, fusion, torch.bfloat16)


def test_both_rules_at_32_rows_give_one_choice_with_both_families(monkeypatch):
    """At 32 rows per group the few-rows rule takes wgrad (<= 32) and the persistent rule
    fprop / dgrad (>= 32): one choice carries both, each kind in one family, and the reason
    names both rules; routing sends wgrad to the few-rows kernel and fprop / dgrad to the
    persistent one (each refuses the CPU tensor with its own reason)."""
    from te_ops.gemm.rules import choose

    assert [choose(k, 32.0, 16, 32, arch=9, dtype=torch.bfloat16).kernel
            for k in ("fprop", "dgrad", "wgrad")] == ["triton_persistent"] * 2 + ["triton_rows"]
    monkeypatch.setattr(grouped_gemm, "triton_auto_reason", lambda *a: None)
    monkeypatch.setattr(grouped_gemm, "large_auto_reason", lambda *a: None)
    cpu = torch.device("cpu")
    choice = grouped_gemm._select_backend(cpu, torch.bfloat16, 16, 32, True, "auto", "auto",
                                          ("wgrad",), ("fprop", "dgrad"))
    assert choice.name == "triton"
    assert choice.triton_kinds == ("wgrad",) and choice.large_kinds == ("fprop", "dgrad")
    assert "wgrad in Triton (few rows per group" in choice.reason
    assert "fprop/dgrad in the persistent Triton grouped GEMM" in choice.reason
    assert not choice.reason.endswith("in torch._grouped_mm")
    x, dy = torch.randn(10, 16, dtype=torch.bfloat16), torch.randn(10, 32, dtype=torch.bfloat16)
    splits = make_splits(torch.tensor([3, 0, 5]), 3, 10, cpu)
    with pytest.raises(RuntimeError, match="large-shape Triton grouped GEMM cannot run"):
        grouped_fprop(x, torch.randn(3, 32, 16, dtype=torch.bfloat16), splits, choice)
    with pytest.raises(RuntimeError, match="Triton grouped GEMMs cannot run"):
        grouped_wgrad(x, dy, splits, choice)
