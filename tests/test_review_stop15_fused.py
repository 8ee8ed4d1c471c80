"""Review of stop 15's merged changes (leaf15: the fast path's per-expert weights; fc1x15: the
PAIRED fc1 + SwiGLU persistent kernel and its ``TE_OPS_FC1_SWIGLU_EPILOGUE=1`` routing;
dsw15: fc2 dgrad with the dSwiGLU epilogue): one test per defect found, against the
independent fp64 reference of ``tests/reference.py``.
"""

from __future__ import annotations

import pytest
import torch
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


def _run(block, x, probs, split):
    for t in (x, probs, *block.parameters()):
        t.grad = None
    out = block(x, split, probs, split)
    fast = type(out.grad_fn).__name__ == "_FastGroupedMLPBackward"
    out.backward(torch.ones_like(out))
    return out.detach(), fast


@pytest.mark.parametrize("fast_step", ["1", "0"])
@pytest.mark.parametrize("which", [(5,), (0,), tuple(range(GROUPS))])
def test_weight_restrided_at_the_same_address_is_not_read_through_a_stale_view(
        monkeypatch, fast_step, which):
    """``weight.data = weight.data.t()`` (a square weight) keeps the data pointer, the shape
    and the dtype but not the strides: the stacked (G, N, K) view remembered by data pointers
    (``_LayerWeights.stacked`` on the fast path, ``stack_weights``' memo on the general path)
    must not be reused, or the moved weight is read as its old layout (silently wrong)."""
    monkeypatch.setenv("TE_OPS_FAST_STEP", fast_step)
    block = _block()
    x, probs, split = _inputs()
    for _ in range(2):
        _run(block, x, probs, split)
    ws = block[0].weights()
    for g in which:
        ws[g].data = ws[g].data.t()
    out, fast = _run(block, x, probs, split)
    assert fast == (fast_step == "1")
    expected = grouped_mlp(leaf(x), split, leaf(probs), [leaf(w) for w in ws], None,
                           [leaf(w) for w in block[2].weights()], None)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
