"""Quantized weights kept across the micro-batches of one optimizer step.

With gradient accumulation the weights do not change between the micro-batches of a step, yet
every forward quantizes them again for fprop (row-wise) and every backward for dgrad
(column-wise). On fine-grained experts the weights outweigh the tokens (E128 H2048 FF768: 604M
weight elements in fc1 and fc2 against fc1's 134M input elements at 65,536 routed rows); there
the quantize kernels are 2.50 ms of an FP8 step's 5.65 ms of GPU time (docs/performance.md,
"FP8 recipes"), the weights' passes about 1.5 ms of it by their sizes.

The caller says when the weights are fresh, as TransformerEngine's modules take it
(``is_first_microbatch`` of ``te.pytorch.Linear`` / ``GroupedLinear``; Megatron-Core passes it
per micro-batch): ``te_ops.Sequential(...)(x, *extra, is_first_microbatch=...)`` (and
``te_ops.MoE``, and a basic op called alone):

* ``None`` (default): nothing is cached; each call quantizes the weights (and the cache an op
  holds is left as it is).
* ``True``: the call quantizes the weights and keeps the copies in the op (fprop's row-wise copy
  now, dgrad's column-wise copy when this micro-batch's backward makes it).
* ``False``: the call reads the copies the last ``True`` call made. The caller promises the
  weights are the ones of that call. What is checked: the cache exists; the recipe and the
  weights' shapes, dtypes and devices are the same; each weight is the same tensor object, in
  the same memory, not written in place since (its ``_version``: ``copy_``, a foreach or
  for-loop optimizer step, ``load_state_dict``). A failed check raises ``RuntimeError`` naming
  the weight and the fix. Writes that leave all of that as it was cannot be seen (TE checks
  nothing): writes through ``.data`` (and a ``.data`` assignment that lands in the memory the
  weight had, as a ``module.to(dtype)`` round trip can), torch's ``fused=True`` optimizers
  (they do not bump ``_version``), and writes into a flat buffer that the parameters view
  through ``.data`` (Megatron-Core's parameter buffers). Computed weights
  (``torch.nn.utils.parametrize``) are a new tensor every call, so ``False`` raises for them,
  as where a framework re-gathers the weights every micro-batch: leave the flag ``None`` there.

Without a recipe the flag changes nothing (there is nothing to quantize). It is an eager
feature: a flagged call is never traced (``torch.compile(fullgraph=True)`` raises with the
reason; without ``fullgraph`` that call runs eagerly between graphs), since the cache is host
state a compiled graph cannot hold; during CUDA graph capture a bool raises (a
replay would read one step's copies for ever). The copies live until the op's next ``True``
call or until the op is freed: about the weights' own bytes (FP8 row-wise + column-wise, with
scales); deepcopy and pickle leave them out. Under activation checkpointing the recompute of a
``True`` micro-batch quantizes fprop's copy again (it is a ``True`` call); dgrad's copy is made
once, in that backward.
"""

from __future__ import annotations

import contextvars
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..tracing import tracing

__all__ = ["WeightCacheEntry", "call_flagged", "first_microbatch", "weight_cache_key"]

_FLAG: contextvars.ContextVar[bool | None] = contextvars.ContextVar("te_ops_first_microbatch",
                                                                   default=None)


