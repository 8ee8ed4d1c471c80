"""Host work of one grouped-MLP forward+backward step, counted (not timed): aten ops and Python
function calls per step, for the peers of ``benchmarks/grouped_mlp.py`` on the CPU.

Counts do not depend on the machine or its load, unlike the CPU times of ``grouped_mlp.py
--interleaved`` (docs/benchmarks.md, "Host overhead"), so they show what a change removed:

``aten``
    every aten op dispatched during the step (``TorchDispatchMode``; forward, and backward,
    which the autograd engine runs on this thread on the CPU), by name;
``python``
    Python-level function calls during the step (``cProfile``; C functions and methods
    included), in total and in te_ops' own functions.

``--device-like`` counts what a CUDA step of the same code dispatches: the split sizes' total
is hidden from the host (on the CPU te_ops reads it from host memory and skips the padding
passes; on a GPU it is on the device), and the calls that are one Triton kernel on CUDA
(padding-row zeroing, SwiGLU forward and backward) count as one ``[launch]`` each, their CPU
ops not counted. ``--stub-gemm`` also times the step (median CPU time of this thread,
interleaved) with ``aten::_grouped_mm``'s CPU kernel replaced by a zero-filled output,
so that every peer's step is host work only (dispatch, Python, autograd).

Usage::

    python benchmarks/host_ops.py [--peers torch_grouped_mm,te_ops_fused_single] \
        [--shapes E64_T256_H64_FF32] [--device-like] [--stub-gemm] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import JsonLines, env_override, machine_info  # noqa: E402
from grouped_mlp import HOST_SHAPES, PEER_CLASSES, QUICK_SHAPES, make_problem  # noqa: E402

import te_ops.basic.swiglu  # noqa: E402
import te_ops.fast_step  # noqa: E402
import te_ops.fused.grouped_mlp  # noqa: E402
import te_ops.gemm.dispatch  # noqa: E402
import te_ops.splits  # noqa: E402


class _Counter(TorchDispatchMode):
    """Counts aten ops by name; ``hidden`` > 0 (inside a stand-in launch) counts nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.hidden = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.hidden:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


_ACTIVE: list[_Counter] = []


def _as_launch(name: str, fn):
    """``fn`` counted as one ``[launch] name`` (its ops hidden) while a counter is active."""
    def wrapped(*args, **kwargs):
        mode = _ACTIVE[-1] if _ACTIVE else None
        if mode is None:
            return fn(*args, **kwargs)
        if not mode.hidden:
            mode.counts[f"[launch] {name}"] += 1
        mode.hidden += 1
        try:
            return fn(*args, **kwargs)
        finally:
            mode.hidden -= 1
    return wrapped


def device_like() -> None:
    """Patch te_ops for ``--device-like`` counting (see the module docstring)."""
    te_ops.splits._cpu_has_padding = lambda ends, num_rows: None
    gg = te_ops.gemm.dispatch
    gg.zero_padding_rows_ = _as_launch("zero_rows", gg.zero_padding_rows_)
    fwd = _as_launch("swiglu_fwd", te_ops.basic.swiglu.swiglu_forward)
    bwd = _as_launch("swiglu_bwd", te_ops.basic.swiglu.swiglu_backward)
    # fused, unfused and fast-path callers
    for module in (te_ops.fused.grouped_mlp, te_ops.basic.swiglu, te_ops.fast_step):
        module.swiglu_forward, module.swiglu_backward = fwd, bwd


_STUB_LIB: list = []


def stub_gemm() -> None:
    """Replace ``aten::_grouped_mm``'s CPU kernel with a zero-filled output of its shape."""
    lib = torch.library.Library("aten", "IMPL")

    def fake(a, b, offs=None, bias=None, out_dtype=None):
        if a.dim() == 2 and b.dim() == 3:  # zeros: no NaN or denormal garbage downstream
            return a.new_zeros(a.shape[0], b.shape[2])
        return a.new_zeros(offs.shape[0], a.shape[0], b.shape[1])

    lib.impl("_grouped_mm", fake, "CPU")
    _STUB_LIB.append(lib)  # the override lives as long as the library object


