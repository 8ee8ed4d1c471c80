"""fc2's grouped dgrad with the (Scaled)SwiGLU backward in its epilogue
(``kernels/dgrad_dswiglu_triton.py``) and where the fused grouped MLP's backward takes it
(``fused/fc2_dgrad_epilogue.py``).

CPU (CI): the gate's rule and reasons, the env toggle, ``explain()`` naming why it is not used,
the config and argument errors (each names the argument, the expected and the actual value),
the sm_90 ahead-of-time compile (wgmma, TMA, one flattened tile loop, shared memory), the
benchmark's record with the kernels replaced by torch references. The
interpreter run of the kernel is in ``tests/test_dgrad_dswiglu_interpret.py``. CUDA: the kernel
against an fp64 per-expert reference (dy ~ N(0, 1), weights at init scale, h ~ N(0, 1), padding
rows over NaN garbage) and bitwise against the two launches it replaces (dh, a; dprobs within
a tolerance: another fp32 summation order), bf16 and fp16, with and without probs; the block
with the epilogue on vs off (repeated calls, unfused forward + fused backward): y, dx,
dW1, dW2 bitwise, probs.grad within tolerance; CUDA graph replay and
``torch.compile(fullgraph=True)`` bitwise equal to eager.
"""

from __future__ import annotations

import pytest
import reference as ref
import torch
from block_replay import (
    assert_graph_and_compile_match_eager,
    run_block_params_first,
    summarize_record,
)
from reference import assert_close
from sm90_compile import compile_for_sm90, for_nesting

import te_ops
from te_ops.fused import fc2_dgrad_epilogue as fe
from te_ops.fused.fc2_dgrad_epilogue import fc2_dgrad_epilogue_reason
from te_ops.kernels import dgrad_dswiglu_triton as D
from te_ops.kernels.grouped_gemm import BackendChoice
from te_ops.kernels.swiglu_triton import ActivationChoice

CUDA = torch.device("cuda")
LARGE = BackendChoice("triton", "test", True, (), ("fprop", "dgrad"))
MM = BackendChoice("grouped_mm", "test", True)
ACT = ActivationChoice("triton", "test")


# ------------------------------------------------------------------------------ CPU: the gate
@pytest.mark.parametrize("args, match", [
    ((LARGE, ACT, None, False, None, 512.0), None),
    ((LARGE, ACT, None, False, None, 100.0), "100 rows per group < AUTO_MIN_ROWS_PER_GROUP=256"),
    ((LARGE, ACT, object(), False, None, 512.0), "a recipe"),
    ((LARGE, ACT, None, True, None, 512.0), "fc1 or fc2 has a bias"),
    ((MM, ACT, None, False, None, 512.0), "fc2's dgrad does not run in the persistent"),
    ((LARGE, ACT, None, False, 32, 512.0), "glu_interleave_size=32"),
    ((LARGE, ActivationChoice("torch", "forced"), None, False, None, 512.0),
     "the activation runs in torch"),
])
def test_rule_and_reasons(monkeypatch, args, match):
    """The gate's checks under auto, with a rule of 256 rows per group."""
    monkeypatch.setattr(fe, "AUTO_MIN_ROWS_PER_GROUP", 256)
    why = fc2_dgrad_epilogue_reason(*args)
    assert why is None if match is None else match in why


def test_auto_follows_the_measured_rule_and_1_opts_in(monkeypatch):
    args = (LARGE, ACT, None, False, None)
    limit = fe.AUTO_MIN_ROWS_PER_GROUP
    assert fc2_dgrad_epilogue_reason(*args, 32.0) is None or limit > 32
    if limit != float("inf"):
        assert fc2_dgrad_epilogue_reason(*args, float(limit)) is None
    monkeypatch.setenv("TE_OPS_FC2_DSWIGLU_EPILOGUE", "1")
    assert fc2_dgrad_epilogue_reason(*args, 32.0) is None
    assert "a bias" in fc2_dgrad_epilogue_reason(LARGE, ACT, None, True, None, 512.0)


