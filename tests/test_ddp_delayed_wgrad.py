"""Delayed wgrad under DistributedDataParallel / fully_shard (2 gloo processes,
tests/ddp_delayed_wgrad_check.py): refused with an error naming the wrapper (the gradients
backward_dw() computes come after the wrapper's reduction), and right under DDP.no_sync() with
a hand all-reduce after backward_dw()."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_delayed_wgrad_under_ddp_and_fsdp2_is_refused_gloo():
    script = Path(__file__).with_name("ddp_delayed_wgrad_check.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "OMP_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("TE_OPS_")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--standalone", str(script)],
        capture_output=True, text=True, env=env, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("delayed_wgrad_check OK") == 2, proc.stdout
