"""te_ops' Triton grouped GEMMs on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``).

Runs where triton is installed and no GPU is (the GPU runs the compiled kernels in
``tests/test_grouped_gemm_triton.py``). float16 only: the interpreter's ``tl.dot`` on bfloat16
operands returns garbage (triton 3.9, checked on a one-tile kernel), which says nothing about
the kernels. Against a float64 per-expert reference: empty groups, padding rows past the
split-size sum (zero output), a skewed group (row-block split), no rows at all, int32 and int64
offsets, non-contiguous weights.
"""

from __future__ import annotations

from interpret import interpreter_marks, run_interpreted

pytestmark = interpreter_marks("tests/test_grouped_gemm_triton.py")

SCRIPT = r'''
import torch
from te_ops.gemm import grouped_gemm_triton as gt


def ref(kind, a, b, sizes):
    s, outs = 0, []
    if kind == "wgrad":  # a = x (M, K), b = dy (M, N)
        out = torch.zeros(len(sizes), b.shape[1], a.shape[1], dtype=torch.float64)
        for g, m in enumerate(sizes):
            out[g] = b[s:s + m].double().t() @ a[s:s + m].double()
            s += m
        return out
    j = b.shape[1] if kind == "fprop" else b.shape[2]
    out = torch.zeros(a.shape[0], j, dtype=torch.float64)  # padding rows stay zero
    for g, m in enumerate(sizes):
        w = b[g].double()
        out[s:s + m] = a[s:s + m].double() @ (w.t() if kind == "fprop" else w)
        s += m
    return out


def case(sizes, m, n, k, odt):
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).half()
    dy = torch.randn(m, n, generator=gen).half()
    w = torch.randn(len(sizes), k, n, generator=gen).half().transpose(1, 2)  # (G, N, K) view
    offs = torch.tensor(sizes).cumsum(0).to(odt)
    got = {"fprop": gt._fprop(x, w, offs), "dgrad": gt._dgrad(dy, w, offs),
           "wgrad": gt._wgrad_launch(x, dy, offs, None, gt._wgrad_kernel)}
    args = {"fprop": (x, w), "dgrad": (dy, w), "wgrad": (x, dy)}
    for kind, out in got.items():
        r = ref(kind, *args[kind], sizes)
        assert out.shape == r.shape and out.dtype == torch.float16, (kind, sizes, out.shape)
        if r.numel():
            err = (out.double() - r).abs().max().item()
            assert err <= 2e-3 * max(1.0, r.abs().max().item()), (kind, sizes, m, n, k, err)


for odt in (torch.int32, torch.int64):
    case([3, 0, 5, 1], 12, 40, 24, odt)   # an empty group, 3 padding rows
    case([0, 0, 0], 4, 16, 16, odt)       # padding only
    case([0, 0, 0], 0, 16, 16, odt)       # no rows
    case([70, 0, 1], 80, 33, 17, odt)     # skewed: the row-block split
    case([1] * 8, 8, 64, 64, odt)         # one row per group (decode)
print("ok")
'''


def test_triton_grouped_gemms_interpreted():
    run_interpreted(SCRIPT)