def test_env_toggle_turns_it_off_and_bad_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("TE_OPS_FC2_DSWIGLU_EPILOGUE", "0")
    assert fc2_dgrad_epilogue_reason(LARGE, ACT, None, False, None, 4096.0) == \
        "TE_OPS_FC2_DSWIGLU_EPILOGUE=0"
    monkeypatch.setenv("TE_OPS_FC2_DSWIGLU_EPILOGUE", "yes")
    with pytest.raises(ValueError, match="TE_OPS_FC2_DSWIGLU_EPILOGUE"):
        fc2_dgrad_epilogue_reason(LARGE, ACT, None, False, None, 4096.0)


def test_explain_says_why_not_used_on_cpu():
    block = te_ops.Sequential(te_ops.GroupedLinear(2, 8, 16, bias=False),
                              te_ops.ScaledSwiGLU(), te_ops.GroupedLinear(2, 8, 8, bias=False))
    split = torch.tensor([2, 1])
    x = torch.randn(3, 8, requires_grad=True)
    block(x, split, torch.rand(3, requires_grad=True), split).sum().backward()
    assert ("fc2 dgrad dSwiGLU epilogue: not used: fc2's dgrad does not run in the persistent"
            in block.explain())


@pytest.mark.parametrize("change, match", [
    ({"EPI_SPLIT": 4}, "EPI_SPLIT must be 1 or 2 .* got EPI_SPLIT=4 BLOCK_N=128"),
    ({"EPI_SPLIT": 2, "BLOCK_N": 2}, "EPI_SPLIT must be 1 or 2 .* got EPI_SPLIT=2 BLOCK_N=2"),
    ({"TAIL": True}, r"config keys must be among .* got unknown \['TAIL'\]"),
])
def test_config_errors_name_the_key(change, match):
    with pytest.raises(ValueError, match=match):
        D._resolve(change, 4)


def test_flat_with_too_many_groups_takes_the_group_walk():
    from te_ops.kernels import grouped_gemm_large_triton as lg

    assert D._resolve(None, lg.FLAT_MAX_GROUPS)["FLAT"] is True
    assert D._resolve(None, lg.FLAT_MAX_GROUPS + 1)["FLAT"] is False


def _args(m=8, n=6, f=4, g=2, dtype=torch.bfloat16):
    return {"dy": torch.zeros(m, n, dtype=dtype), "w": torch.zeros(g, n, f, dtype=dtype),
            "offs": torch.tensor([3, 8]), "h": torch.zeros(m, 2 * f, dtype=dtype),
            "probs": None}


@pytest.mark.parametrize("change, exc, match", [
    ({"dy": torch.zeros(8, 6, 1)}, ValueError, r"dy must be 2-D .* got shape \(8, 6, 1\)"),
    ({"w": torch.zeros(2, 6, 4)}, ValueError,
     r"weights must be 3-D \(G, N, F\) torch.bfloat16 on cpu, got shape \(2, 6, 4\) "
     r"torch.float32"),
    ({"w": torch.zeros(2, 5, 4, dtype=torch.bfloat16)}, ValueError,
     "dy has 6 columns, weights .* have N=5"),
    ({"h": torch.zeros(8, 6, dtype=torch.bfloat16)}, ValueError,
     r"h must have shape \(8, 8\) \(rows, 2F\), torch.bfloat16 on cpu, got \(8, 6\)"),
    ({"h": torch.zeros(8, 8)}, ValueError, r"h must have shape .* got \(8, 8\) torch.float32"),
    ({"offs": torch.tensor([8])}, ValueError,
     r"offsets must be int32/int64 of shape \(2,\) on cpu, got torch.int64 \(1,\)"),
    ({"probs": torch.rand(5)}, ValueError, r"probs must have shape \(8,\) on cpu, got \(5,\)"),
    ({"probs": torch.ones(8, dtype=torch.int32)}, ValueError,
     "probs must be a floating-point tensor, got torch.int32"),
    ({}, RuntimeError, "fc2 dgrad \\+ dSwiGLU Triton kernel cannot run: device type cpu"),
])
def test_argument_errors_name_the_argument(change, exc, match):
    a = {**_args(), **change}
    with pytest.raises(exc, match=match):
        D.large_dgrad_dswiglu(a["dy"], a["w"], a["offs"], a["h"], a["probs"])


