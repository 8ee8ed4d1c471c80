"""fc2's grouped dgrad with the (Scaled)SwiGLU backward in a warp-specialized Gluon epilogue
(``kernels/dgrad_dswiglu_gluon.py``).

CPU (CI): the launch config's checks, the argument errors (the argument, expected and actual
value), the reason on CPU, the fake kernel's shapes; the sm_90 ahead-of-time compile with
Triton 3.6 (skipped without Gluon or an sm_90 ptxas): three partitions with their register
budgets, wgmma m64nBLOCK_Nk16, TMA loads (the ring's dy + W2 tile and the epilogue's two h
tiles), no spills, shared memory within 227 KiB. CUDA (``@pytest.mark.cuda``): the kernel
against an fp64 per-expert reference (dy ~ N(0, 1), weights at init scale, h ~ N(0, 1)) and
bitwise against the two launches it replaces (dh, a; dprobs within fp32 summation order),
skewed and empty groups, padding rows, columns off the tile, NaN garbage in the output
buffers, in place over h, bf16 / fp16, with and without probs, ``SPLIT``; the op under
``torch.compile(fullgraph=True)`` and in a CUDA graph replayed with new offsets, bitwise
equal to eager.
"""

from __future__ import annotations

import re

import pytest
import torch
from block_replay import summarize_record
from sm90_compile import compile_gluon_for_sm90, skip_without_gluon
from test_dgrad_dswiglu import (
    CASES,
    _problem,
    _two_launches,
    check_block_epilogue_equal_to_off,
    check_block_graph_replay_and_compile,
    check_kernel_against_fp64_and_two_launches,
    patch_dswiglu_bench,
)

from te_ops.fused import fc2_dgrad_epilogue as fe
from te_ops.kernels import dgrad_dswiglu_gluon as GD

CUDA = torch.device("cuda")
#: The 128 x 128 tiles with two consumer warpgroups (the default is 64 x 256 with one).
N128 = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "WORKER_REGS": 128,
        "CONSUMER_REGS": 128}


# ----------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("change, match", [
    ({"FLAT": True}, r"config keys must be among .* got unknown \['FLAT'\]"),
    ({**N128, "SPLIT": True}, "num_warps must be 4 with BLOCK_M=128 SPLIT=True .* got 8"),
    ({**N128, "num_warps": 4}, "num_warps must be 8 with BLOCK_M=128 SPLIT=False .* got 4"),
    ({"num_warps": 8}, "num_warps must be 4 with BLOCK_M=64 .* got 8"),
    ({"SPLIT": True}, "SPLIT needs BLOCK_M 128"),
    ({"BLOCK_M": 32}, "BLOCK_M in .* got BLOCK_M=32"),
    ({"EPI_WARPS": 3}, "EPI_WARPS must be 1, 2 or 4, got 3"),
    ({**N128, "CONSUMER_REGS": 232}, r"8 \* CONSUMER_REGS \+ 8 \* WORKER_REGS must be <= 2048"),
    ({"WORKER_REGS": 160}, r"4 \* CONSUMER_REGS \+ 8 \* WORKER_REGS must be <= 2048"),
    ({"BLOCK_N": 96}, "BLOCK_N in .* got BLOCK_M=64 BLOCK_N=96"),
    ({"SUB_M": 4}, "SUB_M must divide BLOCK_M=64 and be a multiple of 8 .* got SUB_M=4"),
    ({"SUB_M": 12}, "SUB_M must divide BLOCK_M=64"),
    ({"STAGES": 0}, "config STAGES must be an int >= 1, got 0"),
    ({"SPLIT": 1}, "config SPLIT must be a bool, got 1"),
])
def test_config_errors_name_the_key(change, match):
    with pytest.raises(ValueError, match=match):
        GD._resolve(change)


def test_config_fits_the_register_file_and_shared_memory():
    cfg = GD.gluon_dswiglu_config()
    assert GD.total_warps(cfg) == 12 and GD.maxnreg(cfg) == GD.MAXNREG == 168
    assert 4 * cfg["CONSUMER_REGS"] + 8 * cfg["WORKER_REGS"] <= 2048
    n128 = GD._resolve(N128)
    assert GD.total_warps(n128) == 16 and GD.maxnreg(n128) == 128
    assert GD.total_warps({**n128, "EPI_WARPS": 2}) == 12
    tile = cfg["BLOCK_M"] * cfg["BLOCK_N"] * 2
    ring = cfg["STAGES"] * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2
    assert ring + 3 * tile <= 227 * 1024  # ring, da tile, gate and up tiles
    assert GD._resolve({**N128, "SPLIT": True, "num_warps": 4})["SPLIT"] is True


