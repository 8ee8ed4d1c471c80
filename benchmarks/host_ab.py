"""Host-overhead A/B in one process: a baseline copy of te_ops against this tree's te_ops,
interleaved step by step with the torch peer (``torch._grouped_mm``), eager fwd+bwd.

Two runs of ``grouped_mlp.py`` (one per tree) compare steps minutes apart on a shared host whose
speed drifts; here every round runs each variant once in turn, so drift hits all alike. The
baseline is a copy of another te_ops tree whose ``torch.library`` namespace is renamed (two
packages cannot both register ``te_ops::...``): ``--make-baseline SRC DEST`` writes it as the
package ``te_ops_base`` under ``DEST``, which then goes on ``PYTHONPATH``.

Per variant and shape (JSON lines): ``ms`` the median step time with the device synchronized
before and after (what ``grouped_mlp.py`` reports), ``host_ms`` the median time until
``backward()`` returns (before the final sync: the host's share, when the device keeps up),
``cpu_ms`` this thread's CPU time until then, ``x_peer`` = ``ms`` / the peer's ``ms``
(``cpu_x_peer`` likewise; ``--stub-gemm`` on the CPU makes the step host work only).
``bitwise`` says whether the output and every gradient (input, probs, parameters) of the new
tree equal the baseline's exactly (first calls). ``--variant-env NAME=VALUE`` adds this tree with any te_ops variable set
(``new_<mode>_<NAME>=<VALUE>``, e.g. ``TE_OPS_FUSION=0``).
``--floor`` adds, per mode, ``floor_<mode>``: a bare ``torch.autograd.Function`` with the
block's weight Parameters as inputs (per-expert: 2 x E, laid out as GroupedLinear lays them
out; single: 2) and the fused step's gradient hand-off (one empty (E, out, in) buffer per
layer, ``unbind`` per expert, taken by ``AccumulateGrad`` without a copy), no math: what
autograd itself costs per step for that many parameters (the floor of the per-expert host
cost while every weight gets its gradient through autograd).
``--profile`` adds, per te_ops variant, the top host events of ``torch.profiler`` (CPU only,
self time per step) and the top Python functions of ``cProfile`` (own time per step).

Usage::

    python benchmarks/host_ab.py --make-baseline /path/to/other/tree/te_ops /tmp/base
    PYTHONPATH=.:/tmp/base python benchmarks/host_ab.py --shapes E64_T256_H2048_FF768 \\
        --iters 50 --warmup 10 [--profile] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import os
import pathlib
import pstats
import re
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    JsonLines,
    check_device,
    check_list,
    check_min,
    env_override,
    machine_info,
)
from grouped_mlp import (  # noqa: E402
    CPU_SHAPES,
    HOST_SHAPES,
    MID_SHAPES,
    SHAPES,
    TorchGroupedMM,
    make_problem,
)

DTYPES = ("float32", "bfloat16", "float16")


def make_baseline(src: str, dest: str) -> None:
    """Copy the package at ``src`` to ``dest/te_ops_base`` with its op namespace renamed."""
    target = pathlib.Path(dest) / "te_ops_base"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__"))
    for path in target.rglob("*.py"):
        text = path.read_text()
        new = re.sub(r"\bte_ops::", "te_ops_base::", text)
        new = new.replace("torch.ops.te_ops.", "torch.ops.te_ops_base.")
        if new != text:
            path.write_text(new)


class TeOpsBlock:
    """The fused te_ops grouped MLP of a given package, with the problem's weights; ``env``:
    environment variables set around each of its steps (e.g. ``TE_OPS_FUSION=0``)."""

    def __init__(self, pkg, problem, single: bool, env: dict[str, str] | None = None) -> None:
        p = problem
        self.env = env or {}
        kw = {"bias": False, "single_grouped_weight": single, "device": p.device,
              "dtype": p.dtype}
        self.problem = problem
        self.block = pkg.Sequential(pkg.GroupedLinear(p.experts, p.hidden, 2 * p.ffn, **kw),
                                    pkg.ScaledSwiGLU(),
                                    pkg.GroupedLinear(p.experts, p.ffn, p.hidden, **kw))
        w1, w2 = problem.weights()
        with torch.no_grad():
            for fc, w in ((self.block[0], w1), (self.block[2], w2)):
                for e, param in enumerate(fc.weights()):
                    param.copy_(w if single else w[e])

    def parameters(self) -> list[torch.Tensor]:
        return list(self.block.parameters())

    def forward(self, x, probs):
        split = self.problem.split
        if self.env:
            with env_override(**self.env):
                return self.block(x, split, probs, split)
        return self.block(x, split, probs, split)


class _FloorFunction(torch.autograd.Function):
    """``x * 1`` with the weights as inputs; backward: ``dy`` for x and, per layer, one
    empty (G, out, in) gradient split per parameter (as ``per_param``)."""

    @staticmethod
    def forward(ctx, x, floor, *params):
        ctx.floor = floor
        return x * 1

    @staticmethod
    def backward(ctx, dy):
        grads = []
        for shape, single in ctx.floor.layers:
            g = dy.new_empty(shape)
            grads.extend([g] if single else g.unbind(0))
        return (dy, None, *grads)


class AutogradFloor:
    """The autograd work of one fused step with the block's parameters and nothing else
    (see the module docstring, ``--floor``)."""

    def __init__(self, problem, single: bool) -> None:
        p = problem
        e = p.experts
        self.layers = [((e, 2 * p.ffn, p.hidden), single), ((e, p.hidden, p.ffn), single)]
        self.params = []
        for shape, _ in self.layers:
            buf = torch.zeros(shape, device=p.device, dtype=p.dtype)
            self.params += ([torch.nn.Parameter(buf)] if single else
                            [torch.nn.Parameter(buf[g]) for g in range(e)])

    def parameters(self) -> list[torch.Tensor]:
        return list(self.params)

    def forward(self, x, probs):
        return _FloorFunction.apply(x, self, *self.params)


def _zero(peer, problem) -> None:
    problem.x.grad = problem.probs.grad = None
    for p in peer.parameters():
        p.grad = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(variants: dict, problem, iters: int, warmup: int) -> dict:
    """Median step ms (synced), host ms (until backward returns) and CPU ms of this thread
    (until backward returns; the whole step's host work on the CPU with one intra-op thread,
    the forward's on CUDA, whose backward runs on autograd's device thread) per variant."""
    x, probs, dy = problem.x, problem.probs, problem.dy
    times = {k: ([], [], []) for k in variants}
    for i in range(warmup + iters):
        for name, peer in variants.items():
            _zero(peer, problem)
            _sync(problem.device)
            t0, c0 = time.perf_counter(), time.thread_time()
            peer.forward(x, probs).backward(dy)
            t1, c1 = time.perf_counter(), time.thread_time()
            _sync(problem.device)
            t2 = time.perf_counter()
            if i >= warmup:
                for ts, v in zip(times[name], (t2 - t0, t1 - t0, c1 - c0)):
                    ts.append(v * 1e3)
    return {k: tuple(map(statistics.median, v)) for k, v in times.items()}


def bitwise_equal(a, b, problem) -> bool:
    """Whether two te_ops variants give the same output and gradients, bit for bit."""
    results = []
    for peer in (a, b):
        _zero(peer, problem)
        out = peer.forward(problem.x, problem.probs)
        out.backward(problem.dy)
        results.append([out.detach().clone(), problem.x.grad.clone(), problem.probs.grad.clone(),
                        *[p.grad.clone() for p in peer.parameters()]])
    _zero(a, problem)
    return all(torch.equal(u, v) for u, v in zip(*results)) and len(results[0]) == len(
        results[1])


def profile_host(peer, problem, steps: int, top: int) -> dict:
    """Top host events (torch.profiler, CPU) and Python functions (cProfile), per step."""
    from torch.profiler import ProfilerActivity, profile

    def step() -> None:
        _zero(peer, problem)
        peer.forward(problem.x, problem.probs).backward(problem.dy)

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    _sync(problem.device)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    torch_top = [{"name": e.key[:80], "self_ms": e.self_cpu_time_total / 1e3 / steps,
                  "total_ms": e.cpu_time_total / 1e3 / steps, "calls": e.count / steps}
                 for e in events]
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        step()
    pr.disable()
    _sync(problem.device)
    stats = pstats.Stats(pr).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    py_top = [{"func": f"{os.path.basename(f)}:{line}({fn})", "own_ms": s[2] * 1e3 / steps,
               "cum_ms": s[3] * 1e3 / steps, "calls": s[1] / steps}
              for (f, line, fn), s in rows]
    return {"torch_profiler_top": torch_top, "cprofile_top": py_top,
            "python_calls": sum(s[1] for s in stats.values()) / steps}


def variant_env(item: str) -> tuple[str, str]:
    """``(NAME, value)`` of a ``--variant-env NAME=VALUE``, the value as te_ops reads it
    (case-insensitive, surrounding spaces ignored, empty: the default; README "Environment
    variables"). Raises ``ValueError`` naming the variable, the accepted values and the
    given one."""
    import te_ops

    name, sep, given = item.partition("=")
    name = name.strip()
    if not sep or name not in te_ops.env.ENV_VARS:
        raise ValueError(f"expected NAME=VALUE with NAME a te_ops variable, got {item!r}")
    var = te_ops.env.ENV_VARS[name]
    value = given.strip().lower() or var.default
    if value not in var.choices:
        raise ValueError(f"{name} must be one of {list(var.choices)}, got {given!r}")
    return name, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--make-baseline", nargs=2, metavar=("SRC", "DEST"))
    parser.add_argument("--baseline", default="te_ops_base", help="baseline package name")
    parser.add_argument("--shapes", default="E64_T256_H2048_FF768")
    parser.add_argument("--modes", default="single,per_expert")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1, help="repeat the timing")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--stub-gemm", action="store_true",
                        help="CPU: aten::_grouped_mm's kernel zero-fills (host_ops.py), one "
                             "intra-op thread: the step is host work only")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads (CPU; 1: cpu_ms is the whole step's work)")
    parser.add_argument("--variant-env", action="append", default=[], metavar="NAME=VALUE",
                        help="also time this tree with the te_ops variable NAME set to VALUE "
                             "around each of its steps (variant new_<mode>_<NAME>=<VALUE>); "
                             "repeatable")
    parser.add_argument("--floor", action="store_true",
                        help="also time a bare autograd.Function with the block's parameters "
                             "(variants floor_<mode>: autograd's own per-step cost)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.make_baseline:
        src = args.make_baseline[0]
        if not os.path.isfile(os.path.join(src, "__init__.py")):
            parser.error(f"--make-baseline SRC: expected a package directory (with "
                         f"__init__.py), got {src!r}")
        make_baseline(*args.make_baseline)
        return 0
    check_device(parser, "--device", args.device)
    shapes = {**SHAPES, **CPU_SHAPES, **HOST_SHAPES, **MID_SHAPES}
    check_list(parser, "--shapes", args.shapes, shapes)
    check_list(parser, "--modes", args.modes, ("single", "per_expert"))
    if args.dtype is not None and args.dtype not in DTYPES:
        parser.error(f"--dtype: expected one of {list(DTYPES)}, got {args.dtype!r}")
    for flag, minimum in (("--iters", 1), ("--warmup", 0), ("--rounds", 1),
                          ("--profile-steps", 1)):
        check_min(parser, flag, getattr(args, flag[2:].replace("-", "_")), minimum)
    if args.threads is not None:
        check_min(parser, "--threads", args.threads, 1)
        torch.set_num_threads(args.threads)
    import te_ops

    variant_envs = []
    for item in args.variant_env:
        try:
            variant_envs.append(variant_env(item))
        except ValueError as exc:
            parser.error(f"--variant-env: {exc}")
    try:
        base = importlib.import_module(args.baseline)
    except ModuleNotFoundError as e:
        parser.error(f"--baseline {args.baseline!r} cannot be imported ({e}): write it with "
                     "--make-baseline SRC DEST and put DEST on PYTHONPATH (see the module "
                     "docstring)")
    if args.stub_gemm:
        from host_ops import stub_gemm

        stub_gemm()
        torch.set_num_threads(1)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    out = JsonLines(args.out)
    out.write({"bench": "host_ab_run", **machine_info(device), "baseline": base.__file__,
               "new": te_ops.__file__})
    try:
        with env_override(TE_OPS_FUSION="1"):
            for shape in args.shapes.split(","):
                problem = make_problem(shape, shapes[shape], device, dtype, 0)
                variants = {"torch_grouped_mm": TorchGroupedMM(problem)}
                for mode in args.modes.split(","):
                    single = mode == "single"
                    variants[f"base_{mode}"] = TeOpsBlock(base, problem, single)
                    variants[f"new_{mode}"] = TeOpsBlock(te_ops, problem, single)
                    for name, value in variant_envs:
                        variants[f"new_{mode}_{name}={value}"] = TeOpsBlock(
                            te_ops, problem, single, {name: value})
                    if args.floor:
                        variants[f"floor_{mode}"] = AutogradFloor(problem, single)
                for mode in args.modes.split(","):
                    out.write({"bench": "host_ab_bitwise", "shape": shape, "mode": mode,
                               "bitwise": bitwise_equal(variants[f"base_{mode}"],
                                                        variants[f"new_{mode}"], problem)})
                for r in range(args.rounds):
                    res = time_interleaved(variants, problem, args.iters, args.warmup)
                    peer_ms, _, peer_cpu = res["torch_grouped_mm"]
                    for name, (ms, host_ms, cpu_ms) in res.items():
                        out.write({"bench": "host_ab", "shape": shape, "round": r,
                                   "variant": name, "dtype": str(dtype), "ms": ms,
                                   "host_ms": host_ms, "cpu_ms": cpu_ms, "x_peer": ms / peer_ms,
                                   "cpu_x_peer": cpu_ms / peer_cpu})
                if args.profile:
                    for name, peer in variants.items():
                        out.write({"bench": "host_ab_profile", "shape": shape,
                                   "variant": name,
                                   **profile_host(peer, problem, args.profile_steps, 15)})
                del variants
    finally:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
