"""Noise floor of the main job's final validation loss: bf16 against tiny, valid perturbations.

The target is FP8's final validation loss within 2 % of bf16's on the same seed. That
comparison means something only if bf16 itself repeats to well under 2 % when its arithmetic
changes by an amount as small as FP8's is large or smaller. This runs the main job
(``te_ops.examples.train_moe``) in separate processes, several at once, as ``RECIPE:VARIANT``
runs over seeds and step counts:

``base``
    the job unchanged.
``ulp``
    one bf16 ulp added to the magnitude of one initial weight (``embed.weight[0, 0]``, after
    the cast to ``--dtype``): the same model to within the parameters' own rounding.
``sdpa_math``
    attention through PyTorch's math SDPA kernel instead of the default fused one: the same
    formula, another accumulation order.
``emulate``
    (with a recipe) ``TE_OPS_QUANTIZED_GEMM=emulate``: the same FP8 bytes dequantized and
    multiplied with fp32 accumulation instead of the native scaled GEMM (Hopper's fprop uses
    fast accumulation).

Each run prints one JSON line (final whole-split validation loss, the periodic evals, wall
time); the driver prints a table of every run's loss relative to ``none:base`` on its seed and
step count, and the noise floor: the largest and mean absolute change of the ``none:*``
perturbations; it exits with status 1 when a run failed (the run is named). Usage::

    python scripts/main_job_noise.py --device cuda --runs none:base,none:ulp,fp8:base \\
        --seeds 0,1,2 --steps 600,1200 --parallel 8 --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

# One parser of comma-separated integer arguments for both main-job drivers.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from main_job_seeds import int_list  # noqa: E402

VARIANTS = ("base", "ulp", "sdpa_math", "emulate")
RECIPES = ("none", "fp8", "mxfp8")


def parse_runs(text: str) -> list[tuple[str, str]]:
    """``"none:base,fp8:emulate"`` -> [("none", "base"), ("fp8", "emulate")]; errors name
    the bad entry."""
    runs = []
    for item in text.split(","):
        recipe, _, variant = item.partition(":")
        variant = variant or "base"
        if recipe not in RECIPES or variant not in VARIANTS:
            raise ValueError(f"--runs entry {item!r}: expected RECIPE:VARIANT with RECIPE in "
                             f"{RECIPES} and VARIANT in {VARIANTS}")
        if variant == "emulate" and recipe == "none":
            raise ValueError(f"--runs entry {item!r}: emulate needs a recipe (fp8 or mxfp8)")
        runs.append((recipe, variant))
    return runs


def nudge_one_ulp(t: Any) -> None:
    """Add one ulp (of ``t``'s dtype) to the magnitude of ``t``'s first element, in place."""
    import torch

    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    with torch.no_grad():
        t.view(-1)[:1].view(ints).add_(1)


def run_one(recipe: str, variant: str, seed: int, steps: int, args: argparse.Namespace
            ) -> dict[str, Any]:
    """One training run in this process; returns its JSON record."""
    import torch

    from te_ops.examples import train_moe

    torch.set_num_threads(args.threads)
    os.environ["TRAIN_MOE_PROGRESS"] = "0"
    if variant == "emulate":
        os.environ["TE_OPS_QUANTIZED_GEMM"] = "emulate"
    if variant == "ulp":
        base = train_moe.MoELanguageModel

        class Nudged(base):  # type: ignore[misc, valid-type]
            def to(self, *a: Any, **k: Any) -> Any:
                out = super().to(*a, **k)
                nudge_one_ulp(out.embed.weight)
                return out

        train_moe.MoELanguageModel = Nudged
    ctx: Any = contextlib.nullcontext()
    if variant == "sdpa_math":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ctx = sdpa_kernel(SDPBackend.MATH)
    name = f"{recipe}_{variant}_s{seed}_n{steps}"
    argv = ["--device", args.device, "--dtype", args.dtype, "--steps", str(steps),
            "--seed", str(seed), "--recipe", recipe, "--eval-batches", str(args.eval_batches),
            "--out-dir", str(Path(args.out) / name)]
    with ctx:
        m = train_moe.main(argv)
    return {"recipe": recipe, "variant": variant, "seed": seed, "steps": steps,
            "device": args.device, "dtype": args.dtype, "eval_batches": args.eval_batches,
            "final_val_loss": m["final_val_loss"], "wall_time_s": m["wall_time_s"],
            "evals": [(e["step"], round(e["val_loss"], 4)) for e in m["evals"]]}


def spawn(job: tuple[str, str, int, int], args: argparse.Namespace) -> dict[str, Any]:
    """Run one job in a child process; returns its record (or an error record)."""
    recipe, variant, seed, steps = job
    cmd = [sys.executable, __file__, "--one", f"{recipe}:{variant}:{seed}:{steps}",
           "--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads),
           "--eval-batches", str(args.eval_batches), "--out", args.out]
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=path)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"recipe": recipe, "variant": variant, "seed": seed, "steps": steps,
            "error": (proc.stderr or proc.stdout)[-800:]}


def report(records: list[dict[str, Any]]) -> None:
    """Table of each run vs ``none:base`` on its seed and step count, and the noise floor."""
    ok = {(r["recipe"], r["variant"], r["seed"], r["steps"]): r["final_val_loss"]
          for r in records if "final_val_loss" in r}
    for steps in sorted({k[3] for k in ok}):
        seeds = sorted({k[2] for k in ok if k[3] == steps})
        print(f"\n--- {steps} steps: final validation loss (vs none:base on the same seed)")
        print(f"{'run':<16}" + "".join(f"  seed {s:<16}" for s in seeds) + "  mean |rel|")
        floor = []
        for recipe, variant in sorted({(k[0], k[1]) for k in ok if k[3] == steps}):
            cells, rels = "", []
            for s in seeds:
                v, b = ok.get((recipe, variant, s, steps)), ok.get(("none", "base", s, steps))
                if v is None:
                    cells += f"  {'-':<21}"
                    continue
                rel = v / b - 1 if b else float("nan")
                rels.append(rel)
                cells += f"  {v:.4f} ({rel:+.2%})  " if b else f"  {v:.4f}{'':<12}"
                if recipe == "none" and variant != "base" and b:
                    floor.append(abs(rel))
            mean = statistics.mean(abs(r) for r in rels) if rels else float("nan")
            print(f"{recipe + ':' + variant:<16}{cells}  {mean:.2%}")
        if floor:
            print(f"noise floor (none:* perturbations vs none:base): max |rel| "
                  f"{max(floor):.2%}, mean |rel| {statistics.mean(floor):.2%} over "
                  f"{len(floor)} pairs")
    for r in records:
        if "error" in r:
            print(f"FAILED {r['recipe']}:{r['variant']} seed {r['seed']} steps {r['steps']}: "
                  f"{r['error']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--runs", default="none:base,none:ulp,none:sdpa_math",
                   help=f"comma-separated RECIPE:VARIANT, RECIPE in {RECIPES}, VARIANT in "
                        f"{VARIANTS}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", default="600", help="comma-separated step counts")
    p.add_argument("--eval-batches", type=int, default=4, help="the job's --eval-batches")
    p.add_argument("--parallel", type=int, default=1, help="runs at once (processes)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--out", default="runs/noise")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        recipe, variant, seed, steps = args.one.split(":")
        print(json.dumps(run_one(recipe, variant, int(seed), int(steps), args)), flush=True)
        return 0
    try:
        runs = parse_runs(args.runs)
    except ValueError as exc:
        p.error(str(exc))
    for name in ("parallel", "threads", "eval_batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        seeds = int_list(args.seeds, "--seeds")
        steps = int_list(args.steps, "--steps", minimum=1)
    except ValueError as exc:
        p.error(str(exc))
    for name, values in (("--runs", [f"{r}:{v}" for r, v in runs]), ("--seeds", seeds),
                         ("--steps", steps)):
        twice = sorted({v for v in values if values.count(v) > 1}, key=str)
        if twice:  # two runs would write one directory at once
            p.error(f"{name}: each value once (every run writes its own directory), got "
                    f"{twice} more than once in {values}")
    # Longest first, so the pool's tail is short runs.
    jobs = sorted(((r, v, s, n) for (r, v), s, n in itertools.product(runs, seeds, steps)),
                  key=lambda j: -j[3] * (2 if j[0] != "none" else 1))
    start = time.perf_counter()
    records = []
    with ThreadPoolExecutor(args.parallel) as pool:
        for future in as_completed([pool.submit(spawn, j, args) for j in jobs]):
            records.append(future.result())
            print(json.dumps(records[-1]), flush=True)
    report(records)
    print(f"\n{len(jobs)} runs, {args.parallel} at once, {time.perf_counter() - start:.0f} s")
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
