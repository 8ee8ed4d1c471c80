"""te_ops experts inside Hugging Face transformers mixture-of-experts models.

transformers 5.x stores each MoE layer's routed experts packed in one module (``MixtralExperts``,
``Qwen2MoeExperts``, ``Qwen3MoeExperts``, ``OlmoeExperts``, ``DeepseekV3Experts``, ...):

- ``gate_up_proj`` (experts, 2 * intermediate, hidden): the gate projection's rows first, then
  the up projection's;
- ``down_proj`` (experts, hidden, intermediate);

and computes ``down_proj[e] @ (act_fn(gate) * up)`` times the routing weight. That is te_ops'
grouped MLP ``GroupedLinear -> ScaledSwiGLU -> GroupedLinear`` with no row reordering: te_ops'
SwiGLU gates with the *first* half (``SiLU(a) * b``), as HF does. ``GroupedLinear`` keeps its
weight as one packed (experts, out, in) parameter by default, exactly HF's
layout, so the te_ops block here *is given HF's own Parameter objects*: no copy, gradients land
in HF's parameters and ``state_dict`` / ``save_pretrained`` / ``from_pretrained`` are unchanged.

Switching a model (transformers >= 5, whose experts classes use ``@use_experts_implementation``)::

    from te_ops.integrations.transformers import use_te_ops
    use_te_ops(model)   # registers "te_ops", checks every experts module, switches the model

or ``register()`` then ``model.set_experts_implementation("te_ops")`` (or
``from_pretrained(..., experts_implementation="te_ops")``). The routers, the aux loss, shared
experts and everything else stay HF's.

``from_hf_experts`` / ``to_hf_state_dict`` convert between te_ops blocks and both the 5.x packed
layout and the 4.x per-expert layouts (``w1``/``w3``/``w2`` in Mixtral, ``gate_proj``/
``up_proj``/``down_proj`` in Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3).

This module imports transformers only where a function needs it (``register``, ``use_te_ops``);
``import te_ops`` never imports it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..basic import GroupedLinear, ScaledSwiGLU, SwiGLU
from ..basic.grouped_linear import _SUPPORTED_DTYPES, stacked
from ..routing import permute, unpermute
from ..sequential import Sequential

__all__ = [
    "IMPLEMENTATION",
    "LAYOUTS",
    "MOE_BLOCKS",
    "TeOpsMoeBlock",
    "experts_block",
    "experts_forward",
    "from_hf_experts",
    "from_hf_moe_block",
    "moe_block_unsupported_reason",
    "register",
    "to_hf_state_dict",
    "unsupported_reason",
    "use_te_ops",
    "use_te_ops_moe",
]

IMPLEMENTATION = "te_ops"
"""The name under which :func:`register` adds te_ops to transformers' ``ExpertsInterface``."""

LAYOUTS = {
    "packed": ("gate_up_proj", "down_proj"),  # transformers >= 5: one (E, ...) tensor each
    "w1_w3_w2": ("w1", "w3", "w2"),  # transformers 4.x Mixtral: gate, up, down per expert
    "gate_up_down": ("gate_proj", "up_proj", "down_proj"),  # 4.x Qwen2/3-MoE, OLMoE, DeepSeek
}
"""Weight layouts: name -> HF parameter names (4.x names: gate, up, down projection)."""

_BLOCK_KEY = "_te_ops_experts_block"  # in the HF module's __dict__: not a submodule


# ------------------------------------------------------------------------------- checks
def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("te_ops.integrations.transformers needs transformers>=4.57: "
                          "pip install 'te_ops[hf]'") from exc
    return transformers


def _is_silu(act_fn: Any) -> bool:
    if isinstance(act_fn, nn.SiLU) or act_fn is nn.functional.silu:
        return True
    # transformers' ACT2FN["silu"] is its own SiLUActivation (forward: F.silu).
    return type(act_fn).__name__ == "SiLUActivation"


