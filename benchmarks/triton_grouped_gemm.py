"""Per-GEMM speed of te_ops' Triton grouped GEMMs against ``torch._grouped_mm`` (CUDA).

For the fc1 (N = 2·FF, K = H) and fc2 (N = H, K = FF) layers of the E64 and E128 H2048 FF768
MoE blocks, and mean rows per group 1..64 (``--rows``) (``M = rows·G`` tokens routed with the same
Zipf(1.2) skew as ``benchmarks/grouped_mlp.py``), times fprop, dgrad and wgrad of both
backends. Each timing is ``triton.testing.do_bench_cudagraph`` (the calls replayed from a
CUDA graph, so host launch cost is excluded, as in the graphed block), median in ms. Also
records the weight bytes per call over the time (GB/s; fprop/dgrad read the W_g of non-empty
groups only, so at 1-2 rows per group this exceeds the HBM bandwidth; wgrad writes all dW)
and the largest difference between the two backends' outputs.

``--sweep`` times launch configurations of the Triton kernels on one shape instead (used to
pick :func:`te_ops.gemm.grouped_gemm_triton.rows_config` / ``wgrad_config``).
``--sweep-decode`` times a short list of variants (``SPLIT``, tiles, warps, stages) of the
configuration the dispatch picks now for each of the six GEMMs of the E64 decode step (mean
``--rows`` rows per expert, 4 by default: T256), against that configuration, and records
whether each variant's output equals it bit for bit (``bitwise_equal``).

Usage::

    python benchmarks/triton_grouped_gemm.py [--rows 1,2,4,...] [--out FILE]
    python benchmarks/triton_grouped_gemm.py --sweep --rows 4 [--out FILE]
    python benchmarks/triton_grouped_gemm.py --sweep-decode --rows 4 [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import append_jsonl, machine_info  # noqa: E402
from grouped_mlp import skewed_sizes  # noqa: E402

from te_ops.gemm import grouped_gemm_triton as tg  # noqa: E402

SHAPES = {"E64_H2048_FF768": (64, 2048, 768), "E128_H2048_FF768": (128, 2048, 768)}
ROWS = [1, 2, 4, 8, 16, 32, 64]


def _bench(fn) -> float:
    import triton.testing
    return float(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median"))


def _operands(groups: int, n: int, k: int, rows: int, seed: int):
    dev = torch.device("cuda")
    sizes = skewed_sizes(groups, rows * groups, seed)
    offs = torch.cumsum(torch.tensor(sizes, device=dev), 0).to(torch.int32)
    m = sum(sizes)
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(groups, n, k, device=dev, dtype=torch.bfloat16, generator=gen)
         * k ** -0.5)
    return x, dy, w, offs, max(sizes)


def _calls(x, dy, w, offs, configs=None):
    rows_cfg, wgrad_cfg = configs or (None, None)
    return {
        "fprop": (lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
                  lambda: tg.triton_fprop(x, w, offs, rows_cfg)),
        "dgrad": (lambda: torch._grouped_mm(dy, w, offs=offs),
                  lambda: tg.triton_dgrad(dy, w, offs, rows_cfg)),
        "wgrad": (lambda: torch._grouped_mm(dy.t(), x, offs=offs),
                  lambda: tg.triton_wgrad(x, dy, offs, wgrad_cfg)),
    }


def compare(args: argparse.Namespace) -> list[dict]:
    records = []
    for shape, (groups, hidden, ffn) in SHAPES.items():
        for layer, (n, k) in (("fc1", (2 * ffn, hidden)), ("fc2", (hidden, ffn))):
            for rows in args.rows:
                x, dy, w, offs, max_rows = _operands(groups, n, k, rows, args.seed)
                for kind, (ref, tri) in _calls(x, dy, w, offs).items():
                    diff = (ref().float() - tri().float()).abs().max().item()
                    t_mm, t_tri = _bench(ref), _bench(tri)
                    gb = w.numel() * w.element_size() / 1e9
                    m = x.shape[0]
                    cfg = (tg.wgrad_config(m / groups, n, k) if kind == "wgrad" else
                           tg.rows_config(kind, m / groups, n if kind == "fprop" else k, groups,
                                          m))
                    rec = {"bench": "triton_grouped_gemm", "shape": shape, "layer": layer,
                           "kind": kind, "groups": groups, "N": n, "K": k,
                           "rows_per_group": rows, "max_rows": max_rows,
                           "grouped_mm_ms": round(t_mm, 5), "triton_ms": round(t_tri, 5),
                           "speedup": round(t_mm / t_tri, 3),
                           "triton_GBps": round(gb / t_tri * 1e3, 1),
                           "grouped_mm_GBps": round(gb / t_mm * 1e3, 1),
                           "max_abs_diff": diff, "triton_config": cfg}
                    print(json.dumps(rec), flush=True)
                    records.append(rec)
                del x, dy, w
    return records


def sweep(args: argparse.Namespace) -> list[dict]:
    records = []
    groups, hidden, ffn = SHAPES["E64_H2048_FF768"]
    for layer, (n, k) in (("fc1", (2 * ffn, hidden)), ("fc2", (hidden, ffn))):
        for rows in args.rows:
            x, dy, w, offs, _ = _operands(groups, n, k, rows, args.seed)
            bm = [16] if rows <= 16 else [32, 64]
            for block_m, bj, br, warps, stages in itertools.product(
                    bm, [32, 64, 128], [64, 128, 256], [4], [3, 4]):
                cfg = {"BLOCK_M": block_m, "BLOCK_J": bj, "BLOCK_R": br,
                       "num_warps": warps, "num_stages": stages}
                for kind in ("fprop", "dgrad"):
                    fn = _calls(x, dy, w, offs, (cfg, None))[kind][1]
                    records.append(_sweep_rec(layer, kind, rows, cfg, fn))
            for block_m, bn, bk, warps, stages in itertools.product(
                    bm, [32, 64, 128], [64, 128, 256], [4], [2, 3]):
                cfg = {"BLOCK_M": block_m, "BLOCK_N": bn, "BLOCK_K": bk,
                       "num_warps": warps, "num_stages": stages}
                fn = _calls(x, dy, w, offs, (None, cfg))["wgrad"][1]
                records.append(_sweep_rec(layer, "wgrad", rows, cfg, fn))
    return [r for r in records if r is not None]


def _decode_variants(kind: str, base: dict[str, int]) -> list[dict[str, int]]:
    """The configurations ``--sweep-decode`` tries beside ``base`` (the current one)."""
    if kind == "wgrad":
        tiles = [{"BLOCK_N": 128, "BLOCK_K": 64}, {"BLOCK_N": 32, "BLOCK_K": 256},
                 {"BLOCK_N": 64, "BLOCK_K": 256}, {"BLOCK_N": 128, "BLOCK_K": 128}]
    else:
        tiles = [{"BLOCK_J": 64, "BLOCK_R": 128}, {"BLOCK_J": 128, "BLOCK_R": 64},
                 {"BLOCK_J": 32, "BLOCK_R": 128}, {"SPLIT": 1}, {"SPLIT": 2},
                 {"BLOCK_J": 16, "BLOCK_R": 256}]
    other = [{"num_warps": 2}, {"num_warps": 8}, {"num_stages": 2}, {"num_stages": 4}]
    return [{**base, **v} for v in tiles + other]


def sweep_decode(args: argparse.Namespace) -> list[dict]:
    """Variants of the dispatch's configuration for each GEMM of the E64 decode step."""
    records = []
    groups, hidden, ffn = SHAPES["E64_H2048_FF768"]
    for layer, (n, k) in (("fc1", (2 * ffn, hidden)), ("fc2", (hidden, ffn))):
        for rows in args.rows:
            operands = _operands(groups, n, k, rows, args.seed)[:4]
            for kind in ("fprop", "dgrad", "wgrad"):
                records += _decode_kind(layer, kind, rows, operands)
            del operands
    return records


