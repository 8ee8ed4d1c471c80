"""Quantized weights kept across the micro-batches of one optimizer step.

With gradient accumulation the weights do not change between the micro-batches of a step, yet
every forward quantizes them again for fprop (row-wise) and every backward for dgrad
(column-wise). On fine-grained experts the weights outweigh the tokens (E128 H2048 FF768: 402M
weight elements against 134M input elements at 65,536 routed rows), and those passes are about
a quarter of an FP8 step's GPU time (docs/performance.md, "FP8 recipes").

The caller says when the weights are fresh, as TransformerEngine's modules take it
(``is_first_microbatch`` of ``te.pytorch.Linear`` / ``GroupedLinear``; Megatron-Core passes it
per micro-batch): ``te_ops.Sequential(...)(x, *extra, is_first_microbatch=...)`` (and
``te_ops.MoE``, and a basic op called alone):

* ``None`` (default): nothing is cached; each call quantizes the weights (and the cache an op
  holds is left as it is).
* ``True``: the call quantizes the weights and keeps the copies in the op (fprop's row-wise copy
  now, dgrad's column-wise copy when this micro-batch's backward makes it).
* ``False``: the call reads the copies the last ``True`` call made. The caller promises the
  weights are the ones of that call. What can be checked is: the cache exists, the recipe
  and the weights' shapes, dtypes and devices are the same, and a weight whose memory is the
  same was not written in place since (its ``_version``: an optimizer step or ``copy_``
  writes it). A failed check raises ``RuntimeError`` saying which; a write through ``.data``
  cannot be seen (TransformerEngine checks nothing). Where a framework writes the weights into
  the same memory every micro-batch (a re-gather), the check raises: leave the flag ``None``.

Without a recipe the flag changes nothing (there is nothing to quantize). It is an eager
feature: under ``torch.compile`` or while tracing a non-``None`` flag raises (the cache is host
state the compiled graph cannot hold). The copies live until the op's next ``True`` call or
until the op is freed: about the weights' own bytes (FP8 row-wise + column-wise, with scales).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..tracing import tracing

__all__ = ["WeightCacheEntry", "check_first_microbatch", "first_microbatch",
           "first_microbatch_scope", "weight_cache_key"]

_FLAG: contextvars.ContextVar[bool | None] = contextvars.ContextVar("te_ops_first_microbatch",
                                                                   default=None)


def check_first_microbatch(value: Any) -> None:
    """Raise ``TypeError`` unless ``value`` is ``None`` or a bool, and ``NotImplementedError``
    for a bool under ``torch.compile`` (see the module docstring)."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"is_first_microbatch must be None, True or False, got "
                        f"{type(value).__name__} ({value!r})")
    if value is not None and torch.compiler.is_compiling():
        raise NotImplementedError(
            "is_first_microbatch is an eager feature: the quantized weight cache is host state "
            "a compiled graph cannot keep; under torch.compile leave it None (each call "
            "quantizes the weights)")


@contextmanager
def first_microbatch_scope(value: bool | None) -> Iterator[None]:
    """Make ``value`` the flag of the te_ops ops run inside (``None`` keeps an enclosing
    call's flag: a fuser's op called through its own module inside a container's call)."""
    check_first_microbatch(value)
    if value is None:
        yield
        return
    token = _FLAG.set(value)
    try:
        yield
    finally:
        _FLAG.reset(token)


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
    versions : tuple[tuple[int, int], ...]
        Each weight's ``(data_ptr(), _version)`` at that call.
    rowwise : Any
        fprop's row-wise operand (a ``QuantizedTensorStorage``; ``None`` when the recipe keeps
        fprop in high precision: then nothing is kept for it).
    columnwise : Any
        dgrad's column-wise operand, set by the first backward that makes it (``None`` until
        then, or when dgrad stays in high precision).
    """

    key: tuple
    versions: tuple[tuple[int, int], ...]
    rowwise: Any = None
    columnwise: Any = None

    @staticmethod
    def versions_of(weights: Sequence[torch.Tensor]) -> tuple[tuple[int, int], ...]:
        return tuple((w.data_ptr(), w._version) for w in weights)

    def check(self, owner: str, key: tuple, weights: Sequence[torch.Tensor]) -> None:
        """Raise ``RuntimeError`` when this entry cannot stand for ``weights`` (see the module
        docstring); ``owner`` names the op in the message."""
        if key != self.key:
            raise RuntimeError(
                f"{owner}: is_first_microbatch=False, but the recipe or the weights' shapes, "
                f"dtypes or devices differ from the is_first_microbatch=True call (cached "
                f"{self.key}, now {key}): pass is_first_microbatch=True")
        for i, ((ptr, version), w) in enumerate(zip(self.versions, weights)):
            if w.data_ptr() == ptr and w._version != version:
                raise RuntimeError(
                    f"{owner}: is_first_microbatch=False, but weight {i} was written in place "
                    f"since the is_first_microbatch=True call (version {version} -> "
                    f"{w._version}, e.g. an optimizer step): pass is_first_microbatch=True on "
                    "the first micro-batch after each weight update")
