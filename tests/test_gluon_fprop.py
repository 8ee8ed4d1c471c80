"""The warp-specialized Gluon grouped GEMM (``te_ops/gemm/grouped_gemm_gluon.py``).

CPU (CI): the launch config, the argument errors and the reason on CPU; the sm_90
ahead-of-time compile (skipped without Gluon or an sm_90 ptxas: run with Triton 3.6 on the
path): three partitions with their register budgets (``setmaxnreg``), wgmma, TMA loads, no
spills, shared memory within SM90's 227 KiB. CUDA (``@pytest.mark.cuda``): fprop and dgrad
against an fp64 per-expert ``torch.nn.functional.linear`` reference at N(0, 1) inputs and
init-scale weights, padding rows that start as NaN garbage, empty groups, bitwise equal to
``torch._grouped_mm`` and to the persistent Triton kernel, CUDA-graph replay with changed
offsets bitwise equal to eager; the dispatched op ``te_ops::grouped_gemm_gluon`` under
``torch.compile(fullgraph=True)``; with the rule patched to take the Gluon kernel for every
fprop / dgrad of the persistent kernels, test_large_gemm_dispatch's block (fused, unfused)
bitwise equal to the Triton kernel's run, and the existing compile and CUDA-graph block
checks bitwise equal to eager. CPU: the choice (the Gluon rows of ``te_ops.gemm.rules``: tests/test_gemm_rules.py) and
the choice's ``explain()`` text and routing.
"""

from __future__ import annotations

import re

import pytest
import torch
from gemm_force import PERSISTENT_FROM_ONE, with_rows
from block_replay import count_launches
from grouped_cuda_helpers import fp64_tolerance, grouped_operands, per_expert_linear_fp64
from sm90_compile import compile_gluon_for_sm90, skip_without_gluon
from test_grouped_gemm_large_triton import CASES  # the persistent kernel's cases

from te_ops.gemm import grouped_gemm_gluon as GG
from te_ops.gemm import grouped_gemm_large_triton as L

CUDA = torch.device("cuda")


# ----------------------------------------------------------------------------------- CPU
def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"config keys must be among .* got unknown \['FLAT'\]"):
        GG._resolve({"FLAT": True})
    with pytest.raises(ValueError, match="SPLIT=True needs num_warps=4 .* got num_warps=8"):
        GG._resolve({"SPLIT": True})
    with pytest.raises(ValueError, match="num_warps must be 8 .* got 4"):
        GG._resolve({"num_warps": 4})
    with pytest.raises(ValueError, match="C_HALF=True .* needs SPLIT=True, got SPLIT=False"):
        GG._resolve({"C_HALF": True})
    with pytest.raises(ValueError, match=r"STAGES=4 with C_HALF=False needs 262144 bytes"):
        GG._resolve({"SPLIT": True, "num_warps": 4, "STAGES": 4})
    assert GG._resolve(GG.DISPATCH_CONFIG)["STAGES"] == 4  # fits with the 64-row buffer


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


def _compile_sm90(dgrad: bool, split: bool = False, extra: dict | None = None):
    skip_without_gluon(GG)
    cfg = GG._resolve({**({"SPLIT": True, "num_warps": 4} if split else {}), **(extra or {})})
    const = {"W_KN": dgrad, "GBLOCK": 8, **cfg}
    return compile_gluon_for_sm90(GG._gluon_kernel, SIGNATURE, const, cfg["num_warps"],
                                  GG.MAXNREG)


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


@pytest.mark.parametrize("dgrad", [False, True])
def test_half_output_buffer_fits_a_fourth_stage(dgrad):
    """``C_HALF``: a 64-row output buffer (32 KiB) instead of 128 rows leaves room for a
    4-stage ring (4 x 48 KiB): within SM90's 227 KiB, no spills."""
    kernel = _compile_sm90(dgrad, extra={"SPLIT": True, "num_warps": 4, "C_HALF": True,
                                         "STAGES": 4})
    assert 4 * 48 * 1024 + 32 * 1024 <= kernel.metadata.shared <= 227 * 1024
    assert "st.local" not in kernel.asm["ptx"]


