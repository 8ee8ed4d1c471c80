"""A new user's CPU checks of training-loop integration and input validation (stop 16):
each test is a fault a user hit, compared against the independent fp64 reference."""

from __future__ import annotations

import pytest
import reference as ref
import torch

import te_ops

E, H, FF = 4, 16, 24


def _block(scale_bias: bool = False) -> te_ops.Sequential:
    torch.manual_seed(0)
    return te_ops.Sequential(
        te_ops.GroupedLinear(E, H, 2 * FF, scale_bias=scale_bias), te_ops.ScaledSwiGLU(),
        te_ops.GroupedLinear(E, FF, H, scale_bias=scale_bias))


@pytest.mark.parametrize("fusion", ["0", "1"])
@pytest.mark.parametrize("kind", ["list", "tensor"])
@pytest.mark.parametrize("missing, scale_bias, name", [
    (1, False, "probs"), (0, True, "fc1 probs"), (1, True, "probs"), (2, True, "fc2 probs")])
def test_missing_probs_is_an_error_on_the_fused_path_too(monkeypatch, fusion, kind, missing,
                                                         scale_bias, name):
    """``probs=None`` for a ScaledSwiGLU (or a ``scale_bias`` GroupedLinear) raised on the
    unfused path but the fused grouped MLP ran it as an unscaled SwiGLU (scale 1): a
    forgotten router weight gave a silently wrong output."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = _block(scale_bias)
    split = ref.split_arg([3, 0, 5, 4], kind, "cpu")
    x = torch.randn(12, H)
    probs = [torch.rand(12) for _ in range(3 if scale_bias else 1)]
    probs[missing if scale_bias else 0] = None
    args = (split, probs[0], probs[1], split, probs[2]) if scale_bias else (
        split, probs[0], split)
    word = name if fusion == "1" else "probs"  # the unfused ops name their own input "probs"
    with pytest.raises(TypeError, match=f"{word} must be a torch.Tensor of shape \\(12,\\), "
                                        "got NoneType"):
        block(x, *args)


@pytest.mark.parametrize("fusion", ["0", "1"])
def test_given_probs_still_match_the_reference(monkeypatch, fusion):
    """The neighbour of the case above: with probs given, fused and unfused match fp64."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = _block()
    split = torch.tensor([3, 0, 5, 4])
    x = torch.randn(12, H)
    probs = torch.rand(12)
    y = block(x, split, probs, split)
    w1 = [ref.leaf(w) for w in block[0].weights()]
    w2 = [ref.leaf(w) for w in block[2].weights()]
    b1 = [ref.leaf(b) for b in block[0].biases()]
    b2 = [ref.leaf(b) for b in block[2].biases()]
    expected = ref.grouped_mlp(ref.leaf(x), [3, 0, 5, 4], ref.leaf(probs), w1, b1, w2, b2)
    ref.assert_close(y, expected, torch.float32, "y")
