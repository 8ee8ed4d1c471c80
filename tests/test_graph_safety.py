"""Graph safety on the CPU: the meta-device proof, the gate and the capture helper's checks.

The meta-device proof
---------------------
A ``meta`` tensor has a shape, a dtype and no data. Every host read of device data -
``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero()``, ``bool(tensor)`` in a Python branch -
raises on it. So running the whole forward *and* backward of the MoE block with every tensor on
``meta`` proves, on a CPU-only CI machine, that the path reads no device value on the host:
the property that lets the block be captured in a CUDA graph. ``TE_OPS_GRAPH_SAFE=1`` is set so
that a fallback to a host-syncing backend raises instead of being taken silently. The negative
tests show the check has teeth: host-syncing variants fail it.

The GPU side of the proof (capture, replay, ``set_sync_debug_mode``) is in
``test_cuda_graphs.py``.
"""

from __future__ import annotations

import pytest
import torch

import te_ops
from te_ops.graphs import (
    GraphedCallable,
    _LeafGradGuard,
    graph_safe_unsupported_reason,
    make_graphed_callable,
)

E, T, H, FF = 4, 64, 32, 48
FUSION = pytest.mark.parametrize("fusion", ["0", "1"])
META_ERRORS = (RuntimeError, NotImplementedError)


def make_block(*, device="cpu", dtype=torch.bfloat16, bias=True, hidden=H, ffn=FF,
               middle: torch.nn.Module | None = None) -> te_ops.Sequential:
    """fc1 (H -> 2FF) -> ScaledSwiGLU [-> middle] -> fc2 (FF -> H)."""
    mods = [te_ops.GroupedLinear(E, hidden, 2 * ffn, bias=bias, device=device, dtype=dtype),
            te_ops.ScaledSwiGLU()]
    if middle is not None:
        mods.append(middle)
    mods.append(te_ops.GroupedLinear(E, ffn, hidden, bias=bias, device=device, dtype=dtype))
    return te_ops.Sequential(*mods)


