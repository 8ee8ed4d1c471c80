"""Today's column-amax kernels on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``).

Runs where triton is installed and no GPU is (as ``tests/test_fp8_triton_interpret.py``; the
GPU runs the compiled kernels in ``tests/test_fp8_column_amax_cuda.py``). The interpreter's
float -> E4M3 conversion differs from the hardware's for some values, so the bytes are
compared kernel against kernel; the amax (no conversion) against a float64 reference:

* ``fp8_rows_column_amax``: the column amax equals the largest finite |w| per (g, k) over N
  (NaN / Inf / zero columns), its row-wise bytes equal ``fp8_rows``;
* ``launch_cols(..., amax=)``: the column-wise copy from a given amax equals the two-pass copy.
"""

from __future__ import annotations

from interpret import interpreter_marks, run_interpreted

pytestmark = interpreter_marks("tests/test_fp8_column_amax_cuda.py")

SCRIPT = r'''
import torch
from te_ops.quantization import fp8_triton

CFG = {"CHUNK": 64, "BLOCK_R": 16, "BLOCK_C": 16}
U8 = torch.uint8


def ref_amax(w):
    g, n, k = w.shape
    out = torch.zeros(g, k, dtype=torch.float64)
    for gi in range(g):
        for ki in range(k):
            col = w[gi, :, ki].double()
            fin = col[torch.isfinite(col)].abs()
            out[gi, ki] = fin.max() if fin.numel() else 0.0
    return out.float()


def case(g, n, k):
    w = torch.randn(g, n, k, generator=torch.Generator().manual_seed(n + k)) * 3
    w[0, 1, 2] = float("nan")
    w[g - 1, :, k - 1] = float("inf")  # Inf only: amax 0
    w[0, :, 0] = 0.0
    res = fp8_triton.fp8_rows_column_amax(w)
    assert res is not None, (g, n, k, "shape not taken")
    q, s, amax = res
    assert torch.equal(amax, ref_amax(w)), (g, n, k, "amax")
    q0, s0 = fp8_triton.launch_rows(w)
    assert torch.equal(q.view(U8), q0.view(U8)) and torch.equal(s, s0), (g, n, k, "rows")
    starts = torch.arange(g) * n
    a = (starts, torch.full_like(starts, n), starts, g * n, 1, k * n, n, True)
    out1 = torch.empty(g, k, n, dtype=torch.float8_e4m3fn)
    out2 = torch.empty_like(out1)
    s1 = fp8_triton.launch_cols(w.reshape(g * n, k), out1, *a, config=CFG)
    s2 = fp8_triton.launch_cols(w.reshape(g * n, k), out2, *a, config=CFG, amax=amax)
    assert torch.equal(out1.view(U8), out2.view(U8)) and torch.equal(s1, s2), (g, n, k, "cols")


case(3, 32, 24)
case(1, 16, 50)
case(4, 8, 7)
print("ok")
'''


def test_column_amax_kernels_interpreted():
    run_interpreted(SCRIPT)
