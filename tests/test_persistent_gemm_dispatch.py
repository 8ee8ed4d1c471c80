"""The dispatch of the persistent many-rows Triton GEMMs (``large_kinds``).

CPU (CI), with CUDA pieces faked as in ``test_large_gemm_dispatch.py``:

* wgrad into an fp32 ``main_grad`` under a forced ``triton`` choice (few-rows or persistent
  kinds): ``torch._grouped_mm(..., out_dtype=float32)`` where it runs (the README's "nor wgrad
  into an fp32 main_grad"), and the backend's own wgrad plus one add where the rows are not
  16-byte aligned (``torch._grouped_mm`` rejects those strides; the forced backend takes them);
* the reasons ``explain()`` shows: the forced choice names the kinds and the kernel family
  with the threshold's value, the auto fallback does not repeat one clause twice, the fc1
  epilogue gate says fc1's fprop runs in the persistent kernel (not "does not run in Triton").

CUDA: a forced-``triton`` block with unaligned features and fp32 ``main_grad`` at few and many
rows per group against the fp64 reference.
"""

from __future__ import annotations

import pytest
import reference as ref
import torch
from gemm_force import FC1_FUSED_ANY, with_rows

import te_ops
from te_ops.gemm import fc1_swiglu_reason
from te_ops.gemm import dispatch as grouped_gemm
from te_ops.gemm import wgrad_into
from te_ops.gemm import grouped_gemm_large_triton as lg
from te_ops.gemm import BackendChoice
from te_ops.gemm.torch_ops import loop_wgrad
from te_ops.splits import make_splits

SIZES = [5, 0, 7, 6]
ROWS = 20  # two padding rows
FORCED_LARGE = BackendChoice("triton", "forced", True, large_kinds=("fprop", "dgrad", "wgrad"))
FORCED_FEW = BackendChoice("triton", "forced", True, triton_kinds=("fprop", "dgrad", "wgrad"))


def _want(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(len(SIZES), dy.shape[1], x.shape[1], dtype=torch.float64)
    start = 0
    for g, m in enumerate(SIZES):
        out[g] = dy[start:start + m].double().t() @ x[start:start + m].double()
        start += m
    return out


def _operands(k: int, n: int):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, k, generator=gen).to(torch.bfloat16)
    dy = torch.randn(ROWS, n, generator=gen).to(torch.bfloat16)
    x[sum(SIZES):] = float("nan")  # padding rows never contribute
    dy[sum(SIZES):] = float("nan")
    return x, dy, make_splits(torch.tensor(SIZES), len(SIZES), ROWS, torch.device("cpu"))


def _fake_cuda_wgrad_pieces(monkeypatch) -> list:
    """As on an H200 in bf16: the out_dtype probe passes, ``torch._grouped_mm`` takes fp32
    output (and rejects unaligned strides, as it does on CPU and CUDA); the Triton wgrad
    kernels (which refuse a CPU tensor) replaced by the per-group loop. Returns the log of
    which ran."""
    log = []
    real = torch._grouped_mm
    # settle the one-time probe of torch._grouped_mm first (it calls the real one)
    assert grouped_gemm.grouped_mm_unsupported_reason(torch.device("cpu"), torch.bfloat16, 16,
                                                      16) is None

    def grouped_mm(a, b, offs=None, out_dtype=None):
        log.append(("_grouped_mm", out_dtype))
        out = real(a, b, offs=offs)  # raises on unaligned strides
        return out if out_dtype is None else out.to(out_dtype)

    def kernel(name):
        def run(x, dy, offsets):
            log.append((name, None))
            return loop_wgrad(x, dy, SIZES)
        return run

    monkeypatch.setattr(wgrad_into, "grouped_mm_out_dtype_reason", lambda *a: None)
    monkeypatch.setattr(torch, "_grouped_mm", grouped_mm)
    monkeypatch.setattr(grouped_gemm, "large_wgrad", kernel("large_wgrad"))
    monkeypatch.setattr(grouped_gemm, "triton_wgrad", kernel("triton_wgrad"))
    return log


@pytest.mark.parametrize("choice", [FORCED_LARGE, FORCED_FEW], ids=["persistent", "few_rows"])
def test_forced_triton_main_grad_fp32_runs_in_grouped_mm(monkeypatch, choice):
    """Aligned features: the fp32 main_grad wgrad is torch._grouped_mm(out_dtype=float32), not
    the Triton wgrad (which writes bf16 only), as the README says; values vs fp64."""
    log = _fake_cuda_wgrad_pieces(monkeypatch)
    x, dy, splits = _operands(16, 24)
    targets = list(torch.ones(len(SIZES), 24, 16).unbind(0))
    wgrad_into.grouped_wgrad_into(targets, x, dy, splits, choice, [True] * len(SIZES))
    assert log == [("_grouped_mm", torch.float32)]
    ref.assert_close(torch.stack(targets) - 1, _want(x, dy), torch.bfloat16, "main_grad")


