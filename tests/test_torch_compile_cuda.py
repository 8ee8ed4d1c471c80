"""te_ops under torch.compile on the GPU: the modes, with device split sizes.

``mode="default"``, ``"max-autotune-no-cudagraphs"`` and ``"reduce-overhead"`` (CUDA graph
trees) compile the bf16 block ``GroupedLinear -> ScaledSwiGLU -> GroupedLinear`` (no bias, so
every op of the graph is a te_ops kernel: ``te_ops::grouped_mm``, the Triton SwiGLU and
padding ``triton_op``s, integer split metadata) with ``fullgraph=True``; the default mode also
with biases (their rows gathered by group id). Five routings the
trace never saw (padding rows, empty experts, all in one expert) replay the same graph: one
frame, no recompile, no cudagraph skip, and the output and every gradient bitwise equal to
an eager run. Inductor runs with ``emulate_precision_casts`` (it rounds intermediates as eager
does). Kept small: the whole file is well under a minute on an H200.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA compile tests need a GPU (torch.cuda.is_available() is False)",
                allow_module_level=True)

from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import te_ops  # noqa: E402

pytestmark = pytest.mark.cuda

E, T, H, FF = 4, 256, 64, 128
DEVICE = torch.device("cuda")
ROUTINGS = ([64, 0, 100, 60], [0, 0, 256, 0], [64, 64, 64, 64], [10, 20, 30, 40],
            [200, 0, 0, 1])


def _block(fusion: str, monkeypatch, bias: bool = False) -> te_ops.Sequential:
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    torch.manual_seed(0)
    kw = {"bias": bias, "device": DEVICE, "dtype": torch.bfloat16}
    return te_ops.Sequential(te_ops.GroupedLinear(E, H, 2 * FF, **kw), te_ops.ScaledSwiGLU(),
                             te_ops.GroupedLinear(E, FF, H, **kw))


def _step(fn, block, x, splits, probs, mark_step=False):
    if mark_step:
        torch.compiler.cudagraph_mark_step_begin()
    x = x.detach().clone().requires_grad_(True)
    probs = probs.detach().clone().requires_grad_(True)
    y = fn(x, splits, probs)
    y.backward(torch.ones_like(y))
    out = [y.detach().clone(), x.grad.clone(), probs.grad.clone(),
           *[p.grad.clone() for p in block.parameters()]]
    block.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("fusion", ["1", "0"], ids=["fused", "unfused"])
@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs", "reduce-overhead"])
def test_compiled_modes_match_eager_bitwise(mode: str, fusion: str, monkeypatch) -> None:
    _check_compiled_bitwise(_block(fusion, monkeypatch), mode)


@pytest.mark.parametrize("fusion", ["1", "0"], ids=["fused", "unfused"])
def test_biased_block_compiles_bitwise(fusion: str, monkeypatch) -> None:
    """With biases (rows gathered by group id: a ``searchsorted`` over the split table, which
    inductor mis-lowers for a sliced boundaries view, pytorch/pytorch#182343) the compiled
    block equals eager bitwise over every routing, padding rows and empty experts included."""
    _check_compiled_bitwise(_block(fusion, monkeypatch, bias=True), "default")


def _check_compiled_bitwise(block: te_ops.Sequential, mode: str,
                            one_inductor_graph: bool = True) -> None:
    """Compile ``block`` in ``mode`` (fullgraph) and check every routing of ``ROUTINGS``
    against eager, bitwise: one frame, no graph break, no cudagraph skip (and, with
    ``one_inductor_graph``, one inductor graph in the non-default modes)."""

    def fn(x, s, p):
        return block(x, s, p, s)

    torch._dynamo.reset()
    counters.clear()
    cnt = CompileCounterWithBackend("inductor")
    with torch._inductor.config.patch(emulate_precision_casts=True):
        compiled = torch.compile(fn, fullgraph=True, mode=mode) if mode != "default" else \
            torch.compile(fn, fullgraph=True, backend=cnt)
        for sizes in ROUTINGS:
            x = torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16)
            probs = torch.rand(T, device=DEVICE, dtype=torch.bfloat16)
            splits = torch.tensor(sizes, device=DEVICE)
            ref = _step(fn, block, x, splits, probs)
            got = _step(compiled, block, x, splits, probs, mark_step=mode == "reduce-overhead")
            for i, (a, b) in enumerate(zip(got, ref)):
                assert torch.equal(a, b), f"{mode}: tensor {i} differs for routing {sizes}"
    assert not counters["graph_break"]
    assert counters["inductor"]["cudagraph_skips"] == 0
    if mode == "default":
        assert cnt.frame_count == 1
    elif one_inductor_graph:
        assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("fusion", ["1", "0"], ids=["fused", "unfused"])
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_fp8_recipe_compiles_bitwise(mode: str, fusion: str, monkeypatch) -> None:
    """Under ``Float8CurrentScaling`` (native FP8 GEMMs, the Triton quantize kernels) the block
    compiles with ``fullgraph=True`` into one graph (no break, no cudagraph skip) and every
    routing's output and gradients are bitwise equal to eager FP8."""
    from te_ops.quantization.gemm import native_unsupported_reason
    from te_ops.recipe import Float8CurrentScaling

    reason = native_unsupported_reason("fp8", DEVICE, torch.bfloat16, (H, 2 * FF))
    if reason is not None:
        pytest.skip(f"native FP8 GEMMs not available here: {reason}")
    with te_ops.autocast(recipe=Float8CurrentScaling()):
        _check_compiled_bitwise(_block(fusion, monkeypatch), mode, one_inductor_graph=False)
