"""The torch (CPU) SwiGLU runs in L2-sized row blocks (``te_ops.basic.swiglu.CPU_BLOCK_ELEMENTS``).

The other tests' shapes fit in one block; here the block is shrunk to a few rows (with a ragged
last block) so that the block loop itself is tested: forward and backward against the
independent fp64 reference, the fused grouped MLP's four fused/unfused combinations still
bit-identical, and gradcheck in float64.
"""

from __future__ import annotations

import pytest
import reference as ref
import test_basic_ops
import test_fused_grouped_mlp
import torch

import te_ops
from te_ops.basic import swiglu


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """One intra-op thread (blocks are used only then) and blocks of 3 rows at 4 columns per
    half (fewer rows at the wider halves here; no alignment), so most shapes end in a ragged
    block."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setattr(swiglu, "CPU_BLOCK_ELEMENTS", 12)
    monkeypatch.setattr(swiglu, "CPU_BLOCK_ALIGN", 1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cpu")


def test_blocks_cover_the_rows():
    # Several blocks (ragged last one) on the CPU, in order; one block on other devices.
    for rows, half in ((0, 4), (1, 4), (7, 4), (9, 2), (5, 100)):
        blk = swiglu._Blocks(torch.zeros(rows, 2 * half), None, None)
        parts = blk.split(torch.arange(rows))
        assert torch.equal(torch.cat(parts), torch.arange(rows)), (rows, half)
        assert len(parts) == len(blk.split(None)) == max(1, -(-rows // blk.step))
        assert rows <= blk.step or len(parts) > 1
    assert swiglu._block_rows(7, 4, torch.device("meta")) == 7
    torch.set_num_threads(2)  # several intra-op threads: one block
    assert swiglu._block_rows(7, 4, torch.device("cpu")) == 7


@pytest.mark.parametrize("with_output", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("interleave", [None, 2])
def test_backward_with_output_matches_forward(dtype, interleave, with_output):
    # The fused backward's recomputed output is bitwise the forward's, block by block; the
    # gradients match the fp64 reference.
    torch.manual_seed(0)
    x = (2 * torch.randn(2, 5, 16)).to(dtype)
    probs = torch.rand(2, 5, dtype=torch.promote_types(dtype, torch.float32))
    dy = torch.randn(2, 5, 8).to(dtype)
    y = swiglu.swiglu_forward(x, interleave, probs)
    res = swiglu.swiglu_backward(x, dy, interleave, probs, with_output=with_output)
    if with_output:
        assert torch.equal(res[2], y)
    leaves = {"x": ref.leaf(x), "probs": ref.leaf(probs)}
    out, grads = ref.forward_backward(
        lambda t: ref.scaled_swiglu(t["x"], t["probs"], interleave), leaves, dy)
    ref.assert_close(y, out, dtype, "output")
    ref.assert_close(res[0], grads["x"], dtype, "grad of input")
    ref.assert_close(res[1], grads["probs"], dtype, "grad of probs")
    # Written over the inputs (as the fused backward does): the same values, bitwise.
    x_in, dy_in = x.clone(), dy.clone()
    res_in = swiglu.swiglu_backward(x_in, dy_in, interleave, probs, with_output=with_output,
                                    grad_into_input=True, output_into_grad=True)
    for want, got in zip(res, res_in):
        assert torch.equal(want, got)
    assert res_in[0].data_ptr() == x_in.data_ptr()
    if with_output:
        assert res_in[2].data_ptr() == dy_in.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize(("half", "interleave"), [(40, None), (40, 4), (20, 4), (7, 7),
                                                  (130, None), (96, 32)])
def test_blocks_bitwise_equal_to_one_block(monkeypatch, dtype, half, interleave):
    # aten's contiguous elementwise loops round their scalar remainder differently from the
    # vector steps (silu: 1 ulp), so ragged blocks made the values depend on the block size
    # (and eager differ from torch.compile's one block). Aligned blocks: bitwise one block's.
    monkeypatch.setattr(swiglu, "CPU_BLOCK_ALIGN", 64)
    torch.manual_seed(half)
    rows = 301
    x = (4 * torch.randn(rows, 2 * half)).to(dtype)
    probs = torch.rand(rows)
    dy = torch.randn(rows, half).to(dtype)
    results = {}
    for elements in (100, 10**12):  # several blocks; one block
        monkeypatch.setattr(swiglu, "CPU_BLOCK_ELEMENTS", elements)
        step = swiglu._block_rows(rows, half, x.device)
        assert (step * half) % 64 == 0 or step >= rows
        y = swiglu.swiglu_forward(x, interleave, probs)
        grads = swiglu.swiglu_backward(x.clone(), dy.clone(), interleave, probs,
                                       with_output=True, grad_into_input=True,
                                       output_into_grad=True)
        results[elements] = (step, y, *grads)
    (step, *blocked), (whole, *one) = results.values()
    assert step < rows and whole >= rows
    for name, a, b in zip(("output", "grad_x", "grad_probs", "recomputed output"), blocked, one):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("rows", [301, 5, 1])
def test_blocks_bitwise_equal_plain_whole_tensor_ops(monkeypatch, with_probs, rows):
    # What the block loop computes, pinned element for element: the sequence of whole-tensor
    # torch ops below (the loop calls silu / silu_backward through their C bindings and
    # reuses per-row-count scratch views; the values must stay these). fp32, 5-row blocks
    # (ragged last one at 301 rows), every pass of the fused backward.
    monkeypatch.setattr(swiglu, "CPU_BLOCK_ALIGN", 64)
    monkeypatch.setattr(swiglu, "CPU_BLOCK_ELEMENTS", 5 * 64)
    half = 64
    torch.manual_seed(rows)
    x = 4 * torch.randn(rows, 2 * half)
    dy = torch.randn(rows, half)
    probs = torch.rand(rows) if with_probs else None
    assert swiglu._block_rows(rows, half, x.device) == 5
    a, b = x[:, :half], x[:, half:]
    silu = torch.nn.functional.silu(a)
    silu_b = silu * b
    p = None if probs is None else probs[:, None]
    want_y = silu_b if p is None else silu_b * p
    dy_p = dy if p is None else dy * p
    want_ga = torch.ops.aten.silu_backward(dy_p * b, a)
    want_gb = dy_p * silu
    y = swiglu.swiglu_forward(x, None, probs)
    grad_x, grad_probs, out = swiglu.swiglu_backward(x.clone(), dy.clone(), None, probs,
                                                     with_output=True, grad_into_input=True,
                                                     output_into_grad=True)
    assert torch.equal(y, want_y) and torch.equal(out, want_y)
    assert torch.equal(grad_x[:, :half], want_ga) and torch.equal(grad_x[:, half:], want_gb)
    if probs is None:
        assert grad_probs is None
    else:
        assert torch.equal(grad_probs, (silu_b * dy).sum(-1))


def test_scratch_views_per_row_count():
    # Full blocks share the scratch buffers themselves; the ragged last block gets views of
    # their first rows (same storage), made once and reused while the row count holds.
    sc = swiglu._Scratch(5, 3, torch.float32, torch.device("cpu"))
    whole, tail = sc.of_rows(5), sc.of_rows(2)
    assert whole.silu.shape == (5, 3) and tail.silu.shape == (2, 3)
    assert tail.silu.data_ptr() == whole.silu.data_ptr()
    assert sc.of_rows(5) is whole and sc.of_rows(2) is tail and sc.of_rows(2).silu is tail.silu
    assert sc.of_rows(3).rows == 3 and whole.dy_b is not whole.silu
    with pytest.raises(AttributeError):
        whole._private  # noqa: B018


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_second_backward_through_retained_graph(monkeypatch, fused):
    # The fused backward writes dh over the activation's saved input (CPU too): a second
    # backward raises torch's in-place error instead of reading dh; unfused it still works.
    monkeypatch.setenv("TE_OPS_FUSION_OFF", "" if fused else "grouped_mlp_backward")
    torch.manual_seed(0)
    blk = te_ops.Sequential(te_ops.GroupedLinear(2, 8, 16), te_ops.ScaledSwiGLU(),
                            te_ops.GroupedLinear(2, 8, 8))
    x = torch.randn(7, 8, requires_grad=True)
    probs = torch.rand(7, requires_grad=True)
    split = torch.tensor([3, 4])
    y = blk(x, split, probs, split)
    dy = torch.randn_like(y)
    y.backward(dy, retain_graph=True)
    first = x.grad.clone()
    if fused:
        with pytest.raises(RuntimeError, match="inplace operation"):
            y.backward(dy)
    else:
        y.backward(dy)
        torch.testing.assert_close(x.grad, 2 * first)


# The existing reference, gradcheck and four-way tests, run again with small blocks.
test_swiglu_matches_reference = test_basic_ops.test_swiglu_matches_reference
test_gradcheck_scaled_swiglu = test_basic_ops.test_gradcheck_scaled_swiglu
test_four_combinations_bit_identical = test_fused_grouped_mlp.test_four_combinations_bit_identical


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("dtype", "interleave"), [(torch.float32, 4), (torch.float32, None),
                                                   (torch.bfloat16, 4)])
def test_eager_matches_compiled(monkeypatch, threads, dtype, interleave):
    # torch.compile traces the SwiGLU as one block of functional ops; eager runs it in row
    # blocks (one thread) with out= ops: the block MLP's output and gradients agree bitwise.
    # They did not with ragged blocks, nor (any thread count) while the interleaved backward
    # wrote silu_backward into a strided half of a scratch buffer.
    torch.set_num_threads(threads)  # the fixture restores it
    monkeypatch.setattr(swiglu, "CPU_BLOCK_ALIGN", 64)
    monkeypatch.setattr(swiglu, "CPU_BLOCK_ELEMENTS", 20)
    case = test_fused_grouped_mlp.Case(hidden=16, ffn=40, out=8, sizes=(10, 20, 37), lead=(77,),
                                       interleave=interleave)
    torch.manual_seed(0)
    inp = test_fused_grouped_mlp.make_inputs(case, dtype, "tensor")
    inp.x.data.mul_(3)
    torch.manual_seed(5)
    blk = test_fused_grouped_mlp.make_block(case, dtype)
    eager = test_fused_grouped_mlp.run(blk, case, inp)
    params = dict(blk.named_parameters())
    for p in params.values():
        p.grad = None
    torch._dynamo.reset()
    y, grads = test_fused_grouped_mlp.run(torch.compile(blk, backend="aot_eager",
                                                        fullgraph=True), case, inp)
    grads = {k.removeprefix("_orig_mod."): g for k, g in grads.items()}
    test_fused_grouped_mlp.assert_bitwise(eager, (y, grads), "compiled vs eager")


@pytest.mark.parametrize("shape", [(3, 2, 0), (0, 2, 0), (2, 0, 4), (5, 0)])
def test_zero_width_and_empty_nd_inputs(shape):
    # (..., 0) inputs: the blocks' 2-D view named its rows explicitly (reshape(-1, 0) of an
    # N-D input raised "ambiguous"); output, grads of x and probs have the input's shapes.
    op = te_ops.ScaledSwiGLU()
    x = torch.randn(*shape, requires_grad=True)
    probs = torch.rand(shape[:-1], requires_grad=True)
    y = te_ops.Sequential(op)(x, probs)
    assert y.shape == (*shape[:-1], shape[-1] // 2)
    y.backward(torch.randn_like(y))
    assert x.grad.shape == x.shape and probs.grad.shape == probs.shape
    assert torch.equal(probs.grad, torch.zeros_like(probs))


@pytest.mark.parametrize("probs", [False, True])
def test_backward_block_traces_fullgraph(probs):
    """Dynamo traces a backward block (``torch.compile`` of code calling it, compiled
    autograd of a backward): every op of the block, ``silu_backward`` included, is one Dynamo
    can trace (a raw C++ op object is "marked as skipped": a graph break, an error with
    ``fullgraph=True``); the traced block equals the eager one bit for bit."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    a, b, dy = (torch.randn(4, 8, generator=gen) for _ in range(3))
    p = torch.rand(4, 1, generator=gen) if probs else None

    def block(a, b, dy, p):
        s = swiglu._Scratch(4, 8, torch.float32, a.device).of_rows(4)
        ga, gb = torch.empty_like(a), torch.empty_like(b)
        gp = torch.empty(4) if p is not None else None
        out = torch.empty_like(a)
        swiglu._backward_block(a, b, dy, p, ga, gb, gp, out, s)
        return ga, gb, gp, out

    got = torch.compile(block, fullgraph=True, backend="eager")(a, b, dy, p)
    want = block(a, b, dy, p)
    for g, w in zip(got, want):
        assert (g is None and w is None) or torch.equal(g, w)
