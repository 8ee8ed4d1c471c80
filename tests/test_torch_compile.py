"""te_ops under torch.compile: the gate, the explicit graph break, the eager run (issue 8).

The block does not trace whole yet (docs/torch_compile.md): these tests pin what holds today.
``fullgraph=True`` raises an error that names the gate's reason; without it the te_ops call
runs eagerly between compiled graphs (one warning per reason) and its outputs and gradients
are bit-identical to eager. Compiled code runs with ``backend="aot_eager"`` (no inductor, fast).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import te_ops
from te_ops.compile import TRACE_REASON

E, D, F = 4, 16, 32


def _block(dtype: torch.dtype) -> te_ops.Sequential:
    return te_ops.Sequential(
        te_ops.GroupedLinear(E, D, 2 * F), te_ops.ScaledSwiGLU(), te_ops.GroupedLinear(E, F, D)
    ).to(dtype)


def _inputs(dtype: torch.dtype, host: bool, rows: int = 12):
    sizes = [3, 0, 5, 2]  # 2 padding rows, one zero-token group
    x = torch.randn(rows, D, dtype=dtype, requires_grad=True)
    probs = torch.rand(rows, dtype=dtype, requires_grad=True)
    splits = sizes if host else torch.tensor(sizes)
    return x, splits, probs


def _run(fn, block, x, splits, probs):
    x = x.detach().clone().requires_grad_(True)
    probs = probs.detach().clone().requires_grad_(True)
    y = fn(x, splits, probs)
    y.backward(torch.ones_like(y))
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    return y.detach(), x.grad, probs.grad, grads


GATE_CASES = {
    "device_splits_bf16": (torch.bfloat16, False, TRACE_REASON),
    "host_list_splits": (torch.bfloat16, True, "split sizes given as a host list"),
    "float32_cpu": (torch.float32, False, "float32 on CPU: torch._grouped_mm's own fake"),
}


@pytest.mark.parametrize("case", list(GATE_CASES))
def test_fullgraph_error_names_the_gate_reason(case: str) -> None:
    dtype, host, expected = GATE_CASES[case]
    block = _block(dtype)
    x, splits, probs = _inputs(dtype, host)
    reason = te_ops.compile_unsupported_reason(block, x, splits, probs, splits)
    assert expected in reason and TRACE_REASON in reason
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, s, p: block(a, s, p, s), fullgraph=True,
                             backend="aot_eager")
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        compiled(x, splits, probs)
    assert expected in str(info.value)
    assert TRACE_REASON in str(info.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("host", [False, True], ids=["device_splits", "host_list"])
def test_compiled_region_runs_block_eagerly_bit_exact(dtype: torch.dtype, host: bool) -> None:
    block = _block(dtype)
    x, splits, probs = _inputs(dtype, host)

    def fn(a, s, p):
        return torch.nn.functional.gelu(block(a * 2, s, p, s)) + 1

    ref = _run(fn, block, x, splits, probs)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _run(compiled, block, x, splits, probs)
        got2 = _run(compiled, block, x, splits, probs)
    for out in (got, got2):
        for a, b in zip((*ref[:3], *ref[3]), (*out[:3], *out[3])):
            assert torch.equal(a, b)
    eager_warnings = [w for w in caught if "runs eagerly under torch.compile" in str(w.message)]
    reason = te_ops.compile_unsupported_reason(block, x, splits, probs, splits)
    assert len([w for w in eager_warnings if reason in str(w.message)]) <= 1
    assert all(reason in str(w.message) or "te_ops" in str(w.message) for w in eager_warnings)


def test_eager_warning_names_the_reason_once() -> None:
    from te_ops import compile as te_compile

    te_compile._WARNED.clear()
    block = _block(torch.bfloat16)
    x, splits, probs = _inputs(torch.bfloat16, host=False)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, s, p: block(a, s, p, s), backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            compiled(x, splits, probs)
    msgs = [str(w.message) for w in caught if "runs eagerly under torch.compile" in str(w.message)]
    assert len(msgs) == 1
    assert TRACE_REASON in msgs[0] and "GroupedLinear/ScaledSwiGLU/GroupedLinear" in msgs[0]


def test_eager_call_has_no_gate_cost() -> None:
    """Outside torch.compile the gate is one ``torch.compiler.is_compiling()`` check: no
    warning, no graph-break machinery."""
    block = _block(torch.bfloat16)
    x, splits, probs = _inputs(torch.bfloat16, host=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        block(x, splits, probs, splits)


def test_compile_unsupported_reason_rejects_non_te_ops_module() -> None:
    with pytest.raises(TypeError, match="module: expected a te_ops.Sequential"):
        te_ops.compile_unsupported_reason(torch.nn.Linear(2, 2))


# --------------------------------------------------------------------------- framework test
# The boundary the whole-block design needs (docs/torch_compile.md): a custom op taking a list
# of optional tensors returns one gradient per list element, eager and compiled fullgraph.
# torch 2.13's register_autograd treats a list holding a None as one opaque input (no
# per-element gradients), so None crosses as a 0-element sentinel tensor, as in TE's
# GroupedLinear custom op.


def _sentinel(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0)


@torch.library.custom_op("te_ops_test::weighted_sum", mutates_args=())
def _weighted_sum_op(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    out = x.clone()
    for k, w in enumerate(ws):
        if w.numel():
            out = out + (k + 1) * w * x
    return out


@_weighted_sum_op.register_fake
def _(x, ws):
    return torch.empty_like(x)


def _ws_setup(ctx, inputs, output):
    x, ws = inputs
    ctx.save_for_backward(x, *ws)


def _ws_backward(ctx, grad):
    x, *ws = ctx.saved_tensors
    dx = grad.clone()
    dws: list[torch.Tensor | None] = []
    for k, w in enumerate(ws):
        if not w.numel():
            dws.append(None)
            continue
        dx = dx + (k + 1) * w * grad
        dws.append((k + 1) * grad * x)
    return dx, dws


_weighted_sum_op.register_autograd(_ws_backward, setup_context=_ws_setup)


def _weighted_sum(x: torch.Tensor, ws: list[torch.Tensor | None]) -> torch.Tensor:
    return _weighted_sum_op(x, [_sentinel(x) if w is None else w for w in ws])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_custom_op_optional_tensor_list_one_grad_per_element(compiled: bool) -> None:
    x = torch.randn(5, requires_grad=True)
    w0 = torch.randn(5, requires_grad=True)
    w2 = torch.randn(5, requires_grad=True)

    def fn(x, w0, w2):
        return _weighted_sum(x, [w0, None, w2])

    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    fn(x, w0, w2).sum().backward()
    xd = x.detach()
    assert torch.equal(w0.grad, xd)
    assert torch.equal(w2.grad, 3 * xd)
    assert torch.allclose(x.grad, 1 + w0.detach() + 3 * w2.detach())
