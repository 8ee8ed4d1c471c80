"""Does a GEMM's time at the power cap depend on its data? Zero rows against random rows.

A grouped GEMM's tail tile computes rows past its group's end and drops them. te_ops' kernels
load those rows from the next group (real data); CUTLASS's grouped GEMM builds a descriptor per
group, so its TMA fills them with zeros. At the H200's 700 W cap a step's time follows its
energy (docs/benchmarks.md, "Energy per step at the power cap"), and a tensor core's energy
per MMA depends on how many bits toggle. This script measures that dependence: a bf16
``torch.matmul`` (M, K) @ (K, N) where a fraction of A's rows (``--zero-fractions``, spread
evenly: every ``1/f``-th row block of 128) is zero, each variant in power-capped blocks of
``--block-ms`` back-to-back calls, variants in turn, ``--rounds`` times (the median call time
of each block's second half; SM clock and instantaneous power at the block's end, NVML).

The record per variant: ``ms`` (median over rounds), ``vs_random`` (random's time / this
one's, > 1: faster), MHz and W.

Usage (CUDA)::

    python benchmarks/gemm_data_power.py --out data_power.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sustained_gemm import _block, _Nvml  # noqa: E402


def operand_with_zero_rows(a: torch.Tensor, fraction: float, block: int = 128) -> torch.Tensor:
    """A copy of ``a`` with ``fraction`` of its ``block``-row blocks zero: blocks whose index
    times ``fraction`` crosses an integer (spread evenly). Raises ``ValueError`` for a fraction
    outside [0, 1]."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    out = a.clone()
    blocks = (a.shape[0] + block - 1) // block
    for b in range(blocks):
        if int((b + 1) * fraction) > int(b * fraction):
            out[b * block:(b + 1) * block] = 0
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, default=16384)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--k", type=int, default=8192)
    parser.add_argument("--zero-fractions", default="0.0625,0.125,0.5,1.0")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block-ms", type=float, default=1000.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    try:
        fractions = [float(f) for f in args.zero_fractions.split(",") if f]
    except ValueError:
        parser.error(f"--zero-fractions: comma-separated numbers in (0, 1], got "
                     f"{args.zero_fractions!r}")
    if any(not 0.0 < f <= 1.0 for f in fractions):
        parser.error(f"--zero-fractions: each in (0, 1], got {fractions}")
    if args.rounds < 1 or min(args.m, args.n, args.k) < 1:
        parser.error(f"--rounds, --m, --n and --k must be >= 1, got {args.rounds}, {args.m}, "
                     f"{args.n}, {args.k}")
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(args.k, args.n, device="cuda", dtype=torch.bfloat16, generator=gen)
    b.mul_(args.k ** -0.5)
    operands = {"random": a}
    for f in fractions:
        operands[f"zero_{f:g}"] = operand_with_zero_rows(a, f)
    out = torch.empty(args.m, args.n, device="cuda", dtype=torch.bfloat16)
    calls = {name: (lambda x=x: torch.matmul(x, b, out=out)) for name, x in operands.items()}
    counts = {}
    for name, fn in calls.items():
        fn()
        torch.cuda.synchronize()
        counts[name] = max(8, int(args.block_ms / max(_block(fn, 3), 1e-3)))
    nvml = _Nvml()
    times = {n: [] for n in calls}
    clocks = {n: [] for n in calls}
    watts = {n: [] for n in calls}
    for _ in range(args.rounds):
        for name, fn in calls.items():
            times[name].append(_block(fn, counts[name]))
            mhz, w = nvml.read()
            clocks[name].append(mhz)
            watts[name].append(w)
    ref = statistics.median(times["random"])
    print(f"# bf16 matmul M={args.m} N={args.n} K={args.k}, {args.rounds} rounds of "
          f"{args.block_ms:g} ms blocks; GPU {torch.cuda.get_device_name()}")
    print(f"{'variant':12} {'ms':>8} {'vs_random':>9} {'MHz':>6} {'W':>6}  rounds")
    for name in calls:
        rec = {"bench": "gemm_data_power", "variant": name, "m": args.m, "n": args.n,
               "k": args.k, "ms": statistics.median(times[name]), "rounds_ms": times[name],
               "mhz": statistics.median(clocks[name]), "w": statistics.median(watts[name])}
        rec["vs_random"] = ref / rec["ms"]
        print(f"{name:12} {rec['ms']:8.3f} {rec['vs_random']:9.3f} {rec['mhz']:6.0f} "
              f"{rec['w']:6.0f}  {[round(t, 3) for t in times[name]]}", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