@pytest.mark.parametrize("dgrad", [False, True])
@pytest.mark.parametrize("c_half", [False, True])
def test_tma_store_epilogue_compiles_for_sm90(dgrad, c_half):
    """``TMA_STORE``: the epilogue issues a TMA store (a 2-D bulk tensor copy from shared
    memory) beside its masked stores for the tail parts, and the consumers fence the proxy
    before handing the buffer over; no spills, within shared memory."""
    assert GG.DISPATCH_CONFIG["TMA_STORE"] is True  # the dispatched config
    extra = GG.DISPATCH_CONFIG if c_half else {"TMA_STORE": True}
    ptx = _compile_sm90(dgrad, extra=extra).asm["ptx"]
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx
    assert "fence.proxy.async.shared::cta" in ptx
    assert "st.global" in ptx  # the masked path of tail parts and padding rows
    assert "st.local" not in ptx and "ld.local" not in ptx
    plain = _compile_sm90(dgrad, extra={**GG.DISPATCH_CONFIG, "TMA_STORE": False} if c_half
                          else {}).asm["ptx"]
    assert "cp.async.bulk.tensor.2d.global.shared::cta" not in plain


@pytest.mark.parametrize("dgrad, n_out, tma", [
    (False, 128, True), (False, 100, False), (False, 8, True), (False, 4, False),
    (True, 64, True)])
def test_tma_store_only_where_output_rows_are_16_byte_aligned(dgrad, n_out, tma):
    """A TMA descriptor of y (M, N) needs 16-byte row strides; fprop's N (out_features) is
    not one of the strides ``tma_unsupported_reason`` checks (K = 64 keeps W's aligned for
    N = 100), so the launch keeps the masked stores there (the same bits)."""
    x = torch.zeros(10, n_out if dgrad else 64, dtype=torch.bfloat16)
    w = torch.zeros(2, n_out, 64, dtype=torch.bfloat16)
    cfg = GG._resolve(GG.DISPATCH_CONFIG)
    assert cfg["TMA_STORE"] is True
    _, rest, kwargs = GG._launch_args(x, w, dgrad, cfg)
    assert rest[1] == (64 if dgrad else n_out)
    assert kwargs["TMA_STORE"] is tma
    assert cfg["TMA_STORE"] is True  # the caller's config is left as it was


# ---------------------------------------------------------------------------------- CUDA
def _operands(sizes, m, n, k, dtype=torch.bfloat16, seed=0):
    """``(x, w, offs)`` of :func:`grouped_operands` (NaN padding rows of x)."""
    return grouped_operands(sizes, m, n, k, dtype, seed)[:3]


def _skip_unless_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")


SPLIT = {"SPLIT": True, "num_warps": 4}


@pytest.mark.cuda
@pytest.mark.parametrize("config", [None, SPLIT, GG.DISPATCH_CONFIG], ids=["none", "split",
                                                                           "dispatch"])
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
        err = (y.double() - per_expert_linear_fp64(x, w, sizes)).abs().max().item()
        assert err <= fp64_tolerance(dtype, k), err
    dy = torch.randn(m, n, device=CUDA).to(dtype)
    dy[total:] = float("nan")
    dx = GG.gluon_dgrad(dy, w, offs, config)
    assert dx.shape == (m, k) and not dx[total:].any()
    if total:
        ref = per_expert_linear_fp64(dy, w.transpose(1, 2), sizes)
        err = (dx.double() - ref).abs().max().item()
        assert err <= fp64_tolerance(dtype, n), err


@pytest.mark.cuda
@pytest.mark.parametrize("config", [None, SPLIT, GG.DISPATCH_CONFIG], ids=["none", "split",
                                                                           "dispatch"])
def test_bitwise_equal_to_grouped_mm_and_the_triton_kernel(config):
    """fprop and dgrad equal ``torch._grouped_mm`` (CUTLASS) and ``large_fprop`` /
    ``large_dgrad`` bit for bit (skewed and empty groups, no padding)."""
    _skip_unless_sm90()
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


