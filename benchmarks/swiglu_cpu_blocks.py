"""Host cost of the CPU SwiGLU's row-block loop (``te_ops.basic.swiglu``), forward and the
fused backward, timed in one process with one intra-op thread (thread CPU time).

The torch SwiGLU runs in L2-sized row blocks on the CPU (``CPU_BLOCK_ELEMENTS``); every block
costs a handful of aten calls and views of host time. Each ``--block-elements`` value is timed
in turn, call by call (A, B, A, B, ...: drift on a shared host hits all alike), at
``--rows`` x ``--half`` (the CPU shape's fc1 output: 4096 x 512) and at a host-bound variant
(one row per block, ``--overhead-rows`` rows: almost no arithmetic, so ``us_per_block`` is the
loop's own host cost). With ``--baseline`` (a renamed copy of another tree's te_ops, written by
``host_ab.py --make-baseline``) the baseline's SwiGLU is timed alongside, and ``bitwise`` says
whether this tree's forward output, input gradient, probs gradient and recomputed output equal
the baseline's exactly.

Usage::

    python benchmarks/host_ab.py --make-baseline /path/to/other/tree/te_ops /tmp/base
    PYTHONPATH=.:/tmp/base python benchmarks/swiglu_cpu_blocks.py --baseline te_ops_base \\
        --iters 60 --out results.jsonl
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import JsonLines, check_min, machine_info  # noqa: E402

from te_ops.basic import swiglu  # noqa: E402

__all__ = ["main"]


def _inputs(rows: int, half: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"x": 3 * torch.randn(rows, 2 * half), "dy": torch.randn(rows, half),
            "probs": torch.rand(rows)}


def _call(module: Any, t: dict[str, torch.Tensor], x: torch.Tensor, dy: torch.Tensor
          ) -> tuple[float, float, tuple]:
    """Thread CPU seconds of one forward and one fused-style backward (gradient over ``x``,
    recomputed output over ``dy``, as the fused grouped MLP calls it), and the results."""
    c0 = time.thread_time()
    y = module.swiglu_forward(t["x"], None, t["probs"])
    c1 = time.thread_time()
    x.copy_(t["x"])
    dy.copy_(t["dy"])
    c2 = time.thread_time()
    grads = module.swiglu_backward(x, dy, None, t["probs"], with_output=True,
                                   grad_into_input=True, output_into_grad=True)
    c3 = time.thread_time()
    return c1 - c0, c3 - c2, (y, *grads)


def _time_case(variants: list[tuple[str, Any, int]], rows: int, half: int, iters: int
               ) -> tuple[dict[str, dict[str, list[float]]], dict[str, tuple]]:
    t = _inputs(rows, half)
    x, dy = t["x"].clone(), t["dy"].clone()
    times = {name: {"fwd": [], "bwd": []} for name, _, _ in variants}
    results: dict[str, tuple] = {}
    with torch.no_grad():  # as the fused ops' forward and backward run
        for i in range(iters + 2):
            for name, module, elements in variants:
                module.CPU_BLOCK_ELEMENTS = elements
                fwd, bwd, res = _call(module, t, x, dy)
                if i >= 2:
                    times[name]["fwd"].append(fwd * 1e3)
                    times[name]["bwd"].append(bwd * 1e3)
                results.setdefault(name, tuple(r.clone() for r in res))
    return times, results


def _blocks(module: Any, rows: int, half: int, elements: int) -> int:
    module.CPU_BLOCK_ELEMENTS = elements
    return -(-rows // module._block_rows(rows, half, torch.device("cpu")))


def _records(variants: list[tuple[str, Any, int]], times: dict, results: dict, rows: int,
             half: int, case: str) -> list[dict]:
    first = variants[0][0]
    records = []
    for name, module, elements in variants:
        blocks = _blocks(module, rows, half, elements)
        rec: dict = {"bench": "swiglu_cpu_blocks", "case": case, "rows": rows, "half": half,
                     "variant": name, "block_elements": elements, "blocks": blocks,
                     "iters": len(times[name]["fwd"])}
        for kind in ("fwd", "bwd"):
            ts = times[name][kind]
            rec[f"{kind}_ms_min"], rec[f"{kind}_ms_median"] = min(ts), statistics.median(ts)
            rec[f"{kind}_us_per_block_min"] = min(ts) * 1e3 / blocks
        if name != first:
            rec[f"bitwise_vs_{first}"] = all(
                torch.equal(a, b) for a, b in zip(results[first], results[name]))
        records.append(rec)
    return records


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--half", type=int, default=512, help="F: the output's width")
    parser.add_argument("--block-elements", default=str(swiglu.CPU_BLOCK_ELEMENTS),
                        help="comma-separated CPU_BLOCK_ELEMENTS values to time")
    parser.add_argument("--overhead-rows", type=int, default=256,
                        help="rows of the host-bound case (one row per block; 0: skip it)")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--baseline", default=None,
                        help="a renamed te_ops copy (host_ab.py --make-baseline) to time too")
    parser.add_argument("--out", default=None, help="append JSON lines to this file")
    args = parser.parse_args(argv)
    for flag, value, low in (("--rows", args.rows, 1), ("--half", args.half, 1),
                             ("--overhead-rows", args.overhead_rows, 0),
                             ("--iters", args.iters, 1)):
        check_min(parser, flag, value, low)
    try:
        args.block_elements = [int(v) for v in args.block_elements.split(",")]
    except ValueError:
        parser.error(f"--block-elements: expected comma-separated ints, got "
                     f"{args.block_elements!r}")
    check_min(parser, "--block-elements", min(args.block_elements), 1)
    args.base_module = None
    if args.baseline is not None:
        try:
            args.base_module = importlib.import_module(args.baseline + ".basic.swiglu")
        except ImportError as e:
            parser.error(f"--baseline {args.baseline!r} cannot be imported ({e}): write it with "
                         "host_ab.py --make-baseline SRC DEST and put DEST on PYTHONPATH")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the blocks run only with one intra-op thread
    modules = [m for m in (swiglu, args.base_module) if m is not None]
    defaults = [m.CPU_BLOCK_ELEMENTS for m in modules]
    out = JsonLines(args.out)
    out.write({"bench": "swiglu_cpu_blocks_run", **machine_info(torch.device("cpu")),
               "baseline": args.baseline})
    cases = [("shape", args.rows, args.half, args.block_elements)]
    if args.overhead_rows:
        cases.append(("one_row_blocks", args.overhead_rows, args.half, [args.half]))
    try:
        for case, rows, half, sizes in cases:
            variants = [(f"this_{e}", swiglu, e) for e in sizes]
            if args.base_module is not None:
                variants += [(f"baseline_{e}", args.base_module, e) for e in sizes]
            times, results = _time_case(variants, rows, half, args.iters)
            for rec in _records(variants, times, results, rows, half, case):
                out.write(rec)
                print(f"{case:15} {rec['variant']:18} blocks {rec['blocks']:4d}  fwd min "
                      f"{rec['fwd_ms_min']:7.3f} ms ({rec['fwd_us_per_block_min']:6.2f} us/block)"
                      f"  bwd min {rec['bwd_ms_min']:7.3f} ms "
                      f"({rec['bwd_us_per_block_min']:6.2f} us/block)", file=sys.stderr)
    finally:
        for m, value in zip(modules, defaults):
            m.CPU_BLOCK_ELEMENTS = value
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