def _act_reason(module: nn.Module, where: str) -> str | None:
    act_fn = getattr(module, "act_fn", None)
    if act_fn is None:
        return f"{where} has no act_fn; te_ops' SwiGLU computes SiLU(gate) * up only"
    if not _is_silu(act_fn):
        name = getattr(act_fn, "__name__", type(act_fn).__name__)
        return (f"{where} uses activation {name}; te_ops' SwiGLU computes SiLU(gate) * up "
                f"only (hidden_act must be 'silu')")
    return None


def _per_expert_layout(experts: Any) -> str | None:
    """The 4.x layout name of a ModuleList of per-expert MLPs, else None."""
    if not isinstance(experts, nn.ModuleList) or len(experts) == 0:
        return None
    for layout in ("w1_w3_w2", "gate_up_down"):
        if all(isinstance(getattr(e, n, None), nn.Linear) for e in experts
               for n in LAYOUTS[layout]):
            return layout
    return None


#: The packed experts modules' layout flags te_ops checks: flag -> (refused value, why).
_PACKED_FLAGS = {
    "has_gate": (False, "has no gate projection (up_proj only)"),
    "has_bias": (True, "has expert biases (te_ops' HF path maps bias-free experts)"),
    "is_transposed": (True, "stores transposed weights (E, in, out), not (E, out, in)"),
    "is_concatenated": (False, "interleaves gate and up rows instead of gate rows first"),
    "has_post_expert_norm": (True, "normalizes each expert's output"),
    "_is_expert_parallel": (True, "is expert-parallel (sentinel routing)"),
}


def _packed_reason(module: nn.Module) -> str | None:
    name = type(module).__name__
    gate_fn = getattr(type(module), "_apply_gate", None)
    if gate_fn is not None and gate_fn.__name__ != "_default_apply_gate":
        return (f"{name} has its own gate function {gate_fn.__qualname__} (e.g. "
                "GPT-OSS's clamped GLU: (clamp(up) + 1) * gate * sigmoid(alpha * gate)), which "
                "te_ops' SwiGLU (SiLU(gate) * up) cannot express")
    for flag, (bad, why) in _PACKED_FLAGS.items():
        if getattr(module, flag, not bad) == bad:
            return f"{name} {why}"
    reason = _act_reason(module, name)
    if reason:
        return reason
    w1, w2 = module.gate_up_proj, module.down_proj
    if w1.dim() != 3 or w2.dim() != 3 or w1.shape[0] != w2.shape[0] or (
            w1.shape[1] != 2 * w2.shape[2]) or w1.shape[2] != w2.shape[1]:
        return (f"{name} has gate_up_proj {tuple(w1.shape)} and down_proj {tuple(w2.shape)}; "
                "expected (E, 2I, H) and (E, H, I)")
    if w1.dtype not in _SUPPORTED_DTYPES or w2.dtype != w1.dtype:
        return f"{name} has parameter dtypes {w1.dtype}/{w2.dtype}; te_ops takes one of " \
               f"{_SUPPORTED_DTYPES}"
    return None


def unsupported_reason(module: nn.Module) -> str | None:
    """Why te_ops cannot run this HF experts module, or ``None`` when it can.

    Accepted: a 5.x packed experts module (``gate_up_proj`` (E, 2I, H), ``down_proj``
    (E, H, I), SiLU, no bias, default gate), or a 4.x ``nn.ModuleList`` of per-expert MLPs
    (``w1``/``w3``/``w2`` or ``gate_proj``/``up_proj``/``down_proj`` bias-free ``nn.Linear``,
    SiLU ``act_fn``), or a module holding such a list as ``.experts`` (4.x sparse MoE block).
    """
    if isinstance(getattr(module, "gate_up_proj", None), torch.Tensor) and isinstance(
            getattr(module, "down_proj", None), torch.Tensor):
        return _packed_reason(module)
    experts = module if isinstance(module, nn.ModuleList) else getattr(module, "experts", None)
    layout = _per_expert_layout(experts)
    if layout is None:
        return (f"{type(module).__name__} is neither a packed experts module (gate_up_proj, "
                "down_proj) nor a list of per-expert MLPs with w1/w3/w2 or gate_proj/up_proj/"
                "down_proj nn.Linear layers")
    gate, up, down = (getattr(experts[0], n).weight for n in LAYOUTS[layout])
    want = (tuple(gate.shape), tuple(up.shape), tuple(down.shape))
    for i, expert in enumerate(experts):
        if any(getattr(expert, n).bias is not None for n in LAYOUTS[layout]):
            return f"expert {i} ({type(expert).__name__}) has biases; HF MoE experts have none"
        got = tuple(tuple(getattr(expert, n).weight.shape) for n in LAYOUTS[layout])
        if got != want or want[0] != want[1] or want[2] != want[0][::-1]:
            return (f"expert {i} ({type(expert).__name__}) has {'/'.join(LAYOUTS[layout])} "
                    f"weight shapes {got}; every expert needs (I, H), (I, H), (H, I) like "
                    f"expert 0's {want}")
        reason = _act_reason(expert, f"expert {i} ({type(expert).__name__})")
        if reason:
            return reason
    return None


