"""Every kernel of one CUDA-graph replay of the grouped MLP step, with the gaps between them.

Issue 10's decode goal times ``benchmarks/grouped_mlp.py``'s ``te_ops_fused_single_graph_noclone``
peer (E64 T256 H2048 FF768, bf16): the fused block's forward and backward captured with
``te_ops.graphs.make_graphed_callable``, each step the inputs copied into the static buffers,
the forward graph replayed, then the backward graph. This script builds that peer the same way,
runs ``--steps`` steps under torch.profiler (Kineto trace), each step closed by a
``torch.cuda.synchronize()`` so that steps do not overlap, and reports for the step with the
median span:

* every device event (kernel, memcpy, memset) in launch order: start offset from the step's
  first kernel, duration, the idle gap before it, its category (``gemm``: grouped GEMM kernels,
  Triton or CUTLASS; ``other``) and whether a ``cudaGraphLaunch`` launched it;
* ``span_us`` (first start to last end), ``busy_us`` (union of the events), ``gap_us`` (span -
  busy), the sum per category, and the same numbers as medians over all steps.

``--peers`` adds other ``grouped_mlp.py`` peers (e.g. the eager ``torch_grouped_mm``) for
reference; ``--summarize FILE`` prints the tables of a JSON-lines file written here.
The trace analysis (:func:`step_kernels`) is plain Python over the trace's events and is
tested on CPU (``tests/test_profile_graph_e64.py``).

Usage::

    python benchmarks/profile_graph_e64.py [--peers te_ops_fused_single_graph_noclone,...]
        [--steps 7] [--out FILE]
    python benchmarks/profile_graph_e64.py --summarize FILE
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
HOST_CATS = ("user_annotation", "cpu_op")
#: Substrings of the grouped GEMM kernels' names (te_ops' Triton decode GEMMs, torch's
#: CUTLASS grouped GEMMs, cuBLAS).
GEMM_MARKS = ("_rows_kernel", "_wgrad_kernel", "grouped_mm", "gemm", "cutlass", "sm90_xmma",
              "wgmma")
DEFAULT_PEERS = "te_ops_fused_single_graph_noclone"
STEP_PREFIX = "profile_graph_step_"


def category(name: str) -> str:
    """``gemm`` for grouped GEMM kernels (see :data:`GEMM_MARKS`), else ``other``."""
    low = name.lower()
    return "gemm" if any(m in low for m in GEMM_MARKS) else "other"


def _union(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def step_kernels(events: list[dict]) -> list[dict]:
    """Split a Kineto trace into steps and list each step's device events.

    Parameters
    ----------
    events : list of dict
        The trace's ``traceEvents``. Steps are the host's ``user_annotation`` / ``cpu_op``
        events named ``profile_graph_step_<i>`` (not their ``gpu_user_annotation`` copies);
        a device event belongs to the step whose host range holds its launch (matched
        through ``args["correlation"]``).

    Returns
    -------
    list of dict
        One per step, in order: ``kernels`` (name, start_us from the step's first device
        event, dur_us, gap_us before it, cat, graph: launched by ``cudaGraphLaunch``),
        ``span_us``, ``busy_us``, ``gap_us``, ``per_cat_us`` ({category: summed duration}),
        ``count``.

    Raises
    ------
    ValueError
        No step annotations, or a step without device events.
    """
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e]
    steps = sorted((e for e in xs if str(e.get("name", "")).startswith(STEP_PREFIX)
                    and e.get("cat") in HOST_CATS), key=lambda e: e["ts"])
    if not steps:
        raise ValueError(f"the trace has no {STEP_PREFIX}<i> annotations")
    launches = {e["args"]["correlation"]: e for e in xs
                if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    device = sorted((e for e in xs if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    out = []
    for step in steps:
        lo, hi = step["ts"], step["ts"] + step.get("dur", 0.0)
        mine = []
        for e in device:
            launch = launches.get(e.get("args", {}).get("correlation"))
            if launch is not None and lo <= launch["ts"] <= hi:
                mine.append((e, launch))
        if not mine:
            raise ValueError(f"step {step['name']} has no device events")
        out.append(_one_step(mine))
    return out


def _one_step(mine: list[tuple[dict, dict]]) -> dict:
    t0 = mine[0][0]["ts"]
    end = t0
    kernels, per_cat = [], {}
    for e, launch in mine:
        dur = float(e.get("dur", 0.0))
        gap = max(0.0, e["ts"] - end)
        cat = category(e["name"]) if e.get("cat") == "kernel" else e["cat"]
        kernels.append({"name": e["name"], "start_us": e["ts"] - t0, "dur_us": dur,
                        "gap_us": gap, "cat": cat,
                        "graph": launch.get("name") == "cudaGraphLaunch"})
        per_cat[cat] = per_cat.get(cat, 0.0) + dur
        end = max(end, e["ts"] + dur)
    span = end - t0
    busy = _union([(e["ts"], e["ts"] + float(e.get("dur", 0.0))) for e, _ in mine])
    return {"kernels": kernels, "span_us": span, "busy_us": busy, "gap_us": span - busy,
            "per_cat_us": per_cat, "count": len(kernels)}


def summary(steps: list[dict]) -> dict:
    """The median-span step (``step``) and medians over all steps of span, busy, gap and the
    per-category sums."""
    order = sorted(range(len(steps)), key=lambda i: steps[i]["span_us"])
    median_step = steps[order[len(order) // 2]]
    cats = sorted({c for s in steps for c in s["per_cat_us"]})
    med = {k: statistics.median(s[k] for s in steps) for k in ("span_us", "busy_us", "gap_us")}
    med["per_cat_us"] = {c: statistics.median(s["per_cat_us"].get(c, 0.0) for s in steps)
                         for c in cats}
    return {"step": median_step, "medians": med, "steps": len(steps)}


def profile_peer(peer_name: str, problem, args: argparse.Namespace) -> dict:
    """Trace ``args.steps`` synchronized steps of one peer; return the analysis."""
    from common import trace_events

    return summary(step_kernels(trace_events(peer_name, problem, warmup=args.warmup,
                                             steps=args.steps, step_prefix=STEP_PREFIX)))


def format_record(r: dict, width: int = 64) -> str:
    """A text table of one record (kernels of the median step, then the sums)."""
    head = f"## {r['shape']} {r['peer']}"
    if "error" in r:
        return f"{head}: {r['error']}"
    s, m = r["step"], r["medians"]
    lines = [head, f"  {'#':>3} {'kernel':<{width}} {'graph':>5} {'start':>8} {'dur':>7} "
                   f"{'gap':>6} cat"]
    for i, k in enumerate(s["kernels"]):
        name = k["name"] if len(k["name"]) <= width else k["name"][:width - 3] + "..."
        lines.append(f"  {i:3d} {name:<{width}} {'yes' if k['graph'] else 'no':>5} "
                     f"{k['start_us']:8.1f} {k['dur_us']:7.1f} {k['gap_us']:6.1f} {k['cat']}")
    cats = ", ".join(f"{c} {v:.1f}" for c, v in sorted(s["per_cat_us"].items()))
    lines.append(f"  median step: {s['count']} events, span {s['span_us']:.1f} us, busy "
                 f"{s['busy_us']:.1f}, gaps {s['gap_us']:.1f}; per category: {cats}")
    mcats = ", ".join(f"{c} {v:.1f}" for c, v in sorted(m["per_cat_us"].items()))
    lines.append(f"  medians of {r['steps']} steps: span {m['span_us']:.1f} us, busy "
                 f"{m['busy_us']:.1f}, gaps {m['gap_us']:.1f}; per category: {mcats}")
    return "\n".join(lines)


def summarize(path: str) -> str:
    """Text tables of a JSON-lines file written by this script."""
    from common import read_records

    return "\n".join(format_record(r) for r in read_records(path, "profile_graph_e64"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="E64_T256_H2048_FF768")
    parser.add_argument("--peers", default=DEFAULT_PEERS)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also append JSON lines to this file")
    parser.add_argument("--summarize", metavar="FILE", default=None)
    args = parser.parse_args(argv)
    from common import check_trace_args

    check_trace_args(parser, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    import torch
    from common import append_jsonl, machine_info, profile_each_peer

    if not torch.cuda.is_available():
        print("profile_graph_e64.py needs a GPU (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    append_jsonl(args.out, [{"bench": "profile_graph_e64_run",
                             **machine_info(torch.device("cuda"))}])
    for record in profile_each_peer(args, "profile_graph_e64", profile_peer):
        append_jsonl(args.out, [record])
        print(format_record(record), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
