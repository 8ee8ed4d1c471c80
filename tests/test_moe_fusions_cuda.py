"""The MoE routing fusions on the GPU: the few-rows Triton kernels' row gather and the fused
layer (``te_ops/fused/moe_routing.py``).

* The gathered launches (fprop / dgrad ``a_rows``, wgrad ``x_rows`` / ``dy_rows``, fc1 + SwiGLU
  ``a_rows``) equal the same kernels on the ``index_select``-ed copy bit for bit, in bf16.
* The fused layer equals the unfused one bit for bit (outputs, aux loss, every gradient), at a
  decode shape (few rows per group: the gathers run in the kernels' loads, ``explain()`` says
  so) and a many-rows shape (the gathers fall back to a transient copy), dropless and capacity.
* ``torch.compile(fullgraph=True)``: one graph; bitwise eager with ``aot_eager``, close with
  inductor.
* CUDA graph: forward + backward captured once, replayed on new tokens (new routings, empty
  experts), bitwise the eager step.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the MoE fusion GPU tests need a GPU (torch.cuda.is_available() is False)",
                allow_module_level=True)

import te_ops  # noqa: E402
from te_ops.gemm.grouped_gemm_triton import triton_dgrad, triton_fprop, triton_wgrad  # noqa: E402
from te_ops.gemm.grouped_mlp_triton import fc1_swiglu  # noqa: E402
from te_ops.routing import pick  # noqa: E402

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
BF16 = torch.bfloat16
ROUTING_OFF = {"TE_OPS_FUSION_OFF": "permute_fc1_forward,fc2_combine_backward"}


@pytest.mark.parametrize("rows, src_rows, groups", [(32, 16, 8), (1000, 520, 8), (0, 4, 2)])
@pytest.mark.parametrize("idt", [torch.int64, torch.int32])
def test_gathered_kernels_equal_index_select_then_the_same_kernel(rows, src_rows, groups, idt):
    gen = torch.Generator(device=DEV).manual_seed(rows)
    k, n, f = 256, 192, 128
    x_src = torch.randn(src_rows, k, device=DEV, dtype=BF16, generator=gen)
    d_src = torch.randn(src_rows, n, device=DEV, dtype=BF16, generator=gen)
    index = torch.randint(0, src_rows + 1, (rows,), device=DEV, generator=gen)  # +1: zero rows
    x, dy = pick(x_src, index), pick(d_src, index)
    index = index.to(idt)
    sizes = torch.full((groups,), rows // groups, device=DEV)
    sizes[-1] -= 3 if rows else 0  # 3 padding rows
    offs = sizes.cumsum(0)
    w = torch.randn(groups, n, k, device=DEV, dtype=BF16, generator=gen)
    assert torch.equal(triton_fprop(x_src, w, offs, a_rows=index), triton_fprop(x, w, offs))
    assert torch.equal(triton_dgrad(d_src, w, offs, a_rows=index), triton_dgrad(dy, w, offs))
    plain = triton_wgrad(x, dy, offs)
    assert torch.equal(triton_wgrad(x_src, dy, offs, x_rows=index), plain)
    assert torch.equal(triton_wgrad(x, d_src, offs, dy_rows=index), plain)
    assert torch.equal(triton_wgrad(x_src, d_src, offs, x_rows=index, dy_rows=index), plain)
    w1 = torch.randn(groups, 2 * f, k, device=DEV, dtype=BF16, generator=gen)
    p = torch.rand(rows, device=DEV, generator=gen)
    got = fc1_swiglu(x_src, w1, offs, p, a_rows=index)
    want = fc1_swiglu(x, w1, offs, p)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _moe(tokens_per_expert: float, mode: str, seed: int = 0) -> tuple[te_ops.MoE, int]:
    torch.manual_seed(seed)
    experts, top_k, hidden, ffn = 8, 2, 256, 128
    tokens = int(tokens_per_expert * experts / top_k)
    kw = {} if mode == "dropless" else {"capacity_factor": 1.0}
    moe = te_ops.MoE(hidden, ffn, experts, top_k, aux_loss_coeff=0.01, device=DEV, dtype=BF16,
                     **kw)
    return moe, tokens


def _step(fn, moe: te_ops.MoE, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    params = [p for p in moe.parameters() if p.requires_grad]
    xi = x.clone().requires_grad_()
    y, aux = fn(xi)
    grads = torch.autograd.grad((y * dy).sum() + aux, [xi, *params])
    return [y, aux, *grads]


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("mode", ["dropless", "capacity"])
@pytest.mark.parametrize("rows_per_expert", [4, 256], ids=["decode", "many_rows"])
def test_fused_layer_is_bitwise_the_unfused_layer(monkeypatch, backend, mode, rows_per_expert):
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", backend)
    moe, tokens = _moe(rows_per_expert, mode)
    x = torch.randn(tokens, 256, device=DEV, dtype=BF16)
    dy = torch.randn_like(x)
    fused = _step(moe, moe, x, dy)
    text = moe.block.explain()
    for name, value in ROUTING_OFF.items():
        monkeypatch.setenv(name, value)
    unfused = _step(moe, moe, x, dy)
    for i, (a, b) in enumerate(zip(fused, unfused)):
        assert torch.equal(a, b), f"tensor {i} differs"
    if backend == "triton" and rows_per_expert == 4:  # the few-rows kernels run every kind
        assert "fprop reads the rows by index" in text or "gathered by index in the " \
            "kernel's load" in text, text
        assert "dgrad reads the rows by index" in text and "wgrad reads the rows by index" \
            in text, text


@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_compile_fullgraph(monkeypatch, mode):
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "triton")
    moe, tokens = _moe(4, mode)
    x = torch.randn(tokens, 256, device=DEV, dtype=BF16)
    dy = torch.randn_like(x)
    eager = _step(moe, moe, x, dy)
    torch._dynamo.reset()
    got = _step(torch.compile(moe, backend="aot_eager", fullgraph=True), moe, x, dy)
    for i, (a, b) in enumerate(zip(got, eager)):
        assert torch.equal(a, b), f"aot_eager: tensor {i} differs"
    torch._dynamo.reset()
    got = _step(torch.compile(moe, fullgraph=True), moe, x, dy)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_cuda_graph_replay_is_bitwise_eager(monkeypatch, backend, mode):
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", backend)
    moe, tokens = _moe(4, mode)
    params = [p for p in moe.parameters() if p.requires_grad]
    static_x = torch.randn(tokens, 256, device=DEV, dtype=BF16, requires_grad=True)
    static_dy = torch.randn(tokens, 256, device=DEV, dtype=BF16)

    def fwd_bwd():
        y, aux = moe(static_x)
        return [y, aux, *torch.autograd.grad((y * static_dy).sum() + aux, [static_x, *params])]

    fwd_bwd()  # probes and plans before capture
    torch.cuda.set_sync_debug_mode("error")  # the fused eager step reads nothing on the host
    try:
        fwd_bwd()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fwd_bwd()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fwd_bwd()
    for seed in range(4):
        gen = torch.Generator(device=DEV).manual_seed(100 + seed)
        x = torch.randn(tokens, 256, device=DEV, dtype=BF16, generator=gen)
        if seed == 3:  # every token to a few experts: empty experts, drops with a capacity
            x = x.abs() + 0.5
            with torch.no_grad():
                moe.router.weight[:2] = 1.0
        with torch.no_grad():
            static_x.copy_(x)
        graph.replay()
        want = _step(moe, moe, x, static_dy)
        for i, (a, b) in enumerate(zip(static_out, want)):
            assert torch.equal(a, b), f"replay {seed}: tensor {i} differs"
    plan = moe.block.fusers()[0].plan()
    assert "Permute" not in [type(op).__name__ for op, _ in plan.forward_ops]
