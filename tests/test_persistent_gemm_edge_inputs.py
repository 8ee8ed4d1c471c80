"""The persistent many-rows Triton grouped GEMMs: edge inputs.

* No groups (weights (0, N, K), offsets (0,)) with rows: every row is padding, and the
  kernel reads no element of the empty offsets.
* Offsets past the rows of x (bad device split sizes, not checkable without a sync): the rows
  are clamped to M (no write past h; the wgrad walks no negative row count).
* The ``te_ops::`` ops called directly with non-contiguous operands: made contiguous, as the
  Python wrappers do (the kernels assume row strides K / N).
* The TMA gate under FakeTensors (``torch.compile``): a storage offset that is not 16-byte
  aligned is known there and drops TMA (a misaligned TMA base faults on the GPU).
* int64 address math on the pointer-load path: no 32-bit tensor products of an index and a
  stride in the TTIR (``k * stride_wk`` would overflow for weights of more than 2^31
  elements, e.g. a (K, G, N) buffer viewed as (G, N, K)).

Interpreter cases run in a subprocess (``TRITON_INTERPRET=1``) against float64 references.
"""

from __future__ import annotations

import re

import pytest
import torch
from interpret import interpreter_marks, run_interpreted
from sm90_compile import compile_for_sm90

HEADER = r'''
import torch
import torch.nn.functional as F
from te_ops.gemm import grouped_gemm_large_triton as L
from te_ops.gemm import grouped_wgrad_large_triton as W

SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}


def ref_fprop(x, w, bounds):
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    for g, (s, e) in enumerate(bounds):
        out[s:e] = F.linear(x[s:e].double(), w[g].double())
    return out


def ref_wgrad(x, dy, bounds):
    return torch.stack([dy[s:e].double().t() @ x[s:e].double() for s, e in bounds])


def close(got, want, tag):
    err = (got.double() - want).abs().max().item() if want.numel() else 0.0
    assert err <= 2e-3 * max(1.0, want.abs().max().item()), (tag, err)
'''

NO_GROUPS = HEADER + r'''
x = torch.randn(40, 24).half()
w = torch.zeros(0, 32, 24).half()
offs = torch.zeros(0, dtype=torch.int32)
p = torch.rand(40)
for tma, flat in ((True, False), (False, True)):
    conf = {**SMALL, "USE_TMA": tma, "FLAT": flat}
    y, _ = L._launch(x, w, offs, None, "fprop", conf, L._large_kernel)
    assert y.shape == (40, 32) and not y.any(), (tma, flat)
    dx, _ = L._launch(torch.randn(40, 32).half(), w, offs, None, "dgrad", conf, L._large_kernel)
    assert dx.shape == (40, 24) and not dx.any(), (tma, flat)
    h, a = L._launch(x, w, offs, p, "fc1_swiglu", conf, L._large_kernel)
    assert h.shape == (40, 32) and a.shape == (40, 16) and not h.any() and not a.any()
    # no reduction (K = 0): zeros, with groups
    offs2 = torch.tensor([10, 30], dtype=torch.int32)
    y, _ = L._launch(x[:, :0], torch.zeros(2, 32, 0).half(), offs2, None, "fprop", conf,
                     L._large_kernel)
    assert y.shape == (40, 32) and not y.any(), (tma, flat)
    h, a = L._launch(x[:, :0], torch.zeros(2, 32, 0).half(), offs2, p, "fc1_swiglu", conf,
                     L._large_kernel)
    assert h.shape == (40, 32) and not h.any() and not a.any()
print("ok")
'''

