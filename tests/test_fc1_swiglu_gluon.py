"""fc1's grouped fprop with the (Scaled)SwiGLU in a warp-specialized Gluon epilogue
(``gemm/fc1_swiglu_gluon.py``) and its dispatch (``fused/fc1_epilogue.py``).

CPU (CI): the config and argument errors, the reason on CPU, the measured rule and the
dispatch (the fused forward, ``explain()``), the sm_90 ahead-of-time compile (skipped
without Gluon or an sm_90 ptxas: run with Triton 3.6 on the path): four partitions' register
budgets, wgmma m64n256k16, one paired TMA load of 48 KiB per k-step, shared memory within
227 KiB. CUDA (``@pytest.mark.cuda``, SM90): h and
a against the fp64 per-expert reference (N(0, 1) inputs, init-scale weights), bitwise equal
to the two launches (``large_fprop`` / ``torch._grouped_mm``, then ``swiglu_forward``) with
NaN garbage in x's padding rows and in the recycled output memory, skewed and empty groups,
with and without probs, bf16 and fp16; CUDA-graph
replay with new offsets and ``torch.compile(fullgraph=True)`` bitwise equal to eager; the
block with the rule patched to take the kernel: fused (repeated calls), the fused
forward with the unfused backward and the unfused ops bitwise equal to the epilogue off;
graph capture and compile of that block bitwise equal to eager.
"""

from __future__ import annotations

import re

import pytest
import torch
from gemm_force import FC1_GLUON_ROW, FC1_FUSED_ANY, NO_FC1_FUSED, with_rows
import torch.nn.functional as F
from block_replay import assert_graph_and_compile_match_eager, count_launches, run_block
from fc1_dispatch_stubs import ACT, LARGE, fused_fc1
from fc1_dispatch_stubs import RecordingAct as _Act
from grouped_cuda_helpers import (
    assert_replay_with_new_offsets_equal_to_eager,
    fc1_block,
    fc1_block_inputs,
    per_expert_linear_fp64,
)
from sm90_compile import compile_gluon_for_sm90, skip_without_gluon
from torch._subclasses.fake_tensor import FakeTensorMode

from te_ops.gemm import fc1_swiglu as fc1_swiglu_mod
from te_ops.gemm import fc1_swiglu_reason
from te_ops.gemm import fc1_swiglu_gluon as FG
from te_ops.gemm import grouped_gemm_gluon as GG
from te_ops.gemm import grouped_gemm_large_triton as L

CUDA = torch.device("cuda")


# ----------------------------------------------------------------------------------- CPU
def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"config keys must be among .* unknown \['FLAT'\]"):
        FG._resolve({"FLAT": True})
    with pytest.raises(ValueError, match="num_warps must be 8 .* got num_warps=4"):
        FG._resolve({"num_warps": 4})
    with pytest.raises(ValueError, match=r"unknown \['SPLIT'\]"):
        FG._resolve({"SPLIT": True})
    with pytest.raises(ValueError, match="config STAGES must be an int >= 1, got 0"):
        FG._resolve({"STAGES": 0})
    with pytest.raises(ValueError, match=r"STAGES=4 .* needs 262144 bytes "
                                         r"of shared memory .* more than the 230400"):
        FG._resolve({"STAGES": 4})
    assert FG.shared_bytes(FG.gluon_fc1_config()) == 3 * 48 * 1024 + 64 * 1024
    with pytest.raises(ValueError, match="SUB_N dividing BLOCK_N / 2, .* SUB_N=96"):
        FG._resolve({"SUB_N": 96})


def test_config_fits_the_register_file():
    cfg = FG.gluon_fc1_config()
    assert cfg["EPI_WARPS"] + 1 <= 4  # producer + epilogue share one warpgroup
    assert GG.MAXNREG * (cfg["num_warps"] + 4) * 32 <= 65536
    assert cfg["num_warps"] * 32 * 200 + 4 * 32 * cfg["WORKER_REGS"] <= 65536


