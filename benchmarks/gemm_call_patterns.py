"""Do te_ops' grouped GEMMs differ from the torch peer's, and does any call pattern run faster?

One process, every measurement interleaved (A, B, A, B, ...), medians of ``--reps`` timed
repetitions after ``--warmup`` untimed ones (CUDA events; on the CPU the host clock, a smoke
run only). Per shape of ``benchmarks/grouped_mlp.py`` (same problem: weights, inputs, Zipf
routing, split sizes on the device that cover every row):

``pattern``
    every ``aten::_grouped_mm`` call of one fwd+bwd step of ``torch_grouped_mm``,
    ``te_ops_fused`` and ``te_ops_fused_single`` (a ``TorchDispatchMode`` records operand
    shapes, strides, dtypes, row/column-major, data-pointer alignment, offs, output), named
    ``fc1_fprop`` ... ``fc2_wgrad``, plus the copies the step makes (``copy_``, ``clone``,
    ``_to_copy``, ``contiguous``); ``same_as_peer`` says whether te_ops' call equals the
    peer's in everything but the data.
``replay``
    each GEMM re-run on the operands captured from the peer's step and from te_ops' step
    (same layout, values differ only where the SwiGLU rounds differently): a data effect.
``layout``
    each GEMM as called, and with the other major-ness of its 3-D weight operand
    (``copy_b``: fprop with a row-major ``W^T`` copy, dgrad with a column-major ``W`` copy;
    the weight copy is timed apart as ``copy_b_cost``), and wgrad computed as
    ``(x^T dy)^T`` (``swap``: other tile orientation; the transpose copy of the result is
    timed apart as ``swap_cost``). Layouts with the ragged (token) dimension contiguous are
    not tried: group starts would not be 16-byte aligned for arbitrary split sizes (TMA).
    ``max_abs_diff`` compares each variant's result with the call's own.
``power``
    the six GEMMs of a step back to back vs. with a memory-bound copy (about the peer's
    elementwise work) between them: GEMM time alone, per GEMM, with the SM clock, power and
    temperature sampled by NVML (``nvidia-ml-py``) in each phase.
``step``
    fwd+bwd step time of the peer, ``te_ops_fused``, ``te_ops_fused_single`` and
    ``te_ops_fused`` with each layout variant patched into ``kernels.grouped_gemm``
    (``+copy_b_fprop``, ``+copy_b_dgrad``, ``+swap_wgrad``), interleaved.
``blocks``
    the peer and ``te_ops_fused`` in alternating blocks of ``--block-steps`` steps each (as a
    sequential benchmark times them), with the clock of each block.
``dense`` (only when named in ``--parts``)
    a dense 8192^3 bf16 ``torch.mm`` as a short burst after an idle device, and after seconds
    of back-to-back products (the sustained, power-limited rate), with NVML clocks.
``profile``
    torch.profiler (``record_shapes=True``) of ``--profile-steps`` steps of the peer and
    ``te_ops_fused``: every kernel in launch order with its full name, grid, block and
    duration, the ``aten::_grouped_mm`` input dims/strides, and the device idle gaps.

Usage::

    python benchmarks/gemm_call_patterns.py [--shapes ...] [--out FILE] [--trace-dir DIR]
    python benchmarks/gemm_call_patterns.py --quick --device cpu      # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    JsonLines,
    check_device,
    check_file,
    check_list,
    check_min,
    env_override,
    free_memory,
    machine_info,
    recorded_run,
)
from grouped_mlp import PEER_CLASSES, QUICK_SHAPES, SHAPES, make_problem  # noqa: E402

import te_ops.gemm.dispatch as gg  # noqa: E402

COPY_OPS = ("copy_", "clone", "_to_copy", "contiguous")
STEP_PEERS = ["torch_grouped_mm", "te_ops_fused", "te_ops_fused_single"]
PARTS = ("pattern", "replay", "layout", "power", "step", "blocks", "profile", "dense")


# ------------------------------------------------------------------------------ recording
def describe(t: torch.Tensor) -> dict:
    """Shape, strides, dtype, major-ness of the last two dims and data-pointer alignment."""
    st = t.stride()
    major = "row" if st[-1] == 1 else ("col" if t.dim() >= 2 and st[-2] == 1 else "other")
    ptr = t.data_ptr()
    align = 1024 if ptr % 1024 == 0 else (ptr & -ptr if ptr else 0)
    return {"shape": list(t.shape), "stride": list(st), "dtype": str(t.dtype).split(".")[-1],
            "major": major, "align": align}


class GemmRecorder(TorchDispatchMode):
    """Records ``aten::_grouped_mm`` calls (and counts copies) of the code run under it.

    With ``keep=True`` each call's operands are cloned (same strides), for replays.
    """

    def __init__(self, two_ff: int, keep: bool = False) -> None:
        super().__init__()
        self.two_ff = two_ff
        self.keep = keep
        self.calls: list[dict] = []
        self.copies: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name == "_grouped_mm":
            a, b = args[0], args[1]
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            call = {"a": describe(a), "b": describe(b), "out": describe(out),
                    "offs": None if offs is None else {**describe(offs),
                                                       "last": int(offs[-1])},
                    "kwargs": {k: str(v) for k, v in kwargs.items() if k != "offs"}}
            call["name"] = gemm_name(a, b, out, self.two_ff)
            if self.keep:
                call["operands"] = (a.clone(), b.clone(), offs)
            self.calls.append(call)
        elif name in COPY_OPS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            self.copies.append({"op": name, "args": [describe(t)["shape"] for t in tensors],
                                "dtypes": [describe(t)["dtype"] for t in tensors]})
        return out


def gemm_name(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, two_ff: int) -> str:
    """``fc1_fprop`` ... from the operand ranks and layouts; fc1 is the GEMM whose output
    (fprop, wgrad) or input gradient (dgrad) has the 2·FF features."""
    kind = kind_of(a, b)
    if kind == "wgrad":
        fc1 = out.shape[1] == two_ff
    elif kind == "fprop":
        fc1 = out.shape[1] == two_ff
    else:
        fc1 = a.shape[1] == two_ff
    return f"{'fc1' if fc1 else 'fc2'}_{kind}"


def record_step(peer, problem, keep: bool) -> GemmRecorder:
    x, probs, dy = problem.x, problem.probs, problem.dy
    params = peer.parameters()
    with env_override(**peer.env):
        for _ in range(2):  # plan, probe, compile outside the recording
            _clear(x, probs, params)
            peer.forward(x, probs).backward(dy)
        _clear(x, probs, params)
        rec = GemmRecorder(2 * problem.ffn, keep)
        with rec:
            peer.forward(x, probs).backward(dy)
        _clear(x, probs, params)
    return rec


def _clear(x, probs, params) -> None:
    x.grad = probs.grad = None
    for p in params:
        p.grad = None


def pattern_records(shape: str, recs: dict[str, GemmRecorder]) -> list[dict]:
    peer = {c["name"]: c for c in recs["torch_grouped_mm"].calls}
    out = []
    for peer_name, rec in recs.items():
        for i, c in enumerate(rec.calls):
            ref = peer.get(c["name"])
            same = ref is not None and all(
                {k: v for k, v in c[f].items() if k != "align"}
                == {k: v for k, v in ref[f].items() if k != "align"}
                for f in ("a", "b", "out")) and c["kwargs"] == ref["kwargs"]
            out.append({"part": "pattern", "shape": shape, "peer": peer_name, "index": i,
                        **{k: v for k, v in c.items() if k != "operands"},
                        "same_as_peer": same})
        counts: dict[str, int] = {}
        for cp in rec.copies:
            counts[cp["op"]] = counts.get(cp["op"], 0) + 1
        out.append({"part": "pattern_copies", "shape": shape, "peer": peer_name,
                    "counts": counts, "copies": rec.copies[:40]})
    return out


# -------------------------------------------------------------------------------- timing
def time_interleaved(fns: dict[str, Callable[[], object]], device: torch.device, *, reps: int,
                     warmup: int, between: Callable[[], None] | None = None
                     ) -> dict[str, list[float]]:
    """ms of each function per repetition, the functions run in turn (A, B, C, A, ...)."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    if cuda:
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in fns}
    events: list[tuple[str, object, object]] = []
    for _ in range(reps):
        for name, fn in fns.items():
            if between is not None:
                between()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                fn()
                end.record()
                events.append((name, start, end))
            else:
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize()
        for name, start, end in events:
            times[name].append(start.elapsed_time(end))
    return times


