"""The bound call sites of the persistent many-rows GEMMs (``grouped_gemm_large_bound``) in
Triton's CPU interpreter (``TRITON_INTERPRET=1``; Triton 3.9, see
``tests/test_grouped_wgrad_large_triton_interpret.py`` for why not 3.6).

Each site's output equals, bit for bit, the eager launch (``_launch`` of
``grouped_gemm_large_triton`` / ``grouped_wgrad_large_triton``: what ``large_fprop`` /
``large_dgrad`` / ``large_wgrad`` run after their checks, which raise off CUDA) over
repeated calls with new values: TMA and pointer-load layouts (a K whose rows are not 16-byte
multiples), weights whose strides change between calls (the plan is rebuilt: k-major
weights take pointer loads), padding rows of NaN, empty groups, no rows; an operand whose
base pointer is not 16-byte aligned takes the eager entry point (here a stand-in that
records the call). The GPU twin is ``tests/test_large_bound_cuda.py``.
"""

from __future__ import annotations

from interpret import interpreter_marks, run_interpreted

pytestmark = interpreter_marks("tests/test_large_bound_cuda.py")

SCRIPT = r'''
import torch
from te_ops.gemm import grouped_gemm_large_triton as L
from te_ops.gemm import grouped_wgrad_large_triton as W
from te_ops.gemm.grouped_gemm_large_bound import BoundLarge, BoundLargeWgrad
from te_ops.kernels.triton_launch import LaunchBatch

gen = torch.Generator().manual_seed(0)


def operands(sizes, m, n, k):
    total = sum(sizes)
    x = torch.randn(m, k, generator=gen).half()
    x[total:] = float("nan")  # padding rows
    w = torch.randn(len(sizes), n, k, generator=gen).half()
    dy = torch.randn(m, n, generator=gen).half()
    dy[total:] = float("nan")
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    return x, w, dy, offs


def eager(kind, a, w, offs):
    return L._launch(a, w, offs, None, kind, None, L._large_kernel)[0]


def same(got, want, tag):
    assert got.shape == want.shape and got.dtype == want.dtype, tag
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), tag


fallbacks = []
for sizes, m, n, k in (([37, 0, 5, 13], 64, 40, 24), ([0, 0, 0], 4, 16, 16),
                       ([20, 0, 7], 30, 36, 20)):  # K * 2 bytes not a 16-byte multiple
    batch = LaunchBatch()
    fprop, dgrad, wgrad = BoundLarge("fprop", batch), BoundLarge("dgrad", batch), \
        BoundLargeWgrad(batch)
    for site in (fprop, dgrad, wgrad):
        site.general = lambda *a, _s=site: fallbacks.append(_s) or "general"
    for call in range(3):  # new values each call, the same plan
        x, w, dy, offs = operands(sizes, m, n, k)
        tag = (sizes, m, n, k, call)
        same(fprop(x, w, offs), eager("fprop", x, w, offs), tag)
        same(dgrad(dy, w, offs), eager("dgrad", dy, w, offs), tag)
        same(wgrad(x, dy, offs), W._launch(x, dy, offs, None, None), tag)
    assert fprop.plan[4] == (k % 8 == 0), (fprop.plan, k)  # TMA loads where the layout allows
    # weights with other strides (k-major storage): the plan is rebuilt, pointer loads
    wk = w.transpose(1, 2).contiguous().transpose(1, 2)
    same(fprop(x, wk, offs), eager("fprop", x, wk, offs), (tag, "k-major"))
    assert fprop.plan[0] == wk.stride() and not fprop.plan[4]
    same(fprop(x, w, offs), eager("fprop", x, w, offs), (tag, "back"))
    assert not fallbacks, fallbacks
    if fprop.plan[4]:  # an operand 2 bytes past a 16-byte boundary: the eager entry point
        buf = torch.randn(m * k + 1, generator=gen).half()
        assert fprop(buf[1:].view(m, k), w, offs) == "general"
        assert fallbacks == [fprop]
        buf = torch.randn(m * n + 1, generator=gen).half()
        assert wgrad(x, buf[1:].view(m, n), offs) == "general"
        assert fallbacks == [fprop, wgrad]
        fallbacks.clear()

# no rows; no groups (zeros / an empty output, as the eager calls)
x, w, dy, offs = operands([0, 0], 0, 16, 16)
batch = LaunchBatch()
same(BoundLarge("fprop", batch)(x, w, offs), eager("fprop", x, w, offs), "no rows")
x, w, dy, offs = operands([3, 5], 8, 16, 16)
w0, offs0 = w[:0], offs[:0]
got = BoundLarge("fprop", batch)(x, w0, offs0)
same(got, eager("fprop", x, w0, offs0), "no groups")
assert not got.any()
same(BoundLargeWgrad(batch)(x[:0], dy[:0], offs), W._launch(x[:0], dy[:0], offs, None, None),
     "wgrad no rows")
print("ok")
'''


def test_bound_large_sites_interpreted():
    run_interpreted(SCRIPT)
