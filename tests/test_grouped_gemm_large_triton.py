"""The persistent Triton grouped GEMM (``te_ops/gemm/grouped_gemm_large_triton.py``).

CPU (CI, with or without triton): the config and argument errors, the TMA gate's reasons, the
program count. The interpreter run of the kernel is in
``tests/test_grouped_gemm_large_triton_interpret.py``. CUDA (``@pytest.mark.cuda``): fprop and
fc1 + SwiGLU against an fp64 per-expert ``torch.nn.functional.linear`` reference at N(0, 1)
inputs and init-scale weights (bf16, fp16; TMA and pointer loads; padding rows over NaN
garbage; empty and skewed groups; dims off the tiles), ``a`` bitwise equal to the Triton SwiGLU
forward on the kernel's ``h``, a shape of each benchmark layer (E8, E32, E128) scaled down,
CUDA-graph replay with new split sizes and ``torch.compile(fullgraph=True)`` bitwise equal to
eager.
"""

from __future__ import annotations

import pytest
import torch
from grouped_cuda_helpers import (
    assert_replay_with_new_offsets_equal_to_eager,
    fp64_tolerance,
    grouped_operands,
    per_expert_linear_fp64,
    swiglu_fp64,
)
from sm90_compile import compile_for_sm90, for_nesting

from te_ops.gemm import grouped_gemm_large_triton as L

CUDA = torch.device("cuda")


# ----------------------------------------------------------------------------------- CPU
def test_config_kinds_and_bad_kind():
    assert L.large_config("fprop")["BLOCK_N"] == 256
    assert L.large_config("fc1_swiglu")["BLOCK_N"] == 256  # PAIRED: gate + up halves
    assert L.large_config("dgrad")["BLOCK_N"] == 256
    with pytest.raises(ValueError,
                       match="kind must be 'fprop', 'dgrad' or 'fc1_swiglu', got 'wgrad'"):
        L.large_config("wgrad")


def _ops(m=8, n=6, k=4, g=2, dtype=torch.bfloat16):
    return (torch.zeros(m, k, dtype=dtype), torch.zeros(g, n, k, dtype=dtype),
            torch.tensor([3, 8]))


@pytest.mark.parametrize("fn", [L.large_fprop, L.large_fc1_swiglu])
@pytest.mark.parametrize("change, match", [
    ({"x": torch.zeros(8, 4, 1)}, r"x must be 2-D \(rows, in_features\), got shape \(8, 4, 1\)"),
    ({"w": torch.zeros(2, 6, 4)}, r"weights must be 3-D \(G, N, K\) torch.bfloat16 on cpu, got "
                                  r"shape \(2, 6, 4\) torch.float32"),
    ({"w": torch.zeros(2, 6, 5, dtype=torch.bfloat16)}, "x has 4 columns, .* have K=5"),
    ({"offs": torch.tensor([8])}, r"offsets must be int32/int64 of shape \(2,\) on cpu, got "
                                  r"torch.int64 \(1,\)"),
    ({"offs": torch.tensor([3.0, 8.0])}, "offsets must be int32/int64"),
])
def test_argument_errors_name_the_argument(fn, change, match):
    x, w, offs = _ops()
    x, w, offs = change.get("x", x), change.get("w", w), change.get("offs", offs)
    with pytest.raises(ValueError, match=match):
        fn(x, w, offs)


def test_fc1_errors_odd_rows_and_probs_shape():
    x, w, offs = _ops(n=5)
    with pytest.raises(ValueError, match="even number of rows .* got 2F=5"):
        L.large_fc1_swiglu(x, w, offs)
    x, w, offs = _ops()
    with pytest.raises(ValueError, match=r"probs must have shape \(8,\) on cpu, got \(7,\)"):
        L.large_fc1_swiglu(x, w, offs, torch.zeros(7))


@pytest.mark.parametrize("fn", [L.large_fprop, L.large_fc1_swiglu])
def test_cpu_raises_with_the_reason(fn):
    with pytest.raises(RuntimeError, match="cannot run: device type cpu is not cuda"):
        fn(*_ops())


