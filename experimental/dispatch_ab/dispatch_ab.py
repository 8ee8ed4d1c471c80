"""Whole-step A/B of dispatch rules at the power cap: patched rule tables, back-to-back steps.

Per-GEMM timings (``sustained_gemm.py``, ``large_gemm_triton.py``) rank kernels one at a time;
a rule change is kept only when the whole fwd+bwd step gets faster in steady state, where the
step's energy at the 700 W cap sets the clock. This script runs, in one process and on one
GPU, rounds of: the torch peer, then te_ops (``--peer``, default ``te_ops_fused_single``)
under each variant, each for ``--steps`` back-to-back steps (``power_clock.measure``: median
step time by CUDA events, mean SM clock and board power through NVML). A variant patches the
dispatch tables for its measurement only and restores them after:

* ``-KIND/IN/OUT``: drop ``(KIND, IN, OUT)`` from ``grouped_gemm_gluon.GLUON_RULE`` (that
  GEMM then runs in the persistent Triton kernel);
* ``+KIND/IN/OUT@ROWS``: add it at ``ROWS`` average rows per group (padding included);
* ``+fc1/IN/OUT@ROWS`` / ``-fc1/IN/OUT``: the same on ``fc1_swiglu_gluon.GLUON_FC1_RULE``
  (fc1's fprop + SwiGLU in one Gluon launch);
* ``gluon:KEY=JSON``: a key of ``grouped_gemm_gluon.DISPATCH_CONFIG`` (the dispatched Gluon
  fprop / dgrad launch config, e.g. ``gluon:SKIP_TAIL=true``);
* ``large:KEY=JSON``: a key of the persistent Triton fprop / dgrad kernel's default config
  (``grouped_gemm_large_triton.large_config``, e.g. ``large:TAIL=true``);
* ``NAME=VALUE``: an environment variable (e.g. ``TE_OPS_FC1_SWIGLU_EPILOGUE=1``).

``--align-splits N`` rounds every expert's token count to a multiple of ``N`` (the total kept,
:func:`aligned_sizes`), so no GEMM tile straddles a group's end: run once with and once
without it to see what the tail tiles' rows cost a peer at the cap.

``--variants`` is ``label:patch;patch,label2:patch``; the label ``default`` (no patches) is
always measured first in each round. Records (JSON lines, ``--out``): one per measurement
(``power_clock``'s fields plus ``variant``, ``round``, ``patches``), and the summary prints per
variant the median over rounds of the step time, ``vs_default`` (default's time / the
variant's, > 1: the variant is faster) and ``x_peer`` (the peer's time / the variant's).

Usage (CUDA, SM90)::

    python benchmarks/dispatch_ab.py --shape E32_T32768_H7168_FF2048 \\
        --variants 'fc1_gluon:+fprop/7168/4096@1024,fc1_gluon_swiglu:+fc1/7168/4096@1024' \\
        --rounds 3 --steps 100 --out ab.jsonl
    python benchmarks/dispatch_ab.py --summarize ab.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import env_override, free_memory  # noqa: E402
from grouped_mlp import PEER_CLASSES, SHAPES, make_problem  # noqa: E402

_KINDS = ("fprop", "dgrad", "fc1")


def parse_patch(text: str) -> tuple[str, ...]:
    """One patch of a variant as a tuple: ``("env", NAME, VALUE)``, ``("config", "gluon" |
    "large", KEY, value)``, ``("rule", sign, kind, in, out, rows)`` (``rows`` ``None`` for a
    removal). Raises ``ValueError`` naming the patch and the expected form."""
    for prefix in ("gluon:", "large:"):
        if text.startswith(prefix):
            key, sep, raw = text[len(prefix):].partition("=")
            if not sep or not key:
                raise ValueError(f"patch {text!r}: expected {prefix}KEY=JSON")
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                raise ValueError(f"patch {text!r}: the value must be JSON (true, 4, ...), "
                                 f"got {raw!r}") from None
            return ("config", prefix[:-1], key, value)
    if "=" in text:
        name, value = text.split("=", 1)
        if not name:
            raise ValueError(f"patch {text!r}: expected NAME=VALUE with a variable name")
        return ("env", name, value)
    form = "-KIND/IN/OUT or +KIND/IN/OUT@ROWS (KIND in fprop, dgrad, fc1)"
    if text[:1] not in "+-" or not text[1:]:
        raise ValueError(f"patch {text!r}: expected {form}")
    sign, rest = text[0], text[1:]
    rows = None
    if sign == "+":
        if "@" not in rest:
            raise ValueError(f"patch {text!r}: an addition needs @ROWS; expected {form}")
        rest, rows_text = rest.split("@", 1)
        try:
            rows = float(rows_text)
        except ValueError:
            raise ValueError(f"patch {text!r}: ROWS must be a number, got {rows_text!r}") from None
    parts = rest.split("/")
    if len(parts) != 3 or parts[0] not in _KINDS or not all(p.isdigit() for p in parts[1:]):
        raise ValueError(f"patch {text!r}: expected {form}")
    return ("rule", sign, parts[0], int(parts[1]), int(parts[2]), rows)


def parse_variants(text: str) -> dict[str, list[tuple[str, ...]]]:
    """``label:patch;patch,...`` -> {label: patches}, ``default`` first with none. Raises
    ``ValueError`` for a missing label, a repeated label or a bad patch."""
    variants: dict[str, list[tuple[str, ...]]] = {"default": []}
    for item in filter(None, text.split(",")):
        label, sep, patches = item.partition(":")
        if not sep or not label:
            raise ValueError(f"variant {item!r}: expected label:patch[;patch...]")
        if label in variants:
            raise ValueError(f"variant label {label!r} given twice (or 'default', which is "
                             "always measured)")
        variants[label] = [parse_patch(p) for p in patches.split(";") if p]
    return variants


def aligned_sizes(sizes: list[int], align: int) -> list[int]:
    """``sizes`` (tokens per expert) rounded to multiples of ``align`` with the same total:
    each rounded down, then the rows left over handed out ``align`` at a time to the experts
    that lost the most (ties: the lower index). Raises ``ValueError`` when ``align`` < 1 or
    the total is not a multiple of ``align``."""
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    total = sum(sizes)
    if total % align:
        raise ValueError(f"the total of sizes ({total}) must be a multiple of align ({align})")
    out = [s - s % align for s in sizes]
    order = sorted(range(len(sizes)), key=lambda i: (-(sizes[i] % align), i))
    for i in order[:(total - sum(out)) // align]:
        out[i] += align
    return out


def with_sizes(problem, sizes: list[int]):
    """``problem`` with other tokens per expert (same x, probs, dy)."""
    split = torch.tensor(sizes, dtype=torch.int64, device=problem.device)
    return dataclasses.replace(problem, sizes=list(sizes), split=split,
                               offsets=torch.cumsum(split, 0).to(torch.int32))


def check_patches(variants: dict[str, list[tuple[str, ...]]],
                  peer_env: dict[str, str | None] | None = None) -> None:
    """Raise ``ValueError`` naming the variant and the patch where a removal names an entry
    the tables do not hold now, or an environment patch sets a variable the te_ops peer's own
    env sets (the peer's value would win inside the measurement): checked before any step
    runs, so a bad patch does not stop a run after its first measurements."""
    from te_ops.gemm import fc1_swiglu_gluon as fg
    from te_ops.gemm import grouped_gemm_gluon as gg

    for label, patches in variants.items():
        for p in patches:
            if p[0] == "env":
                if peer_env and p[1] in peer_env:
                    raise ValueError(f"variant {label!r}: {p[1]}={p[2]} would be overridden by "
                                     f"the peer's own env ({p[1]}={peer_env[p[1]]})")
                continue
            if p[0] == "config":  # keys checked when applied (patched)
                continue
            _, sign, kind, n_in, n_out, _rows = p
            table, key, name = ((fg.GLUON_FC1_RULE, (n_in, n_out), "GLUON_FC1_RULE")
                                if kind == "fc1" else
                                (gg.GLUON_RULE, (kind, n_in, n_out), "GLUON_RULE"))
            if sign == "-" and key not in table:
                raise ValueError(f"variant {label!r}: patch -{kind}/{n_in}/{n_out}: {name} "
                                 f"holds no {key}")


@contextlib.contextmanager
def patched(patches: list[tuple[str, ...]]) -> Iterator[None]:
    """The dispatch tables, launch configs and environment with ``patches`` applied; restored
    on exit. Raises ``KeyError`` for a removal of an entry the table does not hold or a config
    key the kernel does not have."""
    from te_ops.gemm import fc1_swiglu_gluon as fg
    from te_ops.gemm import grouped_gemm_gluon as gg
    from te_ops.gemm import grouped_gemm_large_triton as lg

    saved = (dict(gg.GLUON_RULE), dict(fg.GLUON_FC1_RULE), dict(gg.DISPATCH_CONFIG))
    env = {p[1]: p[2] for p in patches if p[0] == "env"}
    large_changes = {p[2]: p[3] for p in patches if p[:2] == ("config", "large")}
    large_config = lg.large_config
    try:
        for p in patches:
            if p[:2] == ("config", "gluon"):
                if p[2] not in gg.gluon_config():
                    raise KeyError(f"patch gluon:{p[2]}: not a key of the Gluon config "
                                   f"{sorted(gg.gluon_config())}")
                gg.DISPATCH_CONFIG[p[2]] = p[3]
        if large_changes:
            unknown = sorted(set(large_changes) - set(large_config("fprop")))
            if unknown:
                raise KeyError(f"patch large:{unknown[0]}: not a key of the Triton config "
                               f"{sorted(large_config('fprop'))}")

            def patched_config(kind: str) -> dict:
                return {**large_config(kind), **large_changes}

            lg.large_config = patched_config
            lg._DEFAULTS.clear()  # the resolved defaults are cached per (kind, groups)
        for p in patches:
            if p[0] != "rule":
                continue
            _, sign, kind, n_in, n_out, rows = p
            table, key = ((fg.GLUON_FC1_RULE, (n_in, n_out)) if kind == "fc1"
                          else (gg.GLUON_RULE, (kind, n_in, n_out)))
            if sign == "-":
                if key not in table:
                    raise KeyError(f"patch -{kind}/{n_in}/{n_out}: the table holds no {key}")
                del table[key]
            else:
                table[key] = rows
        with env_override(**env):
            yield
    finally:
        gg.GLUON_RULE.clear()
        gg.GLUON_RULE.update(saved[0])
        fg.GLUON_FC1_RULE.clear()
        fg.GLUON_FC1_RULE.update(saved[1])
        gg.DISPATCH_CONFIG.clear()
        gg.DISPATCH_CONFIG.update(saved[2])
        if lg.large_config is not large_config:
            lg.large_config = large_config
            lg._DEFAULTS.clear()


def summarize(records: list[dict]) -> list[dict]:
    """Per (shape, variant): the median over rounds of ``ms_median``, ``vs_default`` and
    ``x_peer`` (each round's ratio, then the median), the mean clock (``None`` where NVML gave
    none). Raises ``ValueError`` for two records of one (shape, variant, round): runs appended
    to one file, whose rounds would pair across runs."""
    seen = set()
    for r in records:
        k = (r["shape"], r["variant"], r["round"])
        if k in seen:
            raise ValueError(f"two records of shape {k[0]}, variant {k[1]!r}, round {k[2]} "
                             "(--out appends: give each run its own file)")
        seen.add(k)
    rows = []
    keys = sorted({(r["shape"], r["variant"]) for r in records},
                  key=lambda k: (k[0], k[1] != "peer", k[1] != "default", k[1]))
    for shape, variant in keys:
        mine = [r for r in records if r["shape"] == shape and r["variant"] == variant]
        by_round = {r["round"]: r for r in mine}
        ratio_default, ratio_peer = [], []
        for rnd, r in by_round.items():
            for ref, out in (("default", ratio_default), ("peer", ratio_peer)):
                other = [o for o in records if o["shape"] == shape and o["variant"] == ref
                         and o["round"] == rnd]
                if other:
                    out.append(other[0]["ms_median"] / r["ms_median"])
        mhz = [r["sm_mhz_mean"] for r in mine if r["sm_mhz_mean"] is not None]
        rows.append({"shape": shape, "variant": variant, "rounds": len(mine),
                     "ms": statistics.median(r["ms_median"] for r in mine),
                     "ms_all": [round(r["ms_median"], 3) for r in mine],
                     "mhz": statistics.fmean(mhz) if mhz else None,
                     "vs_default": statistics.median(ratio_default) if ratio_default else None,
                     "x_peer": statistics.median(ratio_peer) if ratio_peer else None})
    return rows


def print_summary(rows: list[dict]) -> None:
    print(f"{'shape':26} {'variant':20} {'ms':>8} {'MHz':>6} {'vs_default':>10} {'x_peer':>7}"
          "  rounds (ms)")
    for r in rows:
        vd = f"{r['vs_default']:.3f}" if r["vs_default"] is not None else "-"
        xp = f"{r['x_peer']:.3f}" if r["x_peer"] is not None else "-"
        mhz = f"{r['mhz']:.0f}" if r["mhz"] is not None else "-"
        print(f"{r['shape']:26} {r['variant']:20} {r['ms']:8.3f} {mhz:>6} {vd:>10} "
              f"{xp:>7}  {r['ms_all']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="E32_T32768_H7168_FF2048")
    parser.add_argument("--variants", default="")
    parser.add_argument("--peer", default="te_ops_fused_single")
    parser.add_argument("--reference", default="torch_grouped_mm",
                        help="the peer measured first in each round (x_peer)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--interval-ms", type=float, default=20.0)
    parser.add_argument("--rest-s", type=float, default=1.0)
    parser.add_argument("--align-splits", type=int, default=None, metavar="N",
                        help="round every expert's tokens to a multiple of N (total kept)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--summarize", metavar="JSONL", default=None,
                        help="print the summary of an earlier run's records and exit")
    args = parser.parse_args(argv)
    if args.summarize:
        with open(args.summarize) as f:
            records = [json.loads(line) for line in f if line.strip()]
        try:
            rows = summarize(records)
        except ValueError as e:
            parser.error(f"--summarize {args.summarize}: {e}")
        print_summary(rows)
        return 0
    if args.shape not in SHAPES:
        parser.error(f"--shape: unknown {args.shape!r}; known: {sorted(SHAPES)}")
    for flag, name in (("--peer", args.peer), ("--reference", args.reference)):
        if name not in PEER_CLASSES:
            parser.error(f"{flag}: unknown {name!r}; known: {sorted(PEER_CLASSES)}")
    if args.rounds < 1 or args.steps < 2:
        parser.error(f"--rounds must be >= 1 and --steps >= 2, got {args.rounds}, {args.steps}")
    if args.warmup < 0 or args.interval_ms <= 0 or args.rest_s < 0:
        parser.error(f"--warmup and --rest-s must be >= 0 and --interval-ms > 0, got "
                     f"{args.warmup}, {args.rest_s}, {args.interval_ms}")
    try:
        variants = parse_variants(args.variants)
        check_patches(variants, PEER_CLASSES[args.peer].env)
    except ValueError as e:
        parser.error(f"--variants: {e}")
    if args.align_splits is not None:
        tokens = SHAPES[args.shape][1]
        if args.align_splits < 1 or tokens % args.align_splits:
            parser.error(f"--align-splits must be >= 1 and divide the shape's {tokens} tokens, "
                         f"got {args.align_splits}")
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    import pynvml  # nvidia-ml-py
    from power_clock import measure, nvml_index

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index(torch.cuda.current_device()))
    problem = make_problem(args.shape, SHAPES[args.shape], torch.device("cuda"),
                           torch.bfloat16, 0)
    if args.align_splits is not None:
        problem = with_sizes(problem, aligned_sizes(problem.sizes, args.align_splits))
    records = []
    plan = [("peer", args.reference, [])] + [(label, args.peer, p)
                                             for label, p in variants.items()]
    for rnd in range(args.rounds):
        for label, peer, patches in plan:
            time.sleep(args.rest_s)
            with patched(patches):
                r = measure(peer, problem, args.steps, args.warmup, args.interval_ms / 1000.0,
                            pynvml, handle)
            r.update(bench="dispatch_ab", variant=label, round=rnd,
                     patches=[list(p) for p in patches], align_splits=args.align_splits)
            records.append(r)
            print(f"round {rnd} {label:20} {r['ms_median']:8.3f} ms "
                  f"{r['sm_mhz_mean'] or 0:6.0f} MHz {r['power_w_mean']:6.0f} W", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(r) + "\n")
            free_memory()
    print_summary(summarize(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
