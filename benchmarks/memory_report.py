"""Saved-activation bytes and op counts of the grouped MLP, unfused vs fused.

Runs ``Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear)`` forward+backward once per
configuration (forward fused or not x backward fused or not, then the fused forward with
``ScaledSwiGLU(recompute_input=True)``, the opt-in fc1 recompute, with either backward) and
reports:

* ``saved_bytes``: bytes the autograd graph keeps for backward (``save_for_backward``
  tensors, counted once per storage, parameters and the block's input excluded), measured with
  ``torch.autograd.graph.saved_tensors_hooks``;
* ``saved_vs_unfused``: ``saved_bytes`` over the unfused forward's (option off);
* ``fwd_ops`` / ``bwd_ops``: ATen ops dispatched (each one a kernel launch on CUDA), and
  ``*_compute_ops``: the same without pure view/metadata ops, measured with a
  ``TorchDispatchMode``.

Usage::

    python benchmarks/memory_report.py [--device cpu|cuda] [--experts 8 --tokens 4096 ...]

The main job's expert block (defaults of ``te_ops.examples.train_moe``) is
``--experts 4 --tokens 4096 --hidden 128 --ffn 256 --no-bias`` (4096 = 16 x 128 tokens x top-2).

Writes one JSON line per configuration to stdout and to ``<--out>/memory_report.jsonl``
(default ``runs/memory_report``), and a table to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

import torch
from common import add_out_argument, env_override, out_path
from torch.utils._python_dispatch import TorchDispatchMode

import te_ops

_VIEW_OPS = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "as_strided", "expand", "unsqueeze",
    "squeeze", "alias", "detach", "slice", "select", "unbind", "split", "chunk", "permute",
    "split_with_sizes", "lift_fresh", "_to_copy_noop",
}


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def totals(self) -> tuple[int, int]:
        total = sum(self.ops.values())
        compute = sum(n for name, n in self.ops.items() if name not in _VIEW_OPS)
        return total, compute


def _build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
           recompute: bool = False):
    torch.manual_seed(0)
    block = te_ops.Sequential(
        te_ops.GroupedLinear(args.experts, args.hidden, 2 * args.ffn, bias=args.bias,
                             device=device, dtype=dtype),
        te_ops.ScaledSwiGLU(recompute_input=recompute),
        te_ops.GroupedLinear(args.experts, args.ffn, args.hidden, bias=args.bias, device=device,
                             dtype=dtype),
    )
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
    probs = torch.rand(args.tokens, device=device, requires_grad=True)
    expert = torch.randint(0, args.experts, (args.tokens,), device=device)
    split_sizes = torch.bincount(expert, minlength=args.experts)
    return block, x, probs, split_sizes


def measure(args: argparse.Namespace, fwd_fused: bool, bwd_fused: bool,
            recompute: bool = False) -> dict:
    """One forward+backward with the given fusion toggles (and ``recompute_input``); returns
    the counts."""
    off = [name for name, fused in (("grouped_mlp_forward", fwd_fused),
                                    ("grouped_mlp_backward", bwd_fused)) if not fused]
    with env_override(TE_OPS_FUSION_OFF=",".join(off)):
        return _measure(args, recompute)


def _measure(args: argparse.Namespace, recompute: bool = False) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    block, x, probs, split_sizes = _build(args, device, dtype, recompute)
    block(x, split_sizes, probs, split_sizes).sum().backward()  # warm-up: probe, plan
    for t in (x, probs, *block.parameters()):
        t.grad = None  # count te_ops' ops, not autograd's gradient accumulation

    param_ptrs = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_ptrs and ptr not in (x.untyped_storage().data_ptr(),):
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    fwd, bwd = _OpCounter(), _OpCounter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with fwd:
            y = block(x, split_sizes, probs, split_sizes)
    grad = torch.ones_like(y)
    with bwd:
        y.backward(grad)
    plan = block.fusers()[0]._plan
    return {
        "device": args.device,
        "dtype": args.dtype,
        "experts": args.experts,
        "tokens": args.tokens,
        "hidden": args.hidden,
        "ffn": args.ffn,
        "bias": args.bias,
        "forward": "+".join(type(op).__name__ for op, _ in plan.forward_ops),
        "backward": "+".join(type(op).__name__ for op, _ in plan.backward_ops),
        "recompute_input": recompute,
        "saved_bytes": sum(seen.values()),
        "fwd_ops": fwd.totals()[0],
        "fwd_compute_ops": fwd.totals()[1],
        "bwd_ops": bwd.totals()[0],
        "bwd_compute_ops": bwd.totals()[1],
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--bias", action=argparse.BooleanOptionalAction, default=True)
    add_out_argument(parser, "memory_report")
    args = parser.parse_args(argv)
    rows = [measure(args, fwd_fused, bwd_fused, recompute)
            for fwd_fused, bwd_fused, recompute in (
                (False, False, False), (True, False, False), (False, True, False),
                (True, True, False), (True, False, True), (True, True, True))]
    path = out_path(args.out, "memory_report.jsonl")
    base = rows[0]["saved_bytes"]
    for row in rows:
        row["saved_vs_unfused"] = round(row["saved_bytes"] / base, 4) if base else None
        line = json.dumps(row)
        print(line)
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    print(f"{'forward':<45} {'backward':<45} {'recompute':>9} {'saved MiB':>9} {'x unfused':>9} "
          f"{'fwd ops':>8} {'bwd ops':>8}", file=sys.stderr)
    for r in rows:
        print(f"{r['forward']:<45} {r['backward']:<45} {str(r['recompute_input']):>9} "
              f"{r['saved_bytes'] / 2**20:9.2f} {r['saved_vs_unfused']!s:>9} "
              f"{r['fwd_compute_ops']:8d} {r['bwd_compute_ops']:8d}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
