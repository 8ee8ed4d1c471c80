"""Opt-in fc1 recompute (``ScaledSwiGLU(recompute_input=True)``) on CUDA.

Realistic magnitudes (inputs ~ N(0, 1), weights at init scale, probs ~ U(0, 1)), device split
sizes with padding rows and an empty expert: with the option on, all four fused x unfused
pairings are bitwise equal to the option off (the recomputed h is the forward's GEMM on the same
operands, CUTLASS ``grouped_mm`` and the Triton few-rows GEMMs alike) and match the fp64
reference; the eager step does not sync; a CUDA-graph capture with the option on replays
bitwise equal to eager; ``torch.compile(fullgraph=True)`` too.
"""

from __future__ import annotations

import itertools

import pytest
import reference as ref
import torch
from fusion_env import set_grouped_mlp

if not torch.cuda.is_available():
    pytest.skip("CUDA tests need a GPU (torch.cuda.is_available() is False)",
                allow_module_level=True)

import te_ops  # noqa: E402
from te_ops.graphs import graph_safe_unsupported_reason, make_graphed_callable  # noqa: E402

pytestmark = pytest.mark.cuda

#: (experts, rows, hidden, ffn, split sizes): a CUTLASS shape with padding rows and an empty
#: expert, and a decode-like shape whose few rows per expert take the Triton GEMMs.
SHAPES = {
    "grouped_mm": (4, 300, 256, 128, [70, 0, 130, 61]),
    "triton_rows": (16, 64, 256, 128, [4, 0, 6, 2, 4, 4, 3, 5, 4, 4, 1, 7, 4, 4, 4, 2]),
}


def _block(shape, dtype, recompute: bool, bias: bool = False, seed: int = 0):
    e, _, h, ff, _ = shape
    torch.manual_seed(seed)
    kw = {"bias": bias, "device": "cuda", "dtype": dtype}
    return te_ops.Sequential(te_ops.GroupedLinear(e, h, 2 * ff, **kw),
                             te_ops.ScaledSwiGLU(recompute_input=recompute),
                             te_ops.GroupedLinear(e, ff, h, **kw))


def _inputs(shape, dtype, seed: int = 7):
    e, rows, h, _, sizes = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, h, device="cuda", dtype=dtype, generator=gen)
    probs = torch.rand(rows, device="cuda", generator=gen)
    dy = torch.randn(rows, h, device="cuda", dtype=dtype, generator=gen)
    return x, probs, dy, torch.tensor(sizes, device="cuda")


def _run(fn, blk, x, probs, dy, split):
    blk.zero_grad(set_to_none=True)
    xl, pl = x.clone().requires_grad_(), probs.clone().requires_grad_()
    y = fn(xl, split, pl, split)
    out = y.detach().clone()
    y.backward(dy)
    grads = {"x": xl.grad, "probs": pl.grad}
    grads.update({n: p.grad.clone() for n, p in blk.named_parameters()})
    return out, grads


def _assert_same(a, b, what):
    assert torch.equal(a[0], b[0]), f"{what}: output"
    for k in b[1]:
        assert torch.equal(a[1][k], b[1][k]), f"{what}: grad {k}"


def _reference(blk, shape, x, probs, dy):
    e, _, _, _, sizes = shape
    return ref.block_forward_backward(blk, e, sizes, x, probs, dy)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_four_combinations_bitwise_vs_option_off_and_fp64(monkeypatch, shape_name, bias):
    shape, dtype = SHAPES[shape_name], torch.bfloat16
    master = _block(shape, dtype, False, bias)
    x, probs, dy, split = _inputs(shape, dtype)
    set_grouped_mlp(monkeypatch, False, False)
    off = _run(master, master, x, probs, dy, split)
    y_ref, g_ref = _reference(master, shape, x, probs, dy)
    for fwd, bwd in itertools.product((True, False), repeat=2):
        set_grouped_mlp(monkeypatch, fwd, bwd)
        blk = _block(shape, dtype, True, bias, seed=1)
        blk.load_state_dict(master.state_dict())
        torch.cuda.empty_cache()
        if fwd:
            got = _run(blk, blk, x, probs, dy, split)
        else:
            with pytest.warns(UserWarning, match="not honoured"):
                got = _run(blk, blk, x, probs, dy, split)
        _assert_same(got, off, f"recompute on {(fwd, bwd)} vs off")
        ref.assert_close(got[0], y_ref, dtype, "output")
        for k, g in g_ref.items():
            ref.assert_close(got[1][k], g, dtype, f"grad {k}")
        rec = [r for r in blk[1].dispatch_records() if r.startswith("fc1 recompute")]
        assert rec[0].startswith("fc1 recompute: on" if fwd else "fc1 recompute: off"), rec


def test_eager_step_does_not_sync():
    shape = SHAPES["grouped_mm"]
    blk = _block(shape, torch.bfloat16, True)
    x, probs, dy, split = _inputs(shape, torch.bfloat16)
    _run(blk, blk, x, probs, dy, split)  # probes, plan
    xl, pl = x.clone().requires_grad_(), probs.clone().requires_grad_()
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        blk(xl, split, pl, split).backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    assert xl.grad is not None and pl.grad is not None


@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_graph_replay_bitwise_equal_to_eager(shape_name):
    shape, dtype = SHAPES[shape_name], torch.bfloat16
    blk = _block(shape, dtype, True)
    x, probs, dy, split = _inputs(shape, dtype)
    xs, ps = x.clone().requires_grad_(), probs.clone().requires_grad_()
    reason = graph_safe_unsupported_reason(blk, xs, split, ps, split)
    if reason is not None:
        pytest.skip(f"not graph-safe on this GPU: {reason}")
    graphed = make_graphed_callable(blk, (xs, split, ps, split))
    off = _block(shape, dtype, False, seed=1)
    off.load_state_dict(blk.state_dict())
    for seed in (11, 12):
        xi, pi, dyi, _ = _inputs(shape, dtype, seed)
        got = _run(graphed, blk, xi, pi, dyi, split)
        _assert_same(got, _run(off, off, xi, pi, dyi, split), f"seed {seed}: graph vs eager off")
    assert any(r.startswith("fc1 recompute: on") for r in blk[1].dispatch_records())


def test_torch_compile_fullgraph_bitwise_equal_to_eager():
    shape, dtype = SHAPES["grouped_mm"], torch.bfloat16
    blk = _block(shape, dtype, True)
    off = _block(shape, dtype, False, seed=1)
    off.load_state_dict(blk.state_dict())
    compiled = torch.compile(lambda *a: blk(*a), fullgraph=True, backend="aot_eager")
    x, probs, dy, split = _inputs(shape, dtype)
    _assert_same(_run(compiled, blk, x, probs, dy, split), _run(off, off, x, probs, dy, split),
                 "compiled, option on vs eager off")
