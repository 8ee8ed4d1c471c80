"""fc1's grouped fprop with the (Scaled)SwiGLU in its epilogue (``gemm/grouped_mlp_triton.py``)
and where the fused grouped MLP takes it (``fused/fc1_epilogue.py``).

CPU (CI): the rule and its reasons, the env toggle, ``explain()`` naming why it is not used,
the argument errors. The interpreter run of the kernel is in
``tests/test_fc1_epilogue_interpret.py``. CUDA: the kernel against a per-expert fp64 reference
(inputs ~N(0, 1), weights at init scale, padding rows over NaN garbage), bitwise against the two
launches it replaces (h and a), the block with the epilogue bitwise equal to the block without
it (fused, repeated calls, every gradient), CUDA graph replay bitwise equal to eager and
``torch.compile(fullgraph=True)`` of the block bitwise equal to eager.
"""

from __future__ import annotations

import pytest
import reference as ref
import torch
from gemm_force import FC1_FUSED_ANY, NO_FC1_FUSED, with_rows
from block_replay import assert_graph_and_compile_match_eager, run_block_params_first
from reference import assert_close

import te_ops
from te_ops.gemm import fc1_swiglu_reason
from te_ops.gemm import grouped_mlp_triton as gm
from te_ops.gemm.dispatch import BackendChoice
from te_ops.kernels.swiglu_triton import ActivationChoice

CUDA = torch.device("cuda")
TRITON_FPROP = BackendChoice("triton", "test", True, ("fprop", "dgrad", "wgrad"))
MM = BackendChoice("grouped_mm", "test", True)
ACT = ActivationChoice("triton", "test")


# ------------------------------------------------------------------------------ CPU: the rule
@pytest.mark.parametrize("args, match", [
    ((TRITON_FPROP, ACT, None, False, None, 4.0), None),
    ((TRITON_FPROP, ACT, None, False, None, 8.0), None),
    ((TRITON_FPROP, ACT, None, False, None, 9.0), "9 rows per group: no few-rows fc1_swiglu row"),
    ((TRITON_FPROP, ACT, object(), False, None, 4.0), "a recipe"),
    ((TRITON_FPROP, ACT, None, True, None, 4.0), "fc1 has a bias"),
    ((MM, ACT, None, False, None, 4.0), "fc1's fprop does not run in Triton"),
    ((TRITON_FPROP, ACT, None, False, 32, 4.0), "glu_interleave_size=32"),
    ((TRITON_FPROP, ActivationChoice("torch", "forced"), None, False, None, 4.0),
     "the activation runs in torch"),
])
def test_rule_and_reasons(monkeypatch, args, match):
    """The gate's checks under the measured table (its few-rows row: at most 8 rows)."""
    why = fc1_swiglu_reason(*args)
    assert why is None if match is None else match in why


def test_auto_follows_the_measured_rule_and_a_row_opts_in(monkeypatch):
    args = (TRITON_FPROP, ACT, None, False, None)
    limit = 8  # the few-rows fc1_swiglu row of te_ops.gemm.rules
    assert fc1_swiglu_reason(*args, float(limit + 1)) is not None
    assert fc1_swiglu_reason(*args, float(limit)) is None
    with_rows(monkeypatch, last=FC1_FUSED_ANY)
    assert fc1_swiglu_reason(*args, 1000.0) is None
    assert "fc1 has a bias" in fc1_swiglu_reason(TRITON_FPROP, ACT, None, True, None, 4.0)


def test_a_two_launch_row_first_turns_it_off(monkeypatch):
    with_rows(monkeypatch, first=NO_FC1_FUSED)
    assert "no few-rows fc1_swiglu row" in fc1_swiglu_reason(TRITON_FPROP, ACT, None, False,
                                                             None, 0.5)


