"""Pass-by-pass times of the column-wise FP8 quantize kernels under launch variants.

Usage::

    PYTHONPATH=. python benchmarks/fp8_pass_variants.py --out results.jsonl

Every quantize pass pair of one E8 T16384 H4096 FF14336 fp8 step (default settings:
``TE_OPS_SAVE_COLUMNWISE_WEIGHTS=0``), on inputs of the step's shapes: W1 (8, 28672, 4096) and
W2 (8, 4096, 14336) weights (column-wise copy, backward), x (16384, 4096) and dy (16384, 4096)
split (both copies), a (16384, 14336) split (column-wise copy, fc2's wgrad input) and dh
(16384, 28672) split (both copies). For each variant of ``fp8_triton.launch_cols``'s
``config`` (``PREFETCH``: each tile's load issued one tile ahead; ``AMAX``: other tiles for
pass 1 alone), the bytes and scales must equal the default's (which ``benchmarks/
fp8_cols_tiles.py`` and ``tests/test_quantization_cuda.py`` check against the PyTorch
reference); each pass's kernel time comes from ``torch.profiler`` (mean over ``--iters``
calls) with its streaming rate (pass 1: one read; pass 2: one read + the bytes written).
Then the forward's row-wise quantize of W1 / W2: the row-wise kernel against the row-wise +
column-amax kernel (``fp8_triton.fp8_rows_column_amax``), and backward's column-wise copy
from that amax (pass 2 alone), bytes checked against both passes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import append_jsonl  # noqa: E402
from fp8_cols_tiles import split_prep, weight_cols_args  # noqa: E402
from grouped_mlp import SHAPES, make_problem  # noqa: E402

from te_ops.quantization import fp8_triton  # noqa: E402

#: Variant 0 is the library's default (``fp8_triton.COLS_CONFIG``); ``--set before`` times the
#: settings measured before PREFETCH / separate pass-1 tiles (2026-11-30 run 1), ``--set more``
#: the ones tried after.
VARIANT_SETS: dict[str, list[dict]] = {
    "before": [
        {"CHUNK": 512, "PREFETCH": False},
        {"CHUNK": 512, "PREFETCH": True},
        {"CHUNK": 512, "AMAX": {"BLOCK_C": 128, "BLOCK_R": 64}},
        {"CHUNK": 512, "AMAX": {"BLOCK_C": 256, "BLOCK_R": 32}},
        {"CHUNK": 512, "AMAX": {"CHUNK": 1024, "PREFETCH": True}},
        {"CHUNK": 512, "PREFETCH": True, "BLOCK_R": 64},
        {"PREFETCH": True, "CHUNK": 1024},
        {"PREFETCH": True, "BLOCK_C": 128, "BLOCK_R": 64, "num_warps": 8},
    ],
    "more": [
        {},
        {"TRANS_BYTES": True},
        {"CHUNK": 2048},
        {"num_warps": 8},
        {"BLOCK_C": 32},
        {"AMAX": {"CHUNK": 2048}},
        {"PREFETCH": False, "AMAX": {"PREFETCH": True}},
    ],
}


def run_case(t: torch.Tensor, prep, with_rows: bool, cfg: dict) -> tuple:
    """One pass pair on ``t`` (weights (G, N, K) when ``prep`` is None, else split)."""
    if prep is None:
        out, args = weight_cols_args(t)
        res = fp8_triton.launch_cols(*args, cfg, with_rows=with_rows)
    else:
        splits, layout = prep
        g = splits.num_groups
        out = torch.empty(t.shape[1], layout.capacity, dtype=torch.float8_e4m3fn,
                          device=t.device)
        res = fp8_triton.launch_cols(t, out, splits.base_offsets[:g], splits.split_sizes,
                                     layout.starts, layout.capacity, 16, 0, layout.capacity,
                                     False, cfg, with_rows=with_rows)
    return (out,) + (res if with_rows else (res,))


def same(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                           y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y)
               for x, y in zip(a, b))


def _kernel_times(fn, iters: int) -> dict[str, float]:
    """Mean CUDA time (ms) per call of ``fn`` of each kernel it launches, by kernel name."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return {ev.key: ev.device_time_total / 1e3 / iters for ev in prof.key_averages()}


def pass_times(fn, iters: int) -> dict[str, float]:
    """Mean CUDA time (ms) per call of each kernel of ``fn``."""
    times = _kernel_times(fn, iters)
    return {key: times[name] for key, name in (("amax", "_fp8_cols_amax_kernel"),
                                               ("quant", "_fp8_cols_quant_kernel"))
            if name in times}


def kernel_ms(fn, names: tuple[str, ...], iters: int) -> float:
    """Mean CUDA time (ms) per call of ``fn`` summed over the kernels named ``names``."""
    return sum(ms for key, ms in _kernel_times(fn, iters).items() if key in names)