PAST_ROWS = HEADER + r'''
gen = torch.Generator().manual_seed(0)
m, n, k = 40, 48, 24
x = torch.randn(m, k, generator=gen).half()
w = (torch.randn(3, n, k, generator=gen) * k ** -0.5).half()
dy = torch.randn(m, n, generator=gen).half()
def clamped(offsets):  # the kernels' rows: 0 <= start <= end <= m
    ends = [min(max(e, 0), m) for e in offsets]
    return [(min(s, e), e) for s, e in zip([0] + ends[:-1], ends)]


for offsets in ([16, 2000, 3000], [8, 30, 45], [50, 60, 70], [-8, 10, 40], [-5, -3, 12]):
    bounds = clamped(offsets)
    for odt in (torch.int32, torch.int64):
        offs = torch.tensor(offsets, dtype=odt)
        for tma, flat in ((True, False), (False, False), (True, True), (False, True)):
            tag = (offsets, odt, tma, flat)
            conf = {**SMALL, "USE_TMA": tma, "FLAT": flat}
            y, _ = L._launch(x, w, offs, None, "fprop", conf, L._large_kernel)
            close(y, ref_fprop(x, w, bounds), tag)
            dx, _ = L._launch(dy, w, offs, None, "dgrad", conf, L._large_kernel)
            close(dx, ref_fprop(dy, w.transpose(1, 2), bounds), tag)
            h, a = L._launch(x, w, offs, None, "fc1_swiglu", conf, L._large_kernel)
            close(h, ref_fprop(x, w, bounds), tag)
        for tma, flat in ((True, False), (False, False), (True, True), (False, True)):
            conf = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "USE_TMA": tma, "FLAT": flat}
            dw = W._launch(x, dy, offs, None, conf)
            close(dw, ref_wgrad(x, dy, bounds), (offsets, odt, tma, flat, "wgrad"))
# decreasing offsets (a negative split size): groups overlap, so the overlapped rows are
# ill-defined, but no access leaves x / the outputs (a crash or heap corruption here) and the
# rows only one group owns are right (0:10 group 0, 30:40 padding)
offs = torch.tensor([30, 10, 20], dtype=torch.int32)
for tma, flat in ((True, False), (False, True)):
    conf = {**SMALL, "USE_TMA": tma, "FLAT": flat}
    y, _ = L._launch(x, w, offs, None, "fprop", conf, L._large_kernel)
    want = ref_fprop(x, w, [(0, 30), (10, 10), (10, 20)])
    close(y[:10], want[:10], ("decreasing", tma, flat))
    assert not y[30:].any()
for flat in (False, True):
    W._launch(x, dy, offs, None, {"USE_TMA": False, "FLAT": flat})
print("ok")
'''

OPS_NONCONTIGUOUS = HEADER + r'''
gen = torch.Generator().manual_seed(1)
x = torch.randn(20, 48, generator=gen).half()[:, ::2]          # (20, 24), row stride 48
w = (torch.randn(2, 32, 24, generator=gen) * 0.2).half()
dy = torch.randn(20, 64, generator=gen).half()[:, ::2]         # (20, 32), row stride 64
p = torch.rand(40, generator=gen)[::2]
offs = torch.tensor([7, 20], dtype=torch.int32)
bounds = [(0, 7), (7, 20)]
close(torch.ops.te_ops.grouped_gemm_large(x, w, offs), ref_fprop(x, w, bounds), "fprop")
close(torch.ops.te_ops.grouped_dgrad_large(dy, w, offs),
      ref_fprop(dy, w.transpose(1, 2), bounds), "dgrad")
h, a = torch.ops.te_ops.grouped_fc1_swiglu_large(x, w, offs, p)
close(h, ref_fprop(x, w, bounds), "fc1 h")
want = ref_fprop(x, w, bounds)
want_a = F.silu(want[:, :16]) * want[:, 16:] * p.double()[:, None]
close(a, want_a, "fc1 a")
close(torch.ops.te_ops.grouped_wgrad_large(x, dy, offs), ref_wgrad(x, dy, bounds), "wgrad")
out = torch.zeros(2, 32, 24)
torch.ops.te_ops.grouped_wgrad_large_accumulate(x, dy, offs, out)
close(out, ref_wgrad(x, dy, bounds), "wgrad accumulate")
print("ok")
'''


FEW_ROWS_PAST = HEADER + r'''
from te_ops.gemm import grouped_gemm_triton as gt

gen = torch.Generator().manual_seed(2)
m, n, k = 12, 40, 24
x = torch.randn(m, k, generator=gen).half()
dy = torch.randn(m, n, generator=gen).half()
w = torch.randn(3, n, k, generator=gen).half()
for offsets, bounds in (([5, 300, 900], [(0, 5), (5, 12), (12, 12)]),
                        ([-4, 7, 9], [(0, 0), (0, 7), (7, 9)])):
    offs = torch.tensor(offsets, dtype=torch.int32)
    close(gt._fprop(x, w, offs), ref_fprop(x, w, bounds), ("fprop", offsets))
    close(gt._dgrad(dy, w, offs), ref_fprop(dy, w.transpose(1, 2), bounds), ("dgrad", offsets))
    close(gt._wgrad_launch(x, dy, offs, None, gt._wgrad_kernel), ref_wgrad(x, dy, bounds),
          ("wgrad", offsets))
print("ok")
'''

