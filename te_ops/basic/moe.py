"""The routing ops of the MoE layer: :class:`Router`, :class:`Permute`, :class:`Combine`.

In ``te_ops.MoE``'s one ``Sequential`` they run as
``Router -> Permute -> fc1 -> ScaledSwiGLU -> fc2 -> Combine``; each passes the next ops what
they need through the framework's fed extra inputs
(:meth:`~te_ops.op.BasicOperation.feed_extra_input`): the router's top-k ids and weights feed
``Permute``; ``Permute``'s split sizes feed fc1 and fc2, its per-row probs ``ScaledSwiGLU``, its
two index maps ``Combine``. No op reads a device value on the host, in either mode.

The routing math (row order, capacity, the masked gathers) is :mod:`te_ops.routing`'s.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from .. import comm
from ..gemm import RowGather
from ..op import BasicOperation
from ..routing import (
    DROP_POLICIES,
    capacity_per_expert,
    pick,
    pick_sum,
    sort_by_expert,
    tokens_per_expert,
)
from .grouped_linear import check_param_dtype

__all__ = ["Router", "Permute", "Combine", "SCORE_FUNCTIONS"]

#: The router's score functions.
SCORE_FUNCTIONS = ("softmax", "sigmoid")
#: Added to a renormalization's denominator (Megatron-Core and torchtitan use 1e-20).
RENORM_EPS = 1e-20


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _coeff(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite float >= 0, got {value!r}")
    return float(value)


def _renorm_backward(grad: torch.Tensor, normalized: torch.Tensor,
                     denom: torch.Tensor) -> torch.Tensor:
    """Gradient of ``v`` for ``normalized = v / (v.sum(-1) + eps)`` given ``grad`` of
    ``normalized``."""
    return (grad - (grad * normalized).sum(-1, keepdim=True)) / denom


class Router(BasicOperation):
    """Top-k token router: a linear gate, scores, top-k selection and balancing losses.

    Semantics follow Megatron-Core's ``TopKRouter`` (``megatron/core/transformer/moe/router.py``
    and ``moe_utils.py``) and torchtitan's ``TokenChoiceTopKRouter``
    (``torchtitan/models/moe/moe.py``), option by option:

    * ``score_function="softmax"`` with ``renormalize=True``: softmax over the experts, top-k,
      weights divided by their sum = softmax over the k chosen logits (Megatron's default
      ``moe_router_pre_softmax=False``; Mixtral). ``renormalize=False``: the top-k softmax
      scores as they are (Megatron ``moe_router_pre_softmax=True``; torchtitan
      ``route_norm=False``; DeepSeek-V2, Qwen2-MoE ``norm_topk_prob=False``).
    * ``score_function="sigmoid"``: per-expert sigmoid scores; with ``renormalize=True`` the
      k chosen ones divided by their sum + 1e-20 (Megatron ``moe_router_score_function=
      "sigmoid"``, torchtitan ``score_func="sigmoid"``, ``route_norm=True``; DeepSeek-V3).
    * ``num_groups`` / ``group_top_k``: group-limited top-k (DeepSeek-V2/V3 ``n_group`` /
      ``topk_group``; Megatron ``moe_router_num_groups`` / ``moe_router_group_topk``): the
      experts form ``num_groups`` equal groups, each group is scored by the sum of its
      ``top_k // group_top_k`` best selection scores, and the top-k is taken within the
      ``group_top_k`` best groups (Megatron's ``group_limited_topk``).
    * ``expert_bias=True``: aux-loss-free balancing (DeepSeek-V3 sec. 2.1.2; Megatron
      ``moe_router_enable_expert_bias``; torchtitan ``load_balance_coeff``): a per-expert
      bias added to the scores for the *selection* only (the weights stay the scores).
      The bias is a parameter without gradient, changed by :meth:`update_expert_bias`
      (``bias += rate * sign(mean load - load)``, Megatron's ``get_updated_expert_bias``).
    * ``aux_loss_coeff``: the Switch Transformer load-balancing loss (Fedus et al. 2021,
      eq. 4) in Megatron's top-k form ``switch_load_balancing_loss_func``:
      ``coeff * E / (k T^2) * sum_e count_e * sum_t p_te`` (``count_e``: pairs routed to
      ``e``; ``p``: the full score matrix, for sigmoid each row divided by its sum).
    * ``seq_aux_loss_coeff``: the sequence-wise balance loss (DeepSeek-V2 eq. 12-14,
      DeepSeek-V3 eq. 17-20; Megatron ``moe_router_load_balancing_type="seq_aux_loss"``): the
      same formula per sequence (``T`` = sequence length), averaged over the sequences. The
      input must then be (batch, seq, hidden), batch first.
    * ``z_loss_coeff``: the router z-loss (ST-MoE, Zoph et al. 2022, eq. 5; Megatron
      ``moe_z_loss_coeff``): ``coeff * mean_t logsumexp(logits_t)^2``.
    * ``topk_scaling_factor``: the top-k weights (after any renormalization) times this factor
      (DeepSeek-V2/V3 ``routed_scaling_factor``; Megatron ``moe_router_topk_scaling_factor``).
    * A float32 (or float64) ``weight`` with a bfloat16 / float16 input runs the gate GEMM in
      the weight's dtype, the input cast up (DeepSeek-V3 keeps ``gate.weight`` in float32;
      Megatron ``moe_router_dtype="fp32"``); the input's gradient comes back in its dtype.

    The losses are summed into one ``aux_loss`` output (zero when every coefficient is 0).
    The gate GEMM runs in the input's dtype, or the weight's where that is wider (not
    quantized under a ``te_ops.autocast`` recipe); scores, weights and losses are float32
    (float64 where the input or the weight is float64).

    Parameters
    ----------
    hidden_size, num_experts, top_k : int
        ``1 <= top_k <= num_experts``.
    score_function : {"softmax", "sigmoid"}
    renormalize : bool
    num_groups, group_top_k : int or None
        Both or neither; ``num_experts % num_groups == 0``, ``group_top_k <= num_groups``,
        ``group_top_k <= top_k <= group_top_k * num_experts // num_groups``.
    expert_bias : bool
    bias_update_rate : float
        Default ``rate`` of :meth:`update_expert_bias` (Megatron's default 1e-3).
    aux_loss_coeff, seq_aux_loss_coeff, z_loss_coeff : float
        ``>= 0``.
    topk_scaling_factor : float
        ``> 0`` (default 1: no scaling).
    group : torch.distributed.ProcessGroup or None
        Ranks that route one batch together (``te_ops.MoE``'s ``ep_group``; the router is
        replicated on them). The balancing losses then cover the group's tokens, in
        Megatron-Core's global form (``switch_load_balancing_loss_func`` with
        ``moe_router_load_balancing_type="global_aux_loss"``): each rank's loss uses its own
        scores with the group's per-expert counts and token (and sequence) totals, gathered
        with one all-gather of ``E + 2`` ints when a loss coefficient is set, so the ranks'
        ``aux_loss`` values sum to the loss of the group's concatenated batch, and each rank's
        gradient is its tokens' share of that loss's. :meth:`update_expert_bias` sums the
        load over the group. ``None``: this process's tokens only.
    device, dtype :
        Of ``weight`` (``expert_bias`` is float32).

    Shapes
    ------
    Main input x (..., hidden) -> main output x as (T, hidden) (the same values, a view);
    ``weight`` (num_experts, hidden). Extra outputs: ``top_k_index`` (T, top_k) int64,
    ``top_k_probs`` (T, top_k) float, ``aux_loss`` () float.

    Raises
    ------
    ValueError / TypeError
        Bad constructor arguments; an input whose last dim is not ``hidden_size``, on another
        device than the weight, or whose dtype is neither the weight's nor a 16-bit float
        under a float32 / float64 weight; with ``seq_aux_loss_coeff`` an input that is not
        3-D.
    """

    num_extra_outputs = 3

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *,
                 score_function: str = "softmax", renormalize: bool = True,
                 num_groups: int | None = None, group_top_k: int | None = None,
                 expert_bias: bool = False, bias_update_rate: float = 1e-3,
                 aux_loss_coeff: float = 0.0, seq_aux_loss_coeff: float = 0.0,
                 z_loss_coeff: float = 0.0, topk_scaling_factor: float = 1.0,
                 group: Any = None,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size = _positive_int("hidden_size", hidden_size)
        self.num_experts = _positive_int("num_experts", num_experts)
        self.top_k = _positive_int("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k must be <= num_experts={num_experts}, got {top_k}")
        if score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got "
                             f"{score_function!r}")
        for name, flag in (("renormalize", renormalize), ("expert_bias", expert_bias)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__} ({flag!r})")
        if (num_groups is None) != (group_top_k is None):
            raise ValueError("num_groups and group_top_k must be given together, got "
                             f"num_groups={num_groups!r}, group_top_k={group_top_k!r}")
        if num_groups is not None:
            _positive_int("num_groups", num_groups)
            _positive_int("group_top_k", group_top_k)
            if num_experts % num_groups:
                raise ValueError(f"num_groups must divide num_experts={num_experts}, got "
                                 f"{num_groups}")
            if group_top_k > num_groups:
                raise ValueError(f"group_top_k must be <= num_groups={num_groups}, got "
                                 f"{group_top_k}")
            per_group = num_experts // num_groups
            if not group_top_k <= top_k <= group_top_k * per_group:
                raise ValueError(
                    f"top_k must be in [group_top_k, group_top_k * num_experts // num_groups]"
                    f" = [{group_top_k}, {group_top_k * per_group}], got {top_k}")
        self.score_function = score_function
        self.renormalize = renormalize
        self.num_groups = num_groups
        self.group_top_k = group_top_k
        self.bias_update_rate = _coeff("bias_update_rate", bias_update_rate)
        self.aux_loss_coeff = _coeff("aux_loss_coeff", aux_loss_coeff)
        self.seq_aux_loss_coeff = _coeff("seq_aux_loss_coeff", seq_aux_loss_coeff)
        self.z_loss_coeff = _coeff("z_loss_coeff", z_loss_coeff)
        self.topk_scaling_factor = _coeff("topk_scaling_factor", topk_scaling_factor)
        if self.topk_scaling_factor == 0:
            raise ValueError("topk_scaling_factor must be > 0, got 0")
        self.group_size = 1 if group is None else comm.check_group(group, "group")[0]
        self._group = None if group is None else comm.GroupRef(group)
        dtype = check_param_dtype(dtype)
        self.weight = torch.nn.Parameter(torch.empty(num_experts, hidden_size, device=device,
                                                     dtype=dtype))
        if expert_bias:
            # A parameter (without gradient), not a buffer: a traced te_ops call passes the
            # ops' parameters into the graph (te_ops/fuser.py, _run_block), not their buffers.
            self.expert_bias = torch.nn.Parameter(
                torch.zeros(num_experts, device=device, dtype=torch.float32),
                requires_grad=False)
            #: Pairs routed to each expert since the last :meth:`update_expert_bias` (added to
            #: by ``te_ops.MoE`` in training).
            self.register_buffer("expert_load", torch.zeros(num_experts, device=device,
                                                            dtype=torch.float32),
                                 persistent=False)
        else:
            self.register_parameter("expert_bias", None)
            self.expert_load = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Kaiming-uniform gate weight (as ``torch.nn.Linear``); zero expert bias."""
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.expert_bias is not None:
            with torch.no_grad():
                self.expert_bias.zero_()

    def extra_output_names(self) -> list[str | None]:
        return ["top_k_index", "top_k_probs", "aux_loss"]

    def describe(self) -> str:
        return (f"Router({self.hidden_size} -> {self.num_experts} experts, top_k="
                f"{self.top_k}, {self.score_function})")

    def _gate_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in the gate GEMM's dtype: the weight's (a wider float32 / float64 weight casts
        a 16-bit input up)."""
        return x if x.dtype == self.weight.dtype else x.to(self.weight.dtype)

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor | None = None,
                           rate: float | None = None) -> None:
        """Aux-loss-free balancing step (DeepSeek-V3 sec. 2.1.2, Megatron-Core
        ``get_updated_expert_bias``): ``expert_bias += rate * sign(mean(load) - load)``, so
        overloaded experts are chosen less. Runs outside autograd; call it once per optimizer
        step.

        Parameters
        ----------
        tokens_per_expert : torch.Tensor or None
            (num_experts,) load; ``None``: the accumulated ``expert_load``, which is then
            zeroed. With a ``group`` it is summed over the group's ranks (an all-reduce:
            every rank must call this), so the replicated biases stay equal.
        rate : float or None
            ``None``: ``bias_update_rate``.

        Raises
        ------
        RuntimeError
            The router was built without ``expert_bias=True``.
        ValueError
            ``tokens_per_expert`` not of shape (num_experts,).
        """
        if self.expert_bias is None:
            raise RuntimeError("update_expert_bias needs a router built with expert_bias=True")
        load = self.expert_load if tokens_per_expert is None else tokens_per_expert
        if tuple(load.shape) != (self.num_experts,):
            raise ValueError(f"tokens_per_expert must have shape ({self.num_experts},), got "
                             f"{tuple(load.shape)}")
        rate = self.bias_update_rate if rate is None else _coeff("rate", rate)
        load = load.to(self.expert_bias.device, torch.float32)
        if self._group is not None:
            load = comm.all_reduce_sum(load, self._group.group)
        self.expert_bias.add_(torch.sign(load.mean() - load) * rate)
        if tokens_per_expert is None:
            self.expert_load.zero_()

    # ------------------------------------------------------------------ math
    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"input must have shape (..., {self.hidden_size}), got "
                             f"{tuple(x.shape)}")
        w = self.weight
        wider = (w.dtype in (torch.float32, torch.float64)
                 and x.dtype in (torch.bfloat16, torch.float16))
        if (x.dtype != w.dtype and not wider) or x.device != w.device:
            raise ValueError(f"input must have the router weight's dtype and device "
                             f"({w.dtype}, {w.device}; a bfloat16 / float16 input is taken "
                             f"under a float32 / float64 weight), got ({x.dtype}, "
                             f"{x.device})")
        if self.seq_aux_loss_coeff and x.dim() != 3:
            raise ValueError(f"input must have shape (batch, seq, {self.hidden_size}) with "
                             f"seq_aux_loss_coeff > 0 (the loss is per sequence), got "
                             f"{tuple(x.shape)}")

    def _select(self, scores: torch.Tensor) -> torch.Tensor:
        """Top-k expert ids (T, k) of the selection scores (group-limited when configured)."""
        if self.num_groups is None:
            return torch.topk(scores, self.top_k, dim=-1).indices
        t = scores.shape[0]
        grouped = scores.view(t, self.num_groups, -1)
        group_scores = grouped.topk(self.top_k // self.group_top_k, dim=-1).values.sum(-1)
        groups = torch.topk(group_scores, self.group_top_k, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        masked = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, -1)
        return torch.topk(masked, self.top_k, dim=-1).indices

    def _aux_scores(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The scores the balancing losses use and, for sigmoid, their row denominators."""
        if self.score_function == "softmax":
            return scores, None
        denom = scores.sum(-1, keepdim=True) + RENORM_EPS
        return scores / denom, denom

    def _group_totals(self, idx: torch.Tensor, shape: torch.Size, num_tokens: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """With a group and a balancing loss: the group's per-expert pair counts (E,), token
        total and sequence total (int64, on the device), from one all-gather."""
        if self._group is None or not (self.aux_loss_coeff or self.seq_aux_loss_coeff
                                       or self.z_loss_coeff):
            return None
        e = self.num_experts
        local = tokens_per_expert(idx.reshape(-1), e)
        sequences = shape[0] if self.seq_aux_loss_coeff else 0
        mine = torch.cat([local, local.new_full((1,), num_tokens),
                          local.new_full((1,), sequences)])
        every = comm.all_gather(mine, self._group.group, self.group_size).sum(0)
        return every[:e], every[e], every[e + 1]

    def _aux_weights(self, idx: torch.Tensor, shape: torch.Size, num_tokens: int,
                     dtype: torch.dtype, totals: Any = None) -> torch.Tensor | None:
        """d aux_loss / d aux-scores, (T, E) broadcastable (``None`` without balancing loss):
        the Switch term's per-expert weight plus the sequence term's per-sequence one;
        ``totals``: :meth:`_group_totals` (the group's counts and totals)."""
        e, k = self.num_experts, self.top_k
        weights = None
        if self.aux_loss_coeff:
            if totals is None:
                counts = tokens_per_expert(idx.reshape(-1), e).to(dtype)
                weights = (self.aux_loss_coeff * e / (k * num_tokens * num_tokens) * counts
                           ).unsqueeze(0)
            else:
                tokens = totals[1].to(dtype)
                weights = (self.aux_loss_coeff * e / k * totals[0].to(dtype)
                           / (tokens * tokens)).unsqueeze(0)
        if self.seq_aux_loss_coeff:
            batch, seq = shape[0], shape[1]
            seq_of = torch.arange(batch, device=idx.device).repeat_interleave(seq * k)
            counts = tokens_per_expert(seq_of * e + idx.reshape(-1), batch * e).to(dtype)
            if totals is None:
                scale = counts * (self.seq_aux_loss_coeff * e / (k * seq * seq * batch))
            else:
                scale = counts * (self.seq_aux_loss_coeff * e / (k * seq * seq)) / totals[2].to(
                    dtype)
            per_seq = scale.view(batch, 1, e).expand(batch, seq, e).reshape(-1, e)
            weights = per_seq if weights is None else weights + per_seq
        return weights

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, recipe=None):
        ctx = basic_op_ctxs[0]
        self._check_input(input_)
        x = input_.reshape(-1, self.hidden_size)
        num_tokens = x.shape[0]
        cd = torch.float64 if torch.float64 in (x.dtype, self.weight.dtype) else torch.float32
        logits = F.linear(self._gate_input(x), self.weight).to(cd)
        if self.score_function == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)
        selection = scores if self.expert_bias is None else scores + self.expert_bias.to(cd)
        idx = self._select(selection)
        chosen = scores.gather(1, idx)
        denom = chosen.sum(-1, keepdim=True) + RENORM_EPS if self.renormalize else None
        probs = chosen / denom if denom is not None else chosen
        scaled = probs * self.topk_scaling_factor if self.topk_scaling_factor != 1 else probs

        aux = logits.new_zeros(())
        totals = self._group_totals(idx, input_.shape, num_tokens)
        weights = self._aux_weights(idx, input_.shape, num_tokens, cd, totals)
        if weights is not None:
            aux = aux + (weights * self._aux_scores(scores)[0]).sum()
        lse = None
        # the z-loss's mean: over this call's tokens, or the group's
        z_tokens = None if totals is None else totals[1].to(cd)
        if self.z_loss_coeff:
            lse = torch.logsumexp(logits, dim=-1)
            square = lse.square()
            aux = aux + self.z_loss_coeff * (square.mean() if z_tokens is None else
                                             square.sum() / z_tokens)
        if ctx.requires_grad:
            # the weight too: under torch.compile the backward runs outside the trace's
            # parameter swap, so it must not read self.weight
            ctx.save_for_backward(x, self.weight, logits if lse is not None else None, scores,
                                  idx, probs, denom, weights, lse, z_tokens)
            ctx.input_shape = input_.shape
        return x, [(idx, scaled, aux)]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx = basic_op_ctxs[0]
        x, weight, logits, scores, idx, probs, denom, weights, lse, z_tokens = ctx.saved_tensors
        _, grad_probs, grad_aux = basic_op_grad_extra_outputs[0]
        num_tokens = x.shape[0]
        grad_scores = torch.zeros_like(scores)
        if grad_probs is not None:
            g = grad_probs.to(scores.dtype).reshape(probs.shape)
            if self.topk_scaling_factor != 1:
                g = g * self.topk_scaling_factor
            if denom is not None:  # probs: the weights before the scaling
                g = _renorm_backward(g, probs, denom)
            grad_scores.scatter_(1, idx, g)  # top-k ids are distinct per row
        if grad_aux is not None and weights is not None:
            g = grad_aux.to(scores.dtype) * weights
            if self.score_function == "sigmoid":
                normalized, row_denom = self._aux_scores(scores)
                g = _renorm_backward(g.expand_as(scores), normalized, row_denom)
            grad_scores = grad_scores + g
        if self.score_function == "softmax":
            grad_logits = scores * (grad_scores - (grad_scores * scores).sum(-1, keepdim=True))
        else:
            grad_logits = grad_scores * scores * (1 - scores)
        if grad_aux is not None and lse is not None:
            softmax = torch.exp(logits - lse.unsqueeze(-1))
            tokens = num_tokens if z_tokens is None else z_tokens
            grad_logits = grad_logits + (grad_aux.to(scores.dtype) * self.z_loss_coeff * 2
                                         / tokens) * lse.unsqueeze(-1) * softmax
        grad_logits = grad_logits.to(weight.dtype)
        grad_input = None
        if ctx.input_requires_grad:
            grad_input = (grad_logits @ weight).to(x.dtype)
            if grad_output is not None:
                grad_input = grad_input + grad_output.reshape(grad_input.shape)
            grad_input = grad_input.reshape(ctx.input_shape)
        if weight.requires_grad:
            grad_weight = grad_logits.t() @ (x if x.dtype == weight.dtype else x.to(weight.dtype))
        else:
            grad_weight = None
        grads = [grad_weight] + ([None] if self.expert_bias is not None else [])
        return grad_input, [grads], [[]]


