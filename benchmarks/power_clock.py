"""SM clock, board power and energy per step of back-to-back grouped-MLP steps (CUDA, NVML).

The H200 here runs at a 700 W power cap: a step that does its work in fewer cycles can still
run at a lower clock, so the time ratio between two peers in steady state is about the ratio
of the energy each step takes. This script runs each peer of ``benchmarks/grouped_mlp.py``
for ``--steps`` back-to-back forward+backward steps (after ``--warmup``) while a thread reads
NVML every ``--interval-ms``: SM clock (MHz), board power (W), temperature (C) and whether
the clock was held back by the power cap or a thermal limit
(``nvmlDeviceGetCurrentClocksEventReasons``), and the instantaneous power where NVML has it.
Per peer it prints the median step time (CUDA events), the mean clock and power over the
timed steps, the share of samples throttled by power / thermal limits, and the energy per
step (mean power x wall time / steps, J). ``nvmlDeviceGetPowerUsage`` averages over about a
second on recent drivers, so the energy is approximate, and too low for runs shorter than
that window (the E128 peers: 150 steps take ~0.6 s); the instantaneous mean is printed too
(``inst W``; NaN where unavailable).

Needs ``nvidia-ml-py`` (``import pynvml``). Usage::

    python benchmarks/power_clock.py --shapes E32_T32768_H7168_FF2048 \
        --peers torch_grouped_mm,te_ops_fused_single --steps 60 --out power.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import free_memory, warmed_peer  # noqa: E402
from grouped_mlp import PEER_CLASSES, SHAPES, make_problem  # noqa: E402

# NVML clocks-event reason bits (nvml.h: nvmlClocksEventReason*)
_POWER_CAP = 0x4          # SwPowerCap
_HW_SLOWDOWN = 0x8        # HwSlowdown (thermal or power brake)
_SW_THERMAL = 0x20        # SwThermalSlowdown
_HW_THERMAL = 0x40        # HwThermalSlowdown
_HW_POWER_BRAKE = 0x80    # HwPowerBrakeSlowdown


def instant_power_w(pynvml, handle) -> float:
    """Instantaneous board power in W (``NVML_FI_DEV_POWER_INSTANT``), NaN where the driver or
    nvidia-ml-py lacks it (``nvmlDeviceGetPowerUsage`` is an average over about 1 s on
    recent drivers: longer than one step). Also ``benchmarks/sustained_gemm.py``'s reading."""
    fid = getattr(pynvml, "NVML_FI_DEV_POWER_INSTANT", None)
    if fid is None:
        return float("nan")
    try:
        value = pynvml.nvmlDeviceGetFieldValues(handle, [fid])[0]
    except pynvml.NVMLError:
        return float("nan")
    return value.value.uiVal / 1000.0 if value.nvmlReturn == 0 else float("nan")


