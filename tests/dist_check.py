"""DDP and FSDP2 check of a te_ops expert block; run with 2+ processes:

    python -m torch.distributed.run --nproc_per_node 2 tests/dist_check.py --backend gloo
    torchrun --nproc_per_node 2 tests/dist_check.py --backend nccl     # one GPU per process

Every rank builds the same block, runs its own micro-batch (its own routing) under
``DistributedDataParallel`` and under ``torch.distributed.fsdp.fully_shard`` (per-expert and
single-grouped-weight parameters), and checks the averaged gradients and one SGD update
against (a) the float64 per-expert reference of ``reference.py`` and (b) te_ops in one process,
both on the concatenated batch (every rank's rows, regrouped by expert). Prints
``dist_check OK`` and a JSON line of the largest differences per rank; raises otherwise.
``tests/test_training.py`` runs it on gloo with 2 CPU processes.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import warnings

import reference as ref
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import te_ops

E, H, F = 4, 16, 24
LR = 0.1


def make_block(device: torch.device, single: bool) -> te_ops.Sequential:
    torch.manual_seed(0)
    kw = {"single_grouped_weight": single, "device": device}
    return te_ops.Sequential(te_ops.GroupedLinear(E, H, 2 * F, **kw), te_ops.ScaledSwiGLU(),
                             te_ops.GroupedLinear(E, F, H, **kw))


def rank_batch(rank: int, device: torch.device):
    """Rank ``rank``'s rows (sorted by expert), split sizes, probs and output gradient."""
    gen = torch.Generator().manual_seed(100 + rank)
    sizes = torch.randint(0, 7, (E,), generator=gen)
    sizes[rank % E] = 0  # a zero-token expert on every rank (a different one)
    rows = int(sizes.sum()) + 2  # two padding rows
    x = torch.randn(rows, H, generator=gen)
    probs = torch.rand(rows, generator=gen)
    dy = torch.randn(rows, H, generator=gen)
    return [t.to(device) for t in (x, sizes, probs, dy)]


def concatenated(batches):
    """Every rank's valid rows regrouped by expert: one process's batch."""
    xs, ps, ds, sizes = [], [], [], torch.zeros(E, dtype=torch.int64)
    for x, s, p, d in batches:
        s = s.cpu()
        starts = torch.cumsum(s, 0) - s
        for g in range(E):
            rows = slice(int(starts[g]), int(starts[g] + s[g]))
            xs.append((g, x[rows]))
            ps.append((g, p[rows]))
            ds.append((g, d[rows]))
        sizes += s

    def cat(parts):
        return torch.cat([t for g in range(E) for gg, t in parts if gg == g])

    return cat(xs), sizes, cat(ps), cat(ds)


def grads_of(block: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in block.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().cpu()
    return out


def params_of(block: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
            for n, p in block.named_parameters()}


def reference_grads(block, x, sizes, probs, dy, scale: float) -> dict[str, torch.Tensor]:
    """float64 per-expert reference of ``scale * sum(y * dy)`` on one batch."""
    params = {n: p.detach().cpu() for n, p in block.named_parameters()}
    single = block[0].single_grouped_weight
    leaves = {n: ref.leaf(p) for n, p in params.items()}

    def per_group(i, kind):
        t = leaves[f"{i}.{kind}"] if single else None
        return list(t.unbind(0)) if single else [leaves[f"{i}.{kind}{g}"] for g in range(E)]

    def fn(_):
        return ref.grouped_mlp(ref.leaf(x.cpu()), sizes.cpu(), ref.leaf(probs.cpu()),
                               per_group(0, "weight"), per_group(0, "bias"),
                               per_group(2, "weight"), per_group(2, "bias"))

    _, grads = ref.forward_backward(fn, leaves, dy.cpu() * scale)
    return grads


def step_and_check(name: str, model, block, x, split, probs, dy, want_grads, want_single,
                   params0, report) -> None:
    y = model(x.clone().requires_grad_(), split, probs.clone().requires_grad_(), split)
    y.backward(dy)
    got = grads_of(block)
    for k, w in want_grads.items():
        ref.assert_close(got[k], w, torch.float32, f"{name}: {k}.grad vs reference")
        ref.assert_close(got[k], want_single[k], torch.float32, f"{name}: {k}.grad vs one process")
    report[f"{name}_grad_vs_ref"] = max((got[k] - w.float()).abs().max().item()
                                        for k, w in want_grads.items())
    torch.optim.SGD(block.parameters(), lr=LR).step()
    after = params_of(block)
    for k, p0 in params0.items():
        ref.assert_close(after[k], p0 - LR * want_single[k], torch.float32,
                         f"{name}: {k} after SGD")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args = parser.parse_args()
    # te_ops outputs must not be views (FSDP2 warns: in-place ops on them skip its hooks).
    warnings.filterwarnings("error", message=".*returned a view tensor.*")
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    batches = [rank_batch(r, device) for r in range(world)]
    x, split, probs, dy = batches[rank]
    # Each rank backpropagates dy; DDP and FSDP2 average over ranks, so the result is the
    # gradient of the concatenated batch's sum(y * dy) / world.
    xc, sc, pc, dc = concatenated(batches)
    report: dict[str, float] = {}
    for single in (False, True):
        base = make_block(device, single)
        params0 = params_of(base)
        want = reference_grads(base, xc, sc, pc, dc, 1.0 / world)
        one = copy.deepcopy(base)  # te_ops in one process on the concatenated batch
        sc_dev = sc.to(device)
        one(xc.clone().requires_grad_(), sc_dev, pc.clone().requires_grad_(), sc_dev).backward(
            dc / world)
        want_single = grads_of(one)
        tag = "single" if single else "per_expert"
        if not single:
            block = copy.deepcopy(base)
            ddp = DistributedDataParallel(block)
            step_and_check(f"ddp_{tag}", ddp, block, x, split, probs, dy, want, want_single,
                           params0, report)
        block = copy.deepcopy(base)
        mesh = init_device_mesh(device.type, (world,))
        fully_shard(block, mesh=mesh)
        step_and_check(f"fsdp2_{tag}", block, block, x, split, probs, dy, want, want_single,
                       params0, report)
    print(f"dist_check OK rank {rank} {args.backend} " + json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # The checks passed and the group is destroyed: leave without the interpreter's teardown,
    # where gloo's background threads can abort the process ("terminate called without an
    # active exception", seen on loaded 2-core machines) after a run whose checks all passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
