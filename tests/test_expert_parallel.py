"""Expert parallelism (``te_ops.MoE(ep_group=...)``) on gloo: one pool of 4 CPU processes
(tests/dist_pool.py, started once for the module), groups of 1, 2 and 4 ranks and 2 EP x 2
DP, against the single-process layer on the concatenated batch (tests/ep_cases.py); and on
the same pool benchmarks/moe_ep.py end to end and the main job's ``--ep`` against one process.

A CUDA test runs the same layer with one NCCL rank (ep_size 1): it equals the non-EP layer and
captures a CUDA graph in capacity mode.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from dist_pool import DistPool, free_port

import te_ops

ROUTERS = {
    "softmax_aux_z": dict(aux_loss_coeff=0.05, z_loss_coeff=0.01),
    "sigmoid_aux": dict(score_function="sigmoid", aux_loss_coeff=0.05),
    "group_limited_bias_shared": dict(num_experts=8, top_k=4, num_groups=4, group_top_k=2,
                                      score_function="sigmoid", expert_bias=True,
                                      shared_ffn_hidden_size=4),
}


@pytest.fixture(scope="module")
def pool():
    p = DistPool(4, "ep_cases")
    yield p
    p.close()


@pytest.mark.parametrize("router", list(ROUTERS))
@pytest.mark.parametrize("group", ["ep2", "ep4"])
def test_dropless_matches_single_process_uneven_tokens(pool, group, router):
    pool.run("matches_single_process", group=group, counts=[5, 9, 2, 7], **ROUTERS[router])


def test_sequence_aux_loss_over_the_group(pool):
    pool.run("matches_single_process", group="ep2", counts=[2, 3, 1, 2], seq=3,
             seq_aux_loss_coeff=0.05, aux_loss_coeff=0.02)


@pytest.mark.parametrize("group", ["ep2", "ep4"])
def test_capacity_without_overflow_matches_single_process(pool, group):
    # capacity_factor E / k: C >= tokens, nothing can drop
    pool.run("matches_single_process", group=group, counts=[6, 6, 6, 6], capacity_factor=2.0,
             aux_loss_coeff=0.05, z_loss_coeff=0.01)


@pytest.mark.parametrize("mode", [{}, {"capacity_factor": 4.0}], ids=["dropless", "capacity"])
def test_ranks_receiving_no_tokens(pool, mode):
    """Every token on the first rank's expert: the other ranks receive nothing (capacity
    factor E / k: nothing drops)."""
    results = pool.run("matches_single_process", group="ep4", counts=[4, 4, 4, 4],
                       steer="first_rank", top_k=1, aux_loss_coeff=0.05, **mode)
    assert [r["received"] for r in results] == [16, 0, 0, 0]


def test_top_k_spanning_ranks(pool):
    """Each token's two experts on the first and the last rank."""
    results = pool.run("matches_single_process", group="ep4", counts=[3, 2, 4, 1],
                       steer="span", aux_loss_coeff=0.05)
    assert [r["received"] for r in results] == [10, 0, 0, 10]


def test_ep_size_one_group(pool):
    pool.run("matches_single_process", group="ep1", counts=[5, 5, 5, 5], aux_loss_coeff=0.05)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_overflow_drops_per_rank(pool, policy):
    results = pool.run("capacity_overflow_matches_each_rank_alone", group="ep2",
                       counts=[8, 8, 8, 8], capacity_factor=0.5, drop_policy=policy)
    assert all(r["dropped"] > 0 for r in results)


#: Cases that assert on every rank, and their group.
CASES = {
    "capacity_needs_equal_token_counts": "ep2",
    "meta_capacity_reads_no_device_value": "ep2",
    "compile_capacity_fullgraph_bit_exact": "ep2",
    "gates_explain_and_fusion": "ep2",
    "wiring_across_fusers_matches_one_fuser": "ep2",
    "expert_bias_update_sums_the_group_load": "ep4",
    "deepcopy_shares_the_group": "ep2",
    "state_dict_holds_the_local_experts": "ep4",
    "argument_errors": "ep2",
    "one_rank_launches_no_collective": "ep1",
}


