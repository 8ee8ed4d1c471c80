"""The flat-schedule persistent wgrad: offsets and shared-memory edge cases.

1. Offsets that are not contiguous (a strided view of the cumulative ends): the kernels read
   ``offs_ptr + g``, so every Triton grouped GEMM launch passes ``offsets.contiguous()`` (the
   same tensor when it already is: no copy, graph-safe). Checked in Triton's CPU interpreter
   against the contiguous call for the persistent wgrad (flat and nested, TMA and pointer
   loads), the persistent fprop / dgrad, the few-rows fprop / wgrad and the fc1 + SwiGLU
   kernel.
2. int64 offsets past ``2**31`` (bad device split sizes, past M): the persistent wgrad clamps
   them to ``[0, M]`` in the offsets' dtype, then casts (as the fprop kernels do, in int64),
   so the group ends at M; an int32 cast first would wrap (e.g. ``2**32 + 5`` -> 5).
"""

from __future__ import annotations

import pytest
import torch
from interpret import interpreter_marks, run_interpreted
from sm90_compile import compile_for_sm90

_INTERPRETER = interpreter_marks("tests/test_persistent_wgrad_offsets.py (the cuda tests)")

SCRIPT = r'''
import torch
from te_ops.gemm import grouped_gemm_large_triton as L
from te_ops.gemm import grouped_gemm_triton as gt
from te_ops.gemm import grouped_mlp_triton as mt
from te_ops.gemm import grouped_wgrad_large_triton as W

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


@_INTERPRETER[0]
@_INTERPRETER[1]
def test_strided_and_int64_offsets_interpreted():
    """Non-contiguous offsets give the contiguous call's bits in every Triton grouped GEMM
    launch; int64 offsets past 2**31 clamp to M in the persistent wgrad (flat, nested)."""
    run_interpreted(SCRIPT)


def test_flat_accumulate_does_not_fit_sm90_shared_memory():
    """Why the accumulate launch keeps the nested schedule (docs/architecture.md): the flat
    kernel with ``ACCUMULATE`` (fp32 ``out`` loaded in the epilogue) needs more shared memory
    than an SM90 block has (232,448 bytes), so its launch cannot run; the nested one fits.
    Ahead-of-time compile, Triton 3.6 (the H200's)."""
    pytest.importorskip("triton")
    from te_ops.gemm import grouped_wgrad_large_triton as W

    cfg = W.large_wgrad_config()
    sig = {"x_ptr": "*bf16", "dy_ptr": "*bf16", "out_ptr": "*fp32", "offs_ptr": "*i32",
           "order_ptr": "*i64", "M": "i32", "N": "i32", "K": "i32", "G": "i32", "P": "i32"}
    shared = {}
    for name, kernel, extra in (
            ("flat", W._wgrad_flat_kernel, {"TMA_STORE": False, "G_POW2": 8}),
            ("nested", W._wgrad_large_kernel, {})):
        const = {"ACCUMULATE": True, "USE_TMA": True, **extra,
                 **{k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}}
        flat_sig = {k: v for k, v in sig.items() if name == "nested" or k != "order_ptr"}
        shared[name] = compile_for_sm90(kernel, flat_sig, const, cfg["num_warps"],
                                        cfg["num_stages"]).metadata.shared
    assert shared["flat"] > 232448 >= shared["nested"], shared


# ---------------------------------------------------------------------------------- CUDA
def _cuda_operands(sizes, m, n, k, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
    dy = torch.randn(m, n, generator=gen, device="cuda").to(dtype)
    total = sum(sizes)
    x[total:] = float("nan")
    dy[total:] = float("nan")
    return x, dy, torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)


def _fp64_wgrad(x, dy, bounds):
    return torch.stack([dy[s:e].double().t() @ x[s:e].double() for s, e in bounds])


@pytest.mark.cuda
def test_cuda_strided_and_int64_offsets():
    """On the GPU (default flat config: per-group TMA bounds, TMA store): strided offsets give
    the contiguous call's bits (wgrad, persistent fprop); int64 offsets past 2**31 end at M."""
    from te_ops.gemm import grouped_gemm_large_triton as L
    from te_ops.gemm import grouped_wgrad_large_triton as W

    x, dy, offs = _cuda_operands([300, 0, 17, 129, 64], 600, 256, 512, torch.bfloat16)
    strided = torch.stack([offs, torch.full_like(offs, 7)], 1).reshape(-1)[::2]
    assert torch.equal(strided, offs) and not strided.is_contiguous()
    assert torch.equal(W.large_wgrad(x, dy, strided), W.large_wgrad(x, dy, offs))
    w = torch.randn(5, 256, 512, device="cuda", dtype=torch.bfloat16)
    want = L.large_fprop(x, w, offs)
    assert torch.equal(L.large_fprop(x, w, strided)[:510], want[:510])
    xs, dys = x[:510].contiguous(), dy[:510].contiguous()
    big = torch.tensor([300, 2 ** 32 + 5], device="cuda", dtype=torch.int64)
    ref = _fp64_wgrad(xs, dys, [(0, 300), (300, 510)])
    for flat in (True, False):
        got = W._launch(xs, dys, big, None, {"FLAT": flat}).double()
        assert ((got - ref).abs() - 2.0 ** -8 * ref.abs()).max().item() <= 1e-2, flat


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", [{}, {"TMA_STORE": False}], ids=str)
def test_cuda_flat_many_tiles_per_program(dtype, cfg):
    """The flat schedule where programs run many tiles of several groups (300 groups, not a
    power of 2, 1200 tiles over the SMs: descriptors change per group inside one program's
    pipelined loop; GPU cases had at most one tile per program), with empty groups,
    skewed sizes and NaN padding: the fp64 reference and the nested schedule's bits."""
    from te_ops.gemm import grouped_wgrad_large_triton as W

    gen = torch.Generator().manual_seed(3)
    sizes = [int(s) for s in torch.randint(0, 5, (300,), generator=gen) ** 3]  # 0..64
    x, dy, offs = _cuda_operands(sizes, sum(sizes) + 40, 256, 512, dtype)
    dw = W._launch(x, dy, offs, None, {"FLAT": True, **cfg})
    ends = offs.tolist()
    ref = _fp64_wgrad(x, dy, list(zip([0] + ends[:-1], ends)))
    rel = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    assert ((dw.double() - ref).abs() - rel * ref.abs()).max().item() <= 1e-2
    assert torch.equal(dw, W._launch(x, dy, offs, None, {"FLAT": False, "TMA_STORE": False}))
