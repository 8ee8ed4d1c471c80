"""``GroupedLinear``: one linear layer per group (expert) over row-split input.

For group ``g`` with rows ``x_g`` (split by ``split_sizes``): ``y_g = x_g W_g^T + b_g``
(``+ b_g * probs`` rows-wise with ``scale_bias=True``). Rows past the split-size sum are padding:
their outputs are zero and they get zero gradients.
"""

from __future__ import annotations

import copy
import functools
import math
import operator
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..call_scope import current_call
from ..gemm import (
    BackendChoice,
    RowGather,
    grouped_dgrad,
    grouped_fprop,
    grouped_mm_operand_reason,
    grouped_mm_operands,
    row_gather_reason,
    select_backend,
    stack_weights,
)
from ..grouped_tensor import GroupedTensorStorage
from ..op import BasicOperation, OperationContext
from ..quantization import quantize_operand
from ..quantization.autocast import check_operand_dtype
from ..quantization.gemm import is_quantized, quantized_gemm_note
from ..quantization.weight_cache import WeightCacheEntry, first_microbatch, weight_cache_key
from ..shapes import as_shape, rows_2d
from ..splits import GroupedSplits, make_splits
from ..tracing import tracing
from ..training import WgradPolicy, backward_dw, weight_and_bias_grads
from .checkpoint_layout import expert_count_errors

__all__ = ["GroupedLinear", "GroupedLinearSaved", "check_param_dtype", "check_probs",
           "convert_weight_layout"]


_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def check_param_dtype(dtype: Any) -> torch.dtype:
    """``dtype`` (``None``: torch's default dtype) if te_ops' ops take it for parameters.

    Raises
    ------
    ValueError
        Not one of float32, bfloat16, float16, float64; the message names a non-``torch.dtype``
        value's type (``"float32"``, a string, prints like ``torch.float32``'s name).
    """
    dtype = dtype or torch.get_default_dtype()
    if dtype not in _SUPPORTED_DTYPES:
        got = dtype if isinstance(dtype, torch.dtype) else f"{type(dtype).__name__} {dtype!r}"
        raise ValueError(f"dtype must be one of {_SUPPORTED_DTYPES}, got {got}")
    return dtype


