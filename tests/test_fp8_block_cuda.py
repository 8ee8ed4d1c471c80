"""Blockwise FP8 (``Float8BlockScaling``) on the GPU (H200 / SM90).

* The quantize numerics (torch ops on the device) write the bytes and scales the CPU writes:
  1 x 128 rows, 128 x 128 weight blocks, 128 x 1 token tiles per expert; NaN / Inf, zero and
  partial tiles; power-of-two and fp32 scales.
* The native Triton GEMMs (``quantization/fp8_block_triton.py``) agree with the emulation of the
  same bytes (fp32 products; the kernels' FP8 tensor cores accumulate inside each 128-block with
  the hardware's own precision), padding rows zero.
* Under the recipe the block's six GEMMs run in the two Triton kernels (profiler), no
  ``aten::_grouped_mm`` / ``aten::_scaled_grouped_mm``; ``explain()`` says so.
* The block's forward + backward syncs no host (``set_sync_debug_mode("error")``), replays
  bitwise equal to eager inside one CUDA graph (new inputs and split sizes), and
  ``torch.compile(fullgraph=True)`` (the registered ``triton_op`` s; ``aot_eager`` and
  inductor) equals eager bitwise.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a GPU (torch.cuda.is_available() is False)", allow_module_level=True)

import te_ops  # noqa: E402
from te_ops.graphs import make_graphed_callable  # noqa: E402
from te_ops.quantization import Float8BlockQuantizer  # noqa: E402
from te_ops.quantization.gemm import (  # noqa: E402
    block_grouped_gemm_emulated,
    block_grouped_gemm_native,
    native_unsupported_reason,
)
from te_ops.recipe import Float8BlockScaling  # noqa: E402
from te_ops.splits import make_splits  # noqa: E402

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda", torch.cuda.current_device())  # as an input's .device
E, T, H, FF = 8, 1000, 320, 264  # H, FF: not multiples of 128 (partial blocks)
SIZES = [100, 0, 333, 7, 250, 17, 200, 50]  # sums to 957: 43 padding rows
REASON = native_unsupported_reason("fp8_block", DEV, torch.bfloat16, (H, 2 * FF))
NATIVE = pytest.mark.skipif(REASON is not None, reason=f"no native blockwise GEMM: {REASON}")


def block(seed: int = 0) -> te_ops.Sequential:
    torch.manual_seed(seed)
    return te_ops.Sequential(
        te_ops.GroupedLinear(E, H, 2 * FF, device=DEV, dtype=torch.bfloat16),
        te_ops.ScaledSwiGLU(),
        te_ops.GroupedLinear(E, FF, H, device=DEV, dtype=torch.bfloat16))


def inputs(seed: int = 0, sizes=SIZES):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, generator=gen)
    probs = torch.rand(T, device=DEV, dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, generator=gen)
    return x, torch.tensor(sizes, device=DEV), probs, dy


def step(blk, x, sizes, probs, dy, fn=None):
    xx = x.clone().requires_grad_(True)
    pp = probs.clone().requires_grad_(True)
    for p in blk.parameters():
        p.grad = None
    with te_ops.autocast(recipe=Float8BlockScaling()):
        y = (fn or blk)(xx, sizes, pp, sizes)
    y.backward(dy)
    return [y.detach(), xx.grad, pp.grad] + [p.grad for p in blk.parameters()]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _same(a, b) -> bool:
    if a.dtype == torch.float8_e4m3fn:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pow2", [True, False])
def test_quantize_bytes_equal_cpu(dtype, pow2):
    x = torch.randn(T, H, dtype=dtype) * 5
    x[3, 4], x[9, 200], x[10, :128] = float("nan"), float("inf"), 0.0
    x[11, 256:] *= 1e-30
    w = torch.randn(3, 2 * FF, H, dtype=dtype)
    w[1, :128, :128] = 0.0
    cpu_splits = make_splits(torch.tensor(SIZES), E, T, torch.device("cpu"))
    dev_splits = make_splits(torch.tensor(SIZES, device=DEV), E, T, DEV)
    for t, bd, cs, ds in ((x, 1, cpu_splits, dev_splits), (w, 2, None, None)):
        q = Float8BlockQuantizer(rowwise=True, columnwise=True, block_dim=bd,
                                 force_pow_2_scales=pow2)
        a, b = q(t, cs), q(t.to(DEV), ds)
        for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data",
                     "columnwise_scale_inv"):
            assert _same(getattr(a, name), getattr(b, name).cpu()), (bd, name)


@NATIVE
@pytest.mark.parametrize("pow2", [True, False])
def test_native_gemms_match_emulation(pow2):
    gen = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(T, 2 * FF, device=DEV, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(E, 2 * FF, H, device=DEV, dtype=torch.bfloat16, generator=gen)
    splits = make_splits(torch.tensor(SIZES, device=DEV), E, T, DEV)
    q = Float8BlockQuantizer
    xq = q(rowwise=True, columnwise=True, force_pow_2_scales=pow2)(x, splits)
    dyq = q(rowwise=True, columnwise=True, force_pow_2_scales=pow2)(dy, splits)
    wq = q(rowwise=True, columnwise=True, block_dim=2, force_pow_2_scales=pow2)(w)
    for kind, a, b in (("fprop", xq, wq), ("dgrad", dyq, wq), ("wgrad", xq, dyq)):
        nat = block_grouped_gemm_native(kind, a, b, splits)
        emu = block_grouped_gemm_emulated(kind, a, b, splits)
        assert nat.dtype == emu.dtype == torch.bfloat16 and nat.shape == emu.shape
        assert rel(nat, emu) < 1e-2, (kind, rel(nat, emu))
        if kind != "wgrad":
            assert not nat[sum(SIZES):].any(), kind
        else:
            assert not nat[1].any()  # the empty expert


@NATIVE
def test_block_gemms_run_in_the_triton_kernels():
    blk = block()
    args = inputs()
    step(blk, *args)  # plan, compile the kernels
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(blk, *args)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert names.count("aten::_grouped_mm") == 0 and names.count("aten::_scaled_grouped_mm") == 0
    cuda = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("_fp8_block_rows_kernel" in n for n in cuda) == 4, sorted(set(cuda))
    assert sum("_fp8_block_wgrad_kernel" in n for n in cuda) == 2, sorted(set(cuda))
    x, sizes, probs, _ = args
    with te_ops.autocast(recipe=Float8BlockScaling()):
        text = blk.explain(x, sizes, probs, sizes)
    assert "recipe Float8BlockScaling: blockwise FP8 GEMMs in te_ops' Triton kernels" in text


@NATIVE
def test_native_block_step_matches_emulated_step(monkeypatch):
    blk = block()
    args = inputs()
    nat = step(blk, *args)
    monkeypatch.setenv("TE_OPS_QUANTIZED_GEMM", "emulate")
    emu = step(blk, *args)
    for i, (a, b) in enumerate(zip(nat, emu)):
        assert rel(a, b) < 1e-2, (i, rel(a, b))
    assert not nat[0][sum(SIZES):].any()


@NATIVE
def test_eager_step_syncs_no_host():
    blk = block()
    args = inputs()
    step(blk, *args)  # first call: probes and compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(blk, *args)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@NATIVE
def test_graph_capture_bitwise_equals_eager():
    blk = block()
    eager = block(seed=1)
    eager.load_state_dict(blk.state_dict())
    x, sizes, probs, _ = inputs()
    sample = (x.clone().requires_grad_(True), sizes.clone(), probs.clone().requires_grad_(True))
    with te_ops.autocast(recipe=Float8BlockScaling()):
        graphed = make_graphed_callable(blk, (sample[0], sample[1], sample[2], sample[1]))
    for seed, new in ((1, SIZES), (2, [0, 500, 3, 0, 120, 64, 200, 16])):
        x, sizes, probs, dy = inputs(seed, new)
        got = step(blk, x, sizes, probs, dy, fn=graphed)
        for a, b in zip(got, step(eager, x, sizes, probs, dy)):
            assert torch.equal(a, b)


@NATIVE
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_bitwise_equals_eager(backend):
    """aot_eager (the eager kernels) and inductor (with ``emulate_precision_casts``: it rounds
    bf16 intermediates as eager does) over the block with biases and padding rows."""
    blk = block()
    args = inputs()
    ref = step(blk, *args)
    torch._dynamo.reset()
    with torch._inductor.config.patch(emulate_precision_casts=True):
        compiled = torch.compile(blk, fullgraph=True, backend=backend)
        for _ in range(2):
            for a, b in zip(step(blk, *args, fn=compiled), ref):
                assert torch.equal(a, b)