SIGNATURE = {**{n: "*bf16" for n in ("x_ptr", "w_ptr", "h_ptr", "dh_ptr", "a_ptr")},
             "p_ptr": "*fp32", "dpp_ptr": "*fp32", "offs_ptr": "*i32",
             **{n: "i32" for n in ("M", "N", "K", "G", "P", "stride_wg", "stride_wn",
                                   "stride_wk")}}


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "walk"])
@pytest.mark.parametrize("epi_split", [1, 2])
def test_sm90_compile(flat, epi_split):
    """The kernel compiles for sm_90 (Triton's ahead-of-time compile, no GPU): wgmma, TMA
    loads, shared memory within SM90's 227 KiB, one level of ``scf.for`` around the k-steps
    under ``FLAT`` (Triton fused tile and k loops), two in the group walk."""
    pytest.importorskip("triton")
    cfg = {**D.dswiglu_config(), "FLAT": flat, "EPI_SPLIT": epi_split}
    const = {"HAS_P": True, "WRITE_OUT": True, "EVEN_N": True, "GBLOCK": 8 if flat else 1,
             "H_TMA": False,
             **{k: cfg[k] for k in ("USE_TMA", "FLAT", "EPI_SPLIT", "BLOCK_M", "BLOCK_N",
                                    "BLOCK_K", "GROUP_M")}}
    kernel = compile_for_sm90(D._dgrad_dswiglu_kernel, SIGNATURE, const, cfg["num_warps"],
                              cfg["num_stages"])
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    assert kernel.metadata.shared <= 227 * 1024
    nesting = for_nesting(ttgir)
    assert nesting == (1 if flat else 2), nesting


# --------------------------------------------------------------------------- CUDA: the kernel
CASES = {  # name -> (split sizes, rows, FF, H)
    "skewed_padding": ([300, 0, 17, 129, 64, 0, 200, 33], 800, 256, 512),
    "ffn_off_tiles": ([70, 0, 1, 90], 170, 200, 256),
    "one_group": ([256], 300, 128, 128),
    "padding_only": ([0, 0, 0], 40, 128, 128),
    "issue10_scaled_down": ([512, 384, 640, 512], 2048, 768, 1024),
}


def _problem(sizes, rows, ffn, hidden, dtype, seed=0):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    dy = torch.randn(rows, hidden, device=CUDA, dtype=dtype, generator=gen)
    dy[sum(sizes):] = float("nan")  # padding rows of the output gradient: never read in
    w = (torch.randn(len(sizes), hidden, ffn, device=CUDA, generator=gen)
         * ffn ** -0.5).to(dtype)
    h = torch.randn(rows, 2 * ffn, device=CUDA, dtype=dtype, generator=gen)
    offs = torch.cumsum(torch.tensor(sizes, device=CUDA), 0).to(torch.int32)
    probs = torch.rand(rows, device=CUDA, generator=gen)
    return dy, w, h, offs, probs


def _reference(dy, w, h, probs, sizes):
    """fp64: da per expert (zero on padding rows), then the SwiGLU backward of
    ``te_ops.basic.swiglu``'s formulas; (dh, dprobs, a)."""
    f = w.shape[2]
    da = torch.zeros(dy.shape[0], f, dtype=torch.float64, device=dy.device)
    start = 0
    for g, n in enumerate(sizes):
        da[start:start + n] = dy[start:start + n].double() @ w[g].double()
        start += n
    gate, up = h[:, :f].double(), h[:, f:].double()
    s = torch.sigmoid(gate)
    a = gate * s * up
    dp = (a * da).sum(1)
    if probs is not None:
        a = a * probs.double()[:, None]
        da = da * probs.double()[:, None]
    return torch.cat([da * up * s * (1 + gate * (1 - s)), da * gate * s], 1), dp, a


def _two_launches(dy, w, offs, h, probs):
    from te_ops.kernels import grouped_gemm_large_triton as lg
    from te_ops.kernels import swiglu_triton as st

    da = lg.large_dgrad(dy, w, offs)
    return st.swiglu_backward(h.clone(), da, probs, write_output=True, grad_into_input=True)


