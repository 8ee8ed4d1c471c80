"""The Triton row gather of the routing (``te_ops/kernels/gather_triton.py``) on CUDA, against
references written here: one index per row equals torch's masked gather bit for bit; K indices
per row equal an fp32 sum in index order rounded once; a float64 per-row loop bounds both.
Also: empty rows, hidden not a multiple of the block, every entry empty,
``torch.compile(fullgraph=True)`` and CUDA graph replay."""

from __future__ import annotations

import pytest
import torch

from te_ops.kernels import gather_triton

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _problem(s: int, m: int, k: int, h: int, dtype: torch.dtype, empty: float = 0.2):
    gen = torch.Generator(device="cuda").manual_seed(s * 7 + m + k + h)
    src = torch.randn(s, h, device="cuda", generator=gen).to(dtype)
    index = torch.randint(0, s, (m, k), device="cuda", generator=gen)
    drop = torch.rand(m, k, device="cuda", generator=gen) < empty
    return src, torch.where(drop, s, index)  # entry s: an empty slot


def _fp32_in_order(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    padded = torch.cat([src, src.new_zeros(1, src.shape[1])])
    acc = padded[index[:, 0]].float()
    for j in range(1, index.shape[1]):
        acc = acc + padded[index[:, j]].float()
    return acc.to(src.dtype)


def _float64_loop(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(index.shape[0], src.shape[1], dtype=torch.float64)
    s, idx = src.double().cpu(), index.cpu()
    for m in range(idx.shape[0]):
        for r in idx[m].tolist():
            if r < s.shape[0]:
                out[m] += s[r]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("h", [64, 1000, 2048])
def test_gather_rows_sum_matches_references(dtype, k, h):
    src, index = _problem(50, 37, k, h, dtype)
    got = gather_triton.gather_rows_sum(src, index)
    if k == 1:
        want = torch.where((index[:, 0] < 50)[:, None], src[index[:, 0].clamp(max=49)], 0)
        assert torch.equal(got, want)
        assert torch.equal(gather_triton.gather_rows_sum(src, index[:, 0]), want)
    assert torch.equal(got, _fp32_in_order(src, index))
    ref = _float64_loop(src, index)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert (got.double().cpu() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


def test_gather_rows_sum_edge_shapes():
    src, index = _problem(8, 0, 3, 16, torch.bfloat16)
    assert gather_triton.gather_rows_sum(src, index).shape == (0, 16)
    src, index = _problem(8, 5, 2, 16, torch.bfloat16)
    everything_empty = torch.full_like(index, 8)
    assert not gather_triton.gather_rows_sum(src, everything_empty).any()
    no_src = torch.empty(0, 16, device="cuda", dtype=torch.bfloat16)
    assert not gather_triton.gather_rows_sum(no_src, torch.zeros(4, 2, dtype=torch.int64,
                                                                 device="cuda")).any()
    # a non-contiguous source is read as its contiguous copy
    wide = torch.randn(6, 32, device="cuda", dtype=torch.bfloat16)
    idx = torch.tensor([[5, 0], [6, 2]], device="cuda")
    assert torch.equal(gather_triton.gather_rows_sum(wide[:, ::2], idx),
                       _fp32_in_order(wide[:, ::2].contiguous(), idx))


def test_gather_rows_sum_compiles_fullgraph_and_replays_in_a_cuda_graph():
    src, index = _problem(64, 48, 8, 256, torch.bfloat16)
    want = gather_triton.gather_rows_sum(src, index)
    compiled = torch.compile(gather_triton.gather_rows_sum, fullgraph=True)
    assert torch.equal(compiled(src, index), want)
    static_src, static_idx = src.clone(), index.clone()
    gather_triton.gather_rows_sum(static_src, static_idx)  # warm the launch cache
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gather_triton.gather_rows_sum(static_src, static_idx)
    src2, index2 = _problem(64, 48, 8, 256, torch.bfloat16, empty=0.5)
    static_src.copy_(src2)
    static_idx.copy_(index2)
    graph.replay()
    assert torch.equal(out, _fp32_in_order(src2, index2))


def test_unsupported_reason_names_an_index_on_another_device_and_a_src_needing_a_graph():
    src, index = _problem(8, 5, 2, 64, torch.float32)
    assert gather_triton.unsupported_reason(src, index) is None
    assert "index is on cpu" in gather_triton.unsupported_reason(src, index.cpu())
    needs_graph = src.clone().requires_grad_()
    assert "requires grad" in gather_triton.unsupported_reason(needs_graph, index)
    with torch.no_grad():
        assert gather_triton.unsupported_reason(needs_graph, index) is None


def test_routing_picks_fall_back_where_the_kernel_does_not_apply():
    from te_ops.routing import pick_sum

    src, index = _problem(8, 5, 2, 64, torch.float32)
    # a 1-D index: pick_sum sums over the rows' hidden dim, as torch's gather then sum(1)
    flat = index[:, 0]
    want = torch.where((flat < 8)[:, None], src[flat.clamp(max=7)], 0).sum(1)
    assert torch.equal(pick_sum(src, flat), want)
    # a src that requires grad keeps its graph
    leaf = src.clone().requires_grad_()
    pick_sum(leaf, index).sum().backward()
    assert leaf.grad is not None and leaf.grad.shape == src.shape
