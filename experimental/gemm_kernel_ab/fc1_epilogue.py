"""fc1's grouped fprop with the SwiGLU in its epilogue against the two launches it replaces (CUDA).

For fc1 of the E64 and E128 H2048 FF768 MoE blocks (N = 2·FF, K = H) and mean rows per group
``--rows`` (Zipf(1.2)-skewed routing as ``benchmarks/grouped_mlp.py``), times, with probs
(ScaledSwiGLU):

* ``fused``: ``grouped_mlp_triton.fc1_swiglu`` (one launch, ``h`` and ``a``);
* ``two_triton``: Triton fprop (``grouped_gemm_triton.triton_fprop``) then the Triton SwiGLU
  forward (what the fused forward runs without the epilogue kernel when fc1's fprop is in
  Triton);
* ``two_triton_split8``: the same with the plain fprop's ``SPLIT`` raised to 8 (the fused
  kernel's; is the gain the fusion's or the split's?);
* ``two_grouped_mm``: ``torch._grouped_mm`` then the Triton SwiGLU (the dispatch's choice above
  ``MAX_ROWS_PER_GROUP["fprop"]`` rows per group).

``*_graph_ms``: ``triton.testing.do_bench_cudagraph`` median (host launch cost excluded, as in a
graphed step); ``*_eager_ms``: host wall time per call of eager back-to-back calls (median of 15
runs of 50 calls, synchronized at the end of each run: the launch cost counts, as in the eager
decode step). ``h_equal`` / ``a_equal``: the fused outputs equal ``two_triton``'s bit for bit.
``--sweep`` times launch variants of the fused kernel (``VARIANTS``: ``BLOCK_J``, ``SPLIT``,
``BLOCK_R``; the row tile stays the plain fprop's) against the two launches on E64 and E128,
then ``--rounds`` interleaved timings of the best bitwise-equal variant, the current
configuration and the two launches (``fc1_epilogue_ab`` records).

Usage::

    python benchmarks/fc1_epilogue.py [--rows 1,2,4,8,16,32] [--out FILE]
    python benchmarks/fc1_epilogue.py --sweep --rows 2,4,8 [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))  # common.py
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import append_jsonl, check_min, machine_info  # noqa: E402
from grouped_mlp import skewed_sizes  # noqa: E402

from te_ops.gemm import grouped_gemm_triton as tg  # noqa: E402
from te_ops.gemm import grouped_mlp_triton as gm  # noqa: E402
from te_ops.kernels import swiglu_triton as st  # noqa: E402

SHAPES = {"E64_H2048_FF768": (64, 2048, 768), "E128_H2048_FF768": (128, 2048, 768)}
ROWS = [1, 2, 4, 8, 16, 32]


def _graph(fn) -> float:
    import triton.testing
    return float(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median"))


def _eager(fn, calls: int = 50, runs: int = 15) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e3)
    return statistics.median(times)


def _operands(groups: int, hidden: int, ffn: int, rows: int, seed: int):
    dev = torch.device("cuda")
    sizes = skewed_sizes(groups, rows * groups, seed)
    offs = torch.cumsum(torch.tensor(sizes, device=dev), 0).to(torch.int32)
    m = sum(sizes)
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(groups, 2 * ffn, hidden, device=dev, dtype=torch.bfloat16, generator=gen)
         * hidden ** -0.5)
    probs = torch.rand(m, device=dev, generator=gen)
    return x, w, offs, probs


def _calls(x, w, offs, probs, config=None) -> dict:
    def two_triton():
        h = tg.triton_fprop(x, w, offs)
        return h, st.swiglu_forward(h, probs)

    m, groups = x.shape[0], w.shape[0]
    split8 = {**tg.rows_config("fprop", m / groups, w.shape[1], groups, m),
              "SPLIT": max(1, min(8, -(-m // 16)))}

    def two_triton_split8():
        h = tg.triton_fprop(x, w, offs, split8)
        return h, st.swiglu_forward(h, probs)

    def two_grouped_mm():
        h = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        return h, st.swiglu_forward(h, probs)

    return {"fused": lambda: gm.fc1_swiglu(x, w, offs, probs, config),
            "two_triton": two_triton, "two_triton_split8": two_triton_split8,
            "two_grouped_mm": two_grouped_mm}


def compare(args: argparse.Namespace) -> list[dict]:
    records = []
    for shape, (groups, hidden, ffn) in SHAPES.items():
        for rows in args.rows:
            x, w, offs, probs = _operands(groups, hidden, ffn, rows, args.seed)
            calls = _calls(x, w, offs, probs)
            (h, a), (h0, a0) = calls["fused"](), calls["two_triton"]()
            rec = {"bench": "fc1_epilogue", "shape": shape, "rows_per_group": rows,
                   "tokens": x.shape[0], "h_equal": bool(torch.equal(h, h0)),
                   "a_equal": bool(torch.equal(a, a0)),
                   "config": gm.fc1_swiglu_config(x.shape[0] / groups, ffn, groups,
                                                  x.shape[0])}
            for name, fn in calls.items():
                rec[f"{name}_graph_ms"] = round(_graph(fn), 5)
                rec[f"{name}_eager_ms"] = round(_eager(fn), 5)
            for ref in ("two_triton", "two_triton_split8", "two_grouped_mm"):
                rec[f"graph_speedup_vs_{ref}"] = round(rec[f"{ref}_graph_ms"]
                                                       / rec["fused_graph_ms"], 3)
                rec[f"eager_speedup_vs_{ref}"] = round(rec[f"{ref}_eager_ms"]
                                                       / rec["fused_eager_ms"], 3)
            print(json.dumps(rec), flush=True)
            records.append(rec)
    return records


#: Launch variants ``--sweep`` times beside the dispatch's configuration (the row tile stays
#: the plain fprop's; ``bitwise_equal`` records whether h and a keep their bits).
VARIANTS = [{"BLOCK_J": bj, "SPLIT": sp, "BLOCK_R": br}
            for bj, sp, br in itertools.product([32, 64], [2, 4, 8], [128, 256])]


def _sweep_rows(shape: str, rows: int, args: argparse.Namespace) -> list[dict]:
    groups, hidden, ffn = SHAPES[shape]
    x, w, offs, probs = _operands(groups, hidden, ffn, rows, args.seed)
    base = gm.fc1_swiglu_config(x.shape[0] / groups, ffn, groups, x.shape[0])
    two = _calls(x, w, offs, probs)["two_triton"]

    def call(cfg):
        return lambda: gm.fc1_swiglu(x, w, offs, probs, cfg)

    ref = call(base)()
    t_two = _graph(two)
    records = []
    for variant in VARIANTS:
        cfg = {**base, **variant}
        try:
            t = _graph(call(cfg))
        except Exception as exc:  # a config that does not compile (shared memory)
            print(f"skip {cfg}: {str(exc).splitlines()[0][:120]}", flush=True)
            continue
        out = call(cfg)()
        rec = {"bench": "fc1_epilogue_sweep", "shape": shape, "rows_per_group": rows, **cfg,
               "ms": round(t, 5), "two_triton_ms": round(t_two, 5),
               "vs_two_triton": round(t_two / t, 3), "current": cfg == base,
               "bitwise_equal": bool(torch.equal(out[0], ref[0])
                                     and torch.equal(out[1], ref[1]))}
        print(json.dumps(rec), flush=True)
        records.append(rec)
    best = max((r for r in records if r["bitwise_equal"]), key=lambda r: r["vs_two_triton"])
    cfg = {k: best[k] for k in base}
    records.append(_ab(shape, rows, {"fused_best": call(cfg), "fused_current": call(base),
                                     "two_triton": two}, cfg, args.rounds))
    return records


def _ab(shape: str, rows: int, fns: dict, cfg: dict, rounds: int) -> dict:
    """``rounds`` interleaved graph timings of each of ``fns``: medians and ratios."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(_graph(fn))
    med = {name: statistics.median(t) for name, t in times.items()}
    rec = {"bench": "fc1_epilogue_ab", "shape": shape, "rows_per_group": rows,
           "best_config": cfg, "rounds": rounds,
           **{f"{n}_ms": [round(t, 5) for t in ts] for n, ts in times.items()},
           **{f"{n}_vs_two_triton": round(med["two_triton"] / med[n], 3)
              for n in fns if n != "two_triton"}}
    print(json.dumps(rec), flush=True)
    return rec


def sweep(args: argparse.Namespace) -> list[dict]:
    """Launch variants of the fused kernel at each ``--rows`` on E64 and E128 fc1, each
    against the two launches; then ``--rounds`` interleaved timings of the best bitwise-equal
    variant, the dispatch's configuration and the two launches."""
    return [rec for shape in SHAPES for rows in args.rows
            for rec in _sweep_rows(shape, rows, args)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(map(str, ROWS)),
                        help="mean rows per group, comma-separated")
    parser.add_argument("--sweep", action="store_true", help="time launch configurations")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved rounds of the --sweep A/B")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    try:
        args.rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows must be comma-separated ints >= 1, got {args.rows!r}")
    if min(args.rows) < 1:
        parser.error(f"--rows must be comma-separated ints >= 1, got {args.rows}")
    check_min(parser, "--rounds", args.rounds, 1)
    if not torch.cuda.is_available():
        print("CUDA is not available: nothing to measure", file=sys.stderr)
        return 1
    records = sweep(args) if args.sweep else compare(args)
    if args.out:
        append_jsonl(args.out, [{**machine_info(torch.device("cuda")), **r} for r in records])
    return 0


if __name__ == "__main__":
    sys.exit(main())
