"""The per-step host work of the fused grouped MLP: no-op shape changes are skipped, internal
views are saved as they are, and the results do not change.

The aten ops of one step are counted with a ``TorchDispatchMode`` (machine-independent, unlike
a timing; speed itself is measured in ``benchmarks/grouped_mlp.py``). Values are checked
against the float64 per-expert reference of ``tests/reference.py``.
"""

from __future__ import annotations

import collections

import pytest
import reference as ref
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import te_ops
from te_ops.kernels.padding import zero_padding_rows_
from te_ops.shapes import as_shape, rows_2d
from te_ops.signature import same_source
from te_ops.splits import close_host_read_scope, make_splits, open_host_read_scope


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _counted_step(block: te_ops.Sequential, x: torch.Tensor, probs: torch.Tensor,
                  sizes: torch.Tensor) -> collections.Counter[str]:
    """The aten ops of one forward + backward (``backward(dy)``, gradients reset before, as a
    training step), after one warm-up step."""
    dy = torch.randn(x.shape[0], 16)
    counts: collections.Counter[str] = collections.Counter()
    for _ in range(2):  # a warm-up step, then the counted one
        for t in (x, probs, *block.parameters()):
            t.grad = None
        with _CountOps() as mode:
            block(x, sizes, probs, sizes).backward(dy)
        counts = mode.counts
    return counts


def _block(single: bool) -> te_ops.Sequential:
    kw = {"bias": False, "single_grouped_weight": single}
    return te_ops.Sequential(te_ops.GroupedLinear(4, 16, 32, **kw), te_ops.ScaledSwiGLU(),
                             te_ops.GroupedLinear(4, 16, 16, **kw))


# ------------------------------------------------------------------------------ helpers
def test_rows_2d_returns_the_tensor_itself_only_when_nothing_changes():
    x = torch.randn(6, 4)
    assert rows_2d(x, 4) is x
    x3 = torch.randn(2, 3, 4)
    assert torch.equal(rows_2d(x3, 4), x3.reshape(6, 4))
    strided = torch.randn(4, 6).t()  # (6, 4), not contiguous: a contiguous copy
    out = rows_2d(strided, 4)
    assert out is not strided and out.is_contiguous() and torch.equal(out, strided)


def test_as_shape_reshapes_only_when_the_shape_differs():
    x = torch.randn(6, 4)
    assert as_shape(x, (6, 4)) is x
    assert as_shape(x, torch.Size([6, 4])) is x
    y = as_shape(x, (2, 3, 4))
    assert y._base is x and torch.equal(y.reshape(6, 4), x)  # a view where strides allow
    flat = as_shape(x.t(), (24,))  # a transposed tensor is copied, as by Tensor.reshape
    assert torch.equal(flat, x.t().reshape(24))
    with pytest.raises(RuntimeError, match="invalid for input of size 24"):
        as_shape(x, (5, 5))


