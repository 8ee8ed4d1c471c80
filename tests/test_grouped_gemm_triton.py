"""The Triton grouped GEMMs (``te_ops.gemm.grouped_gemm_triton``) and the ``triton`` backend.

CPU (CI): the dispatch rule (auto never picks ``triton`` off CUDA SM90 bf16 with few rows per
group, a forced ``triton`` that cannot run raises with the reason), ``explain()`` naming the
backend, and the argument errors. CUDA: fprop / dgrad / wgrad against a per-expert fp64
``F.linear`` reference (empty groups, padding rows over NaN garbage, odd sizes, inputs ~N(0, 1)
and weights at init scale), the backend in the whole block against the fp64 reference, CUDA
graph replay bitwise equal to eager, and ``torch.compile(fullgraph=True)`` bitwise equal to
eager.
"""

from __future__ import annotations

import pytest
import reference as ref
import torch
import torch.nn.functional as F
from reference import assert_close

import te_ops
from te_ops.gemm import grouped_gemm_triton as tg
from te_ops.gemm.dispatch import select_backend, triton_auto_reason

CUDA = torch.device("cuda")


# ------------------------------------------------------------------------- CPU: dispatch
def test_auto_never_picks_triton_on_cpu():
    choice = select_backend(torch.device("cpu"), torch.bfloat16, 64, 64, True,
                            rows_per_group=1.0)
    assert choice.name == "grouped_mm"
    reason = triton_auto_reason(torch.device("cpu"), torch.bfloat16, ("fprop",))
    assert reason is not None and ("cpu" in reason or "triton is not installed" in reason)


def test_forced_triton_on_cpu_raises_with_reason(monkeypatch):
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "triton")
    with pytest.raises(RuntimeError, match="TE_OPS_GROUPED_GEMM_BACKEND=triton cannot run"):
        select_backend(torch.device("cpu"), torch.bfloat16, 64, 64, True, rows_per_group=1.0)