@pytest.mark.parametrize("choice", [FORCED_LARGE, FORCED_FEW], ids=["persistent", "few_rows"])
@pytest.mark.parametrize("k,n", [(12, 24), (16, 36), (20, 20)])
def test_forced_triton_main_grad_fp32_unaligned_features(monkeypatch, choice, k, n):
    """in_features / out_features whose bf16 rows are not 16-byte aligned (the forced Triton
    backend runs them; torch._grouped_mm raises "strides should be multiple of 16 bytes"):
    the backend's own wgrad, added into the fp32 main_grad; values vs fp64."""
    log = _fake_cuda_wgrad_pieces(monkeypatch)
    x, dy, splits = _operands(k, n)
    targets = list(torch.ones(len(SIZES), n, k).unbind(0))
    wgrad_into.grouped_wgrad_into(targets, x, dy, splits, choice, [True] * len(SIZES))
    kernel = "large_wgrad" if choice.large_kinds else "triton_wgrad"
    assert log == [(kernel, None)]
    ref.assert_close(torch.stack(targets) - 1, _want(x, dy), torch.bfloat16, "main_grad")


def _fake_triton(monkeypatch) -> None:
    monkeypatch.setattr(grouped_gemm, "triton_unsupported_reason", lambda *a: None)


def test_forced_reason_names_kinds_kernels_and_threshold(monkeypatch):
    """explain()'s text for a forced choice: which kinds run in which kernel family, with the
    threshold's value (not only its name), and where an fp32 main_grad's wgrad runs."""
    _fake_triton(monkeypatch)
    cpu = torch.device("cpu")
    limit = 512  # the forced rows of te_ops.gemm.rules
    many = grouped_gemm._select_backend(cpu, torch.bfloat16, 16, 32, True, "triton", "auto",
                                        (), ("fprop", "dgrad", "wgrad"))
    few = grouped_gemm._select_backend(cpu, torch.bfloat16, 16, 32, True, "triton", "auto")
    assert "fprop/dgrad/wgrad in the persistent many-rows kernels (" in many.reason
    assert f"from {limit} rows per group" in many.reason
    assert "fprop/dgrad/wgrad in the few-rows Triton kernels" in few.reason
    assert f"below {limit} rows per group" in few.reason
    for choice in (many, few):
        assert choice.reason.startswith("forced by TE_OPS_GROUPED_GEMM_BACKEND")
        assert "fp32 main_grad in torch._grouped_mm" in choice.reason


def test_auto_fallback_reason_does_not_repeat_itself(monkeypatch):
    """Auto on a GPU where neither Triton rule applies for the same reason (here SM100): the
    grouped_mm choice says it once; with different reasons (SM90, middle row counts) both."""
    monkeypatch.setattr(grouped_gemm, "grouped_mm_unsupported_reason", lambda *a: None)
    monkeypatch.setattr(grouped_gemm, "grouped_mm_host_sync_reason", lambda *a: None)
    _fake_triton(monkeypatch)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    choice = grouped_gemm._select_backend(cuda, torch.bfloat16, 16, 32, True, "auto", "auto")
    assert choice.name == "grouped_mm"
    assert choice.reason.count("not SM100") == 1, choice.reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    choice = grouped_gemm._select_backend(cuda, torch.bfloat16, 16, 32, True, "auto", "auto")
    assert "no few-rows row" in choice.reason and "no persistent-kernel row" in choice.reason


class _Act:
    name, reason = "triton", "test"


def test_fc1_swiglu_reason_names_the_persistent_kernel(monkeypatch):
    """fc1's fprop in the persistent kernel (auto at >= 32 rows per group, or forced): auto
    does not take the epilogue (measured slower there), and the reason says why (not
    "does not run in Triton"); ``1`` takes the persistent kernel's fused launch (same bits)."""
    for choice in (FORCED_LARGE, BackendChoice("triton", "auto", True,
                                               large_kinds=("fprop", "dgrad"))):
        with_rows(monkeypatch)
        why = fc1_swiglu_reason(choice, _Act(), None, False, None, 1024.0)
        assert why is not None and "persistent many-rows Triton kernel" in why, why
        assert "does not run in Triton" not in why and "no fc1_swiglu row" in why
        with_rows(monkeypatch, last=FC1_FUSED_ANY)
        assert fc1_swiglu_reason(choice, _Act(), None, False, None, 1024.0) is None
    with_rows(monkeypatch, last=FC1_FUSED_ANY)  # neighbour: few-rows fprop
    assert fc1_swiglu_reason(FORCED_FEW, _Act(), None, False, None, 1024.0) is None


