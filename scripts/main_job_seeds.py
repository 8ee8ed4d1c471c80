"""The main job under several recipes and seeds: final validation loss per run and vs bf16.

The target: FP8's final validation loss within 2 % of bf16's on the same seed. That needs a
job whose final loss repeats under rounding changes: at the job's default length (600 steps) a
one-ulp change of one initial weight moves bf16's final loss by up to 4 %; at 2000 steps
(``--preset recipe-compare``, this script's default) by at most 0.64 %
(scripts/main_job_noise.py, docs/recipes.md). This
prints each (recipe, seed) final validation loss, each recipe's loss relative to bf16 on the
same seed, and the mean over seeds, as a table and JSON lines. The runs are separate processes,
``--parallel`` at once (on a GPU the small job is host-bound, so several share it well); each
run's output goes to ``--out/seeds_RECIPE_SEED/train.log``.

    python scripts/main_job_seeds.py --device cuda --recipes none,fp8 --seeds 0,1,2 --out runs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from te_ops.examples import train_moe


def run_job(argv: list[str], log: str, threads: int) -> float:
    """One run of the job in this (worker) process; its output goes to ``log``. Returns the
    final validation loss."""
    import torch

    torch.set_num_threads(threads)
    os.environ["TRAIN_MOE_PROGRESS"] = "0"
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f, contextlib.redirect_stdout(f):
        return train_moe.main([*argv, "--threads", str(threads)])["final_val_loss"]


def int_list(text: str, name: str, minimum: int | None = None) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``. Raises ValueError naming the argument ``name``, the
    entry, and what was expected (integers, at least ``minimum`` where given)."""
    values = []
    for item in text.split(","):
        try:
            value = int(item)
        except ValueError:
            raise ValueError(f"{name}: expected comma-separated integers, got {item!r} in "
                             f"{text!r}") from None
        if minimum is not None and value < minimum:
            raise ValueError(f"{name}: each value must be >= {minimum}, got {value}")
        values.append(value)
    return values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--master-weights", default="fp32", choices=["fp32", "none"],
                        help="the job's --master-weights (fp32 master weights with bf16)")
    parser.add_argument("--recipes", default="none,fp8", help="comma-separated, some of "
                        f"{', '.join(train_moe.RECIPES)}; must include none")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int,
                        default=train_moe.PRESETS["recipe-compare"]["steps"],
                        help="the job's --steps (default: the job's --preset recipe-compare)")
    parser.add_argument("--parallel", type=int, default=0,
                        help="runs at once, each its own process (0: all runs at once on "
                             "cuda, up to 8; one at a time on cpu)")
    parser.add_argument("--out", default="runs")
    args = parser.parse_args()
    recipes = args.recipes.split(",")
    try:
        seeds = int_list(args.seeds, "--seeds")
    except ValueError as exc:
        parser.error(str(exc))
    for name, values in (("--recipes", recipes), ("--seeds", seeds)):
        twice = sorted({v for v in values if values.count(v) > 1}, key=str)
        if twice:  # two runs would write one directory at once
            parser.error(f"{name}: each value once (every run writes its own directory), got "
                         f"{twice} more than once in {values}")
    bad = [r for r in recipes if r not in train_moe.RECIPES]
    if bad:  # first: a misspelt name is named as such, not as "none missing"
        parser.error(f"--recipes: unknown {bad}, expected some of {list(train_moe.RECIPES)}")
    if "none" not in recipes:
        parser.error(f"--recipes must include none (the bf16 baseline), got {recipes}")
    if args.parallel < 0:
        parser.error(f"--parallel must be >= 0, got {args.parallel}")
    jobs = [(recipe, seed) for seed in seeds for recipe in recipes]

    def job_argv(recipe: str, seed: int) -> list[str]:
        return ["--device", args.device, "--dtype", args.dtype, "--steps", str(args.steps),
                "--seed", str(seed), "--recipe", recipe, "--master-weights",
                args.master_weights, "--out-dir", f"{args.out}/seeds_{recipe}_{seed}"]

    for recipe, seed in jobs:  # the job's own argument errors once, here, before any run
        train_moe.parse_args(job_argv(recipe, seed))
    parallel = args.parallel or (min(len(jobs), 8) if args.device == "cuda" else 1)
    threads = max(1, (os.cpu_count() or 1) // parallel)
    loss: dict[tuple[str, int], float] = {}
    # spawn: CUDA cannot be initialized again in a forked child.
    with ProcessPoolExecutor(parallel, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {}
        for recipe, seed in jobs:
            log = f"{args.out}/seeds_{recipe}_{seed}/train.log"
            futures[recipe, seed] = pool.submit(run_job, job_argv(recipe, seed), log, threads)
        for (recipe, seed), future in futures.items():
            try:
                loss[recipe, seed] = future.result()
            except Exception as exc:  # name the run; runs not started yet are dropped
                pool.shutdown(wait=False, cancel_futures=True)
                raise SystemExit(
                    f"run --recipe {recipe} --seed {seed} failed: {type(exc).__name__}: {exc} "
                    f"(its output: {args.out}/seeds_{recipe}_{seed}/train.log)") from exc
            print(json.dumps({"recipe": recipe, "seed": seed, "device": args.device,
                              "dtype": args.dtype, "steps": args.steps,
                              "master_weights": args.master_weights,
                              "final_val_loss": loss[recipe, seed]}), flush=True)
    print(f"\n{'recipe':<8}" + "".join(f"  seed {s:<14}" for s in seeds) + "  mean vs none")
    for recipe in recipes:
        rel = [loss[recipe, s] / loss["none", s] - 1 for s in seeds]
        cells = "".join(f"  {loss[recipe, s]:.4f} ({r:+.1%})  " for s, r in zip(seeds, rel))
        print(f"{recipe:<8}{cells}  {statistics.mean(rel):+.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