def check_kernel_against_fp64_and_two_launches(fused, case, with_probs, dtype):
    """``fused(dy, w, offs, h, probs, **kw)`` (a fused fc2 dgrad + dSwiGLU kernel) on
    ``CASES[case]`` over NaN garbage, in place over h: dh and a bitwise the two launches',
    all three within ``assert_close`` of the fp64 reference, dprobs within fp32 summation
    order of the two launches'. Returns ``(dy, w, offs, h, probs, dh0, a0)`` (the inputs and
    the two launches' dh and a) for the callers' launch-config checks."""
    sizes, rows, ffn, hidden = CASES[case]
    dy, w, h, offs, probs = _problem(sizes, rows, ffn, hidden, dtype)
    probs = probs if with_probs else None
    dh0, dp0, a0 = _two_launches(dy, w, offs, h, probs)
    # NaN garbage in the allocator's blocks: every output row must be written
    torch.full((rows + 64, 8 * ffn), float("nan"), device=CUDA, dtype=dtype)
    h_in = h.clone()
    dh, dp, a = fused(dy, w, offs, h_in, probs, grad_into_input=True)
    assert dh.data_ptr() == h_in.data_ptr()
    assert torch.equal(dh, dh0) and torch.equal(a, a0)  # the two launches' bits
    want_dh, want_dp, want_a = _reference(dy, w, h, probs, sizes)
    assert_close(dh, want_dh, dtype, "dh")
    assert_close(a, want_a, dtype, "a")
    if probs is None:
        assert dp is None
    else:
        assert dp.dtype == probs.dtype and dp.shape == probs.shape
        # fp32 sums of the same terms in another order: within fp32 rounding of the terms'
        # magnitudes (the two launches' dprobs and the fp64 reference alike)
        gate, up = h[:, :ffn].double(), h[:, ffn:].double()
        scale = (gate * torch.sigmoid(gate) * up).abs().max().item() * \
            (want_dh.abs().max().item() + 1) * ffn
        torch.testing.assert_close(dp.double(), dp0.double(), rtol=0, atol=1e-6 * scale)
        assert_close(dp, want_dp, dtype, "dprobs")
    return dy, w, offs, h, probs, dh0, a0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no_probs"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_fp64_reference_and_two_launches(case, with_probs, dtype):
    dy, w, offs, h, probs, dh0, a0 = check_kernel_against_fp64_and_two_launches(
        D.large_dgrad_dswiglu, case, with_probs, dtype)
    if case == "skewed_padding" and dtype == torch.bfloat16:  # the other launch configs
        for variant in ({"EPI_SPLIT": 1}, {"FLAT": False}, {"USE_TMA": False},
                        {"H_TMA": True}):
            got = D.large_dgrad_dswiglu(dy, w, offs, h, probs, config=variant)
            assert torch.equal(got[0], dh0) and torch.equal(got[2], a0), variant


# ---------------------------------------------------------------------------- CUDA: the block
def _block(groups=8, hidden=256, ffn=384, scaled=True):
    torch.manual_seed(0)
    kw = {"bias": False, "device": CUDA, "dtype": torch.bfloat16}
    return te_ops.Sequential(te_ops.GroupedLinear(groups, hidden, 2 * ffn, **kw),
                             te_ops.ScaledSwiGLU() if scaled else te_ops.SwiGLU(),
                             te_ops.GroupedLinear(groups, ffn, hidden, **kw))


_run = run_block_params_first  # [y, x.grad, *parameter grads, (probs.grad)], grad_fn name


SIZES = [40, 0, 130, 64, 7, 100, 59, 90]  # 490 of 512 rows (64 per group): padding rows


def _inputs(sizes=SIZES, rows=512, hidden=256):
    x = torch.randn(rows, hidden, device=CUDA, dtype=torch.bfloat16)
    probs = torch.rand(rows, device=CUDA, dtype=torch.bfloat16)
    return x, torch.tensor(sizes, device=CUDA), probs, torch.randn(rows, hidden, device=CUDA,
                                                                  dtype=torch.bfloat16)


def _same(got, want, scaled):
    """y, dx, dW1, dW2 bitwise; probs.grad (last, when scaled) within bf16 rounding."""
    n = len(want) - (1 if scaled else 0)
    assert all(torch.equal(a, b) for a, b in zip(got[:n], want[:n]))
    if scaled:
        torch.testing.assert_close(got[-1].float(), want[-1].float(), rtol=1.6e-2,
                                   atol=1.6e-2 * want[-1].float().abs().max().item())


