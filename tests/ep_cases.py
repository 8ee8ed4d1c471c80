"""Expert-parallel cases run on every rank of a gloo pool (tests/dist_pool.py) by
tests/test_expert_parallel.py.

Each case builds ``te_ops.MoE(..., ep_group=group)`` and, in the same process, the
single-process ``te_ops.MoE`` with the same (full) weights, runs every rank's batch of the
group through the reference (each process makes the whole group's data from fixed seeds) and
asserts on this rank's share: outputs, input gradients, the aux losses (the ranks' shares sum
to the reference's), the router gradient (summed over the group) and this rank's shard of the
expert weight gradients. float64 throughout (the grouped GEMMs run in the loop backend), so
the tolerances are tight.

Groups (made by :func:`setup` on a 4-process pool, in the same order on every rank): ``ep4``
(all four), ``ep2`` (ranks {0, 1} and {2, 3}: each half runs the case on its own), ``ep1``
(each rank alone) and ``dp2`` ({0, 2} and {1, 3}, the data-parallel replicas of ``ep2``).
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from block_replay import assert_layer_compiles_bit_exact, assert_meta_layer_step

import te_ops
from te_ops.routing import tokens_per_expert

H, FF = 8, 6
TOL = dict(rtol=1e-10, atol=1e-10)
GROUPS: dict[str, Any] = {}


def setup(rank: int, world: int) -> None:
    GROUPS["ep4"] = dist.group.WORLD
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    GROUPS["ep2"] = halves[rank // 2]
    singles = [dist.new_group([r]) for r in range(world)]
    GROUPS["ep1"] = singles[rank]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    GROUPS["dp2"] = replicas[rank % 2]


def _group(name: str) -> tuple[Any, int, int]:
    group = GROUPS[name]
    return group, dist.get_world_size(group), dist.get_rank(group)


# ------------------------------------------------------------------------------- building
def build(group: Any, *, num_experts: int = 4, top_k: int = 2, steer: str | None = None,
          dtype: torch.dtype = torch.float64, hidden: int = H, ffn: int = FF, **kw: Any
          ) -> tuple[te_ops.MoE, te_ops.MoE]:
    """(the EP layer, the single-process layer) with the same weights."""
    torch.manual_seed(0)
    ref = te_ops.MoE(hidden, ffn, num_experts, top_k, dtype=dtype, **kw)
    with torch.no_grad():
        for p in ref.parameters():
            if p.requires_grad:
                p.normal_(0, 0.5)
        if ref.router.expert_bias is not None:  # a bias that changes the selection
            ref.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, num_experts))
        _steer(ref, steer)
    moe = te_ops.MoE(hidden, ffn, num_experts, top_k, dtype=dtype, ep_group=group, **kw)
    moe.load_state_dict(ref.state_dict())  # the full layer's: this rank's experts are kept
    return moe, ref


def _steer(moe: te_ops.MoE, steer: str | None) -> None:
    """Gate rows for positive inputs: ``"first_rank"``: every token picks experts
    0..top_k-1; ``"span"``: every token picks expert 0 and the last expert (first and last
    rank)."""
    if steer is None:
        return
    w = moe.router.weight
    w.uniform_(-0.1, 0.1)
    e, k = moe.router.num_experts, moe.router.top_k
    favoured = list(range(k)) if steer == "first_rank" else [0, e - 1]
    for i in favoured:
        w[i] = 5.0


def batches(counts: list[int], steer: str | None, seq: int | None = None
            ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's input and output gradient, from fixed seeds (``seq``: (count, seq, H))."""
    xs, gys = [], []
    for i, n in enumerate(counts):
        gen = torch.Generator().manual_seed(100 + i)
        shape = (n, H) if seq is None else (n, seq, H)
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        xs.append(x.abs() + 0.1 if steer else x)
        gys.append(torch.randn(shape, generator=gen, dtype=torch.float64))
    return xs, gys


def step(moe: te_ops.MoE, x: torch.Tensor, gy: torch.Tensor, ga: float = 3.0):
    """Forward and backward of ``(y * gy).sum() + ga * aux``; (y, aux, dropped, x.grad)."""
    x = x.detach().to(moe.router.weight.dtype).requires_grad_()
    y, aux, dropped = moe(x, return_dropped=True)
    ((y * gy.to(y.dtype)).sum() + ga * aux).backward()
    return y.detach(), aux.detach(), dropped, x.grad