def inputs(device="cpu", dtype=torch.bfloat16, lead=(T,), hidden=H):
    """x (lead..., H) and probs (tokens,) requiring grad; int64 split sizes with an empty group
    and padding rows (sum < tokens)."""
    tokens = 1
    for d in lead:
        tokens *= d
    x = torch.randn(*lead, hidden, dtype=dtype).to(device).requires_grad_()
    sizes = torch.tensor([tokens // 2, 0, tokens // 4, tokens // 8], dtype=torch.int64)
    probs = torch.rand(tokens).to(device).requires_grad_()
    return x, sizes.to(device), probs


# ----------------------------------------------------------------------- the meta-device proof
@FUSION
@pytest.mark.parametrize("build", ["device='meta'", "module.to('meta')"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(T,), (2, T // 2)])
def test_meta_forward_backward_reads_no_device_value(monkeypatch, fusion, build, bias, lead):
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "1")  # any host-syncing fallback raises
    if build == "device='meta'":
        block = make_block(device="meta", bias=bias)
    else:
        block = make_block(bias=bias).to("meta")
    x, sizes, probs = inputs("meta", lead=lead)
    assert graph_safe_unsupported_reason(block, x, sizes, probs, sizes) is None

    y = block(x, sizes, probs, sizes)
    y.backward(torch.empty_like(y))

    assert (y.device.type, y.dtype, tuple(y.shape)) == ("meta", torch.bfloat16, (*lead, H))
    assert x.grad is not None and x.grad.shape == x.shape and x.grad.device.type == "meta"
    assert probs.grad is not None and probs.grad.shape == probs.shape
    for name, p in block.named_parameters():
        assert p.grad is not None, name
        assert (p.grad.shape, p.grad.device.type) == (p.shape, "meta"), name
    plan = block.fusers()[0].plan(x, sizes, probs, sizes)
    fused = [op.is_fused_op for op, _ in plan.forward_ops + plan.backward_ops]
    assert any(fused) == (fusion == "1")


@FUSION
def test_meta_forward_only(monkeypatch, fusion):
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "1")
    block = make_block(device="meta")
    x, sizes, probs = inputs("meta")
    with torch.no_grad():
        y = block(x, sizes, probs, sizes)
    assert y.shape == (T, H) and y.device.type == "meta"


def _assert_meta_call_raises(match: str) -> None:
    """The block on the meta device (no values) called under the test's variables: one of
    ``META_ERRORS`` with ``match`` (a path that reads the split sizes on the host)."""
    block = make_block(device="meta")
    x, sizes, probs = inputs("meta")
    with pytest.raises(META_ERRORS, match=match):
        block(x, sizes, probs, sizes)


@FUSION
def test_meta_graph_safe_forbidden_fails(monkeypatch, fusion):
    """TE_OPS_GRAPH_SAFE=0 takes the per-group loop, which copies split sizes to the host."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "0")
    _assert_meta_call_raises("meta device have no values to copy to the host")


def test_meta_loop_backend_fails(monkeypatch):
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "loop")
    _assert_meta_call_raises("meta device have no values to copy to the host")


def test_meta_eager_split_size_check_fails(monkeypatch):
    """TE_OPS_CHECK_SPLIT_SIZES=1 trades graph safety for a readable error: it reads the sizes."""
    monkeypatch.setenv("TE_OPS_CHECK_SPLIT_SIZES", "1")
    _assert_meta_call_raises("meta tensor")


def test_meta_host_list_is_refused_when_graph_safe_forced(monkeypatch):
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "1")
    block = make_block(device="meta")
    x, _, probs = inputs("meta")
    sizes = [T // 2, 0, T // 4, T // 8]
    with pytest.raises(RuntimeError, match="host list"):
        block(x, sizes, probs, sizes)


class _HostSyncingOp(te_ops.BasicOperation):
    """A custom op that reads a device value on the host, in one of three ways."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def op_forward(self, ctx, input_, *, recipe=None):
        if self.how == "item":
            return input_ / (input_.abs().max().item() + 1.0)
        if self.how == "branch":
            return input_ * 2 if input_.sum() > 0 else input_
        out = input_.clone()
        out[(input_ > 0).nonzero(as_tuple=True)] = 0  # a data-dependent shape in between
        return out

    def op_backward(self, ctx, grad_output):
        return grad_output, []


@pytest.mark.parametrize("how", ["item", "branch", "nonzero"])
def test_meta_custom_host_syncing_op_fails(monkeypatch, how):
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "1")
    block = make_block(device="meta", middle=_HostSyncingOp(how))
    x, sizes, probs = inputs("meta")
    with pytest.raises(META_ERRORS):
        block(x, sizes, probs, sizes)
    # The same block runs on real CPU tensors: a CPU run alone cannot see a host sync.
    block = make_block(middle=_HostSyncingOp(how))
    x, sizes, probs = inputs()
    block(x, sizes, probs, sizes)


def test_meta_tensor_host_reads_raise():
    """The premise of the proof, checked against the installed torch."""
    t = torch.empty(4, dtype=torch.int64, device="meta")
    for read in (t.tolist, lambda: t.sum().item(), t.cpu, t.nonzero, lambda: bool(t.sum())):
        with pytest.raises(META_ERRORS):
            read()


# -------------------------------------------------------------------------------- the gate
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gate_device_split_sizes_is_graph_safe(dtype):
    block = make_block(dtype=dtype)
    x, sizes, probs = inputs(dtype=dtype)
    assert graph_safe_unsupported_reason(block, x, sizes, probs, sizes) is None
    assert graph_safe_unsupported_reason(block[0], x, sizes) is None


def test_gate_host_list_names_split_sizes():
    block = make_block()
    x, sizes, probs = inputs()
    host = sizes.tolist()
    reason = graph_safe_unsupported_reason(block, x, host, probs, host)
    assert reason is not None
    assert "op 0" in reason and "split_sizes" in reason and "host list" in reason
    reason = graph_safe_unsupported_reason(block, x, sizes, probs, host)
    assert reason is not None and reason.startswith("op 2") and "split_sizes" in reason


def test_gate_misaligned_dims_mention_alignment():
    block = make_block(hidden=20)  # 20 x 2 bytes is not a multiple of 16
    x, sizes, probs = inputs(hidden=20)
    reason = graph_safe_unsupported_reason(block, x, sizes, probs, sizes)
    assert reason is not None and "in_features=20" in reason and "16 bytes" in reason
    assert "aligned" in reason


def test_gate_env_forbids(monkeypatch):
    block = make_block()
    x, sizes, probs = inputs()
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "0")
    reason = graph_safe_unsupported_reason(block, x, sizes, probs, sizes)
    assert reason is not None and "TE_OPS_GRAPH_SAFE=0 forbids" in reason


def test_gate_forced_loop_backend(monkeypatch):
    block = make_block()
    x, sizes, probs = inputs()
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "loop")
    reason = graph_safe_unsupported_reason(block, x, sizes, probs, sizes)
    assert reason is not None and "loop" in reason and "TE_OPS_GROUPED_GEMM_BACKEND" in reason


