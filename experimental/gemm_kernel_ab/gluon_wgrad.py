"""The warp-specialized Gluon grouped wgrad against ``torch._grouped_mm`` and te_ops' Triton
wgrad (CUDA, SM90, bf16; an earlier change of issue 10).

For the issue-10 shapes (``large_gemm_triton.SHAPES``; ``--shapes`` may name its
``MID_SHAPES``) and the two wgrads (``fc1_wgrad``: x (T, H), dh (T, 2FF) -> (E, 2FF, H);
``fc2_wgrad``: a (T, FF), dy (T, H) -> (E, H, FF)) with Zipf(1.2) split sizes
(``grouped_mlp.skewed_sizes``), it times ``grouped_mm`` (``torch._grouped_mm(dy.t(), x,
offs=offs)``), ``triton`` (``grouped_wgrad_large_triton.large_wgrad``, its default flat
schedule) and each Gluon config of ``--variants`` (``gluon_NAME``; default: the kernel's
default and two ping-pong configs; ``epilogue``: ``EPILOGUE_VARIANTS``), interleaved round by
round with CUDA events (``large_gemm_triton._time_interleaved``), median of ``--reps`` rounds.
A record (``bench: "gluon_wgrad"``) has the medians, p10/p90, ``NAME_x_grouped_mm`` and
``NAME_x_triton`` (> 1: the Gluon kernel is faster) and checks against ``_grouped_mm``'s output
(``bitwise_equal_NAME``, ``max_abs_diff_NAME``); a config that fails to compile or run is
recorded with its error. ``--check`` first runs correctness cases (``gluon_wgrad_check``
records): empty groups, offsets that stop short of the rows with NaN padding, a ragged tail,
against ``_grouped_mm`` and an fp64 per-group reference.

Usage (one device call)::

    python benchmarks/gluon_wgrad.py [--shapes ...] [--gemms ...] [--reps 20] [--check]
        [--variants JSON|epilogue] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))  # common.py
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import JsonLines, machine_info, summarize_times  # noqa: E402
from large_gemm_triton import (  # noqa: E402
    ALL_SHAPES,
    SHAPES,
    WGRADS,
    _operands,
    _time_interleaved,
)

BENCH = "gluon_wgrad"
#: Gluon configs timed by default: changes to ``gluon_wgrad_config()``.
VARIANTS = {
    "coop_128x256": {},  # the default: one consumer of 8 warps, 128 x 256 tiles
    "pingpong": {"CONSUMERS": 2, "num_warps": 4, "BLOCK_K": 128, "STAGES": 4},
    "pingpong_64x256": {"CONSUMERS": 2, "num_warps": 4, "BLOCK_N": 64, "BLOCK_K": 256,
                        "STAGES": 3},
}
#: ``--variants epilogue``: the subtiled TMA-store epilogue (``EPI_SPLIT`` column slices
#: through ``EPI_BUFS`` smem buffers) with 4 and 3 ring stages, next to the default.
EPILOGUE_VARIANTS = {
    "coop_128x256": {},
    "s4_epi2x1": {"STAGES": 4, "EPI_SPLIT": 2, "EPI_BUFS": 1},
    "s4_epi4x2": {"STAGES": 4, "EPI_SPLIT": 4, "EPI_BUFS": 2},
    "s3_epi4x2": {"STAGES": 3, "EPI_SPLIT": 4, "EPI_BUFS": 2},
}


def _reference(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """fp64 per-group ``dy_g^T @ x_g`` (zeros for an empty group)."""
    ends = offs.tolist()
    out = torch.zeros(len(ends), dy.shape[1], x.shape[1], dtype=torch.float64,
                      device=x.device)
    start = 0
    for g, end in enumerate(ends):
        out[g] = dy[start:end].double().t() @ x[start:end].double()
        start = end
    return out


def check_cases(variants: dict[str, dict]) -> list[dict[str, Any]]:
    """Correctness records: each case, each Gluon config, against ``_grouped_mm`` and fp64."""
    from te_ops.gemm.grouped_wgrad_gluon import gluon_wgrad

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    cases = {  # name: (rows M, N, K, group sizes)
        "empty_groups": (1000, 256, 384, [0, 300, 0, 517, 0, 183]),
        "short_offsets_nan_pad": (1200, 384, 256, [129, 64, 1, 300, 250]),
        "ragged": (2053, 512, 640, [700, 3, 1000, 350]),
        "many_tiles_per_program": (4200, 1024, 1024, [2000, 0, 1500, 596, 1]),
    }
    recs = []
    for name, (m, n, k, sizes) in cases.items():
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
        dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16, generator=gen)
        offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
        used = int(offs[-1])
        x[used:] = float("nan")
        dy[used:] = float("nan")
        ref = _reference(x, dy, offs)
        want = torch._grouped_mm(dy.t(), x, offs=offs)
        rec: dict[str, Any] = {"bench": BENCH + "_check", "case": name, "sizes": sizes,
                               "m": m, "n": n, "k": k,
                               "grouped_mm_err": (want.double() - ref).abs().max().item()}
        for vname, change in variants.items():
            try:
                got = gluon_wgrad(x, dy, offs, change)
                torch.cuda.synchronize()
                rec[f"{vname}_err"] = (got.double() - ref).abs().max().item()
                rec[f"{vname}_bitwise_equal"] = bool(torch.equal(got, want))
                rec[f"{vname}_finite"] = bool(torch.isfinite(got).all())
            except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                rec[f"{vname}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        recs.append(rec)
    return recs


def compare(shape: str, gemm: str, variants: dict[str, dict], reps: int, seed: int
            ) -> dict[str, Any]:
    """The interleaved timing record of one (shape, wgrad)."""
    from te_ops.gemm import grouped_wgrad_large_triton as lw
    from te_ops.gemm.grouped_wgrad_gluon import gluon_wgrad

    ops = _operands(ALL_SHAPES[shape], gemm, seed)
    x, dy, offs = ops["x"], ops["dy"], ops["offs"]
    calls = {"grouped_mm": lambda: torch._grouped_mm(dy.t(), x, offs=offs),
             "triton": lambda: lw.large_wgrad(x, dy, offs)}
    rec: dict[str, Any] = {"bench": BENCH, "shape": shape, "gemm": gemm, "reps": reps,
                           "split_sizes": ops["sizes"]}
    want = calls["grouped_mm"]()
    rec["bitwise_equal_triton"] = bool(torch.equal(calls["triton"](), want))
    for name, change in variants.items():
        def fn(c: dict = change) -> torch.Tensor:
            return gluon_wgrad(x, dy, offs, c)

        try:
            got = fn()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit
            rec[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            continue
        rec[f"bitwise_equal_{name}"] = bool(torch.equal(got, want))
        rec[f"max_abs_diff_{name}"] = (got.float() - want.float()).abs().max().item()
        calls[f"gluon_{name}"] = fn
    times = _time_interleaved(calls, reps, warmup=3)
    for name, ts in times.items():
        stats = summarize_times(ts)
        rec[f"{name}_ms"] = stats["ms_median"]
        rec[f"{name}_p10_ms"] = stats["ms_p10"]
        rec[f"{name}_p90_ms"] = stats["ms_p90"]
        rec[f"{name}_tflops"] = ops["flop"] / stats["ms_median"] / 1e9
    for name in variants:
        if f"gluon_{name}_ms" in rec:
            rec[f"{name}_x_grouped_mm"] = rec["grouped_mm_ms"] / rec[f"gluon_{name}_ms"]
            rec[f"{name}_x_triton"] = rec["triton_ms"] / rec[f"gluon_{name}_ms"]
    rec["triton_x_grouped_mm"] = rec["grouped_mm_ms"] / rec["triton_ms"]
    return rec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--gemms", default=",".join(WGRADS))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--check-only", action="store_true", help="no timing")
    parser.add_argument("--variants", default=None,
                        help="JSON {name: config changes}, or 'epilogue' (EPILOGUE_VARIANTS)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    gemms = args.gemms.split(",")
    bad = [s for s in shapes if s not in ALL_SHAPES] + [g for g in gemms if g not in WGRADS]
    if bad:
        parser.error(f"unknown shapes / gemms {bad}; shapes: {sorted(ALL_SHAPES)}, gemms: "
                     f"{list(WGRADS)}")
    if args.reps < 20:
        parser.error(f"--reps must be >= 20, got {args.reps}")
    variants = (EPILOGUE_VARIANTS if args.variants == "epilogue"
                else json.loads(args.variants) if args.variants else VARIANTS)
    out = JsonLines(args.out)
    out.write({"bench": BENCH + "_machine", **machine_info(torch.device("cuda"))})
    if args.check or args.check_only:
        for rec in check_cases(variants):
            out.write(rec)
    for shape in [] if args.check_only else shapes:
        for gemm in gemms:
            out.write(compare(shape, gemm, variants, args.reps, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
