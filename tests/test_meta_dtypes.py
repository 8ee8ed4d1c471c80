"""The meta device and ``explain(sample)`` accept what the real call accepts, for every dtype.

torch 2.13's meta kernel of ``torch._grouped_mm`` takes bfloat16 only, while its CPU kernel runs
float32 and float16 too. The backend choice on meta follows the CPU kernel's dtypes and runs
te_ops' fake kernel, so a float32/float16 block runs on meta with device split sizes as a
bfloat16 block does (the graph-safety proof of ``test_graph_safety.py`` holds for them too).
Where the choice is the per-group loop (float64, or forced), device split sizes on meta have
no values to read: the call raises, and ``explain(sample)`` shows the same error instead of a
plan the call rejects. ``explain(sample)`` also raises the call's error for a main input or
split sizes the ops reject (dtype, device, features, kind, length), on every device.
"""

from __future__ import annotations

import pytest
import torch

import te_ops
from te_ops.graphs import graph_safe_unsupported_reason
from te_ops.splits import META_LOOP_ERROR

E, T, H, FF = 4, 24, 16, 32
RUNS = [torch.bfloat16, torch.float32, torch.float16]  # torch._grouped_mm runs them on CPU
ALL_DTYPES = [*RUNS, torch.float64]


def _block(device: str, dtype: torch.dtype, single: bool) -> te_ops.Sequential:
    return te_ops.Sequential(
        te_ops.GroupedLinear(E, H, 2 * FF, single_grouped_weight=single, device=device,
                             dtype=dtype),
        te_ops.ScaledSwiGLU(),
        te_ops.GroupedLinear(E, FF, H, single_grouped_weight=single, device=device,
                             dtype=dtype))


def _inputs(device: str, dtype: torch.dtype, host: bool = False):
    x = torch.randn(T, H, dtype=dtype).to(device).requires_grad_()
    probs = torch.rand(T, dtype=dtype).to(device).requires_grad_()
    sizes = [10, 0, 6, 5]  # an empty group and padding rows (sum < T)
    return x, (sizes if host else torch.tensor(sizes).to(device)), probs


def _backends(report: str) -> list[str]:
    """The grouped GEMM decisions of an explain() report, in op order."""
    return [line.split("grouped GEMM backend: ", 1)[1] for line in report.splitlines()
            if "grouped GEMM backend: " in line]


def _names(decisions: list[str]) -> list[str]:
    return [d.split(" ", 1)[0] for d in decisions]