def _large_dgrad_env(monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:  # auto takes the persistent kernels on SM90
        pytest.skip("auto runs fc2's dgrad in the persistent kernel on SM90 only")


def check_block_epilogue_equal_to_off(monkeypatch, scaled, kernel, explained):
    """The block with ``TE_OPS_FC2_DSWIGLU_EPILOGUE=1`` and ``TE_OPS_FC2_DSWIGLU_KERNEL=kernel``
    (three steps) against the epilogue off: y, dx, dW1, dW2 bit
    for bit, probs.grad within bf16 rounding (``_same``); ``explain()`` holds ``explained``.
    Returns ``((x, split, probs, dy), off, got)``: the inputs, the epilogue-off values and the
    last step's values."""
    monkeypatch.setenv("TE_OPS_FC2_DSWIGLU_EPILOGUE", "0")
    x, split, probs, dy = _inputs()
    off = _run(_block(scaled=scaled), x, split, probs, dy)[0]
    monkeypatch.setenv("TE_OPS_FC2_DSWIGLU_EPILOGUE", "1")
    monkeypatch.setenv("TE_OPS_FC2_DSWIGLU_KERNEL", kernel)
    block = _block(scaled=scaled)
    runs = [_run(block, x, split, probs, dy) for _ in range(3)]
    assert runs[-1][1] == "_FuserFunctionBackward"
    assert explained in block.explain()
    for got, _ in runs:
        _same(got, off, scaled)
    return (x, split, probs, dy), off, runs[-1][0]


def check_block_graph_replay_and_compile(monkeypatch, kernel, explained):
    """The block with the epilogue (``TE_OPS_FC2_DSWIGLU_KERNEL=kernel``) captured in a CUDA
    graph (replayed with new split sizes) and compiled with fullgraph=True: bitwise the eager
    values, ``explain()`` holds ``explained`` (``assert_graph_and_compile_match_eager``)."""
    monkeypatch.setenv("TE_OPS_FC2_DSWIGLU_EPILOGUE", "1")
    monkeypatch.setenv("TE_OPS_FC2_DSWIGLU_KERNEL", kernel)
    x, split, probs, dy = _inputs()
    assert_graph_and_compile_match_eager(
        _block(), x, split, probs, dy, [100, 0, 30, 64, 70, 10, 159, 50], explained)


@pytest.mark.cuda
@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "plain"])
def test_block_with_epilogue_equal_to_two_launches(monkeypatch, scaled):
    """Epilogue on (three steps; unfused forward + fused backward) vs off:
    outputs, dx, dW1, dW2 bit for bit, probs.grad within tolerance; explain() names it."""
    _large_dgrad_env(monkeypatch)
    # the Gluon kernel: its own tests
    (x, split, probs, dy), off, got = check_block_epilogue_equal_to_off(
        monkeypatch, scaled, "triton", "fc2 dgrad dSwiGLU epilogue: one Triton launch")
    monkeypatch.setenv("TE_OPS_FUSE_GROUPED_MLP_FORWARD", "0")  # fc2's input saved
    _same(_run(_block(scaled=scaled), x, split, probs, dy)[0], off, scaled)
    # the reference: fp64 per-expert loop
    block = _block(scaled=scaled)
    leaves = {"x": ref.leaf(x), "probs": ref.leaf(probs)}
    w1 = [ref.leaf(w) for w in block[0]._param_lists()[0]]
    w2 = [ref.leaf(w) for w in block[2]._param_lists()[0]]
    h = ref.grouped_linear(leaves["x"], w1, None, SIZES)
    act = ref.scaled_swiglu(h, leaves["probs"]) if scaled else ref.swiglu(h)
    y = ref.grouped_linear(act, w2, None, SIZES)
    y.backward(dy.double())
    assert_close(got[0], y, torch.bfloat16, "y")
    assert_close(got[1], leaves["x"].grad, torch.bfloat16, "dx")
    if scaled:
        assert_close(got[-1], leaves["probs"].grad, torch.bfloat16, "dprobs")


@pytest.mark.cuda
def test_block_graph_replay_and_compile_bitwise_equal_to_eager(monkeypatch):
    """The block with the epilogue captured in a CUDA graph (replayed with new split sizes)
    and compiled with fullgraph=True: bitwise the eager values; one frame, no graph break."""
    _large_dgrad_env(monkeypatch)
    check_block_graph_replay_and_compile(monkeypatch, "triton",
                                         "fc2 dgrad dSwiGLU epilogue: one Triton launch")


