"""The main job's final-loss comparison: its default length, the noise-floor tools
(``scripts/main_job_noise.py``) and the seeds script (``scripts/main_job_seeds.py``)."""

from __future__ import annotations

import importlib.util
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import te_ops
from te_ops.examples import train_moe

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--steps", "4", "--batch-size", "2", "--seq-len", "16", "--layers", "1",
        "--d-model", "16", "--heads", "2", "--experts", "2", "--top-k", "1", "--ffn", "16",
        "--eval-every", "2", "--eval-batches", "1", "--seed", "5"]


def load(rel: str):
    spec = importlib.util.spec_from_file_location(Path(rel).stem, ROOT / rel)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


noise = load("scripts/main_job_noise.py")
seeds = load("scripts/main_job_seeds.py")


def test_default_is_short_and_the_plateaued_run_is_a_preset() -> None:
    assert train_moe.DEFAULT_STEPS == 600
    assert train_moe.parse_args([]).steps == 600
    assert train_moe.parse_args(["--preset", "recipe-compare"]).steps == 2000
    assert train_moe.parse_args(["--preset", "recipe-compare", "--steps", "9"]).steps == 9
    assert train_moe.parse_args(["--hf-model", "mixtral"]).steps == train_moe.DEFAULT_HF_STEPS
    assert train_moe.parse_args(["--steps", "7"]).steps == 7


def test_steps_below_one_still_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        train_moe.parse_args(["--steps", "0"])
    assert "--steps must be >= 1, got 0" in capsys.readouterr().err


def _next_away_from_zero(x: float, mantissa_bits: int) -> float:
    """Independent reference: the next representable value away from zero, for a normal
    binary float with ``mantissa_bits`` explicit mantissa bits."""
    e = math.floor(math.log2(abs(x)))
    return x + math.copysign(2.0 ** (e - mantissa_bits), x)


