"""fc1's persistent fprop with the SwiGLU in its epilogue, ``PAIRED`` (one gate + up accumulator,
``kernels/grouped_gemm_large_triton.py``), the default of ``large_fc1_swiglu``.

CPU (CI): the config and its error, the SM90 compile (one flattened loop, one wgmma chain per
k-step, one W TMA load through the (G, 2, F, K) view, shared memory within 227 KiB, no local
memory in the PTX). The interpreter run is in ``tests/test_grouped_gemm_large_triton_interpret.py``.
CUDA: against the fp64 per-expert reference (x ~ N(0, 1), weights at init scale, bf16 and
fp16, with and without probs, NaN garbage in the padding rows), ``h`` bitwise the plain
persistent fprop's and ``a`` bitwise the Triton SwiGLU forward's on that ``h``, the old
two-accumulator kernel's bits, CUDA-graph replay with new split sizes and
``torch.compile(fullgraph=True)`` bitwise equal to eager.
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
from test_grouped_gemm_large_triton import SIGNATURE  # the persistent kernel's arguments

from te_ops.gemm import grouped_gemm_large_triton as L

CUDA = torch.device("cuda")


# ----------------------------------------------------------------------------------- CPU
def test_default_config_is_the_paired_flat_kernel():
    cfg = L.large_config("fc1_swiglu")
    assert cfg["PAIRED"] is True and cfg["FLAT"] is True and cfg["BLOCK_N"] == 256
    assert "PAIRED" not in L.large_config("fprop")  # a plain tile there
    with pytest.raises(ValueError, match="PAIRED=True needs an even BLOCK_N >= 16 .* "
                                         "got BLOCK_N=8"):
        L._resolve("fc1_swiglu", {"BLOCK_N": 8}, 4)
    with pytest.raises(ValueError, match=r"unknown \['PAIRED'\]"):
        L._resolve("fprop", {"PAIRED": True}, 4)


def _compile(change: dict):
    pytest.importorskip("triton")  # the kernel exists only with triton
    cfg = {**L.large_config("fc1_swiglu"), **change}
    const = {"SWIGLU": True, "HAS_P": True, "W_KN": False, "WARP_SPEC": False,
             "GBLOCK": 8 if cfg["FLAT"] else 1,
             **{k: cfg[k] for k in ("USE_TMA", "FLAT", "TAIL", "PAIRED", "BLOCK_M", "BLOCK_N",
                                    "BLOCK_K", "GROUP_M")}}
    return compile_for_sm90(L._large_kernel, SIGNATURE, const, cfg["num_warps"],
                            cfg["num_stages"])


def test_paired_compiles_for_sm90_as_the_plain_fprop():
    """The default (PAIRED, FLAT, TMA): one level of ``scf.for`` (the tile and k loops fused),
    one ``warp_group_dot`` on a 128 x 256 accumulator (the plain fprop's, not two 128 x 128
    ones), W through a rank-4 TMA descriptor, the gate / up split of the accumulator done in
    registers (no ``local_alloc`` beyond the plain fprop's three pipelined buffers), shared
    memory within SM90's 227 KiB. Checked with Triton 3.6.0 (the H200's)."""
    kernel = _compile({})
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    assert for_nesting(ttgir) == 1
    assert ttgir.count("ttng.warp_group_dot ") == 1
    assert "tensor<128x256xf32, #mma>" in ttgir
    assert "rank = 4" in ttgir  # the (G, 2, F, K) view's shared layout
    assert ttgir.count("ttg.local_alloc") == 3
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor.4d" in ptx
    assert ".local" not in ptx
    assert kernel.metadata.shared <= 227 * 1024


# ---------------------------------------------------------------------------------- CUDA
def _reference(x, w, sizes, probs):
    """fp64 per-expert ``F.linear`` and SwiGLU (gate first, TE's convention)."""
    h = per_expert_linear_fp64(x, w, sizes)
    return h, swiglu_fp64(h, probs)


CASES = [
    ([300, 0, 17, 129], 460, 384, 256),      # empty group, 14 padding rows, skew
    ([1000, 3, 0, 0, 250], 1300, 200, 136),  # F = 100: off the 128-column halves
    ([0, 0], 50, 256, 64),                   # padding only
    ([512] * 4, 2048, 1536, 512),            # E128-like fc1 slice, no padding
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_p", [True, False])
def test_against_reference_and_the_two_launches_bits(dtype, with_p):
    """h within the fp64 reference's tolerance and bitwise the persistent fprop's (same tiles
    of M, same k-steps), a bitwise the Triton SwiGLU forward on that h, padding rows h = 0
    and a = SiLU(0) * 0 * p = 0, over NaN garbage."""
    from te_ops.kernels import swiglu_triton as st

    for sizes, m, n, k in CASES:
        x, w, offs, probs = grouped_operands(sizes, m, n, k, dtype)
        p = probs if with_p else None
        h, a = L.large_fc1_swiglu(x, w, offs, p)
        total = sum(sizes)
        assert h.shape == (m, n) and a.shape == (m, n // 2) and h.dtype == a.dtype == dtype
        assert torch.equal(h, L.large_fprop(x, w, offs)), sizes
        assert torch.equal(a, st.swiglu_forward(h, p)), sizes
        assert not h[total:].any() and not a[total:].any()
        if total:
            want_h, want_a = _reference(x, w, sizes, p)
            tol = fp64_tolerance(dtype, k)
            assert (h.double() - want_h).abs().max().item() <= tol
            assert (a.double() - want_a)[:total].abs().max().item() <= 2 * tol


@pytest.mark.cuda
@pytest.mark.parametrize("change", [{"FLAT": False}, {"USE_TMA": False},
                                    {"TAIL": True},
                                    {"PAIRED": False, "BLOCK_N": 128, "FLAT": False}])
def test_schedules_loads_and_the_old_kernel_give_the_same_bits(change):
    """The group walk, pointer loads, half-height tail tiles and two-accumulator
    kernel (PAIRED=False) give the default's bits."""
    for sizes, m, n, k in CASES:
        x, w, offs, probs = grouped_operands(sizes, m, n, k, torch.bfloat16)
        want = L.large_fc1_swiglu(x, w, offs, probs)
        got = L.large_fc1_swiglu(x, w, offs, probs, config=change)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (sizes, change)


@pytest.mark.cuda
def test_graph_replay_and_compile_bitwise_equal_to_eager():
    """Captured in a CUDA graph, replayed with new split sizes (same rows, device offsets);
    ``torch.compile(fullgraph=True)`` of the op ``te_ops::grouped_fc1_swiglu_large`` (its
    fake kernel gives the shapes): bitwise the eager values."""
    x, w, offs, probs = grouped_operands([300, 0, 200], 520, 512, 256, torch.bfloat16)
    want = L.large_fc1_swiglu(x, w, offs, probs)
    assert_replay_with_new_offsets_equal_to_eager(L.large_fc1_swiglu, x, w, offs, probs)
    compiled = torch.compile(lambda *a: L.large_fc1_swiglu(*a), fullgraph=True)
    for p in (probs, None):
        got = compiled(x, w, offs, p)
        ref = L.large_fc1_swiglu(x, w, offs, p)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert torch.equal(want[0], L.large_fprop(x, w, offs))
