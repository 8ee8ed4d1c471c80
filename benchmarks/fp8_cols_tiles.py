"""Tile settings of the column-wise FP8 quantize kernels (``te_ops/quantization/fp8_triton.py``).

Usage::

    PYTHONPATH=. python benchmarks/fp8_cols_tiles.py --out results.jsonl

For each column-wise setting (``launch_cols``'s ``config``): the bytes and scales must equal
those of the PyTorch reference (``numerics``) on small awkward cases and those of setting 0 on
the big operands; then the time of both passes on the E8 T16384 H4096 FF14336 operands (W1
(8, 28672, 4096) weights; dh (16384, 28672) and x (16384, 4096) split activations, Zipf(1.2)
routing as in ``grouped_mlp.py``) and the effective bandwidth (two reads of the input + one
write of the bytes). Then the row-wise kernel on dh with rows read once (in registers) or twice
(``ROWS_ONE_PASS_MAX``), checked the same way. A setting that fails to compile is reported with
its error. The library's defaults are ``fp8_triton.COLS_CONFIG`` / ``ROWS_ONE_PASS_MAX``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import append_jsonl  # noqa: E402
from grouped_mlp import SHAPES, make_problem  # noqa: E402

from te_ops.quantization import fp8_triton, numerics  # noqa: E402
from te_ops.quantization.layout import column_layout  # noqa: E402
from te_ops.splits import make_splits  # noqa: E402

_BASE = {"CHUNK": 512, "BLOCK_R": 128, "BLOCK_C": 64, "num_warps": 4, "TRANS_BYTES": True,
         "COLS_FIRST": True}
SETTINGS = [_BASE] + [{**_BASE, **change} for change in (
    {"COLS_FIRST": False},
    {"CHUNK": 1024},
    {"CHUNK": 256},
    {"TRANS_BYTES": False},
    {"BLOCK_R": 256, "num_warps": 8},
    {"CHUNK": 1024, "BLOCK_R": 256, "num_warps": 8},
    {"BLOCK_C": 128, "num_warps": 8},
    {"BLOCK_R": 64, "BLOCK_C": 128},
)]


def split_prep(x: torch.Tensor, sizes: torch.Tensor) -> tuple:
    """Splits and 16-row aligned layout of split activations (built once, outside timing)."""
    splits = make_splits(sizes, sizes.numel(), x.shape[0], x.device)
    return splits, column_layout(splits.split_sizes, splits.base_offsets, x.shape[0], 16)


def split_case(x: torch.Tensor, prep: tuple, cfg: dict) -> tuple:
    """Column-wise copy of split activations into the 16-row aligned layout."""
    splits, layout = prep
    g = splits.num_groups
    out = torch.empty(x.shape[1], layout.capacity, dtype=torch.float8_e4m3fn, device=x.device)
    sinv = fp8_triton.launch_cols(x, out, splits.base_offsets[:g], splits.split_sizes,
                                  layout.starts, layout.capacity, 16, 0, layout.capacity, False,
                                  cfg)
    return out, sinv


def weight_cols_args(w: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """(G, N, K) weights -> (the (G, K, N) FP8 buffer of their column-wise copy,
    ``fp8_triton.launch_cols``'s positional arguments that write it: one group per expert)."""
    g, n, k = w.shape
    out = torch.empty(g, k, n, dtype=torch.float8_e4m3fn, device=w.device)
    starts = torch.arange(g, device=w.device, dtype=torch.int64) * n
    return out, (w.reshape(g * n, k), out, starts, torch.full_like(starts, n), starts, g * n,
                 4 if n % 4 == 0 else 1, k * n, n, True)


def uniform_case(w: torch.Tensor, cfg: dict) -> tuple:
    """Column-wise copy of (G, N, K) weights: (G, K, N)."""
    out, args = weight_cols_args(w)
    return out, fp8_triton.launch_cols(*args, cfg)


def check(cfg: dict) -> str | None:
    """None when ``cfg`` writes the reference bytes on small awkward cases, else what differs."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(5000, 200, device=dev, generator=gen) * 7
    x[5, 3], x[77, 9] = float("nan"), float("-inf")
    sizes = torch.tensor([1500, 0, 33, 2047, 1, 0, 900, 400], device=dev)  # 4881 + padding
    splits, layout = prep = split_prep(x, sizes)
    out, sinv = split_case(x, prep, cfg)
    q = torch.zeros(200, layout.capacity, dtype=torch.uint8, device=dev)
    for g, (s0, n) in enumerate(zip(splits.base_offsets.tolist(), sizes.tolist())):
        p0 = int(layout.starts[g])
        if n:
            d, si = numerics.fp8_quantize_rows(x[s0:s0 + n].t().contiguous())
            q[:, p0:p0 + n] = d.view(torch.uint8)
            if not torch.equal(sinv[g], si):
                return f"split scale_inv of group {g}"
        elif not torch.equal(sinv[g], torch.ones_like(sinv[g])):
            return f"split scale_inv of empty group {g}"
    if not torch.equal(out.view(torch.uint8), q):
        return "split bytes"
    w = torch.randn(3, 200, 96, device=dev, generator=gen, dtype=torch.bfloat16)
    wout, wsinv = uniform_case(w, cfg)
    rd, rs = numerics.fp8_quantize_rows(w.transpose(-2, -1).contiguous())
    if not (torch.equal(wout.view(torch.uint8), rd.view(torch.uint8)) and torch.equal(wsinv, rs)):
        return "weight bytes / scales"
    return None


def rows_settings(dh: torch.Tensor, iters: int) -> list[dict]:
    """Row-wise kernel on dh (rows of 28672): one read (row in registers) or two."""
    gen = torch.Generator(device=dh.device).manual_seed(2)
    small = torch.randn(64, 20000, device=dh.device, generator=gen, dtype=torch.bfloat16) * 3
    small[1, 7], small[2, 19999] = float("nan"), float("inf")
    ref_small = numerics.fp8_quantize_rows(small)
    keep = fp8_triton.ROWS_ONE_PASS_MAX
    out, ref = [], None
    try:
        for one_pass_max in (16384, 32768):
            fp8_triton.ROWS_ONE_PASS_MAX = one_pass_max
            rec = {"bench": "fp8_rows_one_pass", "ONE_PASS_MAX": one_pass_max}
            try:
                d, s = fp8_triton.fp8_rows(small)
                ok = torch.equal(d.view(torch.uint8), ref_small[0].view(torch.uint8)) and \
                    torch.equal(s, ref_small[1])
                d, s = fp8_triton.fp8_rows(dh)
                if ref is None:
                    ref = (d.view(torch.uint8).clone(), s.clone())
                ok = ok and torch.equal(d.view(torch.uint8), ref[0]) and torch.equal(s, ref[1])
                rec["check"] = "ok" if ok else "bytes differ"
                ms = time_ms(lambda: fp8_triton.fp8_rows(dh), iters)
                rec["dh_ms"] = round(ms, 4)
                rec["dh_GBps"] = round(dh.numel() * 3 / ms / 1e6, 1)
            except Exception as exc:  # noqa: BLE001 - report a setting that does not compile
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(json.dumps(rec), flush=True)
            out.append(rec)
    finally:
        fp8_triton.ROWS_ONE_PASS_MAX = keep
    return out


def time_ms(fn, iters: int) -> float:
    times = []
    for _ in range(iters + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None, help="append JSON lines to this file")
    args = parser.parse_args(argv)
    name = "E8_T16384_H4096_FF14336"
    p = make_problem(name, SHAPES[name], torch.device("cuda"), torch.bfloat16, 0)
    w1, _ = p.weights()
    sizes = torch.as_tensor(p.split, device="cuda")
    dh = torch.randn(p.tokens, 2 * p.ffn, device="cuda", dtype=torch.bfloat16)
    operands = {"W1": (w1, None), "dh": (dh, split_prep(dh, sizes)),
                "x": (p.x.detach(), split_prep(p.x, sizes))}
    ref = {}
    lines = []
    for i, cfg in enumerate(SETTINGS):
        rec = {"bench": "fp8_cols_tiles", **cfg}
        try:
            rec["check"] = check(cfg) or "ok"
            for op, (t, prep) in operands.items():
                run = (lambda t=t, pr=prep, c=cfg: split_case(t, pr, c)) if prep is not None \
                    else (lambda t=t, c=cfg: uniform_case(t, c))
                data, sinv = run()
                if i == 0:
                    ref[op] = (data.view(torch.uint8).clone(), sinv.clone())
                elif not (torch.equal(data.view(torch.uint8), ref[op][0])
                          and torch.equal(sinv, ref[op][1])):
                    rec["check"] = f"{op} differs from setting 0"
                del data, sinv
                ms = time_ms(run, args.iters)
                rec[f"{op}_ms"] = round(ms, 4)
                rec[f"{op}_GBps"] = round(t.numel() * (2 * t.element_size() + 1) / ms / 1e6, 1)
        except Exception as exc:  # noqa: BLE001 - report the setting that does not compile
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps(rec), flush=True)
        lines.append(rec)
    lines += rows_settings(dh, args.iters)
    append_jsonl(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