def test_tma_reasons():
    x = torch.zeros(8, 16, dtype=torch.float16)
    w = torch.zeros(2, 4, 16, dtype=torch.float16)
    if L.tl is None or not hasattr(L.tl, "make_tensor_descriptor"):
        assert "make_tensor_descriptor" in L.tma_unsupported_reason(x, w)
        return
    assert L.tma_unsupported_reason(x, w) is None
    assert L.tma_unsupported_reason(x.t(), w) == "x is not contiguous"
    assert "not contiguous along K" in L.tma_unsupported_reason(x, w.transpose(1, 2))
    assert "multiple of 16 bytes" in L.tma_unsupported_reason(x[:, :9].contiguous(), w[..., :9])
    shifted = torch.zeros(8 * 16 + 1, dtype=torch.float16)[1:].view(8, 16)  # base 2 bytes off
    assert "16-byte boundary" in L.tma_unsupported_reason(shifted, w)


def test_grid_size_is_bounded_by_tiles():
    cpu = torch.device("cpu")
    assert L.grid_size(cpu, 10, 2, 16, 16, 16) == min(L._CPU_PROGRAMS, (1 + 2 + 1) * 1)
    assert L.grid_size(cpu, 0, 1, 1, 128, 256) == 2  # (0 + 1 + 1) * 1 tiles at most
    assert L.grid_size(cpu, 4096, 8, 4096, 128, 256) == L._CPU_PROGRAMS


SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*bf16", "h_ptr": "*bf16", "a_ptr": "*bf16",
             "p_ptr": "*fp32", "offs_ptr": "*i32", "M": "i32", "N": "i32",
             "K": "i32", "G": "i32", "P": "i32", "stride_wg": "i32", "stride_wn": "i32",
             "stride_wk": "i32"}


@pytest.mark.parametrize("swiglu, flat, tma, dgrad", [
    (False, False, True, False), (True, True, True, False), (True, False, False, False),
    (False, False, True, True), (False, False, False, True), (False, True, True, False),
    (False, True, False, True)])
def test_compiles_for_sm90_with_wgmma_and_tma(swiglu, flat, tma, dgrad):
    """Ahead-of-time compile for SM90 (no GPU needed, Triton's bundled ptxas): the default
    tiles fit (3 stages of x, W tiles in shared memory), the dots are wgmma and the TMA
    variant's loads are TMA copies. ``FLAT``: Triton fused the k-loops into the tile loops
    (one level of ``scf.for`` in the TTGIR; the group walk has two). Checked with Triton
    3.6.0 (the H200's) and 3.9.0."""
    cfg = L.large_config("fc1_swiglu" if swiglu else "dgrad" if dgrad else "fprop")
    const = {"SWIGLU": swiglu, "HAS_P": swiglu, "USE_TMA": tma, "FLAT": flat, "W_KN": dgrad,
             "GBLOCK": 8 if flat else 1,
             "PAIRED": swiglu,
             **{k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}}
    kernel = _compile_sm90(const, cfg)
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    assert "wgmma.mma_async" in ptx
    assert ("cp.async.bulk.tensor" in ptx) == tma
    assert kernel.metadata.shared <= 227 * 1024
    assert for_nesting(ttgir) == (1 if flat else 2)


def _compile_sm90(const: dict, cfg: dict):
    pytest.importorskip("triton")  # the kernel exists only with triton
    return compile_for_sm90(L._large_kernel, SIGNATURE, const, cfg["num_warps"],
                            cfg["num_stages"])


@pytest.mark.parametrize("change, match", [
    ({"FLATTEN": True}, r"config keys must be among .* got unknown \['FLATTEN'\]"),
])
def test_config_errors_name_the_key(change, match):
    with pytest.raises(ValueError, match=match):
        L._resolve("fprop", change, 4)


def test_flat_with_too_many_groups_takes_the_group_walk():
    assert L._resolve("fprop", {"FLAT": True}, L.FLAT_MAX_GROUPS)["FLAT"] is True
    many = L._resolve("dgrad", {"FLAT": True}, L.FLAT_MAX_GROUPS + 1)
    assert many["FLAT"] is False
    assert L._resolve("fc1_swiglu", None, 8) == L.large_config("fc1_swiglu")


# ---------------------------------------------------------------------------------- CUDA
def fprop_with(x, w, offs, config):
    """The persistent fprop with launch parameters ``config`` (keys of ``large_config``)."""
    return L._launch(x, w, offs, None, "fprop", config, L._large_kernel)[0]


