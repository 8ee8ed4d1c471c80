"""Where a refused second-order gradient hangs in the autograd graph.

A te_ops backward run under ``create_graph=True`` returns the first-order gradients marked with
a node that raises when differentiated (``te_ops.fuser._refuse_double_backward``, after
``torch.autograd.function.once_differentiable``). That node must have graph edges to the
forward's inputs: without them, ``torch.autograd.grad(dx.sum(), x)`` finds ``x`` unreachable,
so it raises torch's misleading "appears to not have been used in the graph" and, with
``allow_unused=True`` (as ``torch.autograd.functional.hessian`` / ``hvp`` / ``vhp`` pass), returns
``None``, which those functions turn into a silently all-zero Hessian.

The anchors are tensors that carry those edges, found in backward at no cost to the forward:
the leaves behind the node's input edges (parameters, leaf inputs: ``AccumulateGrad.variable``)
and the saved tensors that require grad (a non-leaf input the forward saved, e.g. fc1's input
for its wgrad). A non-leaf input the forward did not save (fc1 with frozen weights, or a
non-contiguous view, of which a contiguous copy is saved) stays unreachable: a gradient with
respect to it gets torch's "not used" error, or ``None`` with ``allow_unused=True``. Anchoring
it would take a graph-connected stand-in made in every forward (host time on every step) or
keeping the input alive until backward (memory), for a use te_ops does not support anyway.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["graph_anchors"]


def graph_anchors(ctx: Any) -> list[torch.Tensor]:
    """Tensors whose autograd edges lead to the inputs of the node ``ctx`` (a custom
    ``torch.autograd.Function``'s backward context, inside its ``backward``, before the
    backward's own work: a backward that bumps a saved tensor's version in place makes the
    saved tensors unpack no more).

    Returns
    -------
    list[torch.Tensor]
        Distinct tensors that require grad: the leaf variables of ``ctx.next_functions`` and
        the saved tensors that require grad. Empty when there are none.
    """
    anchors: list[torch.Tensor] = []
    seen: set[int] = set()

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in seen:
            seen.add(id(t))
            anchors.append(t)

    for node, _ in getattr(ctx, "next_functions", ()):
        add(getattr(node, "variable", None))  # AccumulateGrad's leaf
    for t in ctx.saved_tensors:
        add(t)
    return anchors
