"""Run one pytest command as N processes at once, each on a disjoint shard of the tests.

Used by ``scripts/gpu_check.sh``'s ``cuda_tests`` step: the GPU tests are mostly small kernels
and compiles that leave the H200 (and the host's cores) idle, so three processes on one GPU
finish in about a third of the time of one. Each process gets ``TEST_SHARD=k/n``
(``tests/conftest.py`` keeps the tests whose node id hashes to shard k); its output goes to
``<log-dir>/<name>_shard<k>.log``. When all are done this prints every shard's summary line and
one combined line in pytest's words (``N passed, M skipped, ... in T s``) and exits with the
first non-zero status of a shard (0 when all passed).

    python scripts/sharded_pytest.py --shards 3 --log-dir $OUT --name cuda_tests -- -q -m cuda tests
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|xfailed|xpassed|errors?|warnings?)")


def tally(text: str) -> Counter:
    """Counts from pytest's last summary line in ``text`` (``'3 passed, 1 skipped in 2.0s'``)."""
    lines = [ln for ln in text.splitlines() if re.search(r" in [0-9.]+s", ln) and _COUNT.search(ln)]
    counts: Counter = Counter()
    if lines:
        for number, word in _COUNT.findall(lines[-1]):
            plural = word.startswith(("error", "warning"))
            counts[word.rstrip("s") if plural else word] += int(number)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=3, help="processes (default 3)")
    parser.add_argument("--log-dir", type=Path, default=Path("."), help="where shard logs go")
    parser.add_argument("--name", default="pytest", help="shard log name prefix")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER,
                        help="arguments after '--' go to `python -m pytest`")
    args = parser.parse_args(argv)
    if args.shards < 1:
        parser.error(f"--shards must be >= 1, got {args.shards}")
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    args.log_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    procs = []
    for k in range(args.shards):
        log = args.log_dir / f"{args.name}_shard{k}.log"
        env = {**os.environ, "TEST_SHARD": f"{k}/{args.shards}"}
        with open(log, "w") as fh:
            procs.append((log, subprocess.Popen([sys.executable, "-m", "pytest", *pytest_args],
                                                stdout=fh, stderr=subprocess.STDOUT, env=env)))
    codes = [proc.wait() for _, proc in procs]
    total: Counter = Counter()
    for k, ((log, _), code) in enumerate(zip(procs, codes)):
        text = log.read_text(errors="replace")
        total += tally(text)
        print(f"--- shard {k}/{args.shards} (rc {code}): {log}")
        for line in text.splitlines():
            if ("slowest" in line or re.match(r"[0-9.]+s (call|setup|teardown) ", line)
                    or line.startswith(("FAILED ", "ERROR "))):
                print(line)
        print(text.rstrip().splitlines()[-1] if text.strip() else "(no output)")
    # "deselected" is left out: every shard deselects the others' tests.
    order = ["failed", "passed", "skipped", "xfailed", "xpassed", "error", "warning"]
    words = ", ".join(f"{total[w]} {w}{'s' if w in ('error', 'warning') and total[w] != 1 else ''}"
                      for w in order if total[w])
    print(f"{words or 'no tests ran'} in {time.monotonic() - start:.2f}s ({args.shards} shards)")
    return next((c for c in codes if c != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
