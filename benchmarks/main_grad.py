"""Megatron main_grad: te_ops' in-GEMM accumulation vs autograd ``.grad`` plus Megatron's hook.

One forward+backward of ``GroupedLinear -> ScaledSwiGLU -> GroupedLinear`` (bf16 weights, an
fp32 ``main_grad`` per parameter, one buffer as Megatron lays it out):

* ``grad_hook``: plain backward; a post-accumulate-grad hook adds ``.grad`` into ``main_grad``
  and drops ``.grad`` (what Megatron's DDP hook does for layers without main_grad support);
* ``main_grad``: ``accumulate_into_main_grad=True`` (te_ops.training): the wgrad goes into
  ``main_grad`` from the GEMM, autograd gets ``None``.

Prints JSON lines (median ms, peak MiB over the step) and whether ``torch._grouped_mm``
accepts ``out_dtype=float32`` here. Usage:
``python benchmarks/main_grad.py [--device cuda] [--experts 8 --hidden 2048 --ffn 2048
--tokens 16384]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    JsonLines,
    free_memory,
    machine_info,
    peak_memory_mib,
    summarize_times,
    time_steps,
)

import te_ops  # noqa: E402
from te_ops.gemm.wgrad_into import grouped_mm_out_dtype_reason  # noqa: E402


def build(args, device, main_grad: bool) -> te_ops.Sequential:
    torch.manual_seed(0)
    kw = {"device": device, "dtype": torch.bfloat16, "accumulate_into_main_grad": main_grad}
    block = te_ops.Sequential(
        te_ops.GroupedLinear(args.experts, args.hidden, 2 * args.ffn, **kw),
        te_ops.ScaledSwiGLU(),
        te_ops.GroupedLinear(args.experts, args.ffn, args.hidden, **kw),
    )
    params = list(block.parameters())
    buffer = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=device)
    pos = 0
    for p in reversed(params):
        p.main_grad = buffer[pos:pos + p.numel()].view(p.shape)
        pos += p.numel()
        if not main_grad:
            def hook(param):
                param.main_grad.add_(param.grad)
                param.grad = None
            p.register_post_accumulate_grad_hook(hook)
    return block


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    out = JsonLines(args.out)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, generator=gen, device=device).bfloat16()
    sizes = torch.full((args.experts,), args.tokens // args.experts, device=device)
    probs = torch.rand(args.tokens, generator=gen, device=device)
    dy = torch.randn(args.tokens, args.hidden, generator=gen, device=device).bfloat16()
    out.write({"probe": "grouped_mm out_dtype=float32 for bf16",
               "reason": grouped_mm_out_dtype_reason(device, torch.bfloat16, torch.float32),
               **machine_info(device)})
    for variant in ("grad_hook", "main_grad"):
        free_memory()
        block = build(args, device, variant == "main_grad")

        def step(block=block):
            block(x, sizes, probs, sizes).backward(dy)

        times = time_steps(step, device, warmup=3, iters=args.iters)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        peak = peak_memory_mib(step, device, base)
        out.write({"variant": variant, "experts": args.experts, "hidden": args.hidden,
                   "ffn": args.ffn, "tokens": args.tokens, **summarize_times(times),
                   "peak_mib_over_resident": peak})
        del block


if __name__ == "__main__":
    main()
