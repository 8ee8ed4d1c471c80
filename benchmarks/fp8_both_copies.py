"""What one pair of passes for both FP8 copies buys (``fp8_triton.fp8_both_grouped``).

Usage::

    PYTHONPATH=. python benchmarks/fp8_both_copies.py --out kernels.jsonl \
        --variants-out-prefix results/fp8_variant

Kernels: on the E8 T16384 H4096 FF14336 operands (W1 (8, 28672, 4096) weights; dh (16384,
28672) and x (16384, 4096) split activations, Zipf(1.2) routing as in ``grouped_mlp.py``), the
time of the row-wise and column-wise copies made apart (row-wise kernel + the column-wise pass
pair: three reads) against both from one pass pair (two reads), for the default tiles
(``fp8_triton.COLS_CONFIG``) and a few others; every setting's bytes and scales must equal
the separate kernels' (``check``).

Variants (``--variants-out-prefix``): the fused block's fast-accum FP8 step
(``grouped_mlp.py --recipe fp8fast``) with the switches set as each step of the work left them:
``separate`` (``quantizer.BOTH_COPIES_ONE_KERNEL = False`` and
``TE_OPS_SAVE_COLUMNWISE_WEIGHTS=0``: every copy quantized apart where it is used, the weights'
column-wise copy made in backward), ``one_kernel`` (both copies of x / dy / dh from one pass
pair; weights still quantized column-wise in backward). The default (both on) is the plain
``grouped_mlp.py`` run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grouped_mlp  # noqa: E402
from common import append_jsonl  # noqa: E402
from fp8_cols_tiles import split_prep, time_ms, weight_cols_args  # noqa: E402

from te_ops.quantization import fp8_triton  # noqa: E402
from te_ops.quantization import quantizer as qmod  # noqa: E402

SHAPE = "E8_T16384_H4096_FF14336"
SAVE_W = "TE_OPS_SAVE_COLUMNWISE_WEIGHTS"
#: Measured on the H200 2026-11-30: the first three (docs/recipes.md); the others are the
#: next candidates for the combined bytes pass (not measured yet).
CONFIGS = [{}, {"CHUNK": 1024}, {"num_warps": 8}, {"TRANS_BYTES": True},
           {"BLOCK_R": 64, "BLOCK_C": 128}, {"BLOCK_R": 64}]


def separate(t: torch.Tensor, prep: tuple | None) -> tuple:
    """Row-wise kernel, then the column-wise pass pair (the library's path before)."""
    rq, rs = fp8_triton.launch_rows(t)
    if prep is None:
        out, args = weight_cols_args(t)
        return rq, rs, out, fp8_triton.launch_cols(*args)
    splits, layout = prep
    g = splits.num_groups
    out = torch.empty(t.shape[1], layout.capacity, dtype=torch.float8_e4m3fn, device=t.device)
    sinv = fp8_triton.launch_cols(t, out, splits.base_offsets[:g], splits.split_sizes,
                                  layout.starts, layout.capacity, 16, 0, layout.capacity, False)
    return rq, rs, out, sinv


def both(t: torch.Tensor, prep: tuple | None, cfg: dict) -> tuple:
    if prep is None:  # (G, N, K) weights
        g, n, k = t.shape
        out, args = weight_cols_args(t)
        sinv, rq, rs = fp8_triton.launch_cols(*args, cfg, with_rows=True)
        return rq.view(g, n, k), rs.view(g, n), out, sinv
    splits, layout = prep
    g = splits.num_groups
    out = torch.empty(t.shape[1], layout.capacity, dtype=torch.float8_e4m3fn, device=t.device)
    sinv, rq, rs = fp8_triton.launch_cols(t, out, splits.base_offsets[:g], splits.split_sizes,
                                          layout.starts, layout.capacity, 16, 0,
                                          layout.capacity, False, cfg, with_rows=True)
    return rq, rs, out, sinv


def same(a: tuple, b: tuple) -> bool:
    def raw(x: torch.Tensor) -> torch.Tensor:
        return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x

    return all(torch.equal(raw(x), raw(y).reshape(x.shape)) for x, y in zip(a, b))


def kernels(iters: int) -> list[dict]:
    p = grouped_mlp.make_problem(SHAPE, grouped_mlp.SHAPES[SHAPE], torch.device("cuda"),
                                 torch.bfloat16, 0)
    w1, _ = p.weights()
    sizes = torch.as_tensor(p.split, device="cuda")
    dh = torch.randn(p.tokens, 2 * p.ffn, device="cuda", dtype=torch.bfloat16)
    operands = {"W1": (w1.detach(), None), "dh": (dh, split_prep(dh, sizes)),
                "x": (p.x.detach(), split_prep(p.x, sizes))}
    lines = []
    for op, (t, prep) in operands.items():
        rec = {"bench": "fp8_both_copies", "operand": op, "setting": "separate",
               "ms": round(time_ms(lambda t=t, pr=prep: separate(t, pr), iters), 4)}
        lines.append(rec)
        print(json.dumps(rec), flush=True)
        for cfg in CONFIGS:
            rec = {"bench": "fp8_both_copies", "operand": op, "setting": "one_kernel",
                   **fp8_triton.COLS_CONFIG, **cfg}
            try:
                ref = separate(t, prep)
                rec["check"] = "ok" if same(both(t, prep, cfg), ref) else "bytes differ"
                del ref
                rec["ms"] = round(time_ms(lambda t=t, pr=prep, c=cfg: both(t, pr, c), iters), 4)
            except Exception as exc:  # noqa: BLE001 - report a setting that does not compile
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            lines.append(rec)
            print(json.dumps(rec), flush=True)
    return lines


def variants(prefix: str) -> None:
    keep = (qmod.BOTH_COPIES_ONE_KERNEL, os.environ.get(SAVE_W))
    try:
        for name, flags in (("separate", (False, "0")), ("one_kernel", (True, "0"))):
            qmod.BOTH_COPIES_ONE_KERNEL, os.environ[SAVE_W] = flags
            grouped_mlp.main(["--shapes", SHAPE, "--peers", "te_ops_fused", "--recipe",
                              "fp8fast", "--iters", "10", "--warmup", "3",
                              "--out", f"{prefix}_{name}.jsonl"])
    finally:
        qmod.BOTH_COPIES_ONE_KERNEL = keep[0]
        if keep[1] is None:
            os.environ.pop(SAVE_W, None)
        else:
            os.environ[SAVE_W] = keep[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None, help="append the kernel JSON lines here")
    parser.add_argument("--variants-out-prefix", default=None,
                        help="also time the block step with the switches off (see above)")
    parser.add_argument("--skip-kernels", action="store_true")
    args = parser.parse_args(argv)
    if args.variants_out_prefix:
        variants(args.variants_out_prefix)
    if not args.skip_kernels:
        append_jsonl(args.out, kernels(args.iters))
    return 0


if __name__ == "__main__":
    sys.exit(main())
