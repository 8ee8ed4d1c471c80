"""How much the native FP8 GEMMs (Hopper fast accumulation in fprop) add to FP8's own rounding.

One forward + backward of a bf16 expert block (GroupedLinear -> ScaledSwiGLU -> GroupedLinear)
without a recipe, under ``Float8CurrentScaling`` with the native scaled grouped GEMMs, under
``Float8CurrentScaling(fast_accumulate_backward=True)`` (fast accumulation in dgrad / wgrad
too), and with ``TE_OPS_QUANTIZED_GEMM=emulate`` (the same FP8 bytes dequantized and multiplied
with fp32 accumulation). Prints one JSON line per shape: the relative Frobenius error of the
output and of every gradient (x, probs, fc1 and fc2 weights) for native vs emulated (what the
native kernels add) and for emulated vs no recipe (what E4M3 rounding costs). Needs CUDA.
Usage: ``python benchmarks/fp8_native_vs_emulated.py [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info  # noqa: E402

import te_ops  # noqa: E402
from te_ops.recipe import Float8CurrentScaling  # noqa: E402

#: (name, experts, tokens, hidden, ffn): the main job's expert block (16 x 128 tokens, top-2,
#: 4 experts, d_model 128, ffn 256) and a larger one.
SHAPES = [("main_job_E4_T4096_H128_FF256", 4, 4096, 128, 256),
          ("E8_T8192_H1024_FF2048", 8, 8192, 1024, 2048)]
NAMES = ["y", "dx", "dprobs", "dW_fc1", "dW_fc2"]


def run(blk, x, sizes, probs, dy, recipe, mode: str | None) -> list[torch.Tensor]:
    """Output and gradients of one forward + backward (``mode``: TE_OPS_QUANTIZED_GEMM)."""
    if mode is None:
        os.environ.pop("TE_OPS_QUANTIZED_GEMM", None)
    else:
        os.environ["TE_OPS_QUANTIZED_GEMM"] = mode
    xx, pp = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    blk.zero_grad(set_to_none=True)
    with te_ops.autocast(enabled=recipe is not None, recipe=recipe):
        y = blk(xx, sizes, pp, sizes)
    y.backward(dy)
    return [t.detach().double() for t in (y, xx.grad, pp.grad, *(p.grad for p in
                                                                   blk.parameters()))]


def rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict[str, float]:
    return {n: round(((u - v).norm() / v.norm().clamp_min(1e-300)).item(), 6)
            for n, u, v in zip(NAMES, a, b)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    dev = torch.device("cuda")
    for name, e, t, h, ff in SHAPES:
        torch.manual_seed(0)
        blk = te_ops.Sequential(
            te_ops.GroupedLinear(e, h, 2 * ff, bias=False, device=dev, dtype=torch.bfloat16),
            te_ops.ScaledSwiGLU(),
            te_ops.GroupedLinear(e, ff, h, bias=False, device=dev, dtype=torch.bfloat16))
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        probs = torch.rand(t, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(t, h, device=dev, dtype=torch.bfloat16) * 1e-3
        sizes = torch.full((e,), t // e, device=dev)
        inp = (blk, x, sizes, probs, dy)
        bf16 = run(*inp, None, None)
        native = run(*inp, Float8CurrentScaling(), "native")
        fast = run(*inp, Float8CurrentScaling(fast_accumulate_backward=True), "native")
        emul = run(*inp, Float8CurrentScaling(), "emulate")
        rec = {"bench": "fp8_native_vs_emulated", "shape": name,
               "native_vs_emulated": rel(native, emul),
               "native_fast_bwd_vs_emulated": rel(fast, emul),
               "emulated_vs_bf16": rel(emul, bf16), "native_vs_bf16": rel(native, bf16),
               **machine_info(dev)}
        line = json.dumps(rec)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
