"""Pass-2 (column-wise bytes) and weight row-wise + column-amax kernel variants (H200).

Usage::

    PYTHONPATH=. python benchmarks/fp8q_variants.py --out results.jsonl

Operands of one E8 T16384 H4096 FF14336 fp8 step, as in ``benchmarks/fp8_pass_variants.py``.
Part 1, ``fp8_triton.launch_cols`` pass 2 under ``config`` variants (``PACK4``: four
destination rows packed into one 32-bit word before the in-register transpose): bytes and
scales must equal variant 0's (the library default), each pass's kernel time from
``torch.profiler``. Part 2, ``fp8_triton.fp8_rows_column_amax`` on W1 / W2 under
``ROWS_COLAMAX_SETTINGS`` variants: bytes, scales and column amax checked against
``fp8_rows`` and a float reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import append_jsonl  # noqa: E402
from fp8_cols_tiles import split_prep  # noqa: E402
from fp8_pass_variants import kernel_ms, pass_times, run_case, same  # noqa: E402
from grouped_mlp import SHAPES, make_problem  # noqa: E402

from te_ops.quantization import fp8_triton  # noqa: E402

#: Variant 0: the byte-wise pass 2 (the settings before PACK4), the reference for the bytes;
#: variant 1 the library default (``fp8_triton.COLS_CONFIG``).
QUANT_VARIANTS: list[dict] = [
    {"PACK4": False, "COLS_ONLY": {}},
    {},
    {"COLS_ONLY": {"BLOCK_R": 256, "CHUNK": 2048}},
    {"CHUNK": 2048},
    {"COLS_ONLY": {"BLOCK_R": 512}},
    {"PACK4": True, "BLOCK_R": 256, "BLOCK_C": 32, "COLS_ONLY": {}},
    {"PACK4": False, "BLOCK_R": 256, "BLOCK_C": 32, "COLS_ONLY": {}},
]

#: ``fp8_triton.ROWS_COLAMAX_SETTINGS`` variants: (largest BLOCK_K, rows per program, tile).
ROWS_VARIANTS: list[tuple[tuple[int, int, int], ...]] = [
    ((32768, 32, 1),),
    ((8192, 64, 2), (32768, 32, 1)),
    ((8192, 128, 2), (32768, 32, 1)),
    ((8192, 64, 4), (32768, 64, 1)),
    ((8192, 128, 4), (32768, 16, 1)),
]


def quant_variants(cases: dict, iters: int) -> list[dict]:
    ref: dict[str, tuple] = {}
    lines = []
    for i, cfg in enumerate(QUANT_VARIANTS):
        rec: dict = {"bench": "fp8q_quant", "variant": i, "config": cfg, "check": "ok"}
        try:
            tot = 0.0
            for op, (t, prep, rows) in cases.items():
                # the default config's pass 1 gives the amax; pass 2 alone is timed
                res = run_case(t, prep, rows, cfg)
                if i == 0:
                    ref[op] = tuple(r.clone() for r in res)
                elif not same(res, ref[op]):
                    rec["check"] = f"{op} differs from variant 0"
                    rec[f"{op}_differing"] = [
                        int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
                        if a.dtype == torch.float8_e4m3fn else int((a != b).sum())
                        for a, b in zip(res, ref[op])]
                del res
                ms = pass_times(lambda t=t, pr=prep, r=rows, c=cfg: run_case(t, pr, r, c),
                                iters)["quant"]
                moved = t.numel() * (t.element_size() + (2 if rows else 1))
                rec[f"{op}_quant_ms"] = round(ms, 4)
                rec[f"{op}_quant_TBps"] = round(moved / ms / 1e9, 2)
                tot += ms
            rec["quant_ms"] = round(tot, 4)
        except Exception as exc:  # noqa: BLE001 - report a variant that does not compile
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
        print(json.dumps(rec), flush=True)
        lines.append(rec)
    return lines


def rows_variants(ws: dict[str, torch.Tensor], iters: int) -> list[dict]:
    lines = []
    saved = fp8_triton.ROWS_COLAMAX_SETTINGS
    refs = {}
    for op, w in ws.items():
        d0, s0 = fp8_triton.fp8_rows(w)
        amax0 = w.float().abs().amax(1)  # finite inputs: the largest magnitude per (g, k)
        refs[op] = (d0.view(torch.uint8), s0, amax0)
    try:
        for i, settings in enumerate(ROWS_VARIANTS):
            fp8_triton.ROWS_COLAMAX_SETTINGS = settings
            rec: dict = {"bench": "fp8q_rows_colamax", "variant": i,
                         "settings": [list(t) for t in settings], "check": "ok"}
            try:
                for op, w in ws.items():
                    d, s, a = fp8_triton.fp8_rows_column_amax(w)
                    d0, s0, a0 = refs[op]
                    if not (torch.equal(d.view(torch.uint8), d0) and torch.equal(s, s0)
                            and torch.equal(a, a0)):
                        rec["check"] = f"{op} differs"
                    del d, s, a
                    ms = kernel_ms(lambda w=w: fp8_triton.fp8_rows_column_amax(w),
                                   ("_fp8_rows_colamax_kernel",), iters)
                    rec[f"{op}_ms"] = round(ms, 4)
                    rec[f"{op}_TBps"] = round(w.numel() * 3 / ms / 1e9, 2)
            except Exception as exc:  # noqa: BLE001
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
            print(json.dumps(rec), flush=True)
            lines.append(rec)
    finally:
        fp8_triton.ROWS_COLAMAX_SETTINGS = saved
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--part", default="both", choices=("both", "quant", "rows"))
    parser.add_argument("--out", default=None, help="append JSON lines to this file")
    args = parser.parse_args(argv)
    name = "E8_T16384_H4096_FF14336"
    p = make_problem(name, SHAPES[name], torch.device("cuda"), torch.bfloat16, 0)
    w1, w2 = (w.detach() for w in p.weights())
    lines = []
    if args.part in ("both", "rows"):
        lines += rows_variants({"W1": w1, "W2": w2}, args.iters)
    if args.part in ("both", "quant"):
        sizes = torch.as_tensor(p.split, device="cuda")
        gen = torch.Generator(device="cuda").manual_seed(3)
        dh = torch.randn(p.tokens, 2 * p.ffn, device="cuda", dtype=torch.bfloat16,
                         generator=gen)
        a = torch.randn(p.tokens, p.ffn, device="cuda", dtype=torch.bfloat16, generator=gen)
        x = p.x.detach()
        cases = {"W1": (w1, None, False), "W2": (w2, None, False),
                 "x": (x, split_prep(x, sizes), True),
                 "dy": (p.dy, split_prep(p.dy, sizes), True),
                 "a": (a, split_prep(a, sizes), False),
                 "dh": (dh, split_prep(dh, sizes), True)}
        lines += quant_variants(cases, args.iters)
    append_jsonl(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