def test_main_job_ep_step_gradients_match_one_process(pool):
    pool.run("main_job_ep_step_gradients_match_one_process")


@pytest.mark.parametrize("case", list(CASES))
def test_case(pool, case):
    pool.run(case, group=CASES[case])


def test_ep_and_dp_with_ddp(pool):
    pool.run("ep_and_dp_with_ddp")


def test_benchmark_runs_on_four_ranks(pool, tmp_path):
    counts = pool.run("benchmark_runs", out=str(tmp_path))
    assert counts == [10] * 4
    assert len((tmp_path / "moe_ep.jsonl").read_text().splitlines()) == 10  # rank 0 writes


def test_main_job_ep_matches_one_process(pool, tmp_path):
    first, *_ = pool.run("main_job_ep_matches_one_process", out=str(tmp_path))
    assert len(first["curve"]) == 2
    assert (tmp_path / "ep" / "metrics.json").exists()  # rank 0 writes


def test_ep_group_needs_torch_distributed():
    import torch.distributed as dist

    assert not dist.is_initialized()  # the workers' groups live in their processes
    with pytest.raises(RuntimeError, match="ep_group: torch.distributed is not initialized"):
        te_ops.MoE(8, 6, 4, 2, ep_group=object())


# ------------------------------------------------------------------------------- CUDA
def _nccl_single_rank(port: int, out: str) -> None:
    """One NCCL rank: ep_size 1 equals the non-EP layer bit for bit (dropless and capacity),
    and the capacity-mode layer (with the router's group all-gather) is captured in CUDA
    graphs, forward and backward, replaying the eager values."""
    import ep_cases
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        group = dist.group.WORLD
        shape = dict(dtype=torch.bfloat16, hidden=16, ffn=16)  # 16-byte rows: torch._grouped_mm
        for mode in ({}, {"capacity_factor": 1.0}):
            moe, ref = ep_cases.build(group, **shape, **mode)
            moe.cuda()
            ref.cuda()
            x = torch.randn(64, 16, device="cuda", dtype=torch.bfloat16)
            gy = torch.randn_like(x)
            for a, b in zip(ep_cases.step(moe, x, gy), ep_cases.step(ref, x, gy)):
                assert torch.equal(a, b), mode
            for p, q in zip(moe.parameters(), ref.parameters()):
                assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), mode
        moe, _ = ep_cases.build(group, capacity_factor=1.0, aux_loss_coeff=0.01, **shape)
        moe.cuda()
        x = torch.randn(64, 16, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        graphed = te_ops.graphs.make_graphed_callable(moe.block, (x,))
        results = []
        for run in (graphed, moe.block):
            moe.zero_grad(set_to_none=True)
            xi = x.detach().clone().requires_grad_()
            y, aux, *_ = run(xi)
            (y.float().square().sum() + aux).backward()
            results.append([y.clone(), aux.clone(), xi.grad] + [p.grad for p in moe.parameters()])
        for a, b in zip(*results):
            assert torch.equal(a, b)
        Path(out).write_text("ok")
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
    # no destroy_process_group: NCCL's teardown after graph-captured collectives can block
    # (seen on the H200); the process exits and the driver frees the communicator
    os._exit(0)


@pytest.mark.cuda
def test_nccl_ep_size_one_equals_non_ep_and_captures(tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "result"
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_nccl_single_rank, args=(free_port(), str(out)))
    proc.start()
    proc.join(timeout=300)
    if proc.is_alive():
        proc.terminate()
        pytest.fail("the NCCL single-rank expert-parallel check did not finish in 300 s")
    assert proc.exitcode == 0 and out.read_text() == "ok", proc.exitcode
