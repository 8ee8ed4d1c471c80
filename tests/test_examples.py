"""The main job (``python -m te_ops.examples.train_moe``) on a tiny config, on the CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from te_ops.examples import train_moe

TINY = ["--steps", "6", "--batch-size", "4", "--seq-len", "32", "--layers", "1",
        "--d-model", "32", "--heads", "2", "--experts", "4", "--top-k", "2", "--ffn", "32",
        "--eval-every", "3", "--eval-batches", "1", "--seed", "3"]


def test_main_job_tiny_writes_metrics_and_is_deterministic(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAIN_MOE_PROGRESS", "0")
    metrics = train_moe.main([*TINY, "--out-dir", str(tmp_path / "api")])

    assert [e["step"] for e in metrics["evals"]] == [3, 6]
    for e in metrics["evals"]:
        assert math.isfinite(e["train_loss"]) and math.isfinite(e["val_loss"])
        assert e["tokens_per_s"] > 0
    assert math.isfinite(metrics["final_val_loss"])
    # Byte-level unigram cross-entropy of English documentation text: about 3.2 nats.
    assert 2.5 < metrics["unigram_baseline"] < 4.0
    assert metrics["fusions"]["forward"] and metrics["fusions"]["backward"]
    assert (tmp_path / "api" / "loss.png").stat().st_size > 0
    saved = json.loads((tmp_path / "api" / "metrics.json").read_text())
    assert saved["final_val_loss"] == metrics["final_val_loss"]
    assert saved["config"]["steps"] == 6

    # Same seed, through the command line in a fresh process: the same numbers.
    env = {**os.environ, "TRAIN_MOE_PROGRESS": "0"}
    subprocess.run([sys.executable, "-m", "te_ops.examples.train_moe", *TINY,
                    "--out-dir", str(tmp_path / "cli")], check=True, env=env,
                   capture_output=True, timeout=120)
    again = json.loads((tmp_path / "cli" / "metrics.json").read_text())
    assert [(e["train_loss"], e["val_loss"]) for e in again["evals"]] == [
        (e["train_loss"], e["val_loss"]) for e in metrics["evals"]]
    assert again["final_val_loss"] == metrics["final_val_loss"]


def test_moe_layer_matches_the_jobs_routing_formulas() -> None:
    """The job's ``te_ops.MoE`` layer computes the job's routing: softmax over the experts,
    top-k, the k weights renormalized to sum to 1, and the Switch loss
    ``E * sum_e (share of pairs on e) * (mean prob of e)`` (float64 per-token loop)."""
    torch.manual_seed(0)
    d, ffn, experts, k = 8, 16, 4, 2
    moe = train_moe.moe_layer(d, ffn, experts, k).double()
    x = torch.randn(2, 5, d, dtype=torch.float64)
    out, aux = moe(x)

    fc1, _, fc2 = moe.experts
    tokens = x.reshape(-1, d)
    probs = torch.softmax(tokens @ moe.router.weight.t(), dim=-1)
    expected = torch.zeros_like(tokens)
    counts = torch.zeros(experts, dtype=torch.float64)
    for t in range(tokens.shape[0]):
        top_p, top_e = probs[t].topk(k)
        for p, e in zip(top_p / top_p.sum(), top_e.tolist()):
            a, b = (tokens[t] @ fc1.weight[e].t()).chunk(2)
            expected[t] += p * (torch.nn.functional.silu(a) * b) @ fc2.weight[e].t()
            counts[e] += 1
    torch.testing.assert_close(out.reshape(-1, d), expected, rtol=1e-10, atol=1e-12)
    switch = experts * (counts / counts.sum() * probs.mean(0)).sum()
    torch.testing.assert_close(aux, switch, rtol=1e-12, atol=0)


def test_cuda_graph_flag_needs_cuda_device() -> None:
    with pytest.raises(SystemExit, match="--cuda-graph needs"):
        train_moe.main(["--cuda-graph", "--device", "cpu"])


def test_main_job_loss_curve_same_with_and_without_fusion(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAIN_MOE_PROGRESS", "0")
    fused = train_moe.main([*TINY, "--out-dir", str(tmp_path / "fused")])
    monkeypatch.setenv("TE_OPS_FUSION", "0")
    unfused = train_moe.main([*TINY, "--out-dir", str(tmp_path / "unfused")])
    assert "ForwardGroupedMLP" in str(fused["fusions"])
    assert "ForwardGroupedMLP" not in str(unfused["fusions"])
    curve = [(e["train_loss"], e["val_loss"]) for e in fused["evals"]]
    assert curve == [(e["train_loss"], e["val_loss"]) for e in unfused["evals"]]
    assert fused["final_val_loss"] == unfused["final_val_loss"]


def test_main_job_compiled_same_losses_as_eager(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``--compile`` (fullgraph; aot_eager: the same kernels) trains to bit-identical losses."""
    monkeypatch.setenv("TRAIN_MOE_PROGRESS", "0")
    torch._dynamo.reset()
    eager = train_moe.main([*TINY, "--out-dir", str(tmp_path / "eager")])
    compiled = train_moe.main([*TINY, "--compile", "--compile-backend", "aot_eager",
                               "--out-dir", str(tmp_path / "compiled")])
    curve = [(e["train_loss"], e["val_loss"]) for e in eager["evals"]]
    assert curve == [(e["train_loss"], e["val_loss"]) for e in compiled["evals"]]
    assert eager["final_val_loss"] == compiled["final_val_loss"]
    assert compiled["config"]["compile"] is True


