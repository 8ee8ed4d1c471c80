"""Graph safety on the GPU: no host sync in eager mode, and capture/replay matches eager.

* ``torch.cuda.set_sync_debug_mode("error")`` turns every host<->device synchronization into an
  error: the eager forward+backward of ``GroupedLinear -> ScaledSwiGLU -> GroupedLinear`` with
  device split sizes runs under it (fused and unfused), while the host-syncing variants raise.
* ``te_ops.graphs.make_graphed_callable`` captures forward and backward once; replays with
  routings the capture never saw (balanced, empty experts, padding rows, all tokens in one
  expert, skewed) give outputs and gradients (input, probs, every weight and bias) bitwise
  equal to an eager run of an identical module, padding rows are zero, and ``.grad`` tensors
  behave as in eager mode (accumulation, no aliasing of the graph's buffers).

Every test needs a GPU (``@pytest.mark.cuda``); the CPU side of the proof is
``test_graph_safety.py``.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA graph tests need a GPU (torch.cuda.is_available() is False)",
                allow_module_level=True)

import te_ops  # noqa: E402
from te_ops.graphs import graph_safe_unsupported_reason, make_graphed_callable  # noqa: E402

E, T, H, FF = 8, 1024, 256, 512
DEVICE = torch.device("cuda")
FUSION = pytest.mark.parametrize("fusion", ["0", "1"])
ROUTINGS = ["balanced", "empty_experts", "padding", "all_in_one", "skewed"]

pytestmark = pytest.mark.cuda


# ---------------------------------------------------------------------------- building blocks
def make_block(dtype: torch.dtype = torch.bfloat16, seed: int = 0,
               middle: torch.nn.Module | None = None) -> te_ops.Sequential:
    torch.manual_seed(seed)
    mods = [te_ops.GroupedLinear(E, H, 2 * FF, device=DEVICE, dtype=dtype),
            te_ops.ScaledSwiGLU()]
    if middle is not None:
        mods.append(middle)
    mods.append(te_ops.GroupedLinear(E, FF, H, device=DEVICE, dtype=dtype))
    return te_ops.Sequential(*mods)


def eager_twin(block: te_ops.Sequential, dtype: torch.dtype) -> te_ops.Sequential:
    twin = make_block(dtype, seed=1)
    twin.load_state_dict(block.state_dict())
    return twin


def routing(kind: str, seed: int) -> list[int]:
    """Host split sizes of one routing kind (generated on the host, copied once)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "balanced":
        return [T // E] * E
    if kind == "all_in_one":
        return [0] * (E - 3) + [T] + [0, 0]
    if kind == "empty_experts":
        weights = torch.ones(E)
        weights[[1, 4, 6]] = 0
        total = T
    elif kind == "padding":
        weights = torch.rand(E, generator=gen)
        weights[2] = 0
        total = T - 100
    else:  # skewed: Zipf-like popularity
        weights = 1.0 / torch.arange(1, E + 1, dtype=torch.float) ** 1.5
        total = T
    picks = torch.multinomial(weights, total, replacement=True, generator=gen)
    return torch.bincount(picks, minlength=E).tolist()


class Batch:
    """One step's inputs on the GPU: x, split sizes, probs and the output gradient."""

    def __init__(self, kind: str, seed: int, dtype: torch.dtype) -> None:
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.kind = kind
        self.sizes = routing(kind, seed)
        self.valid = sum(self.sizes)
        self.split = torch.tensor(self.sizes, dtype=torch.int64, device=DEVICE)
        self.x = torch.randn(T, H, generator=gen, device=DEVICE).to(dtype)
        self.probs = torch.rand(T, generator=gen, device=DEVICE)
        self.dy = torch.randn(T, H, generator=gen, device=DEVICE).to(dtype)

    def leaves(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.x.clone().requires_grad_(), self.probs.clone().requires_grad_())


def step(fn, module: torch.nn.Module, batch: Batch, *, zero: bool = True):
    """One forward+backward through ``fn``; returns (output, x.grad, probs.grad, param grads)."""
    if zero:
        module.zero_grad(set_to_none=True)
    x, probs = batch.leaves()
    y = fn(x, batch.split, probs, batch.split)
    out = y.detach().clone()
    y.backward(batch.dy)
    grads = {n: p.grad for n, p in module.named_parameters()}
    return out, x.grad, probs.grad, grads


def assert_same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, name
    if not torch.equal(got, want):
        diff = (got.float() - want.float()).abs().max().item()
        pytest.fail(f"{name}: graph replay differs from eager (max abs diff {diff})")


def sync_debug_errors():
    """Context: every host<->device sync raises inside (restores the previous mode)."""

    class _Mode:
        def __enter__(self):
            torch.cuda.synchronize()
            self.previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")

        def __exit__(self, *exc):
            torch.cuda.set_sync_debug_mode(self.previous)
            return False

    return _Mode()


# --------------------------------------------------------------------- (a) no sync, eagerly
@FUSION
def test_eager_forward_backward_does_not_sync(monkeypatch, fusion):
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = make_block()
    batches = [Batch(kind, seed, torch.bfloat16) for seed, kind in enumerate(ROUTINGS)]
    step(block, block, batches[0])  # one-time probes and the fuser plan
    leaves = [b.leaves() for b in batches]  # created before the checked region
    with sync_debug_errors():
        for b, (x, probs) in zip(batches, leaves):
            y = block(x, b.split, probs, b.split)
            y.backward(b.dy)
    torch.cuda.synchronize()
    assert all(x.grad is not None and p.grad is not None for x, p in leaves)


@pytest.mark.parametrize("variant", ["TE_OPS_GRAPH_SAFE=0", "host list"])
def test_sync_check_catches_host_syncing_variants(monkeypatch, variant):
    """Negative control: the debug mode does see the syncs of the non-graph-safe paths."""
    block = make_block()
    b = Batch("padding", 0, torch.bfloat16)
    split = b.sizes if variant == "host list" else b.split
    if variant == "TE_OPS_GRAPH_SAFE=0":
        monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "0")
    block(b.x, split, b.probs, split)  # warm-up
    with sync_debug_errors(), pytest.raises(RuntimeError, match="synchroniz"):
        block(b.x, split, b.probs, split)


