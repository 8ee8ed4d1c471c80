"""CUDA operands, fp64 references and a graph-replay check shared by the grouped GEMM kernel
tests (``test_grouped_gemm_large_triton.py``, ``test_fc1_swiglu_paired.py``,
``test_gluon_fprop.py``, ``test_fc1_swiglu_gluon.py``) and the fc1 epilogue block tests
(``test_fc1_epilogue_large.py``, ``test_fc1_swiglu_gluon.py``).

The references are independent of the kernels under test: a per-expert
``torch.nn.functional.linear`` loop in fp64 and the SwiGLU formula (gate columns first, TE's
convention).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

CUDA = torch.device("cuda")


def grouped_operands(sizes: Sequence[int], m: int, n: int, k: int,
                     dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                     transposed: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, w, offs, probs)`` on CUDA for a grouped GEMM with split sizes ``sizes``.

    x: (m, k) ``dtype``, N(0, 1), rows from ``sum(sizes)`` on NaN (padding rows: garbage that
    must not reach the outputs); w: (G, n, k) ``dtype`` at init scale (N(0, 1) / sqrt(k)), or
    a (G, n, k) transposed view of a contiguous (G, k, n) tensor with ``transposed``; offs:
    (G,) int32 cumulative split sizes; probs: (m,) fp32 uniform on [0, 1). All drawn from one
    generator seeded with ``seed``.
    """
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(sizes)
    x = torch.randn(m, k, generator=gen, device=CUDA).to(dtype)
    x[total:] = float("nan")
    shape = (len(sizes), k, n) if transposed else (len(sizes), n, k)
    w = (torch.randn(*shape, generator=gen, device=CUDA) * k ** -0.5).to(dtype)
    w = w.transpose(1, 2) if transposed else w
    offs = torch.tensor(sizes, device=CUDA).cumsum(0).to(torch.int32)
    probs = torch.rand(m, generator=gen, device=CUDA)
    return x, w, offs, probs


def per_expert_linear_fp64(x: torch.Tensor, w: torch.Tensor,
                           sizes: Sequence[int]) -> torch.Tensor:
    """fp64 ``F.linear(x_g, w[g])`` per expert: x (rows, K), w (G, N, K) -> (rows, N) fp64,
    zero on the padding rows past ``sum(sizes)``."""
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64, device=x.device)
    start = 0
    for g, n in enumerate(sizes):
        out[start:start + n] = F.linear(x[start:start + n].double(), w[g].double())
        start += n
    return out


def swiglu_fp64(h: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    """SwiGLU of fp64 ``h`` (rows, 2F), gate columns first: ``gate * sigmoid(gate) * up``
    (rows, F), times ``probs[:, None]`` (in fp64) where given."""
    f = h.shape[1] // 2
    gate, up = h[:, :f], h[:, f:]
    a = gate * torch.sigmoid(gate) * up
    return a if probs is None else a * probs.double()[:, None]


def fp64_tolerance(dtype: torch.dtype, k: int) -> float:
    """Max abs error allowed against the fp64 reference for a reduction over ``k`` in
    ``dtype`` (bf16 2e-2, fp16 3e-3, grown with sqrt(k / 64))."""
    return (2e-2 if dtype == torch.bfloat16 else 3e-3) * max(1.0, (k / 64) ** 0.5)


def assert_replay_with_new_offsets_equal_to_eager(
        fn: Callable, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
        probs: torch.Tensor | None, new_sizes: Sequence[int] = (10, 400, 90)
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``fn(x, w, offs, probs) -> (h, a)`` run once outside the capture (compile), captured in
    a CUDA graph over a copy of ``offs``, replayed after the copy is overwritten with the
    offsets of ``new_sizes`` (same total rows): both outputs bitwise equal to eager ``fn`` at
    the new offsets. Returns the new offsets (int32 on CUDA) and the eager outputs."""
    static_offs = offs.clone()
    fn(x, w, static_offs, probs)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x, w, static_offs, probs)
    new = torch.tensor(list(new_sizes), device=CUDA).cumsum(0).to(torch.int32)
    static_offs.copy_(new)
    graph.replay()
    eager = fn(x, w, new, probs)
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])
    return new, eager


def fc1_block(groups: int = 4, h: int = 256, ffn: int = 384, scaled: bool = True):
    """``te_ops.Sequential(GroupedLinear(groups, h, 2 * ffn), ScaledSwiGLU() (SwiGLU() when not
    ``scaled``), GroupedLinear(groups, ffn, h))``, bf16 on CUDA, no bias, weights from seed 0."""
    import te_ops

    torch.manual_seed(0)
    kw = {"bias": False, "device": CUDA, "dtype": torch.bfloat16}
    act = te_ops.ScaledSwiGLU() if scaled else te_ops.SwiGLU()
    return te_ops.Sequential(te_ops.GroupedLinear(groups, h, 2 * ffn, **kw), act,
                             te_ops.GroupedLinear(groups, ffn, h, **kw))


def fc1_block_inputs(sizes: Sequence[int], rows: int, h: int = 256
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, split, probs, dy)`` for :func:`fc1_block`: x and dy (rows, h) bf16 N(0, 1), split
    sizes ``sizes`` as a CUDA tensor, probs (rows,) bf16 uniform; from a generator seeded
    with 1."""
    gen = torch.Generator(device=CUDA).manual_seed(1)
    x = torch.randn(rows, h, device=CUDA, dtype=torch.bfloat16, generator=gen)
    probs = torch.rand(rows, device=CUDA, dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(rows, h, device=CUDA, dtype=torch.bfloat16, generator=gen)
    return x, torch.tensor(sizes, device=CUDA), probs, dy
