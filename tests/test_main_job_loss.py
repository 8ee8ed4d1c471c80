"""The main job's final-loss comparison: its default length, the noise-floor tools
(``benchmarks/main_job_noise.py``) and the seeds script (``scripts/main_job_seeds.py``)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

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


noise = load("benchmarks/main_job_noise.py")
seeds = load("scripts/main_job_seeds.py")


def test_default_steps_end_on_the_plateau_and_hf_keeps_its_own() -> None:
    assert train_moe.DEFAULT_STEPS == 2000
    assert train_moe.parse_args([]).steps == 2000
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