def _decode_kind(layer: str, kind: str, rows: int, operands) -> list[dict]:
    x, dy, w, offs = operands
    groups, m = w.shape[0], x.shape[0]
    n, k = dy.shape[1], x.shape[1]
    if kind == "wgrad":
        base = tg.wgrad_config(m / groups, n, k)
    else:
        base = tg.rows_config(kind, m / groups, n if kind == "fprop" else k, groups, m)

    def call(cfg):
        pair = (None, cfg) if kind == "wgrad" else (cfg, None)
        return _calls(x, dy, w, offs, pair)[kind][1]

    ref = call(base)()
    t_base = _bench(call(base))
    records = []
    for cfg in [base] + _decode_variants(kind, base):
        rec = _sweep_rec(layer, kind, rows, cfg, call(cfg))
        if rec is None:
            continue
        rec.update(bench="triton_grouped_gemm_sweep_decode", current=cfg == base,
                   base_ms=round(t_base, 5), vs_base=round(t_base / rec["ms"], 3),
                   bitwise_equal=bool(torch.equal(call(cfg)(), ref)))
        print(json.dumps(rec), flush=True)
        records.append(rec)
    return records


def _sweep_rec(layer: str, kind: str, rows: int, cfg: dict, fn) -> dict | None:
    try:
        t = _bench(fn)
    except Exception as exc:  # a config that does not compile (shared memory) is skipped
        print(f"skip {layer} {kind} {cfg}: {str(exc).splitlines()[0][:120]}", flush=True)
        return None
    rec = {"bench": "triton_grouped_gemm_sweep", "layer": layer, "kind": kind,
           "rows_per_group": rows, **cfg, "ms": round(t, 5)}
    print(json.dumps(rec), flush=True)
    return rec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(map(str, ROWS)),
                        help="mean rows per group, comma-separated")
    parser.add_argument("--sweep", action="store_true", help="time launch configurations")
    parser.add_argument("--sweep-decode", action="store_true",
                        help="time variants of the current configurations (E64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also append JSON lines to this file")
    args = parser.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",")]
    if not torch.cuda.is_available():
        print("triton_grouped_gemm: needs CUDA", file=sys.stderr)
        return 1
    records = (sweep_decode(args) if args.sweep_decode else sweep(args) if args.sweep
               else compare(args))
    info = machine_info(torch.device("cuda"))
    append_jsonl(args.out, [{**r, **info} for r in records])
    return 0


if __name__ == "__main__":
    sys.exit(main())
