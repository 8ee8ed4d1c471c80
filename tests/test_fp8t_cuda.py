"""The SwiGLU -> FP8 row-wise kernel (``quantization/fp8_swiglu.py``) and the weights' row-wise
+ column-amax kernel's warps setting, on the GPU.

* ``swiglu_fp8_rows`` writes the bytes and scales of the SwiGLU kernel followed by the row-wise
  quantize kernel, and of the PyTorch quantize reference (``numerics.fp8_quantize_rows``) on
  the SwiGLU kernel's output; its dequantized values are within E4M3's half-ulp of a float64
  SwiGLU of the same input (an independent reference); bf16 / fp32, with and without probs,
  NaN / Inf / zero rows, F not a power of two, F up to ``MAX_FFN``.
* The same bytes under ``torch.compile(fullgraph=True)`` (the registered op) and from a
  captured CUDA graph replayed on new inputs.
* The FP8 expert block with the kernel (fused forward) and without it gives bitwise the same
  output and gradients, fused and unfused.
* ``fp8_rows_column_amax`` with a warps entry in ``ROWS_COLAMAX_SETTINGS`` writes the default
  setting's bytes, scales and column amax.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a GPU (torch.cuda.is_available() is False)", allow_module_level=True)

import te_ops  # noqa: E402
from te_ops.kernels import swiglu_triton  # noqa: E402
from te_ops.quantization import fp8_swiglu, fp8_triton, numerics  # noqa: E402
from te_ops.recipe import Float8CurrentScaling  # noqa: E402

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
U8 = torch.uint8


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a = a.view(U8) if a.dtype == torch.float8_e4m3fn else a
    b = b.view(U8) if b.dtype == torch.float8_e4m3fn else b
    return torch.equal(a, b)


def make_h(rows: int, f: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    h = (torch.randn(rows, 2 * f, device=DEV, generator=gen) * 4).to(dtype)
    probs = torch.rand(rows, device=DEV, generator=gen)
    if rows > 4:
        h[1, 2], h[2, f + 1] = float("nan"), float("inf")
        h[3] = 0
        probs[4] = 0
    return h, probs


@pytest.mark.parametrize(("dtype", "f", "with_probs"), [
    (torch.bfloat16, 200, True), (torch.bfloat16, 2048, False), (torch.bfloat16, 14336, True),
    (torch.float32, 200, True), (torch.bfloat16, fp8_swiglu.MAX_FFN, False)])
def test_swiglu_fp8_rows_bytes_equal_two_kernels_and_torch(dtype, f, with_probs):
    h, probs = make_h(300, f, dtype, seed=f)
    probs = probs if with_probs else None
    q, s = fp8_swiglu.swiglu_fp8_rows(h, probs)
    a = swiglu_triton.swiglu_forward(h, probs)
    q0, s0 = fp8_triton.fp8_rows(a)
    assert same(q, q0) and same(s, s0)
    q1, s1 = numerics.fp8_quantize_rows(a)
    assert same(q, q1) and same(s, s1)
    # independent float64 reference of the activation, finite rows only
    hd = h.double()
    ref = torch.nn.functional.silu(hd[:, :f]) * hd[:, f:]
    if probs is not None:
        ref = ref * probs.double()[:, None]
    got = q.float().double() * s.double()[:, None]
    ok = torch.isfinite(ref).all(1)
    err = (got - ref).abs()[ok]
    bound = (ref.abs()[ok] * 2.0 ** -3 + s.double()[ok][:, None] * 2.0 ** -9) * 1.01
    assert (err <= bound).all()


def test_swiglu_fp8_rows_lead_dims_and_errors():
    h, probs = make_h(24, 64, torch.bfloat16)
    q, s = fp8_swiglu.swiglu_fp8_rows(h.view(4, 6, 128), probs.view(4, 6))
    q0, s0 = fp8_swiglu.swiglu_fp8_rows(h, probs)
    assert q.shape == (4, 6, 64) and s.shape == (4, 6)
    assert same(q.view(24, 64), q0) and same(s.view(24), s0)
    with pytest.raises(ValueError, match="odd"):
        fp8_swiglu.swiglu_fp8_rows(h[:, :127].contiguous(), None)
    with pytest.raises(ValueError, match="MAX_FFN|above"):
        fp8_swiglu.swiglu_fp8_rows(torch.zeros(2, 2 * fp8_swiglu.MAX_FFN + 2, device=DEV,
                                               dtype=torch.bfloat16), None)
    with pytest.raises(ValueError, match="float16"):
        fp8_swiglu.swiglu_fp8_rows(h.half(), None)
    with pytest.raises(ValueError, match="contiguous"):
        fp8_swiglu.swiglu_fp8_rows(h.t(), None)


def test_swiglu_fp8_rows_compile_and_graph_capture():
    h, probs = make_h(256, 1000, torch.bfloat16)
    ref = fp8_swiglu.swiglu_fp8_rows(h, probs)
    torch._dynamo.reset()
    got = torch.compile(fp8_swiglu.swiglu_fp8_rows, fullgraph=True)(h, probs)
    assert all(same(a, b) for a, b in zip(got, ref))
    sh, sp = h.clone(), probs.clone()
    fp8_swiglu.swiglu_fp8_rows(sh, sp)  # warm-up (compiles the kernel) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_swiglu.swiglu_fp8_rows(sh, sp)
    h2, p2 = make_h(256, 1000, torch.bfloat16, seed=9)
    sh.copy_(h2)
    sp.copy_(p2)
    graph.replay()
    torch.cuda.synchronize()
    assert all(same(a, b) for a, b in zip(out, fp8_swiglu.swiglu_fp8_rows(h2, p2)))


def _block_step(seed_inputs: int = 0):
    torch.manual_seed(0)
    e, t, hid, ff = 8, 1000, 256, 512
    blk = te_ops.Sequential(
        te_ops.GroupedLinear(e, hid, 2 * ff, device=DEV, dtype=torch.bfloat16),
        te_ops.ScaledSwiGLU(),
        te_ops.GroupedLinear(e, ff, hid, device=DEV, dtype=torch.bfloat16))
    gen = torch.Generator(device=DEV).manual_seed(seed_inputs)
    x = torch.randn(t, hid, device=DEV, dtype=torch.bfloat16, generator=gen).requires_grad_()
    probs = torch.rand(t, device=DEV, dtype=torch.bfloat16, generator=gen).requires_grad_()
    dy = torch.randn(t, hid, device=DEV, dtype=torch.bfloat16, generator=gen)
    sizes = torch.tensor([100, 0, 333, 7, 250, 17, 200, 50], device=DEV)
    with te_ops.autocast(recipe=Float8CurrentScaling()):
        y = blk(x, sizes, probs, sizes)
    y.backward(dy)
    return [y.detach(), x.grad, probs.grad] + [p.grad for p in blk.parameters()]


@pytest.mark.parametrize("fusion", ["0", "1"])
def test_block_with_swiglu_fp8_kernel_bitwise_equal_without(fusion, monkeypatch):
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    monkeypatch.setattr(fp8_swiglu, "ENABLED", True)
    calls = []
    launch = fp8_swiglu.launch
    monkeypatch.setattr(fp8_swiglu, "launch", lambda *a, **k: calls.append(1) or launch(*a, **k))
    on = _block_step()
    assert len(calls) == (1 if fusion == "1" else 0)  # the fused forward only
    monkeypatch.setattr(fp8_swiglu, "ENABLED", False)
    off = _block_step()
    monkeypatch.setenv("TE_OPS_FUSION", "0" if fusion == "1" else "1")
    other = _block_step()
    for a, b, c in zip(on, off, other):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("settings", [((8192, 64, 2, 16), (32768, 32, 1)),
                                      ((8192, 64, 1, 8), (32768, 16, 1, 8)),
                                      ((4096, 64, 2), (32768, 64, 1, 16))])
def test_rows_column_amax_warps_settings(settings, monkeypatch):
    gen = torch.Generator(device=DEV).manual_seed(2)
    for g, n, k in ((3, 128, 7168), (2, 256, 2048), (2, 64, 14336)):
        w = torch.randn(g, n, k, device=DEV, dtype=torch.bfloat16, generator=gen) * 3
        w[0, 1, 2] = float("nan")
        ref = fp8_triton.fp8_rows_column_amax(w)
        monkeypatch.setattr(fp8_triton, "ROWS_COLAMAX_SETTINGS", settings)
        got = fp8_triton.fp8_rows_column_amax(w)
        monkeypatch.undo()
        q0, s0 = numerics.fp8_quantize_rows(w)
        assert same(got[0], q0) and same(got[1], s0)
        assert all(same(a, b) for a, b in zip(got, ref)), (g, n, k)
