"""Shared helpers of the benchmarks: timing, memory, environment toggles, JSON lines."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import torch

__all__ = [
    "fwd_bwd_step",
    "env_override",
    "time_steps",
    "peak_memory_mib",
    "free_memory",
    "machine_info",
    "JsonLines",
    "check_list",
    "check_min",
    "check_file",
    "read_records",
    "add_out_argument",
    "out_path",
    "error_text",
    "run_and_summarize",
]


def add_out_argument(parser: Any, bench: str) -> None:
    """``--out DIR``: the folder a run writes its files to (default ``runs/<bench>`` under the
    current directory); raw results are never tracked in the repository."""
    parser.add_argument("--out", default=os.path.join("runs", bench), metavar="DIR",
                        help=f"output folder (default: runs/{bench})")


def out_path(folder: str, name: str) -> str:
    """``folder/name``, the folder created when missing; an existing file of that name is
    replaced (one run, one file)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    if os.path.exists(path):
        os.remove(path)
    return path


def check_list(parser: Any, flag: str, text: str, known: Any) -> list[str]:
    """Split the comma-separated ``text`` of ``flag``; ``parser.error`` (exit 2) naming the
    flag, the unknown entries and the known ones when an entry is empty or not in ``known``."""
    items = text.split(",")
    bad = [item for item in items if item not in known]
    if bad:
        parser.error(f"{flag}: unknown {bad} in {text!r}, expected a comma-separated subset of "
                     f"{list(known)}")
    return items


def check_min(parser: Any, flag: str, value: float, minimum: float) -> None:
    """``parser.error`` naming ``flag`` when ``value < minimum``."""
    if value < minimum:
        parser.error(f"{flag} must be >= {minimum}, got {value}")


def check_file(parser: Any, flag: str, path: str | None) -> None:
    """``parser.error`` naming ``flag`` when ``path`` is given but is not a readable file."""
    if path is not None and not os.path.isfile(path):
        parser.error(f"{flag}: expected an existing file, got {path!r}")








@contextlib.contextmanager
def env_override(**values: str | None) -> Iterator[None]:
    """Set (or, with ``None``, unset) environment variables for the block; restore after."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        _set_env(values)
        yield
    finally:
        _set_env(saved)


def _set_env(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], None], device: torch.device, *, warmup: int, iters: int,
               before: Callable[[], None] | None = None) -> list[float]:
    """Milliseconds of each of ``iters`` timed calls of ``step`` after ``warmup`` untimed ones.

    CUDA: one pair of events around each call (device time, launch gaps included);
    CPU: ``time.perf_counter``. ``before`` runs untimed before every call (e.g. zeroing grads).
    """
    for _ in range(warmup):
        if before is not None:
            before()
        step()
    _sync(device)
    times: list[float] = []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for start, end in events:
            if before is not None:
                before()
            start.record()
            step()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(iters):
            if before is not None:
                before()
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def summarize_times(times: list[float]) -> dict[str, float]:
    """Median, min and 10th/90th percentiles (ms)."""
    ordered = sorted(times)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]

    return {
        "ms_median": statistics.median(ordered),
        "ms_min": ordered[0],
        "ms_p10": pct(0.1),
        "ms_p90": pct(0.9),
    }


def peak_memory_mib(step: Callable[[], None], device: torch.device, baseline_bytes: int,
                    before: Callable[[], None] | None = None) -> float | None:
    """Peak allocated memory of one call of ``step`` minus ``baseline_bytes``, in MiB (CUDA only).

    Memory already allocated when the call starts (inputs, a CUDA graph's private pool) counts
    as part of the peak, as it is live during the step.
    """
    if device.type != "cuda":
        return None
    if before is not None:
        before()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - baseline_bytes) / 2**20


def fwd_bwd_step(peer: Any, problem: Any) -> Callable[[], None]:
    """One training step of a benchmark peer on a problem: grads of x, probs and the peer's
    parameters cleared, then forward and backward with the problem's output gradient."""
    params = peer.parameters()
    x, probs, dy = problem.x, problem.probs, problem.dy

    def step() -> None:
        x.grad = None
        probs.grad = None
        for p in params:
            p.grad = None
        peer.forward(x, probs).backward(dy)

    return step


def free_memory() -> None:
    """Collect garbage and return cached CUDA blocks (between peers)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def machine_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "host": platform.node()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        info["capability"] = f"{major}.{minor}"
        info["cuda"] = torch.version.cuda
    else:
        info["cpu"] = platform.processor() or platform.machine()
        info["threads"] = torch.get_num_threads()
    return info


def append_jsonl(path: str | None, records: list[dict[str, Any]]) -> None:
    """Append ``records`` to the JSON-lines file ``path`` (nothing when ``path`` is None)."""
    if path:
        with open(path, "a", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")


def read_records(path: str, bench: str) -> list[dict[str, Any]]:
    """The records of ``bench`` (their ``"bench"`` field) in a JSON-lines file; lines that are
    not JSON objects are skipped (a log with text around the records works too)."""
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.startswith("{")]
    return [r for r in records if r.get("bench") == bench]


class JsonLines:
    """Writes one JSON object per line to stdout and, when given, appends it to a file."""

    def __init__(self, path: str | None) -> None:
        self.file: TextIO | None = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=False)
        print(line, flush=True)
        if self.file is not None:
            self.file.write(line + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


@contextlib.contextmanager
def recorded_run(path: str | None, summarize: Callable[[str], str]) -> Iterator[JsonLines]:
    """The run's :class:`JsonLines` (stdout, and ``path`` when given), closed when the block
    ends; after a block that finished, the benchmark's ``summarize(path)`` table on stderr
    when ``path`` was given."""
    out = JsonLines(path)
    try:
        yield out
    finally:
        out.close()
    if path:
        print(summarize(path), file=sys.stderr)


def error_text(exc: BaseException) -> str:
    """A record's ``error`` / ``skipped`` text for an exception one peer raised (its type and
    first message line, at most 300 characters); the traceback goes to stderr."""
    import traceback

    traceback.print_exc(file=sys.stderr)
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def run_and_summarize(folder: str, bench: str, run_record: dict[str, Any],
                      run: Callable[[JsonLines], None], summarize: Callable[[str], str]) -> int:
    """A benchmark's run: ``folder/<bench>.jsonl`` gets ``run_record`` and whatever ``run``
    writes, ``folder/summary.txt`` the ``summarize`` table, which is also printed. Returns 0,
    or 1 when a record holds an ``"error"``."""
    path = out_path(folder, f"{bench}.jsonl")
    out = JsonLines(path)
    try:
        out.write(run_record)
        run(out)
    finally:
        out.close()
    table = summarize(path)
    with open(os.path.join(folder, "summary.txt"), "w", encoding="utf-8") as f:
        f.write(table + "\n")
    print(table)
    with open(path, encoding="utf-8") as f:
        failed = any('"error"' in line for line in f)
    return 1 if failed else 0
