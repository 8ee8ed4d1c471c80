"""Where the time of one fused expert-block step goes under a recipe (torch.profiler, CUDA).

Usage::

    python benchmarks/profile_recipe.py --shape E8_T16384_H4096_FF14336 --recipe fp8 [--out DIR]

Prints the top kernels by CUDA time for one forward + backward (after warm-up), the same block
and routing as ``benchmarks/grouped_mlp.py`` (te_ops' default block); the table also goes to
``<--out>/profile_recipe.txt`` (default ``runs/profile_recipe``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_out_argument, fwd_bwd_step, out_path  # noqa: E402
from grouped_mlp import KNOWN_SHAPES, RECIPES, TeOps, make_problem  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="E8_T16384_H4096_FF14336", choices=list(KNOWN_SHAPES))
    parser.add_argument("--recipe", default="fp8", choices=list(RECIPES))
    parser.add_argument("--rows", type=int, default=25, help="kernels to print")
    parser.add_argument("--calls", action="store_true",
                        help="also print every kernel launch in order (start, duration, idle "
                             "time before it) and the step's GPU idle time")
    add_out_argument(parser, "profile_recipe")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    problem = make_problem(args.shape, KNOWN_SHAPES[args.shape], torch.device("cuda"),
                           torch.bfloat16, 0)
    peer_cls = type("Profiled", (TeOps,), {"recipe": RECIPES[args.recipe]})
    # Gradients are cleared before every step, as in the timed benchmark (otherwise each
    # step after the first adds its weight gradients into .grad: 17 extra add kernels).
    step = fwd_bwd_step(peer_cls(problem), problem)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows,
                                      max_name_column_width=70)
    print(table)
    with open(out_path(args.out, "profile_recipe.txt"), "w", encoding="utf-8") as f:
        f.write(f"shape {args.shape} recipe {args.recipe}\n{table}\n")
    if args.calls:
        print_calls(prof)
    return 0


def print_calls(prof: torch.profiler.profile, min_us: float = 5.0) -> None:
    """Every CUDA kernel of the profiled step in start order: start (us from the first),
    duration, the GPU's idle time before it; kernels shorter than ``min_us`` with less idle
    time than that before them are counted, not printed. Then busy / idle totals."""
    kernels = sorted((e for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    if not kernels:
        return
    t0 = kernels[0].time_range.start
    end = t0
    idle = hidden = 0.0
    print(f"{'start_us':>10} {'dur_us':>9} {'idle_us':>9}  kernel")
    for e in kernels:
        gap = max(0.0, e.time_range.start - end)
        idle += gap
        dur = e.time_range.end - e.time_range.start
        if dur >= min_us or gap >= min_us:
            print(f"{e.time_range.start - t0:10.1f} {dur:9.1f} {gap:9.1f}  {e.name[:90]}")
        else:
            hidden += 1
        end = max(end, e.time_range.end)
    print(f"span {end - t0:.1f} us, GPU idle {idle:.1f} us, {len(kernels)} kernels "
          f"({int(hidden)} short ones not printed)")


if __name__ == "__main__":
    sys.exit(main())