# ------------------------------------------------------------------ dispatch (CPU + CUDA)
def test_choice_explains_and_routes_the_gluon_kinds(monkeypatch):
    from te_ops.gemm import dispatch as grouped_gemm
    from te_ops.splits import make_splits

    monkeypatch.setattr(grouped_gemm, "large_auto_reason", lambda *a: None)
    cpu = torch.device("cpu")
    choice = grouped_gemm._select_backend(cpu, torch.bfloat16, 768, 2048, True, "auto", "auto",
                                          (), ("fprop", "dgrad"), ("fprop", "dgrad"))
    assert choice.large_kinds == ("fprop", "dgrad") and choice.gluon_kinds == ("fprop", "dgrad")
    assert "fprop/dgrad in the warp-specialized Gluon kernel" in choice.reason
    assert "768 -> 2048 features" in choice.reason
    x = torch.zeros(10, 768, dtype=torch.bfloat16)
    w = torch.zeros(3, 2048, 768, dtype=torch.bfloat16)
    splits = make_splits(torch.tensor([3, 0, 5]), 3, 10, cpu)
    with pytest.raises(RuntimeError, match="cannot run: device type cpu is not cuda"):
        grouped_gemm.grouped_fprop(x, w, splits, choice)
    plain = grouped_gemm._select_backend(cpu, torch.bfloat16, 768, 2048, True, "auto", "auto",
                                         (), ("fprop", "dgrad"))
    assert plain.gluon_kinds == () and "Gluon" not in plain.reason


@pytest.mark.cuda
@pytest.mark.parametrize("dgrad", [False, True])
def test_op_under_compile_fullgraph_equals_eager(dgrad):
    _skip_unless_sm90()
    x, w, offs = _operands([300, 0, 200], 520, 512, 256)
    a = torch.randn(520, 512, device=CUDA).to(torch.bfloat16) if dgrad else x
    want = GG.gluon_grouped_gemm(a, w, offs, dgrad)
    compiled = torch.compile(lambda *t: GG.gluon_grouped_gemm(*t, dgrad), fullgraph=True)
    assert torch.equal(compiled(a, w, offs), want)
    assert torch.equal(want, (L.large_dgrad if dgrad else L.large_fprop)(a, w, offs))


def _force_gluon(monkeypatch) -> list[int]:
    """Auto takes the Gluon kernel for every fprop / dgrad from 32 rows per group (a Gluon
    row put in front of the persistent one; with ``PERSISTENT_FROM_ONE`` in place from 1
    row); returns a list that counts the Gluon launches."""
    import math

    from te_ops.gemm import rules

    low = 1.0 if any(r in rules.RULES for r in PERSISTENT_FROM_ONE) else 32.0
    rows = tuple(rules.Rule(kind, "gluon", (low, math.inf), "Gluon fprop/dgrad: a test's row")
                 for kind in ("fprop", "dgrad"))
    monkeypatch.setattr(rules, "RULES", (*rows, *rules.RULES))
    monkeypatch.setattr(rules, "VERSION", [rules.VERSION[0] + 1])
    return count_launches(monkeypatch, GG)


@pytest.mark.cuda
def test_block_with_gluon_dispatch_bitwise_equal_to_the_triton_kernel(monkeypatch):
    """test_large_gemm_dispatch's 2600-row block (650 rows per group, an empty group, NaN
    padding rows): with every fprop / dgrad in the Gluon kernel, output and all gradients,
    fused and unfused, equal the run with the persistent Triton kernel bit for bit."""
    _skip_unless_sm90()
    import test_large_gemm_dispatch as D

    from te_ops.gemm import dispatch as grouped_gemm

    sizes = [1500, 0, 700, 360]
    rows, hidden, ffn = 2600, 256, 384
    x = torch.randn(rows, hidden, device=CUDA, dtype=torch.bfloat16)
    x[sum(sizes):] = float("nan")
    probs = torch.rand(rows, device=CUDA, dtype=torch.bfloat16)
    splits = torch.tensor(sizes, device=CUDA)
    dy = torch.randn(rows, hidden, device=CUDA, dtype=torch.bfloat16)
    want = {}
    for fusion in ("1", "0"):
        monkeypatch.setenv("TE_OPS_FUSION", fusion)
        grouped_gemm._CHOICES.clear()
        want[fusion] = D._run(D._block(4, hidden, ffn), x, probs, splits, dy)
    launches = _force_gluon(monkeypatch)
    for fusion in ("1", "0"):
        monkeypatch.setenv("TE_OPS_FUSION", fusion)
        block = D._block(4, hidden, ffn)
        got = D._run(block, x, probs, splits, dy)
        assert "warp-specialized Gluon kernel" in block.explain()
        for i, (g, w) in enumerate(zip(got, want[fusion])):
            assert torch.equal(g, w), f"fusion {fusion}, tensor {i}"
    assert launches  # the Gluon kernel ran
    grouped_gemm._CHOICES.clear()


