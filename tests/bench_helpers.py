"""Shared check of the benchmark command-line tests: a bad argument is argparse's usage
error (exit 2) before any work starts."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def usage_error(capsys: pytest.CaptureFixture[str], main: Callable[[list[str]], object],
                argv: list[str]) -> str:
    """Run a benchmark's ``main(argv)``, which must exit with a usage error
    (``SystemExit`` with code 2); returns what was written to stderr (the message naming the
    flag, the expected and the given value)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err
