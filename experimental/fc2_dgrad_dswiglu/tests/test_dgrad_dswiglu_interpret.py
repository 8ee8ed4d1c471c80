"""fc2's dgrad with the SwiGLU backward in its epilogue (``kernels/dgrad_dswiglu_triton.py``) in
Triton's CPU interpreter (``TRITON_INTERPRET=1``).

Runs where triton is installed and no GPU is (the GPU runs the compiled kernel in
``tests/test_dgrad_dswiglu.py``). float16 only (the interpreter's ``tl.dot`` on bfloat16 is
wrong, see ``tests/test_grouped_gemm_triton_interpret.py``). Checks, with and without probs,
int32 and int64 offsets, both schedules (``FLAT`` and the group walk), both epilogue forms
(``EPI_SPLIT`` 1 and 2), TMA and pointer loads (h through TMA too: ``H_TMA``): dh and a
equal the persistent dgrad followed by the Triton SwiGLU backward bit for bit (both
interpreted), dprobs within fp32 rounding of
that kernel's, everything against a float64 per-expert reference; empty groups, padding rows
over NaN garbage, padding only, no rows, FF not a multiple of the tile, dh written over h.
"""

from __future__ import annotations

from interpret import interpreter_marks, run_interpreted

pytestmark = interpreter_marks("tests/test_dgrad_dswiglu.py")

SCRIPT = r'''
import torch
import torch.nn.functional as F
from te_ops.kernels import dgrad_dswiglu_triton as D
from te_ops.kernels import grouped_gemm_large_triton as L
from te_ops.kernels import swiglu_triton as st

SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}


def reference(dy, w, h, p, sizes):
    da = torch.zeros(dy.shape[0], w.shape[2], dtype=torch.float64)
    start = 0
    for g, n in enumerate(sizes):
        da[start:start + n] = dy[start:start + n].double() @ w[g].double()
        start += n
    f = w.shape[2]
    gate, up = h[:, :f].double(), h[:, f:].double()
    s = torch.sigmoid(gate)
    silu = gate * s
    a = silu * up
    dp = (a * da).sum(1)
    if p is not None:
        a = a * p.double()[:, None]
        da = da * p.double()[:, None]
    dgate = da * up * s * (1 + gate * (1 - s))
    return torch.cat([dgate, da * silu], 1), dp, a


def close(name, got, want, case, tol=2e-3):
    if want.numel():
        err = (got.double() - want).abs().max().item()
        assert err <= tol * max(1.0, want.abs().max().item()), (name, case, err)


def case(sizes, m, f, n, odt, cfg, with_p, into=False):
    gen = torch.Generator().manual_seed(m + f + n)
    total = sum(sizes)
    dy = torch.randn(m, n, generator=gen).half()
    dy[total:] = float("nan")  # padding rows: garbage that must not reach the outputs
    w = (torch.randn(len(sizes), n, f, generator=gen) * n ** -0.5).half()
    h = torch.randn(m, 2 * f, generator=gen).half()
    p = torch.rand(m, generator=gen) if with_p else None
    offs = torch.tensor(sizes).cumsum(0).to(odt)
    tag = (sizes, m, f, n, odt, cfg, with_p, into)
    h_in = h.clone()
    dh, dp, a = D._launch(dy, w, offs, h_in, p, cfg, into,
                          (D._dgrad_dswiglu_kernel, D._sum_partials_kernel, st._bwd_kernel))
    if m * f:  # (empty tensors share data pointer 0)
        assert (dh.data_ptr() == h_in.data_ptr()) == into, tag
    da, _ = L._launch(dy, w, offs, None, "dgrad", {**SMALL, "FLAT": True}, L._large_kernel)
    dh0, dp0, a0 = st._backward(h.clone(), da, p, True, False, st._bwd_kernel)
    assert torch.equal(dh, dh0) and torch.equal(a, a0), tag  # the two launches' bits
    if p is None:
        assert dp is None, tag
    else:
        assert dp.dtype == p.dtype and dp.shape == p.shape, tag
        close("dprobs vs kernel", dp, dp0.double(), tag, 1e-5)
    want_dh, want_dp, want_a = reference(dy, w, h, p, sizes)
    close("dh", dh, want_dh, tag)
    close("a", a, want_a, tag)
    if p is not None:
        close("dprobs", dp, want_dp, tag, 5e-3)


for odt in (torch.int32, torch.int64):
    for with_p in (False, True):
        for extra in ({"FLAT": True}, {"FLAT": False}, {"FLAT": True, "EPI_SPLIT": 2},
                      {"FLAT": True, "USE_TMA": False}, {"FLAT": True, "H_TMA": True},
                      {"FLAT": False, "H_TMA": True, "EPI_SPLIT": 1}):
            cfg = {**SMALL, **extra}
            case([3, 0, 5, 1], 12, 40, 24, odt, cfg, with_p)       # empty group, padding
            case([70, 0, 1, 9], 85, 33, 40, odt, cfg, with_p, True)  # skewed, FF off tiles
            case([9, 0, 20, 3], 40, 32, 24, odt, cfg, with_p, True)  # FF on tiles (H_TMA)
        case([0, 0, 0], 4, 16, 16, odt, SMALL, with_p)   # padding only
        case([0, 0, 0], 0, 16, 16, odt, SMALL, with_p)   # no rows
        case([], 5, 16, 16, odt, SMALL, with_p)          # no groups: all rows padding
case([33, 2], 40, 34, 24, torch.int32, {}, True)  # the default 128x128x64 tiles
L.FLAT_MAX_GROUPS = 3  # more groups than the table holds: the group walk, same bits
case([3, 0, 5, 1], 12, 40, 24, torch.int32, SMALL, True)
print("ok")
'''


def test_dgrad_dswiglu_interpreted():
    run_interpreted(SCRIPT)
