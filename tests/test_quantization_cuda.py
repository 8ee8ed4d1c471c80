"""Low-precision recipes on the GPU (H200 / SM90, or SM100).

* The Triton FP8 quantize kernels write the same bytes and scales as the PyTorch reference path
  (row-wise; column-wise per group into the aligned layout, with group sizes that are not
  multiples of 16, empty groups and padding rows; weights; groups spanning many programs'
  row chunks and chunks spanning several groups; both copies from one pair of passes, equal
  to the separate kernels' copies), and the same under
  ``torch.compile(fullgraph=True)`` (the registered ops) as in eager (direct launches).
* Under ``Float8CurrentScaling`` the forward + backward of the expert block runs its six GEMMs
  as ``aten::_scaled_grouped_mm`` (counted with the profiler) and no ``aten::_grouped_mm``.
* Native FP8 GEMMs agree with the emulation of the same bytes (fp32 accumulation both ways).
* CUDA graph capture of the FP8 block replays bitwise equal to eager.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a GPU (torch.cuda.is_available() is False)", allow_module_level=True)

import te_ops  # noqa: E402
from te_ops.graphs import make_graphed_callable  # noqa: E402
from te_ops.quantization import Float8CurrentScalingQuantizer, numerics  # noqa: E402
from te_ops.quantization.gemm import native_unsupported_reason  # noqa: E402
from te_ops.quantization.layout import column_layout  # noqa: E402
from te_ops.recipe import Float8CurrentScaling  # noqa: E402
from te_ops.splits import make_splits  # noqa: E402

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
E, T, H, FF = 8, 1000, 256, 512
SIZES = [100, 0, 333, 7, 250, 17, 200, 50]  # sums to 957: 43 padding rows
REASON = native_unsupported_reason("fp8", DEV, torch.bfloat16, (H, 2 * FF))


def block(seed: int = 0) -> te_ops.Sequential:
    torch.manual_seed(seed)
    return te_ops.Sequential(
        te_ops.GroupedLinear(E, H, 2 * FF, device=DEV, dtype=torch.bfloat16),
        te_ops.ScaledSwiGLU(),
        te_ops.GroupedLinear(E, FF, H, device=DEV, dtype=torch.bfloat16))


def inputs(seed: int = 0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, generator=gen)
    probs = torch.rand(T, device=DEV, dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, generator=gen)
    return x, torch.tensor(SIZES, device=DEV), probs, dy


def step(blk, x, sizes, probs, dy):
    xx = x.clone().requires_grad_(True)
    pp = probs.clone().requires_grad_(True)
    for p in blk.parameters():
        p.grad = None
    with te_ops.autocast(recipe=Float8CurrentScaling()):
        y = blk(xx, sizes, pp, sizes)
    y.backward(dy)
    grads = [xx.grad, pp.grad] + [p.grad for p in blk.parameters()]
    return y.detach(), grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_quantize_bytes_equal_torch(dtype):
    x = torch.randn(T, H, device=DEV, dtype=dtype) * 5
    x[3, 4] = float("nan")
    x[9, 1] = float("inf")
    x[20] = 0
    x[sum(SIZES):] = 1e30
    q = Float8CurrentScalingQuantizer()
    data, sinv = q.quantize_rows(x)
    rdata, rsinv = numerics.fp8_quantize_rows(x)
    assert torch.equal(data.view(torch.uint8), rdata.view(torch.uint8))
    assert torch.equal(sinv, rsinv)
    splits = make_splits(torch.tensor(SIZES, device=x.device), E, T, x.device)
    layout = column_layout(splits.split_sizes, splits.base_offsets, T, 16)
    cdata, csinv = q.quantize_columns_split(x, layout, splits)
    cpu = q.quantize_columns_split(x.cpu(), column_layout(
        splits.split_sizes.cpu(), splits.base_offsets.cpu(), T, 16), make_splits(SIZES, E, T,
                                                                                 "cpu"))
    assert sum(SIZES) == 957
    assert torch.equal(cdata.view(torch.uint8).cpu(), cpu[0].view(torch.uint8))
    assert torch.equal(csinv.cpu(), cpu[1])
    w = torch.randn(E, 2 * FF, H, device=DEV, dtype=dtype)
    wdata, wsinv = q.quantize_columns_uniform(w)
    rdata, rsinv = numerics.fp8_quantize_rows(w.transpose(-2, -1).contiguous())
    assert torch.equal(wdata.view(torch.uint8), rdata.view(torch.uint8))
    assert torch.equal(wsinv, rsinv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sizes", [[1500, 0, 33, 2047, 1, 0, 900, 400], [4990], [0, 0, 5000]])
def test_triton_columnwise_many_chunks_bytes_equal_torch(dtype, sizes):
    """Groups spanning several programs' row chunks, chunks spanning several groups, empty
    groups first / last, padding rows, columns not a multiple of the column block; weights
    whose group rows are not a multiple of the row tile. The aligned layout is written from
    torch.empty, so its gap and tail bytes must come out zero as in the torch path."""
    rows, k = 5000, 200
    gen = torch.Generator(device=DEV).manual_seed(3)
    x = (torch.randn(rows, k, device=DEV, generator=gen) * 7).to(dtype)
    x[5, 3], x[77, 9], x[4000, 1] = float("nan"), float("-inf"), float("inf")
    x[sum(sizes):] = 1e30
    q = Float8CurrentScalingQuantizer(rowwise=False, columnwise=True)
    got = q(x, torch.tensor(sizes, device=DEV))
    ref = q(x.cpu(), sizes)
    assert torch.equal(got.columnwise_data.view(torch.uint8).cpu(),
                       ref.columnwise_data.view(torch.uint8))
    assert torch.equal(got.columnwise_scale_inv.cpu(), ref.columnwise_scale_inv)
    w = torch.randn(3, 1000, 72, device=DEV, generator=gen).to(dtype)
    wq = q(w)
    rdata, rsinv = numerics.fp8_quantize_rows(w.transpose(-2, -1).contiguous())
    assert torch.equal(wq.columnwise_data.view(torch.uint8), rdata.view(torch.uint8))
    assert torch.equal(wq.columnwise_scale_inv, rsinv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sizes", [[1500, 0, 33, 2047, 1, 0, 900, 400], [4990], [5000],
                                   [0, 0, 5000], [0, 7, 0], [16, 32, 4952]])
def test_both_copies_one_kernel_equal_separate_kernels(dtype, sizes):
    """One pair of passes for both copies (``fp8_triton.fp8_both_grouped``) writes the bytes
    and scales of the separate row-wise and column-wise kernels, and of the PyTorch path:
    empty groups, padding rows (their row-wise bytes come from the layout's tail programs),
    group sizes not multiples of 16, one group; weights whose rows are not a multiple of the
    row tile, one group."""
    from te_ops.quantization import quantizer as qmod

    assert qmod.BOTH_COPIES_ONE_KERNEL
    rows, k = 5000, 200
    gen = torch.Generator(device=DEV).manual_seed(6)
    x = (torch.randn(rows, k, device=DEV, generator=gen) * 7).to(dtype)
    x[5, 3], x[77, 9], x[4999, 1] = float("nan"), float("-inf"), float("inf")
    x[sum(sizes):] *= 1e30
    x[2] = 0
    sz = torch.tensor(sizes, device=DEV)
    cls = Float8CurrentScalingQuantizer
    w3 = (torch.randn(3, 1000, 72, device=DEV, generator=gen) * 3).to(dtype)
    w1 = torch.randn(1, 37, 24, device=DEV, generator=gen).to(dtype)
    for t, s, cpu_s in ((x, sz, sizes), (w3, None, None), (w1, None, None)):
        both = cls(rowwise=True, columnwise=True)(t, s)
        row = cls(rowwise=True, columnwise=False)(t, s)
        col = cls(rowwise=False, columnwise=True)(t, s)
        ref = cls(rowwise=True, columnwise=True)(t.cpu(), cpu_s)
        for got, exp in ((both.rowwise_data, row.rowwise_data),
                         (both.columnwise_data, col.columnwise_data),
                         (both.rowwise_scale_inv, row.rowwise_scale_inv),
                         (both.columnwise_scale_inv, col.columnwise_scale_inv)):
            if got.dtype == torch.float8_e4m3fn:
                got, exp = got.view(torch.uint8), exp.view(torch.uint8)
            assert torch.equal(got, exp)
        assert torch.equal(both.rowwise_data.view(torch.uint8).cpu(),
                           ref.rowwise_data.view(torch.uint8))
        assert torch.equal(both.columnwise_data.view(torch.uint8).cpu(),
                           ref.columnwise_data.view(torch.uint8))
        assert torch.equal(both.rowwise_scale_inv.cpu(), ref.rowwise_scale_inv)
        assert torch.equal(both.columnwise_scale_inv.cpu(), ref.columnwise_scale_inv)


def test_quantize_kernels_compile_fullgraph_bitwise():
    """The registered Triton ops (row-wise; column-wise split and weights) under
    ``torch.compile(fullgraph=True)`` write the bytes eager (direct launches) writes."""
    gen = torch.Generator(device=DEV).manual_seed(4)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(E, 2 * FF, H, device=DEV, dtype=torch.bfloat16, generator=gen)
    sizes = torch.tensor(SIZES, device=DEV)
    q = Float8CurrentScalingQuantizer(rowwise=True, columnwise=True)

    def fn(x, sizes, w):
        a, b = q(x, sizes), q(w)
        return (a.rowwise_data, a.rowwise_scale_inv, a.columnwise_data, a.columnwise_scale_inv,
                b.rowwise_data, b.rowwise_scale_inv, b.columnwise_data, b.columnwise_scale_inv)

    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True)(x, sizes, w)
    for i, (a, b) in enumerate(zip(got, fn(x, sizes, w))):
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), f"output {i} differs"


@pytest.mark.skipif(REASON is not None, reason=f"no native FP8 grouped GEMM: {REASON}")
def test_fp8_gemms_run_as_scaled_grouped_mm():
    blk = block()
    args = inputs()
    step(blk, *args)  # plan, probes
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(blk, *args)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert names.count("aten::_scaled_grouped_mm") == 6, names.count("aten::_scaled_grouped_mm")
    assert names.count("aten::_grouped_mm") == 0
    kernels = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    assert any("f8" in k.lower() or "fp8" in k.lower() or "e4m3" in k.lower() for k in kernels), (
        sorted(kernels))


@pytest.mark.skipif(REASON is not None, reason=f"no native FP8 grouped GEMM: {REASON}")
def test_native_matches_emulation_of_same_bytes(monkeypatch):
    blk = block()
    args = inputs()
    y_nat, g_nat = step(blk, *args)
    monkeypatch.setenv("TE_OPS_QUANTIZED_GEMM", "emulate")
    y_emu, g_emu = step(blk, *args)
    for a, b in zip([y_nat] + g_nat, [y_emu] + g_emu):
        err = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
        assert err < 1e-2, err
    assert not y_nat[sum(SIZES):].any()


@pytest.mark.skipif(REASON is not None, reason=f"no native FP8 grouped GEMM: {REASON}")
def test_graph_capture_under_fp8_bitwise_equals_eager():
    blk = block()
    eager = block(seed=1)
    eager.load_state_dict(blk.state_dict())
    x, sizes, probs, dy = inputs()
    sample = (x.clone().requires_grad_(True), sizes.clone(), probs.clone().requires_grad_(True))
    with te_ops.autocast(recipe=Float8CurrentScaling()):
        graphed = make_graphed_callable(blk, (sample[0], sample[1], sample[2], sample[1]))
    for seed in (1, 2):
        x, sizes, probs, dy = inputs(seed)
        sizes = torch.tensor([0, 500, 3, 0, 120, 64, 200, 16], device=DEV) if seed == 2 else sizes
        xx = x.clone().requires_grad_(True)
        pp = probs.clone().requires_grad_(True)
        for p in blk.parameters():
            p.grad = None
        with te_ops.autocast(recipe=Float8CurrentScaling()):
            y = graphed(xx, sizes, pp, sizes)
        y.backward(dy)
        got = [y.detach(), xx.grad, pp.grad] + [p.grad for p in blk.parameters()]
        y_e, g_e = step(eager, x, sizes, probs, dy)
        for a, b in zip(got, [y_e] + g_e):
            assert torch.equal(a, b)


@pytest.mark.parametrize("fusion", ["0", "1"])
def test_one_kernel_copies_bitwise_equal_separate(fusion, monkeypatch):
    """The block's output and every gradient are bitwise the same with both quantized copies
    from one pair of passes as with every copy quantized apart where it is used (fused and
    unfused halves)."""
    from te_ops.quantization import quantizer as qmod

    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    blk = block()
    args = inputs()
    y1, g1 = step(blk, *args)
    monkeypatch.setattr(qmod, "BOTH_COPIES_ONE_KERNEL", False)
    y2, g2 = step(blk, *args)
    for a, b in zip([y1] + g1, [y2] + g2):
        assert torch.equal(a, b)
