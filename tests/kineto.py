"""Hand-built Kineto (Chrome trace) events for the CPU tests of the trace-reading benchmarks."""

from __future__ import annotations


def x_event(cat: str, name: str, ts: float, dur: float, corr: int | None = None) -> dict:
    """A complete ("X") event of category ``cat`` at ``ts`` us lasting ``dur`` us; ``corr``
    links a runtime call to the kernel it launched (``args.correlation``)."""
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e