def test_gate_graph_safe_forced_reports_the_dispatch_error(monkeypatch):
    block = make_block(hidden=20)
    x, sizes, probs = inputs(hidden=20)
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "1")
    reason = graph_safe_unsupported_reason(block, x, sizes, probs, sizes)
    assert reason is not None and "TE_OPS_GRAPH_SAFE=1" in reason and "16 bytes" in reason


def test_gate_eager_split_size_check(monkeypatch):
    block = make_block()
    x, sizes, probs = inputs()
    monkeypatch.setenv("TE_OPS_CHECK_SPLIT_SIZES", "1")
    reason = graph_safe_unsupported_reason(block, x, sizes, probs, sizes)
    assert reason is not None and "TE_OPS_CHECK_SPLIT_SIZES=1" in reason


def test_gate_extra_inputs_on_another_device():
    block = make_block()
    x, sizes, probs = inputs()
    reason = graph_safe_unsupported_reason(block, x, sizes.to("meta"), probs, sizes)
    assert reason is not None and "op 0" in reason and "split_sizes is on meta" in reason
    reason = graph_safe_unsupported_reason(block, x, sizes, probs.to("meta"), sizes)
    assert reason is not None and "op 1" in reason and "probs is on meta" in reason


def test_gate_skips_plain_modules_and_counts_positions():
    block = make_block(middle=torch.nn.Identity())
    x, sizes, probs = inputs()
    assert graph_safe_unsupported_reason(block, x, sizes, probs, sizes) is None
    reason = graph_safe_unsupported_reason(block, x, sizes, probs, sizes.tolist())
    assert reason is not None and reason.startswith("op 3 (GroupedLinear")


def test_gate_argument_errors():
    block = make_block()
    x, sizes, probs = inputs()
    with pytest.raises(ValueError, match="extra_inputs: expected 3"):
        graph_safe_unsupported_reason(block, x, sizes, probs)
    with pytest.raises(TypeError, match="module must be a te_ops"):
        graph_safe_unsupported_reason(torch.nn.Linear(H, H), x)
    with pytest.raises(TypeError, match="input_ must be a torch.Tensor"):
        graph_safe_unsupported_reason(block, [1.0], sizes, probs, sizes)


@pytest.mark.parametrize("case", ["device", "host_list", "misaligned", "loop"])
def test_gate_agrees_with_the_ops(monkeypatch, case):
    """Gate says None  <=>  the block runs with TE_OPS_GRAPH_SAFE=1 (which raises otherwise)."""
    hidden = 20 if case == "misaligned" else H
    block = make_block(hidden=hidden)
    x, sizes, probs = inputs(hidden=hidden)
    split = sizes.tolist() if case == "host_list" else sizes
    if case == "loop":
        monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "loop")
    reason = graph_safe_unsupported_reason(block, x, split, probs, split)
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "1")
    if reason is None:
        block(x, split, probs, split).backward(torch.ones(T, H, dtype=x.dtype))
    else:
        with pytest.raises(RuntimeError, match="TE_OPS_GRAPH_SAFE=1"):
            block(x, split, probs, split)