def _check(module: nn.Module) -> None:
    reason = unsupported_reason(module)
    if reason is not None:
        raise ValueError(f"module: te_ops cannot run these experts: {reason}")


# ------------------------------------------------------------------------------- conversion
def _block(num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
           device: torch.device | str) -> Sequential:
    return Sequential(
        GroupedLinear(num_experts, hidden, 2 * intermediate, bias=False,
                      single_grouped_weight=True, device=device, dtype=dtype),
        ScaledSwiGLU(),
        GroupedLinear(num_experts, intermediate, hidden, bias=False,
                      single_grouped_weight=True, device=device, dtype=dtype))


def from_hf_experts(module: nn.Module, *, copy: bool = False) -> Sequential:
    """A te_ops grouped MLP computing the same experts as an HF experts module.

    Parameters
    ----------
    module : torch.nn.Module
        A 5.x packed experts module, a 4.x ``nn.ModuleList`` of per-expert MLPs, or a 4.x sparse
        MoE block holding that list as ``.experts`` (see :func:`unsupported_reason`).
    copy : bool
        5.x only: False (default) makes the te_ops block use HF's ``gate_up_proj`` /
        ``down_proj`` Parameter objects themselves (zero-copy; gradients land in HF's
        parameters); True gives the block its own copies. 4.x weights are always copied (the
        per-expert tensors are not one buffer).

    Returns
    -------
    te_ops.Sequential
        ``GroupedLinear(E, H, 2I, bias=False, single_grouped_weight=True) -> ScaledSwiGLU ->
        GroupedLinear(E, I, H, ...)``; fc1's weight (E, 2I, H) holds the gate rows first. Call
        it as ``block(x, split_sizes, probs, split_sizes)``.

    Raises
    ------
    ValueError
        The module's activation, layout or biases cannot be expressed (the reason is given).
    """
    _check(module)
    if isinstance(getattr(module, "gate_up_proj", None), torch.Tensor):
        w1, w2 = module.gate_up_proj, module.down_proj
        if copy:
            w1, w2 = (nn.Parameter(w.detach().clone(), requires_grad=w.requires_grad)
                      for w in (w1, w2))
    else:
        experts = module if isinstance(module, nn.ModuleList) else module.experts
        names = LAYOUTS[_per_expert_layout(experts)]
        with torch.no_grad():
            w1 = nn.Parameter(torch.stack([torch.cat([getattr(e, names[0]).weight,
                                                      getattr(e, names[1]).weight])
                                           for e in experts]))
            w2 = nn.Parameter(torch.stack([getattr(e, names[2]).weight for e in experts]))
    block = _block(w1.shape[0], w1.shape[2], w2.shape[2], w1.dtype, "meta")
    block[0].weight, block[2].weight = w1, w2
    return block