@pytest.mark.parametrize("dtype,bits", [(torch.bfloat16, 7), (torch.float32, 23)])
@pytest.mark.parametrize("first", [0.02, -0.013, 1.0, -0.5, 3.0e-3])
def test_nudge_one_ulp_moves_only_the_first_element_by_one_ulp(dtype, bits, first) -> None:
    t = (torch.randn(3, 5, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)
    t[0, 0] = first
    before = t.clone()
    noise.nudge_one_ulp(t)
    x = before[0, 0].double().item()
    assert t[0, 0].double().item() == _next_away_from_zero(x, bits)
    assert torch.equal(t.view(-1)[1:], before.view(-1)[1:])
    if dtype == torch.float32:
        away = torch.tensor(math.copysign(math.inf, x))
        assert t[0, 0] == torch.nextafter(before[0, 0], away)


def test_parse_runs_and_its_errors() -> None:
    assert noise.parse_runs("none:base,none,fp8:emulate") == [
        ("none", "base"), ("none", "base"), ("fp8", "emulate")]
    with pytest.raises(ValueError, match=r"--runs entry 'fp16:base': expected RECIPE:VARIANT"):
        noise.parse_runs("none:base,fp16:base")
    with pytest.raises(ValueError, match=r"--runs entry 'none:jitter'"):
        noise.parse_runs("none:jitter")
    with pytest.raises(ValueError, match=r"'none:emulate': emulate needs a recipe"):
        noise.parse_runs("none:emulate")


def test_report_computes_relative_loss_and_noise_floor(capsys) -> None:
    recs = [{"recipe": "none", "variant": "base", "seed": 0, "steps": 10, "final_val_loss": 2.0},
            {"recipe": "none", "variant": "ulp", "seed": 0, "steps": 10, "final_val_loss": 2.1},
            {"recipe": "fp8", "variant": "base", "seed": 0, "steps": 10, "final_val_loss": 1.9},
            {"recipe": "none", "variant": "ulp", "seed": 1, "steps": 10, "error": "boom"}]
    noise.report(recs)
    out = capsys.readouterr().out
    assert "2.1000 (+5.00%)" in out and "1.9000 (-5.00%)" in out
    assert "max |rel| 5.00%, mean |rel| 5.00% over 1 pairs" in out
    assert "FAILED none:ulp seed 1 steps 10: boom" in out


@pytest.mark.parametrize("argv,message", [
    (["--recipes", "fp8"], "--recipes must include none"),
    (["--recipes", "none,fp4"], "--recipes: unknown ['fp4']"),
    (["--recipes", "fp8fastt"], "--recipes: unknown ['fp8fastt'], expected some of ['none', "
                                "'fp8', 'fp8fast', 'mxfp8', 'fp8block']"),
    (["--parallel", "-1"], "--parallel must be >= 0, got -1"),
])
def test_main_job_seeds_argument_errors(argv, message, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["main_job_seeds.py", "--device", "cpu", *argv])
    with pytest.raises(SystemExit):
        seeds.main()
    assert message in capsys.readouterr().err


def test_main_job_seeds_run_job_logs_and_matches_the_job(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRAIN_MOE_PROGRESS", "0")
    threads = torch.get_num_threads()
    try:
        log = tmp_path / "a" / "train.log"
        got = seeds.run_job([*TINY, "--out-dir", str(tmp_path / "a")], str(log), 1)
    finally:
        torch.set_num_threads(threads)
    want = train_moe.main([*TINY, "--out-dir", str(tmp_path / "b")])["final_val_loss"]
    assert got == want
    assert "final validation loss (whole split)" in log.read_text()


# --------------------------------------------------------------------- CLI errors, failures
@pytest.mark.parametrize("argv,message", [
    (["--seeds", "0,x"], "--seeds: expected comma-separated integers, got 'x' in '0,x'"),
    (["--seeds", ""], "--seeds: expected comma-separated integers, got '' in ''"),
    (["--seeds", "0,1,0"], "--seeds: each value once (every run writes its own directory), "
                           "got [0] more than once in [0, 1, 0]"),
    (["--recipes", "none,fp8,none"], "--recipes: each value once (every run writes its own "
                                     "directory), got ['none'] more than once"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
])
def test_main_job_seeds_rejects_bad_lists_before_any_run(argv, message, monkeypatch, capsys):
    """Bad seeds were a bare int() traceback; repeated values started two runs writing one
    directory; the job's own errors (--steps 0) came from every worker process."""
    def no_pool(*a, **k):
        raise AssertionError("a run was started")

    monkeypatch.setattr(seeds, "ProcessPoolExecutor", no_pool)
    monkeypatch.setattr(sys, "argv", ["main_job_seeds.py", "--device", "cpu", *argv])
    with pytest.raises(SystemExit):
        seeds.main()
    assert message in capsys.readouterr().err


class _ThreadPool(ThreadPoolExecutor):
    """The seeds script's process pool, as threads (``mp_context`` ignored)."""

    def __init__(self, workers: int, mp_context=None) -> None:
        super().__init__(workers)


def _fake_runs(losses: dict[tuple[str, str], float]):
    def run_job(argv, log, threads):
        key = (argv[argv.index("--recipe") + 1], argv[argv.index("--seed") + 1])
        if key not in losses:
            raise RuntimeError("boom")
        return losses[key]
    return run_job


def test_main_job_seeds_table_is_relative_to_bf16_on_each_seed(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(seeds, "ProcessPoolExecutor", _ThreadPool)
    monkeypatch.setattr(seeds, "run_job", _fake_runs(
        {("none", "0"): 2.0, ("fp8", "0"): 2.1, ("none", "1"): 4.0, ("fp8", "1"): 3.8}))
    monkeypatch.setattr(sys, "argv", ["main_job_seeds.py", "--device", "cpu", "--seeds", "0,1",
                                      "--out", str(tmp_path)])
    assert seeds.main() == 0
    out = capsys.readouterr().out
    # fp8 vs none: 2.1 / 2.0 - 1 = +5.0 %, 3.8 / 4.0 - 1 = -5.0 %, mean 0.00 %
    assert "2.1000 (+5.0%)" in out and "3.8000 (-5.0%)" in out and "+0.00%" in out


def test_main_job_seeds_failed_run_is_named(monkeypatch, tmp_path):
    """A failing run re-raised the worker's exception with no word of which run it was."""
    monkeypatch.setattr(seeds, "ProcessPoolExecutor", _ThreadPool)
    monkeypatch.setattr(seeds, "run_job", _fake_runs({("none", "0"): 2.0}))
    monkeypatch.setattr(sys, "argv", ["main_job_seeds.py", "--device", "cpu", "--seeds", "0",
                                      "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"run --recipe fp8 --seed 0 failed: RuntimeError: "
                                         r"boom \(its output: .*seeds_fp8_0/train.log\)"):
        seeds.main()


@pytest.mark.parametrize("argv,message", [
    (["--seeds", "0,x"], "--seeds: expected comma-separated integers, got 'x' in '0,x'"),
    (["--steps", "600,a"], "--steps: expected comma-separated integers, got 'a' in '600,a'"),
    (["--steps", "0"], "--steps: each value must be >= 1, got 0"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--eval-batches", "0"], "--eval-batches must be >= 1, got 0"),
    (["--runs", "none:base,none"], "--runs: each value once (every run writes its own "
                                   "directory), got ['none:base'] more than once"),
    (["--steps", "5,5"], "--steps: each value once"),
])
def test_main_job_noise_argument_errors(argv, message, monkeypatch, capsys):
    """Bad seeds / steps were a bare int() traceback, --threads 0 failed in every child,
    repeated runs wrote one directory at once."""
    monkeypatch.setattr(noise, "spawn", lambda *a: pytest.fail("a run was started"))
    monkeypatch.setattr(sys, "argv", ["main_job_noise.py", "--device", "cpu", *argv])
    with pytest.raises(SystemExit):
        noise.main()
    assert message in capsys.readouterr().err


def test_main_job_noise_exit_status_says_a_run_failed(monkeypatch, capsys):
    def spawn(job, args):
        recipe, variant, seed, steps = job
        rec = {"recipe": recipe, "variant": variant, "seed": seed, "steps": steps}
        return {**rec, "error": "boom"} if variant == "ulp" else {**rec, "final_val_loss": 2.0}

    monkeypatch.setattr(noise, "spawn", spawn)
    argv = ["main_job_noise.py", "--device", "cpu", "--seeds", "0", "--steps", "3"]
    monkeypatch.setattr(sys, "argv", [*argv, "--runs", "none:base,none:ulp"])
    assert noise.main() == 1
    assert "FAILED none:ulp seed 0 steps 3: boom" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", [*argv, "--runs", "none:base"])
    assert noise.main() == 0


@pytest.mark.parametrize(("name", "fast"), [("fp8", False), ("fp8fast", True)])
def test_main_job_fp8_recipes(name, fast):
    """``--recipe fp8fast`` is Float8CurrentScaling with fast accumulation in backward too (the
    benchmark's ``fp8fast``); ``fp8`` keeps the default (fast accumulation in fprop only)."""
    from te_ops.quantization.autocast import current_recipe

    args = train_moe.parse_args(["--recipe", name])
    with train_moe.recipe_context(args):
        recipe = current_recipe()
    assert type(recipe) is te_ops.recipe.Float8CurrentScaling
    assert recipe.fast_accumulate_backward is fast
