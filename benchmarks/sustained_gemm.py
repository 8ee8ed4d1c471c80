"""Per-GEMM time in steady state at the power cap: blocks of back-to-back calls per launch config.

``large_gemm_triton.py`` and ``gluon_wgrad.py`` interleave their variants call by call, so all
of them see the same clock: they compare cycles. At the H200's 700 W cap the clock follows the
power a kernel draws (docs/benchmarks.md, "Energy per step at the power cap"), so a config that
moves fewer bytes runs at a higher clock only when it runs long enough on its own. This script
runs each variant for a block of ``--block-ms`` of back-to-back calls, variants in turn,
``--rounds`` times, and takes per block the median call time (CUDA events) of the block's
second half; the record has the median over rounds (``NAME_ms``), the SM clock and the
instantaneous board power read through NVML at each block's end (``NAME_mhz``, ``NAME_w``;
NaN without ``pynvml``) and the ratios ``NAME_vs_default`` (default time / NAME time, > 1:
NAME is faster) and ``NAME_x_grouped_mm`` (``torch._grouped_mm``'s time / NAME's).

GEMMs (``large_gemm_triton`` operands: Zipf(1.2) split sizes, bf16):

* ``fc1_wgrad`` / ``fc2_wgrad``: the Gluon wgrad (``grouped_wgrad_gluon.gluon_wgrad``) with
  the preset the dispatch picks for the rows per group (``gluon_wgrad_preset``); variants
  change that config (e.g. ``{"GROUP_N": 8}``);
* ``fc1`` / ``fc2`` / ``fc1_dgrad`` / ``fc2_dgrad``: the Gluon fprop / dgrad
  (``grouped_gemm_gluon``) with the dispatched ``DISPATCH_CONFIG``; variants change it (e.g.
  ``{"GROUP_M": 16}``); also ``triton``, the persistent Triton kernel (``large_fprop`` /
  ``large_dgrad``, its default config), which auto runs where ``GLUON_RULE`` does not;
* ``fc1_swiglu``: the Gluon fc1 + SwiGLU (``fc1_swiglu_gluon``), its config; the peer is
  ``_grouped_mm`` plus the Triton SwiGLU forward.

Every variant's output is first checked bit for bit against the default config's
(``NAME_equal_default``): a tile order changes no arithmetic. ``--wait-hint-ns N`` (an
experiment, :func:`install_wait_hint`) patches a suspend-time hint into the mbarrier wait
loops of every kernel compiled in the process (records: ``wait_hint_ns``, ``waits_patched``);
compare two processes through their ``NAME_x_grouped_mm`` ratios.

Usage (CUDA, SM90, one device call)::

    python benchmarks/sustained_gemm.py --shapes E8_T16384_H4096_FF14336 --gemms fc2_wgrad \\
        --variants '{"gn8": {"GROUP_N": 8}}' --out sustained.jsonl
    python benchmarks/sustained_gemm.py --summarize sustained.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import JsonLines, machine_info, read_records  # noqa: E402
from large_gemm_triton import SHAPES, _operands  # noqa: E402
from power_clock import instant_power_w, nvml_index  # noqa: E402

BENCH = "sustained_gemm"
GEMMS = ("fc1_swiglu", "fc1", "fc2", "fc1_dgrad", "fc2_dgrad", "fc1_wgrad", "fc2_wgrad")


def _calls(ops: dict[str, Any], gemm: str, variants: dict[str, dict]
           ) -> dict[str, Callable[[], Any]]:
    """``grouped_mm`` (the peer's call), ``default`` and each variant of te_ops' kernel."""
    x, offs = ops["x"], ops["offs"]
    if gemm.endswith("wgrad"):
        from te_ops.gemm import grouped_wgrad_gluon as gw

        dy = ops["dy"]
        preset = gw.gluon_wgrad_preset(x.shape[0] / offs.numel())[0]  # the dispatch's
        calls = {"grouped_mm": lambda: torch._grouped_mm(dy.t(), x, offs=offs)}
        for name, change in {"default": {}, **variants}.items():
            calls[name] = lambda c=change: gw.gluon_wgrad(x, dy, offs, c, preset)
        return calls
    w = ops["w"]
    if gemm == "fc1_swiglu":
        from te_ops.gemm import fc1_swiglu_gluon as fg
        from te_ops.kernels import swiglu_triton as st

        probs = ops["probs"]
        calls = {"grouped_mm": lambda: st.swiglu_forward(
            torch._grouped_mm(x, w.transpose(1, 2), offs=offs), probs)}
        for name, change in {"default": {}, **variants}.items():
            calls[name] = lambda c=change: fg.gluon_fc1_swiglu(x, w, offs, probs, c)
        return calls
    from te_ops.gemm import grouped_gemm_gluon as gg
    from te_ops.gemm import grouped_gemm_large_triton as lg

    dgrad = gemm.endswith("dgrad")
    run = gg.gluon_dgrad if dgrad else gg.gluon_fprop
    triton_run = lg.large_dgrad if dgrad else lg.large_fprop
    calls = {"grouped_mm": ((lambda: torch._grouped_mm(x, w, offs=offs)) if dgrad
                            else (lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs))),
             "triton": lambda: triton_run(x, w, offs, {})}
    for name, change in {"default": {}, **variants}.items():  # on the dispatched config
        calls[name] = lambda c={**gg.DISPATCH_CONFIG, **change}: run(x, w, offs, c)
    return calls


#: A wait loop's ``mbarrier.try_wait.parity`` without a suspend-time hint (Triton 3.6's
#: lowering of every mbarrier wait; CUTLASS passes 0x989680 = 10^7 ns).
_TRY_WAIT = re.compile(r"(mbarrier\.try_wait\.parity\.shared(?:::cta)?\.b64\s+\w+,\s*"
                       r"\[[^\]]+\],\s*[^;,]+);")


def install_wait_hint(ns: int) -> dict[str, int]:
    """An experiment (``--wait-hint-ns``): every kernel Triton compiles in this process gets
    ``ns`` as the suspend-time hint of its mbarrier wait loops (PTX ISA: ``mbarrier.try_wait``'s
    optional ``suspendTimeHint``, the longest a waiting thread stays suspended before it polls
    again; the wait still ends when the phase completes), through Triton's
    ``knobs.runtime.add_stages_inspection_hook`` on the PTX stage. Triton's cache key does not
    see the hook, so the caller gives the process its own ``TRITON_CACHE_DIR``. Returns the
    count of waits patched per kernel name (filled as kernels compile)."""
    from triton import knobs

    patched: dict[str, int] = {}

    def hook(backend, stages, options, language, capability):
        make_ptx = stages["ptx"]

        def ptx(src, metadata):
            text, count = _TRY_WAIT.subn(rf"\1, {ns};", make_ptx(src, metadata))
            patched[str(metadata.get("name"))] = count
            return text

        stages["ptx"] = ptx

    knobs.runtime.add_stages_inspection_hook = hook
    return patched


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


class _Nvml:
    """SM clock (MHz) and instantaneous board power (W) of the current device, NaN without
    ``pynvml``."""

    def __init__(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            index = nvml_index(torch.cuda.current_device())
            self.nv, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # noqa: BLE001 - any failure: no readings, not no benchmark
            self.nv = None

    def read(self) -> tuple[float, float]:
        if self.nv is None:
            return math.nan, math.nan
        mhz = float(self.nv.nvmlDeviceGetClockInfo(self.handle, self.nv.NVML_CLOCK_SM))
        return mhz, instant_power_w(self.nv, self.handle)


def _block(fn: Callable[[], Any], calls: int) -> float:
    """Median ms of the second half of ``calls`` back-to-back calls."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]
    events[0].record()
    for i in range(calls):
        fn()
        events[i + 1].record()
    torch.cuda.synchronize()
    ms = [events[i].elapsed_time(events[i + 1]) for i in range(calls)]
    return statistics.median(ms[calls // 2:])


def compare(shape: str, gemm: str, variants: dict[str, dict], rounds: int, block_ms: float,
            seed: int) -> dict[str, Any]:
    op_gemm = "fc1" if gemm == "fc1_swiglu" else gemm
    ops = _operands(SHAPES[shape], op_gemm, seed)
    calls = _calls(ops, gemm, variants)
    rec: dict[str, Any] = {"bench": BENCH, "shape": shape, "gemm": gemm,
                           "rounds": rounds, "block_ms": block_ms,
                           "tflop": ops["flop"] / 1e12, "variants": variants}
    ref = _first(calls["default"]())
    for name in variants:
        rec[f"{name}_equal_default"] = bool(torch.equal(_first(calls[name]()), ref))
    del ref
    counts = {}
    for name, fn in calls.items():  # compile, then size each block by one timed call
        fn()
        torch.cuda.synchronize()
        counts[name] = max(8, int(block_ms / max(_block(fn, 3), 1e-3)))
    nvml = _Nvml()
    times: dict[str, list[float]] = {n: [] for n in calls}
    clocks: dict[str, list[float]] = {n: [] for n in calls}
    watts: dict[str, list[float]] = {n: [] for n in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            times[name].append(_block(fn, counts[name]))
            mhz, w = nvml.read()
            clocks[name].append(mhz)
            watts[name].append(w)
    for name in calls:
        rec[f"{name}_ms"] = statistics.median(times[name])
        rec[f"{name}_rounds_ms"] = times[name]
        rec[f"{name}_mhz"] = statistics.median(clocks[name])
        rec[f"{name}_w"] = statistics.median(watts[name])
    for name in calls:
        if name != "grouped_mm":
            rec[f"{name}_x_grouped_mm"] = rec["grouped_mm_ms"] / rec[f"{name}_ms"]
            rec[f"{name}_vs_default"] = rec["default_ms"] / rec[f"{name}_ms"]
    return rec


def summarize(path: str) -> str:
    lines = [f"{'shape':26s} {'gemm':11s} {'variant':12s} {'ms':>8s} {'MHz':>6s} {'W':>5s} "
             f"{'vs default':>10s} {'x _grouped_mm':>13s} {'equal':>5s}"]
    for r in read_records(path, BENCH):
        names = [n for n in ("grouped_mm", "triton") if f"{n}_ms" in r]
        names += ["default", *r["variants"]]
        for n in names:
            eq = r.get(f"{n}_equal_default", "")
            lines.append(
                f"{r['shape']:26s} {r['gemm']:11s} {n:12s} {r[f'{n}_ms']:8.3f} "
                f"{r[f'{n}_mhz']:6.0f} {r[f'{n}_w']:5.0f} "
                f"{r.get(f'{n}_vs_default', float('nan')):10.3f} "
                f"{r.get(f'{n}_x_grouped_mm', float('nan')):13.3f} {str(eq):>5s}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--gemms", default="fc1_wgrad,fc2_wgrad")
    parser.add_argument("--variants", default="{}",
                        help='JSON {"name": {config changes}} for every GEMM named')
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block-ms", type=float, default=400.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wait-hint-ns", type=int, default=0,
                        help="experiment: suspend-time hint (ns) patched into every mbarrier "
                             "wait loop of the kernels Triton compiles here (own cache dir)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--summarize", default=None, metavar="FILE")
    args = parser.parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    shapes = [s for s in args.shapes.split(",") if s]
    gemms = [g for g in args.gemms.split(",") if g]
    for flag, names, known in (("--shapes", shapes, SHAPES), ("--gemms", gemms, GEMMS)):
        bad = [n for n in names if n not in known]
        if bad:
            parser.error(f"{flag}: expected names among {', '.join(known)}, got {bad}")
    try:
        variants = json.loads(args.variants)
    except json.JSONDecodeError as exc:
        parser.error(f"--variants: expected JSON, got {args.variants!r} ({exc})")
    if not isinstance(variants, dict) or not all(isinstance(v, dict) for v in variants.values()):
        parser.error(f"--variants: expected a JSON object of objects, got {args.variants!r}")
    if {"default", "grouped_mm", "triton"} & set(variants):
        parser.error("--variants: 'default', 'grouped_mm' and 'triton' are reserved names")
    if args.wait_hint_ns < 0:
        parser.error(f"--wait-hint-ns: expected >= 0, got {args.wait_hint_ns}")
    if args.rounds < 1 or args.block_ms <= 0:
        parser.error(f"--rounds >= 1 and --block-ms > 0 expected, got {args.rounds} and "
                     f"{args.block_ms}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (SM90): the kernels timed are Gluon kernels")
    patched: dict[str, int] = {}
    if args.wait_hint_ns:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="te_ops_wait_hint_")
        patched = install_wait_hint(args.wait_hint_ns)
    out = JsonLines(args.out)
    out.write({"bench": f"{BENCH}_machine", **machine_info(torch.device("cuda"))})
    for shape in shapes:
        for gemm in gemms:
            rec = compare(shape, gemm, variants, args.rounds, args.block_ms, args.seed)
            rec["wait_hint_ns"] = args.wait_hint_ns
            rec["waits_patched"] = dict(patched)
            out.write(rec)
            torch.cuda.empty_cache()
    out.close()
    if args.out:
        print(summarize(args.out), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