# ---------------------------------------------------------------------------------- CUDA
def _unaligned_block(experts: int, hidden: int, ffn: int) -> te_ops.Sequential:
    torch.manual_seed(0)
    kw = {"bias": False, "device": "cuda", "dtype": torch.bfloat16,
          "accumulate_into_main_grad": True}
    return te_ops.Sequential(te_ops.GroupedLinear(experts, hidden, 2 * ffn, **kw),
                             te_ops.ScaledSwiGLU(),
                             te_ops.GroupedLinear(experts, ffn, hidden, **kw))


@pytest.mark.cuda
@pytest.mark.parametrize("sizes", [[5, 0, 7, 6], [600, 0, 1500, 300]],
                         ids=["few_rows", "many_rows"])
def test_forced_triton_unaligned_features_fp32_main_grad(monkeypatch, sizes):
    """TE_OPS_GROUPED_GEMM_BACKEND=triton, hidden=20 (40-byte bf16 rows: torch._grouped_mm
    cannot take them), Megatron fp32 main_grad: the step runs and every main_grad matches the
    fp64 reference (few-rows and persistent kernels)."""
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "triton")
    experts, hidden, ffn = 4, 20, 24
    block = _unaligned_block(experts, hidden, ffn)
    for p in block.parameters():
        p.main_grad = torch.zeros(p.shape, device="cuda", dtype=torch.float32)
        p.grad_added_to_main_grad = False
    rows = sum(sizes) + 8
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    probs = torch.rand(rows, device="cuda", dtype=torch.bfloat16)
    splits = torch.tensor(sizes, device="cuda")
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    block(x, splits, probs, splits).backward(dy)
    text = block.explain()
    assert ("persistent many-rows kernels" if rows / experts >= 512  # the forced rows
            else "few-rows Triton kernels") in text, text
    total = sum(sizes)
    fc1, _, fc2 = block
    w1 = [ref.leaf(p) for p in fc1.parameters()]
    w2 = [ref.leaf(p) for p in fc2.parameters()]
    xl, pl = ref.leaf(x[:total].detach().clone()), ref.leaf(probs[:total].clone())
    h = ref.grouped_linear(xl, w1, None, sizes)
    want = ref.grouped_linear(ref.scaled_swiglu(h, pl), w2, None, sizes)
    want.backward(dy[:total].double())
    ref.assert_close(x.grad[:total], xl.grad, torch.bfloat16, "x.grad")
    assert not x.grad[total:].any()
    for i, (p, leaf) in enumerate(zip([*fc1.parameters(), *fc2.parameters()], w1 + w2)):
        ref.assert_close(p.main_grad, leaf.grad, torch.bfloat16, f"main_grad {i}")


@pytest.mark.parametrize("capability,dtype,read", [
    ((9, 0), torch.bfloat16, True),  # the measured device and dtype: the rules apply
    ((9, 0), torch.float16, False),
    ((9, 0), torch.float32, False),
    ((8, 0), torch.bfloat16, False),
    ((10, 0), torch.bfloat16, False),
])
def test_row_rules_read_only_where_they_can_apply(monkeypatch, capability, dtype, read):
    """Auto compares the call's rows per group with the rules table only on SM90 in bf16: under torch.compile each comparison of a traced
    row count is a guard, so elsewhere (an A100, fp16/fp32 training) a dynamic row count
    crossing 4, 8, 32 or 512 rows per group recompiled for the same grouped_mm choice."""
    calls = []
    monkeypatch.setattr(grouped_gemm, "triton_unsupported_reason", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(grouped_gemm, "_MEASURED_ON", {})
    real = grouped_gemm.gemm_rules
    monkeypatch.setattr(grouped_gemm, "gemm_rules",
                        lambda *a: calls.append(a[-1]) or real(*a))
    monkeypatch.setattr(grouped_gemm, "_select_backend",
                        lambda *a: BackendChoice("grouped_mm", "stub", True))
    cuda = torch.device("cuda", 0)
    grouped_gemm.select_backend(cuda, dtype, 64, 64, True, rows_per_group=600.0)
    assert calls == (["auto"] if read else [])
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "triton")  # forced: any CUDA GPU, dtype
    calls.clear()
    grouped_gemm.select_backend(cuda, dtype, 64, 64, True, rows_per_group=600.0)
    assert calls == ["forced"]