class Permute(BasicOperation):
    """Rows of the main input sorted by expert for a grouped expert block.

    Dropless (``capacity_factor=None``): every (token, top-k slot) pair gets a row, ``T * k``
    rows sorted by expert, split sizes on the device. With ``capacity_factor``: each expert
    gets ``C = ceil(capacity_factor * T * k / E)`` rows (static shapes: ``E * C`` rows, split
    sizes all ``C``); the pairs past an expert's capacity are dropped by ``drop_policy``
    (``"probs"``: keep the highest weights, Megatron-Core's default ``moe_token_drop_policy``;
    ``"position"``: keep the earliest tokens) and counted; empty rows are zero. A dropped pair
    adds nothing to its token's output. See :func:`te_ops.routing.sort_by_expert`.

    Parameters
    ----------
    num_experts : int
    capacity_factor : float or None
    drop_policy : {"probs", "position"}

    Extra inputs
    ------------
    top_k_index : (T, k) integer expert ids (not differentiable).
    top_k_probs : (T, k) float weights.

    Extra outputs
    -------------
    split_sizes : (E,) int64.
    probs : (R,) the weight of each row (zero for empty rows), in ``top_k_probs``' dtype.
    pair_index, row_index : the index maps of :class:`te_ops.routing.ExpertOrder`, (R,) and
        (T, k) int64, for :class:`Combine`.
    tokens_per_expert : (E,) int64, pairs routed to each expert before any drop.
    dropped : () int64, pairs dropped past capacity (zero dropless).

    Shapes
    ------
    Main input (T, hidden) -> main output (R, hidden), ``R = T * k`` dropless, ``E * C`` with
    a capacity.

    Raises
    ------
    ValueError / TypeError
        Bad constructor arguments; ``top_k_index`` / ``top_k_probs`` not of shape (T, k), not
        integer / float, or on another device.
    """

    num_extra_inputs = 2
    num_extra_outputs = 6

    def __init__(self, num_experts: int, *, capacity_factor: float | None = None,
                 drop_policy: str = "probs") -> None:
        super().__init__()
        self.num_experts = _positive_int("num_experts", num_experts)
        if capacity_factor is not None and (
                isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float))
                or not (math.isfinite(capacity_factor) and capacity_factor > 0)):
            raise ValueError(f"capacity_factor must be a finite float > 0 or None, got "
                             f"{capacity_factor!r}")
        if drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.drop_policy = drop_policy

    def extra_input_names(self) -> list[str | None]:
        return ["top_k_index", "top_k_probs"]

    def extra_output_names(self) -> list[str | None]:
        return ["split_sizes", "probs", "pair_index", "row_index", "tokens_per_expert",
                "dropped"]

    def describe(self) -> str:
        mode = ("dropless" if self.capacity_factor is None else
                f"capacity_factor={self.capacity_factor}, drop_policy={self.drop_policy}")
        return f"Permute({self.num_experts} experts, {mode})"

    def capacity(self, num_tokens: int, top_k: int) -> int | None:
        """Rows per expert for ``num_tokens`` tokens (``None`` dropless)."""
        if self.capacity_factor is None:
            return None
        return capacity_per_expert(num_tokens, top_k, self.num_experts, self.capacity_factor)

    def _check(self, x: torch.Tensor, idx: Any, probs: Any) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"input must be a (tokens, hidden) tensor, got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
        for name, t, floating in (("top_k_index", idx, False), ("top_k_probs", probs, True)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 2 or t.shape[0] != x.shape[0]:
                raise ValueError(f"{name} must have shape ({x.shape[0]}, top_k), got "
                                 f"{tuple(t.shape)}")
            if t.is_floating_point() != floating or t.dtype == torch.bool:
                kind = "a floating-point" if floating else "an integer"
                raise TypeError(f"{name} must have {kind} dtype, got {t.dtype}")
            if t.device != x.device:
                raise ValueError(f"{name} must be on the input's device {x.device}, got "
                                 f"{t.device}")
        if idx.shape != probs.shape:
            raise ValueError(f"top_k_probs must have top_k_index's shape {tuple(idx.shape)}, "
                             f"got {tuple(probs.shape)}")

    def route(self, ctx: Any, input_: torch.Tensor, extra_inputs: tuple[Any, ...]
              ) -> tuple[RowGather, tuple[torch.Tensor, ...]]:
        """The forward without the row copy: the main output as a
        :class:`~te_ops.gemm.RowGather` of ``input_`` (row ``r`` is token
        ``pair_index[r] // k``; an empty capacity slot a zero row) and the extra outputs.
        Writes this op's context (``row_index``, and whether rows are masked), which the
        backward reads; the fused ``Permute -> fc1`` forward (``te_ops/fused/moe_routing.py``)
        hands the gather to fc1's GEMM."""
        idx, probs = extra_inputs
        self._check(input_, idx, probs)
        top_k = idx.shape[1]
        capacity = self.capacity(input_.shape[0], top_k)
        order = sort_by_expert(idx, self.num_experts, capacity=capacity, top_k_weights=probs,
                               drop_policy=self.drop_policy)
        masked = capacity is not None
        row_probs = pick(probs.reshape(-1), order.pair_index, masked=masked)
        if ctx.requires_grad:
            ctx.save_for_backward(order.row_index)
            ctx.masked = masked
        return (RowGather(input_, order.pair_index // top_k, masked),
                (order.split_sizes, row_probs, order.pair_index, order.row_index,
                 order.tokens_per_expert, order.dropped))

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, recipe=None):
        rows, outputs = self.route(basic_op_ctxs[0], input_, basic_op_extra_inputs[0])
        return rows.rows(), [outputs]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx = basic_op_ctxs[0]
        (row_index,) = ctx.saved_tensors
        grad_row_probs = basic_op_grad_extra_outputs[0][1]
        grad_input = None
        if ctx.input_requires_grad and grad_output is not None:
            grad_input = pick_sum(grad_output, row_index, masked=ctx.masked)
        grad_probs = None
        if grad_row_probs is not None and ctx.extra_input_requires_grad(1):
            grad_probs = pick(grad_row_probs, row_index, masked=ctx.masked)
        return grad_input, [[]], [[None, grad_probs]]


class Combine(BasicOperation):
    """Expert rows summed back into token order: ``out[t] = sum_j y[row_index[t, j]]``.

    The routing weights are applied before (by ``ScaledSwiGLU`` in ``te_ops.MoE``: with no
    fc2 bias ``probs * fc2(swiglu(h)) == fc2(probs * swiglu(h))``). Dropped pairs
    (``row_index == R``) add nothing. Both directions are gathers over
    :class:`te_ops.routing.ExpertOrder`'s two maps, so the sums run in a fixed order
    (deterministic, unlike a scatter-add with ``index_add_``).

    Parameters
    ----------
    masked : bool
        Whether index maps may hold the "empty" value (``row_index == R``: a dropped pair;
        ``pair_index == T * k``: an empty capacity slot). ``False`` (dropless routing, where
        no pair is dropped; ``te_ops.MoE`` sets it so) runs each direction as one plain gather
        instead of a gather and a ``where``, with the same values.

    Extra inputs
    ------------
    pair_index : (R,) int64.
    row_index : (T, k) int64.

    Shapes
    ------
    Main input (R, hidden) -> main output (T, hidden), in the input's dtype.

    Raises
    ------
    ValueError / TypeError
        Index maps of the wrong shape or dtype; ``masked`` not a bool.
    """

    num_extra_inputs = 2

    def __init__(self, *, masked: bool = True) -> None:
        super().__init__()
        if not isinstance(masked, bool):
            raise TypeError(f"masked must be a bool, got {type(masked).__name__}")
        self.masked = masked

    def describe(self) -> str:
        return f"Combine(masked={self.masked})"

    def extra_input_names(self) -> list[str | None]:
        return ["pair_index", "row_index"]

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, recipe=None):
        ctx = basic_op_ctxs[0]
        pair_index, row_index = basic_op_extra_inputs[0]
        for name, t, dim in (("pair_index", pair_index, 1), ("row_index", row_index, 2)):
            if not isinstance(t, torch.Tensor) or t.dim() != dim or t.dtype != torch.int64:
                raise TypeError(f"{name} must be a {dim}-D int64 tensor, got "
                                f"{getattr(t, 'dtype', type(t).__name__)} "
                                f"{tuple(getattr(t, 'shape', ()))}")
        if input_.dim() != 2 or input_.shape[0] != pair_index.shape[0]:
            raise ValueError(f"input must have shape ({pair_index.shape[0]}, hidden) (one row "
                             f"per pair_index entry), got {tuple(input_.shape)}")
        if ctx.requires_grad:
            ctx.save_for_backward(pair_index)
            ctx.top_k = row_index.shape[1]
        return pick_sum(input_, row_index, masked=self.masked), [()]

    def grad_rows(self, ctx: Any, grad_output: torch.Tensor) -> RowGather:
        """The input gradient as a :class:`~te_ops.gemm.RowGather` of ``grad_output`` (row
        ``r`` is token ``pair_index[r] // k``'s gradient; an empty capacity slot a zero row),
        from this op's context; the fused ``fc2 -> Combine`` backward
        (``te_ops/fused/moe_routing.py``) hands it to fc2's GEMMs. Shapes: grad_output
        (T, hidden) -> rows (R, hidden)."""
        (pair_index,) = ctx.saved_tensors
        return RowGather(grad_output, pair_index // ctx.top_k, self.masked)

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        return self.grad_rows(basic_op_ctxs[0], grad_output).rows(), [[]], [[None, None]]
