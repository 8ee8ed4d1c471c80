"""te_ops experts inside Hugging Face transformers models (te_ops.integrations.transformers).

Every family's tiny model is built from a config with random init (no downloads). The
reference is HF's own eager experts loop (``experts_implementation="eager"``) on the same
model: outputs, input grads, router grads and every expert grad must agree within a norm-wise
relative error of 1e-5 (float32) and 1e-10 (float64), including batches that leave experts
without tokens.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from torch import nn

transformers = pytest.importorskip(
    "transformers", minversion="5.0",
    reason="the HF integration tests need transformers>=5 (pip install -e '.[test,hf]')")

import te_ops  # noqa: E402
from te_ops.integrations import transformers as te_hf  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=64, num_experts_per_tok=2)
FAMILIES = {  # config class, causal-LM class, family-specific config (8 routed experts each)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=16, num_local_experts=8, output_router_logits=True)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=24, moe_intermediate_size=16, num_experts=8,
                       shared_expert_intermediate_size=24, output_router_logits=True)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=24, moe_intermediate_size=16, num_experts=8,
                       head_dim=16, norm_topk_prob=True, output_router_logits=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=16, num_experts=8, output_router_logits=True,
                   eos_token_id=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(intermediate_size=24, moe_intermediate_size=16, n_routed_experts=8,
                         n_shared_experts=1, first_k_dense_replace=0, n_group=2, topk_group=1,
                         q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=8,
                         qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=2)),
}
FAMILY = pytest.mark.parametrize("family", sorted(FAMILIES))


def make_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(dtype)
    if family == "deepseek_v3":  # its router weight starts at zero: give it some signal
        for layer in model.model.layers:
            nn.init.normal_(layer.mlp.gate.weight, std=0.5)
    return model


def experts_modules(model) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "has_gate")]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error of ``a`` against ``b`` (0 when both are zero)."""
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(torch.finfo(b.dtype).tiny))


def assert_close(a, b, dtype, what, tol=TOL):
    assert a is not None and b is not None, what
    assert rel(a, b) <= tol[dtype], f"{what}: relative error {rel(a, b):.3g} > {tol[dtype]}"


# ------------------------------------------------------------------------------- one block
@FAMILY
@DTYPES
def test_experts_block_matches_hf_eager(family, dtype):
    """Outputs and grads (hidden states, routing weights, expert weights) of one experts module;
    3 tokens x top-2 over 8 experts leave at least 2 experts idle, 16 tokens likely none."""
    te_hf.register()
    model = make_model(family, dtype)
    experts = experts_modules(model)[0]
    hidden, num_experts = experts.gate_up_proj.shape[2], experts.num_experts
    for tokens, seed in ((3, 1), (16, 2)):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(tokens, hidden, generator=g, dtype=dtype)
        index = torch.stack([torch.randperm(num_experts, generator=g)[:2] for _ in range(tokens)])
        weights = torch.rand(tokens, 2, generator=g, dtype=torch.float32)  # HF routers: fp32
        dy = torch.randn(tokens, hidden, generator=g, dtype=dtype)
        results = {}
        for impl in ("eager", "te_ops"):
            model.set_experts_implementation(impl)
            experts.zero_grad(set_to_none=True)
            xi, wi = x.clone().requires_grad_(), weights.clone().requires_grad_()
            out = experts(xi, index, wi)
            (out * dy).sum().backward()
            results[impl] = (out, xi.grad, wi.grad, experts.gate_up_proj.grad.clone(),
                             experts.down_proj.grad.clone())
        names = ("output", "grad hidden", "grad routing weights", "grad gate_up_proj",
                 "grad down_proj")
        for name, te, ref in zip(names, results["te_ops"], results["eager"]):
            assert te.dtype == ref.dtype, name
            assert_close(te, ref, dtype, f"{family} {tokens} tokens {name}")
        idle = [e for e in range(num_experts) if not (index == e).any()]
        if tokens == 3:
            assert len(idle) >= 2
        for e in idle:  # idle experts: zero gradients (HF 5.x eager gives zeros as well)
            assert results["te_ops"][3][e].abs().max() == 0
            assert results["eager"][3][e].abs().max() == 0


