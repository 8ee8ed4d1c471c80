"""Grouped GEMM operands whose own strides or data pointer are not 16-byte aligned (views of a
larger buffer, as ``torch.split`` and checkpoint loaders give): the weights, the input and the
output gradient of fc1 and fc2, packed and per-expert, fused and unfused, on the CPU
``torch._grouped_mm`` backend. Each such operand is copied to an aligned tensor
(``gemm.dispatch.grouped_mm_operands``): results equal the contiguous operands' bit for
bit and the float64 reference; ``explain()`` names the copied forward operand."""

from __future__ import annotations

import pytest
import reference as ref
import torch

import te_ops
from te_ops.gemm.dispatch import grouped_mm_operand_reason, grouped_mm_operands

E, H, F = 3, 16, 8
SIZES = [4, 0, 5]
ROWS = 10  # one padding row


def _misaligned_view(t: torch.Tensor, how: str) -> torch.Tensor:
    """A view with ``t``'s values: ``"stride"``, rows padded by one element (the last dim of a
    wider buffer, as torch.split along it gives); ``"pointer"``, one element past an aligned
    start (as a checkpoint loader's slice of a flat buffer)."""
    if how == "stride":
        buf = torch.zeros(*t.shape[:-1], t.shape[-1] + 1, dtype=t.dtype)
        view = buf[..., :t.shape[-1]]
    else:
        buf = torch.zeros(t.numel() + 1, dtype=t.dtype)
        view = buf[1:].view(t.shape)
    view.copy_(t.detach())
    return view


def _block(single: bool) -> te_ops.Sequential:
    torch.manual_seed(0)
    return te_ops.Sequential(
        te_ops.GroupedLinear(E, H, 2 * F, single_grouped_weight=single),
        te_ops.ScaledSwiGLU(),
        te_ops.GroupedLinear(E, F, H, single_grouped_weight=single))


def _set_weights(op: te_ops.GroupedLinear, how: str) -> None:
    """Replace op's weights by misaligned views holding the same values."""
    if op.single_grouped_weight:
        op.weight = torch.nn.Parameter(_misaligned_view(op.weight, how))
    else:
        for g, w in enumerate(op.weights()):
            setattr(op, f"weight{g}", torch.nn.Parameter(_misaligned_view(w, how)))


def _run(block, x, probs, dy):
    x = x.detach().clone().requires_grad_()
    probs = probs.detach().clone().requires_grad_()
    sizes = torch.tensor(SIZES)
    y = block(x, sizes, probs, sizes)
    y.backward(dy)
    return y.detach(), x.grad, probs.grad, [p.grad for p in block.parameters()]


def _equal(a, b) -> None:
    for u, v in zip(a[:3], b[:3]):
        assert torch.equal(u, v)
    assert len(a[3]) == len(b[3]) and all(torch.equal(u, v) for u, v in zip(a[3], b[3]))


def test_torch_grouped_mm_rejects_the_reported_view():
    """The reported case: torch's own error for a packed weight whose rows are padded."""
    w = _misaligned_view(torch.randn(E, 2 * F, H), "stride")
    offs = torch.tensor([4, 4, 9], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="strides should be multiple of 16 bytes"):
        torch._grouped_mm(torch.randn(9, H), w.transpose(-2, -1), offs=offs)
    assert "16-byte aligned leading stride" in grouped_mm_operand_reason("weight", w)


@pytest.mark.parametrize("how", ["stride", "pointer"])
@pytest.mark.parametrize("layer", [0, 2], ids=["fc1", "fc2"])
@pytest.mark.parametrize("fusion", ["0", "1"], ids=["unfused", "fused"])
@pytest.mark.parametrize("single", [True, False], ids=["packed", "per_expert"])
def test_misaligned_weight_views_run_and_match(single, fusion, layer, how, use_backend,
                                               monkeypatch):
    use_backend("grouped_mm", "cpu", torch.float32, (H, 2 * F), (F, H))
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    x, probs, dy = torch.randn(ROWS, H), torch.rand(ROWS) + 0.5, torch.randn(ROWS, H)
    want = _run(_block(single), x, probs, dy)
    block = _block(single)
    _set_weights(block[layer], how)
    got = _run(block, x, probs, dy)
    _equal(got, want)
    out, grads = ref.block_forward_backward(block, E, SIZES, x, probs, dy)
    ref.assert_close(got[0], out, torch.float32, "output")
    ref.assert_close(got[1], grads["x"], torch.float32, "grad of x")
    explained = block.explain()
    if single:  # per-expert views are stacked into a new tensor (a copy that is aligned)
        assert "grouped GEMM operands: weight" in explained and "copied" in explained


@pytest.mark.parametrize("how", ["stride", "pointer"])
@pytest.mark.parametrize("fusion", ["0", "1"], ids=["unfused", "fused"])
def test_misaligned_input_and_output_gradient_views(fusion, how, use_backend, monkeypatch):
    """x (fc1's fprop and wgrad operand) and dy (fc2's dgrad and wgrad operand) as views."""
    use_backend("grouped_mm", "cpu", torch.float32, (H, 2 * F), (F, H))
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    x, probs, dy = torch.randn(ROWS, H), torch.rand(ROWS) + 0.5, torch.randn(ROWS, H)
    want = _run(_block(True), x, probs, dy)
    block = _block(True)
    x_view = _misaligned_view(x, how).requires_grad_()
    probs_ = probs.clone().requires_grad_()
    sizes = torch.tensor(SIZES)
    y = block(x_view, sizes, probs_, sizes)
    y.backward(_misaligned_view(dy, how))
    _equal((y.detach(), x_view.grad, probs_.grad, [p.grad for p in block.parameters()]), want)


def test_expanded_output_gradient(use_backend):
    """``y.sum().backward()``: dy is an expanded (zero-stride) tensor; dgrad and wgrad copy
    it."""
    use_backend("grouped_mm", "cpu", torch.float32, (H, F))
    lin = te_ops.GroupedLinear(E, H, F)
    x = torch.randn(ROWS, H, requires_grad=True)
    lin(x, SIZES).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    grad_w, lin.weight.grad = lin.weight.grad, None
    lin(x2, SIZES).backward(torch.ones(ROWS, F))
    assert torch.equal(x.grad, x2.grad) and torch.equal(grad_w, lin.weight.grad)


def test_operand_reason_cases():
    t = torch.randn(4, 8)
    assert grouped_mm_operand_reason("x", t) is None
    assert grouped_mm_operand_reason("x", t.t()) is None  # column-major: torch takes it
    assert "strides" in grouped_mm_operand_reason("x", torch.ones(1, 8).expand(4, 8))
    assert "data pointer" in grouped_mm_operand_reason("x", torch.randn(33)[1:].view(4, 8))
    w = torch.randn(3 * 4 * 8 + 4)[:96].view(3, 4, 8)
    assert grouped_mm_operand_reason("w", w) is None
    odd_batch = torch.randn(3, 4 * 8 + 1)[:, :32].view(3, 4, 8)
    assert "batch stride" in grouped_mm_operand_reason("w", odd_batch)
    (fixed,), reasons = grouped_mm_operands(("w", odd_batch))
    assert torch.equal(fixed, odd_batch) and fixed.is_contiguous() and len(reasons) == 1
    (same,), none = grouped_mm_operands(("x", t))
    assert same is t and none == []
