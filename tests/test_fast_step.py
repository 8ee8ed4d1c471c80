"""The fused grouped MLP's fast path for repeated eager training calls (te_ops/fast_step.py).

The fast path must give bitwise the general path's outputs and gradients (the same kernels run),
be taken only for a call like the recorded one, and leave every error, hook and autograd
behaviour as it was. Values are also checked against the float64 per-expert reference of
``tests/reference.py``.
"""

from __future__ import annotations

import copy

import pytest
import reference as ref
import torch
from block_replay import block_args, fwd_bwd_step

import te_ops
from te_ops.fuser import DOUBLE_BACKWARD_ERROR

#: Hidden and FFN sizes: rows of 16-byte multiples in fp32 and bf16, so torch._grouped_mm (or
#: Triton) runs, as the fast path needs (the loop backend reads split sizes on the host).
H, FF = 16, 8


def _block(single: bool, scaled: bool = True, bias: bool = False, groups: int = 4,
           device: str = "cpu", dtype: torch.dtype = torch.float32) -> te_ops.Sequential:
    kw = {"single_grouped_weight": single, "bias": bias, "device": device, "dtype": dtype}
    return te_ops.Sequential(
        te_ops.GroupedLinear(groups, H, 2 * FF, **kw),
        te_ops.ScaledSwiGLU() if scaled else te_ops.SwiGLU(),
        te_ops.GroupedLinear(groups, FF, H, **kw),
    )


def _inputs(rows: int = 10, sizes=(3, 0, 4, 2), device: str = "cpu",
            dtype: torch.dtype = torch.float32, x_grad: bool = True):
    x = torch.randn(rows, H, device=device, dtype=dtype, requires_grad=x_grad)
    probs = torch.rand(rows, device=device, dtype=dtype, requires_grad=True)
    return x, probs, torch.tensor(sizes, device=device)


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        (u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))
        for u, v in zip(a, b))


def _fast_vs_general(monkeypatch, make_block, make_inputs, steps: int = 3):
    """Run ``steps`` calls with the fast path on and off (fresh blocks, same init)."""
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("TE_OPS_FAST_STEP", flag)
        torch.manual_seed(0)
        block = make_block()
        runs = []
        for i in range(steps):
            torch.manual_seed(10 + i)
            runs.append(fwd_bwd_step(block, *make_inputs()))
        results[flag] = runs
    return results["1"], results["0"]


@pytest.mark.parametrize("single", [True, False])
@pytest.mark.parametrize("scaled", [True, False])
@pytest.mark.parametrize("x_grad", [True, False])
@pytest.mark.parametrize("rows,sizes", [(10, (3, 0, 4, 2)), (10, (1, 2, 0, 1)),
                                        (10, (0, 0, 0, 0)), (0, (0, 0, 0, 0))])
def test_fast_path_bitwise_equal_to_general_path(monkeypatch, single, scaled, x_grad, rows,
                                                 sizes):
    """Second and later calls take the fast path (first: general) and match the general path
    bit for bit, with and without padding rows, empty groups, an empty batch, input grad."""
    fast, general = _fast_vs_general(
        monkeypatch, lambda: _block(single, scaled),
        lambda: _inputs(rows, sizes, x_grad=x_grad))
    assert [r[2] for r in fast] == [False, True, True]
    assert not any(r[2] for r in general)
    for (o1, g1, _), (o2, g2, _) in zip(fast, general):
        assert torch.equal(o1, o2)
        assert _same(g1, g2)


def test_fast_path_matches_fp64_reference():
    block = _block(single=True)
    x, probs, split = _inputs()
    fwd_bwd_step(block, x, probs, split)
    out, grads, fast = fwd_bwd_step(block, x, probs, split)
    assert fast
    fc1, fc2 = block[0], block[2]
    w1 = [ref.leaf(w) for w in fc1.weight]
    w2 = [ref.leaf(w) for w in fc2.weight]
    xr, pr = ref.leaf(x), ref.leaf(probs)
    h = ref.grouped_linear(xr, w1, None, split)
    y = ref.grouped_linear(ref.scaled_swiglu(h, pr), w2, None, split)
    ref.assert_close(out, y, torch.float32)
    y.sum().backward()
    ref.assert_close(grads[0], xr.grad, torch.float32)
    ref.assert_close(grads[1], pr.grad, torch.float32)
    ref.assert_close(grads[2], torch.stack([w.grad for w in w1]), torch.float32)
    ref.assert_close(grads[3], torch.stack([w.grad for w in w2]), torch.float32)


