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