def _zero_grads(peer, problem) -> None:
    problem.x.grad = problem.probs.grad = None
    for p in peer.parameters():
        p.grad = None


def count_step(peer, problem) -> dict:
    """aten ops and Python calls of one step (after two warm-up steps)."""
    x, probs, dy = problem.x, problem.probs, problem.dy
    with env_override(**peer.env):
        for _ in range(2):
            _zero_grads(peer, problem)
            peer.forward(x, probs).backward(dy)
        _zero_grads(peer, problem)
        mode = _Counter()
        _ACTIVE.append(mode)
        try:
            with mode:
                peer.forward(x, probs).backward(dy)
        finally:
            _ACTIVE.pop()
        _zero_grads(peer, problem)
        prof = cProfile.Profile()
        prof.enable()
        peer.forward(x, probs).backward(dy)
        prof.disable()
    stats = pstats.Stats(prof).stats
    here = os.path.abspath(__file__)
    calls = sum(s[1] for (f, _, _), s in stats.items() if f != here)
    te_calls = sum(s[1] for (f, _, _), s in stats.items()
                   if f"{os.sep}te_ops{os.sep}" in f)
    launches = {k: v for k, v in mode.counts.items() if k.startswith("[launch]")}
    aten = {k: v for k, v in mode.counts.items() if not k.startswith("[launch]")}
    return {"aten_ops": sum(aten.values()), "launches": sum(launches.values()),
            "aten_by_name": dict(sorted(aten.items(), key=lambda kv: -kv[1])),
            "launch_by_name": launches, "python_calls": calls, "te_ops_python_calls": te_calls}


def time_steps(peers, problem, iters: int, warmup: int) -> list[float]:
    """Median CPU time (ms) of this thread per step, peers interleaved."""
    times: list[list[float]] = [[] for _ in peers]
    for i in range(warmup + iters):
        for peer, ts in zip(peers, times):
            with env_override(**peer.env):
                _zero_grads(peer, problem)
                c0 = time.thread_time()
                peer.forward(problem.x, problem.probs).backward(problem.dy)
                if i >= warmup:
                    ts.append((time.thread_time() - c0) * 1e3)
    return [statistics.median(ts) for ts in times]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default="torch_grouped_mm,te_ops_fused_single,te_ops_fused,"
                                           "te_ops_unfused")
    parser.add_argument("--shapes", default="E64_T256_H64_FF32")
    parser.add_argument("--device-like", action="store_true",
                        help="count what a CUDA step dispatches (see the module docstring)")
    parser.add_argument("--stub-gemm", action="store_true",
                        help="also time the steps with the CPU GEMM kernel stubbed out")
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--out", default=None, help="also append JSON lines to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    shapes = {**HOST_SHAPES, **QUICK_SHAPES}
    names = args.peers.split(",")
    bad = [p for p in names if p not in PEER_CLASSES] + [
        s for s in args.shapes.split(",") if s not in shapes]
    if bad:
        parser.error(f"unknown peers/shapes {bad}; shapes: {list(shapes)}")
    if args.device_like:
        device_like()
    if args.stub_gemm:
        stub_gemm()
    out = JsonLines(args.out)
    out.write({"bench": "host_ops_run", **machine_info(torch.device("cpu")),
               "device_like": args.device_like, "stub_gemm": args.stub_gemm})
    try:
        for shape in args.shapes.split(","):
            problem = make_problem(shape, shapes[shape], torch.device("cpu"), torch.float32, 0)
            peers = [PEER_CLASSES[n](problem) for n in names]
            cpu_ms = (time_steps(peers, problem, args.iters, args.warmup) if args.stub_gemm
                      else [None] * len(peers))
            for name, peer, ms in zip(names, peers, cpu_ms):
                record = {"bench": "host_ops", "shape": shape, "peer": name,
                          "device_like": args.device_like, **count_step(peer, problem)}
                if ms is not None:
                    record["stub_gemm_cpu_ms_median"] = ms
                out.write(record)
    finally:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
