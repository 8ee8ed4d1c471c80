"""``te_ops.MoE``: the whole mixture-of-experts layer as one te_ops ``Sequential``.

``Router -> Permute -> fc1 -> ScaledSwiGLU -> fc2 -> Combine`` (plus optional shared experts):
the ops hand each other top-k ids and weights, split sizes, per-row probs and the index maps
through fed extra inputs (:meth:`te_ops.op.BasicOperation.feed_extra_input`), so one fuser
runs the layer: the grouped-MLP fusion, ``explain()``, the saved context, the meta-device proof
and ``torch.compile`` cover it whole. With ``ep_group`` (expert parallelism) the all-to-all
ops ``AllToAllDispatch`` / ``AllToAllCombine`` join the same fuser around the experts.
"""

from __future__ import annotations

from typing import Any

import torch

from . import comm
from .basic import GroupedLinear, ScaledSwiGLU, SwiGLU
from .basic.ep import AllToAllCombine, AllToAllDispatch
from .basic.moe import Combine, Permute, Router, _positive_int
from .quantization.weight_cache import call_flagged
from .sequential import Sequential

__all__ = ["MoE"]


class MoE(torch.nn.Module):
    """A mixture-of-experts layer: top-k router, SwiGLU experts, optional shared experts.

    ``y = combine(probs * experts(permute(x)))`` (+ ``shared_experts(x)``), where each token's
    ``top_k`` chosen experts are SwiGLU MLPs ``fc2(SiLU(a) * b)``, ``[a, b] = fc1(x)`` (no
    biases). The routing weights are applied to the activation (``ScaledSwiGLU``) rather than
    in the combine: the same value (fc2 is linear, no bias), and it is what the fused grouped
    MLP computes.

    Parameters
    ----------
    hidden_size, ffn_hidden_size, num_experts, top_k : int
        ``ffn_hidden_size`` per expert.
    score_function, renormalize, num_groups, group_top_k, expert_bias, bias_update_rate,
    aux_loss_coeff, seq_aux_loss_coeff, z_loss_coeff, topk_scaling_factor :
        The router's (:class:`te_ops.basic.moe.Router`, which cites each option's source).
        ``moe.router.float()`` keeps the gate in float32 under 16-bit experts (the gate GEMM
        then runs in float32).
    capacity_factor : float or None
        ``None``: dropless (rows = tokens x top_k, device split sizes). Else static per-expert
        capacity with ``drop_policy`` (:class:`te_ops.basic.moe.Permute`).
    drop_policy : {"probs", "position"}
    shared_ffn_hidden_size : int or None
        Width of the shared experts, a dense SwiGLU MLP run on every token and added to the
        output (DeepSeek-V2/V3, Qwen2-MoE; for several shared experts pass their summed
        width); ``None``: none.
    ep_group : torch.distributed.ProcessGroup or None
        Expert parallelism (EP) over this group of ``ep`` ranks (``num_experts`` divisible
        by ``ep``): this rank holds experts ``local_experts = [r * E / ep, (r + 1) * E / ep)``
        in ``experts``; the router (and the shared experts) are replicated. The block gains
        ``AllToAllDispatch`` after ``Permute`` and ``AllToAllCombine`` before ``Combine``
        (``te_ops/basic/ep.py``): dropless, one host read of the split sizes per step;
        with ``capacity_factor``, static splits and no host read (every rank must route the
        same token count). Each rank calls the layer on its own tokens; its output is the
        non-EP layer's on them, the expert weights' gradients hold every rank's tokens'
        contributions, and the balancing losses are shares of the group batch's (see
        :class:`te_ops.basic.moe.Router`, ``group``). ``state_dict()`` holds this rank's
        experts; ``load_state_dict`` also takes the non-EP layer's (all ``E`` experts: this
        rank's rows are kept), so every rank can load one full checkpoint. ``None``: every
        expert here.
    device, dtype :
        Of the parameters.

    Attributes
    ----------
    router : Router
        Its gate weight ``router.weight`` is (num_experts, hidden_size).
    experts : Sequential
        ``fc1 (GroupedLinear E x hidden -> 2 ffn) -> ScaledSwiGLU -> fc2 (ffn -> hidden)``, one
        packed weight per GroupedLinear (``experts[0].weight`` (E, 2 ffn, hidden),
        ``experts[2].weight`` (E, hidden, ffn)); with ``ep_group`` E / ep experts, the ones
        of ``local_experts``.
    ep_dispatch, ep_combine : AllToAllDispatch, AllToAllCombine or None
        The expert-parallel all-to-alls (``None`` without ``ep_group``).
    shared_experts : Sequential or None
        The same block with one group.

    Calling
    -------
    ``y, aux_loss = moe(x)``: x (..., hidden_size) -> y the same shape and dtype, aux_loss a
    float32 scalar (float64 for float64 input; zero without balancing loss).
    ``moe(x, return_dropped=True)`` adds the () int64 number of (token, expert) pairs dropped
    past capacity (zero dropless). In training with ``expert_bias`` the routed load is added
    to ``router.expert_load`` for :meth:`update_expert_bias`.

    Raises
    ------
    ValueError / TypeError
        Bad constructor arguments (messages name them, e.g. ``num_experts`` not divisible by
        the ``ep_group``'s size); an input whose last dim is not ``hidden_size``.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int, *,
                 score_function: str = "softmax", renormalize: bool = True,
                 num_groups: int | None = None, group_top_k: int | None = None,
                 expert_bias: bool = False, bias_update_rate: float = 1e-3,
                 aux_loss_coeff: float = 0.0, seq_aux_loss_coeff: float = 0.0,
                 z_loss_coeff: float = 0.0, topk_scaling_factor: float = 1.0,
                 capacity_factor: float | None = None,
                 drop_policy: str = "probs", shared_ffn_hidden_size: int | None = None,
                 ep_group: Any = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        _positive_int("ffn_hidden_size", ffn_hidden_size)
        if shared_ffn_hidden_size is not None:
            _positive_int("shared_ffn_hidden_size", shared_ffn_hidden_size)
        if ep_group is not None:
            comm.check_group(ep_group, "ep_group")
        self.router = Router(hidden_size, num_experts, top_k, score_function=score_function,
                             renormalize=renormalize, num_groups=num_groups,
                             group_top_k=group_top_k, expert_bias=expert_bias,
                             bias_update_rate=bias_update_rate, aux_loss_coeff=aux_loss_coeff,
                             seq_aux_loss_coeff=seq_aux_loss_coeff, z_loss_coeff=z_loss_coeff,
                             topk_scaling_factor=topk_scaling_factor, group=ep_group,
                             device=device, dtype=dtype)
        self.permute = Permute(num_experts, capacity_factor=capacity_factor,
                               drop_policy=drop_policy)
        if ep_group is None:
            self.ep_dispatch = self.ep_combine = None
            rows_from, local = self.permute, num_experts
        else:
            self.ep_dispatch = AllToAllDispatch(num_experts, ep_group,
                                                capacity=capacity_factor is not None)
            self.ep_combine = AllToAllCombine(self.ep_dispatch)
            rows_from, local = self.ep_dispatch, self.ep_dispatch.num_local_experts
        self.experts = _swiglu_mlp(local, hidden_size, ffn_hidden_size, ScaledSwiGLU(),
                                   device, dtype)
        self.combine = Combine(masked=capacity_factor is not None)  # dropless drops nothing
        self.shared_experts = None if shared_ffn_hidden_size is None else _swiglu_mlp(
            1, hidden_size, shared_ffn_hidden_size, SwiGLU(), device, dtype)
        fc1, act, fc2 = self.experts
        self.permute.feed_extra_input("top_k_index", self.router, "top_k_index")
        self.permute.feed_extra_input("top_k_probs", self.router, "top_k_probs")
        ops = [self.router, self.permute, fc1, act, fc2, self.combine]
        if ep_group is not None:
            self.ep_dispatch.feed_extra_input("split_sizes", self.permute, "split_sizes")
            self.ep_dispatch.feed_extra_input("probs", self.permute, "probs")
            for name in ("a2a_splits", "recv_index", "local_index"):
                self.ep_combine.feed_extra_input(name, self.ep_dispatch, name)
            ops = [self.router, self.permute, self.ep_dispatch, fc1, act, fc2,
                   self.ep_combine, self.combine]
        fc1.feed_extra_input("split_sizes", rows_from, "split_sizes")
        act.feed_extra_input("probs", rows_from, "probs")
        fc2.feed_extra_input("split_sizes", rows_from, "split_sizes")
        self.combine.feed_extra_input("pair_index", self.permute, "pair_index")
        self.combine.feed_extra_input("row_index", self.permute, "row_index")
        # The layer as one Sequential (kept out of the module tree: its ops are registered
        # above under their names). Calling it returns y and the unconsumed extra outputs:
        # aux_loss, tokens_per_expert, dropped.
        self.__dict__["block"] = Sequential(*ops)
        self.hidden_size = hidden_size
        if ep_group is not None:
            self.register_load_state_dict_pre_hook(_take_local_experts)

    @property
    def local_experts(self) -> range:
        """The global ids of the experts this process holds in ``experts`` (all of them
        without ``ep_group``)."""
        if self.ep_dispatch is None:
            return range(self.router.num_experts)
        return self.ep_dispatch.local_experts

    def _apply(self, fn, *args, **kwargs):  # .to() / .cuda(): the block's fusers follow
        out = super()._apply(fn, *args, **kwargs)
        block = self.__dict__["block"]
        block._reset(list(block))
        return out

    def update_expert_bias(self, rate: float | None = None) -> None:
        """Aux-loss-free balancing step from the load routed since the last one (see
        :meth:`te_ops.basic.moe.Router.update_expert_bias`)."""
        self.router.update_expert_bias(rate=rate)

    def explain(self, x: torch.Tensor | None = None) -> str:
        """The fusion plan of :attr:`block` (the routed layer; ``block.explain``) for a call on
        ``x`` (..., hidden_size), or for the last call; the shared experts run beside it."""
        block = self.__dict__["block"]
        return block.explain() if x is None else block.explain(x)

    def forward(self, x: torch.Tensor, *, return_dropped: bool = False,
                is_first_microbatch: bool | None = None) -> Any:
        """``y, aux_loss = moe(x)`` (``y, aux_loss, dropped`` with ``return_dropped=True``);
        shapes, dtypes and errors in the class docstring. ``is_first_microbatch``: the
        quantized weight cache of the routed and shared experts under a recipe, as
        :meth:`te_ops.Sequential.forward` takes it."""
        if is_first_microbatch is None:
            return self._forward(x, return_dropped)
        return call_flagged(is_first_microbatch, self._forward, x, return_dropped)

    def _forward(self, x: torch.Tensor, return_dropped: bool) -> Any:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not isinstance(return_dropped, bool):
            raise TypeError(f"return_dropped must be a bool, got "
                            f"{type(return_dropped).__name__} ({return_dropped!r})")
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must have shape (..., {self.hidden_size}), got "
                             f"{tuple(x.shape)}")
        y, aux_loss, load, dropped = self.__dict__["block"](x)
        if self.shared_experts is not None:
            flat = x.reshape(-1, self.hidden_size)
            sizes = torch.full((1,), flat.shape[0], dtype=torch.int64, device=x.device)
            y = y + self.shared_experts(flat, sizes, sizes)
        if self.router.expert_load is not None and self.training:
            with torch.no_grad():
                self.router.expert_load.add_(load.to(self.router.expert_load.dtype))
        y = y.reshape(x.shape)
        return (y, aux_loss, dropped) if return_dropped else (y, aux_loss)


def _take_local_experts(module: MoE, state_dict: dict, prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook of an expert-parallel layer: expert weights holding every
    expert (the non-EP layer's, a full checkpoint's) are cut to this rank's rows."""
    local, total = module.local_experts, module.router.num_experts
    for i in (0, 2):
        key = f"{prefix}experts.{i}.weight"
        full = state_dict.get(key)
        if isinstance(full, torch.Tensor) and full.dim() == 3 and full.shape[0] == total:
            state_dict[key] = full[local.start:local.stop]


def _swiglu_mlp(groups: int, hidden: int, ffn: int, act: SwiGLU, device: Any,
                dtype: Any) -> Sequential:
    return Sequential(
        GroupedLinear(groups, hidden, 2 * ffn, bias=False, single_grouped_weight=True,
                      device=device, dtype=dtype),
        act,
        GroupedLinear(groups, ffn, hidden, bias=False, single_grouped_weight=True,
                      device=device, dtype=dtype),
    )
