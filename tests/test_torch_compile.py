"""te_ops under torch.compile: the whole block as one graph, bit-exact with eager.

The matrix runs with ``backend="aot_eager"`` (AOTAutograd, the same kernels as eager, no
inductor codegen: fast, and bit-exact by construction); two small tests use the default
inductor backend. Counters come from ``torch._dynamo.testing.CompileCounterWithBackend``
(``frame_count``: compiled graphs, recompiles included) and ``torch._dynamo.utils.counters``
(graph breaks).
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import pytest
import torch
from fusion_env import set_grouped_mlp
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import te_ops

E, D, F = 4, 16, 32
ROUTINGS = ([3, 0, 5, 2], [1, 1, 1, 7], [0, 0, 10, 0], [2, 2, 2, 2], [5, 5, 0, 0])


def _block(kind: str, dtype: torch.dtype) -> te_ops.Sequential:
    if kind == "mlp":
        ops = [te_ops.GroupedLinear(E, D, 2 * F), te_ops.ScaledSwiGLU(),
               te_ops.GroupedLinear(E, F, D)]
    elif kind == "single_weight_no_bias":
        ops = [te_ops.GroupedLinear(E, D, 2 * F, single_grouped_weight=True, bias=False),
               te_ops.ScaledSwiGLU(),
               te_ops.GroupedLinear(E, F, D, single_grouped_weight=True, bias=False)]
    elif kind == "scale_bias":
        ops = [te_ops.GroupedLinear(E, D, 2 * F), te_ops.SwiGLU(),
               te_ops.GroupedLinear(E, F, D, scale_bias=True)]
    else:
        raise ValueError(kind)
    return te_ops.Sequential(*ops).to(dtype)


def _call(block: te_ops.Sequential, kind: str):
    if kind == "scale_bias":
        return lambda x, s, p: block(x, s, s, p)
    return lambda x, s, p: block(x, s, p, s)


def _step(fn, block, x, splits, probs, mark_dynamic=False):
    """Forward and backward; returns output, input grad, probs grad and every param grad."""
    x = x.detach().clone().requires_grad_(True)
    probs = probs.detach().clone().requires_grad_(True)
    if mark_dynamic:
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(probs, 0)
    y = fn(x, splits, probs)
    y.backward(torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape) % 7 - 3)
    grads = [p.grad.clone() for p in block.parameters() if p.requires_grad]
    block.zero_grad(set_to_none=True)
    return [y.detach(), x.grad, probs.grad, *grads]


def _assert_bit_exact(got: list, ref: list) -> None:
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert torch.equal(a, b), f"tensor {i} differs"


def _inputs(dtype, sizes, host, rows=12, nd=False):
    shape = (2, rows // 2) if nd else (rows,)
    x = torch.randn(*shape, D, dtype=dtype)
    probs = torch.rand(*shape, dtype=dtype)
    return x, (list(sizes) if host else torch.tensor(sizes)), probs


def _compare_routings(kind, dtype, host=False, nd=False, routings=ROUTINGS, rows=12,
                      dynamic=None):
    block = _block(kind, dtype)
    fn = _call(block, kind)
    cnt = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True, backend=cnt, dynamic=dynamic)
    frames = []
    for sizes in routings:
        x, splits, probs = _inputs(dtype, sizes, host, rows, nd)
        ref = _step(fn, block, x, splits, probs)
        _assert_bit_exact(_step(compiled, block, x, splits, probs), ref)
        frames.append(cnt.frame_count)
    assert not counters["graph_break"], dict(counters["graph_break"])
    return frames


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fusion", ["1", "0"], ids=["fused", "unfused"])
@pytest.mark.parametrize("backend", ["auto", "loop"])
def test_fullgraph_bit_exact_one_graph_device_splits(dtype, fusion, backend, monkeypatch):
    """Device split sizes: one graph, no graph break, no recompile across five routings
    (padding rows, zero-token groups); every output and gradient bit-identical to eager."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    if backend == "loop":
        monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "loop")
    assert _compare_routings("mlp", dtype) == [1] * len(ROUTINGS)


@pytest.mark.parametrize("fwd,bwd", [("1", "0"), ("0", "1")],
                         ids=["fused_fwd_unfused_bwd", "unfused_fwd_fused_bwd"])
def test_fullgraph_mixed_fused_unfused_halves(fwd, bwd, monkeypatch):
    """The other two of the four fused x unfused forward/backward combinations."""
    set_grouped_mlp(monkeypatch, fwd, bwd)
    assert _compare_routings("mlp", torch.bfloat16) == [1] * len(ROUTINGS)