# ------------------------------------------------------------------- the capture helper (CPU)
def test_make_graphed_callable_argument_errors():
    block = make_block()
    x, sizes, probs = inputs()
    with pytest.raises(TypeError, match="module must be a te_ops"):
        make_graphed_callable(torch.nn.Linear(H, H), (x,))
    with pytest.raises(TypeError, match="sample_inputs must be a non-empty tuple"):
        make_graphed_callable(block, x)
    with pytest.raises(ValueError, match="num_warmup_iters"):
        make_graphed_callable(block, (x, sizes, probs, sizes), num_warmup_iters=0)
    with pytest.raises(ValueError, match=r"host list.*split sizes as a 1-D integer tensor"):
        make_graphed_callable(block, (x, sizes.tolist(), probs, sizes.tolist()))
    with pytest.raises(TypeError, match=r"sample_inputs\[2\] must be a torch.Tensor"):
        make_graphed_callable(block, (x, sizes, 0.5, sizes))


def test_capture_pauses_the_cyclic_collector_after_collecting():
    """``_gc_paused`` (around ``torch.cuda.make_graphed_callables``): cyclic garbage made
    before it is collected on entry, the collector is off inside and back on after, also when
    the block raises; a collector the caller had turned off stays off."""
    import gc
    import weakref

    from te_ops.graphs import _gc_paused

    class Node:
        pass

    assert gc.isenabled()
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    alive = weakref.ref(a)
    del a, b
    with _gc_paused():
        assert alive() is None and not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="capture failed"):
        with _gc_paused():
            raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with _gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_make_graphed_callable_needs_cuda():
    block = make_block()
    x, sizes, probs = inputs()
    expected = ValueError if torch.cuda.is_available() else RuntimeError
    with pytest.raises(expected, match="CUDA"):
        make_graphed_callable(block, (x, sizes, probs, sizes))


class _FakeGraphed(torch.autograd.Function):
    """Stands in for torch.cuda.make_graphed_callables' node: ``y = x * w`` whose backward
    writes the gradients into static buffers and returns views of them, as a replay does."""

    @staticmethod
    def forward(ctx, static, x, w):
        ctx.static, ctx.x, ctx.w = static, x.detach(), w.detach()
        return x * w

    @staticmethod
    def backward(ctx, g):
        static = ctx.static
        static["x"].copy_(g * ctx.w)
        static["w"].copy_(g * ctx.x)
        return None, static["x"].detach(), static["w"].detach()


def _fake_graphed_callable():
    w = torch.nn.Parameter(torch.randn(8))
    module = te_ops.Identity()
    module.w = w
    static = {"x": torch.zeros(8), "w": torch.zeros(8)}
    graphed = GraphedCallable(module, (torch.zeros(8, requires_grad=True),), [0], (w,),
                              lambda x, w_: _FakeGraphed.apply(static, x, w_))
    return graphed, w, static


def test_leaf_grads_do_not_alias_static_buffers_and_accumulate():
    """pytorch/pytorch#181723: a returned static gradient must not become ``.grad``."""
    graphed, w, static = _fake_graphed_callable()
    xs = [torch.randn(8, requires_grad=True) for _ in range(2)]
    gs = [torch.randn(8) for _ in range(2)]
    for x, g in zip(xs, gs):
        graphed(x).backward(g)
    assert w.grad.untyped_storage().data_ptr() != static["w"].untyped_storage().data_ptr()
    assert torch.equal(w.grad, gs[0] * xs[0].detach() + gs[1] * xs[1].detach())
    for x, g in zip(xs, gs):
        assert torch.equal(x.grad, g * w.detach())
        assert x.grad.untyped_storage().data_ptr() != static["x"].untyped_storage().data_ptr()
    kept = w.grad
    w.grad = None
    graphed(xs[0]).backward(gs[0])
    assert torch.equal(kept, gs[0] * xs[0].detach() + gs[1] * xs[1].detach())


