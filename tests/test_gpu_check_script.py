"""``scripts/gpu_check.sh``: every ``--flag`` its steps pass to a repository script is one that
script's argument parser defines (a renamed or misspelt flag would only show on the GPU, as a
failed step of the final check). A text check of each command against the script's
``add_argument`` calls; no script is run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _commands() -> list[tuple[str, list[str]]]:
    """(script path, flags) for each ``"$PY" path.py ...`` command, continuation lines
    joined."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for match in re.finditer(r'"\$PY" ((?:benchmarks|scripts)/\w+\.py)([^;|&]*)', line):
            # Arguments after a lone "--" belong to the command the script runs (pytest).
            own = re.split(r"\s--\s", match.group(2))[0]
            flags = re.findall(r"(?<![\w-])(--[a-z][\w-]*)", own)
            found.append((match.group(1), flags))
    return found


def _defined_flags(path: str) -> set[str]:
    source = (ROOT / path).read_text()
    return set(re.findall(r'add_argument\(\s*"(--[a-z][\w-]*)"', source))


def test_commands_are_found():
    scripts = {path for path, _ in _commands()}
    assert {"benchmarks/profile_gaps.py", "benchmarks/host_ab.py",
            "scripts/main_job_seeds.py", "benchmarks/grouped_mlp.py",
            "scripts/sharded_pytest.py"} <= scripts


def test_every_flag_exists_in_its_script():
    unknown = [(path, flag) for path, flags in _commands() for flag in flags
               if flag not in _defined_flags(path)]
    assert unknown == [], f"flags that the called script does not define: {unknown}"


def test_named_recipes_and_shapes_exist():
    """The recipe and shape names passed on the command lines are the scripts' own."""
    text = "\n".join(line for line in SCRIPT.read_text().splitlines()
                     if not line.lstrip().startswith("#"))
    recipes = set(re.findall(r"--recipes? ([\w,]+)", text))
    assert recipes
    known = {"none", "fp8", "fp8fast", "mxfp8"}
    for value in recipes:
        assert set(value.split(",")) <= known, value
    source = (ROOT / "benchmarks" / "grouped_mlp.py").read_text()
    for shape in set(re.findall(r"E\d+_T\d+_H\d+_FF\d+", text)):
        assert f'"{shape}"' in source, shape


def test_header_lists_every_step():
    """Every ``step NAME`` the script can run is described in its header comment, and is in the
    default STEPS (cpu_tests excepted: CI runs the CPU suite)."""
    text = SCRIPT.read_text()
    header = text.split("\nset -uo pipefail", 1)[0]
    steps = set(re.findall(r"^\s*step (\w+) \d+ ", text, flags=re.M))
    assert {"cuda_tests", "bench_e64_interleaved", "profile_graph", "main_job_mxfp8"} <= steps
    described = set(re.findall(r"^#\s{3,}(\w+)\s", header, flags=re.M))
    assert steps - described == set(), f"steps missing from the header: {steps - described}"
    default = re.search(r'WANT=" \$\{STEPS:-([^}]*)\} "', text)
    assert default is not None
    assert steps - set(default.group(1).split()) == {"cpu_tests"}