def _block_weights(block: Sequential) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(block, Sequential):
        raise ValueError("block must be a te_ops.Sequential(GroupedLinear, (Scaled)SwiGLU, "
                         f"GroupedLinear), got {type(block).__name__}")
    ops = list(block)
    if (len(ops) != 3 or not isinstance(ops[0], GroupedLinear)
            or not isinstance(ops[1], SwiGLU) or not isinstance(ops[2], GroupedLinear)):
        raise ValueError("block must be Sequential(GroupedLinear, (Scaled)SwiGLU, GroupedLinear),"
                         f" got ({', '.join(type(op).__name__ for op in ops)})")
    fc1, act, fc2 = ops
    if fc1.has_bias or fc2.has_bias:
        raise ValueError("block: HF MoE experts have no biases; got a GroupedLinear with bias")
    if act.glu_interleave_size is not None:
        raise ValueError("block: HF stores gate rows first; got glu_interleave_size="
                         f"{act.glu_interleave_size}")
    if (fc1.num_groups != fc2.num_groups or fc1.out_features != 2 * fc2.in_features
            or fc2.out_features != fc1.in_features):
        raise ValueError(
            "block: fc1 must be GroupedLinear(E, H, 2I) and fc2 GroupedLinear(E, I, H); got "
            f"fc1 ({fc1.num_groups}, {fc1.in_features}, {fc1.out_features}) and fc2 "
            f"({fc2.num_groups}, {fc2.in_features}, {fc2.out_features})")
    w1 = stacked(fc1.weights(), fc1.single_grouped_weight)
    w2 = stacked(fc2.weights(), fc2.single_grouped_weight)
    return w1.detach(), w2.detach()


def to_hf_state_dict(block: Sequential, layout: str = "packed", prefix: str = ""
                     ) -> dict[str, torch.Tensor]:
    """The experts' weights of a te_ops block under HF's state-dict keys.

    Parameters
    ----------
    block : te_ops.Sequential
        ``GroupedLinear(E, H, 2I) -> ScaledSwiGLU/SwiGLU -> GroupedLinear(E, I, H)``, no biases,
        halves layout (per-group or single grouped weights).
    layout : str
        ``"packed"`` (transformers >= 5: ``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I)),
        ``"w1_w3_w2"`` (4.x Mixtral: ``{e}.w1.weight`` (I, H) gate, ``{e}.w3.weight`` up,
        ``{e}.w2.weight`` (H, I) down) or ``"gate_up_down"`` (4.x Qwen2/3-MoE, OLMoE,
        DeepSeek-V3: ``{e}.gate_proj.weight``, ``{e}.up_proj.weight``, ``{e}.down_proj.weight``).
    prefix : str
        Put before every key (e.g. ``"model.layers.0.mlp.experts."``).

    Returns
    -------
    dict[str, torch.Tensor]
        Detached views of the block's weights (no copy), ready for ``load_state_dict``.

    Raises
    ------
    ValueError
        An unknown ``layout`` or a block that is not such a grouped MLP.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    w1, w2 = _block_weights(block)
    if layout == "packed":
        return {f"{prefix}gate_up_proj": w1, f"{prefix}down_proj": w2}
    gate, up, down = LAYOUTS[layout]
    half = w1.shape[1] // 2
    out: dict[str, torch.Tensor] = {}
    for e in range(w1.shape[0]):
        out[f"{prefix}{e}.{gate}.weight"] = w1[e, :half]
        out[f"{prefix}{e}.{up}.weight"] = w1[e, half:]
        out[f"{prefix}{e}.{down}.weight"] = w2[e]
    return out


# ------------------------------------------------------------------------------- HF interface
def _state(module: nn.Module) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Everything :func:`unsupported_reason` and :func:`from_hf_experts` read from a packed
    experts module: (objects compared by identity, values compared by ``==``)."""
    cls = type(module)
    act_fn = getattr(module, "act_fn", None)
    w1, w2 = module.gate_up_proj, module.down_proj
    objects = (cls, getattr(cls, "_apply_gate", None), act_fn, type(act_fn), w1, w2)
    values = (tuple(getattr(module, flag, None) for flag in _PACKED_FLAGS),
              w1.shape, w2.shape, w1.dtype, w2.dtype, w1.device, w2.device,
              getattr(module, "num_experts", None))
    return objects, values


def _same_state(a: tuple[tuple[Any, ...], tuple[Any, ...]],
                b: tuple[tuple[Any, ...], tuple[Any, ...]]) -> bool:
    return all(x is y for x, y in zip(a[0], b[0])) and a[1] == b[1]


