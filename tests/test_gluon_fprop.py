"""The warp-specialized Gluon grouped GEMM (``kernels/grouped_gemm_gluon.py``): an experiment.

CPU (CI): the launch config, the argument errors and the reason on CPU; the sm_90
ahead-of-time compile (skipped without Gluon or an sm_90 ptxas: run with Triton 3.6 on the
path): three partitions with their register budgets (``setmaxnreg``), wgmma, TMA loads, no
spills, shared memory within SM90's 227 KiB. CUDA (``@pytest.mark.cuda``): fprop and dgrad
against an fp64 per-expert ``torch.nn.functional.linear`` reference at N(0, 1) inputs and
init-scale weights, padding rows that start as NaN garbage, empty groups, bitwise equal to
``torch._grouped_mm`` and to the persistent Triton kernel, CUDA-graph replay with changed
offsets bitwise equal to eager.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from te_ops.kernels import grouped_gemm_gluon as GG

CUDA = torch.device("cuda")


# ----------------------------------------------------------------------------------- CPU
def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"config keys must be among .* got unknown \['FLAT'\]"):
        GG._resolve({"FLAT": True})
    with pytest.raises(ValueError, match="SPLIT=True needs num_warps=4 .* got num_warps=8"):
        GG._resolve({"SPLIT": True})
    with pytest.raises(ValueError, match="num_warps must be 8 .* got 4"):
        GG._resolve({"num_warps": 4})


def test_config_fits_the_register_file():
    cfg = GG.gluon_config()
    warps = cfg["num_warps"] + 4  # the producer and the epilogue share one warpgroup
    assert cfg["EPI_WARPS"] + 1 <= 4
    assert GG.MAXNREG * warps * 32 <= 65536
    assert cfg["BLOCK_M"] % cfg["SUB_M"] == 0


def test_argument_errors_name_the_argument():
    x = torch.zeros(8, 4, dtype=torch.bfloat16)
    w = torch.zeros(2, 6, 5, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x has 4 columns, .* have K=5"):
        GG.gluon_fprop(x, w, torch.tensor([3, 8]))
    with pytest.raises(ValueError, match="dy has 4 columns, weights .* have N=6"):
        GG.gluon_dgrad(x, w, torch.tensor([3, 8]))
    with pytest.raises(ValueError, match=r"offsets must be int32/int64 of shape \(2,\)"):
        GG.gluon_fprop(x, torch.zeros(2, 6, 4, dtype=torch.bfloat16), torch.tensor([8]))


def test_cpu_raises_with_the_reason():
    x, w = torch.zeros(8, 4, dtype=torch.bfloat16), torch.zeros(2, 6, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="cannot run: device type cpu is not cuda"):
        GG.gluon_fprop(x, w, torch.tensor([3, 8]))
    reason = GG.gluon_unsupported_reason(x, w)
    assert reason is not None and ("CUDA" in reason or "gluon" in reason)


SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "offs_ptr": "*i32",
             "M": "i32", "N": "i32", "K": "i32", "G": "i32", "P": "i32",
             "stride_wg": "i32", "stride_wn": "i32", "stride_wk": "i32"}


def _compile_sm90(dgrad: bool, split: bool = False):
    pytest.importorskip("triton")
    if GG.gluon is None:
        pytest.skip("no triton.experimental.gluon in this Triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = GG._resolve({"SPLIT": True, "num_warps": 4} if split else None)
    const = {"W_KN": dgrad, "GBLOCK": 8, **cfg}
    src = GluonASTSource(GG._gluon_kernel, {**SIGNATURE, **{k: "constexpr" for k in const}},
                         constexprs=const)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": cfg["num_warps"], "maxnreg": GG.MAXNREG})
    except RuntimeError as exc:  # pragma: no cover - e.g. no ptxas in this install
        if "ptxas" in str(exc).lower() and "insufficient registers" not in str(exc).lower():
            pytest.skip(f"cannot assemble for sm_90 here: {str(exc)[:200]}")
        raise


@pytest.mark.parametrize("dgrad, split", [(False, False), (True, False), (False, True),
                                          (True, True)])
def test_compiles_for_sm90_warp_specialized(dgrad, split):
    """Three partitions: the default (8 consumer warps) raises its registers, the worker
    warpgroup lowers to ``WORKER_REGS``; wgmma m64n256k16 in the consumer, TMA loads with an
    expected byte count of one x tile plus one W tile, masked stores; within 227 KiB of
    shared memory; ptxas fits the function in MAXNREG registers without spills."""
    kernel = _compile_sm90(dgrad, split)
    ptx = kernel.asm["ptx"]
    cfg = GG.gluon_config()
    regs = {int(r) for r in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+);", ptx)}
    assert max(regs) <= 256 and min(regs) >= 24 and cfg["WORKER_REGS"] in regs
    assert re.search(rf"\.maxnreg\s+{GG.MAXNREG}", ptx)
    assert re.search(rf"\.reqntid\s+{12 * 32}", ptx)
    assert "setmaxnreg.inc.sync.aligned.u32" in ptx
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in ptx
    assert "cp.async.bulk.tensor" in ptx
    nbytes = (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2
    assert re.search(r"mbarrier\.arrive\.expect_tx\.shared\.b64 _, \[%r\d+\], " + str(nbytes), ptx)
    assert kernel.metadata.shared <= 227 * 1024
    assert "st.local" not in ptx and "ld.local" not in ptx  # no spills in the PTX


# ---------------------------------------------------------------------------------- CUDA
def _reference(x, w, sizes):
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64, device=x.device)
    start = 0
    for g, n in enumerate(sizes):
        out[start:start + n] = F.linear(x[start:start + n].double(), w[g].double())
        start += n
    return out


def _operands(sizes, m, n, k, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(sizes)
    x = torch.randn(m, k, generator=gen, device=CUDA).to(dtype)
    x[total:] = float("nan")  # padding rows: garbage the kernel must not read into outputs
    w = (torch.randn(len(sizes), n, k, generator=gen, device=CUDA) * k ** -0.5).to(dtype)
    offs = torch.tensor(sizes, device=CUDA).cumsum(0).to(torch.int32)
    return x, w, offs


def _tol(dtype, k):
    return (2e-2 if dtype == torch.bfloat16 else 3e-3) * max(1.0, (k / 64) ** 0.5)


CASES = [
    ([300, 0, 17, 129], 460, 384, 256),      # empty group, 14 padding rows, skew
    ([1000, 3, 0, 0, 250], 1300, 200, 136),  # dims off the tiles
    ([0, 0], 50, 256, 64),                   # padding only
    ([512] * 4, 2048, 1536, 512),            # E128-like fc1 slice, no padding
]


def _skip_unless_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")


SPLIT = {"SPLIT": True, "num_warps": 4}


@pytest.mark.cuda
@pytest.mark.parametrize("config", [None, SPLIT])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sizes, m, n, k", CASES)
def test_fprop_and_dgrad_against_fp64_reference(config, dtype, sizes, m, n, k):
    _skip_unless_sm90()
    x, w, offs = _operands(sizes, m, n, k, dtype)
    total = sum(sizes)
    y = GG.gluon_fprop(x, w, offs, config)
    assert y.shape == (m, n) and y.dtype == dtype
    assert not y[total:].any()
    if total:
        err = (y.double() - _reference(x, w, sizes)).abs().max().item()
        assert err <= _tol(dtype, k), err
    dy = torch.randn(m, n, device=CUDA).to(dtype)
    dy[total:] = float("nan")
    dx = GG.gluon_dgrad(dy, w, offs, config)
    assert dx.shape == (m, k) and not dx[total:].any()
    if total:
        ref = _reference(dy, w.transpose(1, 2), sizes)
        err = (dx.double() - ref).abs().max().item()
        assert err <= _tol(dtype, n), err


@pytest.mark.cuda
@pytest.mark.parametrize("config", [None, SPLIT])
def test_bitwise_equal_to_grouped_mm_and_the_triton_kernel(config):
    """fprop and dgrad equal ``torch._grouped_mm`` (CUTLASS) and ``large_fprop`` /
    ``large_dgrad`` bit for bit (skewed and empty groups, no padding)."""
    _skip_unless_sm90()
    from te_ops.kernels import grouped_gemm_large_triton as L

    sizes = [300, 0, 17, 195, 64, 600]
    x, w, offs = _operands(sizes, sum(sizes), 512, 256)
    y = GG.gluon_fprop(x, w, offs, config)
    assert torch.equal(y, torch._grouped_mm(x, w.transpose(1, 2), offs=offs))
    assert torch.equal(y, L.large_fprop(x, w, offs))
    dy = torch.randn(sum(sizes), 512, device=CUDA).to(torch.bfloat16)
    dx = GG.gluon_dgrad(dy, w, offs, config)
    assert torch.equal(dx, torch._grouped_mm(dy, w, offs=offs))
    assert torch.equal(dx, L.large_dgrad(dy, w, offs))


@pytest.mark.cuda
def test_graph_replay_with_new_offsets_bitwise_equal_to_eager():
    _skip_unless_sm90()
    x, w, offs = _operands([300, 0, 200], 520, 512, 256)
    static_offs = offs.clone()
    GG.gluon_fprop(x, w, static_offs)  # compile outside the capture
    dy = torch.randn(520, 512, device=CUDA).to(torch.bfloat16)
    GG.gluon_dgrad(dy, w, static_offs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = GG.gluon_fprop(x, w, static_offs)
        dx = GG.gluon_dgrad(dy, w, static_offs)
    new = torch.tensor([10, 400, 90], device=CUDA).cumsum(0).to(torch.int32)
    static_offs.copy_(new)
    graph.replay()
    assert torch.equal(y, GG.gluon_fprop(x, w, new))
    assert torch.equal(dx, GG.gluon_dgrad(dy, w, new))
