"""Where the time of one fused expert-block step goes under a recipe (torch.profiler, CUDA).

Usage::

    PYTHONPATH=. python benchmarks/profile_recipe.py --shape E8_T16384_H4096_FF14336 --recipe fp8

Prints the top kernels by CUDA time for one forward + backward (after warm-up), the same block
and routing as ``benchmarks/grouped_mlp.py``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fwd_bwd_step  # noqa: E402
from grouped_mlp import RECIPES, SHAPES, TeOps, make_problem  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="E8_T16384_H4096_FF14336", choices=list(SHAPES))
    parser.add_argument("--recipe", default="fp8", choices=list(RECIPES))
    parser.add_argument("--rows", type=int, default=25, help="kernels to print")
    args = parser.parse_args(argv)
    problem = make_problem(args.shape, SHAPES[args.shape], torch.device("cuda"), torch.bfloat16,
                           0)
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
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows,
                                    max_name_column_width=70))
    return 0


if __name__ == "__main__":
    sys.exit(main())