def test_unsupported_reasons_device_first():
    assert "cpu" in gm.unsupported_reason(torch.device("cpu"), torch.bfloat16, None)
    assert "float32" in gm.unsupported_reason(CUDA, torch.float32, None)
    why = gm.unsupported_reason(CUDA, torch.bfloat16, 16)
    assert why is None or "glu_interleave_size=16" in why or "triton" in why


def test_explain_says_why_not_used_on_cpu():
    block = te_ops.Sequential(te_ops.GroupedLinear(2, 8, 16, bias=False),
                              te_ops.ScaledSwiGLU(), te_ops.GroupedLinear(2, 8, 8, bias=False))
    split = torch.tensor([2, 1])
    block(torch.randn(3, 8), split, torch.rand(3), split)
    assert ("fc1 SwiGLU epilogue: not used: fc1's fprop does not run in Triton"
            in block.explain())


def test_argument_errors_name_the_argument():
    x = torch.randn(6, 8, dtype=torch.bfloat16)
    w = torch.randn(2, 4, 8, dtype=torch.bfloat16)
    offs = torch.tensor([3, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="x must be 2-D"):
        gm.fc1_swiglu(x[None], w, offs)
    with pytest.raises(ValueError, match="x has 8 columns, weights .* K=7"):
        gm.fc1_swiglu(x, w[..., :7], offs)
    with pytest.raises(ValueError, match="even number of rows .* 2F=3"):
        gm.fc1_swiglu(x, w[:, :3], offs)
    with pytest.raises(ValueError, match="weights must be 3-D"):
        gm.fc1_swiglu(x, w.float(), offs)
    with pytest.raises(ValueError, match=r"offsets must be int32/int64 of shape \(2,\)"):
        gm.fc1_swiglu(x, w, offs[:1])
    with pytest.raises(ValueError, match=r"probs must have shape \(6,\)"):
        gm.fc1_swiglu(x, w, offs, torch.rand(5))
    with pytest.raises(RuntimeError, match="fused fc1 \\+ SwiGLU kernel cannot run: device"):
        gm.fc1_swiglu(x, w, offs)


# --------------------------------------------------------------------------- CUDA: the kernel
def _problem(sizes, rows, ffn, k, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(rows, k, device=CUDA, dtype=dtype, generator=gen)
    w = torch.randn(len(sizes), 2 * ffn, k, device=CUDA, dtype=dtype, generator=gen) * k ** -0.5
    offs = torch.cumsum(torch.tensor(sizes, device=CUDA), 0).to(torch.int32)
    probs = torch.rand(rows, device=CUDA, generator=gen)
    return x, w, offs, probs


CASES = {  # name -> (split sizes, rows, FF, K)
    "decode_skewed": ([0, 1, 3, 0, 17, 2, 0, 40], 64, 96, 128),
    "padding_rows": ([3, 0, 5, 1], 20, 64, 64),
    "odd_sizes": ([5, 7, 0, 11], 23, 72, 200),
    "all_empty": ([0, 0, 0], 9, 32, 48),
    "empty_batch": ([0, 0], 0, 32, 48),
    "e64_decode": ([4] * 63 + [1], 256, 768, 2048),
}


def _two_launches(x, w, offs, probs):
    from te_ops.gemm import grouped_gemm_triton as tg
    from te_ops.kernels import swiglu_triton as st

    h = tg.triton_fprop(x, w, offs)
    return h, st.swiglu_forward(h, probs)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no_probs"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_fp64_reference_and_two_launches_bitwise(case, with_probs, dtype):
    sizes, rows, ffn, k = CASES[case]
    x, w, offs, probs = _problem(sizes, rows, ffn, k, dtype)
    probs = probs if with_probs else None
    # NaN garbage in the allocator's blocks: padding rows must be written, not assumed zero
    torch.full((rows + 64, 4 * ffn), float("nan"), device=CUDA, dtype=dtype)
    h, a = gm.fc1_swiglu(x, w, offs, probs)
    h0, a0 = _two_launches(x, w, offs, probs)
    assert torch.equal(h, h0) and torch.equal(a, a0)  # bits of fprop + SwiGLU
    total = sum(sizes)
    assert torch.count_nonzero(h[total:]) == 0 and torch.count_nonzero(a[total:]) == 0
    xd, wd = ref.leaf(x).detach(), ref.leaf(w).detach()
    want_h = ref.grouped_linear(xd, list(wd), None, sizes)
    assert_close(h, want_h, dtype, "h")
    want_a = (ref.swiglu(want_h) if probs is None
              else ref.scaled_swiglu(want_h, ref.leaf(probs).detach()))
    assert_close(a, want_a, dtype, "a")


# ---------------------------------------------------------------------------- CUDA: the block
def _block(groups=8, h=128, ffn=96, scaled=True):
    torch.manual_seed(0)
    kw = {"bias": False, "device": CUDA, "dtype": torch.bfloat16}
    return te_ops.Sequential(te_ops.GroupedLinear(groups, h, 2 * ffn, **kw),
                             te_ops.ScaledSwiGLU() if scaled else te_ops.SwiGLU(),
                             te_ops.GroupedLinear(groups, ffn, h, **kw))


_run = run_block_params_first  # [y, x.grad, *parameter grads, (probs.grad)], grad_fn name


def _inputs(sizes, rows, h=128):
    x = torch.randn(rows, h, device=CUDA, dtype=torch.bfloat16)
    probs = torch.rand(rows, device=CUDA, dtype=torch.bfloat16)
    return x, torch.tensor(sizes, device=CUDA), probs, torch.randn(rows, h, device=CUDA,
                                                                  dtype=torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "plain"])
def test_block_with_epilogue_bitwise_equal_to_two_launches(monkeypatch, scaled):
    """Epilogue on (three calls) vs off, and vs the unfused ops: outputs and
    every gradient equal bit for bit; explain() names the decision."""
    with_rows(monkeypatch, last=FC1_FUSED_ANY)
    if torch.cuda.get_device_capability()[0] != 9:
        monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "triton")
    sizes = [0, 1, 12, 0, 3, 2, 0, 10]  # 28 of 32 rows: 4 per group, padding rows
    x, split, probs, dy = _inputs(sizes, 32)
    block = _block(scaled=scaled)
    runs = [_run(block, x, split, probs, dy) for _ in range(3)]
    assert [r[1] for r in runs][-1] == "_FuserFunctionBackward"
    assert "fc1 SwiGLU epilogue: one Triton launch" in block.explain()
    with_rows(monkeypatch, first=NO_FC1_FUSED)
    off = _run(_block(scaled=scaled), x, split, probs, dy)[0]
    monkeypatch.setenv("TE_OPS_FUSION_OFF", "grouped_mlp_backward")
    with_rows(monkeypatch, last=FC1_FUSED_ANY)
    fwd_only = _run(_block(scaled=scaled), x, split, probs, dy)[0]  # fused fwd, unfused bwd
    monkeypatch.setenv("TE_OPS_FUSION", "0")
    unfused = _run(_block(scaled=scaled), x, split, probs, dy)[0]
    for got in [r[0] for r in runs] + [fwd_only, unfused]:
        assert all(torch.equal(a, b) for a, b in zip(got, off))


@pytest.mark.cuda
def test_block_graph_replay_and_compile_bitwise_equal_to_eager(monkeypatch):
    """The block with the epilogue captured in a CUDA graph (replayed with new split sizes)
    and compiled with fullgraph=True: bitwise the eager values; one frame, no graph break."""
    with_rows(monkeypatch, last=FC1_FUSED_ANY)
    if torch.cuda.get_device_capability()[0] != 9:
        monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "triton")
    x, split, probs, dy = _inputs([0, 1, 12, 0, 3, 2, 0, 10], 32)
    assert_graph_and_compile_match_eager(_block(), x, split, probs, dy,
                                         [10, 0, 2, 3, 0, 12, 1, 0],
                                         "fc1 SwiGLU epilogue: one Triton launch")