@pytest.mark.parametrize("kind", ["single_weight_no_bias", "scale_bias"])
def test_fullgraph_bit_exact_variants(kind):
    assert _compare_routings(kind, torch.bfloat16) == [1] * len(ROUTINGS)


def test_fullgraph_nd_input():
    assert _compare_routings("mlp", torch.float32, nd=True) == [1] * len(ROUTINGS)


def test_fullgraph_empty_batch():
    _compare_routings("mlp", torch.float32, routings=([0, 0, 0, 0],), rows=0)


@pytest.mark.parametrize("backend", ["auto", "loop"])
def test_host_list_splits_recompile_once_then_never(backend, monkeypatch):
    """Host split sizes: the second routing changes every entry, so the first distribution
    change recompiles once to a graph with symbolic sizes (SymInt[]), which serves every later
    distribution."""
    if backend == "loop":
        monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "loop")
    assert _compare_routings("mlp", torch.float32, host=True) == [1, 2, 2, 2, 2]


#: Routings whose second keeps group 1 at zero tokens (and group 0 of the third at one).
KEPT_ENTRY_ROUTINGS = ([0, 0, 10, 0], [3, 0, 5, 2], [1, 1, 1, 7], [2, 2, 2, 4], [5, 5, 0, 0])


def test_host_list_entry_kept_by_the_second_call_costs_one_more_graph():
    """Automatic dynamic is per entry: group 1 has 0 tokens in the first two calls, so the
    second graph keeps it a constant; the third call changes it: a third graph, symbolic in
    every entry, which serves every later distribution."""
    assert _compare_routings("mlp", torch.float32, host=True,
                             routings=KEPT_ENTRY_ROUTINGS) == [1, 2, 3, 3, 3]


@pytest.mark.parametrize("routings", [ROUTINGS, KEPT_ENTRY_ROUTINGS], ids=["changed", "kept"])
def test_host_list_splits_dynamic_true_compiles_once(routings):
    """``torch.compile(dynamic=True)``: host split sizes are SymInts from the first call, zeros
    and ones included (ints are not 0/1-specialized): one graph for every distribution."""
    assert _compare_routings("mlp", torch.float32, host=True, routings=routings,
                             dynamic=True) == [1] * len(routings)


def test_deepcopied_block_compiles():
    """A deepcopy (no __init__ call) is found by the trace too, and runs its own parameters."""
    import copy

    original = _block("mlp", torch.float32)
    _call(original, "mlp")(*_inputs(torch.float32, ROUTINGS[0], host=False))
    block = copy.deepcopy(original)
    fn = _call(block, "mlp")
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    x, splits, probs = _inputs(torch.float32, ROUTINGS[1], host=False)
    _assert_bit_exact(_step(compiled, block, x, splits, probs), _step(fn, block, x, splits, probs))


def _token_count_frames(counts, mark_dynamic=False, dynamic=None, host=False):
    """Frame counts after each call with these token counts (device split sizes: every token
    in one group at counts below 8, else spread with an empty group and padding rows)."""
    block, fn, cnt, _ = _compiled_block("mlp", torch.float32)
    compiled = torch.compile(fn, fullgraph=True, backend=cnt, dynamic=dynamic)
    frames = []
    for rows in counts:
        sizes = [0, 0, rows, 0] if rows < 8 else [2, 3, 0, rows - 8]
        x, splits, probs = _inputs(torch.float32, sizes, host=host, rows=rows)
        _assert_bit_exact(_step(compiled, block, x, splits, probs, mark_dynamic=mark_dynamic),
                          _step(fn, block, x, splits, probs))
        frames.append(cnt.frame_count)
    return frames


def test_changing_token_count_recompiles_once_at_two_or_more_tokens():
    assert _token_count_frames((12, 16, 20, 24, 2)) == [1, 2, 2, 2, 2]


def test_mark_dynamic_token_dim_compiles_once():
    assert _token_count_frames((12, 16, 20, 2), mark_dynamic=True) == [1, 1, 1, 1]


