"""fc1's fprop with the SwiGLU epilogue on the CPU in Triton's interpreter (TRITON_INTERPRET=1).

Runs where triton is installed and no GPU is (the GPU runs the compiled kernel in
``tests/test_fc1_epilogue.py``). float16 only (the interpreter's ``tl.dot`` on bfloat16 is
wrong, see ``tests/test_grouped_gemm_triton_interpret.py``). Checks, with and without probs,
int32 and int64 offsets: ``h`` and ``a`` equal the plain Triton fprop followed by the Triton
SwiGLU kernel bit for bit (also interpreted), padding rows are zero, and ``h`` / ``a`` match a
float64 per-expert reference; empty groups, padding only, no rows, a skewed group (row-block
split), FF not a multiple of the column tile, non-contiguous weights.
"""

from __future__ import annotations

from interpret import interpreter_marks, run_interpreted

pytestmark = interpreter_marks("tests/test_fc1_epilogue.py")

SCRIPT = r'''
import torch
import torch.nn.functional as F
from te_ops.gemm import grouped_gemm_triton as gt
from te_ops.gemm import grouped_mlp_triton as gm
from te_ops.kernels import swiglu_triton as st


def case(sizes, m, f, k, odt, with_p):
    gen = torch.Generator().manual_seed(m + f + k)
    x = torch.randn(m, k, generator=gen).half()
    w = (torch.randn(len(sizes), k, 2 * f, generator=gen) * k ** -0.5).half().transpose(1, 2)
    offs = torch.tensor(sizes).cumsum(0).to(odt)
    p = torch.rand(m, generator=gen) if with_p else None
    h, a = gm._launch(x, w, offs, p, None, gm._fc1_swiglu_kernel)
    h0 = gt._fprop(x, w, offs)
    a0 = st._forward(h0, p, st._fwd_kernel)
    assert torch.equal(h, h0) and torch.equal(a, a0), (sizes, m, f, k)
    total = sum(sizes)
    assert not h[total:].any() and not a[total:].any()
    start = 0
    want_h = torch.zeros(m, 2 * f, dtype=torch.float64)
    for g, n in enumerate(sizes):
        want_h[start:start + n] = F.linear(x[start:start + n].double(), w[g].double())
        start += n
    gate, up = want_h[:, :f], want_h[:, f:]
    want_a = gate * torch.sigmoid(gate) * up
    if p is not None:
        want_a = want_a * p.double()[:, None]
    for name, got, want in (("h", h, want_h), ("a", a, want_a)):
        if want.numel():
            err = (got.double() - want).abs().max().item()
            assert err <= 2e-3 * max(1.0, want.abs().max().item()), (name, sizes, err)


for odt in (torch.int32, torch.int64):
    for with_p in (False, True):
        case([3, 0, 5, 1], 12, 40, 24, odt, with_p)   # an empty group, 3 padding rows
        case([0, 0, 0], 4, 16, 16, odt, with_p)       # padding only
        case([0, 0, 0], 0, 16, 16, odt, with_p)       # no rows
        case([70, 0, 1], 80, 33, 17, odt, with_p)     # skewed; FF=33 not a tile multiple
print("ok")
'''


def test_fc1_swiglu_epilogue_interpreted():
    run_interpreted(SCRIPT)