# ------------------------------------------------------------------------------- whole models
@FAMILY
@DTYPES
def test_causal_lm_matches_hf_eager(family, dtype):
    """A tiny *ForCausalLM: logits, loss (with the router aux loss where the family has one),
    grads of the input embeddings, of every router and of every expert parameter."""
    model = make_model(family, dtype)
    te_hf.use_te_ops(model)
    for shape, seed in (((1, 3), 3), ((2, 12), 4)):  # 3 tokens x top-2 < 8 experts: idle ones
        ids = torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(seed))
        embeds = model.get_input_embeddings()(ids).detach()
        results = {}
        for impl in ("eager", "te_ops"):
            model.set_experts_implementation(impl)
            model.zero_grad(set_to_none=True)
            inputs = embeds.clone().requires_grad_()
            out = model(inputs_embeds=inputs, labels=ids)
            out.loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()
                     if ".experts." in n or ".gate." in n}
            results[impl] = (out.logits.detach(), out.loss.detach(), inputs.grad, grads)
        assert all(te_hf._BLOCK_KEY in vars(m) for m in experts_modules(model))  # te_ops ran
        te, ref = results["te_ops"], results["eager"]
        tag = f"{family} {shape}"
        assert_close(te[0], ref[0], dtype, f"{tag} logits")
        assert_close(te[1], ref[1], dtype, f"{tag} loss")
        assert_close(te[2], ref[2], dtype, f"{tag} grad inputs_embeds")
        assert any(".gate." in n for n in ref[3]) and any("gate_up_proj" in n for n in ref[3])
        for name in ref[3]:
            assert_close(te[3][name], ref[3][name], dtype, f"{tag} grad {name}")


@FAMILY
def test_state_dict_unchanged_and_pretrained_round_trip(family, tmp_path):
    model = make_model(family)
    keys = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    n_params = len(list(model.parameters()))
    te_hf.use_te_ops(model)
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(ids).logits
    assert {k: (v.shape, v.dtype) for k, v in model.state_dict().items()} == keys
    assert len(list(model.parameters())) == n_params
    for experts in experts_modules(model):  # zero-copy: the te_ops block holds HF's Parameters
        block = te_hf.experts_block(experts)
        assert block[0].weight is experts.gate_up_proj and block[2].weight is experts.down_proj

    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, experts_implementation="te_ops")
    assert loaded.config._experts_implementation == "te_ops"
    assert set(loaded.state_dict()) == set(keys)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, logits, rtol=0, atol=0)


def test_import_te_ops_does_not_import_transformers():
    code = ("import sys, te_ops, te_ops.integrations; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------------------------------------- conversion
class PerExpertMLP(nn.Module):
    """A transformers 4.x per-expert MLP (MixtralBlockSparseTop2MLP / Qwen2MoeMLP layout)."""

    def __init__(self, names: tuple[str, str, str], hidden: int, inter: int, act: str = "silu",
                 bias: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden, inter, bias=bias, dtype=dtype))
        setattr(self, up, nn.Linear(hidden, inter, bias=bias, dtype=dtype))
        setattr(self, down, nn.Linear(inter, hidden, bias=bias, dtype=dtype))
        self.names = names
        self.act_fn = transformers.activations.ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act_fn(gate(x)) * up(x))


def per_expert_list(layout: str, experts: int = 4, hidden: int = 8, inter: int = 12, **kw):
    torch.manual_seed(7)
    return nn.ModuleList(PerExpertMLP(te_hf.LAYOUTS[layout], hidden, inter, **kw)
                         for _ in range(experts))


