"""The persistent Triton grouped GEMM (``grouped_gemm_large_triton``) in Triton's
CPU interpreter (``TRITON_INTERPRET=1``).

Runs where triton is installed and no GPU is (the GPU runs the compiled kernel in
``tests/test_grouped_gemm_large_triton.py``). float16 only (the interpreter's ``tl.dot`` on
bfloat16 is wrong, see ``tests/test_grouped_gemm_triton_interpret.py``). Both load variants
(TMA descriptors and plain pointers), both schedules (groups walked in order; ``FLAT``: one
loop over the tiles, each tile's group from a tile table in registers; many groups, one, and
more than ``FLAT_MAX_GROUPS``), small tiles
(many tiles per group, the GROUP_M bands, more tiles than programs) and the default tiles,
int32 and int64 offsets.
Against a float64 per-expert ``torch.nn.functional.linear`` reference: empty groups, padding
rows over NaN garbage (zero output), a skewed group, no rows, dims not multiples of the tiles,
non-contiguous weights (pointer loads). The fc1 variant: ``h`` against the reference, ``a``
equal bit for bit to the Triton SwiGLU forward kernel (also interpreted) run on the kernel's
``h``, with and without probs. dgrad (``W_KN``: W read as (G, K_red, N_out)) on the same
weights.
"""

from __future__ import annotations

from interpret import interpreter_marks, run_interpreted

pytestmark = interpreter_marks("tests/test_grouped_gemm_large_triton.py")

