"""Phase 2 with packed 32-bit stores and the row-tiled row-wise + column-amax kernel, on the GPU.

* ``fp8_triton.launch_cols`` with ``PACK4`` (four destination rows per 32-bit word before the
  in-register transpose) writes the bytes and scales of the byte-wise phase 2 and of the
  PyTorch reference path: split activations (empty groups, sizes not multiples of 16, padding
  rows, chunks spanning groups, with and without the row-wise copy, with and without
  ``PREFETCH``) and weights (uniform groups with ``n % 4 == 0``; ``n % 4 != 0`` keeps the
  byte-wise stores), from both phases and from a given amax.
* ``fp8_rows_column_amax`` under ``ROWS_COLAMAX_SETTINGS`` (rows per program up to 8 .. 128,
  tiles of 1 .. 8 rows per load) writes the reference's row-wise bytes, scales and column
  amax.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a GPU (torch.cuda.is_available() is False)", allow_module_level=True)

from te_ops.quantization import fp8_triton, numerics  # noqa: E402
from te_ops.quantization.layout import column_layout  # noqa: E402
from te_ops.quantization.quantizer import Float8CurrentScalingQuantizer  # noqa: E402
from te_ops.splits import make_splits  # noqa: E402

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
U8 = torch.uint8
SMALL = {"CHUNK": 256, "BLOCK_R": 64, "COLS_ONLY": {"BLOCK_R": 128}}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a = a.view(U8) if a.dtype == torch.float8_e4m3fn else a
    b = b.view(U8) if b.dtype == torch.float8_e4m3fn else b
    return torch.equal(a.cpu(), b.cpu())


def split_cols(x, sizes, cfg, with_rows):
    g = len(sizes)
    sp = make_splits(torch.tensor(sizes, device=x.device), g, x.shape[0], x.device)
    lay = column_layout(sp.split_sizes, sp.base_offsets, x.shape[0], 16)
    out = torch.empty(x.shape[1], lay.capacity, dtype=torch.float8_e4m3fn, device=DEV)
    res = fp8_triton.launch_cols(x, out, sp.base_offsets[:g], sp.split_sizes, lay.starts,
                                 lay.capacity, 16, 0, lay.capacity, False, cfg,
                                 with_rows=with_rows)
    return (out,) + (res if with_rows else (res,))


# Each case compiles its own Triton specializations (~20 s per case on the H200), so the grid is
# every split-size pattern once in bf16, plus fp32 and PREFETCH=False on the skewed pattern.
SPLIT_CASES = [(torch.bfloat16, s, True) for s in ([1500, 0, 33, 2047, 1, 0, 900, 400], [4990],
                                                   [0, 0, 5000], [16, 32, 4952], [0, 7, 0])]
SPLIT_CASES += [(torch.float32, [1500, 0, 33, 2047, 1, 0, 900, 400], False),
                (torch.bfloat16, [16, 32, 4952], False)]


@pytest.mark.parametrize(("dtype", "sizes", "prefetch"), SPLIT_CASES)
def test_pack4_split_bytes_equal_bytewise_and_torch(dtype, sizes, prefetch):
    rows, k = 5000, 200
    gen = torch.Generator(device=DEV).manual_seed(11)
    x = (torch.randn(rows, k, device=DEV, generator=gen) * 7).to(dtype)
    x[5, 3], x[77, 9], x[4999, 1] = float("nan"), float("-inf"), float("inf")
    x[sum(sizes):] *= 1e30
    x[2] = 0
    for cfg in ({}, SMALL):
        for with_rows in (False, True):
            base = {**cfg, "PACK4": False, "PREFETCH": prefetch}
            exp = split_cols(x, sizes, base, with_rows)
            got = split_cols(x, sizes, {**base, "PACK4": True}, with_rows)
            assert all(same(a, b) for a, b in zip(got, exp)), (cfg, with_rows)
    q = Float8CurrentScalingQuantizer(rowwise=True, columnwise=True)
    ref = q(x.cpu(), sizes)
    # 32-column blocks fall back to the byte-wise stores (fp8_triton.PACK4_BLOCK_C)
    for cfg in ({"PACK4": True, "PREFETCH": prefetch}, {"BLOCK_C": 32, "BLOCK_R": 256}):
        got = split_cols(x, sizes, cfg, True)
        assert same(got[0], ref.columnwise_data) and same(got[1], ref.columnwise_scale_inv)
        assert same(got[2], ref.rowwise_data) and same(got[3], ref.rowwise_scale_inv)


@pytest.mark.parametrize(("dtype", "shape"),
                         [(torch.bfloat16, (3, 1000, 72)), (torch.bfloat16, (2, 4096, 40)),
                          (torch.bfloat16, (1, 37, 24)), (torch.bfloat16, (4, 132, 300)),
                          (torch.float32, (3, 1000, 72))])
def test_pack4_weights_bytes_equal_torch(dtype, shape):
    g, n, k = shape
    gen = torch.Generator(device=DEV).manual_seed(n)
    w = (torch.randn(g, n, k, device=DEV, generator=gen) * 3).to(dtype)
    w[0, 1, 2], w[-1, :, 0] = float("nan"), float("inf")
    rd, rs = numerics.fp8_quantize_rows(w.transpose(-2, -1).contiguous())
    amax = w.float().abs().nan_to_num(0.0, 0.0, 0.0).amax(1)
    starts = torch.arange(g, device=DEV, dtype=torch.int64) * n
    align = 4 if n % 4 == 0 else 1
    assert fp8_triton.pack4_ok(align, g * n, k * n, n) == (n % 4 == 0)
    assert not fp8_triton.pack4_ok(align, g * n, k * n, n, block_c=32)
    for cfg in ({"PACK4": True}, {"PACK4": True, "PREFETCH": False}, {**SMALL, "PACK4": True}):
        for given in (None, amax):
            out = torch.empty(g, k, n, dtype=torch.float8_e4m3fn, device=DEV)
            sinv = fp8_triton.launch_cols(w.reshape(g * n, k), out, starts,
                                          torch.full_like(starts, n), starts, g * n, align,
                                          k * n, n, True, cfg, amax=given)
            assert same(out, rd) and same(sinv, rs), (cfg, given is None)
    q = Float8CurrentScalingQuantizer(rowwise=True, columnwise=True)(w)  # library defaults
    assert same(q.columnwise_data, rd) and same(q.columnwise_scale_inv, rs)


@pytest.mark.parametrize("settings", [((32768, 32, 1),), ((8192, 64, 2), (32768, 32, 2)),
                                      ((32768, 128, 4),), ((4096, 16, 8), (32768, 32, 1))])
@pytest.mark.parametrize("shape", [(3, 200, 96), (8, 64, 4096), (2, 48, 20000), (4, 1024, 256),
                                   (2, 24, 4096)])
def test_rows_colamax_tiles_bytes(settings, shape, monkeypatch):
    monkeypatch.setattr(fp8_triton, "ROWS_COLAMAX_SETTINGS", settings)
    g, n, k = shape
    gen = torch.Generator(device=DEV).manual_seed(k)
    w = (torch.randn(g, n, k, device=DEV, generator=gen) * 3).to(torch.bfloat16)
    w[0, 1, 2], w[-1, :, 0], w[0, :, -1] = float("nan"), float("inf"), 0.0
    data, sinv, amax = fp8_triton.fp8_rows_column_amax(w)
    rd, rs = numerics.fp8_quantize_rows(w)
    assert same(data, rd) and same(sinv, rs)
    a = w.double().abs()
    ref = torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax(1).float()
    assert torch.equal(amax, ref)