@pytest.mark.parametrize("layout", ["w1_w3_w2", "gate_up_down"])
def test_4x_layout_round_trip_is_exact_and_computes_the_same(layout):
    experts = per_expert_list(layout, dtype=torch.float64)
    block = te_hf.from_hf_experts(experts)
    assert block[0].weight.shape == (4, 24, 8) and block[2].weight.shape == (4, 8, 12)
    state = te_hf.to_hf_state_dict(block, layout)
    expected = experts.state_dict()
    assert list(state) == list(expected)
    for k in expected:
        assert torch.equal(state[k], expected[k]), k
    prefixed = te_hf.to_hf_state_dict(block, layout, prefix="model.layers.0.mlp.experts.")
    assert all(k.startswith("model.layers.0.mlp.experts.") for k in prefixed)
    fresh = per_expert_list(layout, dtype=torch.float64)
    nn.init.zeros_(fresh[0].get_submodule(te_hf.LAYOUTS[layout][0]).weight)
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                  expected.values()))
    # Same function: rows sorted by expert, probs applied.
    x = torch.randn(7, 8, dtype=torch.float64)
    sizes = torch.tensor([2, 0, 4, 1])
    probs = torch.rand(7, dtype=torch.float64)
    ref = torch.cat([experts[e](part) for e, part in enumerate(x.split(sizes.tolist()))])
    torch.testing.assert_close(block(x, sizes, probs, sizes), ref * probs[:, None], rtol=1e-12,
                               atol=1e-12)


def test_4x_sparse_block_with_experts_attribute_is_accepted():
    holder = nn.Module()
    holder.experts = per_expert_list("w1_w3_w2")
    assert te_hf.unsupported_reason(holder) is None
    block = te_hf.from_hf_experts(holder)
    assert torch.equal(block[2].weight[1], holder.experts[1].w2.weight)


def test_packed_layout_round_trip_and_zero_copy():
    experts = experts_modules(make_model("mixtral"))[0]
    shared = te_hf.from_hf_experts(experts)
    assert shared[0].weight is experts.gate_up_proj and shared[2].weight is experts.down_proj
    copied = te_hf.from_hf_experts(experts, copy=True)
    assert copied[0].weight is not experts.gate_up_proj
    state = te_hf.to_hf_state_dict(copied)
    assert list(state) == ["gate_up_proj", "down_proj"]
    for k, v in experts.state_dict().items():
        assert torch.equal(state[k], v), k
    # packed -> 4.x -> packed is exact too
    as_4x = te_hf.to_hf_state_dict(copied, "w1_w3_w2")
    mlps = per_expert_list("w1_w3_w2", experts=8, hidden=32, inter=16)
    mlps.load_state_dict(as_4x)
    back = te_hf.to_hf_state_dict(te_hf.from_hf_experts(mlps))
    assert all(torch.equal(back[k], state[k]) for k in state)


# ------------------------------------------------------------------------------- refusals
def test_gpt_oss_clamped_glu_is_refused_with_the_reason():
    config = transformers.GptOssConfig(**{**COMMON, "intermediate_size": 16,
                                          "num_local_experts": 4, "head_dim": 16})
    model = transformers.GptOssForCausalLM(config)
    experts = experts_modules(model)[0]
    reason = te_hf.unsupported_reason(experts)
    assert reason is not None and "clamped GLU" in reason and "GptOssExperts" in reason
    with pytest.raises(ValueError, match="module: te_ops cannot run these experts: .*clamped"):
        te_hf.from_hf_experts(experts)
    with pytest.raises(ValueError, match=r"model: te_ops cannot run model\.layers\.0\..*"
                                         "clamped"):
        te_hf.use_te_ops(model)
    assert model.config._experts_implementation != "te_ops"  # nothing was switched


def test_non_silu_activation_is_refused_and_the_forward_raises():
    model = make_model("mixtral", hidden_act="gelu")
    experts = experts_modules(model)[0]
    assert "activation GELUActivation" in te_hf.unsupported_reason(experts)
    with pytest.raises(ValueError, match="hidden_act must be 'silu'"):
        te_hf.use_te_ops(model)
    model.set_experts_implementation("te_ops")  # switched by hand: the forward raises
    with pytest.raises(ValueError, match="GELUActivation"):
        model(torch.zeros(1, 2, dtype=torch.long))


@pytest.mark.parametrize("case,match", [
    ("bias", "expert 0 .* has biases"),
    ("gelu", "expert 0 .* uses activation GELUActivation"),
    ("other", "neither a packed experts module"),
])
def test_4x_refusals_name_the_reason(case, match):
    if case == "other":
        module = nn.Linear(2, 2)
    else:
        module = per_expert_list("gate_up_down", bias=case == "bias",
                                 act="gelu" if case == "gelu" else "silu")
    assert te_hf.unsupported_reason(module) is not None
    with pytest.raises(ValueError, match=match):
        te_hf.from_hf_experts(module)