def test_fast_path_is_taken_only_for_a_call_like_the_recorded_one(monkeypatch):
    block = _block(single=False)
    x, probs, split = _inputs()
    assert not fwd_bwd_step(block, x, probs, split)[2]
    assert fwd_bwd_step(block, x, probs, split)[2]
    # new split-size values and new tensors of the same kind: still fast
    x2, probs2, split2 = _inputs(10, (1, 1, 1, 1))
    assert fwd_bwd_step(block, x2, probs2, split2)[2]
    # another row count: general once, then fast again
    x3, probs3, split3 = _inputs(12, (3, 3, 3, 3))
    assert not fwd_bwd_step(block, x3, probs3, split3)[2]
    assert fwd_bwd_step(block, x3, probs3, split3)[2]
    # probs without grad, input without grad: the key changes
    assert not fwd_bwd_step(block, x3, probs3.detach(), split3)[2]
    assert not fwd_bwd_step(block, x3.detach(), probs3.detach(), split3)[2]
    # two split-size tensors (not one source): never fast
    out = block(x3, split3, probs3, split3.clone())
    assert type(out.grad_fn).__name__ != "_FastGroupedMLPBackward"
    # a host list: never fast
    for _ in range(2):
        out = block(x3, [3, 3, 3, 3], probs3, [3, 3, 3, 3])
        assert type(out.grad_fn).__name__ != "_FastGroupedMLPBackward"
    # no grad: the general path's no-grad branch
    fwd_bwd_step(block, x3, probs3, split3)
    with torch.no_grad():
        assert block(x3, split3, probs3, split3).grad_fn is None
    assert fwd_bwd_step(block, x3, probs3, split3)[2]
    # TE_OPS_FAST_STEP=0
    monkeypatch.setenv("TE_OPS_FAST_STEP", "0")
    assert not fwd_bwd_step(block, x3, probs3, split3)[2]
    assert not fwd_bwd_step(block, x3, probs3, split3)[2]


@pytest.mark.parametrize("change", ["swap", "freeze", "main_grad", "delay", "same_setting",
                                    "interleave", "recipe", "fusion_off", "autocast"])
def test_fast_path_follows_changes(monkeypatch, change):
    """Whatever the recorded call's decisions depended on, changed, sends the call down the
    general path (whose result is checked against a fresh block's general path)."""
    block = _block(single=False)
    x, probs, split = _inputs()
    fwd_bwd_step(block, x, probs, split)
    assert fwd_bwd_step(block, x, probs, split)[2]
    fc1 = block[0]
    if change == "swap":
        fc1.weight0 = torch.nn.Parameter(fc1.weight0.detach() * 2)
    elif change == "freeze":
        fc1.weight1.requires_grad_(False)
    elif change == "main_grad":
        fc1.accumulate_into_main_grad = True
        for w in fc1.weights():
            w.main_grad = torch.zeros_like(w)
    elif change == "delay":
        fc1.delay_wgrad_compute = True
    elif change == "same_setting":
        block[1].glu_interleave_size = None  # same value set again: still fast
        assert fwd_bwd_step(block, x, probs, split)[2]
        return
    elif change == "interleave":
        block[1].glu_interleave_size = 2
    elif change == "fusion_off":
        monkeypatch.setenv("TE_OPS_FUSION", "0")
    if change == "recipe":
        with te_ops.autocast(recipe=te_ops.recipe.Float8CurrentScaling()):
            assert not fwd_bwd_step(block, x, probs, split)[2]
        return
    if change == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
                RuntimeError, match="te_ops ops do not follow torch.autocast"):
            block(x, split, probs, split)
        return
    out, grads, fast = fwd_bwd_step(block, x, probs, split)
    assert not fast
    monkeypatch.setenv("TE_OPS_FAST_STEP", "0")
    out2, grads2, _ = fwd_bwd_step(block, x, probs, split)
    assert torch.equal(out, out2) and _same(grads, grads2)


def test_fast_path_environment_changed_and_restored(monkeypatch):
    """The key compares the environment's values: a variable set for other calls and
    restored leaves the recorded call valid (benchmarks toggle variables between peers)."""
    block = _block(single=True)
    other = _block(single=True)
    x, probs, split = _inputs()
    fwd_bwd_step(block, x, probs, split)
    assert fwd_bwd_step(block, x, probs, split)[2]
    monkeypatch.setenv("TE_OPS_FUSION", "0")
    assert not fwd_bwd_step(other, x, probs, split)[2]  # another block, unfused meanwhile
    monkeypatch.delenv("TE_OPS_FUSION")
    assert fwd_bwd_step(block, x, probs, split)[2]