@pytest.mark.parametrize("how", ["automatic", "mark_dynamic", "dynamic_true"])
def test_token_counts_zero_and_one_compile_one_graph_each(how):
    """PyTorch specializes sizes 0 and 1 (a dynamic size is assumed >= 2): each compiles a graph
    of its own the first time it occurs, then reuses it; every other count shares one dynamic
    graph. Automatic dynamic adds the first call's static graph: 4 in all, else 3."""
    counts = (12, 16, 0, 1, 20, 24, 0, 1, 2)
    if how == "automatic":
        want = [1, 2, 3, 4, 4, 4, 4, 4, 4]
        assert _token_count_frames(counts) == want
    else:
        want = [1, 1, 2, 3, 3, 3, 3, 3, 3]
        assert _token_count_frames(counts, mark_dynamic=how == "mark_dynamic",
                                   dynamic=True if how == "dynamic_true" else None) == want


def test_first_token_count_zero_is_its_own_graph():
    """A first call with 0 tokens: its static graph is the 0-token graph; the next count
    compiles the dynamic graph, and 1 its own: 3 in all."""
    assert _token_count_frames((0, 12, 16, 1, 0, 20)) == [1, 2, 2, 3, 3, 3]


def test_host_list_token_counts_zero_and_one_compile_one_graph_each():
    """Host split sizes (symbolic from ``dynamic=True``) with the same token-count rule."""
    assert _token_count_frames((12, 16, 0, 1, 20, 0, 1), dynamic=True, host=True) == [
        1, 1, 2, 3, 3, 3, 3]


def _compiled_block(kind: str, dtype: torch.dtype):
    """A fresh block, its eager call, a frame counter and the call compiled with
    ``fullgraph=True`` on aot_eager (Dynamo's caches reset first)."""
    block = _block(kind, dtype)
    fn = _call(block, kind)
    cnt = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    return block, fn, cnt, torch.compile(fn, fullgraph=True, backend=cnt)


def _compiled_mlp():
    block, fn, cnt, compiled = _compiled_block("mlp", torch.float32)
    x, splits, probs = _inputs(torch.float32, ROUTINGS[0], host=False)
    return block, fn, cnt, compiled, (x, splits, probs)


def _traced_forward_ops(block) -> list[str]:
    """The forward ops of the plan the last trace baked in (the compile fuser's last plan)."""
    (fuser,) = block[0].__dict__["_compile_fusers"].values()
    return [type(op).__name__ for op, _ in fuser._plan.forward_ops]


def test_env_change_retraces_with_the_new_plan(monkeypatch):
    """A changed TE_OPS_* value is guarded: the next call retraces (new plan), no stale plan."""
    block, fn, cnt, compiled, args = _compiled_mlp()
    _step(compiled, block, *args)
    assert _traced_forward_ops(block) == ["ForwardGroupedMLP"]
    monkeypatch.setenv("TE_OPS_FUSION", "0")
    ref = _step(fn, block, *args)
    _assert_bit_exact(_step(compiled, block, *args), ref)
    assert cnt.frame_count == 2
    assert _traced_forward_ops(block) == ["GroupedLinear", "ScaledSwiGLU", "GroupedLinear"]


def test_requires_grad_change_retraces():
    block, fn, cnt, compiled, args = _compiled_mlp()
    _step(compiled, block, *args)
    for p in block[0].parameters():
        p.requires_grad_(False)
    ref = _step(fn, block, *args)
    _assert_bit_exact(_step(compiled, block, *args), ref)
    assert cnt.frame_count == 2
    with torch.no_grad():
        y = compiled(*args)
    assert torch.equal(y, fn(*args))
    assert cnt.frame_count == 3


# --------------------------------------------------------------------------- recipes
RECIPES = {"fp8": te_ops.recipe.Float8CurrentScaling,
           "fp8_fast_bwd": lambda: te_ops.recipe.Float8CurrentScaling(
               fast_accumulate_backward=True),
           "fp8_wgrad_hp": lambda: te_ops.recipe.Float8CurrentScaling(
               wgrad_high_precision=True),
           "mxfp8": te_ops.recipe.MXFP8BlockScaling,
           "fp8_block": te_ops.recipe.Float8BlockScaling}


@pytest.mark.parametrize("fusion", ["1", "0"], ids=["fused", "unfused"])
@pytest.mark.parametrize("name", ["fp8", "fp8_wgrad_hp", "mxfp8", "fp8_block"])
def test_recipes_compile_bit_exact_one_graph(name, fusion, monkeypatch):
    """FP8 / MXFP8 / blockwise FP8 under te_ops.autocast (CPU: emulated, the same bytes as
    eager): one graph
    across routings and across new (equal) recipe objects per call."""
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block, fn, cnt, compiled = _compiled_block("mlp", torch.bfloat16)
    for sizes in ([64, 0, 100, 60], [0, 0, 224, 0], [56, 56, 56, 40]):
        x, splits, probs = _inputs(torch.bfloat16, sizes, host=False, rows=224)
        with te_ops.autocast(recipe=RECIPES[name]()):
            ref = _step(fn, block, x, splits, probs)
        with te_ops.autocast(recipe=RECIPES[name]()):
            _assert_bit_exact(_step(compiled, block, x, splits, probs), ref)
    assert cnt.frame_count == 1