# ------------------------------------------------------------- (b) capture, replay, compare
def _graphed_pair(dtype: torch.dtype):
    block = make_block(dtype)
    sample = Batch("balanced", 100, dtype)
    x, probs = sample.leaves()
    reason = graph_safe_unsupported_reason(block, x, sample.split, probs, sample.split)
    if reason is not None:
        pytest.skip(f"not graph-safe on this GPU: {reason}")
    graphed = make_graphed_callable(block, (x, sample.split, probs, sample.split))
    return block, graphed, eager_twin(block, dtype)


@FUSION
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
def test_replay_matches_eager_bitwise(monkeypatch, fusion, dtype):
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block, graphed, twin = _graphed_pair(dtype)
    kept: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    order = ROUTINGS + ROUTINGS[::-1]  # every routing twice, in different neighbourhoods
    for seed, kind in enumerate(order):
        b = Batch(kind, seed, dtype)
        got = step(graphed, block, b)
        want = step(twin, twin, b)
        for name, g, w in zip(("output", "x.grad", "probs.grad"), got[:3], want[:3]):
            assert_same(f"{kind}: {name}", g, w)
        assert set(got[3]) == set(want[3])
        for name in want[3]:
            assert_same(f"{kind}: {name}.grad", got[3][name], want[3][name])
        if b.valid < T:
            assert torch.count_nonzero(got[0][b.valid:]) == 0, "output padding rows"
            assert torch.count_nonzero(got[1][b.valid:]) == 0, "x.grad padding rows"
        # .grad tensors of earlier steps are not overwritten by later replays
        for name, ref, copy in kept:
            assert torch.equal(ref, copy), f"{name} changed after a later replay"
        kept = [(n, g, g.clone()) for n, g in got[3].items()]
    plan = block.fusers()[0].plan()  # the plan of the capture (replays do not re-plan)
    assert any(op.is_fused_op for op, _ in plan.forward_ops) == (fusion == "1")


