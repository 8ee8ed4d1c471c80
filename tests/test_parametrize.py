"""``torch.nn.utils.parametrize`` on GroupedLinear weights (LoRA on stacked experts, as PEFT
does for MoE models), in both parameter layouts: forward and gradients (of the input, probs,
the parametrization's ``original`` and its own parameters, the other parameters) against the
float64 reference with the parametrization applied by hand; fused and unfused, eager and
``torch.compile(fullgraph=True)``; ``torch.func.functional_call`` on parametrized layers."""

from __future__ import annotations

import pytest
import reference as ref
import torch
from torch.nn.utils import parametrize

import te_ops

E, H, F, RANK = 3, 16, 8, 2
SIZES = [3, 0, 5]  # an empty expert
ROWS = 9  # one padding row


class LowRank(torch.nn.Module):
    """``W + B @ A`` (LoRA) for a weight of shape (*lead, out, in)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        *lead, out, inp = shape
        self.lora_a = torch.nn.Parameter(torch.randn(*lead, RANK, inp) * 0.3)
        self.lora_b = torch.nn.Parameter(torch.randn(*lead, out, RANK) * 0.3)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + self.lora_b @ self.lora_a


def _block(single: bool) -> te_ops.Sequential:
    """fc1 -> ScaledSwiGLU -> fc2 with fc1's and fc2's weights parametrized (per-expert
    layout: expert 1's weight only, so parametrized and plain experts mix)."""
    block = te_ops.Sequential(
        te_ops.GroupedLinear(E, H, 2 * F, single_grouped_weight=single),
        te_ops.ScaledSwiGLU(),
        te_ops.GroupedLinear(E, F, H, single_grouped_weight=single))
    for op in (block[0], block[2]):
        name = "weight" if single else "weight1"
        parametrize.register_parametrization(op, name, LowRank(tuple(getattr(op, name).shape)))
    return block


def _weights_by_hand(lv: dict, prefix: str, single: bool) -> list[torch.Tensor]:
    """The op's per-expert weights from the float64 leaves, parametrization applied by hand."""
    def by_hand(name: str) -> torch.Tensor:
        p = f"{prefix}parametrizations.{name}."
        return lv[p + "original"] + lv[p + "0.lora_b"] @ lv[p + "0.lora_a"]

    if single:
        return list(by_hand("weight").unbind(0))
    return [by_hand("weight1") if g == 1 else lv[f"{prefix}weight{g}"] for g in range(E)]


def _check_block(block: te_ops.Sequential, single: bool, x, probs, y) -> None:
    dy = torch.randn_like(y)
    y.backward(dy)
    leaves = {"x": ref.leaf(x), "probs": ref.leaf(probs)}
    leaves.update({n: ref.leaf(p) for n, p in block.named_parameters()})

    def fn(lv):
        return ref.grouped_mlp(lv["x"], SIZES, lv["probs"], _weights_by_hand(lv, "0.", single),
                               ref.expert_params(lv, "0.", "bias", E),
                               _weights_by_hand(lv, "2.", single),
                               ref.expert_params(lv, "2.", "bias", E))

    out, grads = ref.forward_backward(fn, leaves, dy)
    ref.assert_close(y, out, torch.float32, "output")
    ref.assert_close(x.grad, grads["x"], torch.float32, "grad of x")
    ref.assert_close(probs.grad, grads["probs"], torch.float32, "grad of probs")
    names = [n for n, _ in block.named_parameters()]
    assert any("lora_a" in n for n in names) and any("original" in n for n in names)
    for n, p in block.named_parameters():
        assert p.grad is not None, f"{n}: no gradient"
        ref.assert_close(p.grad, grads[n], torch.float32, f"grad of {n}")


@pytest.mark.parametrize("fusion", ["0", "1"], ids=["unfused", "fused"])
@pytest.mark.parametrize("single", [True, False], ids=["packed", "per_expert"])
def test_parametrized_weights_match_reference(single, fusion, monkeypatch):
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = _block(single)
    x = torch.randn(ROWS, H, requires_grad=True)
    probs = (torch.rand(ROWS) + 0.5).requires_grad_()
    for _ in range(2):  # a second call recomputes the parametrization (nothing kept)
        for p in block.parameters():
            p.grad = None
        x.grad = probs.grad = None
        y = block(x, SIZES, probs, SIZES)
        _check_block(block, single, x, probs, y)


@pytest.mark.parametrize("fusion", ["0", "1"], ids=["unfused", "fused"])
@pytest.mark.parametrize("single", [True, False], ids=["packed", "per_expert"])
def test_parametrized_weights_compile_fullgraph(single, fusion, monkeypatch):
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = _block(single)
    x = torch.randn(ROWS, H, requires_grad=True)
    probs = (torch.rand(ROWS) + 0.5).requires_grad_()
    sizes = torch.tensor(SIZES)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    y = compiled(x, sizes, probs, sizes)
    _check_block(block, single, x, probs, y)
    # a changed LoRA parameter reaches the compiled call (it is a graph input, not a constant)
    with torch.no_grad():
        block[0].parametrizations["weight" if single else "weight1"][0].lora_a.add_(1.0)
    torch.testing.assert_close(compiled(x, sizes, probs, sizes), block(x, SIZES, probs, SIZES),
                               rtol=0, atol=0)


@pytest.mark.parametrize("single", [True, False], ids=["packed", "per_expert"])
def test_parametrized_weight_functional_call(single):
    """functional_call with the parametrization's ``original`` and LoRA parameters replaced
    equals the layer holding those values."""
    block = _block(single)
    fc1 = block[0]
    name = "weight" if single else "weight1"
    x = torch.randn(ROWS, H)
    values = {f"parametrizations.{name}.original": torch.randn_like(
                  fc1.parametrizations[name].original),
              f"parametrizations.{name}.0.lora_a": torch.zeros_like(
                  fc1.parametrizations[name][0].lora_a)}
    got = torch.func.functional_call(fc1, values, (x, SIZES))
    with torch.no_grad():
        fc1.parametrizations[name].original.copy_(values[f"parametrizations.{name}.original"])
        fc1.parametrizations[name][0].lora_a.zero_()
    torch.testing.assert_close(got, fc1(x, SIZES), rtol=0, atol=0)
    # lora_a = 0: the parametrized weight is the original
    torch.testing.assert_close(getattr(fc1, name), fc1.parametrizations[name].original)


def test_functional_call_unparametrized_weight():
    """The plain path: functional_call swaps the packed weight."""
    lin = te_ops.GroupedLinear(E, H, F)
    x = torch.randn(ROWS, H)
    w = torch.randn_like(lin.weight)
    got = torch.func.functional_call(lin, {"weight": w}, (x, SIZES))
    with torch.no_grad():
        lin.weight.copy_(w)
    torch.testing.assert_close(got, lin(x, SIZES), rtol=0, atol=0)


@pytest.mark.parametrize("option", ["accumulate_into_main_grad", "delay_wgrad_compute"])
def test_parametrized_weight_with_main_grad_options_raises(option):
    lin = te_ops.GroupedLinear(E, H, F, **{option: True})
    parametrize.register_parametrization(lin, "weight", LowRank(tuple(lin.weight.shape)))
    if option == "accumulate_into_main_grad":
        lin.parametrizations.weight.original.main_grad = torch.zeros_like(lin.weight)
    x = torch.randn(ROWS, H, requires_grad=True)
    with pytest.raises(NotImplementedError, match="torch.nn.utils.parametrize"):
        lin(x, SIZES).sum().backward()


def test_reset_parameters_reaches_parametrized_original():
    lin = te_ops.GroupedLinear(E, H, F)
    parametrize.register_parametrization(lin, "weight", LowRank(tuple(lin.weight.shape)))
    with torch.no_grad():
        lin.parametrizations.weight.original.zero_()
    lin.reset_parameters()
    assert lin.parametrizations.weight.original.abs().sum() > 0