def experts_block(module: nn.Module) -> Sequential:
    """The te_ops block that runs this HF packed experts module, on its own Parameters.

    Built on first use and kept in the module's ``__dict__`` (not a submodule: ``state_dict``
    and ``parameters()`` do not change). Every call compares what the block was built from
    (the class and its gate function, ``act_fn`` and its type, the layout flags,
    ``num_experts``, the ``gate_up_proj`` / ``down_proj`` Parameter objects, their shapes,
    dtypes and devices) with the module as it is now, and rebuilds (re-checking) on any
    difference: ``from_pretrained`` loading into new Parameters, ``module.to(dtype)``, an
    ``act_fn`` replaced after the first forward. Nothing cached is reused silently.

    Raises
    ------
    ValueError
        te_ops cannot run the module as it is now (the reason is given).
    """
    return _built_for(module, _BLOCK_KEY, _state(module), from_hf_experts)


def _built_for(module: nn.Module, key: str, state: tuple[tuple[Any, ...], tuple[Any, ...]],
               build: Any) -> Any:
    """``build(module)``, kept in ``module.__dict__[key]`` (a plain attribute: not in
    ``state_dict`` / ``parameters()``) with the ``state`` it was built from; rebuilt when the
    module's state differs (a refused module keeps no stale object)."""
    cached = module.__dict__.get(key)
    if cached is None or not _same_state(cached[0], state):
        module.__dict__.pop(key, None)
        cached = (state, build(module))
        module.__dict__[key] = cached
    return cached[1]


def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"te_ops"`` experts implementation (the signature of HF's experts forward).

    Parameters
    ----------
    module : torch.nn.Module
        A 5.x packed experts module (``self`` in HF's call).
    hidden_states : torch.Tensor
        (tokens, hidden), the parameters' dtype.
    top_k_index : torch.Tensor
        (tokens, top_k) integer expert ids.
    top_k_weights : torch.Tensor
        (tokens, top_k) routing weights, any float dtype (HF's routers often give fp32 for
        bf16 models): ScaledSwiGLU multiplies in fp32 (fp64 for fp64) and returns their
        gradient in their own dtype.

    Returns
    -------
    torch.Tensor
        (tokens, hidden) in ``hidden_states``' dtype: ``sum_k w_k * down(SiLU(gate) * up)``.

    Raises
    ------
    ValueError
        The module cannot run on te_ops (reason given).
    """
    block = experts_block(module)
    routed = permute(hidden_states, top_k_index, top_k_weights, module.num_experts)
    y = block(routed.x, routed.split_sizes, routed.probs, routed.split_sizes)
    return unpermute(y, routed.token_index, hidden_states.shape[0])


def register() -> None:
    """Add ``"te_ops"`` (:func:`experts_forward`) to transformers' ``ExpertsInterface``.

    Afterwards ``model.set_experts_implementation("te_ops")`` or
    ``from_pretrained(..., experts_implementation="te_ops")`` selects it. Idempotent.

    Raises
    ------
    ImportError
        transformers is missing or has no experts interface (it needs transformers >= 5).
    """
    _transformers()
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as exc:
        raise ImportError("register() needs transformers >= 5 (its ExpertsInterface); with 4.x "
                          "convert weights with from_hf_experts / to_hf_state_dict") from exc
    ExpertsInterface.register(IMPLEMENTATION, experts_forward)


def use_te_ops(model: nn.Module) -> nn.Module:
    """Register te_ops, check every experts module of ``model`` and switch it to te_ops.

    Returns the model. Raises ``ValueError`` naming the first experts module te_ops cannot run
    (and why) before switching anything, and ``ValueError`` when the model has no packed
    experts module at all; ``TypeError`` when ``model`` is not a ``torch.nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers model), got "
                        f"{type(model).__name__}")
    register()
    found = [(n, m) for n, m in model.named_modules()
             if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)
             and hasattr(m, "has_gate")]
    if not found:
        raise ValueError(f"model: {type(model).__name__} has no transformers experts module "
                         "(a class decorated with @use_experts_implementation)")
    for name, m in found:
        reason = unsupported_reason(m)
        if reason is not None:
            raise ValueError(f"model: te_ops cannot run {name}: {reason}")
    model.set_experts_implementation(IMPLEMENTATION)
    return model


