"""Host time of the parts of one eager fast-path step of the fused grouped MLP (CUDA).

``host_ab.py --profile`` says which Python functions and aten ops take the host time of a
whole step (cProfile and torch.profiler, both of which slow the code they watch). This script
times, without a profiler, the layers of the call one by one on the real problem (E64 T256
H2048 FF768 bf16 by default), for one or more te_ops packages in the same process (e.g. this
tree's ``te_ops`` and a renamed baseline copy, see ``host_ab.py --make-baseline``):

``step``           block(x, split, probs, split).backward(dy): the whole eager step
``fwd_block``      the block's forward (``Sequential`` -> ``nn.Module.__call__`` -> fuser)
``fwd_fuser``      the fuser's ``__call__`` (skips ``Sequential`` and the module call)
``fwd_fast_run``   ``FastStep.run`` (its checks and the autograd Function)
``backward``       ``y.backward(dy)`` alone (the forward untimed before each call)
``backward_body``  of that, the time inside the fast path's backward function
                   (``fast_step._fast_backward``); the rest is the autograd engine's
``engine_noop``    ``y.backward(g)`` of a one-op graph whose backward returns ``g`` (a
                   custom ``autograd.Function`` on the device): the engine's own floor
``make_splits``    the split-size metadata (one Triton launch and the checks)
``k_<call>``       each kernel call of the fast path as it makes it (fprop1, act_forward, ...)
``torch_empty``    one ``torch.empty`` of fc1's output shape
``stream``         Triton's current-stream read for the device

Host microseconds per call: the mean of ``--iters`` back-to-back calls (the device queue
drains between blocks only; the host outruns the device at these sizes, so this is the host's
time), median over ``--rounds``. JSON lines to stdout and ``--out``.

Usage::

    PYTHONPATH=.:/path/to/base python benchmarks/host_parts.py [--packages te_ops,te_ops_base]
        [--modes single,per_expert] [--iters 200] [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import JsonLines, check_list, check_min, env_override, machine_info  # noqa: E402
from grouped_mlp import HOST_SHAPES, SHAPES, make_problem  # noqa: E402
from host_ab import TeOpsBlock  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_call(call: Callable[[], object], iters: int, rounds: int) -> float:
    """Median over ``rounds`` of the mean host microseconds of ``iters`` calls."""
    times = []
    for _ in range(rounds):
        _sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        times.append((time.perf_counter() - t0) / iters * 1e6)
    _sync()
    return statistics.median(times)


def time_backward(make: Callable[[], torch.Tensor], zero: Callable[[], None],
                  dy: torch.Tensor, iters: int, rounds: int) -> float:
    """As :func:`time_call` for ``make().backward(dy)``, counting the backward only."""
    times = []
    for _ in range(rounds):
        _sync()
        total = 0.0
        for _ in range(iters):
            zero()
            y = make()
            t0 = time.perf_counter()
            y.backward(dy)
            total += time.perf_counter() - t0
        times.append(total / iters * 1e6)
    _sync()
    return statistics.median(times)


class _Noop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g


def time_engine_noop(device: torch.device, iters: int, rounds: int) -> float:
    """Host microseconds of ``y.backward(g)`` for the one-op graph of :class:`_Noop`."""
    x = torch.randn(16, device=device, requires_grad=True)
    g = torch.ones(16, device=device)

    def make():
        x.grad = None
        return _Noop.apply(x)

    return time_backward(make, lambda: None, g, iters, rounds)


def time_backward_body(pkg, make, zero, dy, iters: int, rounds: int) -> float:
    """Host microseconds per call spent inside ``fast_step._fast_backward`` while timing
    ``make().backward(dy)``."""
    mod = importlib.import_module(f"{pkg.__name__}.fast_step")
    inner = mod._fast_backward
    spent = [0.0, 0]

    def timed(*args):
        t0 = time.perf_counter()
        try:
            return inner(*args)
        finally:
            spent[0] += time.perf_counter() - t0
            spent[1] += 1

    mod._fast_backward = timed
    try:
        time_backward(make, zero, dy, iters, rounds)
    finally:
        mod._fast_backward = inner
    return spent[0] / max(spent[1], 1) * 1e6


def part_calls(pkg, blk: TeOpsBlock) -> dict[str, Callable[[], object]]:
    """The timed calls of one package's block (its fast path recorded first)."""
    p = blk.problem
    x, probs, dy, split = p.x, p.probs, p.dy, p.split
    block = blk.block
    for _ in range(3):
        for t in [x, probs, *block.parameters()]:
            t.grad = None
        block(x, split, probs, split).backward(dy)
    fuser = block._groups()[0]
    fast = fuser.__dict__.get("_fast_step")
    if fast is None:
        raise RuntimeError("the fast path was not recorded for this block")
    extra = (split, probs, split)
    splits_mod = importlib.import_module(f"{pkg.__name__}.splits")
    stacked = importlib.import_module(f"{pkg.__name__}.basic.grouped_linear").stacked
    splits = splits_mod.make_splits(split, p.experts, p.tokens, p.device)
    w1 = stacked(fast.weights1, fast.ops[0].single_grouped_weight)
    w2 = stacked(fast.weights2, fast.ops[2].single_grouped_weight)
    with torch.no_grad():
        h = fast.fprop1(x.detach(), w1, splits)
        a = fast.act_forward(h, probs.detach())
        dgrad2 = fast.dgrad2(dy, w2, splits)
    launch_mod = importlib.import_module(f"{pkg.__name__}.kernels.triton_launch")

    def step():
        for t in [x, probs, *block.parameters()]:
            t.grad = None
        block(x, split, probs, split).backward(dy)

    calls = {
        "step": step,
        "fwd_block": lambda: block(x, split, probs, split),
        "fwd_fuser": lambda: fuser(x, *extra),
        "fwd_fast_run": lambda: fast.run(x, extra),
        "make_splits": lambda: splits_mod.make_splits(split, p.experts, p.tokens, p.device),
        "k_fprop1": lambda: fast.fprop1(x.detach(), w1, splits),
        "k_act_forward": lambda: fast.act_forward(h, probs.detach()),
        "k_fprop2": lambda: fast.fprop2(a, w2, splits),
        "k_dgrad2": lambda: fast.dgrad2(dy, w2, splits),
        "k_act_backward": lambda: fast.act_backward(h, dgrad2, probs.detach()),
        "k_wgrad2": lambda: fast.wgrad2(a, dy, splits),
        "k_dgrad1": lambda: fast.dgrad1(h, w1, splits),
        "k_wgrad1": lambda: fast.wgrad1(x.detach(), h, splits),
        "torch_empty": lambda: torch.empty(p.tokens, 2 * p.ffn, device=p.device,
                                           dtype=p.dtype),
    }
    if p.device.type == "cuda":
        calls["stream"] = lambda: launch_mod._Runtime().stream(p.device.index or 0)
    return calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--packages", default="te_ops")
    parser.add_argument("--shape", default="E64_T256_H2048_FF768",
                        help="a grouped_mlp.py shape (E64_T256_H64_FF32: a CPU smoke run)")
    parser.add_argument("--modes", default="single,per_expert")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    check_min(parser, "--iters", args.iters, 1)
    check_min(parser, "--rounds", args.rounds, 1)
    shapes = {**SHAPES, **HOST_SHAPES}
    check_list(parser, "--shape", args.shape, shapes)
    check_list(parser, "--modes", args.modes, ("single", "per_expert"))
    device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
              else torch.device("cpu"))  # the CPU: a smoke run (grouped_mm, no Triton)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = JsonLines(args.out)
    out.write({"bench": "host_parts_run", **machine_info(device)})
    problem = make_problem(args.shape, shapes[args.shape], device, dtype, 0)
    with env_override(TE_OPS_FUSION="1"):
        for mode in args.modes.split(","):
            for name in args.packages.split(","):
                pkg = importlib.import_module(name)
                blk = TeOpsBlock(pkg, problem, mode == "single")
                calls = part_calls(pkg, blk)
                row = {"bench": "host_parts", "package": name, "mode": mode,
                       "shape": args.shape}
                for part, call in calls.items():
                    iters = max(10, args.iters // 4) if part.startswith(("step", "fwd")) \
                        else args.iters
                    row[part] = round(time_call(call, iters, args.rounds), 2)
                block = blk.block

                def zero(block=block) -> None:
                    for t in [problem.x, problem.probs, *block.parameters()]:
                        t.grad = None

                def fwd(block=block):
                    return block(problem.x, problem.split, problem.probs, problem.split)

                n = max(10, args.iters // 4)
                row["backward"] = round(time_backward(fwd, zero, problem.dy, n, args.rounds), 2)
                row["backward_body"] = round(time_backward_body(
                    pkg, fwd, zero, problem.dy, n, args.rounds), 2)
                row["engine_noop"] = round(time_engine_noop(device, n, args.rounds), 2)
                out.write(row)
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
