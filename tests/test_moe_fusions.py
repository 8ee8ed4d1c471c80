"""The MoE layer's routing fusions on the CPU (``te_ops/fused/moe_routing.py``).

``Permute -> fc1`` forward (fc1 reads the tokens through the row index, its context keeps the
index instead of the permuted rows) and ``fc2 -> Combine`` backward (fc2's GEMMs read the
output gradient through the index), alone and composed with the grouped-MLP fusions: bitwise
the unfused layer in every forward x backward pairing, against test_moe_layer's float64
per-token reference, under ``torch.compile(fullgraph=True)``, with dropless and capacity
routing and empty experts; the saved bytes (``saved_tensors_hooks``, one count per storage)
drop by the permuted rows; the gates' reasons reach ``explain()``. The row gathers' GEMM side
(``te_ops.gemm.RowGather``) against the gathered copy.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from fusion_env import fusions_off, set_grouped_mlp
from test_moe_layer import MODES, H, _steer, check, make

import te_ops
from te_ops.gemm import (
    BackendChoice,
    RowGather,
    grouped_dgrad,
    grouped_fprop,
    grouped_wgrad,
    row_gather_reason,
    select_backend,
)
from te_ops.gemm.grouped_gemm_triton import check_row_index
from te_ops.routing import pick
from te_ops.splits import make_splits

ROUTING_OFF = {"TE_OPS_FUSION_OFF": "permute_fc1_forward,fc2_combine_backward"}


def _env(monkeypatch, **values: str) -> None:
    for name, value in values.items():
        monkeypatch.setenv(name, value)


def _step(moe: te_ops.MoE, x: torch.Tensor, fn=None) -> list[torch.Tensor]:
    """Output, aux loss, x.grad and every parameter's grad of one forward + backward."""
    moe.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    y, aux = (moe if fn is None else fn)(xi)
    (y.square().sum() + 3.0 * aux).backward()
    return [y, aux, xi.grad] + [p.grad for p in moe.parameters() if p.requires_grad]


def _plan_names(moe: te_ops.MoE) -> tuple[list[str], list[str]]:
    plan = moe.block.fusers()[0].plan()
    return ([type(op).__name__ for op, _ in plan.forward_ops],
            [type(op).__name__ for op, _ in plan.backward_ops])


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), f"tensor {i} differs"


# ------------------------------------------------------------------ fused == unfused, bitwise
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("grouped_mlp", ["1", "0"], ids=["with_grouped_mlp", "alone"])
@pytest.mark.parametrize("permute_fc1, fc2_combine", list(itertools.product("10", "10")))
def test_every_forward_backward_pairing_is_bitwise_the_unfused_layer(
        monkeypatch, mode, grouped_mlp, permute_fc1, fc2_combine):
    """The routing fusions' forward (permute_fc1) and backward (fc2_combine) halves, each on
    or off, with and without the grouped-MLP fusions: the same bits as every fusion off."""
    moe = make(aux_loss_coeff=0.01, shared_ffn_hidden_size=8, **MODES[mode])
    x = torch.randn(2, 6, H)
    monkeypatch.setenv("TE_OPS_FUSION", "0")
    want = _step(moe, x)
    monkeypatch.setenv("TE_OPS_FUSION", "1")
    _env(monkeypatch, TE_OPS_FUSION_OFF=fusions_off(
        permute_fc1_forward=permute_fc1, fc2_combine_backward=fc2_combine,
        grouped_mlp_forward=grouped_mlp, grouped_mlp_backward=grouped_mlp))
    _same(_step(moe, x), want)
    forward, backward = _plan_names(moe)
    mlp = grouped_mlp == "1"
    if permute_fc1 == "1":
        assert ("ForwardGroupedMLP" if mlp else "ForwardPermuteFC1") in forward
        assert "Permute" not in forward
    else:
        assert "Permute" in forward
    if fc2_combine == "1":
        assert ("BackwardGroupedMLP" if mlp else "BackwardFC2Combine") in backward
        assert "Combine" not in backward
    else:
        assert "Combine" in backward


def test_default_plan_covers_the_routing():
    moe = make()
    _step(moe, torch.randn(3, H))
    plan = moe.block.fusers()[0].plan()
    fwd = {type(op).__name__: idx for op, idx in plan.forward_ops}
    bwd = {type(op).__name__: idx for op, idx in plan.backward_ops}
    assert fwd["ForwardGroupedMLP"] == [1, 2, 3, 4] and bwd["BackwardGroupedMLP"] == [2, 3, 4, 5]
    text = moe.block.explain()  # the last call's kernels: where each GEMM read the rows
    assert "row gather: fprop runs in torch._grouped_mm" in text
    assert "row gather: dgrad runs in torch._grouped_mm" in text