def dgrad_with(dy, w, offs, config):
    return L._launch(dy, w, offs, None, "dgrad", config, L._large_kernel)[0]


def fc1_with(x, w, offs, probs, config):
    return L._launch(x, w, offs, probs, "fc1_swiglu", config, L._large_kernel)


CASES = [
    ([300, 0, 17, 129], 460, 384, 256),      # empty group, 14 padding rows, skew
    ([1000, 3, 0, 0, 250], 1300, 200, 136),  # dims off the tiles
    ([0, 0], 50, 256, 64),                   # padding only
    ([512] * 4, 2048, 1536, 512),            # E128-like fc1 slice, no padding
]


LOADS = [(True, False), (False, False), (True, True)]  # (USE_TMA, FLAT)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tma, flat", LOADS)
@pytest.mark.parametrize("sizes, m, n, k", CASES)
def test_fprop_against_fp64_reference(dtype, tma, flat, sizes, m, n, k):
    x, w, offs, _ = grouped_operands(sizes, m, n, k, dtype)
    y = fprop_with(x, w, offs, {"USE_TMA": tma, "FLAT": flat})
    total = sum(sizes)
    assert y.shape == (m, n) and y.dtype == dtype
    assert not y[total:].any()
    err = (y.double() - per_expert_linear_fp64(x, w, sizes)).abs().max().item() if total else 0.0
    assert err <= fp64_tolerance(dtype, k), err


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tma, flat", LOADS)
@pytest.mark.parametrize("sizes, m, n, k", CASES)
def test_dgrad_against_fp64_reference(dtype, tma, flat, sizes, m, n, k):
    """dx_g = dy_g @ W_g, W (G, N, K): dy (m, n) -> dx (m, k); NaN padding rows of dy give
    zeros."""
    x, w, offs, _ = grouped_operands(sizes, m, n, k, dtype)
    gen = torch.Generator(device="cuda").manual_seed(1)
    dy = torch.randn(m, n, generator=gen, device=CUDA).to(dtype)
    total = sum(sizes)
    dy[total:] = float("nan")
    dx = dgrad_with(dy, w, offs, {"USE_TMA": tma, "FLAT": flat})
    assert dx.shape == (m, k) and dx.dtype == dtype
    assert not dx[total:].any()
    err = ((dx.double() - per_expert_linear_fp64(dy, w.transpose(1, 2), sizes)).abs().max().item()
           if total else 0.0)
    assert err <= fp64_tolerance(dtype, n), err


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tma, flat", LOADS)
@pytest.mark.parametrize("with_p", [True, False])
@pytest.mark.parametrize("sizes, m, n, k", CASES)
def test_fc1_swiglu_against_reference_and_swiglu_bits(dtype, tma, flat, with_p, sizes, m, n,
                                                      k):
    from te_ops.kernels import swiglu_triton as st

    x, w, offs, probs = grouped_operands(sizes, m, n, k, dtype)
    p = probs if with_p else None
    h, a = fc1_with(x, w, offs, p, {"USE_TMA": tma, "FLAT": flat})
    total = sum(sizes)
    assert not h[total:].any() and not a[total:].any()
    assert torch.equal(a, st._forward(h, p, st._fwd_kernel))
    if total:
        want = per_expert_linear_fp64(x, w, sizes)
        assert (h.double() - want).abs().max().item() <= fp64_tolerance(dtype, k)
        err = (a.double() - swiglu_fp64(want, p)).abs()[:total].max().item()
        assert err <= 2 * fp64_tolerance(dtype, k), err


@pytest.mark.cuda
def test_non_contiguous_weights_take_pointer_loads():
    x, w, offs, _ = grouped_operands([100, 60], 170, 256, 128, torch.bfloat16, transposed=True)
    assert L.tma_unsupported_reason(x, w) is not None
    y = L.large_fprop(x, w, offs)
    assert torch.equal(y, fprop_with(x, w.contiguous(), offs, {"USE_TMA": False}))