@pytest.mark.parametrize("dtype", RUNS, ids=str)
@pytest.mark.parametrize("fusion", ["1", "0"], ids=["fused", "unfused"])
@pytest.mark.parametrize("single", [True, False], ids=["packed", "per_expert"])
def test_meta_device_split_sizes_run_forward_backward_for_every_dtype(
        monkeypatch, dtype, fusion, single):
    """float32/float16 as bfloat16: graph-safe on meta (TE_OPS_GRAPH_SAFE=1: no host read),
    outputs and every gradient with the parameters' shapes; explain names the same backend
    on meta as on CPU and as the call recorded."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "1")
    block = _block("meta", dtype, single)
    x, sizes, probs = _inputs("meta", dtype)
    assert graph_safe_unsupported_reason(block, x, sizes, probs, sizes) is None
    planned = _backends(block.explain(x, sizes, probs, sizes))
    y = block(x, sizes, probs, sizes)
    y.backward(torch.empty_like(y))
    assert (y.device.type, y.dtype, tuple(y.shape)) == ("meta", dtype, (T, H))
    assert x.grad.shape == x.shape and probs.grad.shape == probs.shape
    for name, p in block.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
    assert _backends(block.explain()) == planned  # what the call ran
    assert _names(planned) == ["grouped_mm", "grouped_mm"]
    cpu = _block("cpu", dtype, single)
    assert _names(_backends(cpu.explain(*_cpu_twin(x, sizes, probs)))) == _names(planned)


def _cpu_twin(x, sizes, probs):
    cx = torch.zeros(x.shape, dtype=x.dtype)
    cs = torch.tensor([10, 0, 6, 5]) if isinstance(sizes, torch.Tensor) else sizes
    return cx, cs, torch.zeros(probs.shape, dtype=probs.dtype), cs


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_meta_explain_agrees_with_the_call(dtype):
    """Device split sizes: where the call runs, explain plans its backend; where it raises
    (float64: torch._grouped_mm has no float64 CPU kernel, so the loop), explain shows that
    error. Host split sizes run on meta for every dtype (the loop reads the host list)."""
    block = _block("meta", dtype, single=False)
    x, sizes, probs = _inputs("meta", dtype)
    planned = _backends(block.explain(x, sizes, probs, sizes))
    if dtype in RUNS:
        block(x, sizes, probs, sizes).sum().backward()
        assert _names(planned) == ["grouped_mm", "grouped_mm"]
    else:
        assert planned == [f"error: {META_LOOP_ERROR}"] * 2
        with pytest.raises(RuntimeError, match="meta device have no values to copy"):
            block(x, sizes, probs, sizes)
    hx, hsizes, hprobs = _inputs("meta", dtype, host=True)
    block(hx, hsizes, hprobs, hsizes).sum().backward()
    want = "grouped_mm" if dtype in RUNS else "loop"
    assert _names(_backends(block.explain())) == [want, want]
    assert hx.grad.shape == hx.shape


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_forced_loop_on_meta_explain_shows_the_calls_error(monkeypatch, dtype):
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "loop")
    lin = te_ops.GroupedLinear(E, H, H, device="meta", dtype=dtype)
    x = torch.empty(T, H, device="meta", dtype=dtype)
    sizes = torch.empty(E, dtype=torch.int64, device="meta")
    assert _backends(te_ops.Sequential(lin).explain(x, sizes)) == [f"error: {META_LOOP_ERROR}"]
    with pytest.raises(RuntimeError, match="meta device have no values to copy"):
        lin(x, sizes)


@pytest.mark.parametrize("dtype", RUNS, ids=str)
def test_meta_probe_reason_is_the_cpu_kernels(dtype):
    """The meta choice's reason text and graph safety match torch._grouped_mm's CPU
    acceptance; float64 names the CPU kernel that refuses it."""
    from te_ops.gemm.dispatch import grouped_mm_unsupported_reason

    meta, cpu = torch.device("meta"), torch.device("cpu")
    assert grouped_mm_unsupported_reason(meta, dtype, H, H) is None
    assert grouped_mm_unsupported_reason(cpu, dtype, H, H) is None
    why = grouped_mm_unsupported_reason(meta, torch.float64, H, H)
    assert why is not None and "float64 on cpu (meta takes the CPU kernel's dtypes)" in why


def _bad_samples(device: str, dtype: torch.dtype):
    sizes = torch.tensor([10, 0, 6, 5]).to(device)
    probs = torch.rand(T, dtype=dtype).to(device)
    other = torch.float16 if dtype != torch.float16 else torch.float32
    yield "input dtype", (torch.randn(T, H, dtype=other).to(device), sizes, probs, sizes)
    yield "integer input", (torch.ones(T, H, dtype=torch.int32).to(device), sizes, probs, sizes)
    yield "in_features", (torch.randn(T, H + 1, dtype=dtype).to(device), sizes, probs, sizes)
    x = torch.randn(T, H, dtype=dtype).to(device)
    short = sizes[:3]
    yield "split_sizes length", (x, short, probs, short)
    yield "host list length", (x, [10, 0, 6], probs, [10, 0, 6])
    matrix = sizes.reshape(2, 2)
    yield "split_sizes rank", (x, matrix, probs, matrix)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_explain_sample_raises_the_calls_error(device, dtype):
    block = _block(device, dtype, single=False)
    for case, sample in _bad_samples(device, dtype):
        with pytest.raises((TypeError, ValueError)) as call:
            block(*sample)
        with pytest.raises(type(call.value)) as planned:
            block.explain(*sample)
        assert str(planned.value) == str(call.value), case


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_explain_sample_accepts_what_the_call_accepts(device):
    """Accepted samples still plan: float split sizes holding whole numbers, host lists, a
    3-D input with (B, S) probs."""
    block = _block(device, torch.float32, single=False)
    x = torch.randn(2, T // 2, H).to(device)
    probs = torch.rand(2, T // 2).to(device)
    for sizes in (torch.tensor([10.0, 0.0, 6.0, 5.0]).to(device), [10, 0, 6, 5]):
        assert "grouped GEMM backend" in block.explain(x, sizes, probs, sizes)
        block(x, sizes, probs, sizes)
