"""The fast path with per-expert weight Parameters (``weight0..weight{G-1}``) at many experts:
its per-parameter handling (te_ops/fast_step.py ``_LayerWeights``: the cached stacked view,
version counters in place of one saved tensor per weight) keeps the general path's values,
names, autograd hand-off and in-place-change errors.

Values are compared with the general path (``TE_OPS_FAST_STEP=0``) and with the single grouped
weight layout bit for bit (the same kernels run); the general path is itself checked against
``tests/reference.py`` elsewhere.
"""

from __future__ import annotations

import pytest
import torch
from block_replay import fwd_bwd_step

import te_ops

H, FF = 16, 8
GROUPS = 128


def _block(single: bool, groups: int = GROUPS, x_seed: int = 0) -> te_ops.Sequential:
    torch.manual_seed(x_seed)
    kw = {"single_grouped_weight": single, "bias": False}
    return te_ops.Sequential(te_ops.GroupedLinear(groups, H, 2 * FF, **kw), te_ops.ScaledSwiGLU(),
                             te_ops.GroupedLinear(groups, FF, H, **kw))


def _inputs(groups: int = GROUPS, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    base = torch.arange(groups) % 5  # 0..4 rows per expert (empty experts too)
    sizes = base[torch.randperm(groups, generator=gen)]  # one row count for every seed
    rows = int(sizes.sum())
    x = torch.randn(rows, H, generator=gen).requires_grad_()
    probs = torch.rand(rows, generator=gen).requires_grad_()
    return x, probs, sizes


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


def _copy_weights(src, dst) -> None:
    """Per-expert weights of ``src`` into ``dst`` (either layout)."""
    with torch.no_grad():
        for i in (0, 2):
            w = torch.stack(src[i].weights()) if not src[i].single_grouped_weight else (
                src[i].weight)
            if dst[i].single_grouped_weight:
                dst[i].weight.copy_(w)
            else:
                for g, p in enumerate(dst[i].weights()):
                    p.copy_(w[g])


def test_per_expert_fast_path_bitwise_vs_general_and_single(monkeypatch):
    """128 experts: per-expert fast == per-expert general == single grouped weight (fast),
    output and every gradient, over three calls with new inputs."""
    runs = {}
    for name, single, flag in (("fast", False, "1"), ("general", False, "0"),
                               ("single", True, "1")):
        monkeypatch.setenv("TE_OPS_FAST_STEP", flag)
        block = _block(single)
        if single:
            _copy_weights(_block(False), block)
        runs[name] = [fwd_bwd_step(block, *_inputs(seed=s)) for s in (1, 1, 2)]
    assert [r[2] for r in runs["fast"]] == [False, True, True]
    assert not any(r[2] for r in runs["general"])
    for fast, general, single in zip(runs["fast"], runs["general"], runs["single"]):
        assert torch.equal(fast[0], general[0]) and _same(fast[1], general[1])
        assert torch.equal(fast[0], single[0])
        per_expert_w = fast[1][2:]
        assert _same(fast[1][:2], single[1][:2])
        assert torch.equal(torch.stack(per_expert_w[:GROUPS]), single[1][2])
        assert torch.equal(torch.stack(per_expert_w[GROUPS:]), single[1][3])


def test_parameter_names_and_state_dict_unchanged():
    block = _block(False)
    names = [f"{i}.weight{g}" for i in (0, 2) for g in range(GROUPS)]
    before = block.state_dict()
    for _ in range(2):
        assert fwd_bwd_step(block, *_inputs())[2] in (False, True)
    assert [n for n, _ in block.named_parameters()] == names
    after = block.state_dict()
    assert list(after) == names == list(before)


def test_gradients_go_through_accumulate_grad_without_copies():
    """Every per-expert weight gets its gradient from autograd's AccumulateGrad: the
    post-accumulate hook fires once per weight per backward, ``.grad`` accumulates over two
    backwards, and the first backward's gradients are the slices of one buffer (taken
    without a copy: adjacent data pointers)."""
    block = _block(False)
    x, probs, split = _inputs()
    fwd_bwd_step(block, x, probs, split)
    weights = list(block.parameters())
    fired = []
    for w in weights:
        w.grad = None
        w.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    out = block(x, split, probs, split)
    assert type(out.grad_fn).__name__ == "_FastGroupedMLPBackward"
    out.sum().backward()
    assert len(fired) == len(weights) == 2 * GROUPS
    assert {id(p) for p in fired} == {id(w) for w in weights}
    for layer in (weights[:GROUPS], weights[GROUPS:]):
        step = layer[0].numel() * layer[0].element_size()
        ptrs = [w.grad.data_ptr() for w in layer]
        assert ptrs == list(range(ptrs[0], ptrs[0] + len(layer) * step, step))
    first = [w.grad.clone() for w in weights]
    block(x, split, probs, split).sum().backward()
    assert len(fired) == 4 * GROUPS
    assert all(torch.equal(w.grad, g + g) for w, g in zip(weights, first))


@pytest.mark.parametrize("layer,index", [(0, 0), (0, 77), (2, GROUPS - 1)])
def test_in_place_weight_change_between_forward_and_backward_raises(layer, index):
    block = _block(False)
    x, probs, split = _inputs()
    fwd_bwd_step(block, x, probs, split)
    out = block(x, split, probs, split)
    assert type(out.grad_fn).__name__ == "_FastGroupedMLPBackward"
    with torch.no_grad():
        block[layer].weights()[index].mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_in_place_change_of_a_weight_with_its_own_version_counter_raises():
    """weight5 re-assigned (a Parameter with a version counter of its own), then packed
    next to the others again (``.float()`` re-packs): the stack is a free view, and an
    in-place change of weight5 alone still raises (the version check covers each weight,
    not only the counter the others share)."""
    block = _block(False)
    fc2 = block[2]
    fc2.weight5 = torch.nn.Parameter(fc2.weight5.detach().clone())
    block.float()
    ws = fc2.weights()
    step = ws[0].numel() * ws[0].element_size()
    assert ws[5].data_ptr() == ws[0].data_ptr() + 5 * step  # adjacent again
    x, probs, split = _inputs()
    fwd_bwd_step(block, x, probs, split)
    out = block(x, split, probs, split)
    assert type(out.grad_fn).__name__ == "_FastGroupedMLPBackward"
    v4 = ws[4]._version
    with torch.no_grad():
        ws[5].add_(1.0)
    assert ws[4]._version == v4  # not a shared counter
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: fc2's weight5"):
        out.sum().backward()


@pytest.mark.parametrize("change", ["repoint_all", "one_apart"])
def test_weight_data_repointed_follows(monkeypatch, change):
    """``weight.data = ...`` keeps the Parameter objects (the key) but moves the storage:
    all weights into a new buffer (still a free view, at new addresses), or one weight into
    a storage of its own (the stack becomes a copy and the weights are saved). Each call
    gives the general path's values on an identical block."""
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("TE_OPS_FAST_STEP", flag)
        block = _block(False)
        x, probs, split = _inputs()
        for _ in range(2):
            fwd_bwd_step(block, x, probs, split)
        ws = block[0].weights()
        if change == "repoint_all":
            buf = torch.stack([w.detach() for w in ws]) * 0.5
            for g, w in enumerate(ws):
                w.data = buf[g]
        else:
            ws[9].data = ws[9].detach().clone() + 1.0
        results[flag] = [fwd_bwd_step(block, x, probs, split) for _ in range(2)]
    assert [r[2] for r in results["1"]] == [True, True]
    for a, b in zip(results["1"], results["0"]):
        assert torch.equal(a[0], b[0]) and _same(a[1], b[1])


def test_stacked_copy_in_place_change_raises():
    """One weight apart (the stack is a copy): the weights are saved tensors as before, so an
    in-place change between forward and backward raises."""
    block = _block(False)
    x, probs, split = _inputs()
    fwd_bwd_step(block, x, probs, split)
    block[2].weights()[3].data = block[2].weights()[3].detach().clone()
    out = block(x, split, probs, split)
    assert type(out.grad_fn).__name__ == "_FastGroupedMLPBackward"
    with torch.no_grad():
        block[2].weights()[3].add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_saved_tensors_do_not_grow_with_the_expert_count():
    """Per-expert weights adjacent in one buffer: the fast path saves one tensor per layer
    (weight0), not one per expert, so its save / unpack work does not grow with G."""
    counts = {}
    for groups in (4, GROUPS):
        block = _block(False, groups=groups)
        x, probs, split = _inputs(groups)
        fwd_bwd_step(block, x, probs, split)
        out = block(x, split, probs, split)
        assert type(out.grad_fn).__name__ == "_FastGroupedMLPBackward"
        counts[groups] = len(out.grad_fn.saved_tensors)
        out.sum().backward()
    assert counts[4] == counts[GROUPS] <= 9


@pytest.mark.parametrize("change", ["dtype", "shape"])
@pytest.mark.parametrize("flag", ["1", "0"])
def test_weight_reinterpreted_in_place_is_refused(monkeypatch, change, flag):
    """``weight.data = weight.data.view(...)`` of a middle weight keeps its pointer and its
    contiguity, so the remembered stacked view's pointer check passes: both the fast path
    and ``stack_weights`` (the general path) compare every weight's dtype and shape too and
    refuse the block with the weight's name, rather than reading its bytes through weight0's
    dtype (bf16 read as fp16) or shape."""
    monkeypatch.setenv("TE_OPS_FAST_STEP", flag)
    kw = {"single_grouped_weight": False, "bias": False, "dtype": torch.bfloat16}
    block = te_ops.Sequential(te_ops.GroupedLinear(GROUPS, H, 2 * FF, **kw),
                              te_ops.ScaledSwiGLU(), te_ops.GroupedLinear(GROUPS, FF, H, **kw))
    x, probs, split = _inputs()
    x = x.detach().to(torch.bfloat16).requires_grad_()
    for _ in range(2):
        fwd_bwd_step(block, x, probs, split)
    w = block[2].weights()[5]
    ptr = w.data_ptr()
    w.data = w.data.view(torch.float16) if change == "dtype" else w.data.view(FF, H)
    assert w.data_ptr() == ptr and w.is_contiguous()
    match = "weight5 is torch.float16" if change == "dtype" else r"weight5 has shape \(8, 16\)"
    with pytest.raises(ValueError, match=match):
        block(x, split, probs, split)
