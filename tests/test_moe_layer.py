"""``te_ops.MoE`` (router -> permute -> experts -> combine as one Sequential) on the CPU.

The reference is independent of te_ops: float64, a loop over tokens and their top-k experts,
``torch.nn.functional.linear`` per expert; the balancing losses are written from the papers'
formulas (Switch Transformer eq. 4, DeepSeek-V2/V3's sequence-wise loss, ST-MoE's z-loss).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from block_replay import assert_layer_compiles_bit_exact, assert_meta_layer_step

import te_ops
from te_ops.basic.moe import Combine, Permute, Router

H, FF, E = 16, 12, 4


def _grad_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double().requires_grad_()


class Reference:
    """The layer in float64 from the module's parameters (copied as new leaves)."""

    def __init__(self, moe: te_ops.MoE) -> None:
        self.moe = moe
        r = moe.router
        self.w_router = _grad_leaf(r.weight)
        self.bias = None if r.expert_bias is None else r.expert_bias.detach().double()
        self.w1 = _grad_leaf(moe.experts[0].weight)
        self.w2 = _grad_leaf(moe.experts[2].weight)
        shared = moe.shared_experts
        self.s1 = None if shared is None else _grad_leaf(shared[0].weight)
        self.s2 = None if shared is None else _grad_leaf(shared[2].weight)

    def leaves(self) -> list[torch.Tensor]:
        return [t for t in (self.w_router, self.w1, self.w2, self.s1, self.s2) if t is not None]

    @staticmethod
    def swiglu_mlp(v: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        a, b = F.linear(v, w1).chunk(2, dim=-1)
        return F.linear(F.silu(a) * b, w2)

    def select(self, sel: torch.Tensor) -> list[int]:
        """One token's top-k experts by ``sel`` (group-limited when configured)."""
        r = self.moe.router
        k = r.top_k
        candidates = list(range(r.num_experts))
        if r.num_groups is not None:
            size = r.num_experts // r.num_groups
            group_score = []
            for g in range(r.num_groups):
                members = sorted(sel[g * size:(g + 1) * size].tolist(), reverse=True)
                group_score.append(sum(members[:k // r.group_top_k]))
            best = sorted(range(r.num_groups), key=lambda g: -group_score[g])[:r.group_top_k]
            candidates = [e for g in best for e in range(g * size, (g + 1) * size)]
        return sorted(candidates, key=lambda e: -float(sel[e]))[:k]

    def __call__(self, x: torch.Tensor):
        r, p = self.moe.router, self.moe.permute
        xd = x.double().reshape(-1, H)
        t_count, k = xd.shape[0], r.top_k
        logits = F.linear(xd, self.w_router)
        scores = torch.softmax(logits, -1) if r.score_function == "softmax" else torch.sigmoid(
            logits)
        sel = scores.detach() + (0 if self.bias is None else self.bias)
        chosen, weights = [], []
        for t in range(t_count):
            experts = self.select(sel[t])
            w = scores[t, experts]
            if r.renormalize:
                w = w / (w.sum() + 1e-20)
            w = w * r.topk_scaling_factor
            chosen.append(experts)
            weights.append(w)
        kept = {(t, j) for t in range(t_count) for j in range(k)}
        if p.capacity_factor is not None:
            cap = math.ceil(p.capacity_factor * t_count * k / r.num_experts)
            kept = set()
            for e in range(r.num_experts):
                pairs = [(t, j) for t in range(t_count) for j in range(k) if chosen[t][j] == e]
                if p.drop_policy == "probs":  # highest weight first, ties in pair order
                    pairs.sort(key=lambda tj: -float(weights[tj[0]][tj[1]].detach()))
                kept.update(pairs[:cap])
        rows = []
        for t in range(t_count):
            out = torch.zeros(H, dtype=torch.float64)
            for j, e in enumerate(chosen[t]):
                if (t, j) in kept:
                    out = out + weights[t][j] * self.swiglu_mlp(xd[t], self.w1[e], self.w2[e])
            if self.s1 is not None:
                out = out + self.swiglu_mlp(xd[t], self.s1[0], self.s2[0])
            rows.append(out)
        y = torch.stack(rows).reshape(x.shape)
        counts = torch.zeros(r.num_experts, dtype=torch.float64)
        for experts in chosen:
            for e in experts:
                counts[e] += 1
        aux = torch.zeros((), dtype=torch.float64)
        # the balancing losses' scores: softmax, or sigmoid scores normalized per token
        q = scores if r.score_function == "softmax" else scores / (
            scores.sum(-1, keepdim=True) + 1e-20)
        if r.aux_loss_coeff:  # Switch eq. 4, top-k: f_i = count_i / (k T), P_i = mean_t q_ti
            f = counts / (k * t_count)
            big_p = q.mean(0)
            aux = aux + r.aux_loss_coeff * r.num_experts * (f * big_p).sum()
        if r.seq_aux_loss_coeff:  # DeepSeek-V3 eq. 17-20, per sequence, mean over sequences
            batch, seq = x.shape[0], x.shape[1]
            per_seq = []
            for b in range(batch):
                toks = range(b * seq, (b + 1) * seq)
                f = torch.zeros(r.num_experts, dtype=torch.float64)
                for t in toks:
                    for e in chosen[t]:
                        f[e] += r.num_experts / (k * seq)
                big_p = q[b * seq:(b + 1) * seq].mean(0)
                per_seq.append(r.seq_aux_loss_coeff * (f * big_p).sum())
            aux = aux + torch.stack(per_seq).mean()
        if r.z_loss_coeff:  # ST-MoE eq. 5
            aux = aux + r.z_loss_coeff * (torch.log(torch.exp(logits).sum(-1)) ** 2).mean()
        dropped = t_count * k - len(kept)
        return y, aux, dropped, counts


def make(dtype=torch.float32, seed=0, **kw) -> te_ops.MoE:
    torch.manual_seed(seed)
    num_experts = kw.pop("num_experts", E)
    top_k = kw.pop("top_k", 2)
    moe = te_ops.MoE(H, FF, num_experts, top_k, dtype=dtype, **kw)
    with torch.no_grad():  # weights of O(1) outputs (Kaiming-uniform gives tiny ones)
        for p in moe.parameters():
            if p.requires_grad:
                p.normal_(0, 0.5)
    return moe


def check(moe: te_ops.MoE, x: torch.Tensor, *, tol: float = 2e-4) -> None:
    """Output, aux loss, dropped count and gradients of x and every weight vs the reference."""
    ref = Reference(moe)
    x = x.detach().requires_grad_()
    xr = x.detach().double().requires_grad_()
    y, aux, dropped = moe(x, return_dropped=True)
    y_ref, aux_ref, dropped_ref, _ = ref(xr)
    torch.testing.assert_close(y.double(), y_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(aux.double(), aux_ref, rtol=tol, atol=tol)
    assert int(dropped) == dropped_ref
    gy = torch.randn_like(y_ref)
    ga = 3.0
    ((y * gy.to(y.dtype)).sum() + ga * aux).backward()
    ((y_ref * gy).sum() + ga * aux_ref).backward()
    pairs = [(x, xr), (moe.router.weight, ref.w_router), (moe.experts[0].weight, ref.w1),
             (moe.experts[2].weight, ref.w2)]
    if moe.shared_experts is not None:
        pairs += [(moe.shared_experts[0].weight, ref.s1), (moe.shared_experts[2].weight, ref.s2)]
    for mine, theirs in pairs:
        assert mine.grad is not None
        torch.testing.assert_close(mine.grad.double(), theirs.grad, rtol=tol * 10,
                                   atol=tol * 10)


ROUTERS = {
    "softmax_renorm": dict(),
    "softmax_no_renorm": dict(renormalize=False),
    "sigmoid_renorm": dict(score_function="sigmoid"),
    "sigmoid_no_renorm": dict(score_function="sigmoid", renormalize=False),
    "group_limited": dict(num_experts=8, top_k=4, num_groups=4, group_top_k=2,
                          score_function="sigmoid"),
    "expert_bias": dict(score_function="sigmoid", expert_bias=True),
    "scaled_top_k": dict(score_function="sigmoid", topk_scaling_factor=2.5),
    "scaled_top_k_softmax": dict(renormalize=False, topk_scaling_factor=0.5),
    "switch_aux": dict(aux_loss_coeff=0.05),
    "switch_aux_sigmoid": dict(aux_loss_coeff=0.05, score_function="sigmoid"),
    "seq_aux": dict(seq_aux_loss_coeff=0.05),
    "seq_aux_sigmoid": dict(seq_aux_loss_coeff=0.05, score_function="sigmoid"),
    "z_loss": dict(z_loss_coeff=0.01),
    "all_losses": dict(aux_loss_coeff=0.02, seq_aux_loss_coeff=0.03, z_loss_coeff=0.01),
}
MODES = {"dropless": dict(), "capacity_probs": dict(capacity_factor=1.0),
         "capacity_position": dict(capacity_factor=0.75, drop_policy="position")}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("router", list(ROUTERS))
def test_layer_matches_reference(router, mode):
    moe = make(**ROUTERS[router], **MODES[mode])
    if moe.router.expert_bias is not None:
        with torch.no_grad():  # a bias that changes the selection
            moe.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, moe.router.num_experts))
    check(moe, torch.randn(2, 6, H))


@pytest.mark.parametrize("mode", list(MODES))
def test_shared_experts(mode):
    check(make(shared_ffn_hidden_size=8, aux_loss_coeff=0.01, **MODES[mode]),
          torch.randn(3, 4, H))


def test_float64_is_tight():
    check(make(dtype=torch.float64, aux_loss_coeff=0.01, z_loss_coeff=0.01,
               shared_ffn_hidden_size=4), torch.randn(2, 5, H, dtype=torch.float64), tol=1e-10)


def test_float32_gate_takes_bfloat16_tokens_as_float32():
    """A float32 router weight with bf16 tokens runs the gate in float32 on the tokens cast up
    (DeepSeek-V3's fp32 gate): ids, weights, aux loss and the weight gradient are bitwise a
    float32 router's on ``x.float()``; the token gradient is its gradient rounded to bf16."""
    import copy

    torch.manual_seed(0)
    r16 = Router(H, E, 2, aux_loss_coeff=0.01, z_loss_coeff=0.01)
    r32 = copy.deepcopy(r16)
    x = torch.randn(12, H).bfloat16()
    g = torch.randn(12, 2)
    grads = []
    for router, xi in ((r16, x.clone().requires_grad_()), (r32, x.float().requires_grad_())):
        _, idx, probs, aux = router(xi)
        ((probs * g).sum() + aux).backward()
        grads.append((idx, probs, aux, router.weight.grad, xi.grad))
    (i16, p16, a16, w16, x16), (i32, p32, a32, w32, x32) = grads
    assert torch.equal(i16, i32) and torch.equal(p16, p32) and torch.equal(a16, a32)
    assert torch.equal(w16, w32) and x16.dtype == torch.bfloat16
    assert torch.equal(x16, x32.bfloat16())
    with pytest.raises(ValueError, match="a bfloat16 / float16 input is taken under a float32"):
        r16.bfloat16()(torch.randn(3, H))


def test_layer_with_a_float32_gate_under_bfloat16_experts():
    """``moe.router.float()``: the layer runs with bf16 tokens and experts and a float32 gate,
    within bf16 rounding of the float64 reference."""
    torch.manual_seed(0)
    moe = te_ops.MoE(H, 16, E, 2, dtype=torch.bfloat16, aux_loss_coeff=0.01)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    moe.router.float()
    check(moe, torch.randn(2, 6, H).bfloat16(), tol=3e-2)


def _steer(moe: te_ops.MoE, favour: int | None = None, avoid: int | None = None) -> None:
    """Gate rows so that (for positive inputs) expert ``favour`` always wins / ``avoid``
    never does."""
    with torch.no_grad():
        w = moe.router.weight
        w.uniform_(-0.1, 0.1)
        if favour is not None:
            w[favour] = 5.0
        if avoid is not None:
            w[avoid] = -5.0


@pytest.mark.parametrize("mode", list(MODES))
def test_an_empty_expert(mode):
    moe = make(**MODES[mode])
    _steer(moe, avoid=3)
    x = torch.rand(2, 6, H) + 0.1
    y, _ = moe(x)
    check(moe, x)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("mode", list(MODES))
def test_all_tokens_on_one_expert(mode):
    moe = make(top_k=1, **MODES[mode])
    _steer(moe, favour=2)
    x = torch.rand(12, H) + 0.1
    check(moe, x)
    _, _, dropped = moe(x, return_dropped=True)
    if moe.permute.capacity_factor is not None:  # capacity ceil(cf * 12 / 4) of 12 tokens
        assert int(dropped) == 12 - math.ceil(moe.permute.capacity_factor * 12 / E)


@pytest.mark.parametrize("mode", list(MODES))
def test_one_token(mode):
    check(make(shared_ffn_hidden_size=4, **MODES[mode]), torch.randn(1, H))


@pytest.mark.parametrize("mode", list(MODES))
def test_top_k_equals_num_experts(mode):
    check(make(top_k=E, aux_loss_coeff=0.01, **MODES[mode]), torch.randn(2, 3, H))


def test_unfused_matches_fused_bitwise(monkeypatch):
    moe = make(shared_ffn_hidden_size=8, aux_loss_coeff=0.01)
    x = torch.randn(2, 6, H)
    results = []
    for fusion in ("1", "0"):
        monkeypatch.setenv("TE_OPS_FUSION", fusion)
        moe.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y, aux = moe(xi)
        (y.square().sum() + aux).backward()
        results.append([y, aux, xi.grad] + [p.grad for p in moe.parameters() if p.requires_grad])
    plan = moe.block.fusers()[0].plan()
    assert not any(op.is_fused_op for op, _ in plan.forward_ops)  # the last call: unfused
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_grouped_mlp_fusion_takes_split_sizes_from_permute():
    moe = make()
    moe(torch.randn(4, H))
    plan = moe.block.fusers()[0].plan()
    # the grouped-MLP fusions, extended by the routing fusions (te_ops/fused/moe_routing.py)
    assert [(type(op).__name__, idx) for op, idx in plan.forward_ops] == [
        ("Router", [0]), ("ForwardGroupedMLP", [1, 2, 3, 4]), ("Combine", [5])]
    assert [(type(op).__name__, idx) for op, idx in plan.backward_ops] == [
        ("Router", [0]), ("Permute", [1]), ("BackwardGroupedMLP", [2, 3, 4, 5])]
    # the fed split sizes are a device tensor: the plan names the graph-safe backend as such
    assert "not graph-safe" not in moe.block.explain(torch.zeros(4, H))


def test_expert_bias_update_rule():
    """DeepSeek-V3's aux-loss-free update: b_i += u * sign(mean load - load_i)."""
    moe = make(expert_bias=True, score_function="sigmoid")
    x = torch.randn(2, 6, H)
    _, _, _, counts = Reference(moe)(x)
    moe.train()
    moe(x)
    torch.testing.assert_close(moe.router.expert_load.double(), counts)
    moe.update_expert_bias(rate=0.01)
    torch.testing.assert_close(moe.router.expert_bias.double(),
                               0.01 * torch.sign(counts.mean() - counts))
    assert not moe.router.expert_load.any()  # consumed
    moe.eval()
    moe(x)
    assert not moe.router.expert_load.any()  # only training routes count
    assert moe.router.expert_bias.grad is None


def test_no_balancing_loss_gives_zero():
    _, aux = make()(torch.randn(3, H))
    assert aux.shape == () and aux.item() == 0.0


# --------------------------------------------------------------------------- graph safety
META_ROUTERS = {
    "softmax_bias_losses": dict(aux_loss_coeff=0.01, seq_aux_loss_coeff=0.01, z_loss_coeff=0.01,
                                expert_bias=True),
    "sigmoid_group_limited": dict(score_function="sigmoid", num_groups=2, group_top_k=1,
                                  aux_loss_coeff=0.01),
}


@pytest.mark.parametrize("router", list(META_ROUTERS))
@pytest.mark.parametrize("mode", list(MODES))
def test_meta_forward_backward_reads_no_device_value(monkeypatch, mode, router):
    """Every tensor on ``meta`` (no values): any host read of a device value would raise (see
    tests/test_graph_safety.py for the proof's reasoning)."""
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "1")
    # bf16 and 16-byte rows: what torch._grouped_mm (the graph-safe grouped GEMM) takes on meta
    moe = te_ops.MoE(H, 16, E, 2, device="meta", dtype=torch.bfloat16,
                     shared_ffn_hidden_size=8, **META_ROUTERS[router], **MODES[mode])
    assert_meta_layer_step(moe, torch.randn(2, 8, H, device="meta", dtype=torch.bfloat16,
                                            requires_grad=True))


def test_meta_host_read_would_fail():
    """The proof has teeth: a host read of a meta tensor raises."""
    with pytest.raises((RuntimeError, NotImplementedError)):
        int(torch.zeros((), device="meta", dtype=torch.int64))


# --------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("mode", ["dropless", "capacity_probs"])
def test_compile_fullgraph_bit_exact(mode):
    moe = make(shared_ffn_hidden_size=8, aux_loss_coeff=0.01, z_loss_coeff=0.01,
               **MODES[mode])
    assert_layer_compiles_bit_exact(moe, torch.randn(2, 6, H))


# --------------------------------------------------------------------------- the framework
def test_fed_inputs_are_not_call_inputs_and_feeding_outputs_are_not_returned():
    moe = make()
    sig = moe.block.signature()
    assert sig.total == 0
    assert sig.returned == [[False, False, True], [False, False, False, False, True, True],
                            [], [], [], []]
    # the expert block alone: its producer is not there, so split sizes are call inputs again
    assert moe.experts.num_extra_inputs() == 3


def test_wiring_across_fusers_matches_one_fuser():
    """A hook on the activation puts it in a fuser of its own: the container then carries the
    fed values from one fuser to the next, with the same results."""
    moe = make(aux_loss_coeff=0.01)
    x = torch.randn(2, 5, H)
    xa = x.clone().requires_grad_()
    ya, auxa = moe(xa)
    (ya.square().sum() + auxa).backward()
    grads_a = [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad(set_to_none=True)
    calls = []
    moe.experts[1].register_forward_hook(lambda *args: calls.append(1))
    assert len(moe.block.fusers()) == 3
    xb = x.clone().requires_grad_()
    yb, auxb = moe(xb)
    (yb.square().sum() + auxb).backward()
    assert calls == [1]
    torch.testing.assert_close(yb, ya)
    torch.testing.assert_close(xb.grad, xa.grad)
    for p, g in zip(moe.parameters(), grads_a):
        torch.testing.assert_close(p.grad, g)


def test_feed_errors():
    router, permute, combine = Router(H, E, 2), Permute(E), Combine()
    with pytest.raises(ValueError, match="slot must name one of Permute's extra inputs"):
        permute.feed_extra_input("nope", router, "top_k_index")
    with pytest.raises(ValueError, match="output must name one of Router's extra outputs"):
        permute.feed_extra_input("top_k_index", router, "probs")
    with pytest.raises(TypeError, match="producer must be a te_ops BasicOperation"):
        permute.feed_extra_input(0, torch.nn.Linear(2, 2), 0)
    with pytest.raises(ValueError, match="producer must be another op"):
        permute.feed_extra_input(0, permute, 0)
    combine.feed_extra_input("pair_index", permute, "pair_index")
    with pytest.raises(ValueError, match="does not run before it"):
        te_ops.Sequential(combine, permute)


@pytest.mark.parametrize("kwargs, match", [
    (dict(top_k=5), "top_k must be <= num_experts=4"),
    (dict(score_function="relu"), "score_function must be one of"),
    (dict(num_groups=2), "num_groups and group_top_k must be given together"),
    (dict(num_groups=3, group_top_k=1), "num_groups must divide num_experts=4"),
    (dict(num_groups=2, group_top_k=2, top_k=1), r"top_k must be in \[group_top_k"),
    (dict(aux_loss_coeff=-1.0), "aux_loss_coeff must be a finite float >= 0"),
    (dict(renormalize=1), "renormalize must be a bool"),
    (dict(topk_scaling_factor=0.0), "topk_scaling_factor must be > 0, got 0"),
    (dict(topk_scaling_factor=float("nan")), "topk_scaling_factor must be a finite float"),
])
def test_router_argument_errors(kwargs, match):
    args = dict(top_k=2) | kwargs
    with pytest.raises((ValueError, TypeError), match=match):
        Router(H, E, args.pop("top_k"), **args)


def test_layer_input_errors():
    moe = make(seq_aux_loss_coeff=0.1)
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., 16\)"):
        moe(torch.randn(3, 5))
    with pytest.raises(ValueError, match="seq_aux_loss_coeff > 0"):
        moe(torch.randn(3, H))
    with pytest.raises(ValueError, match="capacity_factor must be a finite float > 0"):
        te_ops.MoE(H, FF, E, 2, capacity_factor=0)
    with pytest.raises(ValueError, match="drop_policy must be one of"):
        te_ops.MoE(H, FF, E, 2, capacity_factor=1.0, drop_policy="random")
    with pytest.raises(RuntimeError, match="expert_bias=True"):
        make().update_expert_bias()


def test_op_graph_names_the_fed_inputs():
    from te_ops.ir import build_graph, validate

    moe = make()
    graph = build_graph(moe.block)
    validate(graph)
    fed = {n: d["fed"] for n, d in graph.nodes(data=True) if d.get("fed")}
    assert fed == {"op1": {0: ("op0", "top_k_index"), 1: ("op0", "top_k_probs")},
                   "op2": {0: ("op1", "split_sizes")}, "op3": {0: ("op1", "probs")},
                   "op4": {0: ("op1", "split_sizes")},
                   "op5": {0: ("op1", "pair_index"), 1: ("op1", "row_index")}}
    assert '"op1" -> "op5" [style=dotted, label="row_index"]' in moe.block.to_dot()


def test_module_tree_and_state_dict_names():
    moe = make(shared_ffn_hidden_size=8, expert_bias=True)
    assert sorted(moe.state_dict()) == [
        "experts.0.weight", "experts.2.weight", "router.expert_bias", "router.weight",
        "shared_experts.0.weight", "shared_experts.2.weight"]
    assert moe.router.weight.shape == (E, H)
    assert moe.experts[0].weight.shape == (E, 2 * FF, H)
    assert moe.experts[2].weight.shape == (E, H, FF)
    assert make().shared_experts is None


def test_deepcopy_and_to_keep_the_wiring():
    import copy

    moe = make(aux_loss_coeff=0.01, capacity_factor=1.0)
    x = torch.randn(2, 5, H)
    y, aux = moe(x)
    twin = copy.deepcopy(moe)
    assert twin.block[1] is twin.permute and twin.block[0] is twin.router
    y2, aux2 = twin(x)
    assert torch.equal(y, y2) and torch.equal(aux, aux2)
    twin.to(torch.float64)
    y3, _ = twin(x.double())
    torch.testing.assert_close(y3, y.double(), rtol=1e-4, atol=1e-4)


def test_graph_safety_gate_accepts_the_layer():
    from te_ops.graphs import graph_safe_unsupported_reason

    moe = te_ops.MoE(H, 16, E, 2, dtype=torch.bfloat16)
    assert graph_safe_unsupported_reason(moe.block, torch.randn(8, H, dtype=torch.bfloat16)
                                         ) is None


def test_permute_and_combine_input_errors():
    permute, combine = Permute(E), Combine()
    x = torch.randn(3, H)
    idx = torch.zeros(3, 2, dtype=torch.int64)
    probs = torch.rand(3, 2)
    with pytest.raises(TypeError, match="top_k_index must have an integer dtype"):
        permute(x, idx.float(), probs)
    with pytest.raises(ValueError, match=r"top_k_probs must have shape \(3, top_k\)"):
        permute(x, idx, probs[:2])
    with pytest.raises(ValueError, match="top_k_probs must have top_k_index's shape"):
        permute(x, idx, probs[:, :1])
    with pytest.raises(TypeError, match="row_index must be a 2-D int64 tensor"):
        combine(torch.randn(6, H), torch.arange(6), torch.arange(6))
    with pytest.raises(ValueError, match=r"input must have shape \(6, hidden\)"):
        combine(torch.randn(5, H), torch.arange(6), torch.arange(6).view(3, 2))


def test_permute_alone_returns_every_output():
    x = torch.randn(3, H)
    idx = torch.tensor([[0, 1], [1, 2], [1, 0]])
    rows, split_sizes, probs, pair_index, row_index, load, dropped = Permute(E)(
        x, idx, torch.rand(3, 2))
    assert split_sizes.tolist() == [2, 3, 1, 0] and load.tolist() == [2, 3, 1, 0]
    assert torch.equal(rows, x[pair_index // 2]) and int(dropped) == 0
    assert torch.equal(pair_index[row_index.reshape(-1)], torch.arange(6))


def test_split_size_check_with_fed_split_sizes(monkeypatch):
    """TE_OPS_CHECK_SPLIT_SIZES=1 reads split sizes on the host: eager it checks the fed ones;
    the compile gate runs such a call eagerly rather than tracing the read."""
    from te_ops.compile import call_reasons

    monkeypatch.setenv("TE_OPS_CHECK_SPLIT_SIZES", "1")
    moe = make()
    x = torch.randn(4, H)
    y, _ = moe(x)
    assert y.shape == x.shape
    reasons = call_reasons(moe.block.fusers()[0].basic_ops, x, ())
    assert any("TE_OPS_CHECK_SPLIT_SIZES=1" in r for r in reasons)


def test_activation_checkpoint_recomputes_the_same():
    moe = make(aux_loss_coeff=0.01, capacity_factor=1.0)
    x = torch.randn(2, 5, H)
    grads = []
    for wrap in (False, True):
        xi = x.clone().requires_grad_()
        if wrap:
            y, aux, *_ = torch.utils.checkpoint.checkpoint(
                moe.block, xi, use_reentrant=False, context_fn=te_ops.checkpoint_context_fn)
        else:
            y, aux, *_ = moe.block(xi)
        (y.square().sum() + aux).backward()
        grads.append((y, xi.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


# --------------------------------------------------------------------------- CUDA graphs
def test_graph_gate_checks_the_layer_and_its_shared_experts(monkeypatch):
    from te_ops.graphs import graph_safe_unsupported_reason

    moe = te_ops.MoE(H, 16, E, 2, dtype=torch.bfloat16, shared_ffn_hidden_size=16)
    x = torch.randn(8, H, dtype=torch.bfloat16)
    assert graph_safe_unsupported_reason(moe, x) is None
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "loop")
    assert "the per-group loop backend copies split sizes to the host" in (
        graph_safe_unsupported_reason(moe, x))
    monkeypatch.delenv("TE_OPS_GROUPED_GEMM_BACKEND")
    with pytest.raises(ValueError, match="extra_inputs: te_ops.MoE takes the tokens only"):
        graph_safe_unsupported_reason(moe, x, torch.zeros(E, dtype=torch.int64))


@pytest.mark.parametrize("mode", ["dropless", "capacity_probs"])
def test_make_graphed_callable_of_the_layer_with_emulated_graphs(monkeypatch, mode):
    """``make_graphed_callable(te_ops.MoE)`` on the CPU with torch's graph machinery replaced by
    an eager emulation of its contract (tests/test_graph_safety.py): two outputs (y, aux_loss),
    every gradient equal to an eager twin's over changing routings, and the warm-up runs leave
    ``router.expert_load`` as it was (only replays count)."""
    import copy

    import te_ops.graphs as graphs
    from test_graph_safety import _emulated_make_graphed_callables

    monkeypatch.setattr(graphs, "_check_sample_inputs", lambda s: tuple(s))
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", _emulated_make_graphed_callables)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    torch.manual_seed(0)  # bf16, 16-byte rows: the graph-safe grouped GEMM's operands
    moe = te_ops.MoE(H, 16, E, 2, dtype=torch.bfloat16, expert_bias=True, aux_loss_coeff=0.01,
                     shared_ffn_hidden_size=16, **MODES[mode])
    twin = copy.deepcopy(moe)
    graphed = graphs.make_graphed_callable(moe, (torch.randn(2, 8, H).bfloat16()
                                                 .requires_grad_(),), check_sync=False)
    assert not moe.router.expert_load.any()
    for step in range(3):
        x, dy = torch.randn(2, 8, H).bfloat16(), torch.randn(2, 8, H).bfloat16()
        outs = []
        for fn, m in ((graphed, moe), (twin, twin)):
            xi = x.clone().requires_grad_()
            y, aux = fn(xi)
            torch.autograd.backward((y, aux), (dy, torch.ones_like(aux)))
            outs.append([y.detach().clone(), aux.detach().clone(), xi.grad]
                        + [p.grad for p in m.parameters() if p.requires_grad])
            m.zero_grad(set_to_none=True)
        for i, (a, b) in enumerate(zip(*outs)):
            assert torch.equal(a, b), f"step {step}: tensor {i}"
    assert torch.equal(moe.router.expert_load, twin.router.expert_load)


CUDA_H, CUDA_FF, CUDA_E = 64, 128, 8


def _cuda_layer(mode: str):
    """A bf16 layer on the GPU with every router feature that changes the math, and an
    identical eager twin."""
    import copy

    torch.manual_seed(0)
    moe = te_ops.MoE(CUDA_H, CUDA_FF, CUDA_E, 2, device="cuda", dtype=torch.bfloat16,
                     expert_bias=True, aux_loss_coeff=0.01, seq_aux_loss_coeff=0.01,
                     z_loss_coeff=1e-3, shared_ffn_hidden_size=64, **MODES[mode])
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.linspace(-0.05, 0.05, CUDA_E))
    return moe, copy.deepcopy(moe)


def _cuda_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(2, 128, CUDA_H, device="cuda", dtype=torch.bfloat16, generator=gen)
    return x, torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=gen)


def _cuda_step(fn, moe: te_ops.MoE, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    xi = x.clone().requires_grad_()
    y, aux = fn(xi)
    torch.autograd.backward((y, aux), (dy, torch.ones_like(aux)))
    out = [y.detach().clone(), aux.detach().clone(), xi.grad.clone()]
    out += [p.grad.clone() for p in moe.parameters() if p.requires_grad]
    moe.zero_grad(set_to_none=True)
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["dropless", "capacity_probs"])
def test_cuda_layer_runs_without_host_sync(mode):
    """Eager forward + backward under ``torch.cuda.set_sync_debug_mode("error")``: any
    host<->device sync (a split-size read, ``nonzero``, ``.item()``) raises."""
    moe, _ = _cuda_layer(mode)
    x, dy = _cuda_batch(0)
    _cuda_step(moe, moe, x, dy)  # one-time probes of the grouped GEMM backend
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _cuda_step(moe, moe, x, dy)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["dropless", "capacity_probs"])
def test_cuda_graph_of_the_layer_replays_bitwise_eager(mode):
    """The whole layer (router to combine, shared experts, balancing losses) in one CUDA graph:
    each replay routes new tokens (routings the capture never saw), and the output, aux loss
    and every gradient are bitwise an eager twin's; the routed load counts the replays."""
    from te_ops.graphs import make_graphed_callable

    moe, twin = _cuda_layer(mode)
    sample = _cuda_batch(100)[0].requires_grad_()
    graphed = make_graphed_callable(moe, (sample,))
    assert not moe.router.expert_load.any()  # capture runs left no load behind
    loads = []
    for step in range(4):
        x, dy = _cuda_batch(step)
        got = _cuda_step(graphed, moe, x, dy)
        before = twin.router.expert_load.clone()
        ref = _cuda_step(twin, twin, x, dy)
        loads.append(twin.router.expert_load - before)
        for i, (a, b) in enumerate(zip(got, ref)):
            assert torch.equal(a, b), f"{mode}, replay {step}: tensor {i} differs"
    assert torch.equal(moe.router.expert_load, twin.router.expert_load)
    assert any(not torch.equal(loads[0], load) for load in loads[1:])  # routings changed


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["dropless", "capacity_probs"])
def test_cuda_compile_fullgraph_bit_exact(mode):
    """``torch.compile(fullgraph=True)`` of the layer on the GPU: with ``aot_eager`` (the same
    kernels) bitwise eager over changing routings in one frame; with inductor one frame and
    no graph break, equal to eager within bf16 rounding (inductor generates the router's
    softmax and reductions itself)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    moe, _ = _cuda_layer(mode)
    for backend, exact in (("aot_eager", True), ("inductor", False)):
        torch._dynamo.reset()
        counters.clear()
        cnt = CompileCounterWithBackend(backend)
        compiled = torch.compile(moe, backend=cnt, fullgraph=True)
        for step in range(3):
            x, dy = _cuda_batch(step)
            ref = _cuda_step(moe, moe, x, dy)
            got = _cuda_step(compiled, moe, x, dy)
            for i, (a, b) in enumerate(zip(got, ref)):
                if exact:
                    assert torch.equal(a, b), f"{backend}, step {step}: tensor {i} differs"
                else:
                    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        assert cnt.frame_count == 1 and not counters["graph_break"]


def test_layer_explain_is_the_blocks_plan():
    moe = te_ops.MoE(16, 8, 4, 2)
    x = torch.randn(6, 16)
    text = moe.explain(x)
    assert text == moe.block.explain(x) and "Router" in text
    moe(x)
    assert moe.explain() == moe.block.explain()


@pytest.mark.parametrize("kwargs, match", [
    ({"ffn_hidden_size": -1}, "ffn_hidden_size must be a positive int, got -1"),
    ({"ffn_hidden_size": 0}, "ffn_hidden_size must be a positive int, got 0"),
    ({"shared_ffn_hidden_size": 0}, "shared_ffn_hidden_size must be a positive int, got 0"),
])
def test_layer_width_errors_name_the_argument(kwargs, match):
    args = {"hidden_size": 16, "ffn_hidden_size": 8, "num_experts": 4, "top_k": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        te_ops.MoE(**args)


def test_return_dropped_must_be_a_bool():
    moe = te_ops.MoE(16, 8, 4, 2)
    with pytest.raises(TypeError, match="return_dropped must be a bool, got str"):
        moe(torch.randn(3, 16), return_dropped="yes")


def test_dropless_combine_runs_unmasked_and_equals_the_masked_combine():
    """te_ops.MoE's dropless Combine skips the empty-slot mask (nothing can be dropped); the
    layer's output and gradients equal a masked Combine's bit for bit; capacity keeps it."""
    assert te_ops.MoE(16, 8, 4, 2).combine.masked is False
    assert te_ops.MoE(16, 8, 4, 2, capacity_factor=1.0).combine.masked is True
    torch.manual_seed(0)
    x = torch.randn(9, 16, dtype=torch.float64)
    results = []
    for masked in (False, True):
        torch.manual_seed(1)
        moe = te_ops.MoE(16, 8, 4, 2, dtype=torch.float64, aux_loss_coeff=0.01)
        moe.combine.masked = masked
        xi = x.clone().requires_grad_()
        y, aux = moe(xi)
        (y.square().sum() + aux).backward()
        results.append([y, xi.grad] + [p.grad for p in moe.parameters() if p.requires_grad])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="masked must be a bool, got int"):
        Combine(masked=1)