_INTERPRETER = interpreter_marks("tests/test_grouped_gemm_large_triton.py")


@pytest.mark.parametrize("script", [
    pytest.param(NO_GROUPS, marks=_INTERPRETER, id="no_groups"),
    pytest.param(PAST_ROWS, marks=_INTERPRETER, id="offsets_past_rows"),
    pytest.param(OPS_NONCONTIGUOUS, marks=_INTERPRETER, id="ops_noncontiguous"),
    pytest.param(FEW_ROWS_PAST, marks=_INTERPRETER, id="few_rows_offsets_past_rows")])
def test_interpreted(script):
    run_interpreted(script)


# ------------------------------------------------------------------------ TMA gate, fake
def _misaligned_fake(shape: tuple[int, ...]) -> torch.Tensor:
    """A bf16 view with storage offset 1 (2 bytes): not on a 16-byte boundary."""
    numel = 1
    for s in shape:
        numel *= s
    return torch.empty(numel + 8, dtype=torch.bfloat16)[1:1 + numel].view(shape)


def test_tma_gate_sees_fake_storage_offset():
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from te_ops.gemm import grouped_gemm_large_triton as L
    from te_ops.gemm import grouped_wgrad_large_triton as W

    if not hasattr(L.tl, "make_tensor_descriptor"):
        pytest.skip("the installed Triton has no tl.make_tensor_descriptor")
    with FakeTensorMode():
        x = torch.empty(64, 32, dtype=torch.bfloat16)
        w = torch.empty(2, 16, 32, dtype=torch.bfloat16)
        dy = torch.empty(64, 16, dtype=torch.bfloat16)
        assert L.tma_unsupported_reason(x, w) is None
        assert W.tma_unsupported_reason(x, dy) is None
        why = L.tma_unsupported_reason(x, _misaligned_fake((2, 16, 32)))
        assert why is not None and "16-byte" in why
        why = L.tma_unsupported_reason(_misaligned_fake((64, 32)), w)
        assert why is not None and "16-byte" in why
        why = W.tma_unsupported_reason(x, _misaligned_fake((64, 16)))
        assert why is not None and "16-byte" in why
        aligned = torch.empty(2 * 16 * 32 + 8, dtype=torch.bfloat16)[8:8 + 2 * 16 * 32]
        assert L.tma_unsupported_reason(x, aligned.view(2, 16, 32)) is None


# ------------------------------------------------------------------ int64 address math
_SIG = {"x_ptr": "*bf16", "w_ptr": "*bf16", "h_ptr": "*bf16", "a_ptr": "*bf16",
        "p_ptr": "*fp32", "offs_ptr": "*i32", "M": "i32", "N": "i32",
        "K": "i32", "G": "i32", "P": "i32", "stride_wg": "i32", "stride_wn": "i32",
        "stride_wk": "i32"}
_WGRAD_SIG = {"x_ptr": "*bf16", "dy_ptr": "*bf16", "out_ptr": "*fp32", "offs_ptr": "*i32",
              "order_ptr": "*i64", "M": "i32", "N": "i32", "K": "i32", "G": "i32", "P": "i32"}
_I32_TENSOR_MUL = re.compile(r"arith\.muli .*: tensor<[0-9x]+xi32>")


def _ttir(fn, signature: dict, const: dict) -> str:
    return compile_for_sm90(fn, signature, const).asm["ttir"]


@pytest.mark.parametrize("schedule", [{"FLAT": False}, {"FLAT": True}])
@pytest.mark.parametrize("kind", ["fprop", "dgrad", "fc1_swiglu"])
def test_pointer_loads_use_int64_offsets(kind, schedule):
    """Every tensor product in the pointer-load kernel (row * row stride, index * weight
    stride) is 64-bit: M * N or a weight's storage past 2^31 elements cannot wrap."""
    pytest.importorskip("triton")
    from te_ops.gemm import grouped_gemm_large_triton as L

    swiglu = kind == "fc1_swiglu"
    cfg = L.large_config(kind)
    const = {"SWIGLU": swiglu, "HAS_P": swiglu, "USE_TMA": False, "W_KN": kind == "dgrad",
             "GBLOCK": 128 if schedule.get("FLAT") else 1, "PAIRED": swiglu,
             **{k: cfg[k] for k in ("FLAT", "BLOCK_M", "BLOCK_N",
                                    "BLOCK_K", "GROUP_M")}, **schedule}
    ttir = _ttir(L._large_kernel, _SIG, const)
    assert "tt.addptr" in ttir
    assert not _I32_TENSOR_MUL.findall(ttir)