def _sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t, group=group)
    return t


def expert_grads(moe: te_ops.MoE) -> list[torch.Tensor]:
    return [moe.experts[0].weight.grad, moe.experts[2].weight.grad]


def check_shard_grads(moe: te_ops.MoE, ref: te_ops.MoE, *, tol: dict = TOL) -> None:
    local = slice(moe.local_experts.start, moe.local_experts.stop)
    for mine, full in zip(expert_grads(moe), expert_grads(ref)):
        torch.testing.assert_close(mine, full[local], **tol)


# ------------------------------------------------------------------------------- the cases
def matches_single_process(group: str, counts: list[int], steer: str | None = None,
                           seq: int | None = None, **kw: Any) -> dict:
    """This rank's results against the single-process layer on the group's concatenated
    batch (``counts[r]`` tokens on rank ``r``; with ``seq`` sequences of that length)."""
    g, size, rank = _group(group)
    moe, ref = build(g, steer=steer, **kw)
    xs, gys = batches(counts[:size], steer, seq)
    y, aux, dropped, dx = step(moe, xs[rank], gys[rank])
    y_ref, aux_ref, dropped_ref, dx_ref = step(ref, torch.cat(xs), torch.cat(gys))
    rows = slice(sum(counts[:rank]), sum(counts[:rank + 1]))
    torch.testing.assert_close(y, y_ref[rows], **TOL)
    torch.testing.assert_close(dx, dx_ref[rows], **TOL)
    torch.testing.assert_close(_sum(aux, g), aux_ref, **TOL)
    assert int(_sum(dropped, g)) == int(dropped_ref) == 0
    torch.testing.assert_close(_sum(moe.router.weight.grad, g), ref.router.weight.grad, **TOL)
    if moe.shared_experts is not None:
        for mine, full in zip(moe.shared_experts.parameters(), ref.shared_experts.parameters()):
            torch.testing.assert_close(_sum(mine.grad, g), full.grad, **TOL)
    check_shard_grads(moe, ref)
    _, top_k_index, _, _ = ref.router(torch.cat(xs))
    load = tokens_per_expert(top_k_index.reshape(-1), ref.router.num_experts)
    return {"received": int(load[moe.local_experts.start:moe.local_experts.stop].sum())}


def capacity_overflow_matches_each_rank_alone(group: str, counts: list[int],
                                              capacity_factor: float, drop_policy: str) -> dict:
    """Capacity mode past capacity: each rank drops its own pairs past ``C`` (computed from
    its tokens), as the single-process layer on that rank's batch alone does; the expert
    gradients sum the ranks' batches."""
    g, size, rank = _group(group)
    moe, ref = build(g, capacity_factor=capacity_factor, drop_policy=drop_policy, top_k=2)
    xs, gys = batches(counts[:size], None)
    y, aux, dropped, dx = step(moe, xs[rank], gys[rank])
    mine_ref = None
    for i in range(size):  # the reference's gradients add up over the ranks' batches
        out = step(ref, xs[i], gys[i])
        if i == rank:
            mine_ref = out
    y_ref, _, dropped_ref, dx_ref = mine_ref
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(dx, dx_ref, **TOL)
    assert int(dropped) == int(dropped_ref) > 0, (int(dropped), int(dropped_ref))
    torch.testing.assert_close(_sum(moe.router.weight.grad, g), ref.router.weight.grad, **TOL)
    check_shard_grads(moe, ref)
    return {"dropped": int(dropped)}


def capacity_needs_equal_token_counts(group: str) -> str:
    """Capacity mode with different token counts: the device-side check raises (on the CPU
    at once) before any row is sent."""
    g, size, rank = _group(group)
    moe, _ = build(g, capacity_factor=1.0)
    x = torch.randn(4 + 2 * rank, H, dtype=torch.float64)
    try:
        moe(x)
    except RuntimeError as exc:
        assert "different capacities" in str(exc), exc
        return str(exc)
    raise AssertionError("capacity mode with different token counts did not raise")