def test_recipe_change_retraces():
    """No recipe -> FP8 -> FP8 with another setting -> MXFP8 -> blockwise FP8: each a new
    trace, bit-exact."""
    block, fn, cnt, compiled = _compiled_block("mlp", torch.bfloat16)
    x, splits, probs = _inputs(torch.bfloat16, [64, 0, 100, 60], host=False, rows=224)
    for i, name in enumerate([None, "fp8", "fp8_fast_bwd", "fp8_wgrad_hp", "mxfp8",
                              "fp8_block"]):
        ctx = te_ops.autocast(recipe=RECIPES[name]()) if name else te_ops.autocast(False)
        with ctx:
            ref = _step(fn, block, x, splits, probs)
            _assert_bit_exact(_step(compiled, block, x, splits, probs), ref)
        assert cnt.frame_count == i + 1


# --------------------------------------------------------------------------- the gate
GATE_CASES = {
    "check_split_sizes": "TE_OPS_CHECK_SPLIT_SIZES=1 reads device split sizes on the host",
    "not_a_tensor": "the input is a list, not a tensor",
    "main_grad": "GroupedLinear(accumulate_into_main_grad=True) adds weight gradients into "
                 "param.main_grad",
    "delayed_wgrad": "GroupedLinear(delay_wgrad_compute=True) keeps backward state in Python",
}


def _gate_call(case: str, monkeypatch, block):
    x, splits, probs = _inputs(torch.bfloat16, ROUTINGS[0], host=False)
    if case == "check_split_sizes":
        monkeypatch.setenv("TE_OPS_CHECK_SPLIT_SIZES", "1")
    elif case == "main_grad":
        block[0].accumulate_into_main_grad = True
        for p in block[0].weights():
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    elif case == "delayed_wgrad":
        block[2].delay_wgrad_compute = True
    else:
        x = x.tolist()
    return x, splits, probs


@pytest.mark.parametrize("case", list(GATE_CASES))
def test_fullgraph_error_names_the_gate_reason(case, monkeypatch):
    block = _block("mlp", torch.bfloat16)
    fn = _call(block, "mlp")
    x, splits, probs = _gate_call(case, monkeypatch, block)
    assert GATE_CASES[case] in te_ops.compile_unsupported_reason(block, x, splits, probs, splits)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    with pytest.raises(torch._dynamo.exc.Unsupported, match="te_ops: ") as info:
        compiled(x, splits, probs)
    assert GATE_CASES[case] in str(info.value)


@dataclasses.dataclass(frozen=True)
class _ListFieldRecipe(te_ops.recipe.Float8CurrentScaling):
    layers: tuple = (0, 1)


def test_fullgraph_error_names_a_non_constant_recipe_field():
    block = _block("mlp", torch.bfloat16)
    fn = _call(block, "mlp")
    x, splits, probs = _inputs(torch.bfloat16, ROUTINGS[0], host=False)
    expected = "the recipe _ListFieldRecipe's field layers is a tuple"
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    with te_ops.autocast(recipe=_ListFieldRecipe()):
        assert expected in te_ops.compile_unsupported_reason(block, x, splits, probs, splits)
        with pytest.raises(torch._dynamo.exc.Unsupported, match=expected):
            compiled(x, splits, probs)


