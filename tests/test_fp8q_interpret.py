"""Packed phase 2 and row-tiled row-wise + column-amax kernels through Triton's interpreter.

Runs where triton is installed and no GPU is (as ``tests/test_fp8_triton_interpret.py``; the
GPU runs the compiled kernels in ``tests/test_fp8q_cuda.py``). Kernel against kernel (the
interpreter's float -> E4M3 conversion differs from the hardware's for some values):

* ``launch_cols`` with ``PACK4`` (four destination rows per 32-bit word) writes the byte-wise
  phase 2's bytes and scales: split activations (empty groups, padding rows, sizes not
  multiples of 16, with and without the row-wise copy and ``PREFETCH``), weights with
  ``n % 4 == 0`` (packed, ``align=4``) and ``n % 4 != 0`` (byte-wise);
* ``fp8_rows_column_amax`` with tiles of 2 / 4 rows equals the one-row tiles.
"""

from __future__ import annotations

from interpret import interpreter_marks, run_interpreted

pytestmark = interpreter_marks("tests/test_fp8q_cuda.py")

SCRIPT = r'''
import torch
from te_ops.quantization import fp8_triton
from te_ops.quantization.layout import column_layout
from te_ops.splits import make_splits

U8 = torch.uint8
# The interpreter runs the packed stores' logic with any column block (the compiled kernel
# takes PACK4_BLOCK_C only, see fp8_triton).
fp8_triton.PACK4_BLOCK_C = (16,)
assert fp8_triton.pack4_ok(16, 64, 0, 64, block_c=16)


def same(a, b):
    return torch.equal(a.view(U8) if a.dtype == torch.float8_e4m3fn else a,
                       b.view(U8) if b.dtype == torch.float8_e4m3fn else b)


def cfg(pack, prefetch):
    return {"CHUNK": 64, "BLOCK_R": 16, "BLOCK_C": 16, "PACK4": pack, "PREFETCH": prefetch,
            "COLS_ONLY": {"BLOCK_R": 32}}


def split_case(rows, k, sizes):
    gen = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, k, generator=gen) * 7
    x[5, 3], x[7, 1] = float("nan"), float("inf")
    x[sum(sizes):] *= 1e30
    g = len(sizes)
    sp = make_splits(torch.tensor(sizes), g, rows, torch.device("cpu"))
    lay = column_layout(sp.split_sizes, sp.base_offsets, rows, 16)
    a = (sp.base_offsets[:g], sp.split_sizes, lay.starts, lay.capacity, 16, 0, lay.capacity,
         False)
    for rows_too in (False, True):
        for prefetch in (False, True):
            got = []
            for pack in (False, True):
                out = torch.empty(k, lay.capacity, dtype=torch.float8_e4m3fn)
                res = fp8_triton.launch_cols(x, out, *a, config=cfg(pack, prefetch),
                                             with_rows=rows_too)
                got.append((out,) + (res if rows_too else (res,)))
            assert all(same(p, q) for p, q in zip(*got)), (rows, k, sizes, rows_too, prefetch)


def weight_case(g, n, k):
    w = torch.randn(g, n, k, generator=torch.Generator().manual_seed(n)) * 3
    starts = torch.arange(g) * n
    got = []
    for pack, align in ((False, 1), (True, 4 if n % 4 == 0 else 1)):
        out = torch.empty(g, k, n, dtype=torch.float8_e4m3fn)
        a = (starts, torch.full_like(starts, n), starts, g * n, align, k * n, n, True)
        s = fp8_triton.launch_cols(w.reshape(g * n, k), out, *a, config=cfg(pack, True))
        got.append((out, s))
    assert all(same(p, q) for p, q in zip(*got)), (g, n, k)


def colamax_case(g, n, k):
    w = torch.randn(g, n, k, generator=torch.Generator().manual_seed(n + k)) * 3
    w[0, 1, 2] = float("nan")
    res = []
    for tile in (1, 2, 4):
        fp8_triton.ROWS_COLAMAX_SETTINGS = ((32768, 32, tile),)
        res.append(fp8_triton.fp8_rows_column_amax(w))
    for other in res[1:]:
        assert all(same(p, q) for p, q in zip(res[0], other)), (g, n, k)


split_case(200, 40, [50, 0, 33, 7, 60, 0])
split_case(100, 24, [100])
split_case(130, 20, [0, 0, 90])
split_case(96, 33, [17, 1, 70])
weight_case(3, 40, 24)
weight_case(2, 37, 20)
colamax_case(3, 32, 24)
colamax_case(2, 8, 50)
print("ok")
'''


def test_pack4_and_row_tiles_interpreted():
    run_interpreted(SCRIPT)