# ------------------------------------------------------------------ CPU: the benchmark record
def patch_dswiglu_bench(monkeypatch):
    """``benchmarks/large_gemm_triton.py`` (imported) on the CPU at one tiny shape
    (E2 T64 H32 FF16), its fc2 dgrad, SwiGLU backward and fused kernels replaced by torch
    references (``_reference``) and its timer by fixed times (call i of a round takes 1 + i
    ms). Returns the module, the reference dgrad ``(dy, w, offs, cfg=None, *rest)`` and the
    reference fused call ``(dy, w, offs, h, probs, config=None)``."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experimental", "gemm_kernel_ab"))
    import large_gemm_triton as bench

    from te_ops.kernels import grouped_gemm_large_triton as lg
    from te_ops.kernels import swiglu_triton as st

    def dgrad(dy, w, offs, cfg=None, *rest):
        out, start = torch.zeros(dy.shape[0], w.shape[2]), 0
        for g, end in enumerate(offs.tolist()):
            out[start:end] = dy[start:end].float() @ w[g].float()
            start = end
        return out.to(dy.dtype)

    def swiglu_bwd(h, da, probs, write_output=False, grad_into_input=False):
        dh, dp, a = _reference(da.float(), torch.eye(da.shape[1])[None].expand(1, -1, -1),
                               h, probs, [da.shape[0]])
        return dh.to(h.dtype), dp.float(), a.to(h.dtype)

    def fused(dy, w, offs, h, probs, config=None):
        return swiglu_bwd(h, dgrad(dy, w, offs), probs)

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "SHAPES", {"E2_T64_H32_FF16": (2, 64, 32, 16)})
    monkeypatch.setattr(bench, "ALL_SHAPES", bench.SHAPES)
    monkeypatch.setattr(lg, "large_dgrad", dgrad)
    monkeypatch.setattr(st, "swiglu_backward", swiglu_bwd)
    monkeypatch.setattr(D, "large_dgrad_dswiglu", fused)
    monkeypatch.setattr(bench, "_time_interleaved",
                        lambda calls, reps, warmup: {n: [1.0 + i] * reps
                                                     for i, n in enumerate(calls)})
    return bench, dgrad, fused


def test_benchmark_record_on_cpu(monkeypatch, tmp_path, capsys):
    """``benchmarks/large_gemm_triton.py --gemms fc2_dswiglu`` end to end on a tiny shape with
    the kernels replaced by torch references and fixed times (call i of a round takes 1 + i
    ms): the record's checks, times and ratios, then ``--summarize``; a bad
    ``--dswiglu-variants`` config is a usage error naming the flag."""
    import argparse

    bench, _, _ = patch_dswiglu_bench(monkeypatch)
    args = argparse.Namespace(seed=0, reps=20, warmup=0,
                              dswiglu_variants={"walk": {"FLAT": False}})
    rec = bench.compare_dswiglu("E2_T64_H32_FF16", args)
    assert rec["dh_equal"] and rec["a_equal"] and rec["dh_equal_walk"]
    assert rec["dprobs_max_abs_diff"] == 0.0
    # order: lead_in, dgrad, dgrad_fused_tiles, two_launches, fused, fused_walk
    assert rec["two_launches_ms"] == 4.0 and rec["fused_ms"] == 5.0
    assert rec["fused_x"] == 4.0 / 5.0 and rec["fused_walk_x"] == 4.0 / 6.0
    assert rec["epilogue_ms"] == 2.0 and rec["variants"]["walk"]["FLAT"] is False
    table = summarize_record(bench, rec, tmp_path / "r.jsonl", capsys)
    assert "fc2 dgrad+dSwiGLU" in table and "x 0.800" in table and "variant walk" in table
    with pytest.raises(SystemExit):
        bench.main(["--gemms", "fc2_dswiglu", "--dswiglu-variants", '{"x": {"EPI_SPLIT": 3}}'])
    assert "--dswiglu-variants 'x': config EPI_SPLIT must be 1 or 2" in capsys.readouterr().err
