"""README.md stays true to the code: the env-var table and the CI command."""

from __future__ import annotations

from pathlib import Path

import te_ops.env

ROOT = Path(__file__).resolve().parents[1]


def test_readme_env_table_matches_env_module():
    readme = (ROOT / "README.md").read_text()
    assert te_ops.env.markdown_table() in readme


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line for line in ci.splitlines() if "pytest" in line).strip()
    assert command in readme
