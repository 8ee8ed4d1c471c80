"""Where one forward+backward step of the grouped MLP spends its time (torch.profiler).

For each shape and peer (``te_ops`` and the eager ``torch._grouped_mm`` peer by default,
any peer of ``benchmarks/grouped_mlp.py`` allowed), after ``--warmup`` untimed steps, profiles
``--steps`` steps and reports per step:

* ``step_ms``: wall time per step (CUDA events around the profiled steps, or the host clock);
* ``busy_ms``: the sum of the device time of every kernel (CPU: self time of every aten op);
* the top kernels and the top ``aten::`` ops by self device time (CPU: self CPU time), each with
  ms per step, calls per step and share of ``busy_ms``;
* ``top_host``: the top ops by self host (CPU) time, share of the profiled wall time per step
  (where the host time of a launch-bound shape goes);
* with ``--cprofile``: the Python functions with the most own time (cProfile, unprofiled by
  torch.profiler), ms per step.

Per-kernel times of two peers profiled one after the other are not comparable on a GPU at its
power limit (the H200 on the large shapes): the clock depends on what ran before and on the
idle gap between peers; compare whole steps with ``benchmarks/grouped_mlp.py`` (rounds).

The problem is the one ``benchmarks/grouped_mlp.py`` builds (bf16, Zipf(1.2) routing, split
sizes on the device that cover every row, so nothing is padding).

Usage::

    python benchmarks/profile_grouped_mlp.py [--shapes ...] [--peers ...] [--out DIR]
    python benchmarks/profile_grouped_mlp.py --device cpu --shapes tiny
    python benchmarks/profile_grouped_mlp.py --summarize runs/profile_grouped_mlp/profile.jsonl
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    JsonLines,
    add_out_argument,
    check_list,
    env_override,
    free_memory,
    fwd_bwd_step,
    machine_info,
    out_path,
    read_records,
)
from grouped_mlp import (  # noqa: E402
    KNOWN_SHAPES,
    PEER_CLASSES,
    SHAPE_SETS,
    make_problem,
    resolve_shapes,
)

DEFAULT_PEERS = ["torch_grouped_mm", "te_ops"]


def _device_us(evt) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(evt, name, None)
        if value is not None:
            return float(value)
    return 0.0


def _rows(events, time_of, steps: int, busy_us: float, top: int, width: int) -> list[dict]:
    ranked = sorted(events, key=time_of, reverse=True)[:top]
    return [{"name": e.key[:width], "ms": time_of(e) / steps / 1e3,
             "calls": e.count / steps, "share": time_of(e) / busy_us if busy_us else 0.0}
            for e in ranked if time_of(e) > 0]


def profile_peer(peer_name: str, problem, args: argparse.Namespace) -> dict:
    """Profile ``args.steps`` fwd+bwd steps of one peer; return one JSON record."""
    peer = PEER_CLASSES[peer_name](problem)
    cuda = problem.device.type == "cuda"
    x, probs = problem.x, problem.probs
    step = fwd_bwd_step(peer, problem)

    try:
        with env_override(**peer.env):
            for _ in range(args.warmup):
                step()
            if cuda:
                torch.cuda.synchronize()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) as prof:
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step()
                if cuda:
                    torch.cuda.synchronize()
                wall_ms = (time.perf_counter() - t0) * 1e3 / args.steps
            if cuda:  # unprofiled wall time too (the profiler adds host overhead)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                for _ in range(args.steps):
                    step()
                end.record()
                torch.cuda.synchronize()
                step_ms = start.elapsed_time(end) / args.steps
            else:
                step_ms = wall_ms
    finally:
        x.grad = None
        probs.grad = None
    avgs = prof.key_averages()
    if cuda:
        kernels = [e for e in avgs if e.device_type == DeviceType.CUDA]
        time_of = _device_us
    else:
        kernels = []

        def time_of(e) -> float:
            return float(e.self_cpu_time_total)
    ops = [e for e in avgs if e.key.startswith("aten::") and e.device_type == DeviceType.CPU]
    busy_us = sum(_device_us(e) for e in kernels) if cuda else sum(time_of(e) for e in ops)
    host = [e for e in avgs if e.device_type == DeviceType.CPU]
    record = {
        "step_ms": step_ms,
        "profiled_step_ms": wall_ms,
        "busy_ms": busy_us / args.steps / 1e3,
        "top_kernels": _rows(kernels, _device_us, args.steps, busy_us, args.top, 110),
        "top_ops": _rows(ops, time_of, args.steps, busy_us, args.top, 60),
        "top_host": _rows(host, lambda e: float(e.self_cpu_time_total), args.steps,
                          wall_ms * 1e3 * args.steps, args.top, 60),
    }
    if args.cprofile:
        record["top_python"] = _cprofile(step, args, cuda)
    return record


def _cprofile(step, args: argparse.Namespace, cuda: bool) -> list[dict]:
    """Python functions by own time over ``args.steps`` steps (cProfile)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, func), (_, ncalls, tottime, _, _) in stats.stats.items():
        rows.append({"name": f"{os.path.basename(file)}:{line}({func})"[:70],
                     "ms": tottime * 1e3 / args.steps, "calls": ncalls / args.steps})
    rows.sort(key=lambda r: r["ms"], reverse=True)
    return rows[: args.top]


