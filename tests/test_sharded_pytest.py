"""``TEST_SHARD`` (tests/conftest.py) and ``scripts/sharded_pytest.py``: the shards of a test
run are disjoint and together hold every test; the runner adds up the shards' counts and fails
when one shard fails; a bad ``TEST_SHARD`` is a usage error that names it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import sharded_pytest  # noqa: E402

_SAMPLE = '''
import pytest

@pytest.mark.parametrize("i", range(23))
def test_case(i):
    assert i != 7 or __import__("os").environ.get("FAIL_SEVEN") != "1"
'''


def _collect(sample: Path, shard: str | None) -> tuple[int, set[str]]:
    env = {k: v for k, v in os.environ.items() if k != "TEST_SHARD"}
    if shard is not None:
        env["TEST_SHARD"] = shard
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p",
                           "no:cacheprovider", str(sample)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    return proc.returncode, {ln for ln in proc.stdout.splitlines() if "::" in ln}


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    # Inside tests/ so that tests/conftest.py (which reads TEST_SHARD) applies.
    path = ROOT / "tests" / f"_shard_sample_{os.getpid()}_{tmp_path.name}.py"
    path.write_text(_SAMPLE)
    yield path
    path.unlink()


def test_shards_partition_the_tests(sample: Path):
    _, every = _collect(sample, None)
    assert len(every) == 23
    parts = [_collect(sample, f"{k}/2")[1] for k in range(2)]
    assert set().union(*parts) == every
    assert sum(map(len, parts)) == 23
    assert all(parts)


def test_bad_shard_value_is_a_usage_error(sample: Path):
    for bad in ("3/3", "a/b"):
        env = {**os.environ, "TEST_SHARD": bad}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p",
                               "no:cacheprovider", str(sample)], capture_output=True, text=True,
                              env=env, cwd=ROOT)
        assert proc.returncode == 4, (bad, proc.stdout, proc.stderr)
        assert "TEST_SHARD must be 'k/n'" in proc.stderr and repr(bad) in proc.stderr


def test_runner_adds_up_shards_and_fails_with_a_failed_shard(sample: Path, tmp_path: Path,
                                                            capsys, monkeypatch):
    args = ["--shards", "2", "--log-dir", str(tmp_path), "--name", "s", "--", "-q", "-p",
            "no:cacheprovider", str(sample)]
    monkeypatch.chdir(ROOT)
    assert sharded_pytest.main(args) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("23 passed in ")
    monkeypatch.setenv("FAIL_SEVEN", "1")
    assert sharded_pytest.main(args) == 1
    out = capsys.readouterr().out
    assert "1 failed, 22 passed in " in out.splitlines()[-1]
    assert any(ln.startswith("FAILED ") and "test_case[7]" in ln for ln in out.splitlines())
    assert sorted(p.name for p in tmp_path.glob("s_shard*.log")) == ["s_shard0.log",
                                                                     "s_shard1.log"]


def test_tally_reads_the_last_summary_line():
    text = "....\nsomething 3 passed in 1s\n10 passed, 2 skipped, 1 error, 5 deselected in 3.1s\n"
    counts = sharded_pytest.tally(text)
    assert counts["passed"] == 10 and counts["skipped"] == 2 and counts["error"] == 1


def test_shards_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        sharded_pytest.main(["--shards", "0", "--", "-q"])
    assert "--shards must be >= 1, got 0" in capsys.readouterr().err
