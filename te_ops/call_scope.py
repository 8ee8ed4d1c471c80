"""One fuser forward call as a scope, for host caches that hold only during that call.

Some per-step host work only needs doing once per call: e.g. a
:class:`~te_ops.basic.GroupedLinear` checks that its parameter dict still holds the same
Parameter objects (64-128 ids with per-expert weights) before it uses its cached parameter
lists, at several uses per call (check_input, fprop operands, saved layout...).
Inside one forward call nothing can swap a parameter between those uses (module hooks run
outside it; an op with hooks runs in a fuser call of its own), so the first check of the call
is remembered for the rest of it.

:func:`open_call_scope` / :func:`close_call_scope` bracket the fuser's forward walk
(``te_ops.fuser._forward_ops``); :func:`current_call` is a fresh object per scope (``None``
outside one), which a cache stores and compares by identity. The scope is a
``contextvars.ContextVar``: threads and async tasks each see their own.
"""

from __future__ import annotations

import contextvars

__all__ = ["open_call_scope", "close_call_scope", "current_call"]

_CALL: contextvars.ContextVar[object | None] = contextvars.ContextVar("te_ops_fuser_call",
                                                                    default=None)


def open_call_scope() -> contextvars.Token:
    """Start a call scope (a new :func:`current_call` object); pass the token to
    :func:`close_call_scope` in a ``finally``."""
    return _CALL.set(object())


def close_call_scope(token: contextvars.Token) -> None:
    """End the scope opened by :func:`open_call_scope` (the previous one, if any, is back)."""
    _CALL.reset(token)


def current_call() -> object | None:
    """The object standing for the running fuser forward call, ``None`` outside one."""
    return _CALL.get()
