"""Review of stop 14 (the flat-schedule persistent wgrad): faults found and their fixes.

1. Offsets that are not contiguous (a strided view of the cumulative ends): every Triton
   grouped GEMM launch passed the tensor to its kernel, which reads ``offs_ptr + g``, so
   group ``g`` got the wrong element of the storage and the result was silently wrong. The
   launches now pass ``offsets.contiguous()`` (the same tensor when it already is: no copy,
   graph-safe). Checked in Triton's CPU interpreter against the contiguous call for the
   persistent wgrad (flat and nested, TMA and pointer loads), the persistent fprop / dgrad,
   the few-rows fprop / wgrad and the fc1 + SwiGLU kernel.
2. int64 offsets past ``2**31`` (bad device split sizes, past M): the persistent wgrad cast
   them to int32 before clamping to ``[0, M]``, so a wrapped value (e.g. ``2**32 + 5`` ->
   5) replaced the clamp to M that its docstring promises (and that the fprop kernels do,
   in int64). Now clamped in the offsets' dtype, then cast: the group ends at M.
"""

from __future__ import annotations

from interpret import interpreter_marks, run_interpreted

pytestmark = interpreter_marks("tests/test_grouped_wgrad_large_triton.py")

SCRIPT = r'''
import torch
from te_ops.kernels import grouped_gemm_large_triton as L
from te_ops.kernels import grouped_gemm_triton as gt
from te_ops.kernels import grouped_mlp_triton as mt
from te_ops.kernels import grouped_wgrad_large_triton as W

SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}
gen = torch.Generator().manual_seed(0)
m, n, k, sizes = 64, 32, 16, [20, 0, 7, 30]
x = torch.randn(m, k, generator=gen).half()
dy = torch.randn(m, n, generator=gen).half()
w = torch.randn(len(sizes), n, k, generator=gen).half()
probs = torch.rand(m, generator=gen)
x[57:] = float("nan")  # padding rows
dy[57:] = float("nan")
offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
strided = torch.stack([offs, torch.full_like(offs, 3)], 1).reshape(-1)[::2]
assert torch.equal(strided, offs) and not strided.is_contiguous()


def same(a, b, tag):
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), tag


# 1. non-contiguous offsets: the same bits as the contiguous tensor, for every launch
for flat in (True, False):
    for tma in (True, False):
        conf = {**SMALL, "FLAT": flat, "USE_TMA": tma}
        same(W._launch(x, dy, strided, None, conf), W._launch(x, dy, offs, None, conf),
             ("wgrad_large", flat, tma))
    conf = {**SMALL, "USE_TMA": False}
    acc = torch.zeros(len(sizes), n, k)
    same(W._launch(x, dy, strided, acc.clone(), conf), W._launch(x, dy, offs, acc, conf),
         ("wgrad_large accumulate", flat))
    conf = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "USE_TMA": False, "FLAT": flat}
    for kind, a in (("fprop", x), ("dgrad", dy)):
        same(L._launch(a, w, strided, None, kind, conf, L._large_kernel)[0],
             L._launch(a, w, offs, None, kind, conf, L._large_kernel)[0], ("large", kind, flat))
same(gt._fprop(x, w, strided), gt._fprop(x, w, offs), "few-rows fprop")
same(gt._wgrad_launch(x, dy, strided, None, gt._wgrad_kernel),
     gt._wgrad_launch(x, dy, offs, None, gt._wgrad_kernel), "few-rows wgrad")
w1 = torch.randn(len(sizes), 2 * 16, k, generator=gen).half()
for p in (None, probs):
    got = mt._launch(x, w1, strided, p, None, mt._fc1_swiglu_kernel)
    want = mt._launch(x, w1, offs, p, None, mt._fc1_swiglu_kernel)
    same(got[0][:57], want[0][:57], "fc1 swiglu h")
    same(got[1][:57], want[1][:57], "fc1 swiglu a")

# 2. int64 offsets past 2**31 end at M (clamped before the int32 cast)
xs, dys = x[:57].clone(), dy[:57].clone()
big = torch.tensor([20, 2 ** 32 + 5], dtype=torch.int64)  # group 1: rows 20:57 (M)
want = torch.stack([dys[:20].double().t() @ xs[:20].double(),
                    dys[20:].double().t() @ xs[20:].double()])
for flat in (True, False):
    for tma in (True, False):
        conf = {**SMALL, "FLAT": flat, "USE_TMA": tma}
        got = W._launch(xs, dys, big, None, conf).double()
        err = ((got - want).abs() - 2.0 ** -11 * want.abs()).max().item()
        assert err <= 1e-3, ("int64 past 2**31", flat, tma, err)
print("ok")
'''


def test_strided_and_int64_offsets_interpreted():
    """Non-contiguous offsets give the contiguous call's bits in every Triton grouped GEMM
    launch; int64 offsets past 2**31 clamp to M in the persistent wgrad (flat, nested)."""
    run_interpreted(SCRIPT)