def test_master_weights_step_matches_fp32_adamw_reference() -> None:
    """``MasterWeights``: bf16 parameters end as the bf16 rounding of an fp32 AdamW step taken
    on fp32 copies with the bf16 gradients cast to fp32 (reference built here, by hand)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    ref = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    master = train_moe.MasterWeights(list(model.parameters()))
    opt = torch.optim.AdamW(master.masters, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        x = torch.randn(5, 8, dtype=torch.bfloat16)
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        for r, p in zip(ref, model.parameters()):
            r.grad = p.grad.float()
        master.take_grads()
        opt.step()
        ref_opt.step()
        master.copy_back()
        for r, m, p in zip(ref, master.masters, model.parameters()):
            assert m.dtype == torch.float32 and p.dtype == torch.bfloat16
            torch.testing.assert_close(m.detach(), r.detach(), rtol=0, atol=0)
            assert torch.equal(p.detach(), r.detach().to(torch.bfloat16))
    state = opt.state[master.masters[0]]
    assert state["exp_avg"].dtype == torch.float32


def test_main_job_bf16_master_weights_flag(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``--dtype bfloat16`` trains with fp32 master weights by default; ``--master-weights
    none`` is the bf16-parameter update (a different run); both keep bf16 parameters."""
    monkeypatch.setenv("TRAIN_MOE_PROGRESS", "0")
    tiny = [*TINY, "--steps", "3", "--dtype", "bfloat16"]
    fp32 = train_moe.main([*tiny, "--out-dir", str(tmp_path / "fp32")])
    bf16 = train_moe.main([*tiny, "--master-weights", "none", "--out-dir", str(tmp_path / "b")])
    assert fp32["config"]["master_weights"] == "fp32"
    assert bf16["config"]["master_weights"] == "none"
    assert fp32["fp32_master_weights"] is True and bf16["fp32_master_weights"] is False
    assert math.isfinite(fp32["final_val_loss"]) and math.isfinite(bf16["final_val_loss"])
    assert fp32["final_val_loss"] != bf16["final_val_loss"]
    with pytest.raises(SystemExit):
        train_moe.main([*tiny, "--master-weights", "fp16"])


