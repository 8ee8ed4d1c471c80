"""What is live at the memory peak of one grouped-MLP forward+backward step (CUDA).

Records the caching allocator's history (``torch.cuda.memory._record_memory_history``) over one
step of each peer of ``benchmarks/grouped_mlp.py`` and prints, at the step's peak, the live
blocks allocated during the step by size, each with the innermost Python frame of this
repository that allocated it (memory live before the step, e.g. inputs and parameters, is one
line). ``--small`` lists every block under 1 MiB live at the peak, in bytes, where two peers'
peaks differ by KiB (split tables, kernel scratch, the peer's CUTLASS argument buffers).

Usage::

    python benchmarks/peak_memory_breakdown.py --shapes E32_T32768_H7168_FF2048 \
        --peers torch_grouped_mm,te_ops [--out DIR]

The text goes to stdout and to ``<--out>/peak_memory.txt`` (default ``runs/peak_memory``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    add_out_argument,
    check_list,
    env_override,
    free_memory,
    fwd_bwd_step,
    out_path,
)
from grouped_mlp import KNOWN_SHAPES, PEER_CLASSES, SHAPES, make_problem  # noqa: E402

_MIB = 2**20


def _where(frames: list[dict]) -> str:
    for f in frames:
        name = f.get("filename", "")
        if ("te_ops" in name or "benchmarks" in name) and "peak_memory" not in name:
            return f"{os.path.basename(name)}:{f.get('line')}({f.get('name')})"
    for f in frames:  # a C++ allocation (the torch peer's): the first aten / native frame
        name = f.get("name", "")
        if ("at::" in name or "native" in name) and "Allocator" not in name:
            return name[:90]
    return frames[0].get("name", "?") if frames else "?"


def breakdown(peer_name: str, problem, top: int, small_kib: bool = False) -> list[str]:
    peer = PEER_CLASSES[peer_name](problem)
    params = peer.parameters()
    x, probs = problem.x, problem.probs
    step = fwd_bwd_step(peer, problem)

    with env_override(**peer.env):
        step()  # warm up (kernels compiled, probes run)
        x.grad = None
        probs.grad = None
        for p in params:
            p.grad = None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=200000)
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    live: dict[int, tuple[int, str]] = {}
    cur = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for ev in snap["device_traces"][0]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], _where(ev.get("frames", [])))
            cur += ev["size"]
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])[0]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    lines = [f"## {problem.name} {peer_name}: before the step {before / _MIB:.0f} MiB "
             f"(parameters {param_bytes / _MIB:.0f}), peak {(before + peak) / _MIB:.0f} MiB "
             f"(step's own {peak / _MIB:.0f})"]
    by_site: dict[str, list[int]] = {}
    for size, site in at_peak.values():
        by_site.setdefault(site, []).append(size)
    for site, sizes in sorted(by_site.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"  {sum(sizes) / _MIB:9.1f} MiB  {len(sizes):3d} blocks  {site}")
    if small_kib:  # every block under 1 MiB live at the peak, in bytes: the KiB differences
        small = sorted((size, site) for size, site in at_peak.values() if size < _MIB)
        lines.append(f"  before the step {before} bytes, step's own peak {peak} bytes; "
                     f"blocks under 1 MiB: {len(small)}, {sum(s for s, _ in small)} bytes")
        for size, site in small:
            lines.append(f"    {size:8d} B  {site}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--peers", default="torch_grouped_mm,te_ops")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--small", action="store_true",
                        help="also list every block under 1 MiB live at the peak, in bytes")
    add_out_argument(parser, "peak_memory")
    args = parser.parse_args(argv)
    shapes = check_list(parser, "--shapes", args.shapes, KNOWN_SHAPES)
    peers = check_list(parser, "--peers", args.peers, PEER_CLASSES)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    path = out_path(args.out, "peak_memory.txt")
    for name in shapes:
        problem = make_problem(name, KNOWN_SHAPES[name], torch.device("cuda"), torch.bfloat16, 0)
        for peer in peers:
            text = "\n".join(breakdown(peer, problem, args.top, args.small))
            print(text, flush=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(text + "\n")
            free_memory()
        del problem
        free_memory()
    return 0


if __name__ == "__main__":
    sys.exit(main())