def weight_rows(ws: dict[str, torch.Tensor], iters: int) -> list[dict]:
    """Forward's row-wise weights quantize: the row-wise kernel alone, and the row-wise +
    column-amax kernel (bytes checked equal); then backward's column-wise copy from that amax
    (pass 2 alone) against both passes."""
    lines = []
    for op, w in ws.items():
        rec: dict = {"bench": "fp8_weight_rows", "operand": op, "shape": list(w.shape)}
        d0, s0 = fp8_triton.fp8_rows(w)
        d1, s1, amax = fp8_triton.fp8_rows_column_amax(w)
        rec["check"] = "ok" if (torch.equal(d0.view(torch.uint8), d1.view(torch.uint8))
                                and torch.equal(s0, s1)) else "bytes differ"
        del d0, s0, d1, s1
        rd = w.numel() * w.element_size()
        rec["rows_ms"] = round(kernel_ms(lambda w=w: fp8_triton.fp8_rows(w),
                                         ("_fp8_rows_kernel",), iters), 4)
        rec["rows_colamax_ms"] = round(kernel_ms(
            lambda w=w: fp8_triton.fp8_rows_column_amax(w), ("_fp8_rows_colamax_kernel",),
            iters), 4)
        rec["rows_TBps"] = round((rd + w.numel()) / rec["rows_ms"] / 1e9, 2)
        rec["rows_colamax_TBps"] = round((rd + w.numel()) / rec["rows_colamax_ms"] / 1e9, 2)
        ref = run_case(w, None, False, {})
        out, args = weight_cols_args(w)

        def given(out=out, args=args, amax=amax):
            return (out, fp8_triton.launch_cols(*args, amax=amax))
        got = given()
        if not same(got, ref):
            rec["check"] = "column copy from the given amax differs"
        rec["cols_given_amax_ms"] = round(kernel_ms(given, ("_fp8_cols_quant_kernel",
                                                            "_fp8_cols_amax_kernel"), iters), 4)
        print(json.dumps(rec), flush=True)
        lines.append(rec)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--set", default="more", choices=list(VARIANT_SETS))
    parser.add_argument("--out", default=None, help="append JSON lines to this file")
    args = parser.parse_args(argv)
    name = "E8_T16384_H4096_FF14336"
    p = make_problem(name, SHAPES[name], torch.device("cuda"), torch.bfloat16, 0)
    w1, w2 = p.weights()
    sizes = torch.as_tensor(p.split, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    dh = torch.randn(p.tokens, 2 * p.ffn, device="cuda", dtype=torch.bfloat16, generator=gen)
    a = torch.randn(p.tokens, p.ffn, device="cuda", dtype=torch.bfloat16, generator=gen)
    x = p.x.detach()
    cases = {"W1": (w1.detach(), None, False), "W2": (w2.detach(), None, False),
             "x": (x, split_prep(x, sizes), True), "dy": (p.dy, split_prep(p.dy, sizes), True),
             "a": (a, split_prep(a, sizes), False), "dh": (dh, split_prep(dh, sizes), True)}
    ref: dict[str, tuple] = {}
    lines = []
    for i, cfg in enumerate(VARIANT_SETS[args.set]):
        rec: dict = {"bench": "fp8_pass_variants", "set": args.set, "variant": i,
                     "config": cfg, "check": "ok"}
        try:
            tot = {"amax": 0.0, "quant": 0.0}
            for op, (t, prep, rows) in cases.items():
                res = run_case(t, prep, rows, cfg)
                if i == 0:
                    ref[op] = tuple(r.clone() for r in res)
                elif not same(res, ref[op]):
                    rec["check"] = f"{op} differs from the default"
                del res
                ms = pass_times(lambda t=t, pr=prep, r=rows, c=cfg: run_case(t, pr, r, c),
                                args.iters)
                read = t.numel() * t.element_size()
                written = t.numel() * (2 if rows else 1)
                for key in ("amax", "quant"):
                    rec[f"{op}_{key}_ms"] = round(ms[key], 4)
                    tot[key] += ms[key]
                rec[f"{op}_amax_TBps"] = round(read / ms["amax"] / 1e9, 2)
                rec[f"{op}_quant_TBps"] = round((read + written) / ms["quant"] / 1e9, 2)
            rec["amax_ms"] = round(tot["amax"], 4)
            rec["quant_ms"] = round(tot["quant"], 4)
        except Exception as exc:  # noqa: BLE001 - report a variant that does not compile
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        print(json.dumps(rec), flush=True)
        lines.append(rec)
    lines += weight_rows({"W1": w1.detach(), "W2": w2.detach()}, args.iters)
    append_jsonl(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