@pytest.mark.cuda
@pytest.mark.parametrize("fusion", ["1", "0"], ids=["fused", "unfused"])
def test_compile_and_graph_checks_with_gluon_dispatch(fusion, monkeypatch):
    """The existing compile (fullgraph) and CUDA-graph replay checks (new split sizes each
    replay) with fprop / dgrad in the Gluon kernel: bitwise equal to eager."""
    _skip_unless_sm90()
    import test_cuda_graphs
    import test_torch_compile_cuda

    with_rows(monkeypatch, last=PERSISTENT_FROM_ONE)
    launches = _force_gluon(monkeypatch)
    block = test_torch_compile_cuda._block(fusion, monkeypatch)
    x = torch.randn(256, block[0].in_features, device=CUDA, dtype=torch.bfloat16)
    sizes = torch.tensor([64] * 4, device=CUDA)
    block(x, sizes, torch.rand(256, device=CUDA), sizes)
    assert "warp-specialized Gluon kernel" in block.explain()
    test_torch_compile_cuda._check_compiled_bitwise(block, "default")
    test_cuda_graphs.test_replay_matches_eager_bitwise(monkeypatch, fusion, torch.bfloat16)
    assert launches


# Group sizes around the 64-row halves of a 128-row tile: tail tiles whose second half is
# empty (1, 63, 64 rows; 129 = 128 + 1), one row into it (65), full (127, 128); empty groups
# (first, middle and last), a long group, 37 padding rows (NaN in the input).
TAIL_SIZES = [0, 1, 63, 64, 65, 0, 127, 128, 129, 300, 0]
TAIL_CONFIGS = {"half_buffer": {**SPLIT, "C_HALF": True, "STAGES": 4},
                "dispatch": GG.DISPATCH_CONFIG,  # the dispatched calls' config itself
                # parts inside their group in one TMA store (128-row buffer), and the
                # dispatched config with masked stores only
                "tma_store": {"TMA_STORE": True},
                "dispatch_masked_stores": {**GG.DISPATCH_CONFIG, "TMA_STORE": False}}


def _poisoned_empty(numel: int, dtype: torch.dtype) -> None:
    """Leave a NaN-filled block of ``numel`` elements in the caching allocator's pool, so
    the kernel's ``torch.empty`` output starts as NaN garbage: a row it does not write
    stays NaN and cannot equal the reference's."""
    torch.full((numel,), float("nan"), device=CUDA, dtype=dtype)
    torch.cuda.synchronize()


@pytest.mark.cuda
@pytest.mark.parametrize("n, k", [(384, 320), (64, 64)], ids=["k5n2", "k1n1"])
@pytest.mark.parametrize("name", list(TAIL_CONFIGS))
def test_tail_tiles_bitwise_equal_to_grouped_mm(name, n, k):
    """Every stored row of fprop and dgrad equals ``torch._grouped_mm``'s and the Triton
    kernel's bit for bit (group sizes 1, 63, 64, 65, 127, 128, 129, empty groups, NaN
    padding rows in the input, NaN garbage in the output buffer; one and several k-steps);
    padding rows zero."""
    _skip_unless_sm90()
    config = TAIL_CONFIGS[name]
    total = sum(TAIL_SIZES)
    m = total + 37
    x, w, offs = _operands(TAIL_SIZES, m, n, k, seed=3)
    _poisoned_empty(m * n, x.dtype)
    y = GG.gluon_fprop(x, w, offs, config)
    want = torch._grouped_mm(x[:total], w.transpose(1, 2), offs=offs)
    assert torch.equal(y[:total], want)
    assert torch.equal(y, L.large_fprop(x, w, offs))
    assert not y[total:].any()
    dy = torch.randn(m, n, device=CUDA).to(torch.bfloat16)
    dy[total:] = float("nan")
    _poisoned_empty(m * k, dy.dtype)
    dx = GG.gluon_dgrad(dy, w, offs, config)
    assert torch.equal(dx[:total], torch._grouped_mm(dy[:total], w, offs=offs))
    assert torch.equal(dx, L.large_dgrad(dy, w, offs))
    assert not dx[total:].any()