def test_leaf_grad_guard_adds_in_place_into_existing_grad():
    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.full((3,), 2.0)
    buffer = w.grad
    (guarded,) = _LeafGradGuard.apply(w)
    (guarded * 3).sum().backward()
    assert w.grad is buffer and torch.equal(w.grad, torch.full((3,), 5.0))


class _ViewsOfOneBuffer(torch.autograd.Function):
    """Returns, as gradients, views of one static (n, 2, 3) buffer (like a GroupedLinear wgrad
    unbound per expert)."""

    @staticmethod
    def forward(ctx, static, *ws):
        ctx.static = static
        return torch.zeros(())

    @staticmethod
    def backward(ctx, g):
        return (None, *(v.detach() for v in ctx.static.unbind(0)))


def test_leaf_grad_guard_copies_each_buffer_once():
    ws = [torch.nn.Parameter(torch.zeros(2, 3)) for _ in range(4)]
    ws[2].grad = torch.ones(2, 3)
    static = torch.arange(24.0).view(4, 2, 3)
    _ViewsOfOneBuffer.apply(static, *_LeafGradGuard.apply(*ws)).backward()
    expected = static.clone()
    static.zero_()  # the next replay overwrites the buffer
    for i, w in enumerate(ws):
        assert torch.equal(w.grad, expected[i] + (1 if i == 2 else 0))
    storages = {w.grad.untyped_storage().data_ptr() for i, w in enumerate(ws) if i != 2}
    assert len(storages) == 1 and static.untyped_storage().data_ptr() not in storages


def test_graphed_callable_input_checks():
    block = make_block()
    x, sizes, probs = inputs()
    calls = []
    graphed = GraphedCallable(block, (x, sizes, probs, sizes), [0, 1, 2, 1], (),
                              lambda *a: calls.append(a))
    x2 = torch.randn_like(x).requires_grad_()
    graphed(x2, sizes, probs, sizes)
    assert len(calls) == 1 and len(calls[0]) == 3 and calls[0][1] is sizes
    with pytest.raises(ValueError, match="captured with 4 inputs, got 3"):
        graphed(x2, sizes, probs)
    with pytest.raises(TypeError, match=r"inputs\[1\].*split sizes as a tensor"):
        graphed(x2, sizes.tolist(), probs, sizes)
    with pytest.raises(ValueError, match=r"inputs\[0\] must match.*fixed shapes"):
        graphed(x2[:-1], sizes, probs, sizes)
    with pytest.raises(ValueError, match=r"inputs\[0\] must match"):
        graphed(x2.float(), sizes, probs, sizes)
    with pytest.raises(ValueError, match=r"inputs\[2\]\.requires_grad must be True"):
        graphed(x2, sizes, probs.detach(), sizes)
    with torch.no_grad():  # nothing is differentiated: requires_grad may differ
        graphed(x2.detach(), sizes, probs.detach(), sizes)
    with pytest.raises(ValueError, match=r"inputs\[3\] must be the same tensor object"):
        graphed(x2, sizes, probs, sizes.clone())


