"""Delayed wgrad under torch's data-parallel wrappers; run with 2 processes on gloo:

    python -m torch.distributed.run --nproc_per_node 2 --standalone \\
        tests/ddp_delayed_wgrad_check.py

``delay_wgrad_compute=True`` computes weight gradients in ``backward_dw()``, after the
backward in which ``DistributedDataParallel`` and ``fully_shard`` reduce them, so te_ops
refuses it there: DDP at the forward, FSDP2 at ``backward_dw()``. Under ``DDP.no_sync()``
(nothing reduced in backward) it runs, and gradients all-reduced by hand after
``backward_dw()`` equal DDP's without delayed wgrad. Prints ``delayed_wgrad_check OK`` per rank.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import te_ops

E, H, F = 4, 16, 24


def make_block(single: bool, delay: bool) -> te_ops.Sequential:
    torch.manual_seed(0)
    kw = {"single_grouped_weight": single, "delay_wgrad_compute": delay}
    return te_ops.Sequential(te_ops.GroupedLinear(E, H, 2 * F, **kw), te_ops.ScaledSwiGLU(),
                             te_ops.GroupedLinear(E, F, H, **kw))


def batch(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    sizes = [3 + rank, 0, 2, 4]
    rows = sum(sizes)
    return (torch.randn(rows, H, generator=g), sizes, torch.rand(rows, generator=g),
            torch.randn(rows, H, generator=g))


def expect_error(fn, *needles: str) -> None:
    try:
        fn()
    except RuntimeError as exc:
        msg = str(exc)
        missing = [n for n in needles if n not in msg]
        assert not missing, f"{missing} not in {msg!r}"
        return
    raise AssertionError(f"no RuntimeError naming {needles}")


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, sizes, probs, dy = batch(rank)
    for single in (False, True):
        # DDP: refused at the forward, naming the wrapper and the option
        ddp = DistributedDataParallel(make_block(single, delay=True))
        expect_error(lambda: ddp(x, sizes, probs, sizes), "DistributedDataParallel",
                     "delay_wgrad_compute=True", "no_sync")
        with torch.no_grad():  # inference: nothing to reduce, runs
            ddp(x, sizes, probs, sizes)

        # DDP.no_sync() + backward_dw() + a hand all-reduce == DDP without delayed wgrad
        plain = DistributedDataParallel(make_block(single, delay=False))
        plain(x, sizes, probs, sizes).backward(dy)
        want = {n: p.grad for n, p in plain.module.named_parameters()}
        delayed = DistributedDataParallel(make_block(single, delay=True))
        with delayed.no_sync():
            delayed(x, sizes, probs, sizes).backward(dy)
        delayed.module.backward_dw()
        for n, p in delayed.module.named_parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
            torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-6, msg=n)

        # FSDP2: refused at backward_dw() (the unsharded parameters are freed by then)
        block = make_block(single, delay=True)
        fully_shard(block,
                    mesh=init_device_mesh("cpu", (world,)))
        block(x, sizes, probs, sizes).backward(dy)
        expect_error(block.backward_dw, "fully_shard", "delay_wgrad_compute=False")
    print(f"delayed_wgrad_check OK rank {rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # The checks passed and the group is destroyed: leave without the interpreter's teardown,
    # where gloo's background threads can abort the process ("terminate called without an
    # active exception", seen on loaded 2-core machines) after a run whose checks all passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
