"""te_ops' transformers experts path re-checks the HF module on every call.

What te_ops builds from a foreign experts module (the activation, the layout flags, the
Parameter objects, their shapes, dtypes and devices) is compared with the module as it is at
each call: a change after the first forward either runs the changed module right (compared with
transformers' own eager loop) or raises the same refusal the unchanged check gives, never
silently reuses the old block.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip(
    "transformers", minversion="5.0",
    reason="the HF integration tests need transformers>=5 (pip install -e '.[test,hf]')")

from te_ops.integrations import transformers as te_hf  # noqa: E402

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=64, num_experts_per_tok=2)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=16, num_local_experts=4)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=24, moe_intermediate_size=16, num_experts=4,
                       head_dim=16)),
}
FAMILY = pytest.mark.parametrize("family", sorted(FAMILIES))


def _experts(family: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(dtype)
    te_hf.register()
    return model, next(m for m in model.modules()
                       if hasattr(m, "gate_up_proj") and hasattr(m, "has_gate"))


def _inputs(experts: nn.Module, dtype: torch.dtype = torch.float32, tokens: int = 7):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, experts.gate_up_proj.shape[2], generator=g, dtype=dtype)
    index = torch.stack([torch.randperm(experts.num_experts, generator=g)[:2]
                         for _ in range(tokens)])
    return x, index, torch.rand(tokens, 2, generator=g)


def _run(model, experts, impl, x, index, w):
    model.set_experts_implementation(impl)
    with torch.no_grad():
        return experts(x, index, w)


def _assert_matches_eager(model, experts, dtype=torch.float32):
    x, index, w = _inputs(experts, dtype)
    ref = _run(model, experts, "eager", x, index, w)
    got = _run(model, experts, "te_ops", x, index, w)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@FAMILY
@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_activation_replaced_after_first_forward_is_refused(family, act):
    model, experts = _experts(family)
    _assert_matches_eager(model, experts)  # the first forward builds te_ops' block
    experts.act_fn = transformers.activations.ACT2FN[act]
    before = te_hf.unsupported_reason(experts)
    assert before is not None and "uses activation" in before
    x, index, w = _inputs(experts)
    with pytest.raises(ValueError, match="te_ops cannot run these experts: .* uses activation"):
        _run(model, experts, "te_ops", x, index, w)
    # switching back to SiLU (a new object) runs again, equal to HF's loop
    experts.act_fn = nn.SiLU()
    _assert_matches_eager(model, experts)


@FAMILY
def test_layout_flag_changed_after_first_forward_is_refused(family):
    model, experts = _experts(family)
    _assert_matches_eager(model, experts)
    experts.is_transposed = True
    x, index, w = _inputs(experts)
    with pytest.raises(ValueError, match="stores transposed weights"):
        _run(model, experts, "te_ops", x, index, w)


@FAMILY
def test_parameters_replaced_after_first_forward_are_used(family):
    model, experts = _experts(family)
    _assert_matches_eager(model, experts)
    old = te_hf.experts_block(experts)
    experts.gate_up_proj = nn.Parameter(torch.randn_like(experts.gate_up_proj))
    _assert_matches_eager(model, experts)
    new = te_hf.experts_block(experts)
    assert new is not old and new[0].weight is experts.gate_up_proj
    assert te_hf.experts_block(experts) is new  # unchanged module: the block is kept


@FAMILY
def test_module_dtype_changed_after_first_forward(family):
    model, experts = _experts(family)
    _assert_matches_eager(model, experts)
    model.to(torch.float64)  # same Parameter objects, new dtype
    x, index, w = _inputs(experts, torch.float64)
    ref = _run(model, experts, "eager", x, index, w)
    got = _run(model, experts, "te_ops", x, index, w)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


@FAMILY
def test_parameter_shape_changed_in_place_is_rechecked(family):
    model, experts = _experts(family)
    _assert_matches_eager(model, experts)
    with torch.no_grad():  # a bad checkpoint loader: one expert fewer in gate_up_proj only
        experts.gate_up_proj.data = experts.gate_up_proj.data[1:].clone()
    x, index, w = _inputs(experts)
    with pytest.raises(ValueError, match="expected \\(E, 2I, H\\) and \\(E, H, I\\)"):
        _run(model, experts, "te_ops", x, index, w)
