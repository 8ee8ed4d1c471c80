"""te_ops issues the same ``torch._grouped_mm`` calls as plain torch autograd of the block.

On the H200 the kernel torch runs depends only on the operands' layouts (and per-group sizes),
and the same calls ran equally fast on either side's operands (docs/benchmarks.md, "Why te_ops'
GEMMs timed slower than the peer's"). This pins the layouts: a change to them must be measured
there first (``benchmarks/gemm_call_patterns.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import te_ops

G, T, H, FF = 4, 48, 32, 40  # H, FF and 2FF all differ, so every GEMM has its own shapes


class _Calls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket.__name__ == "_grouped_mm":
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            extra = {k: v for k, v in kwargs.items() if k != "offs"}
            self.calls.append(tuple(
                (tuple(t.shape), t.stride(), t.dtype) for t in (args[0], args[1], out)
            ) + ((offs.dtype, tuple(offs.tolist())), tuple(sorted(extra.items()))))
        return out


def _torch_block(w1, w2, x, probs, offs, dy):
    h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
    a, b = h.chunk(2, dim=-1)
    g = F.silu(a) * b * probs.unsqueeze(-1).to(h.dtype)
    torch._grouped_mm(g, w2.transpose(-2, -1), offs=offs).backward(dy)


def _stacked(weights: list[torch.Tensor]) -> torch.Tensor:
    """(G, out, in) copy of per-expert weights or of ``single_grouped_weight``'s one weight."""
    w = weights[0] if len(weights) == 1 and weights[0].dim() == 3 else torch.stack(weights)
    return w.detach().clone().requires_grad_()


@pytest.mark.parametrize("fusion", ["0", "1"])
@pytest.mark.parametrize("single", [False, True])
def test_grouped_mm_calls_match_plain_torch(monkeypatch, fusion, single):
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    torch.manual_seed(0)
    dtype = torch.bfloat16
    kw = {"bias": False, "single_grouped_weight": single, "dtype": dtype}
    block = te_ops.Sequential(te_ops.GroupedLinear(G, H, 2 * FF, **kw), te_ops.ScaledSwiGLU(),
                              te_ops.GroupedLinear(G, FF, H, **kw))
    sizes = torch.tensor([20, 0, 17, 11])
    x = torch.randn(T, H, dtype=dtype, requires_grad=True)
    probs = torch.rand(T, requires_grad=True)
    dy = torch.randn(T, H, dtype=dtype)
    block(x, sizes, probs, sizes).backward(dy)  # plan and probe outside the recording

    mine = _Calls()
    with mine:
        block(x, sizes, probs, sizes).backward(dy)
    w1, w2 = (_stacked(block[i].weights()) for i in (0, 2))
    theirs = _Calls()
    with theirs:
        _torch_block(w1, w2, x, probs, torch.cumsum(sizes, 0).to(torch.int32), dy)

    assert len(mine.calls) == 6
    assert sorted(mine.calls, key=repr) == sorted(theirs.calls, key=repr)
