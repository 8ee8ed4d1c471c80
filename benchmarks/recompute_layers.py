"""Peak memory and step time of a stack of fused grouped-MLP blocks, fc1 recompute on vs off.

One block's step (``benchmarks/grouped_mlp.py``) peaks inside its own backward, where the
recomputed h is live just as a saved h would be, so ``recompute_input=True`` cannot lower that
peak. What it lowers is what each block keeps from its forward until its backward: in a model
of L blocks, the forwards of all L run before the first backward. This script runs ``--layers``
blocks ``Sequential(GroupedLinear, ScaledSwiGLU(recompute_input=...), GroupedLinear)`` back to
back (each block's output feeds the next, same routing), then one backward, and reports per
setting: the median step time (CUDA events, ``--iters`` steps after ``--warmup``), the peak
allocated memory of one step minus the parameters (``peak_mib``), the memory allocated once
every forward has run (``after_forward_mib``: what the blocks hold for backward, inputs and
probs included, minus the parameters), per block the peak and the allocated memory when its
input gradient is ready (``backward_mib``: [peak, allocated] pairs, last block first; the
weight gradients of the blocks done so far count), and the floating-point bytes saved for
backward per block (``saved_tensors_hooks``; parameters, probs and each block's input excluded;
the integer split tensors, a few hundred bytes, left out).

Usage::

    python benchmarks/recompute_layers.py [--shape E8_T16384_H4096_FF14336] [--layers 4]
        [--out DIR]

One JSON line per setting to stdout and to ``<--out>/recompute_layers.jsonl`` (default
``runs/recompute_layers``), a table to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    add_out_argument,
    machine_info,
    out_path,
    peak_memory_mib,
    summarize_times,
    time_steps,
)
from grouped_mlp import SHAPES, TINY_SHAPES, skewed_sizes  # noqa: E402

import te_ops  # noqa: E402


def build(shape: tuple[int, int, int, int], layers: int, recompute: bool,
          device: torch.device) -> list[te_ops.Sequential]:
    experts, _, hidden, ffn = shape
    torch.manual_seed(0)
    kw = {"bias": False, "device": device, "dtype": torch.bfloat16}
    return [te_ops.Sequential(te_ops.GroupedLinear(experts, hidden, 2 * ffn, **kw),
                              te_ops.ScaledSwiGLU(recompute_input=recompute),
                              te_ops.GroupedLinear(experts, ffn, hidden, **kw))
            for _ in range(layers)]


def _memory_trace(blocks: list[te_ops.Sequential], x: torch.Tensor, block_args: tuple,
                  dy: torch.Tensor, before, device: torch.device, param_bytes: int
                  ) -> tuple[float | None, list[list[float]]]:
    """Allocated MiB after all forwards, and per block backward (in the order they run) the
    peak since the previous one and the allocated MiB when the block's input gradient is
    ready (a tensor hook on each block's input); parameters subtracted."""
    if device.type != "cuda":
        return None, []
    mib = 2**20
    per_block: list[list[float]] = []

    def record(grad: torch.Tensor) -> None:
        torch.cuda.synchronize(device)
        per_block.append([(torch.cuda.max_memory_allocated(device) - param_bytes) / mib,
                          (torch.cuda.memory_allocated(device) - param_bytes) / mib])
        torch.cuda.reset_peak_memory_stats(device)

    before()
    torch.cuda.synchronize(device)
    y = x
    for b in blocks:
        y.register_hook(record)
        y = b(y, *block_args)
    torch.cuda.synchronize(device)
    after = (torch.cuda.memory_allocated(device) - param_bytes) / mib
    torch.cuda.reset_peak_memory_stats(device)
    y.backward(dy)
    return after, per_block


def measure(args: argparse.Namespace, recompute: bool, device: torch.device) -> dict:
    shape = {**SHAPES, **TINY_SHAPES}[args.shape]
    experts, tokens, hidden, _ = shape
    blocks = build(shape, args.layers, recompute, device)
    params = [p for b in blocks for p in b.parameters()]
    split = torch.tensor(skewed_sizes(experts, tokens, 0), device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=gen)
    x.requires_grad_()
    probs = torch.rand(tokens, device=device, generator=gen, requires_grad=True)
    dy = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=gen)

    def before() -> None:
        for t in (x, probs, *params):
            t.grad = None

    def forward() -> torch.Tensor:
        y = x
        for b in blocks:
            y = b(y, split, probs, split)
        return y

    def step() -> None:
        forward().backward(dy)

    times = time_steps(step, device, warmup=args.warmup, iters=args.iters, before=before)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    peak = peak_memory_mib(step, device, param_bytes, before=before)
    after_forward, per_block = _memory_trace(blocks, x, (split, probs, split), dy, before,
                                              device, param_bytes)
    saved: dict[int, int] = {}
    skip = {p.untyped_storage().data_ptr() for p in (*params, probs)}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip and t.is_floating_point():
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    before()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = forward()
    inputs = args.layers * tokens * hidden * 2  # each block's input (bf16), saved by fc1
    y.backward(dy)
    del y
    for b in blocks:
        for p in b.parameters():
            p.grad = None
    return {"bench": "recompute_layers", "shape": args.shape, "layers": args.layers,
            "recompute_input": recompute, **summarize_times(times), "peak_mib": peak,
            "param_mib": param_bytes / 2**20, "after_forward_mib": after_forward,
            "backward_mib": per_block,
            "saved_mib_per_block": (sum(saved.values()) - inputs) / args.layers / 2**20,
            "records": blocks[0][1].dispatch_records()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="E8_T16384_H4096_FF14336",
                        choices=[*SHAPES, *TINY_SHAPES])
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run "
                        "(no peak memory there)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    add_out_argument(parser, "recompute_layers")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.iters < 1 or args.warmup < 0:
        parser.error(f"--layers and --iters must be >= 1, --warmup >= 0, got {args.layers}, "
                     f"{args.iters}, {args.warmup}")
    device = torch.device(args.device)
    path = out_path(args.out, "recompute_layers.jsonl")
    rows = []
    for recompute in (False, True):
        row = {**machine_info(device), **measure(args, recompute, device)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"{'shape':<26} {'layers':>6} {'recompute':>9} {'ms':>9} {'peak MiB':>9} "
          f"{'after fwd':>9} {'saved MiB/block':>16}  backward [peak, end] MiB per block",
          file=sys.stderr)
    nan = float("nan")
    for r in rows:
        trace = " ".join(f"[{a:.0f}, {b:.0f}]" for a, b in r["backward_mib"])
        print(f"{r['shape']:<26} {r['layers']:>6} {r['recompute_input']!s:>9} "
              f"{r['ms_median']:9.3f} {r['peak_mib'] or nan:9.0f} "
              f"{r['after_forward_mib'] or nan:9.0f} {r['saved_mib_per_block']:16.2f}  {trace}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