def test_to_hf_state_dict_errors_name_the_argument():
    import te_ops

    block = te_hf.from_hf_experts(per_expert_list("w1_w3_w2"))
    with pytest.raises(ValueError, match="layout must be one of"):
        te_hf.to_hf_state_dict(block, "w1w2w3")
    biased = te_ops.Sequential(te_ops.GroupedLinear(2, 4, 8), te_ops.ScaledSwiGLU(),
                               te_ops.GroupedLinear(2, 4, 4))
    with pytest.raises(ValueError, match="block: HF MoE experts have no biases"):
        te_hf.to_hf_state_dict(biased)
    with pytest.raises(ValueError, match=r"block must be Sequential\(GroupedLinear"):
        te_hf.to_hf_state_dict(te_ops.Sequential(te_ops.GroupedLinear(2, 4, 4, bias=False)))


def test_model_without_experts_is_refused():
    with pytest.raises(ValueError, match="model: Linear has no transformers experts module"):
        te_hf.use_te_ops(nn.Linear(2, 2))


# ------------------------------------------------------------------------------- main job
def test_main_job_hf_model_trains_both_and_final_losses_agree(tmp_path, monkeypatch):
    from te_ops.examples import train_moe

    monkeypatch.setenv("TRAIN_MOE_PROGRESS", "0")
    tiny = ["--steps", "4", "--batch-size", "2", "--seq-len", "16", "--layers", "1",
            "--d-model", "32", "--heads", "2", "--experts", "4", "--top-k", "2", "--ffn", "16",
            "--eval-every", "2", "--eval-batches", "1", "--seed", "3"]
    metrics = train_moe.main([*tiny, "--hf-model", "qwen3_moe", "--out-dir", str(tmp_path)])
    runs = metrics["runs"]
    assert set(runs) == {"te_ops", "eager"}
    for r in runs.values():
        assert [e["step"] for e in r["evals"]] == [2, 4]
        assert all(e["train_loss"] == e["train_loss"] for e in r["evals"])  # not NaN
    assert metrics["final_val_loss_rel_diff"] < 0.01
    assert metrics["fusions"]["forward"] == ["ForwardGroupedMLP"]
    assert (tmp_path / "loss.png").stat().st_size > 0 and (tmp_path / "metrics.json").exists()
    # Recorded as in the te_ops job (the HF runs share its train_loop): float32, no masters.
    assert metrics["fp32_master_weights"] is False


def test_main_job_hf_model_rejects_cuda_graph():
    from te_ops.examples import train_moe

    with pytest.raises(SystemExit):
        train_moe.main(["--hf-model", "mixtral", "--cuda-graph"])


def test_te_ops_experts_forward_reads_no_device_value(monkeypatch):
    """The meta-device graph-safety proof (tests/test_graph_safety.py) for the HF path."""
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "1")  # a host-syncing fallback raises
    config_cls, _, extra = FAMILIES["mixtral"]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    with torch.device("meta"):
        experts = transformers.models.mixtral.modeling_mixtral.MixtralExperts(config)
    experts.to(torch.bfloat16)  # bf16 experts, fp32 routing weights (as Mixtral's router gives)
    x = torch.empty(10, 32, device="meta", dtype=torch.bfloat16, requires_grad=True)
    weights = torch.empty(10, 2, device="meta", dtype=torch.float32, requires_grad=True)
    index = torch.empty(10, 2, device="meta", dtype=torch.int64)
    out = te_hf.experts_forward(experts, x, index, weights)
    out.backward(torch.empty_like(out))
    assert out.shape == (10, 32) and out.dtype == torch.bfloat16 and x.grad.shape == x.shape
    assert weights.grad.shape == (10, 2) and weights.grad.dtype == torch.float32
    assert experts.gate_up_proj.grad.shape == experts.gate_up_proj.shape


