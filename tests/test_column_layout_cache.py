"""quantization.layout.splits_layout: the group-aligned layout of column-wise quantized copies is
built once per splits object and alignment, and equals a fresh build."""

from __future__ import annotations

import inspect

import torch

import te_ops
import te_ops.quantization.layout as layout_mod
from te_ops.splits import make_splits


def _fields(lay):
    return (lay.capacity, lay.src, lay.dest, lay.group_ids, lay.offsets, lay.starts)


def _same(a, b) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1:], b[1:]))


def test_cached_per_align_and_equal_to_a_fresh_build():
    sizes = torch.tensor([5, 0, 17, 3])
    splits = make_splits(sizes, 4, 30, torch.device("cpu"))  # 5 padding rows
    first = layout_mod.splits_layout(splits, 16)
    assert layout_mod.splits_layout(splits, 16) is first
    assert _same(_fields(first), _fields(layout_mod.column_layout(sizes, splits.base_offsets,
                                                                  30, 16)))
    mx = layout_mod.splits_layout(splits, 32)
    assert mx is not first and mx.capacity % 32 == 0
    # Group starts are multiples of the alignment; the ends are the GEMM's offsets.
    assert first.starts.tolist() == [0, 16, 16, 48]
    assert first.offsets.tolist() == [16, 16, 48, 64]
    # A new splits object (e.g. the next step's, or backward's rebuilt one) builds its own.
    other = make_splits(torch.tensor([1, 1, 1, 1]), 4, 30, torch.device("cpu"))
    assert layout_mod.splits_layout(other, 16).offsets.tolist() == [16, 32, 48, 64]


def test_fp8_step_builds_the_layout_once_per_splits(monkeypatch):
    built = []
    real = layout_mod.column_layout

    def counting(*args, **kwargs):
        built.append(inspect.stack()[1].function)  # who asked for a build
        return real(*args, **kwargs)

    monkeypatch.setattr(layout_mod, "column_layout", counting)
    torch.manual_seed(0)
    block = te_ops.Sequential(te_ops.GroupedLinear(4, 32, 64, bias=False), te_ops.ScaledSwiGLU(),
                              te_ops.GroupedLinear(4, 32, 32, bias=False)).to(torch.bfloat16)
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    sizes = torch.tensor([20, 0, 30, 10])
    probs = torch.rand(64, requires_grad=True)
    with te_ops.autocast(enabled=True, recipe=te_ops.recipe.Float8CurrentScaling()):
        block(x, sizes, probs, sizes).sum().backward()
    # The forward's column-wise copy of x, and one build for the backward's column-wise
    # copies and wgrad GEMMs (the CPU's emulated GEMMs dequantize through column_layout
    # directly, as QuantizedTensorStorage.dequantize has no splits object).
    assert built.count("build") == 2, built  # splits_layout's builds
    assert set(built) <= {"build", "dequantize"}, built
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()