SCRIPT = r'''
import torch
import torch.nn.functional as F
from te_ops.gemm import grouped_gemm_large_triton as L
from te_ops.kernels import swiglu_triton as st

SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}


def reference(x, w, sizes):
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)  # padding rows stay 0
    start = 0
    for g, n in enumerate(sizes):
        out[start:start + n] = F.linear(x[start:start + n].double(), w[g].double())
        start += n
    return out


def close(name, got, want, case):
    if want.numel():
        err = (got.double() - want).abs().max().item()
        assert err <= 2e-3 * max(1.0, want.abs().max().item()), (name, case, err)


def case(sizes, m, n, k, odt, cfg, tma, with_p, transposed=False, flat=False):
    gen = torch.Generator().manual_seed(m + n + k)
    total = sum(sizes)
    x = torch.randn(m, k, generator=gen).half()
    x[total:] = float("nan")  # padding rows: garbage the kernel must not read into output
    if transposed:  # (G, N, K) view of a (G, K, N) tensor: pointer loads only
        w = (torch.randn(len(sizes), k, n, generator=gen) * k ** -0.5).half().transpose(1, 2)
    else:
        w = (torch.randn(len(sizes), n, k, generator=gen) * k ** -0.5).half()
    offs = torch.tensor(sizes).cumsum(0).to(odt)
    conf = {**cfg, "USE_TMA": tma, "FLAT": flat}
    want = reference(x, w, sizes)
    tag = (sizes, m, n, k, odt, cfg, tma, flat)
    y, none = L._launch(x, w, offs, None, "fprop", conf, L._large_kernel)
    assert none is None and y.shape == (m, n) and y.dtype == torch.float16, tag
    assert not y[total:].any(), tag  # zeros, not NaN
    close("y", y, want, tag)
    # dgrad: dy (m, n) @ W_g (n, k) -> (m, k), the same kernel reading W as (G, K_red, N_out)
    dy = torch.randn(m, n, generator=gen).half()
    dy[total:] = float("nan")
    dx, _ = L._launch(dy, w, offs, None, "dgrad", conf, L._large_kernel)
    assert dx.shape == (m, k) and not dx[total:].any(), tag
    close("dx", dx, reference(dy, w.transpose(1, 2), sizes), tag)
    if n % 2:
        return
    p = torch.rand(m, generator=gen) if with_p else None
    h, a = L._launch(x, w, offs, p, "fc1_swiglu", conf, L._large_kernel)
    assert h.shape == (m, n) and a.shape == (m, n // 2), tag
    assert not h[total:].any() and not a[total:].any(), tag
    close("h", h, want, tag)
    assert torch.equal(a, st._forward(h, p, st._fwd_kernel)), tag  # the SwiGLU's bits
    gate, up = want[:, :n // 2], want[:, n // 2:]
    want_a = gate * torch.sigmoid(gate) * up
    if p is not None:
        want_a = want_a * p.double()[:, None]
    close("a", a, want_a, tag)


for tma, flat in ((True, False), (False, False), (True, True)):
    for odt in (torch.int32, torch.int64):
        with_p = odt == torch.int64
        case([3, 0, 5, 1], 12, 40, 24, odt, SMALL, tma, with_p, flat=flat)   # empty group
        case([0, 0, 0], 4, 16, 16, odt, SMALL, tma, with_p, flat=flat)       # padding only
        case([0, 0, 0], 0, 16, 16, odt, SMALL, tma, with_p, flat=flat)       # no rows
        case([70, 0, 1, 9], 85, 66, 40, odt, SMALL, tma, with_p, flat=flat)  # skewed, off tiles
    case([33, 2], 40, 34, 24, torch.int32, {}, tma, True, flat=flat)  # default 128x256x64
case([70, 0, 1, 9], 85, 66, 40, torch.int32, SMALL, False, True, flat=True)  # flat, pointers
case([5] * 9, 50, 32, 16, torch.int64, SMALL, True, True, flat=True)  # 9 groups: 16 lanes
L._CPU_PROGRAMS = 3  # another program count: a different tile-to-program assignment
case([70, 0, 1, 9], 85, 66, 40, torch.int32, SMALL, True, True)
case([70, 0, 1, 9], 85, 66, 40, torch.int32, SMALL, True, True, flat=True)
case([20, 0, 7], 30, 36, 17, torch.int32, SMALL, True, True)       # K*2 bytes not 16-aligned
case([20, 0, 7], 30, 36, 24, torch.int64, SMALL, False, True, transposed=True)
case([20, 0, 7], 30, 36, 24, torch.int64, SMALL, True, False, transposed=True)  # TMA dropped
x = torch.zeros(8, 17).half()
assert L.tma_unsupported_reason(x, torch.zeros(2, 4, 17).half()) is not None
assert L.tma_unsupported_reason(x[:, :16], torch.zeros(2, 4, 16).half()) == "x is not contiguous"
# FLAT over many groups (17 groups + padding: a 32-lane tile table), one group, and more
# groups than FLAT_MAX_GROUPS (the launch takes the group walk: same outputs)
sizes17 = [0, 3, 17, 1, 0, 40, 2, 5, 16, 0, 9, 33, 1, 1, 0, 7, 12]
for tma in (True, False):
    case(sizes17, 160, 24, 16, torch.int32, SMALL, tma, True, flat=True)
    case([37], 45, 32, 24, torch.int64, SMALL, tma, False, flat=True)
L.FLAT_MAX_GROUPS = 3
case([3, 0, 5, 1], 12, 40, 24, torch.int32, SMALL, True, True, flat=True)
L.FLAT_MAX_GROUPS = 1024
# fc1 PAIRED (the default: one gate + up accumulator, W1 through its (G, 2, F, K) view) against
# the plain fprop's h bit for bit (h's 32-column tiles there, 16 + 16 here); F = 20 is off
# the 16-column halves
gen = torch.Generator().manual_seed(5)
x = torch.randn(35, 24, generator=gen).half()
x[29:] = float("nan")
w = (torch.randn(3, 40, 24, generator=gen) * 24 ** -0.5).half()
offs = torch.tensor([20, 20, 29], dtype=torch.int32)
p = torch.rand(35, generator=gen)
PAIR = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2}
for tma, flat in ((True, True), (False, True), (True, False), (False, False)):
    conf = {**PAIR, "USE_TMA": tma, "FLAT": flat}
    y, _ = L._launch(x, w, offs, None, "fprop", conf, L._large_kernel)
    h, a = L._launch(x, w, offs, p, "fc1_swiglu", conf, L._large_kernel)
    assert torch.equal(h, y), (tma, flat)
    assert torch.equal(a, st._forward(h, p, st._fwd_kernel)) and not a[29:].any(), (tma, flat)
print("ok")
'''


def test_large_grouped_gemm_interpreted():
    run_interpreted(SCRIPT)