# ------------------------------------------------------------------ against the reference
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("grouped_mlp", ["1", "0"], ids=["with_grouped_mlp", "alone"])
def test_fused_layer_matches_float64_reference(monkeypatch, mode, grouped_mlp):
    set_grouped_mlp(monkeypatch, grouped_mlp, grouped_mlp)
    moe = make(aux_loss_coeff=0.02, z_loss_coeff=0.01, **MODES[mode])
    check(moe, torch.randn(2, 5, H))
    forward, backward = _plan_names(moe)
    assert "Permute" not in forward and "Combine" not in backward


@pytest.mark.parametrize("mode", list(MODES))
def test_empty_expert_fused_matches_unfused_and_reference(monkeypatch, mode):
    moe = make(**MODES[mode])
    _steer(moe, avoid=3)
    x = torch.rand(2, 6, H) + 0.1
    fused = _step(moe, x)
    moe.zero_grad(set_to_none=True)
    check(moe, x)
    _env(monkeypatch, **ROUTING_OFF)
    _same(_step(moe, x), fused)
    assert fused[-1][3].abs().sum() == 0  # fc2.weight's grad of the idle expert


def test_float64_layer_is_tight_with_the_routing_fusions():
    moe = make(dtype=torch.float64, aux_loss_coeff=0.01)
    check(moe, torch.randn(2, 5, H, dtype=torch.float64), tol=1e-10)


# ------------------------------------------------------------------ torch.compile
@pytest.mark.parametrize("mode", ["dropless", "capacity_probs"])
@pytest.mark.parametrize("grouped_mlp", ["1", "0"], ids=["with_grouped_mlp", "alone"])
def test_compile_fullgraph_is_bitwise_eager(monkeypatch, mode, grouped_mlp):
    set_grouped_mlp(monkeypatch, grouped_mlp, grouped_mlp)
    moe = make(aux_loss_coeff=0.01, **MODES[mode])
    x = torch.randn(2, 6, H)
    eager = _step(moe, x)
    torch._dynamo.reset()
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)
    _same(_step(moe, x, compiled), eager)
    traced = next(iter(moe.router.__dict__["_compile_fusers"].values()))
    names = [type(op).__name__ for op, _ in traced.plan().forward_ops]
    assert "Permute" not in names  # the traced plan took the fusion too


