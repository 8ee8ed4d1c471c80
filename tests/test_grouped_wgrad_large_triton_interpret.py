"""The large-shape Triton grouped wgrad (``grouped_wgrad_large_triton``) in Triton's
CPU interpreter (``TRITON_INTERPRET=1``).

Runs where triton is installed and no GPU is (the GPU runs the compiled kernel in
``tests/test_grouped_wgrad_large_triton.py``). float16 only (the interpreter's ``tl.dot`` on
bfloat16 is wrong, see ``tests/test_grouped_gemm_triton_interpret.py``). Note: Triton 3.6's
interpreter fails here with numpy 2.x (``range()`` over a scalar kernel argument, which it
holds as a 1-element array; so does ``grouped_gemm_large_triton``'s test); Triton 3.9's runs
it. Both load variants (pointer loads; TMA descriptors with the ``tl.where`` masking of the
tail step), small tiles (several row steps, n- and k-tiles per group, more tiles than programs)
and the default tiles, the nested and the flat schedules (per-group TMA bounds or
pointer loads' masks; TMA or pointer stores), int32 and int64 offsets, two program counts,
groups by decreasing rows (the flat kernel's in-register order equals ``group_order``'s
stable argsort). Against a float64 per-group ``dy_g^T @ x_g`` reference at N(0, 1)
inputs: empty groups, a group smaller than BLOCK_M, groups ending mid-step (their tail rows are
the next group's), padding rows of NaN, dims off the tiles, no rows; and the fp32 accumulation
into ``out``.
"""

from __future__ import annotations

from interpret import interpreter_marks, run_interpreted

pytestmark = interpreter_marks("tests/test_grouped_wgrad_large_triton.py")

SCRIPT = r'''
import torch
from te_ops.gemm import grouped_wgrad_large_triton as W

SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}


def reference(x, dy, sizes):
    out = torch.zeros(len(sizes), dy.shape[1], x.shape[1], dtype=torch.float64)
    start = 0
    for g, n in enumerate(sizes):
        out[g] = dy[start:start + n].double().t() @ x[start:start + n].double()
        start += n
    return out


def case(sizes, m, n, k, odt, cfg, tma):
    gen = torch.Generator().manual_seed(m + n + k)
    total = sum(sizes)
    x = torch.randn(m, k, generator=gen).half()
    dy = torch.randn(m, n, generator=gen).half()
    x[total:] = float("nan")  # padding rows: garbage that must not reach dW
    dy[total:] = float("nan")
    offs = torch.tensor(sizes).cumsum(0).to(odt)
    conf = {**cfg, "USE_TMA": tma}
    tag = (sizes, m, n, k, odt, cfg, tma)
    want = reference(x, dy, sizes)
    if tma and n % 8 == 0 and k % 8 == 0:
        assert W.tma_unsupported_reason(x, dy) is None, tag  # the TMA loads run
    dw = W._launch(x, dy, offs, None, conf)
    assert dw.shape == (len(sizes), n, k) and dw.dtype == torch.float16, tag
    err = ((dw.double() - want).abs() - 2.0 ** -11 * want.abs()).max().item() if dw.numel() else 0
    assert err <= 1e-3, (tag, err)
    for g, size in enumerate(sizes):
        assert size or not dw[g].any(), tag
    main_grad = torch.randn(len(sizes), n, k, generator=gen)
    before = main_grad.clone()
    got = W._launch(x, dy, offs, main_grad, conf)  # the accumulate launch: nested schedule
    assert got is main_grad, tag
    if main_grad.numel():
        err = (main_grad.double() - before.double() - want).abs().max().item()
        assert err <= 1e-4, (tag, err)


NESTED = {"FLAT": False}
FLAT_PTR_STORE = {"FLAT": True, "TMA_STORE": False}
for sched in (NESTED, {}, FLAT_PTR_STORE):  # {}: the default (flat, TMA store)
    for tma in (False, True):
        for odt in (torch.int32, torch.int64):
            small = {**SMALL, **sched}
            case([37, 0, 5, 13], 64, 40, 24, odt, small, tma)   # empty, < BLOCK_M, NaN pad
            case([0, 0, 0], 4, 16, 16, odt, small, tma)         # padding only
            case([0, 0], 0, 16, 16, odt, small, tma)            # no rows
            case([70, 0, 1, 9], 85, 40, 48, odt, small, tma)    # skewed, off tiles
        case([33, 2], 40, 40, 24, torch.int32, sched, tma)  # default 64-row steps, tiles
case([70, 0, 1, 9], 85, 34, 40, torch.int32, SMALL, True)  # N*2 bytes not 16-aligned: pointers
case([20, 0, 7], 30, 36, 17, torch.int32, SMALL, True)     # K*2 bytes not 16-aligned: pointers
W._CPU_PROGRAMS = 3  # another program count: a different tile-to-program assignment
case([70, 0, 1, 9], 85, 40, 48, torch.int32, SMALL, True)
case([5, 40, 0, 21, 3], 75, 20, 30, torch.int64, SMALL, False)
case([5, 40, 0, 21, 3], 75, 24, 32, torch.int64, {**SMALL, **NESTED}, True)


# The flat kernel's in-register group order (``_rank_order``) against torch's stable argsort
# (``group_order``, the nested launch's table): ties, empty groups, one group, lanes past G.
import triton
import triton.language as tl


@triton.jit
def _order_kernel(offs_ptr, out_ptr, M, G, G_POW2: tl.constexpr):
    r = tl.arange(0, G_POW2).to(tl.int64)
    valid = r < G
    tl.store(out_ptr + r, W._rank_order(offs_ptr, r, valid, M, G_POW2), mask=valid)


def kernel_order(sizes, odt, m=None):
    offs = torch.tensor(sizes).cumsum(0).to(odt)
    out = torch.full((len(sizes),), -1, dtype=torch.int32)
    m = int(offs[-1]) if m is None else m
    _order_kernel[(1,)](offs, out, m, len(sizes), G_POW2=W.next_power_of_2(len(sizes)))
    return offs, out


gen = torch.Generator().manual_seed(5)
for sizes in ([3], [0], [4, 4, 4], [0, 5, 0, 5, 2], [7, 1, 7, 0, 3, 9, 9, 2],
              torch.randint(0, 6, (37,), generator=gen).tolist(),
              torch.randint(0, 300, (128,), generator=gen).tolist()):
    for odt in (torch.int32, torch.int64):
        offs, got = kernel_order(sizes, odt)
        assert torch.equal(got.long(), W.group_order(offs)), (sizes, got)
# offsets past M: the kernel orders by the clamped rows the tiles run (torch by the raw ones)
offs, got = kernel_order([5, 10, 10], torch.int32, m=12)  # rows 5, 7, 0 after clamping
assert got.tolist() == [1, 0, 2] and W.group_order(offs).tolist() == [1, 2, 0], got
print("ok")
'''


def test_large_grouped_wgrad_interpreted():
    run_interpreted(SCRIPT)
