"""Host time per call of the small device calls an eager te_ops step makes (CUDA).

The E64 decode step is host-bound: its time is the host's work per call, not the kernels'.
This times, on the host clock, how long each kind of call takes to return (the device is
synchronized between batches, so the launch queue never fills): ``torch.cumsum`` of the split
sizes (cub's scan) and an exact alternative, ``torch.empty`` with keyword device/dtype against
``Tensor.new_empty``, te_ops' padding-row Triton kernel launched from Python, one
``torch._grouped_mm`` and one in-place elementwise op for scale; and the persistent many-rows
Triton kernels' entry points (``large_fprop`` / ``large_dgrad`` / ``large_wgrad``) against the
``torch._grouped_mm`` calls they replace, and the fast path's bound call sites of those kernels
(``*_bound``: ``grouped_gemm_large_bound``, one ``LaunchBatch.begin`` per batch of calls, as
the fast path makes one per forward / backward; ``launch_batch_begin`` is that call alone).
JSON lines, median microseconds per call.

Usage::

    python benchmarks/host_launch_costs.py [--groups 64] [--calls 200] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import JsonLines, machine_info  # noqa: E402


def host_us(fn, calls: int, device: torch.device, batch: int = 20) -> float:
    """Median host microseconds per call of ``fn`` (device synced between batches)."""
    for _ in range(batch):
        fn()
    torch.cuda.synchronize(device)
    per_call = []
    for _ in range(max(calls // batch, 1)):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        per_call.append((time.perf_counter() - t0) / batch * 1e6)
        torch.cuda.synchronize(device)
    return statistics.median(per_call)


def _bound_calls(device: torch.device, x: torch.Tensor, wt: torch.Tensor, dy: torch.Tensor,
                 offs: torch.Tensor) -> dict:
    """The fast path's bound sites of the persistent kernels (bound by a first call here)."""
    from te_ops.gemm.grouped_gemm_large_bound import BoundLarge, BoundLargeWgrad
    from te_ops.kernels.triton_launch import LaunchBatch

    batch = LaunchBatch()
    fprop, dgrad, wgrad = BoundLarge("fprop", batch), BoundLarge("dgrad", batch), \
        BoundLargeWgrad(batch)
    for _ in range(2):  # the first call binds, the second checks the direct launch runs
        batch.begin(device)
        fprop(x, wt, offs)
        dgrad(dy, wt, offs)
        wgrad(x, dy, offs)
    if not batch.ready:
        raise RuntimeError("the bound sites did not bind (direct launches off here?)")
    return {"launch_batch_begin": lambda: batch.begin(device),
            "large_fprop_bound": lambda: fprop(x, wt, offs),
            "large_dgrad_bound": lambda: dgrad(dy, wt, offs),
            "large_wgrad_bound": lambda: wgrad(x, dy, offs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    g, t = args.groups, args.tokens
    sizes = torch.full((g,), t // g, dtype=torch.int64, device=device)
    tri = torch.ones(g, g, dtype=torch.float64, device=device).triu_()
    x = torch.randn(t, 2048, device=device, dtype=torch.bfloat16)
    w = torch.randn(g, 2048, 1536, device=device, dtype=torch.bfloat16)
    offs = torch.cumsum(sizes, 0).to(torch.int32)
    calls = {
        "cumsum_int64": lambda: torch.cumsum(sizes, 0),
        "cumsum_fp64_matmul": lambda: (sizes.double() @ tri).long(),
        "empty_kwargs": lambda: torch.empty(t, 1536, device=x.device, dtype=x.dtype),
        "new_empty": lambda: x.new_empty(t, 1536),
        "add_inplace": lambda: x.add_(0),
        "grouped_mm": lambda: torch._grouped_mm(x, w, offs=offs),
    }
    try:
        from te_ops.kernels.padding import _launch

        calls["triton_zero_rows_launch"] = lambda: _launch(x, offs)
    except ImportError:  # no Triton
        pass
    # The persistent many-rows kernels' eager entry points (argument checks, config, TMA gate,
    # grid, launch), against the torch._grouped_mm calls they replace: their host cost per
    # call, which te_ops' fast path pays for every fprop / dgrad (and, at 64-256 rows per
    # group, wgrad) of a step (docs/benchmarks.md, the goal table's 64-256-rows paragraph).
    from te_ops.gemm import grouped_gemm_large_triton as large
    from te_ops.gemm import grouped_wgrad_large_triton as large_w

    if large.unsupported_reason(device, x.dtype) is None:
        wt = torch.randn(g, 1536, 2048, device=device, dtype=torch.bfloat16)  # (G, N, K)
        dy = torch.randn(t, 1536, device=device, dtype=torch.bfloat16)
        calls.update({
            "large_fprop": lambda: large.large_fprop(x, wt, offs),
            "grouped_mm_fprop_wt": lambda: torch._grouped_mm(x, wt.transpose(1, 2), offs=offs),
            "large_dgrad": lambda: large.large_dgrad(dy, wt, offs),
            "grouped_mm_dgrad": lambda: torch._grouped_mm(dy, wt, offs=offs),
            "large_wgrad": lambda: large_w.large_wgrad(x, dy, offs),
            "grouped_mm_wgrad": lambda: torch._grouped_mm(dy.t(), x, offs=offs),
        })
        calls.update(_bound_calls(x.device, x, wt, dy, offs))  # with its index (cuda:0)
    out = JsonLines(args.out)
    out.write({"bench": "host_launch_costs_run", **machine_info(device), "groups": g})
    try:
        for name, fn in calls.items():
            out.write({"bench": "host_launch_costs", "call": name,
                       "host_us": host_us(fn, args.calls, device)})
    finally:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
