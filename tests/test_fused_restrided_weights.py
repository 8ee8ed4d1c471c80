"""The fused grouped MLP with per-expert weights whose data is re-pointed between calls, and
the PAIRED fc1 + SwiGLU persistent kernel's routing (a rules row): against the independent
fp64 reference of ``tests/reference.py``.
"""

from __future__ import annotations

import pytest
import torch
from gemm_force import FC1_FUSED_ANY, NO_FC1_FUSED, with_rows
from block_replay import fwd_bwd_step
from reference import grouped_mlp, leaf

import te_ops

H, FF = 16, 8  # fc1's weights (2 FF, H) are square: a transpose keeps their shape
GROUPS = 8


def _block() -> te_ops.Sequential:
    torch.manual_seed(0)
    kw = {"single_grouped_weight": False, "bias": False}
    return te_ops.Sequential(te_ops.GroupedLinear(GROUPS, H, 2 * FF, **kw),
                             te_ops.ScaledSwiGLU(), te_ops.GroupedLinear(GROUPS, FF, H, **kw))


def _inputs():
    gen = torch.Generator().manual_seed(1)
    sizes = torch.tensor([3, 0, 4, 1, 2, 5, 0, 3])
    rows = int(sizes.sum())
    x = torch.randn(rows, H, generator=gen).requires_grad_()
    probs = torch.rand(rows, generator=gen).requires_grad_()
    return x, probs, sizes


def _warmed():
    """The block and its inputs after two steps (the stacked weight view remembered):
    ``(block, x, probs, split)``."""
    block = _block()
    x, probs, split = _inputs()
    for _ in range(2):
        fwd_bwd_step(block, x, probs, split)
    return block, x, probs, split


def _check_step_against_reference(block, x, probs, split, ws) -> None:
    """One more step: the output within 1e-5 of the fp64 reference with fc1's weights ``ws``
    (as the test left them) and fc2's."""
    out, _, node = fwd_bwd_step(block, x, probs, split)
    assert node == "_FuserFunctionBackward"
    expected = grouped_mlp(leaf(x), split, leaf(probs), [leaf(w) for w in ws], None,
                           [leaf(w) for w in block[2].weights()], None)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", [(5,), (0,), tuple(range(GROUPS))])
def test_weight_restrided_at_the_same_address_is_not_read_through_a_stale_view(which):
    """``weight.data = weight.data.t()`` (a square weight) keeps the data pointer, the shape
    and the dtype but not the strides: the stacked (G, N, K) view remembered by data pointers
    (``stack_weights``' memo) must not be reused, or the moved weight is read as its old
    layout (silently wrong)."""
    block, x, probs, split = _warmed()
    ws = block[0].weights()
    for g in which:
        ws[g].data = ws[g].data.t()
    _check_step_against_reference(block, x, probs, split, ws)


def test_weights_reallocated_apart_at_the_old_addresses_are_stacked_as_a_copy():
    """Every weight re-pointed to a storage of its own whose data sits at the old slice's
    address (what the CUDA caching allocator can hand out when weights are re-allocated one
    by one after the packed buffer was freed; simulated here with ``torch.from_numpy`` of the
    buffer's slices): the remembered data pointers all match, but weight0's storage no longer
    spans the G weights, so the (G, N, K) view cannot be taken (``as_strided`` raised
    "out of bounds for storage") and the weights must be stacked as a copy, with the
    reference's values."""
    block, x, probs, split = _warmed()
    ws = block[0].weights()
    ptrs = [w.data_ptr() for w in ws]
    numel = ws[0].numel()
    flat = ws[0].detach().as_strided((GROUPS, numel), (numel, 1)).numpy()
    apart = [torch.from_numpy(flat[g]).view(ws[g].shape) for g in range(GROUPS)]
    for w, t in zip(ws, apart):
        w.data = t
    assert [w.data_ptr() for w in ws] == ptrs
    assert ws[0].untyped_storage().nbytes() == numel * ws[0].element_size()
    _check_step_against_reference(block, x, probs, split, ws)


# ------------------------------------------------------------------------------------- CUDA
CUDA = torch.device("cuda")


def _sm90() -> None:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("auto runs the persistent Triton kernels on SM90 only")


def _cuda_block(scaled: bool = True, hidden: int = 256, ffn: int = 384,
                recompute: bool = False, single: bool = False) -> te_ops.Sequential:
    torch.manual_seed(0)
    kw = {"bias": False, "device": CUDA, "dtype": torch.bfloat16,
          "single_grouped_weight": single}
    act = (te_ops.ScaledSwiGLU(recompute_input=recompute) if scaled
           else te_ops.SwiGLU(recompute_input=recompute))
    return te_ops.Sequential(te_ops.GroupedLinear(8, hidden, 2 * ffn, **kw), act,
                             te_ops.GroupedLinear(8, ffn, hidden, **kw))


