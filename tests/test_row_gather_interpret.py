"""The few-rows Triton kernels' row gather (``A_ROWS`` / ``X_ROWS`` / ``DY_ROWS``) on the CPU
through Triton's interpreter (``TRITON_INTERPRET=1``).

Runs where triton is installed and no GPU is (the GPU runs the compiled kernels in
``tests/test_moe_fusions_cuda.py``). float16 (the interpreter's bf16 ``tl.dot`` is unreliable,
see test_grouped_gemm_triton_interpret.py). Each gathered launch against the same kernel on the
gathered copy (``te_ops.routing.pick``), bitwise, and against a float64 reference: repeated
rows, index entries past the source (zero rows), an empty group, padding rows, int32 and int64
indices, no rows at all.
"""

from __future__ import annotations

from interpret import interpreter_marks, run_interpreted

pytestmark = interpreter_marks("tests/test_moe_fusions_cuda.py")

SCRIPT = r'''
import torch
from te_ops.gemm import grouped_gemm_triton as gt, grouped_mlp_triton as gm
from te_ops.routing import pick


def ref_rows(a, w, sizes, rows, fprop=True):
    out = torch.zeros(rows, w.shape[1] if fprop else w.shape[2], dtype=torch.float64)
    s = 0
    for g, m in enumerate(sizes):
        wg = w[g].double()
        out[s:s + m] = a[s:s + m].double() @ (wg.t() if fprop else wg)
        s += m
    return out


def case(sizes, rows, src_rows, k, n, idt, seed):
    gen = torch.Generator().manual_seed(seed)
    x_src = torch.randn(src_rows, k, generator=gen).half()
    d_src = torch.randn(src_rows, n, generator=gen).half()
    index = torch.randint(0, src_rows + 1, (rows,), generator=gen).to(idt)  # src_rows: zero
    x, dy = pick(x_src, index.long()), pick(d_src, index.long())
    w = torch.randn(len(sizes), n, k, generator=gen).half()
    offs = torch.tensor(sizes).cumsum(0)
    y = gt._fprop(x_src, w, offs, a_rows=index)
    assert torch.equal(y, gt._fprop(x, w, offs)), ("fprop", sizes)
    dx = gt._dgrad(d_src, w, offs, a_rows=index)
    assert torch.equal(dx, gt._dgrad(dy, w, offs)), ("dgrad", sizes)
    if rows:
        torch.testing.assert_close(y.double(), ref_rows(x, w, sizes, rows), rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(dx.double(), ref_rows(dy, w, sizes, rows, False), rtol=2e-3,
                                   atol=2e-3)
    plain = gt._wgrad_launch(x, dy, offs, None, gt._wgrad_kernel)
    for xr, dr in ((index, None), (None, index), (index, index)):
        got = gt._wgrad_launch(x_src if xr is not None else x, d_src if dr is not None else dy,
                               offs, None, gt._wgrad_kernel, xr, dr)
        assert torch.equal(got, plain), ("wgrad", xr is None, dr is None, sizes)
    w1 = torch.randn(len(sizes), 2 * 16, k, generator=gen).half()
    p = torch.rand(rows, generator=gen)
    h, a = gm._launch(x_src, w1, offs, p, None, gm._fc1_swiglu_kernel, index)
    h0, a0 = gm._launch(x, w1, offs, p, None, gm._fc1_swiglu_kernel)
    assert torch.equal(h, h0) and torch.equal(a, a0), ("fc1_swiglu", sizes)


for idt in (torch.int64, torch.int32):
    case([3, 0, 5, 1], 12, 9, 24, 40, idt, 0)   # an empty group, 3 padding rows
    case([70, 0, 1], 80, 50, 17, 33, idt, 1)    # skewed, repeated rows
    case([0, 0], 0, 4, 16, 16, idt, 2)          # no rows
print("ok")
'''


def test_gathered_kernels_equal_the_kernels_on_the_gathered_copy():
    run_interpreted(SCRIPT)
