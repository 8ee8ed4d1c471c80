"""The row-wise + column-amax FP8 kernel and the column pass from a given amax, on the GPU.

``fp8_triton.fp8_rows_column_amax`` must write the row-wise kernel's bytes and scales and the
column amax of a reference written here (NaN / Inf / zero columns, K up to the one-read row
limit, group row counts with 8 / 16 / 32 rows per program, a shape it does not take); the
column-wise pass from that amax must write the two-pass copy's bytes; both the same under
``torch.compile(fullgraph=True)`` (registered ops) and inside a CUDA graph as in eager.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a GPU (torch.cuda.is_available() is False)", allow_module_level=True)

from te_ops.quantization import Float8CurrentScalingQuantizer, fp8_triton, numerics  # noqa: E402

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
U8 = torch.uint8


def weights(g: int, n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    w = (torch.randn(g, n, k, device=DEV, generator=gen) * 3).to(dtype)
    w[0, 1, 2] = float("nan")
    w[-1, :, 0] = float("inf")
    w[0, :, -1] = 0.0
    w[-1, n - 1, k // 2] = -float("inf")
    return w


def ref_amax(w: torch.Tensor) -> torch.Tensor:
    a = w.double().abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax(1).float()


@pytest.mark.parametrize("shape", [(3, 200, 96), (8, 64, 4096), (2, 48, 20000), (4, 1024, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_column_amax_kernel_bytes(shape, dtype):
    w = weights(*shape, dtype)
    data, sinv, amax = fp8_triton.fp8_rows_column_amax(w)
    rd, rs = numerics.fp8_quantize_rows(w)
    assert torch.equal(data.view(U8), rd.view(U8))
    assert torch.equal(sinv, rs)
    assert torch.equal(amax, ref_amax(w))
    q = Float8CurrentScalingQuantizer(rowwise=False, columnwise=True)
    given, alone = q(w, columnwise_amax=amax), q(w)
    assert torch.equal(given.columnwise_data.view(U8), alone.columnwise_data.view(U8))
    assert torch.equal(given.columnwise_scale_inv, alone.columnwise_scale_inv)


def test_shape_not_taken_falls_back_to_column_pass():
    w = weights(2, 7, 64, torch.bfloat16)  # no power of two from 8 up divides 7
    assert fp8_triton.fp8_rows_column_amax(w) is None
    got = Float8CurrentScalingQuantizer(rowwise=True)(w, record_columnwise_amax=True)
    assert got.columnwise_amax is None  # backward then makes it with both phases


def _fn(w):
    row = Float8CurrentScalingQuantizer(rowwise=True)(w, record_columnwise_amax=True)
    col = Float8CurrentScalingQuantizer(rowwise=False, columnwise=True)(
        w, columnwise_amax=row.columnwise_amax)
    return (row.rowwise_data.view(U8), row.rowwise_scale_inv, row.columnwise_amax,
            col.columnwise_data.view(U8), col.columnwise_scale_inv)


def test_compile_fullgraph_and_graph_capture_bitwise():
    w = weights(8, 256, 512, torch.bfloat16, seed=3)
    eager = _fn(w)
    torch._dynamo.reset()
    compiled = torch.compile(_fn, fullgraph=True)(w)
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)
    static = w.clone()
    _fn(static)  # warm-up (kernel compiles) outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _fn(static)
    static.copy_(weights(8, 256, 512, torch.bfloat16, seed=4))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(out, _fn(static)):
        assert torch.equal(a, b)