def meta_capacity_reads_no_device_value(group: str) -> None:
    """Capacity mode on ``meta`` (no values: any host read raises), forward and backward,
    with every router loss and the shared experts; dropless on ``meta`` under
    TE_OPS_GRAPH_SAFE=1 raises naming the host read."""
    g, size, rank = _group(group)
    os.environ["TE_OPS_GRAPH_SAFE"] = "1"
    try:
        kw = dict(device="meta", dtype=torch.bfloat16, ep_group=g, shared_ffn_hidden_size=8,
                  aux_loss_coeff=0.01, seq_aux_loss_coeff=0.01, z_loss_coeff=0.01,
                  expert_bias=True)
        moe = te_ops.MoE(16, 16, 4, 2, capacity_factor=1.0, **kw)
        x = torch.randn(2, 8, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
        assert_meta_layer_step(moe, x)
        dropless = te_ops.MoE(16, 16, 4, 2, **kw)
        try:
            dropless(x)
        except RuntimeError as exc:
            assert "TE_OPS_GRAPH_SAFE=1 forbids host syncs" in str(exc), exc
            assert "copies the all-to-all split sizes to the host" in str(exc), exc
        else:
            raise AssertionError("dropless expert parallelism ran on meta")
    finally:
        del os.environ["TE_OPS_GRAPH_SAFE"]


def compile_capacity_fullgraph_bit_exact(group: str) -> None:
    """``torch.compile(fullgraph=True)`` of the capacity-mode layer: the collectives are
    graph nodes; forward and backward bit for bit the eager ones. Dropless: fullgraph
    raises naming the host read."""
    g, size, rank = _group(group)
    moe, _ = build(g, capacity_factor=1.0, aux_loss_coeff=0.01, z_loss_coeff=0.01,
                   shared_ffn_hidden_size=4, dtype=torch.float32)
    x = torch.randn(2, 3, H, generator=torch.Generator().manual_seed(rank))
    assert_layer_compiles_bit_exact(moe, x)
    dropless, _ = build(g, dtype=torch.float32)
    torch._dynamo.reset()
    try:
        torch.compile(dropless, backend="aot_eager", fullgraph=True)(x)
    except Exception as exc:  # torch._dynamo's Unsupported, carrying te_ops' reason
        assert "copies the all-to-all split sizes to the host" in str(exc), exc
    else:
        raise AssertionError("dropless expert parallelism traced whole")
    torch._dynamo.reset()


def one_rank_launches_no_collective(group: str) -> None:
    """A one-rank group: both modes equal the non-EP layer bit for bit (forward, every
    gradient) without launching a collective or reading a device value on the host; the
    gates accept dropless mode too and explain() says why."""
    from unittest import mock

    from te_ops.graphs import graph_safe_unsupported_reason

    g, size, _ = _group(group)
    assert size == 1

    def refuse(*args: Any, **kw: Any) -> None:
        raise AssertionError("a one-rank group launched a collective or read the host")

    for kw in ({}, {"capacity_factor": 2.0}):
        moe, ref = build(g, aux_loss_coeff=0.05, **kw)
        x = torch.randn(7, H, dtype=torch.float64)
        dy = torch.randn(7, H, dtype=torch.float64)
        results = []
        for layer, patched in ((ref, False), (moe, True)):
            xi = x.clone().requires_grad_()
            # every collective of te_ops.comm names its group through group_name
            with mock.patch.object(te_ops.comm, "group_name", refuse), \
                    mock.patch("te_ops.basic.ep.host_values", refuse) if patched else \
                    contextlib.nullcontext():
                y, aux = layer(xi)
                ((y * dy).sum() + aux).backward()
            results.append([y, aux, xi.grad] + [p.grad for p in layer.parameters()
                                                 if p.requires_grad])
        for got, want in zip(results[1], results[0]):
            assert torch.equal(got, want), (kw, got, want)
        # the gates may refuse CPU float64 for other reasons, never for the all-to-alls
        for why in (graph_safe_unsupported_reason(moe.block, x),
                    te_ops.compile_unsupported_reason(moe.block, x)):
            assert why is None or "AllToAll" not in why, why
        text = moe.block.explain(x)
        assert "group has one rank, so the all-to-all is the identity" in text, text
    # bad split sizes: the device-side assert (raised at once on the CPU) names them
    dispatch = te_ops.AllToAllDispatch(4, g)
    rows, probs = torch.randn(6, H), torch.rand(6)
    with pytest.raises(RuntimeError, match="split_sizes must sum to the input's rows"):
        te_ops.Sequential(dispatch)(rows, torch.tensor([1, 2, 0, 1]), probs)


def gates_explain_and_fusion(group: str) -> None:
    """The graph-safety and compile gates name the dropless host read and accept the
    capacity mode; explain() names the transport; the grouped-MLP fusion still applies
    between the all-to-alls (float32)."""
    from te_ops.graphs import graph_safe_unsupported_reason

    g, size, rank = _group(group)
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    dropless = te_ops.MoE(16, 16, 4, 2, dtype=torch.bfloat16, ep_group=g)
    capacity = te_ops.MoE(16, 16, 4, 2, dtype=torch.bfloat16, ep_group=g, capacity_factor=1.0)
    reason = graph_safe_unsupported_reason(dropless.block, x)
    assert reason is not None and "op 2 (AllToAllDispatch" in reason, reason
    assert graph_safe_unsupported_reason(capacity.block, x) is None
    assert "copies the all-to-all split sizes" in te_ops.compile_unsupported_reason(
        dropless.block, x)
    assert te_ops.compile_unsupported_reason(capacity.block, x) is None
    moe, _ = build(g, dtype=torch.float32)
    moe(torch.randn(6, H))
    plan = moe.block.fusers()[0].plan()
    names = [type(op).__name__ for op, _ in plan.forward_ops]
    assert names == ["Router", "Permute", "AllToAllDispatch", "ForwardGroupedMLP",
                     "AllToAllCombine", "Combine"], names
    text = moe.block.explain()
    assert "all_to_all_single over gloo with host split lists" in text, text
    assert "runs on CUDA tensors only" in text, text
    # the symmetric-memory gate's next reason, for CUDA rows over this gloo group
    why = te_ops.comm.device_splits_unavailable_reason(g, torch.device("cuda"))
    assert why.startswith("the group's backend is gloo") and "needs an NCCL group" in why, why
    assert "copies the all-to-all split sizes to the host once per step" in reason, reason


def wiring_across_fusers_matches_one_fuser(group: str) -> None:
    """A hook on the activation splits the block into three fusers: the fed index maps and
    split lists cross fuser boundaries (the combine reads the split sizes again), same
    results."""
    g, size, rank = _group(group)
    moe, _ = build(g, aux_loss_coeff=0.01)
    xs, gys = batches([5, 3, 4, 6][:size], None)
    first = step(moe, xs[rank], gys[rank])
    grads = [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad(set_to_none=True)
    calls = []
    moe.experts[1].register_forward_hook(lambda *args: calls.append(1))
    assert len(moe.block.fusers()) == 3
    second = step(moe, xs[rank], gys[rank])
    assert calls == [1]
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, **TOL)
    for p, gr in zip(moe.parameters(), grads):
        torch.testing.assert_close(p.grad, gr, **TOL)


def expert_bias_update_sums_the_group_load(group: str) -> None:
    """Aux-loss-free balancing under EP: the load summed over the group, so every rank's
    replicated bias takes the update of the concatenated batch's load."""
    g, size, rank = _group(group)
    moe, ref = build(g, expert_bias=True, score_function="sigmoid")
    xs, _ = batches([5, 3, 4, 6][:size], None)
    moe.train()
    ref.train()
    moe(xs[rank])
    ref(torch.cat(xs))
    moe.update_expert_bias(rate=0.01)
    ref.update_expert_bias(rate=0.01)
    torch.testing.assert_close(moe.router.expert_bias, ref.router.expert_bias, rtol=0, atol=0)
    every = [torch.empty_like(moe.router.expert_bias) for _ in range(size)]
    dist.all_gather(every, moe.router.expert_bias, group=g)
    assert all(torch.equal(e, every[0]) for e in every)


def deepcopy_shares_the_group(group: str) -> None:
    g, size, rank = _group(group)
    moe, _ = build(g, capacity_factor=1.0)
    x = torch.randn(4, H, dtype=torch.float64)
    twin = copy.deepcopy(moe)
    assert twin.ep_dispatch.group is g and twin.router._group.group is g
    assert twin.block[2] is twin.ep_dispatch and twin.block[6] is twin.ep_combine
    assert torch.equal(moe(x)[0], twin(x)[0])


def state_dict_holds_the_local_experts(group: str) -> None:
    """``state_dict()`` holds this rank's experts and loads back; ``load_state_dict`` of the
    full layer's keeps this rank's rows (checked against the full weights)."""
    g, size, rank = _group(group)
    moe, ref = build(g)
    local = slice(moe.local_experts.start, moe.local_experts.stop)
    sd = moe.state_dict()
    assert sd["experts.0.weight"].shape[0] == 4 // size
    assert torch.equal(sd["experts.2.weight"], ref.state_dict()["experts.2.weight"][local])
    twin, _ = build(g, top_k=1)
    twin.load_state_dict(sd)
    assert torch.equal(twin.experts[0].weight, moe.experts[0].weight)
    import pytest

    with pytest.raises(RuntimeError, match="size mismatch"):
        twin.load_state_dict({**sd, "experts.0.weight": sd["experts.0.weight"][:0]})


def argument_errors(group: str) -> None:
    g, size, rank = _group(group)
    cases = [
        (ValueError, "num_experts must be divisible by the ep_group's size",
         lambda: te_ops.MoE(H, FF, size + 1, 1, ep_group=g)),
        (TypeError, "ep_group must be a torch.distributed.ProcessGroup",
         lambda: te_ops.AllToAllDispatch(4, "world")),
        (TypeError, "dispatch must be an AllToAllDispatch",
         lambda: te_ops.AllToAllCombine(te_ops.Permute(4))),
        (TypeError, "capacity must be a bool",
         lambda: te_ops.AllToAllDispatch(4, g, capacity=1.0)),
    ]
    dispatch = te_ops.AllToAllDispatch(4, g)
    x = torch.randn(5, H)
    cases += [
        (ValueError, r"split_sizes must have shape \(4,\)",
         lambda: dispatch(x, torch.tensor([1, 2, 2]), torch.rand(5))),
        (TypeError, "split_sizes must have an integer dtype",
         lambda: dispatch(x, torch.ones(4), torch.rand(5))),
        (ValueError, r"probs must have shape \(5,\)",
         lambda: dispatch(x, torch.tensor([1, 2, 2, 0]), torch.rand(4))),
        # every rank gets the same sizes: the count exchange runs, then each rank raises
        (ValueError, "split_sizes must sum to the input's 5 rows",
         lambda: dispatch(x, torch.tensor([1, 1, 1, 0]), torch.rand(5))),
        (ValueError, "multiple of num_experts=4 rows in capacity mode",
         lambda: te_ops.AllToAllDispatch(4, g, capacity=True)(
             x, torch.tensor([1, 1, 1, 2]), torch.rand(5))),
    ]
    import pytest

    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()


def ep_and_dp_with_ddp(ep: str = "ep2", dp: str = "dp2") -> dict:
    """2 EP x 2 DP on four ranks: DistributedDataParallel over the non-expert parameters
    (an input projection, the router, the shared experts), the expert weights sharded over
    the EP group and replicated over the DP group, their gradients all-reduced over the DP
    group only (then divided by the world size, as DDP averages). Against the single-process
    model: the mean over the four ranks of each rank's loss, each EP group's aux shares
    summing to its concatenated batch's aux loss."""
    from torch.nn.parallel import DistributedDataParallel

    ep_group, ep_size, _ = _group(ep)
    dp_group, _, _ = _group(dp)
    world, rank = dist.get_world_size(), dist.get_rank()

    class Model(torch.nn.Module):
        def __init__(self, group: Any) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(H, H, dtype=torch.float64)
            self.moe = te_ops.MoE(H, FF, 4, 2, dtype=torch.float64, ep_group=group,
                                  aux_loss_coeff=0.05, shared_ffn_hidden_size=4)

        def forward(self, x):
            return self.moe(self.proj(x))

    torch.manual_seed(0)
    ref = Model(None)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.5)
    model = Model(ep_group)
    model.load_state_dict(ref.state_dict())
    expert_names = [f"moe.experts.{i}.weight" for i in (0, 2)]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_names)
    ddp = DistributedDataParallel(model)
    counts = [5, 3, 6, 4]
    xs, gys = batches(counts, None)
    y, aux = ddp(xs[rank])
    ((y * gys[rank]).sum() + aux).backward()  # DDP averages over the world
    for name in expert_names:
        p = model.get_parameter(name)
        dist.all_reduce(p.grad, group=dp_group)
        p.grad /= world
    for first in range(0, world, ep_size):  # each EP group's concatenated batch
        group_rows = slice(first, first + ep_size)
        Y, AUX = ref(torch.cat(xs[group_rows]))
        (((Y * torch.cat(gys[group_rows])).sum() + AUX) / world).backward()
    for name, p in model.named_parameters():
        full = ref.get_parameter(name).grad
        if name in expert_names:
            full = full[model.moe.local_experts.start:model.moe.local_experts.stop]
        torch.testing.assert_close(p.grad, full, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    return {"loss_share": float(aux)}



def benchmark_runs(out: str) -> int:
    """benchmarks/moe_ep.py end to end on this pool's four ranks (ep 4, gloo, tiny shapes):
    every part, mode and peer gives a record, and the te_ops layer matches the torch peer."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import moe_ep

    records = moe_ep.main(["--device", "cpu", "--tokens", "16", "--hidden", "16", "--ffn", "8",
                           "--experts", "8", "--top-k", "2", "--dtype", "float32",
                           "--iters", "2", "--warmup", "1", "--out", out])
    kinds = {(r["part"], r["mode"], r["peer"]) for r in records}
    assert kinds == {(p, m, n) for p in moe_ep.PARTS for m in moe_ep.MODES
                     for n in ("te_ops", "torch_a2a")} | {
        ("layer", m, "te_ops_no_ep") for m in moe_ep.MODES}, kinds
    assert all(r["ep"] == 4 and r["ms_median_slowest_rank"] > 0 for r in records)
    assert all((r["ratio_vs_no_ep"] is not None) == ((r["part"], r["peer"]) == ("layer", "te_ops"))
               for r in records), records
    diffs = [r["max_abs_diff"] for r in records if r["max_abs_diff"] is not None]
    assert diffs and max(diffs) < 1e-5, diffs
    return len(records)


def main_job_ep_step_gradients_match_one_process() -> None:
    """One training step of the main job under ``--ep 4`` (each rank's quarter of the batch,
    DDP over the non-expert parameters, the expert gradients divided by N): every gradient
    equals the one-process step's on the whole batch (the expert ones on this rank's rows)."""
    from te_ops.examples import train_moe

    args = train_moe.parse_args(
        ["--batch-size", "4", "--seq-len", "16", "--layers", "2", "--d-model", "16",
         "--heads", "2", "--experts", "8", "--top-k", "2", "--ffn", "16", "--ep", "4",
         "--aux-coef", "0.5"])
    cpu = torch.device("cpu")
    sizes = (args.seq_len, args.layers, args.d_model, args.heads, args.ffn, args.experts,
             args.top_k)
    torch.manual_seed(0)
    ep = train_moe.ExpertParallel(cpu)
    model, ddp = ep.build(args, cpu, torch.float32)
    torch.manual_seed(0)
    one = train_moe.MoELanguageModel(*sizes)
    x, y = train_moe.sample_batch(torch.arange(512) % 256, args.batch_size, args.seq_len,
                                  torch.Generator().manual_seed(1))
    loss = train_moe.backward_step(ddp, model, ep.rows(x), ep.rows(y), args, ep)
    full = train_moe.backward_step(one, one, x, y, args, None)
    torch.testing.assert_close(ep.mean(loss), full.detach(), rtol=1e-5, atol=1e-6)
    local = model.blocks[0].moe.local_experts
    for name, p in model.named_parameters():
        g = one.get_parameter(name).grad
        if ".moe.experts." in name:
            g = g[local.start:local.stop]
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")


def main_job_ep_matches_one_process(out: str) -> dict:
    """The main job with ``--ep 4`` on this pool's four ranks against the same job in one
    process (rank 0 runs it after): the same loss curve (each rank's quarter of the batch,
    the one-process initial weights, DDP's mean)."""
    from te_ops.examples import train_moe

    tiny = ["--steps", "6", "--batch-size", "4", "--seq-len", "16", "--layers", "1",
            "--d-model", "16", "--heads", "2", "--experts", "4", "--top-k", "2", "--ffn", "16",
            "--eval-every", "3", "--eval-batches", "1", "--seed", "3"]
    os.environ["TRAIN_MOE_PROGRESS"] = "0"
    ep = train_moe.main([*tiny, "--ep", "4", "--out-dir", os.path.join(out, "ep")])
    assert ep["config"]["ep"] == 4
    if dist.get_rank() != 0:
        return {}
    one = train_moe.main([*tiny, "--out-dir", os.path.join(out, "one")])
    curve = [(e["train_loss"], e["val_loss"]) for e in ep["evals"]]
    reference = [(e["train_loss"], e["val_loss"]) for e in one["evals"]]
    torch.testing.assert_close(curve, reference, rtol=1e-5, atol=0)
    torch.testing.assert_close(ep["final_val_loss"], one["final_val_loss"], rtol=1e-5, atol=0)
    return {"curve": curve, "reference": reference}