def test_forced_triton_error_reaches_the_block(monkeypatch):
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "triton")
    block = te_ops.Sequential(te_ops.GroupedLinear(2, 8, 8, bias=False))
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="triton cannot run"):
        block(x, torch.tensor([2, 2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unsupported_dtypes_have_reasons(dtype):
    reason = tg.unsupported_reason(CUDA, dtype)
    assert reason is not None and (str(dtype) in reason or "triton" in reason)


def test_env_var_rejects_unknown_backend(monkeypatch):
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "cutlass")
    with pytest.raises(ValueError, match="TE_OPS_GROUPED_GEMM_BACKEND.*triton"):
        select_backend(torch.device("cpu"), torch.float32, 8, 8, True)


def test_argument_errors_name_the_argument():
    x = torch.randn(6, 8, dtype=torch.bfloat16)
    w = torch.randn(2, 4, 8, dtype=torch.bfloat16)
    offs = torch.tensor([3, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="x has 8 columns, weights .* K=7"):
        tg.triton_fprop(x, w[..., :7], offs)
    with pytest.raises(ValueError, match="dy has 8 columns, weights .* N=4"):
        tg.triton_dgrad(x, w, offs)
    with pytest.raises(ValueError, match=r"offsets must have shape \(2,\)"):
        tg.triton_fprop(x, w, offs[:1])
    with pytest.raises(ValueError, match="weights must be torch.bfloat16"):
        tg.triton_fprop(x, w.float(), offs)
    with pytest.raises(ValueError, match="x and dy must have the same rows"):
        tg.triton_wgrad(x, x[:5], offs)
    with pytest.raises(ValueError, match="offsets must be int32/int64"):
        tg.triton_wgrad(x, x, offs.float())


def test_valid_call_off_cuda_raises_the_reason():
    x = torch.randn(6, 8, dtype=torch.bfloat16)
    w = torch.randn(2, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="Triton grouped GEMMs cannot run"):
        tg.triton_fprop(x, w, torch.tensor([3, 6], dtype=torch.int32))


def test_launch_configs_grow_with_rows():
    small, large = tg.rows_config("fprop", 1, 1536, 64, 64), \
        tg.rows_config("fprop", 512, 1536, 64, 512 * 64)
    assert small["BLOCK_M"] <= large["BLOCK_M"] and small["SPLIT"] == 4
    assert tg.rows_config("dgrad", 1, 1, 2, 1)["SPLIT"] == 1
    assert tg.wgrad_config(1, 1536, 2048)["BLOCK_M"] <= tg.wgrad_config(512, 1536, 2048)[
        "BLOCK_M"]


# ------------------------------------------------------------------------- CUDA: numerics
def _problem(sizes, rows, n, k, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(rows, k, device=CUDA, dtype=dtype, generator=gen)
    dy = torch.randn(rows, n, device=CUDA, dtype=dtype, generator=gen)
    w = torch.randn(len(sizes), n, k, device=CUDA, dtype=dtype, generator=gen) * k ** -0.5
    offs = torch.cumsum(torch.tensor(sizes, device=CUDA), 0).to(torch.int32)
    return x, dy, w, offs


def _reference(x, dy, w, sizes):
    """Per-expert fp64 ``F.linear`` (fprop, dgrad, wgrad); padding rows zero."""
    y = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    dx = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64)
    dw = torch.zeros(w.shape, dtype=torch.float64)
    xd, dyd, wd = (t.detach().double().cpu() for t in (x, dy, w))
    start = 0
    for g, m in enumerate(sizes):
        rows = slice(start, start + m)
        y[rows] = F.linear(xd[rows], wd[g])
        dx[rows] = F.linear(dyd[rows], wd[g].t())
        dw[g] = F.linear(dyd[rows].t(), xd[rows].t())
        start += m
    return y, dx, dw


CASES = {  # name -> (split sizes, rows, N, K)
    "decode_skewed": ([0, 1, 3, 0, 17, 2, 0, 40], 64, 96, 128),
    "padding_rows": ([3, 0, 5, 1], 20, 64, 64),
    "odd_sizes": ([5, 7, 0, 11], 23, 72, 200),
    "all_empty": ([0, 0, 0], 9, 32, 48),
    "empty_batch": ([0, 0], 0, 32, 48),
    "many_rows": ([130, 2, 70], 202, 128, 256),
    **{f"edge_{name}": (sizes, rows, 32, 16)
       for name, (_, rows, sizes) in ref.EDGE_CASES.items()},
}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernels_match_fp64_reference(case, dtype):
    sizes, rows, n, k = CASES[case]
    x, dy, w, offs = _problem(sizes, rows, n, k, dtype)
    # NaN garbage in the allocator's blocks: padding rows must be written, not assumed zero
    torch.full((rows + 64, max(n, k) * 4), float("nan"), device=CUDA, dtype=dtype)
    y, dx, dw = tg.triton_fprop(x, w, offs), tg.triton_dgrad(dy, w, offs), \
        tg.triton_wgrad(x, dy, offs)
    want = _reference(x, dy, w, sizes)
    for name, got, exp in zip(("fprop", "dgrad", "wgrad"), (y, dx, dw), want):
        assert got.dtype == dtype
        assert_close(got, exp, dtype, name)
    total = sum(sizes)
    assert torch.count_nonzero(y[total:]) == 0 and torch.count_nonzero(dx[total:]) == 0


@pytest.mark.cuda
def test_strided_weights_view():
    """Weights given as a transposed view (G, N, K) with K not the unit stride."""
    sizes = [4, 0, 9]
    x, dy, w, offs = _problem(sizes, 13, 64, 32)
    w_t = w.transpose(1, 2).contiguous().transpose(1, 2)
    assert not w_t.is_contiguous()
    torch.testing.assert_close(tg.triton_fprop(x, w_t, offs), tg.triton_fprop(x, w, offs),
                               rtol=0, atol=0)
    torch.testing.assert_close(tg.triton_dgrad(dy, w_t, offs), tg.triton_dgrad(dy, w, offs),
                               rtol=0, atol=0)


def _block(seed=0):
    torch.manual_seed(seed)
    kw = {"bias": False, "device": CUDA, "dtype": torch.bfloat16}
    return te_ops.Sequential(te_ops.GroupedLinear(8, 128, 2 * 96, **kw), te_ops.ScaledSwiGLU(),
                             te_ops.GroupedLinear(8, 96, 128, **kw))


@pytest.mark.cuda
@pytest.mark.parametrize("fusion", ["1", "0"], ids=["fused", "unfused"])
def test_block_with_triton_backend_matches_reference(fusion, monkeypatch):
    """Auto picks ``triton`` for 4 rows per group on SM90 (forced elsewhere); explain() says
    so; output and every gradient match the fp64 reference."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    if torch.cuda.get_device_capability()[0] != 9:
        monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "triton")
    block = _block()
    sizes = [0, 1, 12, 0, 3, 2, 0, 10]
    x = torch.randn(32, 128, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(32, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    split = torch.tensor(sizes, device=CUDA)
    y = block(x, split, probs, split)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert "grouped GEMM backend: triton" in block.explain()
    fc1, _, fc2 = block
    w1, w2 = fc1.weight, fc2.weight  # packed (8, out, in)
    leaves = {"x": ref.leaf(x), "probs": ref.leaf(probs),
              **{f"w1_{i}": ref.leaf(w) for i, w in enumerate(w1.unbind(0))},
              **{f"w2_{i}": ref.leaf(w) for i, w in enumerate(w2.unbind(0))}}
    h = ref.grouped_linear(leaves["x"], [leaves[f"w1_{i}"] for i in range(8)], None, sizes)
    a = ref.scaled_swiglu(h, leaves["probs"])
    want = ref.grouped_linear(a, [leaves[f"w2_{i}"] for i in range(8)], None, sizes)
    assert_close(y, want, torch.bfloat16, "output")
    want.backward(dy.double())
    assert_close(x.grad, leaves["x"].grad, torch.bfloat16, "x.grad")
    assert_close(probs.grad, leaves["probs"].grad, torch.bfloat16, "probs.grad")
    for i in range(8):
        assert_close(w1.grad[i], leaves[f"w1_{i}"].grad, torch.bfloat16, f"fc1 weight[{i}]")
        assert_close(w2.grad[i], leaves[f"w2_{i}"].grad, torch.bfloat16, f"fc2 weight[{i}]")


@pytest.mark.cuda
def test_graph_replay_bitwise_equal_to_eager():
    """The three kernels captured in one CUDA graph: replays with new split sizes written
    into the same device buffer equal eager calls bit for bit."""
    x, dy, w, offs = _problem([4, 0, 9, 3], 20, 64, 96)

    def run():
        return tg.triton_fprop(x, w, offs), tg.triton_dgrad(dy, w, offs), \
            tg.triton_wgrad(x, dy, offs)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for sizes in ([4, 0, 9, 3], [0, 0, 20, 0], [1, 1, 1, 1], [0, 0, 0, 0]):
        offs.copy_(torch.cumsum(torch.tensor(sizes, device=CUDA), 0))
        graph.replay()
        for got, want in zip(outs, run()):
            assert torch.equal(got, want), sizes


@pytest.mark.cuda
def test_torch_compile_fullgraph_bitwise_equal_to_eager():
    """``torch.compile(fullgraph=True)`` of the three calls: one frame, no graph break, the
    outputs equal eager bit for bit; the traced calls are the ``te_ops::`` triton_ops."""
    from torch._dynamo.testing import CompileCounterWithBackend

    x, dy, w, offs = _problem([4, 0, 9, 3], 20, 64, 96)

    def fn(x, dy, w, offs):
        return tg.triton_fprop(x, w, offs), tg.triton_dgrad(dy, w, offs), \
            tg.triton_wgrad(x, dy, offs)

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, fullgraph=True, backend=cnt)
    for got, want in zip(compiled(x, dy, w, offs), fn(x, dy, w, offs)):
        assert torch.equal(got, want)
    assert cnt.frame_count == 1


@pytest.mark.cuda
@pytest.mark.parametrize("fusion", ["1", "0"], ids=["fused", "unfused"])
def test_block_forced_triton_compiles_and_captures_bitwise(fusion, monkeypatch):
    """The existing block checks with the triton backend forced: compiled (fullgraph, default
    and reduce-overhead) and CUDA-graph replay bitwise equal to eager."""
    import test_cuda_graphs
    import test_torch_compile_cuda

    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "triton")
    for mode in ("default", "reduce-overhead"):
        test_torch_compile_cuda._check_compiled_bitwise(
            test_torch_compile_cuda._block(fusion, monkeypatch), mode)
    test_cuda_graphs.test_replay_matches_eager_bitwise(monkeypatch, fusion, torch.bfloat16)


# ------------------------------------------------------------- CPU: routing of a mixed choice
def test_mixed_choice_routes_each_gemm_kind(monkeypatch):
    """Auto with the rule satisfied (Triton's availability faked on CPU): the choice names the
    Triton kinds and says why; fprop/dgrad outside ``triton_kinds`` run in torch._grouped_mm
    (checked against the fp64 reference), wgrad inside them goes to the Triton kernel (which
    then refuses the CPU tensor with its reason)."""
    from te_ops.gemm import dispatch as grouped_gemm
    from te_ops.gemm.dispatch import grouped_dgrad, grouped_fprop, grouped_wgrad
    from te_ops.splits import make_splits

    monkeypatch.setattr(grouped_gemm, "triton_auto_reason", lambda *a: None)
    cpu = torch.device("cpu")
    choice = grouped_gemm._select_backend(cpu, torch.float32, 16, 32, True, "auto", "auto",
                                          ("wgrad",))
    assert choice.name == "triton" and choice.triton_kinds == ("wgrad",)
    assert "wgrad in Triton" in choice.reason and "fprop/dgrad in torch._grouped_mm" in \
        choice.reason
    sizes = [3, 0, 5]
    x, dy = torch.randn(10, 16), torch.randn(10, 32)
    w = torch.randn(3, 32, 16)
    splits = make_splits(torch.tensor(sizes), 3, 10, cpu)
    want = _reference(x, dy, w, sizes)
    assert_close(grouped_fprop(x, w, splits, choice), want[0], torch.float32, "fprop")
    assert_close(grouped_dgrad(dy, w, splits, choice), want[1], torch.float32, "dgrad")
    with pytest.raises(RuntimeError, match="Triton grouped GEMMs cannot run"):
        grouped_wgrad(x, dy, splits, choice)


def test_unsupported_reason_names_the_device_and_dtype_first(monkeypatch):
    """Forced ``triton`` on the CPU names the device and dtype first, also where triton is
    missing ("triton is not installed" is not why it cannot run there)."""
    from te_ops.gemm import grouped_gemm_triton as gt

    monkeypatch.setattr(gt, "triton", None)
    assert gt.unsupported_reason(torch.device("cpu"), torch.bfloat16) == (
        "device type cpu is not cuda (the Triton grouped GEMMs need a GPU)")
    assert "dtype torch.float32 is not one of" in gt.unsupported_reason(
        torch.device("cuda"), torch.float32)
    assert gt.unsupported_reason(torch.device("cuda"), torch.bfloat16) == (
        "triton is not installed")
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "triton")
    with pytest.raises(RuntimeError, match="triton cannot run: device type cpu is not cuda"):
        select_backend(torch.device("cpu"), torch.float32, 64, 64, True, rows_per_group=1.0)
