"""Host time of one eager launch of te_ops' Triton kernels: ``JITFunction.run`` against the
direct launch of the cached compiled kernel and against a bound call site
(``te_ops/kernels/triton_launch.py``).

Per kernel call (the E64 T256 H2048 FF768 decode shape's fc1 fprop, dgrad and wgrad and the
SwiGLU forward, bf16), the median over ``--rounds`` of the mean host time of ``--iters``
back-to-back calls: the public entry points with ``TE_OPS_TRITON_DIRECT_LAUNCH=0``
(``run_us``) and ``1`` (``direct_us``), and the fast path's bound call sites (``BoundRows``,
``BoundWgrad``, ``BoundForward``: no argument checks, config and launch bound once, one
``LaunchBatch.begin`` per block of calls; ``bound_us``). The device is synchronized between
blocks only; the calls queue on the stream. CUDA only.

Usage::

    PYTHONPATH=. python benchmarks/launch_overhead.py [--iters 200] [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import JsonLines, check_min, env_override, machine_info  # noqa: E402


def _calls(groups: int = 64, rows: int = 256, hidden: int = 2048, ffn: int = 768) -> tuple:
    """The public calls by name, the bound ones by name, and the bound sites' batch."""
    from te_ops.gemm import grouped_gemm_triton as gt
    from te_ops.kernels import swiglu_triton
    from te_ops.kernels.triton_launch import LaunchBatch

    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(rows, hidden, device=dev, dtype=dt)
    w = torch.randn(groups, 2 * ffn, hidden, device=dev, dtype=dt)
    dy = torch.randn(rows, 2 * ffn, device=dev, dtype=dt)
    offsets = torch.arange(1, groups + 1, device=dev, dtype=torch.int32) * (rows // groups)
    batch = LaunchBatch()
    fprop, dgrad = gt.BoundRows("fprop", batch), gt.BoundRows("dgrad", batch)
    wgrad, act = gt.BoundWgrad(batch), swiglu_triton.BoundForward(batch)
    return {
        "fprop": lambda: gt.triton_fprop(x, w, offsets),
        "dgrad": lambda: gt.triton_dgrad(dy, w, offsets),
        "wgrad": lambda: gt.triton_wgrad(x, dy, offsets),
        "swiglu_fwd": lambda: swiglu_triton.swiglu_forward(dy, None),
    }, {
        "fprop": lambda: fprop(x, w, offsets),
        "dgrad": lambda: dgrad(dy, w, offsets),
        "wgrad": lambda: wgrad(x, dy, offsets),
        "swiglu_fwd": lambda: act(dy, None),
    }, batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    check_min(parser, "--iters", args.iters, 1)
    check_min(parser, "--rounds", args.rounds, 1)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the Triton kernels launch on it)")
    out = JsonLines(args.out)
    out.write({"bench": "launch_overhead_run", **machine_info(torch.device("cuda"))})
    calls, bound_calls, batch = _calls()
    device = torch.device("cuda", torch.cuda.current_device())
    for name, call in calls.items():
        ways = {"0": call, "1": call, "bound": bound_calls[name]}
        times: dict[str, list[float]] = {way: [] for way in ways}
        for way, fn in ways.items():  # warm up each way (compile, cache, bind)
            with env_override(TE_OPS_TRITON_DIRECT_LAUNCH="0" if way == "0" else "1"):
                fn(), fn()
        torch.cuda.synchronize()
        for _ in range(args.rounds):
            for way, fn in ways.items():
                with env_override(TE_OPS_TRITON_DIRECT_LAUNCH="0" if way == "0" else "1"):
                    batch.begin(device)
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        fn()
                    t1 = time.perf_counter()
                torch.cuda.synchronize()
                times[way].append((t1 - t0) / args.iters * 1e6)
        out.write({"bench": "launch_overhead", "kernel": name,
                   "run_us": statistics.median(times["0"]),
                   "direct_us": statistics.median(times["1"]),
                   "bound_us": statistics.median(times["bound"]), "rounds_run_us": times["0"],
                   "rounds_direct_us": times["1"], "rounds_bound_us": times["bound"]})
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