class Sampler:
    """A thread that reads NVML every ``interval_s`` seconds until :meth:`stop`."""

    def __init__(self, pynvml, handle, interval_s: float) -> None:
        self.nv, self.handle, self.interval_s = pynvml, handle, interval_s
        self.samples: list[tuple[float, int, float, int, int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        nv, h = self.nv, self.handle
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nv.nvmlDeviceGetCurrentClocksThrottleReasons
        while not self._stop.is_set():
            self.samples.append((
                time.perf_counter(),
                nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
                nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
                reasons(h),
                instant_power_w(nv, h)))
            time.sleep(self.interval_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def nvml_index(cuda_index: int) -> int:
    """NVML's index of CUDA device ``cuda_index`` under ``CUDA_VISIBLE_DEVICES`` (torch's
    ``torch.cuda._get_nvml_device_index``, which ``torch.cuda.power_draw`` uses; without it,
    only the identity when the variable is unset, else ValueError)."""
    mapper = getattr(torch.cuda, "_get_nvml_device_index", None)
    if mapper is not None:
        return mapper(cuda_index)
    if os.environ.get("CUDA_VISIBLE_DEVICES") is None:
        return cuda_index
    raise ValueError("cannot map CUDA device to its NVML index with CUDA_VISIBLE_DEVICES="
                     f"{os.environ['CUDA_VISIBLE_DEVICES']!r} in this torch")


def measure(peer_name: str, problem, steps: int, warmup: int, interval_s: float,
            pynvml, handle) -> dict:
    with warmed_peer(peer_name, problem, warmup) as step:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        with Sampler(pynvml, handle, interval_s) as sampler:
            t0 = time.perf_counter()
            events[0].record()
            for i in range(steps):
                step()
                events[i + 1].record()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
    ms = [events[i].elapsed_time(events[i + 1]) for i in range(steps)]
    busy = [s for s in sampler.samples if t0 <= s[0] <= t1]
    power = statistics.fmean(s[2] for s in busy) if busy else float("nan")
    wall = t1 - t0
    record = {
        "bench": "power_clock", "shape": problem.name, "peer": peer_name, "steps": steps,
        "ms_median": statistics.median(ms), "ms_first": ms[0], "ms_last": ms[-1],
        "samples": len(busy),
        "sm_mhz_mean": statistics.fmean(s[1] for s in busy) if busy else None,
        "sm_mhz_min": min((s[1] for s in busy), default=None),
        "power_w_mean": power,
        "power_instant_w_mean": statistics.fmean(s[5] for s in busy) if busy else None,
        "temp_c_max": max((s[3] for s in busy), default=None),
        "power_capped_share": (sum(bool(s[4] & (_POWER_CAP | _HW_POWER_BRAKE)) for s in busy)
                               / len(busy)) if busy else None,
        "thermal_share": (sum(bool(s[4] & (_SW_THERMAL | _HW_THERMAL | _HW_SLOWDOWN))
                              for s in busy) / len(busy)) if busy else None,
        "joules_per_step": power * wall / steps,
    }
    del step
    free_memory()
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="E8_T16384_H4096_FF14336,E32_T32768_H7168_FF2048")
    parser.add_argument("--peers", default="torch_grouped_mm,te_ops_fused_single")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--interval-ms", type=float, default=20.0)
    parser.add_argument("--rest-s", type=float, default=2.0,
                        help="idle seconds before each peer (the board cools a little)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be >= 2, got {args.steps}")
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; known: {sorted(SHAPES)}")
    bad = [p for p in args.peers.split(",") if p not in PEER_CLASSES]
    if bad:
        parser.error(f"--peers: unknown {bad}; known: {sorted(PEER_CLASSES)}")
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    index = torch.cuda.current_device()
    # NVML numbers the physical GPUs; CUDA_VISIBLE_DEVICES renumbers CUDA's (a lane pinned to
    # GPU 1 sees it as device 0): torch maps one to the other
    handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index(index))
    limit = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0
    print(f"# power limit {limit:.0f} W, GPU {torch.cuda.get_device_name(index)}")
    print(f"{'shape':26} {'peer':22} {'ms':>8} {'first':>7} {'MHz':>6} {'W':>6} "
          f"{'inst W':>6} {'capped':>6} {'J/step':>7}")
    for name in args.shapes.split(","):
        problem = make_problem(name, SHAPES[name], torch.device("cuda"), torch.bfloat16, 0)
        for peer in args.peers.split(","):
            time.sleep(args.rest_s)
            r = measure(peer, problem, args.steps, args.warmup, args.interval_ms / 1000.0,
                        pynvml, handle)
            r["power_limit_w"] = limit
            print(f"{name:26} {peer:22} {r['ms_median']:8.3f} {r['ms_first']:7.3f} "
                  f"{r['sm_mhz_mean'] or 0:6.0f} {r['power_w_mean']:6.0f} "
                  f"{r['power_instant_w_mean'] or float('nan'):6.0f} "
                  f"{r['power_capped_share'] or 0:6.2f} {r['joules_per_step']:7.3f}", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(r) + "\n")
        del problem
        free_memory()
    return 0


if __name__ == "__main__":
    sys.exit(main())
