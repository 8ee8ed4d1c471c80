"""The docs stay true to the code: README's env table and CI command, the examples of
docs/architecture.md run as written, docs/performance.md carries the sections the GEMM rules
cite and a commit for its numbers, and neither the docs nor the sources are a diary (no
numbered stops or passes, issue numbers, dates or raw results files, no link to the deleted
benchmark diary or to a file that is not in the repository, no tracked raw results)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

import te_ops.env

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PERFORMANCE = ROOT / "docs" / "performance.md"


def _docs() -> list[Path]:
    return [ROOT / "README.md", ROOT / "benchmarks" / "README.md",
            *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "experimental").rglob("*.md"))]


def _example(name: str) -> str:
    block = re.search(rf"<!-- {name} example -->\n```python\n(.*?)```", ARCHITECTURE.read_text(),
                      re.S)
    assert block is not None, f"docs/architecture.md lost its '{name}' example"
    return block.group(1)


def test_readme_env_table_matches_env_module():
    readme = (ROOT / "README.md").read_text()
    assert te_ops.env.markdown_table() in readme


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line for line in ci.splitlines() if "pytest" in line).strip()
    assert command in readme


def test_architecture_is_a_short_reference_with_a_picture_and_the_three_how_tos():
    text = ARCHITECTURE.read_text()
    assert len(text.splitlines()) <= 400
    assert "```mermaid" in text
    for heading in ("## Layers", "## The path of one call", "## Adding a fusion",
                    "## Adding a GEMM backend", "## Adding a recipe"):
        assert f"\n{heading}\n" in text, heading


def test_performance_is_short_and_every_section_names_its_commit():
    text = PERFORMANCE.read_text()
    assert len(text.splitlines()) <= 150
    sections = re.split(r"\n## ", text)[1:]
    assert sections
    for section in sections:
        title = section.splitlines()[0]
        assert re.search(r"[Cc]ommits? `[0-9a-f]{7,40}`", section), f"'{title}' names no commit"
        assert re.search(r"`python\s", section), f"'{title}' gives no command"


def test_performance_has_every_section_the_gemm_rules_cite():
    from te_ops.gemm import rules

    headings = re.findall(r"^## (.+)$", PERFORMANCE.read_text(), flags=re.M)
    for section in rules.SECTIONS:
        assert section in headings, f"docs/performance.md has no section '{section}'"
    for row in rules.RULES:
        assert row.why.startswith(rules.SECTIONS), row


@pytest.mark.parametrize("name,path", [
    ("adding-a-fusion", "tests/extension_bias_pair.py"),
    ("adding-a-gemm-backend", "tests/extension_loop_mm.py"),
])
def test_extension_examples_are_the_tested_files(name, path):
    """The docs show the files tests/test_extension_examples.py registers and runs."""
    assert _example(name) == (ROOT / path).read_text(), (
        f"docs/architecture.md's '{name}' example differs from {path}")


def test_recipe_example_runs_and_matches_the_builtin_recipe():
    namespace: dict = {}
    exec(compile(_example("adding-a-recipe"), "architecture.md:adding-a-recipe", "exec"),
         namespace)
    recipe = namespace["Float8ForwardOnly"]()
    assert recipe.quantizer("grad_output", rowwise=True, columnwise=False) is None  # dgrad
    assert recipe.quantizer("input", rowwise=True, columnwise=False) is not None  # fprop
    assert hash(recipe) == hash(namespace["Float8ForwardOnly"]())  # a plan-cache key


def _without_env_table(path: Path) -> str:
    """The doc's text; README's env table is te_ops.env's (checked against it above)."""
    text = path.read_text()
    if path.name == "README.md" and path.parent == ROOT:
        text = text.replace(te_ops.env.markdown_table(), "")
    return text


def test_no_doc_is_a_diary():
    diary = re.compile(r"\b[Ss]top \d+|\b(?:First|Second|Third|Fourth|Fifth|Sixth|Seventh) pass\b"
                       r"|\b[Pp]ass \d+\b|review[ ]round|docs/benchmarks\.md")
    found = [(p.relative_to(ROOT).as_posix(), m.group(0)) for p in _docs()
             for m in diary.finditer(_without_env_table(p))]
    assert found == []
    assert not (ROOT / "docs" / "benchmarks.md").exists()


def _sources() -> list[Path]:
    """The package, tests, benchmarks and scripts: code, shell and markdown files."""
    return [p for folder in ("te_ops", "tests", "benchmarks", "scripts")
            for p in sorted((ROOT / folder).rglob("*"))
            if p.suffix in (".py", ".sh", ".md") and "__pycache__" not in p.parts]


#: Marks of measurement history: the deleted benchmark diary, issue and item numbers, numbered
#: passes / stops / rounds, branch names, dates, raw results file names.
_SOURCE_DIARY = re.compile(
    r"docs/benchmarks\.md|\b[Ii]ssue[- ]\d+|\bitem \d+\b|\b(?:[Ff]irst|[Ss]econd|[Tt]hird) pass\b"
    r"|\b[Ss]top \d+\b|\b[Rr]ound \d+\b|\bbranch [a-z]+\d|\b20\d\d-[01]\d-[0-3]\d\b"
    r"|results/h200[_]")


def test_no_source_is_a_diary():
    found = [f"{p.relative_to(ROOT).as_posix()}:{n}: {m.group(0)}" for p in _sources()
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             for m in _SOURCE_DIARY.finditer(line)]
    assert found == []


#: The files docs/architecture.md's how-tos tell the reader to create (not in the repository).
_HOW_TO_TARGETS = {"te_ops/fused/bias_pair.py", "te_ops/gemm/backends/loop_mm.py"}
_CITED = re.compile(r"(?<![\w/.-])((?:benchmarks|docs|scripts|tests|experimental|te_ops)/[\w./-]*"
                    r"\.(?:py|md|sh))")
_CITED_IN_PACKAGE = re.compile(r"(?<![\w/.-])((?:basic|fused|gemm|kernels|quantization)/\w+\.py)")


def test_sources_and_docs_cite_only_files_in_the_repository():
    """Every repository path a source or doc names exists, and no doc cites the design notes
    outside the repository (DESIGN.md). In docs/performance.md only a path quoted on its own
    is checked (its commands name the scripts of the commit they ran at); experimental/ is
    left out (its READMEs re-run scripts of the commit they name)."""
    texts = [p for p in [*_sources(), *_docs()] if "experimental" not in p.relative_to(ROOT).parts]
    missing = []
    for p in texts:
        text = p.read_text(encoding="utf-8")
        if p.suffix == ".md":
            assert "DESIGN.md" not in text, p.name
        for n, line in enumerate(text.splitlines(), 1):
            if p == PERFORMANCE:
                cited = re.findall(r"`((?:benchmarks|docs|scripts|tests|te_ops)/[\w./-]+)`", line)
            else:
                cited = [*_CITED.findall(line),
                         *("te_ops/" + c for c in _CITED_IN_PACKAGE.findall(line))]
            missing += [f"{p.relative_to(ROOT).as_posix()}:{n}: {c}" for c in cited
                        if c not in _HOW_TO_TARGETS and not (ROOT / c).exists()]
    assert missing == []


def test_raw_benchmark_results_are_not_tracked():
    ignored = (ROOT / ".gitignore").read_text().split()
    assert "runs/" in ignored and "benchmarks/results/" in ignored
    try:
        tracked = subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=ROOT,
                                 capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    assert tracked == ""
