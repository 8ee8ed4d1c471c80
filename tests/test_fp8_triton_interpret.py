"""The FP8 Triton quantize kernels on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``).

Runs where triton is installed (skipped otherwise; the byte checks against the PyTorch path
run on the GPU in ``tests/test_quantization_cuda.py``). The interpreter's float -> E4M3
conversion differs from the hardware's for some values (triton 3.9: magnitudes just below 128
come out as 64), so this compares kernels with kernels: the one-pair-of-passes kernel that
writes both copies against the separate row-wise and column-wise kernels, on tiny awkward
shapes (empty groups, padding rows, sizes not multiples of 16, one group, weights).
"""

from __future__ import annotations

from interpret import interpreter_marks, run_interpreted

pytestmark = interpreter_marks("tests/test_quantization_cuda.py")

SCRIPT = r'''
import torch
from te_ops.quantization import fp8_triton
from te_ops.quantization.layout import column_layout
from te_ops.splits import make_splits

CFG = {"CHUNK": 64, "BLOCK_R": 16, "BLOCK_C": 16}
U8 = torch.uint8


def same(a, b):
    return torch.equal(a.view(U8) if a.dtype == torch.float8_e4m3fn else a,
                       b.view(U8) if b.dtype == torch.float8_e4m3fn else b)


def split_case(rows, k, sizes):
    gen = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, k, generator=gen) * 7
    x[5, 3], x[7, 1] = float("nan"), float("inf")
    x[sum(sizes):] *= 1e30
    g = len(sizes)
    sp = make_splits(torch.tensor(sizes), g, rows, torch.device("cpu"))
    lay = column_layout(sp.split_sizes, sp.base_offsets, rows, 16)
    out1 = torch.empty(k, lay.capacity, dtype=torch.float8_e4m3fn)
    out2 = torch.empty_like(out1)
    a = (sp.base_offsets[:g], sp.split_sizes, lay.starts, lay.capacity, 16, 0, lay.capacity,
         False)
    s1 = fp8_triton.launch_cols(x, out1, *a, config=CFG)
    s2, rq, rs = fp8_triton.launch_cols(x, out2, *a, config=CFG, with_rows=True)
    q0, s0 = fp8_triton.launch_rows(x)
    assert same(out1, out2) and same(s1, s2), (rows, k, sizes, "columns")
    assert same(rq, q0) and same(rs, s0), (rows, k, sizes, "rows")


def weight_case(g, n, k):
    w = torch.randn(g, n, k, generator=torch.Generator().manual_seed(n)) * 3
    starts = torch.arange(g) * n
    out1 = torch.empty(g, k, n, dtype=torch.float8_e4m3fn)
    out2 = torch.empty_like(out1)
    a = (starts, torch.full_like(starts, n), starts, g * n, 1, k * n, n, True)
    s1 = fp8_triton.launch_cols(w.reshape(g * n, k), out1, *a, config=CFG)
    s2, rq, rs = fp8_triton.launch_cols(w.reshape(g * n, k), out2, *a, config=CFG,
                                        with_rows=True)
    q0, s0 = fp8_triton.launch_rows(w)
    assert same(out1, out2) and same(s1, s2), (g, n, k, "columns")
    assert same(rq, q0.reshape(g * n, k)) and same(rs, s0.reshape(-1)), (g, n, k, "rows")


split_case(200, 40, [50, 0, 33, 7, 60, 0])
split_case(100, 24, [100])
split_case(130, 20, [0, 0, 90])
split_case(96, 33, [17, 1, 70])
split_case(64, 16, [0, 0])
weight_case(3, 37, 24)
weight_case(1, 20, 50)
print("ok")
'''


def test_both_copies_kernel_equals_separate_kernels_interpreted():
    run_interpreted(SCRIPT)