def summarize(path: str, top: int = 8) -> str:
    """Text tables of a JSON-lines file written by this script."""
    out: list[str] = []
    for r in read_records(path, "profile_grouped_mlp"):
        head = f"## {r['shape']} {r['peer']}"
        if "error" in r:
            out.append(f"{head}: {r['error']}")
            continue
        out.append(f"{head}: step {r['step_ms']:.3f} ms, busy {r['busy_ms']:.3f} ms")
        for key, label in (("top_kernels", "kernel"), ("top_ops", "aten op (self)"),
                           ("top_host", "host: op (self CPU time)"),
                           ("top_python", "host: Python function (own time)")):
            if not r.get(key):
                continue
            out.append(f"  {label:<70} {'ms/step':>8} {'calls':>6} {'share':>6}")
            for row in r[key][:top]:
                share = f"{100 * row['share']:5.1f}%" if "share" in row else f"{'-':>6}"
                out.append(f"  {row['name'][:70]:<70} {row['ms']:8.3f} {row['calls']:6.1f} "
                           f"{share}")
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=None,
                        help="comma-separated shape or set names (benchmarks/grouped_mlp.py's): "
                             + ", ".join([*SHAPE_SETS, *KNOWN_SHAPES]))
    parser.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                        help="comma-separated peers of benchmarks/grouped_mlp.py")
    parser.add_argument("--device", default=None, choices=["cuda", "cpu"],
                        help="cuda (default when present) or cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps")
    parser.add_argument("--top", type=int, default=12, help="rows per table")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cprofile", action="store_true",
                        help="also list the Python functions with the most own time")
    add_out_argument(parser, "profile_grouped_mlp")
    parser.add_argument("--summarize", metavar="FILE", default=None)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps}, {args.warmup}")
    if args.summarize is not None and not os.path.isfile(args.summarize):
        parser.error(f"--summarize: expected an existing file, got {args.summarize!r}")
    args.peers = check_list(parser, "--peers", args.peers, PEER_CLASSES)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.shapes = resolve_shapes(parser, args.shapes, torch.device(args.device))
    return args


def main(argv: list[str] | None = None) -> int:
    """Profile every (shape, peer); writes ``<--out>/profile.jsonl`` and prints the tables."""
    args = parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize, args.top))
        return 0
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    path = out_path(args.out, "profile.jsonl")
    out = JsonLines(path)
    out.write({"bench": "profile_grouped_mlp_run", **machine_info(device), "device": device.type})
    failed = False
    try:
        for name, shape in args.shapes.items():
            problem = make_problem(name, shape, device, dtype, args.seed)
            for peer in args.peers:
                record = {"bench": "profile_grouped_mlp", "shape": name, "peer": peer,
                          "dtype": args.dtype, "device": device.type, "steps": args.steps}
                try:
                    record.update(profile_peer(peer, problem, args))
                except Exception as exc:  # one peer failing must not stop the others
                    record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                    failed = True
                out.write(record)
                free_memory()  # the peer (and its parameters) is gone once profile_peer returns
            del problem
            free_memory()
    finally:
        out.close()
    print(summarize(path, args.top))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