def _emulated_make_graphed_callables(func, sample_args, num_warmup_iters=3, pool=None,
                                     allow_unused_input=False):
    """torch.cuda.make_graphed_callables' contract, run eagerly on the CPU: static input
    buffers (the sample args), outputs detached, and a backward that writes the gradients into
    static buffers and returns views of them."""
    static_in = tuple(sample_args)
    state: dict = {}

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            for buf, arg in zip(static_in, args):
                if buf.data_ptr() != arg.data_ptr():
                    buf.copy_(arg)
            with torch.enable_grad():
                out = func(*static_in)
            state["tuple"] = isinstance(out, tuple)
            state["out"] = out if state["tuple"] else (out,)
            detached = tuple(o.detach() for o in state["out"])
            return detached if state["tuple"] else detached[0]

        @staticmethod
        def backward(ctx, *grad):
            wrt = [t for t in static_in if t.requires_grad]
            grads = torch.autograd.grad(state["out"], wrt, grad, allow_unused=allow_unused_input)
            bufs = state.setdefault("grads", [None if g is None else torch.empty_like(g)
                                              for g in grads])
            for buf, g in zip(bufs, grads):
                if g is not None:
                    buf.copy_(g)
            it = iter(bufs)
            return tuple(_detached(next(it)) if t.requires_grad else None for t in static_in)

    return lambda *args: Graphed.apply(*args)


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


@FUSION
def test_make_graphed_callable_end_to_end_with_emulated_graphs(monkeypatch, fusion):
    """The wrapper's own logic (buffers, aliasing, parameter plumbing, gradient hand-off) on
    the CPU, with torch's graph machinery replaced by an eager emulation of its contract."""
    import te_ops.graphs as graphs

    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    monkeypatch.setattr(graphs, "_check_sample_inputs", lambda s: tuple(s))
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", _emulated_make_graphed_callables)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    block, twin = make_block(), make_block()
    twin.load_state_dict(block.state_dict())
    x, sizes, probs = inputs()
    graphed = make_graphed_callable(block, (x, sizes, probs, sizes), check_sync=False)
    assert graphed.static_inputs[1] is graphed.static_inputs[3]
    assert graphed.static_inputs[0] is not x  # the caller's tensors are not the buffers

    for m in (block, twin):
        m.zero_grad(set_to_none=True)
    for step, split in enumerate(([32, 0, 16, 8], [0, 64, 0, 0], [10, 10, 10, 10]) * 2):
        if step == 3:  # then accumulate over the last three steps
            for m in (block, twin):
                m.zero_grad(set_to_none=True)
        s = torch.tensor(split)
        xs, ps, dy = torch.randn(T, H).bfloat16(), torch.rand(T), torch.randn(T, H).bfloat16()
        outs = []
        for fn in (graphed, twin):
            xl, pl = xs.clone().requires_grad_(), ps.clone().requires_grad_()
            y = fn(xl, s, pl, s)
            outs.append((y.detach().clone(), xl, pl))
            y.backward(dy)
        (y_g, x_g, p_g), (y_e, x_e, p_e) = outs
        assert torch.equal(y_g, y_e)
        assert torch.equal(x_g.grad, x_e.grad) and torch.equal(p_g.grad, p_e.grad)
        for (name, a), b in zip(block.named_parameters(), twin.parameters()):
            assert torch.equal(a.grad, b.grad), f"step {step}: {name}"
    assert any(op.is_fused_op for op, _ in block.fusers()[0].plan().forward_ops) == (
        fusion == "1")
    graphed.check_parameters()
    with torch.no_grad():
        block[0].weight.data = block[0].weight.data.clone()
    with pytest.raises(RuntimeError, match="storage, dtype, shape or strides changed since"):
        graphed.check_parameters()


def test_leaf_grad_guard_whole_buffer_gradient_is_one_copy():
    """A gradient that is its whole buffer (an input's: x, probs) is copied by one clone; a
    later view of the same buffer shares that copy, and nothing aliases the static buffer."""
    x = torch.zeros(4, 3, requires_grad=True)
    static = torch.arange(12.0).view(4, 3)

    class _Whole(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return torch.zeros(())

        @staticmethod
        def backward(ctx, g):
            return static.detach()

    _Whole.apply(*_LeafGradGuard.apply(x)).backward()
    expected = static.clone()
    static.zero_()  # the next replay overwrites the buffer
    assert torch.equal(x.grad, expected) and x.grad.is_contiguous()
    assert x.grad.untyped_storage().data_ptr() != static.untyped_storage().data_ptr()