#: 490 of 512 rows in 8 groups (64 per group on average: fc1's fprop, fc2's dgrad and the
#: wgrads in the persistent kernels under auto on SM90 bf16), an empty group, padding rows.
CUDA_SIZES = [40, 0, 130, 64, 7, 100, 59, 90]


def _cuda_inputs(hidden: int = 256):
    gen = torch.Generator(device=CUDA).manual_seed(3)
    x = torch.randn(512, hidden, device=CUDA, dtype=torch.bfloat16, generator=gen)
    probs = torch.rand(512, device=CUDA, dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(512, hidden, device=CUDA, dtype=torch.bfloat16, generator=gen)
    return x, torch.tensor(CUDA_SIZES, device=CUDA), probs, dy


def _cuda_run(block, x, split, probs, dy):
    """y, dx, every weight's grad, probs.grad (scaled) and the output node's name."""
    x = x.detach().clone().requires_grad_(True)
    probs = probs.detach().clone().requires_grad_(True)
    scaled = isinstance(block[1], te_ops.ScaledSwiGLU)
    y = block(x, split, probs, split) if scaled else block(x, split, split)
    y.backward(dy)
    out = [y.detach().clone(), x.grad.clone(), *[p.grad.clone() for p in block.parameters()]]
    if scaled:
        out.append(probs.grad.clone())
    block.zero_grad(set_to_none=True)
    return out, type(y.grad_fn).__name__


@pytest.mark.cuda
@pytest.mark.parametrize("recompute", [False, True], ids=["saved_h", "recompute_h"])
@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "plain"])
def test_persistent_fc1_epilogue_equals_the_two_launch_pair(monkeypatch, scaled, recompute):
    """fc1 + SwiGLU in the PAIRED persistent kernel (a rules row), over three calls, and
    with ``recompute_input=True`` (the backward re-runs fc1's GEMM in the plain
    persistent fprop, so its h must be the PAIRED kernel's bit for bit): y, dx, dW1, dW2
    bitwise the two-launch pairs' (``0`` / ``0``), probs.grad within bf16 rounding."""
    _sm90()
    x, split, probs, dy = _cuda_inputs()
    with_rows(monkeypatch, first=NO_FC1_FUSED)
    want = _cuda_run(_cuda_block(scaled, recompute=recompute), x, split, probs, dy)[0]
    with_rows(monkeypatch, last=FC1_FUSED_ANY)
    block = _cuda_block(scaled, recompute=recompute)
    runs = [_cuda_run(block, x, split, probs, dy) for _ in range(3)]
    notes = block.explain()
    assert "persistent many-rows kernel, large_fc1_swiglu" in notes
    assert all(name == "_FuserFunctionBackward" for _, name in runs)
    n = len(want) - (1 if scaled else 0)
    for got, _ in runs:
        assert all(torch.equal(a, b) for a, b in zip(got[:n], want[:n]))
        if scaled:
            torch.testing.assert_close(got[-1].float(), want[-1].float(), rtol=1.6e-2,
                                       atol=1.6e-2 * want[-1].float().abs().max().item())


@pytest.mark.cuda
@pytest.mark.parametrize("which", ["first", "all"])
def test_restrided_weights_on_the_persistent_kernels(monkeypatch, which):
    """The CUDA side of the re-strided weight (``w.data = w.data.t()`` of square fc1 weights,
    hidden = 2 ffn) after warm calls: a remembered (G, N, K) view with the transposed strides
    must not reach the persistent kernels: outputs against the fp64 reference."""
    _sm90()
    with_rows(monkeypatch, first=NO_FC1_FUSED)
    block = _cuda_block(hidden=256, ffn=128)
    x, split, probs, dy = _cuda_inputs(hidden=256)
    for _ in range(2):
        _cuda_run(block, x, split, probs, dy)
    ws = block[0].weights()
    for g, w in enumerate(ws):
        if which == "all" or g == 0:
            w.data = w.data.t()
    got, node = _cuda_run(block, x, split, probs, dy)
    assert node == "_FuserFunctionBackward"
    expected = grouped_mlp(leaf(x), split, leaf(probs), [leaf(w) for w in ws], None,
                           [leaf(w) for w in block[2].weights()], None)
    torch.testing.assert_close(got[0].double(), expected, rtol=1.6e-2,
                               atol=1.6e-2 * expected.abs().max().item())