def test_fast_path_keeps_input_errors():
    """After fast calls, bad input raises the general path's errors (names the argument)."""
    block = _block(single=True)
    x, probs, split = _inputs()
    for _ in range(2):
        fwd_bwd_step(block, x, probs, split)
    with pytest.raises(ValueError, match=f"in_features={H}"):
        block(torch.randn(10, H - 1), split, probs, split)
    with pytest.raises(ValueError, match="dtype"):
        block(x.double(), split, probs, split)
    with pytest.raises(ValueError, match="split_sizes must have num_groups=4"):
        block(x, torch.tensor([3, 4, 3]), probs, torch.tensor([3, 4, 3]))
    with pytest.raises(TypeError, match="split_sizes must have an integer dtype"):
        bad = torch.tensor([True, False, True, True])
        block(x, bad, probs, bad)
    with pytest.raises(ValueError, match="probs must have shape"):
        block(x, split, probs[:5], split)
    with pytest.raises(RuntimeError, match="split_sizes must be non-negative and sum"):
        block(x, torch.tensor([9, 9, 0, 0]), probs, torch.tensor([9, 9, 0, 0]))
    assert fwd_bwd_step(block, x, probs, split)[2]
    # the same sum error on the fast path itself (same kind of call, bad values)
    bad = torch.tensor([9, 9, 0, 0])
    with pytest.raises(RuntimeError, match="split_sizes must be non-negative and sum"):
        block(x, bad, probs, bad)


@pytest.mark.parametrize("single", [True, False])
def test_fast_path_block_cast_or_copied(single):
    """``op.to(dtype)`` keeps the Parameter objects: the next call with the old input dtype
    gets the general path's clear error; a deepcopy takes the general path once, then its own fast
    path, with the same values."""
    block = _block(single)
    x, probs, split = _inputs()
    for _ in range(2):
        out, grads, _ = fwd_bwd_step(block, x, probs, split)
    copied = copy.deepcopy(block)
    assert [fwd_bwd_step(copied, x, probs, split)[2] for _ in range(2)] == [False, True]
    out2, grads2, _ = fwd_bwd_step(copied, x, probs, split)
    assert torch.equal(out, out2) and _same(grads, grads2)
    block[2].to(torch.float64)  # one op (Sequential.to would also rebuild its fusers)
    with pytest.raises(ValueError, match="input must match the weights' dtype torch.float64"):
        block(x, split, probs, split)


@pytest.mark.parametrize("single", [True, False])
@pytest.mark.parametrize("op", [0, 2])
def test_fast_path_weight_data_replaced_with_another_shape(monkeypatch, single, op):
    """``param.data = t`` of another shape keeps the Parameter objects: the call behaves as on
    the general path (which raises for the new feature size) instead of returning an output
    of another shape."""
    errors = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("TE_OPS_FAST_STEP", flag)
        block = _block(single)
        x, probs, split = _inputs()
        for _ in range(2):
            fwd_bwd_step(block, x, probs, split)
        for w in block[op].weights():  # out_features grows by 16
            w.data = torch.randn(*w.shape[:-2], w.shape[-2] + 16, w.shape[-1])
        name = "weight" if single else "weight0"
        with pytest.raises(ValueError, match=rf"{name} must have shape") as info:
            block(x, split, probs, split)
        errors[flag] = str(info.value)
    assert errors["1"] == errors["0"]