def _args(m=8, n=6, f=4, g=2, dtype=torch.bfloat16):
    return (torch.zeros(m, n, dtype=dtype), torch.zeros(g, n, f, dtype=dtype),
            torch.tensor([3, m]), torch.zeros(m, 2 * f, dtype=dtype), torch.rand(m))


@pytest.mark.parametrize("index, value, exc, match", [
    (0, torch.zeros(8, 5, dtype=torch.bfloat16), ValueError, "dy has 5 columns, weights"),
    (3, torch.zeros(8, 6, dtype=torch.bfloat16), ValueError,
     r"h must have shape \(8, 8\) .* got \(8, 6\)"),
    (2, torch.tensor([8]), ValueError, r"offsets must be int32/int64 of shape \(2,\)"),
    (4, torch.zeros(8, dtype=torch.int64), ValueError, "probs must be a floating-point"),
])
def test_argument_errors_name_the_argument(index, value, exc, match):
    args = list(_args())
    args[index] = value
    with pytest.raises(exc, match=match):
        GD.gluon_dgrad_dswiglu(*args)


def test_cpu_raises_with_the_reason():
    dy, w, offs, h, probs = _args()
    with pytest.raises(RuntimeError, match="cannot run: device type cpu is not cuda"):
        GD.gluon_dgrad_dswiglu(dy, w, offs, h, probs)
    why = GD.gluon_dswiglu_unsupported_reason(dy, w, h)
    assert why is not None and ("CUDA" in why or "gluon" in why)
    with pytest.raises(ValueError, match="unknown"):
        GD._launch(dy, w, offs, h, probs, {"X": 1}, False)


def test_fake_kernel_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        dy, w, offs, h, probs = _args(m=16, n=6, f=8)
        dh, dp, a = torch.ops.te_ops.grouped_dgrad_dswiglu_gluon(dy, w, offs, h, probs)
        assert dh.shape == (16, 16) and dp.shape == (16,) and a.shape == (16, 8)
        assert dp.dtype == torch.float32
        assert torch.ops.te_ops.grouped_dgrad_dswiglu_gluon(dy, w, offs, h, None)[1].numel() == 0


def test_kernel_choice_follows_the_env_and_the_reason(monkeypatch):
    """auto: Gluon where it can run, else Triton with the reason; triton: always Triton;
    gluon: raises with the reason where it cannot run; a bad value names the variable."""
    dy, w, _, h, _ = _args()
    monkeypatch.setenv("TE_OPS_FC2_DSWIGLU_KERNEL", "auto")
    kernel, why = fe.dswiglu_kernel(dy, w, h)
    assert kernel == "triton" and why.startswith("the Gluon kernel cannot run: ")
    monkeypatch.setattr(GD, "gluon_dswiglu_unsupported_reason", lambda *a: None)
    assert fe.dswiglu_kernel(dy, w, h)[0] == "gluon"
    monkeypatch.setenv("TE_OPS_FC2_DSWIGLU_KERNEL", "triton")
    assert fe.dswiglu_kernel(dy, w, h) == ("triton",
                                           "forced by TE_OPS_FC2_DSWIGLU_KERNEL=triton")
    monkeypatch.setattr(GD, "gluon_dswiglu_unsupported_reason", lambda *a: "no SM90 here")
    monkeypatch.setenv("TE_OPS_FC2_DSWIGLU_KERNEL", "gluon")
    with pytest.raises(RuntimeError, match="TE_OPS_FC2_DSWIGLU_KERNEL=gluon cannot run: no SM90"):
        fe.dswiglu_kernel(dy, w, h)
    monkeypatch.setenv("TE_OPS_FC2_DSWIGLU_KERNEL", "cutlass")
    with pytest.raises(ValueError, match="TE_OPS_FC2_DSWIGLU_KERNEL"):
        fe.dswiglu_kernel(dy, w, h)


def test_run_dgrad_dswiglu_calls_the_chosen_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(GD, "gluon_dgrad_dswiglu", lambda *a, **k: calls.append("gluon"))
    monkeypatch.setattr(fe.dgrad_dswiglu_triton, "large_dgrad_dswiglu",
                        lambda *a, **k: calls.append("triton"))
    dy, w, offs, h, probs = _args()
    fe.run_dgrad_dswiglu(dy, w, offs, h, probs, kernel="gluon")
    fe.run_dgrad_dswiglu(dy, w, offs, h, probs, kernel="triton")
    fe.run_dgrad_dswiglu(dy, w, offs, h, probs)  # auto on CPU: the Triton kernel
    assert calls == ["gluon", "triton", "triton"]