@pytest.mark.parametrize("flat", [False, True])
def test_wgrad_pointer_loads_use_int64_offsets(flat):
    pytest.importorskip("triton")
    from te_ops.gemm import grouped_wgrad_large_triton as W

    cfg = W.large_wgrad_config()
    const = {"ACCUMULATE": not flat, "USE_TMA": False,
             **{k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}}
    kernel = W._wgrad_large_kernel
    if flat:  # the flat schedule (pointer loads and stores)
        const.update(TMA_STORE=False, G_POW2=8)
        kernel = W._wgrad_flat_kernel
    sig = {k: v for k, v in _WGRAD_SIG.items() if not flat or k != "order_ptr"}
    ttir = _ttir(kernel, sig, const)
    assert "tt.addptr" in ttir
    assert not _I32_TENSOR_MUL.findall(ttir)


# ---------------------------------------------------------------------------------- CUDA
def _ref_fprop(x: torch.Tensor, w: torch.Tensor, bounds: list[tuple[int, int]]
               ) -> torch.Tensor:
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64, device=x.device)
    for g, (s, e) in enumerate(bounds):
        out[s:e] = x[s:e].double() @ w[g].double().t()
    return out


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.double(), want, rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.cuda
def test_cuda_offsets_past_rows_and_no_groups():
    """Compiled kernels (TMA and pointer loads, both schedules): offsets past M give the
    clamped groups' rows (without the clamp the kernel wrote rows past h: run under
    ``compute-sanitizer`` to see the writes themselves); no groups give zeros."""
    from te_ops.gemm import grouped_gemm_large_triton as L
    from te_ops.gemm import grouped_wgrad_large_triton as W

    gen = torch.Generator(device="cuda").manual_seed(0)
    m, n, k = 300, 256, 128
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(3, n, k, device="cuda", generator=gen) * k ** -0.5).bfloat16()
    offs = torch.tensor([100, 5000, 9000], device="cuda", dtype=torch.int32)
    bounds = [(0, 100), (100, 300), (300, 300)]
    for tma, flat in ((True, False), (False, False), (True, True)):
        y = L._launch(x, w, offs, None, "fprop", {"USE_TMA": tma, "FLAT": flat},
                      L._large_kernel)[0]
        _close(y, _ref_fprop(x, w, bounds))
    dy = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
    dw = W.large_wgrad(x, dy, offs)
    want = torch.stack([dy[s:e].double().t() @ x[s:e].double() for s, e in bounds])
    torch.testing.assert_close(dw.double(), want, rtol=1.6e-2, atol=0.2)
    none = torch.zeros(0, n, k, device="cuda", dtype=torch.bfloat16)
    y = L.large_fprop(x, none, torch.zeros(0, device="cuda", dtype=torch.int32))
    torch.cuda.synchronize()
    assert y.shape == (m, n) and not y.any()


@pytest.mark.cuda
def test_cuda_compile_misaligned_weights_view():
    """Weights that are a view of a larger buffer at a 2-byte offset: eager (data pointer) and
    torch.compile (FakeTensor storage offset) both take pointer loads, no misaligned TMA."""
    from te_ops.gemm import grouped_gemm_large_triton as L

    gen = torch.Generator(device="cuda").manual_seed(1)
    g, n, k, m = 2, 256, 128, 256
    buf = torch.randn(g * n * k + 8, device="cuda", generator=gen).bfloat16() * k ** -0.5
    w = buf[1:1 + g * n * k].view(g, n, k)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    offs = torch.tensor([100, 256], device="cuda", dtype=torch.int32)
    want = _ref_fprop(x, w, [(0, 100), (100, 256)])
    _close(L.large_fprop(x, w, offs), want)

    def call(x, buf, offs):
        return L.large_fprop(x, buf[1:1 + g * n * k].view(g, n, k), offs)

    got = torch.compile(call, fullgraph=True)(x, buf, offs)
    torch.cuda.synchronize()
    _close(got, want)