def test_argument_errors_name_the_argument():
    x = torch.zeros(8, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x has 4 columns, .* have K=5"):
        FG.gluon_fc1_swiglu(x, torch.zeros(2, 6, 5, dtype=torch.bfloat16), torch.tensor([3, 8]))
    with pytest.raises(ValueError, match="even number of rows .* got 2F=5"):
        FG.gluon_fc1_swiglu(x, torch.zeros(2, 5, 4, dtype=torch.bfloat16), torch.tensor([3, 8]))
    with pytest.raises(ValueError, match=r"probs must have shape \(8,\)"):
        FG.gluon_fc1_dispatched(x, torch.zeros(2, 6, 4, dtype=torch.bfloat16),
                                torch.tensor([3, 8]), torch.ones(7))


def test_cpu_raises_with_the_reason():
    x, w = torch.zeros(8, 4, dtype=torch.bfloat16), torch.zeros(2, 6, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="cannot run: device type cpu is not cuda"):
        FG.gluon_fc1_swiglu(x, w, torch.tensor([3, 8]))
    reason = FG.gluon_fc1_unsupported_reason(x, w)
    assert reason is not None and ("CUDA" in reason or "gluon" in reason)


def test_rule_takes_the_measured_range_only(monkeypatch):
    """The Gluon fc1_swiglu row holds between the measured points around E128's fc1 only,
    on SM90 in bfloat16, where this Triton has Gluon."""
    monkeypatch.setattr(FG, "gluon", object())  # as where Gluon is installed
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))

    def kernel(*args):
        rule = fc1_swiglu_mod.fc1_swiglu_rule(*args)
        return None if rule is None else rule.kernel

    bf16 = (CUDA, torch.bfloat16)
    assert kernel(2048, 1536, 512.0, *bf16) == "gluon" == kernel(2048, 1536, 700.0, *bf16)
    assert kernel(2048, 1536, 1024.0, *bf16) is None  # the next measured point
    assert kernel(4096, 28672, 2048.0, *bf16) is None  # E8: two launches (measured)
    assert kernel(2048, 1536, None, *bf16) is None
    assert kernel(2048, 1536, 512.0, CUDA, torch.float16) is None
    monkeypatch.setattr(FG, "gluon", None)
    assert kernel(2048, 1536, 512.0, *bf16) is None


def test_reason_and_general_path_route_the_rule_shapes(monkeypatch):
    """At a rule shape auto (and ``1``) take the fused launch, which is the Gluon kernel
    (``gluon_fc1_dispatched``), recorded for ``explain()``; ``0`` still turns it off; off the
    rule auto keeps the two launches and ``1`` runs ``large_fc1_swiglu``."""
    real = fc1_swiglu_mod.fc1_swiglu_rule

    def rule(i, o, rows, *args, **kwargs):  # the Gluon row at a (4, 8, 64 rows) shape
        got = real(i, o, rows, *args, **kwargs)
        if (i, o, rows) != (4, 8, 64.0) or (got is not None and got.kernel == "grouped_mm"):
            return got
        return FC1_GLUON_ROW

    monkeypatch.setattr(fc1_swiglu_mod, "fc1_swiglu_rule", rule)
    monkeypatch.setattr(FG, "gluon_fc1_unsupported_reason", lambda x, w: None)
    gluon, large = [], []
    monkeypatch.setattr(FG, "gluon_fc1_dispatched",
                        lambda x, w, off, p: (gluon.append(x), ("gh", "ga"))[1])
    monkeypatch.setattr(fc1_swiglu_mod, "large_fc1_swiglu",
                        lambda x, w, off, p: (large.append(x), ("h", "a"))[1])
    here = {"device": CUDA, "dtype": torch.bfloat16}
    assert fc1_swiglu_reason(LARGE, ACT, None, False, None, 64.0, features=(4, 8),
                               **here) is None
    assert "persistent" in fc1_swiglu_reason(LARGE, ACT, None, False, None, 64.0)
    assert "a recipe" in fc1_swiglu_reason(LARGE, ACT, object(), False, None, 64.0,
                                             features=(4, 8), **here)
    fc1 = type("Fc1", (), {"has_bias": False, "out_features": 8})()
    with FakeTensorMode():  # operands on a (fake) CUDA device, as the general path has them
        splits = type("S", (), {"num_rows": 128, "num_groups": 2,
                                "offsets": torch.tensor([64, 128], device=CUDA)})()
        act = _Act()
        x, w = torch.zeros(128, 4, device=CUDA), torch.zeros(2, 8, 4, device=CUDA)
        p = torch.ones(128, device=CUDA)
        assert fused_fc1(fc1, act, x, w, splits, LARGE, p, None) == \
            ("gh", "ga", ACT)
        assert "warp-specialized Gluon kernel, gluon_fc1_swiglu" in act.records[-1][1]
        with_rows(monkeypatch, first=NO_FC1_FUSED)
        assert fused_fc1(fc1, act, x, w, splits, LARGE, p, None) is None
        with_rows(monkeypatch, last=FC1_FUSED_ANY)
        x96 = torch.zeros(96, 4, device=CUDA)  # 48 rows per group: off the rule
        splits.num_rows = 96
        assert fused_fc1(fc1, act, x96, w, splits, LARGE, p, None) == \
            ("h", "a", ACT)
        assert "large_fc1_swiglu; the fc1_swiglu row" in act.records[-1][1]
    assert gluon == [x] and large == [x96]


SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*bf16", "h_ptr": "*bf16", "a_ptr": "*bf16",
             "p_ptr": "*fp32", "offs_ptr": "*i32", "M": "i32", "F": "i32", "K": "i32",
             "G": "i32", "P": "i32", "stride_wg": "i32", "stride_wn": "i32"}


def _compile_sm90(config: dict | None, has_p: bool):
    skip_without_gluon(FG)
    cfg = FG._resolve(config)
    const = {"HAS_P": has_p, "GBLOCK": 8, **cfg}
    return compile_gluon_for_sm90(FG._fc1_swiglu_kernel, SIGNATURE, const, cfg["num_warps"],
                                  GG.MAXNREG)


@pytest.mark.parametrize("has_p", [True, False])
def test_compiles_for_sm90_warp_specialized(has_p):
    """The worker warpgroup at ``WORKER_REGS``, the consumers raised; wgmma m64n256k16; one
    TMA transaction of x's tile + the paired (gate, up) W tile per k-step (48 KiB); the
    exponential of the SiLU in the epilogue; shared memory within 227 KiB."""
    kernel = _compile_sm90(None, has_p)
    ptx = kernel.asm["ptx"]
    cfg = FG.gluon_fc1_config()
    regs = {int(r) for r in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+);", ptx)}
    assert cfg["WORKER_REGS"] in regs and max(regs) <= 256
    assert "setmaxnreg.inc.sync.aligned.u32" in ptx
    assert re.search(rf"\.maxnreg\s+{GG.MAXNREG}", ptx)
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in ptx
    assert "cp.async.bulk.tensor.4d" in ptx  # the (G, 2, F, K) view of W1
    nbytes = (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2
    assert re.search(r"mbarrier\.arrive\.expect_tx\.shared\.b64 _, \[%r\d+\], " + str(nbytes), ptx)
    assert "ex2.approx" in ptx
    assert kernel.metadata.shared <= 227 * 1024
    assert "st.local" not in ptx and "ld.local" not in ptx


# ---------------------------------------------------------------------------------- CUDA
def _skip_unless_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")


def _operands(sizes, m, ffn, k, dtype=torch.bfloat16, probs_dtype=torch.float32, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(sizes)
    x = torch.randn(m, k, generator=gen, device=CUDA).to(dtype)
    x[total:] = float("nan")  # padding rows: garbage that must not reach the outputs
    w = (torch.randn(len(sizes), 2 * ffn, k, generator=gen, device=CUDA) * k ** -0.5).to(dtype)
    offs = torch.tensor(sizes, device=CUDA).cumsum(0).to(torch.int32)
    probs = None
    if probs_dtype is not None:
        probs = torch.rand(m, generator=gen, device=CUDA).to(probs_dtype)
    return x, w, offs, probs


def _nan_garbage(m, ffn, dtype):
    """Fill and free blocks of h's and a's sizes, so the caching allocator hands NaN bytes
    to the kernel's outputs."""
    h = torch.full((m, 2 * ffn), float("nan"), device=CUDA, dtype=dtype)
    a = torch.full((m, ffn), float("nan"), device=CUDA, dtype=dtype)
    del h, a


def _reference(x, w, sizes, probs):
    h = per_expert_linear_fp64(x, w, sizes)
    ffn = w.shape[1] // 2
    a = F.silu(h[:, :ffn]) * h[:, ffn:]
    if probs is not None:
        a = a * probs.double()[:, None]
    return h, a


CASES = [
    ([300, 0, 17, 129], 460, 192, 256),      # empty group, 14 padding rows, skew, F < 2 tiles
    ([1000, 3, 0, 0, 250], 1300, 100, 136),  # F and K off the tiles
    ([0, 0], 50, 128, 64),                   # padding only
    ([512] * 4, 2048, 768, 512),             # E128-like fc1 slice, no padding
]
VARIANTS = [(torch.bfloat16, torch.float32, None), (torch.bfloat16, None, None),
            (torch.bfloat16, torch.bfloat16, None), (torch.float16, torch.float32, None)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, probs_dtype, config", VARIANTS,
                         ids=["bf16-p32", "bf16-nop", "bf16-pbf16", "fp16-p32"])
@pytest.mark.parametrize("sizes, m, ffn, k", CASES)
def test_against_reference_and_bitwise_two_launches(sizes, m, ffn, k, dtype, probs_dtype,
                                                    config):
    """h and a against fp64; h bitwise ``large_fprop`` (and ``torch._grouped_mm`` on the
    grouped rows), a bitwise the Triton SwiGLU forward on that h (all rows, padding too);
    the padding rows of h are zero although x's are NaN and the output memory held NaN."""
    _skip_unless_sm90()
    from te_ops.kernels.swiglu_triton import swiglu_forward

    x, w, offs, probs = _operands(sizes, m, ffn, k, dtype, probs_dtype)
    total = sum(sizes)
    _nan_garbage(m, ffn, dtype)
    h, a = FG._launch(x, w, offs, probs, config)
    assert h.shape == (m, 2 * ffn) and a.shape == (m, ffn) and h.dtype == a.dtype == dtype
    assert not h[total:].any()
    plain = L.large_fprop(x, w, offs)
    assert torch.equal(h, plain)
    assert torch.equal(a, swiglu_forward(plain, probs))
    if total:
        assert torch.equal(h[:total], torch._grouped_mm(x[:total], w.transpose(1, 2),
                                                        offs=offs)[:total])
        h_ref, a_ref = _reference(x[:total], w, sizes, None if probs is None else probs[:total])
        tol = (2e-2 if dtype == torch.bfloat16 else 3e-3) * max(1.0, (k / 64) ** 0.5)
        assert (h[:total].double() - h_ref).abs().max().item() <= tol
        assert (a[:total].double() - a_ref).abs().max().item() <= 2 * tol


@pytest.mark.cuda
def test_dispatched_falls_back_with_the_same_bits_on_a_misaligned_base():
    """An x whose base is off 16 bytes: ``gluon_fc1_dispatched`` runs ``large_fc1_swiglu``
    (same bits); ``gluon_fc1_swiglu`` says why it cannot run."""
    _skip_unless_sm90()
    x, w, offs, probs = _operands([100, 60], 170, 128, 64)
    odd = torch.empty(170 * 64 + 1, device=CUDA, dtype=x.dtype)[1:].view(170, 64)
    odd.copy_(x)
    with pytest.raises(RuntimeError, match="16-byte boundary"):
        FG.gluon_fc1_swiglu(odd, w, offs, probs)
    h, a = FG.gluon_fc1_dispatched(odd, w, offs, probs)
    h2, a2 = FG.gluon_fc1_swiglu(x, w, offs, probs)
    assert torch.equal(h, h2) and torch.equal(a, a2)


@pytest.mark.cuda
def test_graph_replay_with_new_offsets_and_compile_bitwise_equal_to_eager():
    _skip_unless_sm90()
    x, w, offs, probs = _operands([300, 0, 200], 520, 256, 256)
    new, want = assert_replay_with_new_offsets_equal_to_eager(FG.gluon_fc1_dispatched, x, w,
                                                              offs, probs)
    compiled = torch.compile(FG.gluon_fc1_dispatched, fullgraph=True)
    got = compiled(x, w, new, probs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


SIZES, ROWS = [150, 0, 47, 83], 300  # 75 rows per group: fc1's fprop in the persistent kernel


def _take_gluon(monkeypatch) -> list[int]:
    """fc1 + SwiGLU fused at every shape (rows after the table) and the Gluon kernel patched to
    be the fused launch's; counts its launches."""
    with_rows(monkeypatch, last=FC1_FUSED_ANY)
    monkeypatch.setattr(fc1_swiglu_mod, "_gluon_shape", lambda *a: True)
    return count_launches(monkeypatch, FG)


@pytest.mark.cuda
@pytest.mark.parametrize("scaled", [True, False], ids=["ScaledSwiGLU", "SwiGLU"])
def test_block_interchange_bitwise_equal(monkeypatch, scaled):
    """Auto at a (patched) rule shape: the Gluon kernel (first and repeated calls);
    against the epilogue off, the fused forward with the unfused backward and the unfused
    ops: output and every gradient bit for bit."""
    _skip_unless_sm90()
    x, split, probs, dy = fc1_block_inputs(SIZES, ROWS)
    with_rows(monkeypatch, first=NO_FC1_FUSED)
    off = run_block(fc1_block(scaled=scaled), x, split, probs, dy)[0]
    launches = _take_gluon(monkeypatch)
    block = fc1_block(scaled=scaled)
    runs = [run_block(block, x, split, probs, dy) for _ in range(3)]
    assert runs[-1][1] == "_FuserFunctionBackward"
    assert "warp-specialized Gluon kernel, gluon_fc1_swiglu" in block.explain()
    assert len(launches) == 3
    monkeypatch.setenv("TE_OPS_FUSION_OFF", "grouped_mlp_backward")
    fwd_only = run_block(fc1_block(scaled=scaled), x, split, probs, dy)[0]
    monkeypatch.setenv("TE_OPS_FUSION", "0")
    unfused = run_block(fc1_block(scaled=scaled), x, split, probs, dy)[0]
    for got in [r[0] for r in runs] + [fwd_only, unfused]:
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, off))


@pytest.mark.cuda
def test_block_graph_replay_and_compile_bitwise_equal_to_eager(monkeypatch):
    _skip_unless_sm90()
    _take_gluon(monkeypatch)
    x, split, probs, dy = fc1_block_inputs(SIZES, ROWS)
    assert_graph_and_compile_match_eager(fc1_block(), x, split, probs, dy, [10, 90, 0, 180],
                                         "warp-specialized Gluon kernel, gluon_fc1_swiglu")


@pytest.mark.cuda
def test_block_at_a_rule_shape_takes_the_kernel_unpatched(monkeypatch):
    """E128 T65536 H2048 FF768 (the Gluon fc1_swiglu row's measured shape, 512 rows) under
    auto: the Gluon kernel runs (``explain()``), and the block's output and gradients equal
    the run with the epilogue off bit for bit."""
    _skip_unless_sm90()
    rule = fc1_swiglu_mod.fc1_swiglu_rule(2048, 1536, 512.0, CUDA, torch.bfloat16)
    if rule is None or rule.kernel != "gluon":
        pytest.skip("no Gluon fc1_swiglu row holds E128 T65536 H2048 FF768")
    gen = torch.Generator().manual_seed(0)  # Zipf(1.2) routing, as benchmarks/grouped_mlp.py
    popularity = 1.0 / torch.arange(1, 129, dtype=torch.float64) ** 1.2
    picks = torch.multinomial(popularity[torch.randperm(128, generator=gen)], 65536,
                              replacement=True, generator=gen)
    sizes = torch.bincount(picks, minlength=128).tolist()
    x, split, probs, dy = fc1_block_inputs(sizes, 65536, h=2048)
    with_rows(monkeypatch, first=NO_FC1_FUSED)
    off = run_block(fc1_block(128, 2048, 768), x, split, probs, dy)[0]
    with_rows(monkeypatch)
    block = fc1_block(128, 2048, 768)
    got = run_block(block, x, split, probs, dy)[0]
    assert "warp-specialized Gluon kernel, gluon_fc1_swiglu" in block.explain()
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, off))