def _call_flagged(value: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with ``value`` as the running call's flag. Raises ``TypeError`` unless
    ``value`` is a bool, and ``RuntimeError`` during CUDA graph capture (see the module
    docstring). A nested call passing ``None`` does not come here, so it keeps this flag (an
    op with hooks runs through its own module inside a container's call)."""
    if not isinstance(value, bool):
        raise TypeError(f"is_first_microbatch must be None, True or False, got "
                        f"{type(value).__name__} ({value!r})")
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "is_first_microbatch during CUDA graph capture: a replay would keep reading the "
            "copies of the captured call's step (a later True call makes new ones); capture "
            "with is_first_microbatch=None (each replay quantizes the weights)")
    token = _FLAG.set(value)
    try:
        return fn(*args)
    finally:
        _FLAG.reset(token)


#: ``call_flagged(value, fn, *args)``: ``fn(*args)`` with ``value`` as the flag, always eager:
#: torch.compile does not trace it (``fullgraph=True`` raises with the reason; otherwise the
#: call runs eagerly between graphs), since the cache is host state a graph cannot keep.
call_flagged = torch._dynamo.disable(_call_flagged, reason=(
    "is_first_microbatch is an eager feature: the quantized weight cache is host state a "
    "compiled graph cannot keep; under torch.compile(fullgraph=True) leave it None (each call "
    "quantizes the weights)"))


def first_microbatch() -> bool | None:
    """The running call's ``is_first_microbatch`` (``None`` outside one and while tracing)."""
    return None if tracing() else _FLAG.get()


def weight_cache_key(recipe: Any, weights: Sequence[torch.Tensor]) -> tuple:
    """What a cached copy must match: the recipe (recipes are dataclasses: equal fields, equal
    recipe) and each weight's shape, dtype and device."""
    return (recipe, tuple((tuple(w.shape), w.dtype, w.device) for w in weights))


@dataclass
class WeightCacheEntry:
    """One op's quantized weights for one optimizer step.

    key : tuple
        :func:`weight_cache_key` of the ``True`` call.
    versions : tuple[tuple[weakref.ref, int, int], ...]
        Each weight's (weak reference, ``data_ptr()``, ``_version``) at that call.
    rowwise : Any
        fprop's row-wise operand (a ``QuantizedTensorStorage``; ``None`` when the recipe keeps
        fprop in high precision: then nothing is kept for it).
    columnwise : Any
        dgrad's column-wise operand, set by the first backward that makes it (``None`` until
        then, or when dgrad stays in high precision).
    """

    key: tuple
    versions: tuple[tuple[weakref.ref, int, int], ...]
    rowwise: Any = None
    columnwise: Any = None

    def reset(self, key: tuple, versions: tuple, rowwise: Any) -> None:
        """Make this entry a ``True`` call's (dgrad's copy to be made again). An op keeps one
        entry object: a context saved before (activation checkpointing's recompute of the
        ``True`` micro-batch is such a later ``True`` call) fills the same one."""
        self.key, self.versions, self.rowwise, self.columnwise = key, versions, rowwise, None

    @staticmethod
    def versions_of(weights: Sequence[torch.Tensor]) -> tuple[tuple[weakref.ref, int, int], ...]:
        """Each weight's identity at a ``True`` call: (weak reference, ``data_ptr()``,
        ``_version``)."""
        return tuple((weakref.ref(w), w.data_ptr(), w._version) for w in weights)

    def check(self, owner: str, key: tuple, weights: Sequence[torch.Tensor],
              names: Sequence[str]) -> None:
        """Raise ``RuntimeError`` when this entry cannot stand for ``weights`` (see the module
        docstring); ``owner`` and ``names`` (the weights' attribute names) go in the message."""
        fix = ("pass is_first_microbatch=True on the first micro-batch after each weight "
               "update")
        if key != self.key:
            raise RuntimeError(
                f"{owner}: is_first_microbatch=False, but the recipe or the weights' shapes, "
                f"dtypes or devices differ from the is_first_microbatch=True call (cached "
                f"{self.key}, now {key}): {fix}")
        for name, (ref, ptr, version), w in zip(names, self.versions, weights):
            if ref() is not w:
                why = ("is another tensor object (a new Parameter, load_state_dict(assign="
                       "True), a computed or functional_call weight)")
            elif w.data_ptr() != ptr:
                why = "moved to other memory (.data assigned, .to(...))"
            elif w._version != version:
                why = (f"was written in place (version {version} -> {w._version}: an optimizer "
                       "step, copy_, load_state_dict)")
            else:
                continue
            raise RuntimeError(
                f"{owner}: is_first_microbatch=False, but its {name} {why} since the "
                f"is_first_microbatch=True call: {fix}")