# ------------------------------------------------------------------ saved bytes
def _saved_bytes(moe: te_ops.MoE, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward (parameters included)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, aux = moe(x.clone().requires_grad_())
    (y.sum() + aux).backward()
    return sum(storages.values())


@pytest.mark.parametrize("mode", list(MODES))
def test_fused_layer_saves_the_index_instead_of_the_permuted_rows(monkeypatch, mode):
    """The router saves x in token order for its weight grad; fc1's context now points at the
    same storage and adds the (rows,) int64 index, instead of the (rows, H) permuted copy."""
    moe = make(**MODES[mode])
    x = torch.randn(4, 8, H)
    fused = _saved_bytes(moe, x)
    _env(monkeypatch, **ROUTING_OFF)
    unfused = _saved_bytes(moe, x)
    rows = 32 * 2 if mode == "dropless" else moe.permute.capacity(32, 2) * moe.permute.num_experts
    assert unfused - fused == rows * H * 4 - rows * 8
    assert fused < unfused


# ------------------------------------------------------------------ gates and explain()
def test_recipe_keeps_the_routing_unfused_and_says_why():
    moe = make()
    x = torch.randn(4, H)
    with te_ops.autocast(recipe=te_ops.recipe.Float8CurrentScaling()):
        moe(x)
    text = moe.block.explain()
    forward, backward = _plan_names(moe)
    assert "Permute" in forward and "Combine" in backward
    assert "the row gather does not make" in text
    assert "fc2's dgrad and wgrad read a quantized dy" in text


def test_toggles_are_noted_where_the_pattern_is(monkeypatch):
    _env(monkeypatch, **ROUTING_OFF)
    moe = make()
    moe(torch.randn(4, H))
    text = moe.block.explain()
    assert "TE_OPS_FUSION_OFF lists permute_fc1_forward" in text
    assert "TE_OPS_FUSION_OFF lists fc2_combine_backward" in text


def test_fc2_with_bias_and_unfed_split_sizes_are_refused_with_the_reason():
    torch.manual_seed(0)
    permute = te_ops.basic.moe.Permute(4)
    fc1 = te_ops.GroupedLinear(4, H, 8)  # split sizes a call input: not fed by the permute
    combine = te_ops.basic.moe.Combine()
    fc2 = te_ops.GroupedLinear(4, 8, H)  # with a bias
    combine.feed_extra_input("pair_index", permute, "pair_index")
    combine.feed_extra_input("row_index", permute, "row_index")
    block = te_ops.Sequential(permute, fc1, fc2, combine)
    x = torch.randn(5, H, requires_grad=True)
    idx = torch.randint(0, 4, (5, 2))
    probs = torch.rand(5, 2)
    sizes = torch.bincount(idx.reshape(-1), minlength=4)
    y, *_ = block(x, idx, probs, sizes, sizes)
    y.sum().backward()
    text = block.explain()
    assert "fc1's split sizes are not fed by this permute's split_sizes output" in text
    assert "fc2 has a bias" in text
    forward, backward = ([type(op).__name__ for op, _ in p] for p in
                         (block.fusers()[0].plan().forward_ops,
                          block.fusers()[0].plan().backward_ops))
    assert forward == ["Permute", "GroupedLinear", "GroupedLinear", "Combine"]
    assert backward == forward


# ------------------------------------------------------------------ the GEMM side
def _gather_case(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randn(7, 16, generator=gen)
    index = torch.tensor([6, 0, 7, 3, 3, 1, 7, 2, 5, 4])  # 7 == len(src): zero rows
    sizes = [3, 0, 5]  # 2 padding rows
    return src, index, make_splits(sizes, 3, 10, src.device), gen


@pytest.mark.parametrize("backend_name", ["grouped_mm", "loop"])
def test_gathered_operands_give_the_gathered_copys_bits(monkeypatch, backend_name):
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", backend_name)
    src, index, splits, gen = _gather_case()
    backend = select_backend(src.device, src.dtype, 16, 16, False, 10 / 3)
    gather = RowGather(src, index)
    rows = pick(src, index)
    assert gather.shape == tuple(rows.shape) and torch.equal(gather.rows(), rows)
    w = torch.randn(3, 16, 16, generator=gen)
    dsrc = torch.randn(7, 16, generator=gen)
    dgather, drows = RowGather(dsrc, index), pick(dsrc, index)
    assert torch.equal(grouped_fprop(gather, w, splits, backend),
                       grouped_fprop(rows, w, splits, backend))
    assert torch.equal(grouped_dgrad(dgather, w, splits, backend),
                       grouped_dgrad(drows, w, splits, backend))
    assert torch.equal(grouped_wgrad(gather, dgather, splits, backend),
                       grouped_wgrad(rows, drows, splits, backend))
    ref = torch.zeros(10, 16, dtype=torch.float64)
    for g, (a, b) in enumerate([(0, 3), (3, 3), (3, 8)]):
        ref[a:b] = rows[a:b].double() @ w[g].double().t()
    torch.testing.assert_close(grouped_fprop(gather, w, splits, backend).double(), ref,
                               rtol=1e-5, atol=1e-5)


def test_row_gather_reason_names_where_the_rows_are_read():
    few = BackendChoice("triton", "test", True, triton_kinds=("fprop", "wgrad"),
                        large_kinds=("dgrad",))
    assert row_gather_reason(few, "fprop") is None and row_gather_reason(few, "wgrad") is None
    assert "the persistent / Gluon Triton kernel" in row_gather_reason(few, "dgrad")
    mm = BackendChoice("grouped_mm", "test", True)
    assert "torch._grouped_mm, which takes no row index" in row_gather_reason(mm, "fprop")
    loop = BackendChoice("loop", "test", False)
    assert "the loop backend" in row_gather_reason(loop, "wgrad")
    reg = BackendChoice("grouped_mm", "test", True, registered=(("fprop", "mine"),))
    assert "registered kernel" in row_gather_reason(reg, "fprop")


@pytest.mark.parametrize("index, match", [
    (torch.zeros(2, 2, dtype=torch.int64), r"a_rows must be a 1-D int32/int64 tensor"),
    (torch.zeros(4), r"a_rows must be a 1-D int32/int64 tensor on cpu .* got torch.float32"),
])
def test_row_index_errors_name_the_argument(index, match):
    with pytest.raises(ValueError, match=match):
        check_row_index("a_rows", index, torch.device("cpu"))


def test_row_gather_is_not_kept_under_a_recipe():
    fc1 = te_ops.GroupedLinear(2, H, 8, bias=False)
    src = torch.randn(3, H)
    splits = make_splits([2, 2], 2, 4, src.device)
    ctx = te_ops.op.OperationContext()
    backend = fc1.select_backend(src, splits)
    with pytest.raises(ValueError, match="x2d: a row gather is kept in high precision only"):
        fc1.make_saved(ctx, RowGather(src, torch.tensor([0, 1, 2, 0])), splits, backend, None,
                       (4, H), recipe=te_ops.recipe.Float8CurrentScaling())


def test_fc1_recompute_reruns_the_gathered_fprop_bitwise(monkeypatch):
    """``ScaledSwiGLU(recompute_input=True)`` behind the fused permute: fc1's GEMM is re-run in
    backward on the row gather its context keeps, with the unfused layer's bits."""
    moe = make()
    moe.experts[1].recompute_input = True
    x = torch.randn(2, 6, H)
    fused = _step(moe, x)
    text = moe.block.explain()
    assert "recompute_input not honoured" not in text
    monkeypatch.setenv("TE_OPS_FUSION", "0")
    with pytest.warns(UserWarning, match="recompute_input=True is not honoured"):
        _same(_step(moe, x), fused)