@pytest.mark.parametrize("fusion", ["1", "0"])
@pytest.mark.parametrize("op", [0, 2])
def test_a_later_per_expert_weight_of_another_shape_is_named(monkeypatch, fusion, op):
    """Only weight3's data replaced (weight0 keeps the layer's shape): the stacking names the
    entry, fused and unfused, fast path recorded or not."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = _block(False)
    x, probs, split = _inputs()
    for _ in range(2):
        fwd_bwd_step(block, x, probs, split)
    w = block[op].weights()[3]
    w.data = torch.randn(w.shape[0] + 16, w.shape[1])
    with pytest.raises(ValueError, match=r"weight3 has shape .* expected .* weight0"):
        block(x, split, probs, split)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_fast_path_and_activation_checkpointing(use_reentrant):
    """Under saved-tensor hooks (non-reentrant checkpointing) the general path runs, so the
    recomputation saves what the original forward saved; gradients equal the plain calls'."""
    block = _block(single=True)
    x, probs, split = _inputs()
    plain = [fwd_bwd_step(block, x, probs, split) for _ in range(2)]
    assert plain[1][2]
    fresh = _block(single=True)
    fresh.load_state_dict(block.state_dict())
    for blk in (block, fresh):  # a block with a recorded fast path, and a fresh one
        for _ in range(2):
            for t in (x, probs, *blk.parameters()):
                t.grad = None
            out = te_ops.checkpoint(blk, x, split, probs, split, use_reentrant=use_reentrant)
            out.backward(torch.ones_like(out))
            assert torch.equal(out.detach(), plain[1][0])
            assert _same([t.grad for t in (x, probs, *blk.parameters())], plain[1][1])
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = block(x, split, probs, split)
    assert packed and type(out.grad_fn).__name__ != "_FastGroupedMLPBackward"


@pytest.mark.parametrize("single", [True, False])
def test_fast_path_in_place_weight_change_raises(single):
    block = _block(single)
    x, probs, split = _inputs()
    fwd_bwd_step(block, x, probs, split)
    out = block(x, split, probs, split)
    assert type(out.grad_fn).__name__ == "_FastGroupedMLPBackward"
    with torch.no_grad():
        block[2].weights()[-1].add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_fast_path_in_place_input_view_change_raises():
    """An input that is a view of a grad-requiring tensor, changed in place after the forward:
    the error names the in-place op (the base is saved, as on the general path)."""
    block = _block(single=True)
    base = torch.randn(12, H, requires_grad=True)
    probs, split = torch.rand(10), torch.tensor([3, 0, 4, 2])
    for _ in range(2):
        x = base[:10]
        out = block(x, split, probs, split)
    assert type(out.grad_fn).__name__ == "_FastGroupedMLPBackward"
    out.sum().backward()
    out = block(base[:10], split, probs, split)
    with torch.no_grad():
        base.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_fast_path_retained_graph_and_double_backward_raise():
    block = _block(single=True)
    x, probs, split = _inputs()
    fwd_bwd_step(block, x, probs, split)
    out = block(x, split, probs, split)
    assert type(out.grad_fn).__name__ == "_FastGroupedMLPBackward"
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    out = block(x, split, probs, split)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="higher-order gradients"):
        gx.sum().backward()
    assert "higher-order" in DOUBLE_BACKWARD_ERROR


def test_fast_path_parameter_hooks_and_grad_accumulation():
    """One autograd edge per weight parameter: per-parameter hooks run, .grad accumulates."""
    block = _block(single=False)
    x, probs, split = _inputs()
    fwd_bwd_step(block, x, probs, split)
    seen = []
    for w in block.parameters():
        w.grad = None
        w.register_hook(lambda g, w=w: seen.append(w))
    out = block(x, split, probs, split)
    assert type(out.grad_fn).__name__ == "_FastGroupedMLPBackward"
    out.sum().backward()
    first = [w.grad.clone() for w in block.parameters()]
    assert len(seen) == len(list(block.parameters())) == 8
    block(x, split, probs, split).sum().backward()
    for w, g in zip(block.parameters(), first):
        assert torch.equal(w.grad, g + g)


def test_fast_path_then_torch_compile_fullgraph():
    """Eager fast calls, then the compiled block (which traces the general path): equal."""
    block = _block(single=True)
    x, probs, split = _inputs()
    eager = [fwd_bwd_step(block, x, probs, split) for _ in range(2)]
    assert eager[1][2]
    compiled = torch.compile(block, fullgraph=True)
    for t in (x, probs, *block.parameters()):
        t.grad = None
    out = compiled(x, split, probs, split)
    out.backward(torch.ones_like(out))
    grads = [t.grad for t in (x, probs, *block.parameters())]
    ref.assert_close(out, eager[1][0], torch.float32)
    for g, e in zip(grads, eager[1][1]):
        ref.assert_close(g, e, torch.float32)
    assert fwd_bwd_step(block, x, probs, split)[2]  # eager again: fast