# ------------------------------------------------------------------------------- whole MoE blocks
#: HF sparse-MoE block class -> (its router's class, score function, shared expert):
#: ``"gated"`` is Qwen2-MoE's ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``,
#: ``"added"`` DeepSeek-V3's ``shared_experts(x)``; both stay HF modules (their gate and up
#: weights are two tensors, where te_ops' one-group block would need them packed: a copy).
MOE_BLOCKS: dict[str, tuple[str, str, str | None]] = {
    "MixtralSparseMoeBlock": ("MixtralTopKRouter", "softmax", None),
    "Qwen2MoeSparseMoeBlock": ("Qwen2MoeTopKRouter", "softmax", "gated"),
    "Qwen3MoeSparseMoeBlock": ("Qwen3MoeTopKRouter", "softmax", None),
    "OlmoeSparseMoeBlock": ("OlmoeTopKRouter", "softmax", None),
    "DeepseekV3MoE": ("DeepseekV3TopkRouter", "sigmoid", "added"),
}

_MOE_KEY = "_te_ops_moe"  # in the replacement block's __dict__: not a submodule
_HALF = (torch.bfloat16, torch.float16)


def _hf_class(block: nn.Module) -> str:
    """The HF block class name (that of the block a :class:`TeOpsMoeBlock` replaced)."""
    return block.hf_class if isinstance(block, TeOpsMoeBlock) else type(block).__name__


def _router_options(block: nn.Module) -> tuple[dict[str, Any] | None, str | None]:
    """The ``te_ops.MoE`` router options that compute ``block``'s routing, or the reason none
    do: (options, None) or (None, reason)."""
    name = _hf_class(block)
    gate = block.gate
    if getattr(block, "jitter_noise", 0):
        return None, (f"{name} has router_jitter_noise={block.jitter_noise}: in training it "
                      "multiplies the tokens by random noise, which te_ops.MoE does not do")
    if MOE_BLOCKS[name][1] == "softmax":  # softmax over all experts, top-k (HF's order)
        return {"score_function": "softmax",
                "renormalize": bool(getattr(gate, "norm_topk_prob", True))}, None
    # DeepSeek-V3: sigmoid, the correction bias in the selection only, group-limited top-k
    # with each group scored by the sum of its two best biased scores, then the scaling
    opts = {"score_function": "sigmoid", "renormalize": bool(gate.norm_topk_prob),
            "expert_bias": True, "topk_scaling_factor": float(gate.routed_scaling_factor)}
    groups, group_top_k = gate.num_group, gate.topk_group
    if groups not in (None, 1):
        if gate.top_k // group_top_k != 2:
            return None, (f"{name} scores each of its n_group={groups} groups by the sum of its "
                          f"2 best scores; te_ops' group-limited top-k (Megatron's) sums the "
                          f"top_k // topk_group = {gate.top_k} // {group_top_k} = "
                          f"{gate.top_k // group_top_k} best")
        opts.update(num_groups=groups, group_top_k=group_top_k)
    w = gate.weight
    if w.dtype in _HALF:
        return None, (f"{name}'s router casts its {w.dtype} gate.weight and the tokens to "
                      "float32 for the gate GEMM; te_ops' Router runs a 16-bit gate in 16 bits: "
                      "keep the gate in float32 (block.gate.float(); from_pretrained does, "
                      "_keep_in_fp32_modules_strict)")
    return opts, None