def test_unsupported_reasons_name_the_operand():
    dy, w, _, h, _ = _args(f=8)
    why = GD.gluon_dswiglu_unsupported_reason
    assert why(dy, w, h) is not None  # CPU (or no Gluon) first
    if GD.gluon is None:
        return
    from te_ops.kernels import grouped_gemm_gluon as GG

    orig = GG.gluon_unsupported_reason
    try:
        GD.gluon_unsupported_reason = lambda *a: None
        assert "not contiguous along F" in why(dy, w.transpose(1, 2).contiguous()
                                               .transpose(1, 2), h)
        assert "h is not contiguous" in why(dy, w, h.t().contiguous().t())
        odd = torch.zeros(8, 6, dtype=torch.bfloat16)  # 12-byte rows
        assert "multiple of 16 bytes" in why(dy, w, odd)
        assert why(dy, w, h) is None or "16-byte boundary" in why(dy, w, h)
    finally:
        GD.gluon_unsupported_reason = orig


SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*bf16", "h_ptr": "*bf16", "dh_ptr": "*bf16",
             "a_ptr": "*bf16", "p_ptr": "*fp32", "dpp_ptr": "*fp32", "offs_ptr": "*i32",
             "M": "i32", "N": "i32", "K": "i32", "G": "i32", "P": "i32",
             "stride_wg": "i32", "stride_wn": "i32", "stride_wk": "i32"}


def _compile_sm90(change: dict | None, has_p: bool = True):
    skip_without_gluon(GD)
    cfg = GD._resolve(change)
    const = {"HAS_P": has_p, "WRITE_OUT": True, "GBLOCK": 8, **cfg}
    return compile_gluon_for_sm90(GD._dgrad_dswiglu_kernel, SIGNATURE, const,
                                  cfg["num_warps"], GD.maxnreg(cfg))


@pytest.mark.parametrize("change, has_p", [
    (None, True), (None, False), (N128, True), ({**N128, "SPLIT": True, "num_warps": 4}, True),
    ({**N128, "EPI_WARPS": 2, "WORKER_REGS": 152, "CONSUMER_REGS": 176}, True)])
def test_compiles_for_sm90_warp_specialized(change, has_p):
    kernel = _compile_sm90(change, has_p)
    ptx = kernel.asm["ptx"]
    cfg = GD._resolve(change)
    regs = {int(r) for r in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+);", ptx)}
    assert cfg["WORKER_REGS"] in regs and max(regs) <= 256
    assert re.search(rf"\.maxnreg\s+{GD.maxnreg(cfg)}", ptx)
    assert re.search(rf"\.reqntid\s+{GD.total_warps(cfg) * 32}", ptx)
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg['BLOCK_N']}k16.f32.bf16.bf16" in ptx
    ring = (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2
    h_tiles = 2 * cfg["BLOCK_M"] * cfg["BLOCK_N"] * 2
    for nbytes in (ring, h_tiles):
        assert re.search(r"mbarrier\.arrive\.expect_tx\.shared\.b64 _, \[%r\d+\], "
                         + str(nbytes), ptx), nbytes
    assert "ex2.approx" in ptx  # the SwiGLU backward's sigmoid, in the epilogue partition
    assert kernel.metadata.shared <= 227 * 1024
    assert "st.local" not in ptx and "ld.local" not in ptx  # no spills


# ---------------------------------------------------------------------------------- CUDA
def _sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel runs on SM90 only")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no_probs"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_fp64_reference_and_two_launches(case, with_probs, dtype):
    _sm90()
    dy, w, offs, h, probs, dh0, a0 = check_kernel_against_fp64_and_two_launches(
        GD.gluon_dgrad_dswiglu, case, with_probs, dtype)
    if case == "skewed_padding" and dtype == torch.bfloat16:
        got = GD.gluon_dgrad_dswiglu(dy, w, offs, h, probs, write_output=False)
        assert torch.equal(got[0], dh0) and got[2] is None


CONFIGS = {"n128": N128, "n128_split": {**N128, "SPLIT": True, "num_warps": 4},
           "n128_sub16": {**N128, "SUB_M": 16},
           "n128_epi2": {**N128, "EPI_WARPS": 2, "WORKER_REGS": 152, "CONSUMER_REGS": 176},
           "sub16": {"SUB_M": 16}}


@pytest.mark.cuda
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("case", ["skewed_padding", "ffn_off_tiles", "padding_only"])
def test_launch_configs_bitwise_equal_to_two_launches(case, config):
    """The other launch configs (tiles, warps, slices): dh and a the two launches' bits,
    dprobs within fp32 summation order (the same partial sums as the default where the
    column tile is the same)."""
    _sm90()
    sizes, rows, ffn, hidden = CASES[case]
    dy, w, h, offs, probs = _problem(sizes, rows, ffn, hidden, torch.bfloat16)
    dh0, dp0, a0 = _two_launches(dy, w, offs, h, probs)
    torch.full((rows + 64, 8 * ffn), float("nan"), device=CUDA, dtype=torch.bfloat16)
    dh, dp, a = GD.gluon_dgrad_dswiglu(dy, w, offs, h, probs, config=CONFIGS[config])
    assert torch.equal(dh, dh0) and torch.equal(a, a0)
    torch.testing.assert_close(dp, dp0, rtol=1e-5, atol=1e-5 * dp0.abs().max().item())


@pytest.mark.cuda
def test_op_compiles_and_replays_in_a_cuda_graph_bitwise():
    _sm90()
    sizes, rows, ffn, hidden = CASES["skewed_padding"]
    dy, w, h, offs, probs = _problem(sizes, rows, ffn, hidden, torch.bfloat16)
    eager = GD.gluon_dgrad_dswiglu(dy, w, offs, h, probs)

    def fn(dy, w, offs, h, probs):
        return GD.gluon_dgrad_dswiglu(dy, w, offs, h, probs)

    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True)(dy, w, offs, h, probs)
    for x, y in zip(got, eager):
        assert torch.equal(x, y)
    static = [t.clone() for t in (dy, w, offs, h, probs)]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn(*static)  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)
    new = torch.cumsum(torch.tensor([100, 0, 30, 64, 70, 10, 159, 50], device=CUDA),
                       0).to(torch.int32)
    static[2].copy_(new)
    graph.replay()
    want = GD.gluon_dgrad_dswiglu(dy, w, new, h, probs)
    for x, y in zip(out, want):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------------- CUDA: the block