def stats(ts: list[float]) -> dict[str, float]:
    s = sorted(ts)
    return {"ms_median": statistics.median(s), "ms_min": s[0], "ms_max": s[-1], "n": len(s)}


class ClockSampler:
    """NVML samples (SM clock MHz, power W, temperature C, clock-event reasons) every
    ``period`` s in a thread; ``phase(name)`` labels the samples taken inside it."""

    def __init__(self, enabled: bool, period: float = 0.01) -> None:
        self.period = period
        self.samples: list[tuple[float, int, float, int, int]] = []
        self.phases: list[tuple[str, float, float]] = []
        self.ok = False
        self.error = "no CUDA device"
        self._stop = threading.Event()
        if not enabled:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            self.ok = True
        except Exception as exc:  # no NVML: the rest still runs
            self.error = f"{type(exc).__name__}: {exc}"

    def __enter__(self) -> ClockSampler:
        if self.ok:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.ok:
            self._thread.join()

    def _run(self) -> None:
        nv, h = self._nvml, self._h
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons",
                          getattr(nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
        while not self._stop.is_set():
            try:
                self.samples.append((time.perf_counter(),
                                     nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                                     nv.nvmlDeviceGetPowerUsage(h) / 1e3,
                                     nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
                                     reasons(h) if reasons else -1))
            except Exception:
                pass
            time.sleep(self.period)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.phases.append((name, t0, time.perf_counter()))

    def summary(self, name: str) -> dict:
        spans = [(a, b) for n, a, b in self.phases if n == name]
        rows = [s for s in self.samples if any(a <= s[0] <= b for a, b in spans)]
        if not rows:
            return {}
        clk = [r[1] for r in rows]
        pw = [r[2] for r in rows]
        reasons: dict[str, int] = {}
        for r in rows:
            reasons[hex(r[4])] = reasons.get(hex(r[4]), 0) + 1
        return {"samples": len(rows), "sm_mhz_mean": statistics.mean(clk), "sm_mhz_min": min(clk),
                "sm_mhz_max": max(clk), "power_w_mean": statistics.mean(pw),
                "power_w_max": max(pw), "temp_c_max": max(r[3] for r in rows),
                "clock_event_reasons": reasons}


# --------------------------------------------------------------------- layout variants
def fprop_copy_b(a, b, offs):
    """fprop with ``W^T`` as a row-major copy (the as-called ``b`` is a column-major view)."""
    return torch._grouped_mm(a, b.contiguous(), offs=offs)


def dgrad_copy_b(a, b, offs):
    """dgrad with ``W`` as a column-major copy (the as-called ``b`` is row-major)."""
    return torch._grouped_mm(a, b.transpose(-2, -1).contiguous().transpose(-2, -1), offs=offs)


def wgrad_swap(a, b, offs):
    """``dy^T x`` as ``(x^T dy)^T``, made contiguous like the as-called result."""
    return torch._grouped_mm(b.t(), a.t(), offs=offs).transpose(-2, -1).contiguous()


def kind_of(a, b) -> str:
    if a.dim() == 2 and b.dim() == 2:
        return "wgrad"
    return "fprop" if b.stride(-2) == 1 else "dgrad"


VARIANTS = {"copy_b_fprop": ("fprop", fprop_copy_b), "copy_b_dgrad": ("dgrad", dgrad_copy_b),
            "swap_wgrad": ("wgrad", wgrad_swap)}


@contextlib.contextmanager
def patched_gemm(variant: str | None) -> Iterator[None]:
    """Route te_ops' ``grouped_mm`` calls of one GEMM kind through a layout variant."""
    if variant is None:
        yield
        return
    kind, fn = VARIANTS[variant]
    original = gg.grouped_mm

    def grouped_mm(a, b, offs):
        return fn(a, b, offs) if kind_of(a, b) == kind else original(a, b, offs)

    gg.grouped_mm = grouped_mm
    try:
        yield
    finally:
        gg.grouped_mm = original


# ---------------------------------------------------------------------------- the parts
def part_replay(shape, recs, device, args) -> list[dict]:
    peer = {c["name"]: c["operands"] for c in recs["torch_grouped_mm"].calls}
    mine = {c["name"]: c["operands"] for c in recs["te_ops_fused"].calls}
    out = []
    for name in sorted(peer):
        if name not in mine:
            continue
        (pa, pb, po), (ma, mb, mo) = peer[name], mine[name]
        ts = time_interleaved({
            "peer_operands": lambda pa=pa, pb=pb, po=po: torch._grouped_mm(pa, pb, offs=po),
            "te_ops_operands": lambda ma=ma, mb=mb, mo=mo: torch._grouped_mm(ma, mb, offs=mo),
        }, device, reps=args.reps, warmup=args.warmup)
        rec = {"part": "replay", "shape": shape, "gemm": name,
               "a_equal": bool(torch.equal(pa, ma)), "b_equal": bool(torch.equal(pb, mb))}
        for k, v in ts.items():
            rec[k] = stats(v)
        rec["te_over_peer"] = rec["te_ops_operands"]["ms_median"] / rec["peer_operands"][
            "ms_median"]
        out.append(rec)
    return out


def part_layout(shape, recs, device, args) -> list[dict]:
    out = []
    for c in recs["torch_grouped_mm"].calls:
        a, b, offs = c["operands"]
        kind = kind_of(a, b)
        ref = torch._grouped_mm(a, b, offs=offs)
        fns: dict[str, Callable[[], object]] = {
            "as_called": lambda a=a, b=b, o=offs: torch._grouped_mm(a, b, offs=o)}
        if kind == "fprop":
            b2 = b.contiguous()
            fns["copy_b"] = lambda a=a, b2=b2, o=offs: torch._grouped_mm(a, b2, offs=o)
            fns["copy_b_cost"] = lambda b=b: b.contiguous()
        elif kind == "dgrad":
            b2 = b.transpose(-2, -1).contiguous().transpose(-2, -1)
            fns["copy_b"] = lambda a=a, b2=b2, o=offs: torch._grouped_mm(a, b2, offs=o)
            fns["copy_b_cost"] = lambda b=b: b.transpose(-2, -1).contiguous()
        else:
            fns["swap"] = lambda a=a, b=b, o=offs: torch._grouped_mm(b.t(), a.t(), offs=o)
            fns["swap_cost"] = lambda r=ref: r.transpose(-2, -1).contiguous()
        rec = {"part": "layout", "shape": shape, "gemm": c["name"], "kind": kind,
               "a": c["a"], "b": c["b"]}
        diffs = {}
        for k, fn in fns.items():
            if k.endswith("_cost") or k == "as_called":
                continue
            r = fn()
            if k == "swap":
                r = r.transpose(-2, -1)
            diffs[k] = (r.float() - ref.float()).abs().max().item()
            diffs[k + "_bitwise"] = bool(torch.equal(r, ref))
            del r
        ts = time_interleaved(fns, device, reps=args.reps, warmup=args.warmup)
        for k, v in ts.items():
            rec[k] = stats(v)
        rec["max_abs_diff"] = diffs
        out.append(rec)
        del ref, fns
    return out


def part_power(shape, recs, device, args, sampler: ClockSampler) -> list[dict]:
    calls = [(c["name"], c["operands"]) for c in recs["te_ops_fused"].calls]
    big = max((op for _, ops in calls for op in ops[:2]), key=lambda t: t.numel())
    filler_src = torch.empty_like(big)
    filler_dst = torch.empty_like(big)
    out = []
    cuda = device.type == "cuda"
    results: dict[str, dict[str, list[float]]] = {"back_to_back": {}, "with_filler": {}}
    for _ in range(args.warmup):
        for _, (a, b, o) in calls:
            torch._grouped_mm(a, b, offs=o)
    for mode in ("back_to_back", "with_filler") * args.power_blocks:
        with sampler.phase(f"{shape}:power:{mode}"):
            evs = []
            for _ in range(max(1, args.reps // args.power_blocks)):
                for name, (a, b, o) in calls:
                    if mode == "with_filler":
                        filler_dst.copy_(filler_src)
                    if cuda:
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                            enable_timing=True)
                        s.record()
                        torch._grouped_mm(a, b, offs=o)
                        e.record()
                        evs.append((name, s, e))
                    else:
                        t0 = time.perf_counter()
                        torch._grouped_mm(a, b, offs=o)
                        results[mode].setdefault(name, []).append(
                            (time.perf_counter() - t0) * 1e3)
            if cuda:
                torch.cuda.synchronize()
                for name, s, e in evs:
                    results[mode].setdefault(name, []).append(s.elapsed_time(e))
    filler_ms = statistics.median(time_interleaved(
        {"copy": lambda: filler_dst.copy_(filler_src)}, device, reps=5, warmup=1)["copy"])
    for mode, per in results.items():
        rec = {"part": "power", "shape": shape, "mode": mode, "filler_ms": filler_ms,
               "gemms": {k: stats(v) for k, v in per.items()},
               "gemm_sum_of_medians_ms": sum(statistics.median(v) for v in per.values()),
               "clock": sampler.summary(f"{shape}:power:{mode}")}
        out.append(rec)
    return out


def part_step(shape, problem, device, args, sampler: ClockSampler) -> list[dict]:
    runs = [(p, None) for p in STEP_PEERS] + [("te_ops_fused", v) for v in VARIANTS]
    peers = {}
    for peer_name, variant in runs:
        label = peer_name + (f"+{variant}" if variant else "")
        peers[label] = (PEER_CLASSES[peer_name](problem), variant)
    x, probs, dy = problem.x, problem.probs, problem.dy

    def step_fn(peer, variant):
        params = peer.parameters()

        def step():
            with env_override(**peer.env), patched_gemm(variant):
                peer.forward(x, probs).backward(dy)
        return step, params

    fns = {}
    all_params = []
    for label, (peer, variant) in peers.items():
        fn, params = step_fn(peer, variant)
        fns[label] = fn
        all_params += params

    def clear():
        _clear(x, probs, all_params)

    with sampler.phase(f"{shape}:step"):
        ts = time_interleaved(fns, device, reps=args.step_reps, warmup=args.warmup,
                              between=clear)
    base = statistics.median(ts["torch_grouped_mm"])
    flops = problem.flops
    out = []
    for label, v in ts.items():
        s = stats(v)
        out.append({"part": "step", "shape": shape, "peer": label, **s,
                    "tflops": flops / (s["ms_median"] * 1e-3) / 1e12,
                    "ratio_vs_grouped_mm": base / s["ms_median"]})
    out.append({"part": "step_clock", "shape": shape, **sampler.summary(f"{shape}:step")})
    clear()
    del peers, fns
    return out


def part_blocks(shape, problem, device, args, sampler: ClockSampler) -> list[dict]:
    """The peer and ``te_ops_fused`` timed in alternating blocks of ``--block-steps`` steps
    (as a sequential benchmark runs them): the drift of the clock between blocks."""
    x, probs, dy = problem.x, problem.probs, problem.dy
    out = []
    peers = {n: PEER_CLASSES[n](problem) for n in ("torch_grouped_mm", "te_ops_fused")}
    for block in range(args.blocks):
        for name, peer in peers.items():
            params = peer.parameters()

            def step(peer=peer):
                with env_override(**peer.env):
                    peer.forward(x, probs).backward(dy)

            label = f"{shape}:block{block}:{name}"
            with sampler.phase(label):
                ts = time_interleaved({name: step}, device, reps=args.block_steps,
                                      warmup=1, between=lambda p=params: _clear(x, probs, p))
            out.append({"part": "blocks", "shape": shape, "block": block, "peer": name,
                        **stats(ts[name]), "clock": sampler.summary(label)})
    _clear(x, probs, [p for peer in peers.values() for p in peer.parameters()])
    return out


def part_profile(shape, problem, device, args) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    out = []
    for peer_name in ("torch_grouped_mm", "te_ops_fused"):
        peer = PEER_CLASSES[peer_name](problem)
        params = peer.parameters()
        x, probs, dy = problem.x, problem.probs, problem.dy
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                         else [])
        with env_override(**peer.env):
            for _ in range(2):
                _clear(x, probs, params)
                peer.forward(x, probs).backward(dy)
            if device.type == "cuda":
                torch.cuda.synchronize()
            with profile(activities=acts, record_shapes=True) as prof:
                for _ in range(args.profile_steps):
                    _clear(x, probs, params)
                    peer.forward(x, probs).backward(dy)
                if device.type == "cuda":
                    torch.cuda.synchronize()
        _clear(x, probs, params)
        path = os.path.join(args.trace_dir or tempfile.gettempdir(),
                            f"trace_{shape}_{peer_name}.json")
        prof.export_chrome_trace(path)
        out.append({"part": "profile", "shape": shape, "peer": peer_name,
                    "steps": args.profile_steps, **parse_trace(path)})
        if not args.trace_dir:
            os.remove(path)
        del peer, prof
        free_memory()
    return out


def parse_trace(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    ops = [e for e in events if e.get("cat") == "cpu_op" and e.get("name") == "aten::_grouped_mm"]
    rows = [{"name": k["name"], "us": k.get("dur"), "grid": k.get("args", {}).get("grid"),
             "block": k.get("args", {}).get("block"),
             "regs": k.get("args", {}).get("registers per thread"),
             "smem": k.get("args", {}).get("shared memory")} for k in kernels]
    gaps = []
    for prev, nxt in zip(kernels, kernels[1:]):
        gap = nxt["ts"] - (prev["ts"] + prev.get("dur", 0))
        if gap > 0:
            gaps.append((gap, prev["name"][:60], nxt["name"][:60]))
    busy = sum(k.get("dur", 0) for k in kernels)
    span = (kernels[-1]["ts"] + kernels[-1].get("dur", 0) - kernels[0]["ts"]) if kernels else 0
    return {
        "kernels": rows,
        "grouped_mm_inputs": [{"dims": o.get("args", {}).get("Input Dims"),
                               "strides": o.get("args", {}).get("Input Strides"),
                               "types": o.get("args", {}).get("Input type")} for o in ops],
        "busy_us": busy, "span_us": span, "idle_us": span - busy,
        "top_gaps": [{"us": g, "after": a, "before": b}
                     for g, a, b in sorted(gaps, reverse=True)[:8]],
    }


def part_dense(device, args, sampler: ClockSampler) -> list[dict]:
    """One dense ``--dense-size``^3 bf16 ``torch.mm`` (random data) timed twice: a burst of
    ``--reps`` products after 3 warm-ups and ``--dense-idle`` s of idle device, and the last
    ``--reps`` of ``--dense-sustain`` s of back-to-back products (power limit reached)."""
    n = args.dense_size
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = []
    for mode in ("burst", "sustained"):
        if device.type == "cuda":
            torch.cuda.synchronize()
        if mode == "burst":
            time.sleep(args.dense_idle)
        else:
            t_end = time.perf_counter() + args.dense_sustain
            while time.perf_counter() < t_end:
                for _ in range(50):
                    torch.mm(a, b)
                if device.type == "cuda":
                    torch.cuda.synchronize()
        with sampler.phase(f"dense:{mode}"):
            ts = time_interleaved({"mm": lambda: torch.mm(a, b)}, device, reps=args.reps,
                                  warmup=3 if mode == "burst" else 0)["mm"]
        s = stats(ts)
        out.append({"part": "dense", "mode": mode, "size": n, **s,
                    "tflops": 2 * n**3 / (s["ms_median"] * 1e-3) / 1e12,
                    "clock": sampler.summary(f"dense:{mode}")})
    return out


# ---------------------------------------------------------------------------------- main
def run_shape(name, shape, device, args, out: JsonLines, sampler: ClockSampler) -> None:
    free_memory()
    problem = make_problem(name, shape, device, torch.bfloat16, args.seed)
    parts = set(args.parts.split(","))
    recs = {}
    for peer_name in STEP_PEERS:
        peer = PEER_CLASSES[peer_name](problem)
        keep = peer_name != "te_ops_fused_single" and bool(parts & {"replay", "layout",
                                                                    "power"})
        recs[peer_name] = record_step(peer, problem, keep)
        del peer
        free_memory()
    if "pattern" in parts:
        for r in pattern_records(name, recs):
            out.write(r)
    for part, fn in (("replay", lambda: part_replay(name, recs, device, args)),
                     ("layout", lambda: part_layout(name, recs, device, args)),
                     ("power", lambda: part_power(name, recs, device, args, sampler))):
        if part in parts:
            _write_all(out, part, name, fn)
    recs.clear()
    free_memory()
    if "step" in parts:
        _write_all(out, "step", name, lambda: part_step(name, problem, device, args, sampler))
        free_memory()
    if "blocks" in parts:
        _write_all(out, "blocks", name, lambda: part_blocks(name, problem, device, args,
                                                            sampler))
        free_memory()
    if "profile" in parts:
        _write_all(out, "profile", name, lambda: part_profile(name, problem, device, args))


def _write_all(out: JsonLines, part: str, shape: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        for r in fn():
            out.write(r)
    except Exception as exc:  # one part failing must not stop the others
        out.write({"part": part, "shape": shape,
                   "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"})
    print(f"# {shape} {part}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def summarize(path: str) -> str:
    """Short text tables of a JSON-lines file written by this script."""
    lines: list[str] = []
    with open(path, encoding="utf-8") as f:
        recs = [json.loads(line) for line in f if line.startswith("{")]
    for r in recs:
        p, sh = r.get("part"), r.get("shape")
        if "error" in r:
            lines.append(f"{sh} {p}: ERROR {r['error']}")
        elif p == "pattern":
            a, b, o = r["a"], r["b"], r["out"]
            lines.append(f"{sh} pattern {r['peer']:<20} {r['name']:<10} a{a['shape']}{a['major']}"
                         f" b{b['shape']}{b['major']} out{o['shape']}{o['dtype']} same="
                         f"{r['same_as_peer']}")
        elif p == "pattern_copies":
            lines.append(f"{sh} copies  {r['peer']:<20} {r['counts']}")
        elif p == "replay":
            lines.append(f"{sh} replay {r['gemm']:<10} peer {r['peer_operands']['ms_median']:.3f}"
                         f" te_ops {r['te_ops_operands']['ms_median']:.3f} ms "
                         f"({r['te_over_peer']:.4f}x) a_eq={r['a_equal']} b_eq={r['b_equal']}")
        elif p == "layout":
            cols = " ".join(f"{k} {r[k]['ms_median']:.3f}" for k in
                            ("as_called", "copy_b", "copy_b_cost", "swap", "swap_cost") if k in r)
            lines.append(f"{sh} layout {r['gemm']:<10} {cols} diff {r['max_abs_diff']}")
        elif p == "power":
            c = r.get("clock", {})
            lines.append(f"{sh} power {r['mode']:<13} gemms {r['gemm_sum_of_medians_ms']:.3f} ms"
                         f" (filler {r['filler_ms']:.3f} ms) sm {c.get('sm_mhz_mean', 0):.0f} MHz"
                         f" [{c.get('sm_mhz_min', 0)}-{c.get('sm_mhz_max', 0)}] "
                         f"{c.get('power_w_mean', 0):.0f} W")
        elif p == "step":
            lines.append(f"{sh} step {r['peer']:<28} {r['ms_median']:8.3f} ms "
                         f"{r['tflops']:6.1f} TF/s x{r['ratio_vs_grouped_mm']:.3f}")
        elif p == "dense":
            c = r.get("clock", {})
            lines.append(f"dense {r['size']}^3 mm {r['mode']:<10} {r['ms_median']:.3f} ms "
                         f"{r['tflops']:.1f} TF/s sm {c.get('sm_mhz_mean', 0):.0f} MHz "
                         f"{c.get('power_w_mean', 0):.0f} W")
        elif p == "blocks":
            c = r.get("clock", {})
            lines.append(f"{sh} block {r['block']} {r['peer']:<20} {r['ms_median']:8.3f} ms"
                         f" sm {c.get('sm_mhz_mean', 0):.0f} MHz {c.get('power_w_mean', 0):.0f} W"
                         f" {c.get('temp_c_max', 0)} C")
        elif p == "step_clock":
            lines.append(f"{sh} step clock sm {r.get('sm_mhz_mean', 0):.0f} MHz "
                         f"[{r.get('sm_mhz_min', 0)}-{r.get('sm_mhz_max', 0)}] "
                         f"{r.get('power_w_mean', 0):.0f} W max {r.get('temp_c_max', 0)} C")
        elif p == "profile":
            gemm = [k for k in r["kernels"] if "cutlass" in k["name"]]
            lines.append(f"{sh} profile {r['peer']:<18} busy {r['busy_us'] / 1e3:.3f} span "
                         f"{r['span_us'] / 1e3:.3f} idle {r['idle_us'] / 1e3:.3f} ms; "
                         f"{len(gemm)} GEMM kernels " + ", ".join(
                             f"{k['us'] / 1e3:.3f}ms g{k['grid']}" for k in gemm[:6]))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default=None)
    parser.add_argument("--parts",
                        default="pattern,replay,layout,power,step,blocks,profile")
    parser.add_argument("--reps", type=int, default=24)
    parser.add_argument("--step-reps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--power-blocks", type=int, default=2)
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=2, help="alternating blocks per peer")
    parser.add_argument("--block-steps", type=int, default=12, help="timed steps per block")
    parser.add_argument("--dense-size", type=int, default=8192)
    parser.add_argument("--dense-idle", type=float, default=2.0, help="s idle before the burst")
    parser.add_argument("--dense-sustain", type=float, default=3.0,
                        help="s of back-to-back products before the sustained timing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace-dir", default=None, help="keep the chrome traces here")
    parser.add_argument("--out", default=None)
    parser.add_argument("--summarize", metavar="FILE", default=None)
    args = parser.parse_args(argv)
    check_file(parser, "--summarize", args.summarize)
    if args.summarize:
        return args
    check_device(parser, "--device", args.device)
    if args.shapes is not None:
        check_list(parser, "--shapes", args.shapes, {**SHAPES, **QUICK_SHAPES})
    check_list(parser, "--parts", args.parts, PARTS)
    for flag in ("--reps", "--step-reps", "--power-blocks", "--profile-steps", "--blocks",
                 "--block-steps", "--dense-size"):
        check_min(parser, flag, getattr(args, flag[2:].replace("-", "_")), 1)
    for flag in ("--warmup", "--dense-idle", "--dense-sustain"):
        check_min(parser, flag, getattr(args, flag[2:].replace("-", "_")), 0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    known = {**SHAPES, **QUICK_SHAPES}
    default = QUICK_SHAPES if args.quick else {k: v for k, v in SHAPES.items()
                                               if not k.startswith("E64")}
    names = args.shapes.split(",") if args.shapes else list(default)
    with recorded_run(args.out, summarize) as out:
        out.write({"bench": "gemm_call_patterns_run", **machine_info(device),
                   "device": device.type, "shapes": names, "parts": args.parts,
                   "reps": args.reps})
        sampler = ClockSampler(device.type == "cuda")
        if not sampler.ok:
            out.write({"part": "clock", "error": sampler.error})
        with sampler:
            if "dense" in args.parts.split(","):
                _write_all(out, "dense", "-", lambda: part_dense(device, args, sampler))
            for name in names:
                run_shape(name, known[name], device, args, out, sampler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
