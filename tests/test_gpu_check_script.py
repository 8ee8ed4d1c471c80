"""``scripts/gpu_check.sh``: every ``--flag`` its steps pass to a repository script is one that
script's argument parser defines (a renamed or misspelt flag would only show on the GPU, as a
failed step), every script of ``benchmarks/`` is run by a step and listed in
``benchmarks/README.md``, and the header describes every step. Text checks; no script is run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _code() -> str:
    """The script without its comment lines, continuation lines joined."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def _commands() -> list[tuple[str, list[str]]]:
    """(script path, flags) for each ``"$PY" path.py ...`` command."""
    found = []
    for line in _code().splitlines():
        for match in re.finditer(r'"\$PY" ((?:benchmarks|scripts)/\w+\.py)([^;|&]*)', line):
            # Arguments after a lone "--" belong to the command the script runs (pytest).
            own = re.split(r"\s--\s", match.group(2))[0]
            flags = re.findall(r"(?<![\w-])(--[a-z][\w-]*)", own)
            found.append((match.group(1), flags))
    return found


def _defined_flags(path: str) -> set[str]:
    source = (ROOT / path).read_text()
    flags = set(re.findall(r'add_argument\(\s*"(--[a-z][\w-]*)"', source))
    if "add_out_argument(parser" in source:  # benchmarks/common.py's --out DIR
        flags.add("--out")
    return flags


def test_every_benchmark_is_run_by_a_step_and_listed_in_the_readme():
    run = {path for path, _ in _commands()}
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        if script.name == "common.py":
            continue
        rel = f"benchmarks/{script.name}"
        assert rel in run, f"{rel} is run by no step of scripts/gpu_check.sh"
        assert f"`{script.name}`" in readme, f"{script.name} is not listed in benchmarks/README.md"
    assert {"scripts/sharded_pytest.py", "scripts/main_job_seeds.py",
            "scripts/compare_main_job.py"} <= run


def test_every_flag_exists_in_its_script():
    unknown = [(path, flag) for path, flags in _commands() for flag in flags
               if flag not in _defined_flags(path)]
    assert unknown == [], f"flags that the called script does not define: {unknown}"


def test_every_benchmark_writes_under_out():
    """Each benchmark command names its own folder under $OUT (raw results stay untracked)."""
    for line in _code().splitlines():
        if '"$PY" benchmarks/' in line and "--summarize" not in line:
            assert re.search(r'--out "\$OUT/\w+"', line), line


def test_named_recipes_peers_and_shapes_exist():
    """The recipe, peer and shape names passed on the command lines are the scripts' own."""
    import os
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import grouped_mlp

    code = _code()
    recipes = set(re.findall(r"--recipes? ([\w,]+)", code))
    assert recipes
    for value in recipes:
        assert set(value.split(",")) <= {"none", "fp8", "fp8fast", "mxfp8", "fp8block"}, value
    for value in re.findall(r"--peers ([\w,]+)", code):
        assert set(value.split(",")) <= set(grouped_mlp.PEER_CLASSES), value
    for shape in set(re.findall(r"E\d+_T\d+_H\d+_FF\d+", code)):
        assert shape in grouped_mlp.KNOWN_SHAPES, shape


def test_header_lists_every_step_and_the_default_runs_all_but_the_cpu_suite():
    text = SCRIPT.read_text()
    header = text.split("\nset -uo pipefail", 1)[0]
    steps = set(re.findall(r"^\s*step (\w+) \d+ ", text, flags=re.M))
    assert {"cuda_tests", "bench", "bench_fp8", "profile", "memory", "peak"} <= steps
    described = set(re.findall(r"^#\s{3,}(\w+)\s", header, flags=re.M))
    assert steps - described == set(), f"steps missing from the header: {steps - described}"
    default = re.search(r'WANT=" \$\{STEPS:-([^}]*)\} "', text)
    assert default is not None
    assert steps - set(default.group(1).split()) == {"cpu_tests"}
    for subset in re.findall(r'STEPS="([^"]+)"', header):  # the header's example calls
        assert set(subset.split()) <= steps | {"env"}, subset


def test_cuda_tests_step_runs_the_cuda_marked_suite_sharded():
    code = _code()
    assert re.search(r'step cuda_tests \d+ "\$PY" scripts/sharded_pytest.py .* -- -q -m cuda tests',
                     code)
