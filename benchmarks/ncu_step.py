"""Hardware counters of every kernel of one grouped-MLP forward+backward step (Nsight Compute).

At the H200's 700 W cap a step's time follows the energy it takes (docs/benchmarks.md, "Energy
per step at the power cap"), so two peers that issue the same MMAs differ in what else their
kernels move and execute. This script runs one step of one ``benchmarks/grouped_mlp.py`` peer
inside a CUDA profiler range, for ``ncu --profile-from-start off`` to read per kernel:

* ``gpu__time_duration.sum`` (ns; under replay, not the step's time at the power cap);
* ``dram__bytes_read.sum`` / ``dram__bytes_write.sum``: HBM traffic;
* ``lts__t_bytes.sum``: all L2 traffic (TMA / L1 loads and stores, atomics);
* ``smsp__inst_executed.sum``: warp instructions issued (spinning waits count);
* ``sm__cycles_elapsed.avg.per_second``: the SM clock during the replay.

Run it under ncu (the device's Nsight Compute; ``--clock-control none`` leaves the clocks as
the card has them, as the device notes ask)::

    ncu --clock-control none --profile-from-start off --csv --page raw \\
        --metrics $(python benchmarks/ncu_step.py --metrics) \\
        python benchmarks/ncu_step.py --shape E32_T32768_H7168_FF2048 --peer te_ops_fused_single \\
        > e32_te.csv
    python benchmarks/ncu_step.py --summarize e32_te.csv e32_torch.csv

``--summarize`` prints one table per CSV (kernels in launch order, short names) and the step's
totals, and, for two or more CSVs, each total as a ratio to the first file's.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import sys

METRICS = (
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "lts__t_bytes.sum",
    "smsp__inst_executed.sum",
    "sm__cycles_elapsed.avg.per_second",
)
_TOTALS = METRICS[:5]

#: Factor to the base unit (bytes, ns, Hz, instructions) of each unit ncu writes in the units
#: row: the long names of older releases and the short ones (``ns``, ``hz``) of the H200's.
_SCALE = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
          "ns": 1, "us": 1e3, "ms": 1e6, "s": 1e9,
          "nsecond": 1, "usecond": 1e3, "msecond": 1e6, "second": 1e9,
          "hz": 1, "khz": 1e3, "Khz": 1e3, "Mhz": 1e6, "MHz": 1e6, "Ghz": 1e9, "GHz": 1e9,
          "cycle/nsecond": 1e9, "cycle/usecond": 1e6, "cycle/second": 1,
          "inst": 1, "Kinst": 1e3, "Minst": 1e6, "Ginst": 1e9, "": 1}


def run_step(shape: str, peer: str, warmup: int) -> None:
    """``warmup`` untimed steps, then one step between cudaProfilerStart / Stop."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import warmed_peer
    from grouped_mlp import SHAPES, make_problem

    if shape not in SHAPES:
        raise SystemExit(f"--shape: expected one of {', '.join(SHAPES)}, got {shape!r}")
    problem = make_problem(shape, SHAPES[shape], torch.device("cuda"), torch.bfloat16, 0)
    with warmed_peer(peer, problem, warmup) as step:
        torch.cuda.cudart().cudaProfilerStart()
        step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def _number(text: str) -> float:
    return float(text.replace(",", "")) if text not in ("", "n/a") else float("nan")


