"""A pool of ``torch.distributed`` worker processes for tests, started once and reused.

``DistPool(world, module)`` spawns ``world`` processes (``torch.multiprocessing``, the spawn
start method), each joining one process group (gloo on CPU, over a free local port) and
importing ``module`` (a file in tests/, found through the parent's ``sys.path``). Its
``setup(rank, world)``, if any, runs once per process (e.g. to make the subgroups every case
uses, in the same order on every rank). ``pool.run(name, **kwargs)`` calls
``module.name(**kwargs)`` on every rank at once and returns the ranks' results in rank order.

Time is bounded: the start and every case have a deadline; a rank that raises, or a case that
runs past its deadline (a hang in a collective), fails the call with the ranks' tracebacks or
a message naming the case, and the pool is shut down (the next call starts a fresh one, since
a failed collective leaves the ranks out of step). Collectives time out by themselves too
(the process group's ``timeout``).
"""

from __future__ import annotations

import datetime
import importlib
import os
import queue
import socket
import time
import traceback
from typing import Any

import torch.multiprocessing as mp

#: Seconds for the processes to start and join the group.
START_TIMEOUT = 180.0
#: Seconds for one case on every rank.
CASE_TIMEOUT = 120.0


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world: int, port: int, backend: str, module: str, inbox: Any,
           outbox: Any) -> None:
    import torch
    import torch.distributed as dist

    for name in [n for n in os.environ if n.startswith("TE_OPS_")]:
        del os.environ[name]  # cases set what they need
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=CASE_TIMEOUT / 2))
        cases = importlib.import_module(module)
        setup = getattr(cases, "setup", None)
        if setup is not None:
            setup(rank, world)
    except BaseException:
        outbox.put((rank, "error", traceback.format_exc()))
        return
    outbox.put((rank, "ready", None))
    while True:
        message = inbox.get()
        if message is None:
            break
        name, kwargs = message
        try:
            outbox.put((rank, "ok", getattr(cases, name)(**kwargs)))
        except BaseException:
            outbox.put((rank, "error", traceback.format_exc()))
    outbox.close()
    outbox.join_thread()
    os._exit(0)  # without the process group's teardown, which waits on the other ranks


class DistPool:
    """``world`` worker processes running the cases of ``module`` (see the module docstring)."""

    def __init__(self, world: int, module: str, backend: str = "gloo") -> None:
        self.world, self.module, self.backend = world, module, backend
        self.processes: list[Any] = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(self.world)]
        port = free_port()
        self.processes = [
            ctx.Process(target=_serve, args=(r, self.world, port, self.backend, self.module,
                                             self.inboxes[r], self.outbox), daemon=True)
            for r in range(self.world)]
        for p in self.processes:
            p.start()
        self._collect("the start (init_process_group and setup)", START_TIMEOUT)

    def _collect(self, what: str, timeout: float) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        end = time.monotonic() + timeout
        while len(results) + len(errors) < self.world:
            try:
                rank, status, payload = self.outbox.get(timeout=1.0)
            except queue.Empty:
                pending = [r for r in range(self.world) if r not in results and r not in errors]
                dead = [r for r in pending if not self.processes[r].is_alive()]
                if dead:
                    codes = [self.processes[r].exitcode for r in dead]
                    self.close()
                    raise AssertionError(f"{what}: rank(s) {dead} exited (exit codes {codes}) "
                                         "without an answer") from None
                if time.monotonic() > end:
                    self.close()
                    raise AssertionError(
                        f"{what}: rank(s) {pending} did not answer within {timeout:.0f} s (a "
                        "hang in a collective?); the pool was shut down") from None
                continue
            (errors if status == "error" else results)[rank] = payload
        if errors:
            self.close()
            text = "\n".join(f"--- rank {r}:\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"{what} failed on rank(s) {sorted(errors)}:\n{text}")
        return [results[r] for r in range(self.world)]

    def run(self, name: str, **kwargs: Any) -> list[Any]:
        """``module.name(**kwargs)`` on every rank; their results in rank order."""
        if not self.processes:
            self._start()
        for box in self.inboxes:
            box.put((name, kwargs))
        return self._collect(f"case {name}({kwargs})", CASE_TIMEOUT)

    def close(self) -> None:
        """Stop the workers (asked first, then terminated)."""
        for p, box in zip(self.processes, getattr(self, "inboxes", [])):
            if p.is_alive():
                box.put(None)
        end = time.monotonic() + 5
        for p in self.processes:
            p.join(timeout=max(0.1, end - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        self.processes = []