@pytest.mark.cuda
def test_graph_replay_and_compile_bitwise_equal_to_eager():
    """Captured in a CUDA graph and replayed with new split sizes (same total rows, device
    offsets), and under torch.compile(fullgraph=True): bitwise the eager values."""
    x, w, offs, probs = grouped_operands([300, 0, 200], 520, 512, 256, torch.bfloat16)
    want = L.large_fc1_swiglu(x, w, offs, probs)
    flat = fc1_with(x, w, offs, probs, {"FLAT": True})
    assert torch.equal(flat[0], want[0]) and torch.equal(flat[1], want[1])  # same k-steps
    assert_replay_with_new_offsets_equal_to_eager(L.large_fc1_swiglu, x, w, offs, probs)
    compiled = torch.compile(lambda *a: L.large_fc1_swiglu(*a), fullgraph=True)
    got = compiled(x, w, offs, probs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    fprop = torch.compile(lambda *a: L.large_fprop(*a), fullgraph=True)
    assert torch.equal(fprop(x, w, offs), L.large_fprop(x, w, offs))
    dy = torch.randn(x.shape[0], w.shape[1], device=CUDA).to(x.dtype)
    dgrad = torch.compile(lambda *a: L.large_dgrad(*a), fullgraph=True)
    assert torch.equal(dgrad(dy, w, offs), L.large_dgrad(dy, w, offs))


#: Row counts whose last row tiles (BLOCK_M 128) hold 1, 64, 65, 0 and 127 rows, an empty
#: group and 40 NaN padding rows.
TAIL_CASES = [([129, 0, 192, 193, 256, 127, 30], 1167, 512, 192)]


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["fprop", "dgrad", "fc1_swiglu"])
@pytest.mark.parametrize("change", [{"FLAT": True}, {"FLAT": True, "USE_TMA": False}])
def test_flat_bitwise_equal_to_the_group_walk(kind, change):
    """The flattened schedule (the padding rows, NaN garbage in x, in a loop that stores
    zeros) gives the group walk's bits (same k-steps per output element), zeros in the
    padding rows, and the fp64 reference's values."""
    tma = change.get("USE_TMA", True)
    for sizes, m, n, k in CASES + TAIL_CASES:
        x, w, offs, probs = grouped_operands(sizes, m, n, k, torch.bfloat16)
        total = sum(sizes)
        if kind == "dgrad":
            x = torch.randn(m, n, device=CUDA).to(torch.bfloat16)
            x[total:] = float("nan")
            got = dgrad_with(x, w, offs, change)
            want = dgrad_with(x, w, offs, {"USE_TMA": tma, "FLAT": False})
            ref = per_expert_linear_fp64(x, w.transpose(1, 2), sizes)
        elif kind == "fprop":
            got = fprop_with(x, w, offs, change)
            want = fprop_with(x, w, offs, {"USE_TMA": tma, "FLAT": False})
            ref = per_expert_linear_fp64(x, w, sizes)
        else:
            got, a = fc1_with(x, w, offs, probs, change)
            want, a_want = fc1_with(x, w, offs, probs, {"USE_TMA": tma, "FLAT": False})
            assert torch.equal(a, a_want) and not a[total:].any(), (sizes, change)
            ref = per_expert_linear_fp64(x, w, sizes)
        assert torch.equal(got, want), (sizes, change)
        assert not got[total:].any(), (sizes, change)
        if total:
            red = n if kind == "dgrad" else k
            assert (got.double() - ref).abs().max().item() <= fp64_tolerance(torch.bfloat16, red)


@pytest.mark.cuda
@pytest.mark.parametrize("change", [{}, {"FLAT": False}])
def test_bitwise_equal_to_grouped_mm(change):
    """fprop and dgrad equal ``torch._grouped_mm`` (CUTLASS) bit for bit, as the benchmark
    finds at its layers' shapes, in each schedule (skewed and empty groups, no padding)."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    sizes = [300, 0, 17, 195, 64, 600]
    x, w, offs, _ = grouped_operands(sizes, sum(sizes), 512, 256, torch.bfloat16)
    assert torch.equal(fprop_with(x, w, offs, change),
                       torch._grouped_mm(x, w.transpose(1, 2), offs=offs))
    dy = torch.randn(sum(sizes), 512, device=CUDA).to(torch.bfloat16)
    assert torch.equal(dgrad_with(dy, w, offs, change),
                       torch._grouped_mm(dy, w, offs=offs))
