"""``benchmarks/host_ab.py``'s command line: a missing baseline package is a clear error that
says how to make one (not an import traceback)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import host_ab  # noqa: E402


def test_missing_baseline_names_make_baseline(capsys):
    with pytest.raises(SystemExit) as info:
        host_ab.main(["--baseline", "te_ops_no_such_baseline", "--device", "cpu"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--baseline 'te_ops_no_such_baseline' cannot be imported" in err
    assert "--make-baseline SRC DEST" in err


def test_threads_must_be_positive(capsys):
    with pytest.raises(SystemExit) as info:
        host_ab.main(["--threads", "0", "--device", "cpu", "--shapes", "E8_T4096_H256_FF512"])
    assert info.value.code == 2
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err