def read_csv(path: str) -> list[dict[str, float | str]]:
    """Kernels of an ``ncu --csv --page raw`` file: name plus the metrics in :data:`METRICS`.
    Values are converted to base units (bytes, ns, Hz) using the units row; a unit not in
    :data:`_SCALE` raises (ValueError naming the file, metric and unit) rather than being
    read as a base unit."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    start = text.find('"ID"')
    if start < 0:
        raise ValueError(f"{path}: no ncu CSV header (a line starting with \"ID\") found")
    rows = list(csv.reader(io.StringIO(text[start:])))
    header, units, body = rows[0], rows[1], rows[2:]
    if "Kernel Name" not in header:
        raise ValueError(f"{path}: the ncu CSV header has no \"Kernel Name\" column")
    columns = {m: header.index(m) for m in METRICS if m in header}
    for m, i in columns.items():
        if units[i] not in _SCALE:
            raise ValueError(f"{path}: metric {m} in unit {units[i]!r}, expected one of "
                             f"{sorted(_SCALE)}")
    kernels = []
    for row in body:
        if len(row) != len(header):
            continue
        rec: dict[str, float | str] = {"name": row[header.index("Kernel Name")]}
        for m, i in columns.items():
            rec[m] = _number(row[i]) * _SCALE[units[i]]
        kernels.append(rec)
    return kernels


def short_name(name: str) -> str:
    """Kernel name without return type, namespaces, template arguments and parameters, at
    most 48 characters (``<unnamed>`` / ``(anonymous namespace)`` namespaces dropped too)."""
    if name.startswith("void "):
        name = name[len("void "):]
    name = name.replace("<unnamed>::", "").replace("(anonymous namespace)::", "")
    kept, depth = [], 0
    for ch in name:
        if ch == "(" and depth == 0:
            break  # the parameter list
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(depth - 1, 0)
        elif depth == 0:
            kept.append(ch)
    return "".join(kept).split("::")[-1].strip()[:48]


def summarize(paths: list[str]) -> str:
    lines, totals = [], []
    for path in paths:
        kernels = read_csv(path)
        lines.append(f"== {path}: {len(kernels)} kernels")
        lines.append(f"{'kernel':48s} {'us':>9s} {'DRAM rd MB':>11s} {'DRAM wr MB':>11s} "
                     f"{'L2 MB':>9s} {'Minst':>9s} {'MHz':>6s}")
        for k in kernels:
            lines.append(
                f"{short_name(str(k['name'])):48s} {k.get(METRICS[0], 0) / 1e3:9.1f} "
                f"{k.get(METRICS[1], 0) / 1e6:11.1f} {k.get(METRICS[2], 0) / 1e6:11.1f} "
                f"{k.get(METRICS[3], 0) / 1e6:9.1f} {k.get(METRICS[4], 0) / 1e6:9.2f} "
                f"{k.get(METRICS[5], 0) / 1e6:6.0f}")
        total = {m: sum(float(k.get(m, 0.0)) for k in kernels) for m in _TOTALS}
        totals.append(total)
        lines.append(f"{'TOTAL':48s} {total[METRICS[0]] / 1e3:9.1f} "
                     f"{total[METRICS[1]] / 1e6:11.1f} {total[METRICS[2]] / 1e6:11.1f} "
                     f"{total[METRICS[3]] / 1e6:9.1f} {total[METRICS[4]] / 1e6:9.2f}")
    if len(paths) > 1:
        lines.append("== totals / first file's")
        for path, total in zip(paths[1:], totals[1:]):
            ratio = "  ".join(
                f"{m.split('.')[0]} {total[m] / totals[0][m]:.3f}" if totals[0][m] else
                f"{m.split('.')[0]} -" for m in _TOTALS)
            lines.append(f"{path}: {ratio}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", help="a shape of grouped_mlp.SHAPES")
    parser.add_argument("--peer", help="a peer of grouped_mlp.PEER_CLASSES")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--metrics", action="store_true",
                        help="print the comma-separated metric list for ncu --metrics")
    parser.add_argument("--summarize", nargs="+", metavar="CSV")
    args = parser.parse_args(argv)
    if args.metrics:
        print(",".join(METRICS))
        return 0
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    if not args.shape or not args.peer:
        parser.error("--shape and --peer are required to run a step "
                     f"(got --shape={args.shape!r}, --peer={args.peer!r})")
    if args.warmup < 1:
        parser.error(f"--warmup: expected >= 1 (Triton compiles on the first step), "
                     f"got {args.warmup}")
    run_step(args.shape, args.peer, args.warmup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
