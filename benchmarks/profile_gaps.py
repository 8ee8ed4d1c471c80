"""Where the GPU sits idle during a forward+backward step, and why (torch.profiler trace).

``profile_grouped_mlp.py`` reports how long the kernels run (``busy_ms``); on the H200 some
te_ops steps took 1-2 ms longer than their kernels (E32, E128: 2026-11-30 stop 9 profile),
while the peer's did not. This script finds those idle stretches. For each shape and peer it
runs ``--steps`` steps back to back, the way ``grouped_mlp.py`` times them (grads cleared
before each step, no synchronization between steps), records a Kineto trace, and reports per
step:

* ``span_ms`` (first kernel start to last kernel end, divided by steps), ``busy_ms`` (union of
  kernel, memcpy and memset intervals) and ``idle_ms`` = span - busy;
* ``gaps``: idle stretches longer than ``--min-gap-us`` grouped by the kernel that ends them
  and the host ops that launched it (outermost first), with ``late_ms``: how much of the gap
  the host caused, i.e. how long after the previous kernel ended the launch call began (a gap
  with ``late_ms`` near its length is host-bound; one with ``late_ms`` 0 waited on something
  else, e.g. a stream wait);
* ``runtime``: CUDA runtime / driver calls by name, calls and host ms per step (a
  ``cudaStreamSynchronize``, ``cudaMemcpy`` or ``cudaEventSynchronize`` here is a host sync);
* ``gpu_clocks``: ``nvidia-smi``'s SM clock (MHz), power (W) and temperature (C) right after
  the profiled steps, where available (power or thermal throttling shows up as a lower clock).

Usage::

    python benchmarks/profile_gaps.py [--shapes E32_T32768_H7168_FF2048,...] [--peers ...]
    python benchmarks/profile_gaps.py --summarize FILE

Needs a GPU (the trace's device events); ``analyze_trace`` itself is plain Python over the
trace's JSON events and is tested on CPU (``tests/test_profile_gaps.py``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections import defaultdict

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
HOST_CATS = ("cpu_op", "user_annotation")
# The sibling scripts (common.py, grouped_mlp.py) import torch: imported where used, so that
# analyze_trace needs no torch.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def _merged_busy(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start >= end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy


def _context(host_ops: list[dict], launch: dict, depth: int) -> str:
    """Names of the host ops on the launch's thread that enclose its start, outermost first
    (``depth`` of the innermost kept). The autograd engine runs backward on its own thread."""
    ts, tid = launch["ts"], launch.get("tid")
    enclosing = [e for e in host_ops if e["ts"] <= ts <= e["ts"] + e.get("dur", 0.0)
                 and (tid is None or e.get("tid") in (None, tid))]
    enclosing.sort(key=lambda e: (-e.get("dur", 0.0), e["ts"]))
    names = [_short(e["name"], 40) for e in enclosing]
    if len(names) > depth + 1:
        names = names[:1] + ["..."] + names[-depth:]
    return " > ".join(names) if names else "(no host op)"


def analyze_trace(events: list[dict], steps: int, min_gap_us: float = 5.0, top: int = 15,
                  depth: int = 3) -> dict:
    """Idle stretches of the device timeline in a Kineto trace.

    Parameters
    ----------
    events : list of dict
        The trace's ``traceEvents`` (``ph == "X"`` events with ``cat``, ``name``, ``ts`` and
        ``dur`` in microseconds; device and launch events carry ``args["correlation"]``).
    steps : int
        Steps the trace covers (per-step numbers are totals / steps).
    min_gap_us : float
        Gaps shorter than this are counted in ``idle_ms`` but not listed.
    top, depth : int
        Rows per table; host ops kept per context (innermost).

    Returns
    -------
    dict
        ``span_ms``, ``busy_ms``, ``idle_ms``, ``listed_gap_ms``, ``gaps`` and ``runtime``
        (see the module docstring), all per step.

    Raises
    ------
    ValueError
        If ``steps`` < 1 or the trace has no device events.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e]
    device = sorted((e for e in xs if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    if not device:
        raise ValueError("the trace has no kernel, memcpy or memset events (profiled on a GPU?)")
    launches = {}
    runtime: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in xs:
        if e.get("cat") in LAUNCH_CATS:
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launches[corr] = e
            runtime[e["name"]][0] += 1
            runtime[e["name"]][1] += e.get("dur", 0.0)
    host_ops = [e for e in xs if e.get("cat") in HOST_CATS]
    intervals = [(e["ts"], e["ts"] + e.get("dur", 0.0)) for e in device]
    span = max(stop for _, stop in intervals) - device[0]["ts"]
    busy = _merged_busy(intervals)
    groups: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    end = intervals[0][1]
    for e, (start, stop) in zip(device[1:], intervals[1:]):
        gap = start - end
        if gap > min_gap_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            late = min(gap, max(0.0, launch["ts"] - end)) if launch else 0.0
            where = _context(host_ops, launch, depth) if launch else "(launch not found)"
            row = groups[(_short(e["name"]), where)]
            row[0] += 1
            row[1] += gap
            row[2] += late
        end = max(end, stop)
    gaps = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
    per = 1e3 * steps
    return {
        "span_ms": span / per,
        "busy_ms": busy / per,
        "idle_ms": (span - busy) / per,
        "listed_gap_ms": sum(v[1] for v in groups.values()) / per,
        "gaps": [{"next_kernel": k, "launched_in": w, "count": v[0] / steps, "ms": v[1] / per,
                  "late_ms": v[2] / per} for (k, w), v in gaps],
        "runtime": [{"name": n, "calls": v[0] / steps, "ms": v[1] / per}
                    for n, v in sorted(runtime.items(), key=lambda kv: -kv[1][1])[:top]],
    }


def gpu_clocks() -> dict | None:
    """SM clock (MHz), power (W) and temperature (C) of the visible GPUs from nvidia-smi."""
    query = "clocks.sm,power.draw,temperature.gpu"
    try:
        cmd = ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"smi": [line.strip() for line in out.splitlines() if line.strip()]}


def profile_peer(peer_name: str, problem, args: argparse.Namespace) -> dict:
    """Trace ``args.steps`` back-to-back steps of one peer and analyze the idle time."""
    from common import trace_events

    events = trace_events(peer_name, problem, warmup=args.warmup, steps=args.steps)
    record = analyze_trace(events, args.steps, args.min_gap_us, args.top, args.depth)
    record["gpu_clocks"] = gpu_clocks()
    return record


def summarize(path: str, top: int = 10) -> str:
    """Text tables of a JSON-lines file written by this script."""
    from common import read_records

    out: list[str] = []
    for r in read_records(path, "profile_gaps"):
        head = f"## {r['shape']} {r['peer']}"
        if "error" in r:
            out.append(f"{head}: {r['error']}")
            continue
        out.append(f"{head}: span {r['span_ms']:.3f} ms, busy {r['busy_ms']:.3f} ms, idle "
                   f"{r['idle_ms']:.3f} ms (listed gaps {r['listed_gap_ms']:.3f}); "
                   f"clocks {r.get('gpu_clocks')}")
        out.append(f"  {'gap ends at kernel':<45} {'launched in (host ops)':<70} {'n':>5} "
                   f"{'ms':>7} {'late':>7}")
        for g in r["gaps"][:top]:
            out.append(f"  {g['next_kernel'][:45]:<45} {g['launched_in'][:70]:<70} "
                       f"{g['count']:5.1f} {g['ms']:7.3f} {g['late_ms']:7.3f}")
        out.append(f"  {'runtime call':<45} {'calls':>6} {'host ms':>8}")
        for c in r["runtime"][:top]:
            out.append(f"  {c['name'][:45]:<45} {c['calls']:6.1f} {c['ms']:8.3f}")
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="E8_T16384_H4096_FF14336,E128_T65536_H2048_FF768,"
                        "E32_T32768_H7168_FF2048", help="comma-separated grouped_mlp shapes")
    parser.add_argument("--peers", default="torch_grouped_mm,te_ops_fused,te_ops_fused_single")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--min-gap-us", type=float, default=5.0)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also append JSON lines to this file")
    parser.add_argument("--summarize", metavar="FILE", default=None)
    args = parser.parse_args(argv)
    from common import check_min, check_trace_args

    check_trace_args(parser, args)
    check_min(parser, "--min-gap-us", args.min_gap_us, 0)
    check_min(parser, "--top", args.top, 1)
    check_min(parser, "--depth", args.depth, 1)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize, args.top))
        return 0
    import torch
    from common import JsonLines, machine_info, profile_each_peer

    if not torch.cuda.is_available():
        print("profile_gaps.py needs a GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    out = JsonLines(args.out)
    out.write({"bench": "profile_gaps_run", **machine_info(torch.device("cuda"))})
    for record in profile_each_peer(args, "profile_gaps", profile_peer):
        out.write(record)
    if args.out:
        print(summarize(args.out, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