def test_bf16_model_with_fp32_routing_weights_matches_eager_to_bf16_tolerance():
    """Mixtral's router gives fp32 weights to bf16 experts: te_ops takes them as they are and
    returns their gradient in fp32; results agree with HF's to bf16 rounding."""
    model = make_model("mixtral", torch.bfloat16)
    te_hf.use_te_ops(model)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(6))
    results = {}
    for impl in ("eager", "te_ops"):
        model.set_experts_implementation(impl)
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids)
        out.loss.backward()
        results[impl] = (out.logits.detach().float(), model.model.layers[0].mlp.gate.weight.grad,
                         model.model.layers[0].mlp.experts.gate_up_proj.grad)
    for te, ref in zip(results["te_ops"], results["eager"]):
        assert te.dtype == ref.dtype
        assert rel(te.float(), ref.float()) < 2e-2


def test_per_group_te_ops_block_exports_to_every_layout():
    import te_ops

    block = te_ops.Sequential(
        te_ops.GroupedLinear(3, 8, 12, bias=False, single_grouped_weight=False),
        te_ops.ScaledSwiGLU(),
        te_ops.GroupedLinear(3, 6, 8, bias=False, single_grouped_weight=False))
    packed = te_hf.to_hf_state_dict(block)
    assert torch.equal(packed["gate_up_proj"][2], block[0].weight2)
    assert torch.equal(packed["down_proj"][1], block[2].weight1)
    per_expert = te_hf.to_hf_state_dict(block, "gate_up_down")
    assert torch.equal(per_expert["2.gate_proj.weight"], block[0].weight2[:6])
    assert torch.equal(per_expert["2.up_proj.weight"], block[0].weight2[6:])


# --------------------------------------------------------------------------- checkpointing
def _fp8_grads(model, ids):
    model.zero_grad(set_to_none=True)
    with te_ops.autocast(recipe=te_ops.recipe.Float8CurrentScaling()):
        loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_hf_activation_checkpointing_under_a_recipe_with_checkpoint_context_fn():
    # HF's activation checkpointing recomputes each decoder layer outside te_ops.autocast: with
    # its default (use_reentrant=False) torch raised "A different number of tensors was saved".
    # te_ops.checkpoint_context_fn as context_fn re-enters the recipe: gradients bit for bit
    # those of the uncheckpointed model under the recipe.
    import copy

    model = make_model("mixtral")
    te_hf.use_te_ops(model)
    model.train()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    loss0, grads0 = _fp8_grads(copy.deepcopy(model), ids)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={
        "use_reentrant": False, "context_fn": te_ops.checkpoint_context_fn})
    loss, grads = _fp8_grads(model, ids)
    assert torch.equal(loss, loss0)
    assert grads.keys() == grads0.keys() and len(grads) > 0
    for name, g in grads.items():
        assert torch.equal(g, grads0[name]), name


# ------------------------------------------------------------------------------- whole MoE blocks
#: Norm-wise relative error limits of te_ops.MoE against HF's whole block: HF's routers compute
#: in float32 whatever the model's dtype (softmax(logits.float()), DeepSeek-V3's float32 gate),
#: te_ops' Router in float64 for a float64 model, so float64 agrees to float32 rounding.
MOE_TOL = {torch.float32: 1e-5, torch.float64: 1e-6}


def sparse_blocks(model) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules()
            if type(m).__name__ in te_hf.MOE_BLOCKS or isinstance(m, te_hf.TeOpsMoeBlock)]


def moe_model(family: str, dtype: torch.dtype = torch.float32, **overrides):
    """:func:`make_model` with HF's eager experts loop (the reference) and, for DeepSeek-V3,
    a nonzero correction bias (so it changes which experts are chosen)."""
    model = make_model(family, dtype, **overrides)
    model.set_experts_implementation("eager")
    with torch.no_grad():
        with_correction_bias(model)
    return model