def test_gated_call_runs_eagerly_bit_exact_and_warns_once(monkeypatch):
    from te_ops import compile as te_compile

    te_compile._WARNED.clear()
    block = _block("mlp", torch.bfloat16)
    fn = _call(block, "mlp")
    x, splits, probs = _gate_call("check_split_sizes", monkeypatch, block)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager")
    ref = _step(fn, block, x, splits, probs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            _assert_bit_exact(_step(compiled, block, x, splits, probs), ref)
    msgs = [str(w.message) for w in caught if "runs eagerly under torch.compile" in str(w.message)]
    assert len(msgs) == 1 and GATE_CASES["check_split_sizes"] in msgs[0]


def test_traceable_call_has_no_reason():
    block = _block("mlp", torch.float32)
    x, splits, probs = _inputs(torch.float32, ROUTINGS[0], host=False)
    assert te_ops.compile_unsupported_reason(block, x, splits, probs, splits) is None


def test_compile_unsupported_reason_rejects_non_te_ops_module() -> None:
    with pytest.raises(TypeError, match="module: expected a te_ops.Sequential"):
        te_ops.compile_unsupported_reason(torch.nn.Linear(2, 2))


def test_eager_call_warns_nothing() -> None:
    block = _block("mlp", torch.bfloat16)
    x, splits, probs = _inputs(torch.bfloat16, ROUTINGS[0], host=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        block(x, splits, probs, splits)


# --------------------------------------------------------------------------- inductor
@pytest.mark.parametrize("dtype", [torch.float32], ids=str)
def test_inductor_default_mode_matches_eager(dtype):
    """The default backend (inductor) on a tiny block: one graph, no recompile across
    routings; float32 bit-identical (inductor may fuse bf16 elementwise ops differently, so
    bf16 is compared at the dtype's tolerance). Prints the compile time."""
    block = _block("mlp", dtype)
    fn = _call(block, "mlp")
    cnt = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=cnt)
    t0 = time.perf_counter()
    for i, sizes in enumerate(ROUTINGS[:2]):
        x, splits, probs = _inputs(dtype, sizes, host=False)
        got = _step(compiled, block, x, splits, probs)
        if i == 0:
            print(f"inductor compile+first step {dtype}: {time.perf_counter() - t0:.1f} s")
        ref = _step(fn, block, x, splits, probs)
        for a, b in zip(got, ref):
            if dtype == torch.float32:
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            else:
                torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1.6e-2)
    assert cnt.frame_count == 1


def test_inductor_with_precision_casts_bitwise_under_blockwise_fp8():
    """inductor with ``emulate_precision_casts=True`` (each bf16 intermediate rounded where
    eager rounds it) on the blockwise FP8 block (CPU: the emulated recipe): bitwise equal to
    eager. Without it inductor keeps some bf16 intermediates in fp32, an input of a later
    quantize moves by a bf16 ulp, FP8 codes flip, and the results differ by about 1 %
    (relative norm; measured for all three FP8 recipes)."""
    import torch._inductor.config as inductor_config

    block = _block("mlp", torch.bfloat16)
    fn = _call(block, "mlp")
    torch._dynamo.reset()
    x, splits, probs = _inputs(torch.bfloat16, [64, 0, 100, 60], host=False, rows=224)
    with inductor_config.patch(emulate_precision_casts=True):
        compiled = torch.compile(fn, fullgraph=True, backend="inductor")
        with te_ops.autocast(recipe=te_ops.recipe.Float8BlockScaling()):
            got = _step(compiled, block, x, splits, probs)
    with te_ops.autocast(recipe=te_ops.recipe.Float8BlockScaling()):
        _assert_bit_exact(got, _step(fn, block, x, splits, probs))


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


# --------------------------------------------------------------------------- transformers
def test_hf_experts_with_te_ops_compile_fullgraph_bit_exact():
    """A Hugging Face Mixtral experts module running te_ops (te_ops.integrations) compiles
    with fullgraph=True: permute, the te_ops block, unpermute; bit-identical to eager."""
    pytest.importorskip("transformers")
    from test_hf_integration import experts_modules, make_model

    import te_ops.integrations.transformers as te_hf

    te_hf.register()
    model = make_model("mixtral", torch.float32)
    model.set_experts_implementation("te_ops")
    experts = experts_modules(model)[0]
    hidden, num_experts = experts.gate_up_proj.shape[2], experts.num_experts
    cnt = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(experts, fullgraph=True, backend=cnt)
    for seed in (1, 2, 3):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(16, hidden, generator=g)
        index = torch.stack([torch.randperm(num_experts, generator=g)[:2] for _ in range(16)])
        weights = torch.rand(16, 2, generator=g)
        results = []
        for fn in (experts, compiled):
            experts.zero_grad(set_to_none=True)
            xi, wi = x.clone().requires_grad_(), weights.clone().requires_grad_()
            out = fn(xi, index, wi)
            out.sum().backward()
            results.append([out.detach(), xi.grad, wi.grad, experts.gate_up_proj.grad.clone(),
                            experts.down_proj.grad.clone()])
        _assert_bit_exact(results[1], results[0])
    assert cnt.frame_count == 1