def test_master_weights_takes_a_generator() -> None:
    """``MasterWeights(model.parameters())`` (a generator) must hold every parameter: a
    generator stored as is was consumed by the masters, then ``take_grads`` / ``copy_back``
    zipped over nothing and the model silently never trained."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    master = train_moe.MasterWeights(model.parameters())
    assert len(master.params) == len(master.masters) == 2
    opt = torch.optim.SGD(master.masters, lr=1.0)
    model(torch.randn(5, 8, dtype=torch.bfloat16)).sum().backward()
    master.take_grads()
    assert all(m.grad is not None and m.grad.dtype == torch.float32 for m in master.masters)
    # Reference: one SGD step by hand in fp32, rounded to bf16.
    expected = [(b.float() - p.grad.float()).to(torch.bfloat16)
                for b, p in zip(before, model.parameters())]
    opt.step()
    master.copy_back()
    for e, p in zip(expected, model.parameters()):
        assert torch.equal(p.detach(), e)


def test_master_weights_bad_params_raise() -> None:
    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"iterable of parameters.*one tensor of shape \(3,\)"):
        train_moe.MasterWeights(w)
    with pytest.raises(TypeError, match=r"params\[1\] must be a floating-point tensor, got "
                                        r"torch.int64"):
        train_moe.MasterWeights([w, torch.zeros(2, dtype=torch.int64)])
    with pytest.raises(TypeError, match=r"params\[0\] must be .* got float"):
        train_moe.MasterWeights([1.0])
    with pytest.raises(ValueError, match=r"params\[1\] is the same tensor as params\[0\]"):
        train_moe.MasterWeights([w, w])


def test_master_weights_bad_containers_raise() -> None:
    """An empty iterable (which would fail later, in ``copy_back``'s
    ``torch._foreach_copy_``), a module or optimizer param groups (torch's "object is not
    iterable", a bare "got dict") are refused at construction, naming what came."""
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    gen = model.parameters()
    list(gen)  # exhausted
    with pytest.raises(ValueError, match=r"at least one parameter, got an empty iterable"):
        train_moe.MasterWeights(gen)
    with pytest.raises(ValueError, match=r"at least one parameter"):
        train_moe.MasterWeights([])
    with pytest.raises(TypeError, match=r"model.parameters\(\)\), got a Linear module"):
        train_moe.MasterWeights(model)
    with pytest.raises(TypeError, match=r"params\[0\] must be a floating-point tensor, got a "
                                        r"dict with keys \['params', 'weight_decay'\]"):
        train_moe.MasterWeights([{"params": list(model.parameters()), "weight_decay": 0.0}])


def test_main_job_bf16_master_weights_compiled_same_losses_as_eager(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp32 masters (the bf16 default) keep ``--compile --compile-backend aot_eager``
    bit-identical to eager: the masters are copied into the same bf16 parameter storage the
    compiled graph reads."""
    monkeypatch.setenv("TRAIN_MOE_PROGRESS", "0")
    torch._dynamo.reset()
    tiny = [*TINY, "--steps", "3", "--dtype", "bfloat16"]
    eager = train_moe.main([*tiny, "--out-dir", str(tmp_path / "eager")])
    compiled = train_moe.main([*tiny, "--compile", "--compile-backend", "aot_eager",
                               "--out-dir", str(tmp_path / "compiled")])
    assert compiled["config"]["master_weights"] == "fp32"
    curve = [(e["train_loss"], e["val_loss"]) for e in eager["evals"]]
    assert curve == [(e["train_loss"], e["val_loss"]) for e in compiled["evals"]]
    assert eager["final_val_loss"] == compiled["final_val_loss"]


def test_master_weights_keep_the_parameter_objects_and_storage() -> None:
    """``copy_back`` writes in place: the module's parameters (and so ``state_dict`` and any
    CUDA graph or optimizer hook holding them) stay the same objects with the same storage."""
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    objs = list(model.parameters())
    ptrs = [p.data_ptr() for p in objs]
    master = train_moe.MasterWeights(model.parameters())
    opt = torch.optim.AdamW(master.masters, lr=1e-1)
    model(torch.randn(3, 8, dtype=torch.bfloat16)).sum().backward()
    master.take_grads()
    opt.step()
    master.copy_back()
    assert all(a is b for a, b in zip(model.parameters(), objs))
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    sd = model.state_dict()
    assert sd["weight"].data_ptr() == ptrs[0] and sd["weight"].dtype == torch.bfloat16
    assert torch.equal(sd["weight"], master.masters[0].detach().to(torch.bfloat16))


def test_master_weights_state_dict_round_trip_and_errors() -> None:
    """``MasterWeights.state_dict`` / ``load_state_dict``: the fp32 masters come back exactly
    (in place: the optimizer's references stay valid) and are rounded into the parameters;
    a wrong length or shape raises naming the index and the expected value."""
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    master = train_moe.MasterWeights(model.parameters())
    with torch.no_grad():
        for m in master.masters:
            m.add_(1e-3)  # below bf16's resolution near 1: only the masters hold it
    saved = master.state_dict()
    other = train_moe.MasterWeights(model.parameters())
    ids = [id(m) for m in other.masters]
    other.load_state_dict(saved)
    assert [id(m) for m in other.masters] == ids  # loaded in place
    for m, t, p in zip(other.masters, saved["masters"], model.parameters()):
        assert torch.equal(m.detach(), t) and m.dtype == torch.float32
        assert torch.equal(p.detach(), t.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"list of 2 tensors, got 1"):
        other.load_state_dict({"masters": saved["masters"][:1]})
    with pytest.raises(ValueError, match=r"state\['masters'\]\[0\] must be a torch.float32 "
                                         r"tensor of shape \(3, 4\), got torch.float32 of "
                                         r"shape \(4, 3\)"):
        other.load_state_dict({"masters": [torch.zeros(4, 3), saved["masters"][1]]})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64, torch.int64])
def test_master_weights_load_state_dict_rejects_other_dtypes(dtype: torch.dtype) -> None:
    """A non-fp32 entry (e.g. the bf16 parameters' own state_dict values) would lose the low
    bits the masters keep: it raises naming index, expected and actual dtype, and loads
    nothing (the entry before it keeps its value)."""
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    master = train_moe.MasterWeights(model.parameters())
    before = [m.detach().clone() for m in master.masters]
    good = torch.full((3, 4), 0.5)
    with pytest.raises(ValueError, match=rf"state\['masters'\]\[1\] must be a torch.float32 "
                                         rf"tensor of shape \(3,\), got {dtype} of shape \(3,\)"):
        master.load_state_dict({"masters": [good, torch.zeros(3, dtype=dtype)]})
    assert all(torch.equal(m.detach(), b) for m, b in zip(master.masters, before))


@pytest.mark.parametrize(("state", "got"), [
    ({"master": []}, r"got a dict with keys \['master'\]"),
    ({"weight": torch.zeros(3, 4), "bias": torch.zeros(3)},
     r"got a dict with keys \['bias', 'weight'\]"),  # a model's state_dict
    ([torch.zeros(3, 4), torch.zeros(3)], r"got list"),
    (None, r"got NoneType"),
])
def test_master_weights_load_state_dict_names_a_wrong_container(state, got: str) -> None:
    """A state without a 'masters' entry is reported by what came, not as "state['masters']
    must be a list of 2 tensors, got NoneType" whatever it was."""
    master = train_moe.MasterWeights(torch.nn.Linear(4, 3).to(torch.bfloat16).parameters())
    with pytest.raises(ValueError, match=r"state must be a dict with a 'masters' entry .*" + got):
        master.load_state_dict(state)
    with pytest.raises(ValueError, match=r"state\['masters'\] must be a list of 2 tensors, "
                                         r"got Tensor"):
        master.load_state_dict({"masters": torch.zeros(2)})


def test_main_job_records_whether_fp32_masters_were_kept(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAIN_MOE_PROGRESS", "0")
    m = train_moe.main([*TINY, "--steps", "1", "--out-dir", str(tmp_path)])
    assert m["config"]["master_weights"] == "fp32" and m["fp32_master_weights"] is False


@pytest.mark.parametrize("extra, world, message", [
    ([], None, "--ep 2 needs 2 processes (torchrun --nproc_per_node 2"),
    (["--experts", "3", "--top-k", "2"], "2", "--experts must be divisible by --ep 2, got 3"),
    (["--batch-size", "5"], "2", "--batch-size must be divisible by --ep 2, got 5"),
    (["--compile"], "2", "--compile does not apply to --ep (the dropless expert-parallel"),
    (["--hf-model", "mixtral"], "2", "--hf-model does not apply to --ep"),
])
def test_ep_flag_errors(extra, world, message, monkeypatch, capsys) -> None:
    if world is not None:
        monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit):
        train_moe.parse_args([*TINY, "--ep", "2", *extra])
    assert message in capsys.readouterr().err