def moe_block_unsupported_reason(block: nn.Module) -> str | None:
    """Why ``te_ops.MoE`` cannot compute this HF sparse-MoE block, or ``None`` when it can.

    Accepted: the transformers 5.x blocks of :data:`MOE_BLOCKS` (Mixtral, Qwen2-MoE, Qwen3-MoE,
    OLMoE, DeepSeek-V3) with their own router class, packed experts te_ops runs
    (:func:`unsupported_reason`), a gate weight of shape (experts, hidden), and routing
    te_ops' :class:`~te_ops.basic.moe.Router` computes: softmax top-k with or without
    renormalization (``norm_topk_prob``); DeepSeek-V3's sigmoid scores, correction bias,
    group-limited top-k (when ``top_k // topk_group == 2``), renormalization and
    ``routed_scaling_factor``, with a float32 or float64 gate. Refused with the mismatch named:
    Mixtral's ``router_jitter_noise > 0``, another group scoring, a 16-bit DeepSeek-V3 gate,
    unknown block classes, a replaced router.
    """
    name = _hf_class(block)
    if name not in MOE_BLOCKS:
        return (f"{name} is not a sparse-MoE block te_ops.MoE maps (known: "
                f"{', '.join(MOE_BLOCKS)})")
    router_class = MOE_BLOCKS[name][0]
    gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
    if type(gate).__name__ != router_class:
        return (f"{name}.gate is a {type(gate).__name__}, not {router_class}: its routing is "
                "not the one te_ops.MoE maps")
    if not isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        return f"{name}.experts is not a transformers 5 packed experts module"
    reason = unsupported_reason(experts)
    if reason is not None:
        return f"{name}.experts: {reason}"
    e, _, hidden = experts.gate_up_proj.shape
    if tuple(gate.weight.shape) != (e, hidden) or gate.top_k > e:
        return (f"{name}.gate.weight has shape {tuple(gate.weight.shape)} and top_k="
                f"{gate.top_k}; expected ({e}, {hidden}) (experts, hidden) and top_k <= {e}")
    w, dtype = gate.weight.dtype, experts.gate_up_proj.dtype
    if w != dtype and not (w in (torch.float32, torch.float64) and dtype in _HALF):
        return (f"{name}.gate.weight is {w} and the experts {dtype}; te_ops' Router takes "
                "the experts' dtype, or float32 / float64 over 16-bit experts")
    return _router_options(block)[1]


def from_hf_moe_block(block: nn.Module) -> Any:
    """The ``te_ops.MoE`` that computes an HF sparse-MoE block's routed part, on HF's tensors.

    The layer is given the block's own ``gate.weight``, ``experts.gate_up_proj`` and
    ``experts.down_proj`` Parameter objects (no copy: gradients land in HF's parameters) and,
    for DeepSeek-V3, a Parameter sharing the storage of ``gate.e_score_correction_bias``
    (``update_expert_bias`` changes HF's buffer in place). Dropless, no balancing loss (HF
    computes its aux loss from the router logits) and no shared experts (HF's modules run them,
    see :class:`TeOpsMoeBlock`).

    Returns
    -------
    te_ops.MoE
        ``y, aux_loss = moe(x)`` for x (..., hidden): y the routed experts' sum, as HF's block
        computes it before adding a shared expert.

    Raises
    ------
    ValueError
        The block cannot be mapped (:func:`moe_block_unsupported_reason`'s reason).
    """
    from ..moe import MoE

    reason = moe_block_unsupported_reason(block)
    if reason is not None:
        raise ValueError(f"block: te_ops.MoE cannot compute this block: {reason}")
    gate, experts = block.gate, block.experts
    opts, _ = _router_options(block)
    e, two_i, hidden = experts.gate_up_proj.shape
    moe = MoE(hidden, two_i // 2, e, gate.top_k, device="meta",
              dtype=experts.gate_up_proj.dtype, **opts)
    moe.router.weight = gate.weight
    moe.experts[0].weight = experts.gate_up_proj
    moe.experts[2].weight = experts.down_proj
    if opts.get("expert_bias"):
        bias = gate.e_score_correction_bias  # a Parameter aliasing HF's buffer
        moe.router.expert_bias = nn.Parameter(bias, requires_grad=False)
        moe.router.expert_load = torch.zeros(e, device=bias.device, dtype=torch.float32)
    return moe


def _block_state(block: nn.Module) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """What :func:`from_hf_moe_block` read: (objects compared by identity, values by ``==``)."""
    gate = block.gate
    w = gate.weight
    bias = getattr(gate, "e_score_correction_bias", None)
    objects, values = _state(block.experts)
    flags = tuple(getattr(gate, a, None) for a in (
        "top_k", "num_experts", "norm_topk_prob", "routed_scaling_factor", "num_group",
        "topk_group"))
    return ((*objects, type(gate), w, bias),
            (values, w.shape, w.dtype, w.device, flags, getattr(block, "jitter_noise", None),
             None if bias is None else (bias.dtype, bias.device, bias.data_ptr())))