def test_fast_path_on_meta_device():
    """No host read on the fast path: it runs on meta tensors."""
    block = _block(single=True, device="meta", dtype=torch.bfloat16)
    x = torch.empty(10, H, device="meta", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.empty(10, device="meta", dtype=torch.bfloat16, requires_grad=True)
    split = torch.empty(4, dtype=torch.int64, device="meta")
    for _ in range(2):
        out = block(x, split, probs, split)
        out.sum().backward()
    assert type(out.grad_fn).__name__ == "_FastGroupedMLPBackward"
    assert x.grad.shape == x.shape and block[0].weight.grad.shape == block[0].weight.shape


@pytest.mark.cuda
@pytest.mark.parametrize("single", [True, False])
@pytest.mark.parametrize("rows", [256, 4096])
def test_fast_path_cuda_bitwise_and_graph_capture(monkeypatch, single, rows):
    """bf16 on the GPU (few-rows Triton GEMMs at 4 rows per expert; at 64 the persistent Triton
    fprop / dgrad and torch._grouped_mm's wgrad): fast and
    general paths equal bit for bit; a CUDA graph captured after fast eager calls (the capture
    takes the general path) replays with new split sizes to the eager values."""
    groups = 64
    sizes = [rows // groups] * groups
    sizes[0] -= 3  # three padding rows

    def make_block():
        torch.manual_seed(0)
        b = _block(single, groups=groups, device="cuda", dtype=torch.bfloat16)
        for w in b.parameters():
            torch.nn.init.normal_(w, std=0.02)
        return b

    def make_inputs():
        return _inputs(rows, sizes, device="cuda", dtype=torch.bfloat16)

    fast, general = _fast_vs_general(monkeypatch, make_block, make_inputs)
    assert [r[2] for r in fast] == [False, True, True]
    for (o1, g1, _), (o2, g2, _) in zip(fast, general):
        assert torch.equal(o1, o2) and _same(g1, g2)
    monkeypatch.setenv("TE_OPS_FAST_STEP", "1")
    block = make_block()
    x, probs, split = make_inputs()
    dy = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        fwd_bwd_step(block, x, probs, split, dy)
    graph = torch.cuda.CUDAGraph()
    for t in (x, probs, *block.parameters()):
        t.grad = None
    with torch.cuda.graph(graph):
        out = block(x, split, probs, split)
        assert type(out.grad_fn).__name__ != "_FastGroupedMLPBackward"
        out.backward(dy)
    new = list(reversed(sizes))
    split.copy_(torch.tensor(new, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    got = [out.detach().clone()] + [t.grad.clone() for t in (x, probs, *block.parameters())]
    eager_block = make_block()
    e_out, e_grads, _ = fwd_bwd_step(eager_block, x, probs, torch.tensor(new, device="cuda"), dy)
    assert torch.equal(got[0], e_out)
    assert _same(got[1:], e_grads)


def test_fast_path_binds_the_triton_kinds_to_bound_call_sites(monkeypatch):
    """The kinds a backend runs in Triton call bound call sites of the kernels (same launch
    wrappers' kernels and configs, without the per-call checks; one launch batch per recorded
    call), the others the dispatch with the recorded backend; the CUDA tests compare the
    bits."""
    from te_ops import fast_step
    from te_ops.gemm.dispatch import BackendChoice
    from te_ops.kernels.swiglu_triton import ActivationChoice
    from te_ops.kernels.triton_launch import LaunchBatch

    calls = []

    class Site:
        def __init__(self, *args):
            self.made = args

        def __call__(self, a, b, offsets):
            calls.append((*self.made[:-1], a, b, offsets, self.made[-1]))

    monkeypatch.setattr(fast_step, "BoundRows", Site)
    monkeypatch.setattr(fast_step, "BoundWgrad", lambda batch: Site("wgrad", batch))
    monkeypatch.setattr(fast_step, "grouped_dgrad", lambda dy, w, splits, backend: calls.append(
        ("dgrad-dispatch", backend)))
    backend = BackendChoice("triton", "test", True, triton_kinds=("fprop", "wgrad"))
    batch = LaunchBatch()
    fprop, dgrad, wgrad = fast_step._gemm_calls(backend, batch)
    splits = type("S", (), {"offsets": "OFFS"})()
    fprop("X", "W", splits)
    dgrad("DY", "W", splits)
    wgrad("X", "DY", splits)
    assert calls == [("fprop", "X", "W", "OFFS", batch), ("dgrad-dispatch", backend),
                     ("wgrad", "X", "DY", "OFFS", batch)]
    fwd, bwd = fast_step._activation_calls(ActivationChoice("triton", "test"), None, batch)
    assert type(fwd) is fast_step.swiglu_triton.BoundForward and fwd.batch is batch
    assert type(bwd) is fast_step.swiglu_triton.BoundBackward and bwd.batch is batch


def test_fast_backward_under_a_trace_uses_the_dispatching_calls(monkeypatch):
    """Compiled autograd traces the fast path's backward with Dynamo: then the GEMM and
    activation calls are the dispatching ones (``grouped_dgrad`` / ``grouped_wgrad`` /
    ``swiglu_backward``, whose Triton kinds are custom ops under a trace), never the eager
    entry points (which would trace into the direct Triton launcher); the gradients are
    unchanged."""
    from te_ops import fast_step
    from te_ops.gemm.dispatch import BackendChoice
    from te_ops.kernels.swiglu_triton import ActivationChoice

    # Without a launch batch, every Triton kind of the backend goes to the dispatch.
    calls = []
    for name in ("grouped_fprop", "grouped_dgrad", "grouped_wgrad"):
        monkeypatch.setattr(fast_step, name, lambda *a, backend, _n=name: calls.append(_n))
    monkeypatch.setattr(fast_step, "swiglu_backward", lambda *a, **k: calls.append("act"))
    backend = BackendChoice("triton", "test", True, triton_kinds=("fprop", "dgrad", "wgrad"))
    for f in fast_step._gemm_calls(backend):
        f("A", "B", None)
    fast_step._activation_calls(ActivationChoice("triton", "test"), None)[1]("H", "DY", "P")
    assert calls == ["grouped_fprop", "grouped_dgrad", "grouped_wgrad", "act"]
    monkeypatch.undo()

    # The backward: under a trace, the recorded eager calls are not made.
    torch.manual_seed(0)
    block = _block(True)
    x, probs, split = _inputs()
    want = [fwd_bwd_step(block, x, probs, split) for _ in range(3)][-1]
    assert want[2]
    step = block.fusers()[0].__dict__["_fast_step"]

    def eager_call(*args):
        raise AssertionError("an eager entry point ran under a trace")

    for name in ("dgrad1", "wgrad1", "dgrad2", "wgrad2", "act_backward"):
        monkeypatch.setattr(step, name, eager_call)
    monkeypatch.setattr(fast_step, "tracing", lambda: True)
    got = fwd_bwd_step(block, x, probs, split)
    assert got[2] and torch.equal(got[0], want[0]) and _same(got[1], want[1])
    monkeypatch.setattr(fast_step, "tracing", lambda: False)
    with pytest.raises(AssertionError, match="eager entry point"):
        fwd_bwd_step(block, x, probs, split)


@pytest.mark.parametrize("layer,index", [(0, 2), (2, 3), (0, 0)])
def test_a_per_group_weight_cast_alone_takes_the_general_path_and_its_error(monkeypatch, layer,
                                                                           index):
    """Casting one per-expert weight (not only the first, which the key holds) sends the
    call to the general path, which names the weight, instead of running the fast path's
    kernels on a promoted stack (on CUDA: a Triton compile of mixed dtypes)."""
    from te_ops import fuser as fuser_mod

    torch.manual_seed(0)
    block = _block(False)
    x, probs, split = _inputs()
    assert [fwd_bwd_step(block, x, probs, split) for _ in range(2)][-1][2]
    w = getattr(block[layer], f"weight{index}")
    w.data = w.data.to(torch.float64)
    general = []
    run = fuser_mod.OperationFuser._run
    monkeypatch.setattr(fuser_mod.OperationFuser, "_run",
                        lambda self, *a, **k: general.append(1) or run(self, *a, **k))
    # weight0 cast alone: the input check names the odd weights, not the input
    match = (f"weight{index} is torch.float64" if index else
             "weight1 is torch.float32 on cpu, expected torch.float64 on cpu as weight0")
    with pytest.raises(ValueError, match=match):
        block(*block_args(block, x, probs, split))
    assert general == [1]
    w.data = w.data.to(torch.float32)  # cast back: the fast path again, same results
    assert fwd_bwd_step(block, x, probs, split)[2]


def test_stacking_per_group_weights_of_mixed_dtype_names_the_weight():
    """The kind behind the fast path's fault: torch.stack promoted mixed dtypes silently."""
    from te_ops.gemm.dispatch import stack_weights

    ws = [torch.zeros(3, 2) for _ in range(4)]
    ws[1] = ws[1].to(torch.float64)
    with pytest.raises(ValueError, match="weights\\[1\\] is torch.float64 on cpu, expected "
                                         "torch.float32"):
        stack_weights(ws)