def with_correction_bias(model) -> None:
    """DeepSeek-V3: a nonzero correction bias, so it changes which experts are chosen."""
    for _, block in sparse_blocks(model):
        bias = getattr(block.gate, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(torch.linspace(-0.3, 0.3, bias.numel()))


def assert_moe_close(a, b, dtype, what):
    assert_close(a, b, dtype, what, MOE_TOL)


@FAMILY
@DTYPES
def test_moe_block_matches_the_hf_block(family, dtype):
    """te_ops.MoE in place of one HF sparse-MoE block (router, experts, combine; shared
    experts HF's): output, input grad and the grad of every parameter of the block, for 3
    tokens (idle experts) and 24."""
    import copy

    model = moe_model(family, dtype)
    hf = sparse_blocks(model)[0][1]
    ref = copy.deepcopy(hf)
    mine = te_hf.TeOpsMoeBlock(hf)
    assert [n for n, _ in mine.named_parameters()] == [n for n, _ in ref.named_parameters()]
    for shape, seed in (((1, 3), 1), ((2, 12), 2)):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(*shape, 32, generator=g, dtype=dtype)
        dy = torch.randn(*shape, 32, generator=g, dtype=dtype)
        results = []
        for block in (mine, ref):
            block.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            out = block(xi)
            (out * dy).sum().backward()
            results.append([out, xi.grad] + [p.grad for p in block.parameters()])
        names = ["output", "grad x"] + [f"grad {n}" for n, _ in ref.named_parameters()]
        for name, a, b in zip(names, *results):
            assert a.dtype == b.dtype, name
            assert_moe_close(a, b, dtype, f"{family} {shape} {name}")
    assert te_hf._MOE_KEY in vars(mine)  # te_ops.MoE ran


@FAMILY
@DTYPES
def test_causal_lm_with_te_ops_moe_matches_hf(family, dtype):
    """A tiny *ForCausalLM with every sparse-MoE block replaced: logits, loss (with HF's router
    aux loss, whose logits the HF gate still records), the aux loss itself and the grads of the
    input embeddings and of every parameter."""
    import copy

    model = moe_model(family, dtype)
    ref = copy.deepcopy(model)
    te_hf.use_te_ops_moe(model)
    blocks = sparse_blocks(model)
    assert blocks and all(isinstance(m, te_hf.TeOpsMoeBlock) for _, m in blocks)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    embeds = model.get_input_embeddings()(ids).detach()
    results = []
    for m in (model, ref):
        inputs = embeds.clone().requires_grad_()
        out = m(inputs_embeds=inputs, labels=ids)
        out.loss.backward()
        results.append((out, inputs.grad, {n: p.grad for n, p in m.named_parameters()}))
    (out, gx, grads), (out_ref, gx_ref, grads_ref) = results
    assert all(te_hf._MOE_KEY in vars(m) for _, m in blocks)
    assert_moe_close(out.logits, out_ref.logits, dtype, f"{family} logits")
    assert_moe_close(out.loss, out_ref.loss, dtype, f"{family} loss")
    if out_ref.aux_loss is not None:
        assert out_ref.aux_loss > 0
        assert_moe_close(out.aux_loss, out_ref.aux_loss, dtype, f"{family} aux loss")
    assert_moe_close(gx, gx_ref, dtype, f"{family} grad inputs_embeds")
    assert set(grads) == set(grads_ref)
    for name, g in grads_ref.items():
        if g is not None:
            assert_moe_close(grads[name], g, dtype, f"{family} grad {name}")


@FAMILY
def test_moe_block_shares_hf_tensors_and_state_dict(family, tmp_path):
    model = moe_model(family)
    state = model.state_dict()
    params = dict(model.named_parameters())
    te_hf.use_te_ops_moe(model)
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == {
        k: v.data_ptr() for k, v in state.items()}
    assert dict(model.named_parameters()) == params  # the same Parameter objects, same names
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(ids).logits
    for _, block in sparse_blocks(model):
        moe = block.moe
        assert moe.router.weight is block.gate.weight
        assert moe.experts[0].weight is block.experts.gate_up_proj
        assert moe.experts[2].weight is block.experts.down_proj
        bias = getattr(block.gate, "e_score_correction_bias", None)
        if bias is not None:  # DeepSeek-V3: the balancing update moves HF's buffer
            assert moe.router.expert_bias.data_ptr() == bias.data_ptr()
            before = bias.clone()
            moe.router.update_expert_bias(torch.arange(bias.numel()), rate=0.01)
            assert (bias - before)[0] > 0 > (bias - before)[-1]
            bias.copy_(before)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)  # a plain HF model: same keys, same logits
    assert set(loaded.state_dict()) == set(state)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, logits, rtol=1e-5, atol=1e-5)