def _router_logits_wanted() -> bool:
    """Whether HF is collecting router logits now (``output_router_logits``: its aux loss)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # cannot tell: run the gate, so a recorder gets its logits
        return True
    collected = _active_collector.get()
    return collected is not None and "router_logits" in collected


class TeOpsMoeBlock(nn.Module):
    """An HF sparse-MoE block run as ``te_ops.MoE`` (router to combine in one te_ops
    ``Sequential``), plus HF's shared expert where the family has one.

    Holds the HF block's submodules under their names (``gate``, ``experts``,
    ``shared_expert`` / ``shared_expert_gate`` / ``shared_experts``), so ``state_dict`` keys,
    ``parameters()`` and checkpoints are the HF block's; the ``te_ops.MoE`` of
    :func:`from_hf_moe_block` lives in ``__dict__`` on the same tensors and is rebuilt (and
    re-checked) when HF replaces them or changes their dtype or device.

    While HF collects router logits (``output_router_logits``, for its aux loss) the HF gate
    runs too (its logits feed the loss through HF's recorder; the gate GEMM and top-k then run
    twice); otherwise only te_ops routes.

    Shapes
    ------
    hidden_states (batch, seq, hidden) -> the same shape, as the HF block.
    """

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        reason = moe_block_unsupported_reason(block)
        if reason is not None:
            raise ValueError(f"block: te_ops.MoE cannot compute this block: {reason}")
        self.hf_class = type(block).__name__
        self.shared = MOE_BLOCKS[self.hf_class][2]
        for name, child in block.named_children():
            self.add_module(name, child)
        for name, value in vars(block).items():  # plain attributes (top_k, jitter_noise, ...)
            if not name.startswith("_") and name != "training":
                setattr(self, name, value)
        self.training = block.training

    @property
    def moe(self) -> Any:
        """The ``te_ops.MoE`` on this block's tensors (checked, rebuilt when they changed).

        Raises
        ------
        ValueError
            The block as it is now cannot be mapped (the reason is given).
        """
        return _built_for(self, _MOE_KEY, _block_state(self), from_hf_moe_block)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        if moe.training != self.training:
            moe.train(self.training)
        if _router_logits_wanted():
            self.gate(hidden_states)  # HF's recorder keeps its logits for the aux loss
        y, _ = moe(hidden_states)
        if self.shared == "gated":  # Qwen2-MoE
            flat = hidden_states.reshape(-1, hidden_states.shape[-1])
            shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
            y = y + shared.view_as(y)
        elif self.shared == "added":  # DeepSeek-V3
            y = y + self.shared_experts(hidden_states)
        return y

    def extra_repr(self) -> str:
        return f"te_ops.MoE in place of {self.hf_class}"


def use_te_ops_moe(model: nn.Module) -> nn.Module:
    """Replace every HF sparse-MoE block of ``model`` by a :class:`TeOpsMoeBlock`.

    Every block whose class is in :data:`MOE_BLOCKS` is checked first; the first that
    ``te_ops.MoE`` cannot compute raises ``ValueError`` naming it and the reason, before
    anything is replaced. Blocks already replaced are kept. Returns the model (its
    ``state_dict`` keys and Parameters unchanged).

    Raises
    ------
    TypeError
        ``model`` is not a ``torch.nn.Module``.
    ValueError
        A block te_ops cannot compute (named, with the reason); a model with no such block.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers model), got "
                        f"{type(model).__name__}")
    found = [(n, m) for n, m in model.named_modules() if type(m).__name__ in MOE_BLOCKS]
    if not found and not any(isinstance(m, TeOpsMoeBlock) for m in model.modules()):
        raise ValueError(f"model: {type(model).__name__} has no sparse-MoE block te_ops.MoE "
                         f"maps ({', '.join(MOE_BLOCKS)})")
    for name, m in found:
        reason = moe_block_unsupported_reason(m)
        if reason is not None:
            raise ValueError(f"model: te_ops.MoE cannot compute {name}: {reason}")
    for name, m in found:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, TeOpsMoeBlock(m))
    return model