def check_probs(probs: Any, num_rows: int, device: torch.device, name: str = "probs",
                lead_shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Check per-row probs and return them flattened to shape (num_rows,).

    Accepted shapes: (num_rows,) or, when given, ``lead_shape`` (the input's leading dims, so
    an (B, S, H) input may take (B, S) probs). Float dtype, on the input's device.

    Raises
    ------
    TypeError, ValueError
        The message names ``name`` with the expected and the actual value.
    """
    shapes = [(num_rows,)]
    if lead_shape is not None and tuple(lead_shape) != (num_rows,):
        shapes.append(tuple(lead_shape))
    if not isinstance(probs, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {_shapes_text(shapes)}, got "
                        f"{type(probs).__name__}")
    if tuple(probs.shape) not in shapes:
        raise ValueError(f"{name} must have shape {_shapes_text(shapes)}, got "
                         f"{tuple(probs.shape)}")
    if not probs.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype, got {probs.dtype}")
    if probs.device != device:
        raise ValueError(f"{name} must be on the input's device {device}, got {probs.device}")
    return probs if probs.dim() == 1 else probs.reshape(num_rows)


def _shapes_text(shapes: list[tuple[int, ...]]) -> str:
    return " or ".join(str(s) for s in shapes)


def columnwise_only(storage: Any) -> Any:
    """A shallow copy of a quantized storage without its row-wise copy (what a saved context
    keeps: the column-wise copy feeds the backward GEMMs, the row-wise one only this call's)."""
    kept = copy.copy(storage)
    kept.rowwise_data = kept.rowwise_scale_inv = None
    return kept


@functools.lru_cache(maxsize=64)
def _backend_text(choice: BackendChoice) -> str:
    safe = "graph-safe" if choice.graph_safe else "not graph-safe"
    return f"{choice.name} ({choice.reason}; {safe})"


def _graph_safe_with_device_sizes(info: Any, op: GroupedLinear) -> bool:
    """Whether ``op``'s backend would be graph-safe with split sizes as a device tensor."""
    try:
        return select_backend(info.device, info.dtype, op.in_features, op.out_features,
                              True).graph_safe
    except RuntimeError:
        return False


def stacked(params: list[torch.Tensor], single: bool, prefix: str | None = None
            ) -> torch.Tensor:
    """The parameters as one (G, ...) tensor: the single grouped parameter itself, or the
    per-group parameters stacked (a free view when they are adjacent, see ``stack_weights``;
    ``prefix``, e.g. ``"weight"``, names them in its errors)."""
    return params[0] if single else stack_weights(params, prefix)


def bias_table(stacked_bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Shape (G + 1, N): the (G, N) biases and a zero row that padding rows gather."""
    zero = stacked_bias.new_zeros(1, stacked_bias.shape[1])
    return torch.cat([stacked_bias, zero]).to(dtype)


def add_group_bias(y: torch.Tensor, stacked_bias: torch.Tensor, splits: GroupedSplits,
                   probs: torch.Tensor | None) -> torch.Tensor:
    """``y[r] += b[group(r)]`` (times ``probs[r]`` when given); padding rows get nothing.

    One gather from a (G + 1, N) table whose last row is zero, so no host sync. Padding rows
    of ``probs`` are ignored, whatever they hold.
    """
    rows = bias_table(stacked_bias, y.dtype)[splits.group_ids]
    if probs is not None:
        rows = rows * splits.zero_padding(probs).to(y.dtype).unsqueeze(-1)
    return y.add_(rows)


def convert_weight_layout(state_dict: dict, prefix: str, num_groups: int, single: bool) -> None:
    """Rewrite ``state_dict`` in place to the layout of a layer (``single`` = one ``weight``
    (G, out, in) and ``bias`` (G, out); else ``weight{g}`` / ``bias{g}``) when it holds the
    other layout completely and none of the target keys; anything else is left as it is."""
    for kind in ("weight", "bias"):
        one = prefix + kind
        per = [f"{prefix}{kind}{g}" for g in range(num_groups)]
        if (single and one not in state_dict and all(k in state_dict for k in per)
                and len({tuple(getattr(state_dict[k], "shape", ())) for k in per}) == 1):
            state_dict[one] = torch.stack([state_dict.pop(k) for k in per])
        elif (not single and one in state_dict and not any(k in state_dict for k in per)
              and getattr(state_dict[one], "dim", lambda: 0)() >= 1
              and state_dict[one].shape[0] == num_groups):
            stacked_param = state_dict.pop(one)
            for g, k in enumerate(per):
                state_dict[k] = stacked_param[g]


@functools.lru_cache(maxsize=64)
def _recipe_note(recipe: Any, device: torch.device, dtype: torch.dtype, in_features: int,
                 out_features: int, backend_name: str) -> str:
    """:func:`quantized_gemm_note`, cached per call configuration (it runs every forward), and
    the GEMMs the recipe keeps in high precision."""
    note = quantized_gemm_note(recipe, device, dtype, in_features, out_features, backend_name)
    keep = [g for g in ("fprop", "dgrad", "wgrad") if g in recipe.high_precision_gemms()]
    return note + (f"; {', '.join(keep)} in high precision (recipe setting)"
                   if keep else "")


@dataclass
class GroupedLinearSaved:
    """The one saved-context layout of :class:`GroupedLinear` (see docs/saved_context.md).

    Every forward that covers a GroupedLinear (unfused or fused) writes its context with
    :meth:`save`; every backward reads it with :meth:`load`.

    Attributes
    ----------
    splits : GroupedSplits
        Split sizes, offsets, per-row group ids (device tensors).
    x : GroupedTensorStorage | None
        The input (split grouping), or ``None`` when it is not needed (no wgrad) or is
        recomputed by ``recompute_x``.
    weights : list[torch.Tensor]
        The parameters ``weight0..`` (saved by reference; no copy), or ``[weight]`` with
        ``single_grouped_weight``.
    biases : list[torch.Tensor]
        The parameters ``bias0..`` (or ``[bias]``; empty without bias).
    probs : torch.Tensor | None
        Per-row scale of the bias (``scale_bias=True``).
    backend : BackendChoice
        The grouped GEMM backend the forward chose; backward uses the same.
    recompute_x : callable | None
        Returns the input when a fused forward did not save it (it recomputes it from the
        producing op's saved context, bit-identically).
    in_shape : tuple[int, ...]
        Shape of the main input (leading dims are flattened into rows).
    probs_requires_grad : bool
        Whether the caller's ``probs`` requires grad (recorded from the caller's tensor, since
        ``probs`` here is a reshape made with grad mode off).
    recipe : te_ops.recipe.Recipe | None
        The low-precision recipe the forward ran with; ``x`` is then its column-wise quantized
        copy (``QuantizedTensorStorage``) and backward quantizes ``dy`` and the weights with it.
    weight_amax : torch.Tensor | None
        FP8 current scaling: the stacked weights' column amax (G, in)
        fp32, recorded by the forward's row-wise quantize; dgrad's column-wise copy is then
        made in one pass (``None``: backward computes it).
    weights_view : torch.Tensor | None
        Per-group weights (not ``single``): the forward's (G, out, in) view of them (their
        buffer, no copy), which dgrad reads instead of stacking them again; a plain reference
        in the layout (``weights`` are the saved tensors, whose versions autograd checks).
        ``None`` when stacking them took a copy (weights not adjacent), under a recipe, or
        while tracing.
    x_gather : RowGather | None
        The input as rows gathered from a source (the MoE layer's tokens in token order, and
        the row -> token index), kept instead of ``x`` when a fused forward read it so
        (``te_ops/fused/moe_routing.py``): the source is the tensor the router saves anyway,
        so only the (rows,) index is added. :meth:`input_2d` gathers the rows; the wgrad GEMM
        takes the gather itself (:func:`te_ops.gemm.row_gather_reason`). High precision only.
    weight_cache : WeightCacheEntry | None
        The op's quantized weights of this optimizer step, when the forward ran with
        ``is_first_microbatch`` (:mod:`te_ops.quantization.weight_cache`): dgrad reads its
        column-wise copy, or makes it and keeps it there. ``None`` otherwise.
    """

    splits: GroupedSplits
    x: GroupedTensorStorage | None
    weights: list[torch.Tensor]
    biases: list[torch.Tensor]
    probs: torch.Tensor | None
    backend: BackendChoice
    in_shape: tuple[int, ...]
    recompute_x: Callable[[], torch.Tensor] | None = None
    single: bool = False
    probs_requires_grad: bool = False
    recipe: Any = None
    training: WgradPolicy | None = None
    weight_amax: torch.Tensor | None = None
    weights_view: torch.Tensor | None = None
    x_gather: RowGather | None = None
    weight_cache: WeightCacheEntry | None = None

    def save(self, ctx: OperationContext) -> None:
        """Write this layout into ``ctx`` (tensors via ``save_for_backward``)."""
        x_tensors: list[torch.Tensor | None] = []
        x_storage = None
        if self.x is not None:
            # The splits own the split metadata: the storage's references to it are dropped
            # here and put back by load(), so each op saves split sizes and offsets once.
            self.x.split_sizes = self.x.base_offsets = None
            x_tensors, x_storage = self.x.prepare_for_saving()
        gather = self.x_gather
        ctx.save_for_backward(*self.splits.to_tensors(), *x_tensors, *self.weights,
                              *self.biases, self.probs, self.weight_amax,
                              *((gather.src, gather.index) if gather else (None, None)))
        ctx.grouped_linear_layout = {
            "num_groups": self.splits.num_groups,
            "num_rows": self.splits.num_rows,
            "host_sizes": self.splits.host_sizes,
            "host_copy": self.splits.host_copy,
            "has_padding": self.splits.has_padding,
            "x_storage": x_storage,
            "num_weights": len(self.weights),
            "num_biases": len(self.biases),
            "backend": self.backend,
            "recompute_x": self.recompute_x,
            "in_shape": self.in_shape,
            "single": self.single,
            "probs_requires_grad": self.probs_requires_grad,
            "recipe": self.recipe,
            "training": self.training,
            "weights_view": self.weights_view,
            "gather_masked": gather.masked if gather else None,
            "weight_cache": self.weight_cache,
        }

    @classmethod
    def load(cls, ctx: OperationContext) -> GroupedLinearSaved:
        """Read the layout written by :meth:`save` (after the fuser restored saved tensors)."""
        meta = ctx.grouped_linear_layout
        rest = list(ctx.saved_tensors)
        splits = GroupedSplits.from_tensors(
            rest[:4], num_groups=meta["num_groups"], num_rows=meta["num_rows"],
            host_sizes=meta["host_sizes"], has_padding=meta["has_padding"],
            host_copy=meta["host_copy"],
        )
        rest = rest[4:]
        # The storages are refilled as shallow copies: the layout dict lives as long as the
        # autograd node (until the outputs are freed, not when this backward ends), and a
        # refilled original would keep the input (and quantized weights) alive with it.
        x = copy.copy(meta["x_storage"])
        if x is not None:
            rest = x.restore_from_saved(rest)
            x.split_sizes, x.base_offsets = splits.split_sizes, splits.base_offsets
        nw, nb = meta["num_weights"], meta["num_biases"]
        weights, biases, probs = rest[:nw], rest[nw:nw + nb], rest[nw + nb]
        weight_amax = rest[nw + nb + 1]
        src, index = rest[nw + nb + 2], rest[nw + nb + 3]
        gather = None if src is None else RowGather(src, index, meta["gather_masked"])
        return cls(splits, x, weights, biases, probs, meta["backend"], meta["in_shape"],
                   meta["recompute_x"], meta["single"], meta["probs_requires_grad"],
                   meta["recipe"], meta["training"], weight_amax,
                   meta["weights_view"], gather, meta["weight_cache"])

    def has_input(self) -> bool:
        """Whether the layout keeps the input (stored, or as a row gather)."""
        return self.x is not None or self.x_gather is not None

    def fprop_input(self) -> torch.Tensor | RowGather:
        """The input as fprop read it: the stored (rows, in_features) tensor, or the row
        gather (the fc1 recompute re-runs fprop on it)."""
        return self.x_gather if self.x_gather is not None else self.x.as_2d()

    def input_2d(self) -> torch.Tensor:
        """The (rows, in_features) input, from the storage, gathered or recomputed."""
        if self.x_gather is not None:
            return self.x_gather.rows()
        if self.x is not None:
            return self.x.as_2d()
        if self.recompute_x is None:
            raise RuntimeError("GroupedLinear context holds no input and no way to recompute it")
        x = self.recompute_x()
        cols = self.in_shape[-1]
        return x if x.dim() == 2 and x.shape[1] == cols else x.reshape(-1, cols)

    def wgrad_input(self) -> Any:
        """The wgrad GEMM's input operand: the saved (quantized) storage under a recipe, or the
        recomputed input quantized column-wise, or the plain (rows, in_features) input."""
        if is_quantized(self.x):
            return self.x
        if self.x_gather is not None and self.recipe is None:
            return self.x_gather  # the wgrad GEMM gathers it (in its load where it can)
        return quantize_operand(self.recipe, "input", self.input_2d(), self.splits,
                                columnwise=True)


class GroupedLinear(BasicOperation):
    """A linear layer per group: ``y_g = x_g W_g^T + b_g`` on row-split input.

    Parameters
    ----------
    num_groups : int
        Number of groups (experts), >= 1.
    in_features, out_features : int
        Per-group weight shape is (out_features, in_features).
    bias : bool
        Add a per-group bias: ``bias`` of shape (num_groups, out_features) (per-expert
        layout: ``bias{g}`` of shape (out_features,)).
    scale_bias : bool
        Take a second extra input, per-row ``probs`` of shape (tokens,), and add
        ``bias * probs`` instead of ``bias`` (needs ``bias=True``).
    single_grouped_weight : bool
        ``True`` (default): all groups in one packed parameter ``weight`` of shape
        (num_groups, out_features, in_features) (and ``bias`` (num_groups, out_features)),
        the layout of HF transformers 5, torchtitan and Megatron's distributed checkpoints.
        ``False``: per-expert ``weight{g}`` (out_features, in_features) / ``bias{g}``, as
        TransformerEngine's option of that name. Same math bit for bit; packed is the default
        because every per-expert Parameter is one more autograd leaf and host work per step
        (2 parameters instead of 2 x num_groups; measured in README.md).
    accumulate_into_main_grad : bool
        Megatron-style: add each weight gradient into ``param.main_grad`` (honouring
        ``param.overwrite_main_grad``, setting ``param.grad_added_to_main_grad = True``) and
        give autograd ``None`` for the weights instead (see :mod:`te_ops.training` and
        docs/training_integration.md).
    delay_wgrad_compute : bool
        Backward computes the input gradient only; the weight and bias gradients are computed
        by :meth:`backward_dw` later (TransformerEngine's option of that name).
    device, dtype :
        Of the parameters (default: torch's defaults).

    Extra inputs
    ------------
    split_sizes : list[int] | torch.Tensor
        Rows per group, a host list or a 1-D integer tensor on the input's device; may sum to
        fewer than the rows (the rest is padding), never more.
    probs : torch.Tensor, only with ``scale_bias=True``
        Shape (tokens,), float.

    Shapes
    ------
    input (..., in_features) -> output (..., out_features); leading dims are flattened into
    rows (tokens) in row-major order. With ``single_grouped_weight=False`` the parameters
    ``weight{g}`` (out_features, in_features) and ``bias{g}`` (out_features,) are the names
    TransformerEngine's ops use, so its checkpoints map one to one; with ``bias=False`` the
    ``bias`` / ``bias{g}`` attributes are ``None`` (as ``torch.nn.Linear.bias``). Weights
    parametrized with ``torch.nn.utils.parametrize`` (either layout) are computed once per
    call and differentiated through (not with ``accumulate_into_main_grad`` /
    ``delay_wgrad_compute``, which raise ``NotImplementedError``). Initialization follows
    ``torch.nn.Linear`` (Kaiming-uniform
    weights, uniform biases; TransformerEngine zeros biases, see :meth:`reset_parameters`
    for why te_ops does not). ``load_state_dict`` also
    accepts a checkpoint of the other weight layout (per-group ``weight{g}`` vs
    ``single_grouped_weight``).

    Raises
    ------
    ValueError / TypeError
        Bad constructor arguments, an input whose last dim is not ``in_features``, bad split
        sizes or probs (see :func:`te_ops.splits.make_splits`); messages name the argument.
    """

    def __init__(self, num_groups: int, in_features: int, out_features: int, *,
                 bias: bool = True, scale_bias: bool = False,
                 single_grouped_weight: bool = True,
                 accumulate_into_main_grad: bool = False,
                 delay_wgrad_compute: bool = False,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        for name, value in (("num_groups", num_groups), ("in_features", in_features),
                            ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name, flag in (("bias", bias), ("scale_bias", scale_bias),
                           ("single_grouped_weight", single_grouped_weight),
                           ("accumulate_into_main_grad", accumulate_into_main_grad),
                           ("delay_wgrad_compute", delay_wgrad_compute)):
            if not isinstance(flag, bool):  # bias=2 or "no" is not taken as True
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__} ({flag!r})")
        bias, scale_bias = bool(bias), bool(scale_bias)
        if scale_bias and not bias:
            raise ValueError("scale_bias=True needs bias=True, got bias=False")
        dtype = check_param_dtype(dtype)
        self.num_groups = num_groups
        self.in_features = in_features
        self.out_features = out_features
        self.has_bias = bias
        self.scale_bias = scale_bias
        self.single_grouped_weight = bool(single_grouped_weight)
        self.num_extra_inputs = 2 if scale_bias else 1
        self.accumulate_into_main_grad = bool(accumulate_into_main_grad)
        self.delay_wgrad_compute = bool(delay_wgrad_compute)
        # Per-group weights are adjacent slices of one buffer so the grouped GEMM can use them
        # as one (G, N, K) tensor without a copy (see gemm.stack_weights).
        weight_buffer = torch.empty(num_groups, out_features, in_features, device=device,
                                    dtype=dtype)
        bias_buffer = torch.empty(num_groups, out_features, device=device, dtype=dtype)
        if self.single_grouped_weight:
            self.weight = torch.nn.Parameter(weight_buffer)
            self.register_parameter("bias", torch.nn.Parameter(bias_buffer) if bias else None)
        else:
            for g in range(num_groups):
                self.register_parameter(f"weight{g}", torch.nn.Parameter(weight_buffer[g]))
            for g in range(num_groups):  # None without bias, as torch.nn.Linear's bias
                self.register_parameter(f"bias{g}",
                                        torch.nn.Parameter(bias_buffer[g]) if bias else None)
        self.reset_parameters()

    @property
    def use_bias(self) -> bool:
        """Whether the layer adds a per-group bias (TransformerEngine's name; ``has_bias``
        is the same flag)."""
        return self.has_bias

    def reset_parameters(self) -> None:
        """``torch.nn.Linear``'s initialization, per group (Kaiming-uniform weights, uniform
        biases in ``±1/sqrt(in_features)``).

        TransformerEngine's ops start biases at zero; te_ops keeps ``torch.nn.Linear``'s
        rule instead, so a block built from te_ops starts from the same distribution as the
        per-expert ``nn.Linear`` modules it replaces (and the tests' random biases exercise
        the bias math). Call ``torch.nn.init.zeros_`` on ``biases()`` for TE's start.
        """
        bound = 1.0 / math.sqrt(self.in_features)
        weights, biases = self._stored_param_lists()
        with torch.no_grad():
            for w in stacked(weights, self.single_grouped_weight, "weight").unbind(0):
                torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
            for b in biases:
                torch.nn.init.uniform_(b, -bound, bound)

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() give each parameter new storage: pack them into one buffer again.
        module = super()._apply(fn, *args, **kwargs)
        self._pack_parameters()
        return module

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        # Accept the other weight layout (as TransformerEngine does), so the
        # single_grouped_weight flag can be flipped on existing checkpoints.
        if self.single_grouped_weight:  # per-expert entries that cannot be stacked
            expected = {"weight": (self.out_features, self.in_features),
                        "bias": (self.out_features,)}
            for kind, shape in expected.items():
                for g in range(self.num_groups):
                    t = state_dict.get(f"{prefix}{kind}{g}")
                    if t is not None and tuple(getattr(t, "shape", ())) != shape:
                        error_msgs.append(
                            f"size mismatch for {prefix}{kind}{g}: copying a param with shape "
                            f"{tuple(t.shape)} from checkpoint into {prefix}{kind}[{g}] of a "
                            f"single_grouped_weight layer, which has shape {shape}")
        error_msgs.extend(expert_count_errors(  # another expert count: name the experts
            state_dict, prefix, self.num_groups, self.single_grouped_weight,
            ("weight", "bias") if self.has_bias else ("weight",)))
        convert_weight_layout(state_dict, prefix, self.num_groups, self.single_grouped_weight)
        names = [prefix + n for n, p in self._parameters.items() if p is not None]
        # load_state_dict passes strict=True here whatever the caller asked: warn in every
        # case (with strict=True an error follows), so strict=False never loads nothing
        # silently.
        if names and not any(n in state_dict for n in names):
            ours = [k for k in state_dict if k.startswith(prefix) and "." not in k[len(prefix):]]
            if ours:
                warnings.warn(
                    f"load_state_dict: GroupedLinear at {prefix or '(root)'!r} "
                    f"loaded nothing; the checkpoint has {ours[:4]}, the layer expects "
                    f"{names[:4]}", UserWarning, stacklevel=2)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def __setstate__(self, state: dict) -> None:
        # deepcopy / pickle / torch.load copy each parameter on its own: pack them again.
        super().__setstate__(state)
        self._pack_parameters()

    def _pack_parameters(self) -> None:
        """Make ``weight0..`` (and ``bias0..``) adjacent slices of one buffer again, keeping
        the Parameter objects, so the grouped GEMM uses them without a copy."""
        if self.single_grouped_weight:
            return
        with torch.no_grad():
            for params in self._stored_param_lists():
                if params and stack_weights(params).data_ptr() != params[0].data_ptr():
                    buffer = torch.stack([p.data for p in params])
                    for g, p in enumerate(params):
                        p.data = buffer[g]

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.has_bias}, "
                f"scale_bias={self.scale_bias}, single_grouped_weight={self.single_grouped_weight}"
                + "".join(f", {name}=True" for name in ("accumulate_into_main_grad",
                                                        "delay_wgrad_compute")
                          if getattr(self, name)))

    def _param_names(self) -> tuple[list[str], list[str]]:
        """The weight and bias attribute names (``["weight"], ["bias"]`` or ``weight{g}`` /
        ``bias{g}``; no bias names without bias)."""
        if self.single_grouped_weight:
            return ["weight"], (["bias"] if self.has_bias else [])
        groups = range(self.num_groups)
        return ([f"weight{g}" for g in groups],
                [f"bias{g}" for g in groups] if self.has_bias else [])

    def is_parametrized(self) -> bool:
        """Whether a weight or bias is parametrized (``torch.nn.utils.parametrize``: the
        attribute is then computed from ``parametrizations.<name>.original`` at every access;
        te_ops computes it once per call and differentiates through it)."""
        return "parametrizations" in self._modules

    def _param_lists(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        # Cached while the parameter dict holds the same objects (functional_call and
        # re-assignment swap entries, so the identities are the key). Within one fuser
        # forward call the dict cannot change, so the key is checked once per call
        # (te_ops/call_scope.py): with per-expert weights it is 2 x num_groups ids.
        # Parametrized weights (torch.nn.utils.parametrize) are computed at every access
        # (the fuser runs a call under parametrize.cached(): one value per call), never kept.
        if self.is_parametrized():
            self.__dict__.pop("_param_lists_cache", None)
            return tuple([getattr(self, n) for n in ns] for ns in self._param_names())
        cached = self.__dict__.get("_param_lists_cache")
        call = current_call()
        if cached is not None and call is not None and cached[3] is call:
            return cached[1], cached[2]
        key = tuple(map(id, self._parameters.values()))
        if cached is None or cached[0] != key:
            names = self._param_names()
            weights = [self._parameters[n] for n in names[0]]
            biases = [self._parameters[n] for n in names[1]]
            cached = (key, weights, biases, call)
            if tracing():  # the trace's stand-ins of the parameters: never kept (they would
                return weights, biases  # outlive it and break pickle / deepcopy of the op)
        elif call is not None:
            cached = (key, cached[1], cached[2], call)
        self.__dict__["_param_lists_cache"] = cached
        return cached[1], cached[2]

    def _stored_param_lists(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The stored Parameters (a parametrized one's ``original``), for initialization and
        packing; :meth:`_param_lists` gives the tensors the op computes with."""
        if not self.is_parametrized():
            return self._param_lists()
        parametrizations = self._modules["parametrizations"]
        return tuple([parametrizations[n].original if n in parametrizations
                      else self._parameters[n] for n in names]
                     for names in self._param_names())

    def computed_parameters(self) -> list[torch.Tensor]:
        """The tensors the op computes with, weights then biases (the order of the parameter
        gradients :meth:`fuser_backward` returns): the Parameters themselves, or, for weights
        parametrized with ``torch.nn.utils.parametrize``, their computed values (the fuser
        passes these to its autograd function, so gradients flow through the
        parametrization into its ``original`` and the parametrization's own parameters)."""
        weights, biases = self._param_lists()
        return [*weights, *biases]

    def weights(self) -> list[torch.Tensor]:
        """The weight Parameters: ``[weight0, ..., weight{G-1}]``, or ``[weight]`` (shape
        (G, out, in)) with ``single_grouped_weight`` (a new list)."""
        return list(self._param_lists()[0])

    def biases(self) -> list[torch.Tensor]:
        """The bias Parameters: ``[bias0, ...]`` or ``[bias]``; ``[]`` without bias."""
        return list(self._param_lists()[1])

    def extra_input_names(self) -> list[str | None]:
        return ["split_sizes", "probs"][: self.num_extra_inputs]

    def describe(self) -> str:
        extra = ", scale_bias" if self.scale_bias else ("" if self.has_bias else ", no bias")
        extra += "" if self.single_grouped_weight else ", per-expert weights"
        extra += ", main_grad" if self.accumulate_into_main_grad else ""
        extra += ", delayed wgrad" if self.delay_wgrad_compute else ""
        return (f"GroupedLinear(groups={self.num_groups}, {self.in_features}->"
                f"{self.out_features}{extra})")

    def unsupported_reason(self, input_: torch.Tensor) -> str | None:
        if input_.dtype not in _SUPPORTED_DTYPES:
            return f"input dtype {input_.dtype} is not one of {_SUPPORTED_DTYPES}"
        return None

    def dispatch_notes(self, info: Any) -> list[str]:
        if info.dtype is None:
            return ["grouped GEMM backend: decided at the first call"]
        idx = info.index(self)
        sig = info.extra_inputs[idx][0] if info.extra_inputs[idx] else None
        # fed split sizes are an earlier op's device tensor (te_ops.MoE's Permute)
        device_sizes = isinstance(sig, tuple) and sig[:1] in (("tensor",), ("fed",))
        try:
            choice = select_backend(info.device, info.dtype, self.in_features,
                                    self.out_features, device_sizes)
        except RuntimeError as exc:
            return [f"grouped GEMM backend: error: {exc}"]
        text = _backend_text(choice)
        if (sig is None or sig == ("none",)) and _graph_safe_with_device_sizes(info, self):
            # Planned without the extra inputs: the split-size kind decides graph safety.
            text = text.replace("; not graph-safe)",
                                "; graph-safe only with split sizes as a device tensor)")
        notes = [f"grouped GEMM backend: {text}"]
        recipe = getattr(info, "recipe", None)
        if recipe is not None:
            notes.append(_recipe_note(recipe, info.device, info.dtype, self.in_features,
                                      self.out_features, choice.name))
        return notes

    # ------------------------------------------------------------------ checks
    def check_input(self, input_: torch.Tensor) -> None:
        """Raise ValueError/TypeError when ``input_`` cannot feed this layer."""
        if input_.dim() < 1 or input_.shape[-1] != self.in_features:
            raise ValueError(
                f"input must have last dim in_features={self.in_features}, got shape "
                f"{tuple(input_.shape)}"
            )
        reason = self.unsupported_reason(input_)
        if reason:
            raise TypeError(f"input: {reason}")
        self.check_input_dtype(input_.dtype, input_.device)

    def check_input_dtype(self, dtype: torch.dtype, device: torch.device) -> None:
        """Raise ValueError when an input of ``dtype`` on ``device`` does not match the
        weights' dtype and device (the check of :meth:`check_input`; a fused op runs it for
        an inner op's input before that input exists). Also raise ValueError when the first
        weight's shape is not the layer's (``param.data`` replaced by a tensor of another
        shape); the other per-group weights are checked where they are stacked."""
        w = self._param_lists()[0][0]
        single = self.single_grouped_weight
        expected = ((self.num_groups,) if single else ()) + (self.out_features, self.in_features)
        if w.shape != expected:
            name = "weight" if single else "weight0"
            raise ValueError(
                f"{name} must have shape {expected} ({'num_groups, ' if single else ''}"
                f"out_features, in_features), got {tuple(w.shape)}: was its .data replaced "
                f"by a tensor of another shape?"
            )
        if dtype != w.dtype or device != w.device:
            if not single:  # the per-expert weights disagree: name the odd one, not the input
                stack_weights(self._param_lists()[0], "weight")
            target = ", ".join(([f"'{w.device}'"] if device != w.device else [])
                               + ([str(w.dtype)] if dtype != w.dtype else []))
            source = ", ".join(([f"'{device}'"] if device != w.device else [])
                               + ([str(dtype)] if dtype != w.dtype else []))
            raise ValueError(
                f"input must match the weights' dtype {w.dtype} and device {w.device}, got "
                f"{dtype} on {device}: move the input with "
                f"x.to({target}) (or the layer with .to({source}))"
            )

    def prepare_splits(self, input_: torch.Tensor, split_sizes: Any, recipe: Any = None,
                       checked: bool = False, num_rows: int | None = None) -> GroupedSplits:
        """Validate the input (unless ``checked``: the caller ran :meth:`check_input`; under
        ``recipe`` also its dtype, before the split sizes, in the order of the fused forward)
        and split sizes; derive offsets and group ids on the device. ``num_rows``: the rows of
        this layer's input where ``input_`` is not it (the source of a row gather)."""
        if not checked:
            self.check_input(input_)
            if recipe is not None:
                check_operand_dtype(recipe, "input", input_)
        rows = input_.numel() // self.in_features if num_rows is None else num_rows
        return make_splits(split_sizes, self.num_groups, rows, input_.device)

    def select_backend(self, input_: torch.Tensor, splits: GroupedSplits) -> BackendChoice:
        """Choose the grouped GEMM backend for this call, once (saved in the layout for the
        backward, recorded for ``explain()``)."""
        choice = select_backend(input_.device, input_.dtype, self.in_features,
                                self.out_features, device_split_sizes=splits.on_device,
                                rows_per_group=splits.num_rows / max(splits.num_groups, 1))
        self.record_dispatch("grouped GEMM backend", _backend_text(choice))
        return choice

    def _record_recipe(self, recipe: Any, x2d: torch.Tensor, backend: BackendChoice) -> None:
        """Record for ``explain()`` how this call's GEMMs ran under ``recipe`` (or drop the
        record of an earlier call's recipe)."""
        records = self.__dict__.setdefault("_dispatch_records", {})
        if recipe is None and not self.__dict__.get("_recipe_recorded"):
            return  # no recipe now and no recipe record to drop (the per-step common case)
        for kind in [k for k in records if k.startswith("recipe ")]:
            del records[kind]
        self.__dict__["_recipe_recorded"] = recipe is not None
        if recipe is not None:
            kind, decision = _recipe_note(recipe, x2d.device, x2d.dtype, self.in_features,
                                          self.out_features, backend.name).split(": ", 1)
            self.record_dispatch(kind, decision)

    # ------------------------------------------------------------------ math
    def forward_operands(self, ctx: OperationContext, x2d: torch.Tensor, splits: GroupedSplits,
                         recipe: Any, save_input: bool = True, weight_operand: Any = None,
                         input_operand: Any = None) -> tuple[Any, Any]:
        """fprop's operands (x, stacked weights): as they are, or under ``recipe`` quantized
        row-wise, each with its column-wise copy too where this call's context will keep it
        (x: wgrad input, when ``save_input`` and a weight needs a gradient; weights: dgrad,
        never: backward quantizes them for dgrad, or reads ``is_first_microbatch``'s copy),
        both copies from one quantize call (one pair of passes on CUDA). ``weight_operand``:
        the weights' operand made earlier by :meth:`forward_weight_operand` (same context and
        recipe).
        ``input_operand``: x's row-wise operand made earlier (the fused forward's SwiGLU + FP8
        kernel), for a call that keeps no column-wise copy of x; ``x2d`` is then unused.
        :meth:`make_saved` takes the result."""
        weights, _ = self._param_lists()
        if recipe is None:
            return x2d, stacked(weights, self.single_grouped_weight, "weight")
        # Both copies from one call only when the recipe quantizes every GEMM (with a GEMM kept
        # in high precision, each GEMM's operands are made, or passed plain, where it runs).
        both = not recipe.high_precision_gemms()
        keep_x = (both and ctx.requires_grad and save_input
                  and any(p.requires_grad for p in weights))
        if input_operand is not None and keep_x:
            raise ValueError("input_operand is a row-wise copy only, but this call keeps x's "
                             "column-wise copy for wgrad (save_input=True): pass x2d alone")
        x_in = input_operand if input_operand is not None else quantize_operand(
            recipe, "input", x2d, splits if keep_x else None, rowwise=True, columnwise=keep_x)
        if weight_operand is None:
            weight_operand = self.forward_weight_operand(ctx, recipe)
        return x_in, weight_operand

    def forward_weight_operand(self, ctx: OperationContext, recipe: Any) -> Any:
        """The stacked weights as fprop reads them (see :meth:`forward_operands`). Needs no
        split sizes, so a fused forward makes it first: the GPU then quantizes the weights
        while the host builds the split and layout tensors."""
        weights, _ = self._param_lists()
        w = stacked(weights, self.single_grouped_weight, "weight")
        if recipe is None:
            return w
        # Backward quantizes the weights for dgrad (keeping that copy from the forward measured
        # within noise on the H200 and costs its memory): their column amax from this read
        # (GroupedLinearSaved.weight_amax), so that copy is one pass there.
        dgrad = ctx.requires_grad and ctx.input_requires_grad
        amax = dgrad and "dgrad" not in recipe.high_precision_gemms()
        flag = first_microbatch()  # is_first_microbatch (te_ops/quantization/weight_cache.py)
        entry = self.__dict__.get("_weight_cache")
        if flag is False:
            if entry is None:
                raise RuntimeError(
                    f"{self.describe()}: is_first_microbatch=False, but no quantized weights "
                    "are cached: pass is_first_microbatch=True on the first micro-batch of "
                    "each optimizer step")
            entry.check(self.describe(), weight_cache_key(recipe, weights), weights,
                        self._param_names()[0])
            ctx.weight_cache = entry  # make_saved keeps it for dgrad's column-wise copy
            if entry.rowwise is not None:
                return entry.rowwise
            # else the recipe keeps fprop in high precision: nothing was kept
        elif flag and entry is not None:  # the last step's copies go before new ones are made
            entry.rowwise = entry.columnwise = None
        w_op = quantize_operand(recipe, "weight", w, rowwise=True, record_columnwise_amax=amax)
        if flag:
            made = (weight_cache_key(recipe, weights), WeightCacheEntry.versions_of(weights),
                    w_op if is_quantized(w_op) else None)
            if entry is None:
                entry = self.__dict__["_weight_cache"] = WeightCacheEntry(*made)
            else:  # one entry per op: a backward whose context holds it fills the current one
                entry.reset(*made)
            ctx.weight_cache = entry
        return w_op

    def forward_math(self, x2d: torch.Tensor, splits: GroupedSplits, backend: BackendChoice,
                     probs: torch.Tensor | None, recipe: Any = None,
                     operands: tuple[Any, Any] | None = None) -> torch.Tensor:
        """(rows, in) -> (rows, out): grouped GEMM, then the bias (padding rows stay zero).
        With a ``recipe`` the GEMM reads its row-wise quantized x and weights (``operands``,
        from :meth:`forward_operands`, or quantized here row-wise only; with ``operands``
        given only ``x2d``'s device and dtype are read)."""
        weights, biases = self._param_lists()
        single = self.single_grouped_weight
        self._record_recipe(recipe, x2d, backend)
        self.record_row_gather(backend, ("fprop", "wgrad") if isinstance(x2d, RowGather)
                               else ())
        if operands is None:
            operands = (quantize_operand(recipe, "input", x2d, rowwise=True),
                        quantize_operand(recipe, "weight", stacked(weights, single, "weight"),
                                         rowwise=True))
        x_op, w_op = operands
        if (backend.name != "loop" and type(x_op) is torch.Tensor
                and isinstance(w_op, torch.Tensor) and not is_quantized(w_op)):
            # the plain operands checked (and copied where misaligned) once, for the GEMM
            # and for explain()'s record
            (x_op, w_op), reasons = grouped_mm_operands(("input", x_op), ("weight", w_op))
            self._record_alignment_reasons(reasons)
            y = grouped_fprop(x_op, w_op, splits, backend, aligned=True)
        else:
            self._record_operand_alignment(backend, operands)
            y = grouped_fprop(*operands, splits, backend)
        if self.has_bias:
            y = add_group_bias(y, stacked(biases, single, "bias"), splits,
                               probs if self.scale_bias else None)
        return y

    def record_row_gather(self, backend: BackendChoice, kinds: tuple[str, ...]) -> None:
        """Record for ``explain()`` how this call's GEMMs of ``kinds`` read a row-gathered
        operand (:func:`te_ops.gemm.row_gather_reason`); no ``kinds``: drop an earlier call's
        record."""
        records = self.__dict__.setdefault("_dispatch_records", {})
        if not kinds:
            records.pop("row gather", None)
            return
        self.record_dispatch("row gather", "; ".join(
            row_gather_reason(backend, k)
            or f"{k} reads the rows by index in the few-rows Triton kernel's load"
            for k in kinds))

    def _record_operand_alignment(self, backend: BackendChoice, operands: tuple[Any, Any]
                                  ) -> None:
        """Record for ``explain()`` which of fprop's operands (x, the stacked weights) the
        grouped GEMM copies because their strides or data pointer are not 16-byte aligned
        (``gemm.dispatch.grouped_mm_operands``; dgrad and wgrad copy theirs, the
        output gradient included, the same way), or drop an earlier call's record."""
        reasons = [] if backend.name == "loop" else [
            r for name, t in zip(("input", "weight"), operands)
            if isinstance(t, torch.Tensor) and (r := grouped_mm_operand_reason(name, t))]
        self._record_alignment_reasons(reasons)

    def _record_alignment_reasons(self, reasons: list[str]) -> None:
        """Record (or, with no ``reasons``, drop) the note that fprop's grouped GEMM copies
        its misaligned operands."""
        records = self.__dict__.setdefault("_dispatch_records", {})
        if reasons:
            self.record_dispatch("grouped GEMM operands", "; ".join(reasons) + ": copied to a "
                                 "16-byte aligned tensor for each GEMM (a copy per call; a "
                                 "contiguous parameter avoids it)")
        else:
            records.pop("grouped GEMM operands", None)

    def make_saved(self, ctx: OperationContext, x2d: torch.Tensor | RowGather | None,
                   splits: GroupedSplits,
                   backend: BackendChoice, probs: torch.Tensor | None, in_shape,
                   recompute_x: Callable[[], torch.Tensor] | None = None,
                   recipe: Any = None, operands: tuple[Any, Any] | None = None
                   ) -> GroupedLinearSaved:
        """Build this op's saved layout (input kept only where wgrad needs it; under a
        ``recipe`` as its column-wise quantized copy, data + scale_inv, taken from the
        forward's ``operands`` when they hold it, as is the weights' column-wise copy; a
        :class:`~te_ops.gemm.RowGather` ``x2d`` is kept as it is: ``x_gather``, no recipe)."""
        weights, biases = self._param_lists()
        need_x = any(map(_REQUIRES_GRAD, weights))
        storage = weight_amax = None
        x_in, w_in = operands if operands is not None else (None, None)
        gather = x2d if isinstance(x2d, RowGather) else None
        if gather is not None and recipe is not None:
            raise ValueError("x2d: a row gather is kept in high precision only, got one under "
                             f"the recipe {type(recipe).__name__}")
        if gather is not None:
            gather = gather if need_x and recompute_x is None else None
        elif need_x and recompute_x is None and x2d is not None:
            if is_quantized(x_in) and x_in.columnwise_data is not None:
                storage = columnwise_only(x_in)
            else:
                storage = quantize_operand(recipe, "input", x2d, splits, columnwise=True)
                if not is_quantized(storage):  # no recipe, or one that keeps wgrad unquantized
                    storage = GroupedTensorStorage(
                        self.num_groups, tuple(x2d.shape), x2d.dtype, x2d,
                        split_sizes=splits.split_sizes, base_offsets=splits.base_offsets)
        if is_quantized(w_in) and ctx.input_requires_grad:
            weight_amax = w_in.columnwise_amax
        # Per-group weights: keep fprop's (G, out, in) view of them for dgrad (no second
        # stack; a copy made for non-adjacent weights is not kept alive until backward).
        weights_view = None
        if (not self.single_grouped_weight and ctx.input_requires_grad
                and isinstance(w_in, torch.Tensor) and w_in._is_view()):
            weights_view = w_in
        return GroupedLinearSaved(
            splits=splits, x=storage, weights=list(weights), biases=list(biases),
            probs=probs if self.scale_bias else None, backend=backend,
            in_shape=tuple(in_shape), recompute_x=recompute_x if need_x else None,
            single=self.single_grouped_weight,
            probs_requires_grad=self.scale_bias and ctx.extra_input_requires_grad(1),
            recipe=recipe,
            training=self._call_policy(weights, biases),
            weight_amax=weight_amax,
            weights_view=weights_view,
            x_gather=gather,
            weight_cache=getattr(ctx, "weight_cache", None) if recipe is not None else None,
        )

    def _call_policy(self, weights: list[torch.Tensor], biases: list[torch.Tensor]
                     ) -> WgradPolicy | None:
        """:meth:`wgrad_policy` for one forward call, given this call's parameter lists."""
        if not (self.accumulate_into_main_grad or self.delay_wgrad_compute):
            return None
        return self.wgrad_policy().for_call(weights, biases)

    def wgrad_policy(self, call: bool = False) -> WgradPolicy | None:
        """This op's main_grad / delayed-wgrad policy (``None`` when both options are off);
        one object per op, holding the queue of delayed wgrad jobs (``call=True``: a copy for
        one forward call, holding the current Parameter objects)."""
        if not (self.accumulate_into_main_grad or self.delay_wgrad_compute):
            return None
        policy = self.__dict__.get("_wgrad_policy")
        if self.is_parametrized():
            raise NotImplementedError(
                f"{self.describe()}: accumulate_into_main_grad / delay_wgrad_compute need "
                "the weights as Parameters; this layer has torch.nn.utils.parametrize "
                "parametrizations (computed weights): turn those options off or remove the "
                "parametrization")
        if policy is None:
            names = self._param_names()
            policy = WgradPolicy(self.describe(), *names)
            self.__dict__["_wgrad_policy"] = policy
        policy.accumulate_into_main_grad = self.accumulate_into_main_grad
        policy.delay_wgrad_compute = self.delay_wgrad_compute
        return policy.for_call(*self._param_lists()) if call else policy

    def backward_dw(self) -> None:
        """Compute the weight and bias gradients that backward queued with
        ``delay_wgrad_compute=True`` (every queued micro-batch, oldest first): weights into
        ``main_grad`` (with ``accumulate_into_main_grad``) or added to ``.grad``, biases added
        to ``.grad``. Does nothing when nothing is queued. See :func:`te_ops.training.backward_dw`.
        """
        policy = self.__dict__.get("_wgrad_policy")
        if policy is not None:
            backward_dw(policy)

    @staticmethod
    def backward_math(saved: GroupedLinearSaved, dy2d: torch.Tensor, need_dgrad: bool,
                      ) -> tuple[torch.Tensor | None, list[torch.Tensor | None],
                                 torch.Tensor | None]:
        """dgrad, parameter grads (weights then biases) and probs grad from a saved layout."""
        dy_q = GroupedLinear.quantize_grad_output(saved, dy2d, need_dgrad)
        dgrad = GroupedLinear.dgrad_math(saved, dy2d, dy_q) if need_dgrad else None
        return (dgrad, *GroupedLinear.param_grads_math(saved, dy2d, dy_q))

    @staticmethod
    def quantize_grad_output(saved: GroupedLinearSaved, dy2d: torch.Tensor, need_dgrad: bool
                             ) -> Any:
        """Under a recipe, when this backward runs both dgrad and wgrad now: ``dy2d``'s
        row-wise (dgrad) and column-wise (wgrad) copies from one quantize call (one pair of
        passes on CUDA; the copies are the bytes of two separate calls). ``None`` otherwise
        (each GEMM then quantizes its own copy). Pass it to :meth:`dgrad_math`, then to
        :meth:`param_grads_math` (which drops the row-wise copy after dgrad)."""
        policy = saved.training
        if (saved.recipe is None or not need_dgrad or saved.recipe.high_precision_gemms()
                or (policy is not None and policy.delay_wgrad_compute)
                or not any(w.requires_grad for w in saved.weights)):
            return None
        return quantize_operand(saved.recipe, "grad_output", dy2d, saved.splits, rowwise=True,
                                columnwise=True)

    @staticmethod
    def dgrad_math(saved: GroupedLinearSaved, dy2d: torch.Tensor, dy_q: Any = None
                   ) -> torch.Tensor:
        """(rows, out) -> (rows, in): the input gradient; padding rows are zero. Under a
        recipe the GEMM reads ``dy_q`` (from :meth:`quantize_grad_output`) or ``dy2d``
        quantized row-wise here, and the forward's saved column-wise weights (or the weights
        quantized column-wise here)."""
        weights = (saved.weights_view if saved.weights_view is not None
                   else stacked(saved.weights, saved.single))
        dy_in = dy_q if dy_q is not None else quantize_operand(saved.recipe, "grad_output",
                                                               dy2d, rowwise=True)
        cache = saved.weight_cache  # is_first_microbatch: this step's copy, once made
        w_in = None if cache is None else cache.columnwise
        if w_in is None:
            w_in = quantize_operand(saved.recipe, "weight", weights, columnwise=True,
                                    columnwise_amax=saved.weight_amax)
            if cache is not None and is_quantized(w_in):
                cache.columnwise = w_in
        return grouped_dgrad(dy_in, w_in, saved.splits, saved.backend)

    @staticmethod
    def param_grads_math(saved: GroupedLinearSaved, dy2d: torch.Tensor, dy_q: Any = None,
                         ) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
        """Weight grads, bias grads (one list, ``parameters()`` order) and the probs grad.
        ``dy_q``: see :meth:`quantize_grad_output` (its row-wise copy is dropped here)."""
        splits = saved.splits
        if dy_q is not None:
            dy_q.rowwise_data = dy_q.rowwise_scale_inv = None  # dgrad's copy: done with
        # Plain gradients, or main_grad / delayed wgrad: te_ops.training is the one path.
        grads, bias_grads = weight_and_bias_grads(saved, dy2d, dy_q)
        grad_probs = None
        if saved.biases and saved.probs is not None and saved.probs_requires_grad:
            table = bias_table(stacked(saved.biases, saved.single), dy2d.dtype)
            rows = table[splits.group_ids]
            acc = torch.promote_types(dy2d.dtype, torch.float32)  # fp64 stays fp64
            grad_probs = (rows.to(acc) * dy2d.to(acc)).sum(-1).to(saved.probs.dtype)
            grad_probs = splits.zero_padding(grad_probs)
        return grads + bias_grads, grad_probs

    # ------------------------------------------------------------------ fuser interface
    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, recipe=None):
        ctx = basic_op_ctxs[0]
        extra = basic_op_extra_inputs[0]
        splits = self.prepare_splits(input_, extra[0], recipe)
        probs = None
        if self.scale_bias:
            probs = extra[1]
            probs = check_probs(probs, splits.num_rows, input_.device,
                                lead_shape=tuple(input_.shape[:-1]))
        backend = self.select_backend(input_, splits)
        x2d = rows_2d(input_, self.in_features)
        operands = self.forward_operands(ctx, x2d, splits, recipe)
        y = self.forward_math(x2d, splits, backend, probs, recipe, operands)
        if ctx.requires_grad:
            self.make_saved(ctx, x2d, splits, backend, probs, input_.shape,
                            recipe=recipe, operands=operands).save(ctx)
        del operands
        return as_shape(y, (*input_.shape[:-1], self.out_features)), [()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx = basic_op_ctxs[0]
        saved = GroupedLinearSaved.load(ctx)
        dy2d = rows_2d(grad_output, self.out_features)
        dgrad, param_grads, grad_probs = self.backward_math(saved, dy2d, ctx.input_requires_grad)
        if dgrad is not None:
            dgrad = as_shape(dgrad, saved.in_shape)
        extra_grads = [None, grad_probs] if self.scale_bias else [None]
        return dgrad, [param_grads], [extra_grads]