def test_capture_runs_with_the_cyclic_collector_off(monkeypatch):
    """Warm-up and capture run with Python's collector off (a collection that frees an
    earlier capture's graph mid-capture invalidates the capture); it is on again after."""
    import gc

    seen: list[bool] = []
    real = torch.cuda.make_graphed_callables

    def recording(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", recording)
    _graphed_pair(torch.bfloat16)
    assert seen == [False] and gc.isenabled()


def test_replay_gradients_accumulate_like_eager():
    block, graphed, twin = _graphed_pair(torch.bfloat16)
    batches = [Batch(kind, seed, torch.bfloat16) for seed, kind in enumerate(ROUTINGS[:3])]
    block.zero_grad(set_to_none=True)
    twin.zero_grad(set_to_none=True)
    for b in batches:
        got = step(graphed, block, b, zero=False)
        want = step(twin, twin, b, zero=False)
    for name in want[3]:
        assert_same(f"accumulated {name}.grad", got[3][name], want[3][name])


def test_replay_without_grad_matches_eager_forward():
    block, graphed, twin = _graphed_pair(torch.bfloat16)
    for seed, kind in enumerate(ROUTINGS):
        b = Batch(kind, seed, torch.bfloat16)
        x, probs = b.leaves()
        with torch.no_grad():
            got = graphed(x, b.split, probs, b.split).clone()
            want = twin(x, b.split, probs, b.split)
        assert_same(f"{kind}: no-grad output", got, want)


def test_static_input_buffers_can_be_filled_in_place():
    block, graphed, twin = _graphed_pair(torch.bfloat16)
    b = Batch("padding", 7, torch.bfloat16)
    x_s, split_s, probs_s, _ = graphed.static_inputs
    with torch.no_grad():
        x_s.copy_(b.x)
        split_s.copy_(b.split)
        probs_s.copy_(b.probs)
    block.zero_grad(set_to_none=True)
    y = graphed(*graphed.static_inputs)
    want = twin(b.x, b.split, b.probs, b.split)
    assert_same("output (static inputs)", y.detach(), want.detach())
    graphed.check_parameters()
    # Same address, other dtype / shape: the captured kernels would read the bytes as before.
    w = block[0].weight
    for view in (w.data.view(torch.float16), w.data.view(w.shape[0], w.shape[2], w.shape[1])):
        orig = w.data
        w.data = view
        with pytest.raises(RuntimeError, match="dtype, shape or strides changed since capture"):
            graphed.check_parameters()
        w.data = orig
    graphed.check_parameters()


# ------------------------------------------------------------------------- refusals on GPU
def test_make_graphed_callable_refuses_host_lists_and_forbidden_env(monkeypatch):
    block = make_block()
    b = Batch("balanced", 0, torch.bfloat16)
    with pytest.raises(ValueError, match="split sizes as a 1-D integer tensor"):
        make_graphed_callable(block, (b.x, b.sizes, b.probs, b.sizes))
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "0")
    with pytest.raises(ValueError, match="TE_OPS_GRAPH_SAFE=0 forbids"):
        make_graphed_callable(block, (b.x, b.split, b.probs, b.split))


class _ItemOp(te_ops.BasicOperation):
    """A custom op that reads a device value on the host (``.item()``)."""

    def op_forward(self, ctx, input_, *, recipe=None):
        return input_ / (input_.abs().max().item() + 1.0)

    def op_backward(self, ctx, grad_output):
        return grad_output, []


def test_make_graphed_callable_sync_check_catches_custom_ops():
    block = make_block(middle=_ItemOp())
    b = Batch("balanced", 0, torch.bfloat16)
    assert graph_safe_unsupported_reason(block, b.x, b.split, b.probs, b.split) is None
    with pytest.raises(RuntimeError, match="synchronized the host"):
        make_graphed_callable(block, (b.x, b.split, b.probs, b.split))