def test_moe_block_follows_hf_tensor_changes():
    """``model.to(float64)`` and ``load_state_dict`` after a call: the te_ops.MoE is rebuilt on
    the new tensors (or sees the in-place copy) and still computes the HF block."""
    import copy

    model = moe_model("mixtral")
    ref = copy.deepcopy(model)
    te_hf.use_te_ops_moe(model)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        model(ids)
        first = sparse_blocks(model)[0][1].moe
        for m in (model, ref):
            m.to(torch.float64)
        assert sparse_blocks(model)[0][1].moe is not first
        assert_moe_close(model(ids).logits, ref(ids).logits, torch.float64, "after .to()")
        fresh = make_model("mixtral", torch.float64, seed=9)
        for m in (model, ref):
            m.load_state_dict(fresh.state_dict())
        assert_moe_close(model(ids).logits, ref(ids).logits, torch.float64, "after load")


def test_deepseek_v3_float32_gate_under_bfloat16_experts():
    """DeepSeek-V3 as ``from_pretrained`` keeps it: bf16 model, float32 gate and correction
    bias. te_ops' Router runs the gate in float32 on the tokens cast up, as HF's router does:
    the chosen experts are HF's (checked through the output within bf16 rounding)."""
    import copy

    model = moe_model("deepseek_v3").to(torch.bfloat16)
    for _, block in sparse_blocks(model):
        block.gate.float()
    hf = sparse_blocks(model)[0][1]
    ref = copy.deepcopy(hf)
    mine = te_hf.TeOpsMoeBlock(hf)
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        assert rel(mine(x).float(), ref(x).float()) < 2e-2


@pytest.mark.parametrize("family, overrides, match", [
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1: in training it "
                                                "multiplies the tokens by random noise"),
    ("deepseek_v3", dict(num_experts_per_tok=4, n_group=2, topk_group=1),
     r"sums the top_k // topk_group = 4 // 1 = 4 best"),
    ("qwen3_moe", dict(hidden_act="gelu"), "uses activation GELU"),
])
def test_moe_block_refusals_name_the_mismatch(family, overrides, match):
    model = moe_model(family, **overrides)
    name, block = sparse_blocks(model)[0]
    assert re.search(match, te_hf.moe_block_unsupported_reason(block))
    with pytest.raises(ValueError, match=f"te_ops.MoE cannot compute {name}: .*{match}"):
        te_hf.use_te_ops_moe(model)
    assert not any(isinstance(m, te_hf.TeOpsMoeBlock) for m in model.modules())  # untouched
    with pytest.raises(ValueError, match=f"block: te_ops.MoE cannot compute this block: .*"
                                         f"{match}"):
        te_hf.TeOpsMoeBlock(block)


def test_moe_block_other_refusals():
    model = moe_model("deepseek_v3").to(torch.bfloat16)  # its gate in bf16 too
    block = sparse_blocks(model)[0][1]
    assert "keep the gate in float32 (block.gate.float()" in te_hf.moe_block_unsupported_reason(
        block)
    mixtral = moe_model("mixtral")
    block = sparse_blocks(mixtral)[0][1]
    block.gate = nn.Linear(32, 8, bias=False)
    assert "MixtralSparseMoeBlock.gate is a Linear, not MixtralTopKRouter" in (
        te_hf.moe_block_unsupported_reason(block))
    assert "Linear is not a sparse-MoE block te_ops.MoE maps (known: MixtralSparseMoeBlock" in (
        te_hf.moe_block_unsupported_reason(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="has no sparse-MoE block te_ops.MoE maps"):
        te_hf.use_te_ops_moe(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        te_hf.use_te_ops_moe("mixtral")
    model = moe_model("qwen3_moe")
    te_hf.use_te_ops_moe(model)
    assert te_hf.use_te_ops_moe(model) is model  # replaced blocks are kept