@pytest.mark.cuda
@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "plain"])
def test_block_with_gluon_epilogue_equal_to_two_launches(monkeypatch, scaled):
    """``TE_OPS_FC2_DSWIGLU_EPILOGUE=1`` with the Gluon kernel (general path, then the fast
    path) against the epilogue off: y, dx, dW1, dW2 bit for bit, probs.grad within bf16
    rounding; explain() names the Gluon launch."""
    _sm90()
    check_block_epilogue_equal_to_off(
        monkeypatch, scaled, "gluon",
        "fc2 dgrad dSwiGLU epilogue: one warp-specialized Gluon launch")


@pytest.mark.cuda
def test_block_graph_replay_and_compile_bitwise_equal_to_eager(monkeypatch):
    _sm90()
    check_block_graph_replay_and_compile(
        monkeypatch, "gluon", "fc2 dgrad dSwiGLU epilogue: one warp-specialized Gluon launch")


# ------------------------------------------------------------------ CPU: the benchmark record
def test_benchmark_record_with_gluon_on_cpu(monkeypatch, tmp_path, capsys):
    """``--gemms fc2_dswiglu --gluon`` end to end on a tiny shape, the kernels replaced by
    torch references and fixed times (call i of a round takes 1 + i ms): the Gluon calls'
    checks, times and ratios, ``--summarize``, and a bad Gluon config is a usage error."""
    import argparse

    from te_ops.kernels import grouped_gemm_gluon as GG

    bench, dgrad, fused = patch_dswiglu_bench(monkeypatch)
    monkeypatch.setattr(GG, "gluon_grouped_gemm", lambda dy, w, offs, _: dgrad(dy, w, offs))
    monkeypatch.setattr(GG, "gluon_dgrad", dgrad)
    monkeypatch.setattr(GD, "gluon_dgrad_dswiglu", fused)
    args = argparse.Namespace(seed=0, reps=20, warmup=0, dswiglu_variants={},
                              gluon={"gluon": {}, "gluon_n128": {"BLOCK_M": 128}})
    rec = bench.compare_dswiglu("E2_T64_H32_FF16", args)
    assert rec["two_launches_gluon_equal"] and rec["dh_equal_gluon"] and rec["a_equal_gluon"]
    assert rec["dprobs_max_abs_diff_gluon_n128"] == 0.0
    # order: lead_in, dgrad, dgrad_fused_tiles, two_launches, fused, dgrad_gluon,
    # dgrad_gluon_n128, two_launches_gluon, gluon, gluon_n128
    assert rec["two_launches_ms"] == 4.0 and rec["gluon_ms"] == 9.0
    assert rec["gluon_x"] == 4.0 / 9.0 and rec["gluon_n128_vs_gluon_pair"] == 8.0 / 10.0
    assert rec["gluon_configs"]["gluon_n128"]["BLOCK_M"] == 128
    table = summarize_record(bench, rec, tmp_path / "r.jsonl", capsys)
    assert "gluon pair" in table and "gluon_n128" in table and "x 0.444" in table
    with pytest.raises(SystemExit):
        bench.main(["--gemms", "fc2_dswiglu", "--gluon", '{"gluon": {"SUB_M": 3}}'])
    assert "--gluon 'gluon' (fc2_dswiglu): config SUB_M" in capsys.readouterr().err