# -------------------------------------------------------------------------- op counts
@pytest.mark.parametrize("single", [True, False])
@pytest.mark.parametrize("fusion", ["1", "0"])
def test_step_on_2d_input_makes_no_view_ops(monkeypatch, single, fusion):
    """A 2-D input and 1-D probs need no reshape: the step dispatches no ``view`` and (the
    saved tensors being the caller's or the ops' own) no ``as_strided`` re-view either, except
    the per-expert weights' stacked view (once per op and step); fused and unfused."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = _block(single)
    x = torch.randn(12, 16, requires_grad=True)
    probs = torch.rand(12, requires_grad=True)
    sizes = torch.tensor([3, 0, 5, 4])
    counts = _counted_step(block, x, probs, sizes)
    assert counts["view"] == 0, counts
    assert counts["_unsafe_view"] == 0, counts
    # fc1/fc2 weights stacked for fprop; dgrad reads that view (GroupedLinearSaved.weights_view)
    stacked_views = 0 if single else 2
    assert counts["as_strided"] == stacked_views, counts


def test_fused_single_weight_step_op_budget():
    """The fused single-weight step's aten ops (CPU, device split sizes covering every row):
    6 grouped GEMMs, the split-size derivation and check, the torch SwiGLU, autograd's own.
    Guards against ops creeping back."""
    block = _block(single=True)
    x = torch.randn(12, 16, requires_grad=True)
    probs = torch.rand(12, requires_grad=True)
    sizes = torch.tensor([3, 1, 5, 3])
    counts = _counted_step(block, x, probs, sizes)
    assert counts["_grouped_mm"] == 6
    # 48 ops for the step itself; the CPU SwiGLU's row blocks (L2 reuse,
    # te_ops.basic.swiglu.CPU_BLOCK_ELEMENTS) allocate their scratch buffers once per call and
    # split x into halves: 6 more ops on this path (the Triton kernels run on CUDA).
    assert sum(counts.values()) <= 54, counts


# ------------------------------------------------------------------------------ values
@pytest.mark.parametrize("shape", [(12, 16), (3, 4, 16)])
@pytest.mark.parametrize("fusion", ["1", "0"])
def test_grads_match_reference_with_and_without_reshapes(monkeypatch, shape, fusion):
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = _block(single=True)  # float32: the grouped_mm backend
    sizes = [3, 0, 5, 2]  # 2 padding rows
    x = torch.randn(*shape, requires_grad=True)
    probs = torch.rand(shape[:-1], requires_grad=True)
    split = torch.tensor(sizes)
    y = block(x, split, probs, split)
    y.square().sum().backward()
    w1 = ref.leaf(block[0].weight.detach())
    w2 = ref.leaf(block[2].weight.detach())
    xr, pr = ref.leaf(x.detach().reshape(-1, 16)), ref.leaf(probs.detach().reshape(-1))
    h = ref.grouped_linear(xr, list(w1.unbind(0)), None, sizes)
    want = ref.grouped_linear(ref.scaled_swiglu(h, pr), list(w2.unbind(0)), None, sizes)
    want.square().sum().backward()
    ref.assert_close(y.reshape(-1, 16), want, torch.float32, "output")
    ref.assert_close(x.grad.reshape(-1, 16), xr.grad, torch.float32, "x.grad")
    ref.assert_close(probs.grad.reshape(-1), pr.grad, torch.float32, "probs.grad")
    ref.assert_close(block[0].weight.grad, w1.grad, torch.float32, "fc1 weight grad")
    ref.assert_close(block[2].weight.grad, w2.grad, torch.float32, "fc2 weight grad")
    assert probs.grad.shape == probs.shape and x.grad.shape == x.shape


def test_input_that_is_a_view_without_grad_still_names_the_inplace_op(monkeypatch):
    """A view of a tensor that needs no grad is saved as it is (no base-and-restride): an
    in-place change before backward still gives torch's version-counter error."""
    block = _block(single=True)
    base = torch.randn(2, 6, 16)
    x = base.view(12, 16)
    sizes = torch.tensor([3, 3, 3, 3])
    y = block(x, sizes, torch.rand(12), sizes)
    with torch.no_grad():
        base.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


# ---------------------------------------------------------------------- padding / splits
def test_padding_mask_callable_runs_only_on_the_mask_path():
    offsets = torch.tensor([2, 5], dtype=torch.int32)

    def fail() -> torch.Tensor:
        raise AssertionError("the mask was built on the slice path")

    out = torch.full((7, 3), float("nan"))
    zero_padding_rows_(out, offsets, fail)  # CPU eager: slice path, no mask needed
    assert torch.equal(out[5:], torch.zeros(2, 3)) and out[:5].isnan().all()
    meta = torch.empty(7, 3, device="meta")  # meta: the mask path, built by the callable
    calls = []
    mask = torch.zeros(7, 1, dtype=torch.bool, device="meta")
    zero_padding_rows_(meta, offsets.to("meta"), lambda: calls.append(1) or mask)
    assert calls == [1]


def test_host_read_scope_functions_share_one_host_copy():
    sizes = torch.tensor([1, 2])
    token = open_host_read_scope()
    try:
        a = make_splits(sizes, 2, 3, sizes.device)
        b = make_splits(sizes, 2, 3, sizes.device)
        assert a.sizes_on_host() is b.sizes_on_host() == [1, 2]
    finally:
        close_host_read_scope(token)
    c = make_splits(sizes, 2, 3, sizes.device)
    assert c.sizes_on_host() == [1, 2] and c.sizes_on_host() is not a.sizes_on_host()


def test_same_source_rejects_other_dtype_before_comparing_memory():
    t = torch.arange(4)
    assert same_source(t, t.detach())
    assert not same_source(t, t.view(torch.float64))  # same memory, another dtype
    assert not same_source(t, t.clone())


def test_recipe_record_is_dropped_by_the_next_call_without_a_recipe():
    """The per-call recipe record (``explain()``) is skipped when there is no recipe and
    nothing to drop, and still dropped after a call under a recipe."""
    lin = te_ops.GroupedLinear(2, 16, 16)
    x = torch.randn(6, 16)
    lin(x, [3, 3])
    assert not any(r.startswith("recipe ") for r in lin.dispatch_records())
    with te_ops.autocast(recipe=te_ops.recipe.Float8CurrentScaling()):
        lin(x, [3, 3])
    assert any(r.startswith("recipe Float8CurrentScaling") for r in lin.dispatch_records())
    lin(x, [3, 3])
    assert not any(r.startswith("recipe ") for r in lin.dispatch_records())
