"""A fusion as a fused-op file: the forward of Bias -> Bias into one buffer (the docs' example).

In te_ops it would be ``te_ops/fused/bias_pair.py`` ending in
``register_forward_fusion(fuse_bias_pair_forward, name="bias_pair_forward")`` and imported by
one line of ``te_ops/fused/__init__.py``; here tests/test_extension_examples.py registers it
for its tests only (other tests' Bias -> Bias blocks stay unfused).
"""

from __future__ import annotations

import te_ops
from te_ops.fuser import match_window
from te_ops.op import FusedOperation

BIAS_PAIR = [("the first Bias", te_ops.Bias), ("the second Bias", te_ops.Bias)]


class ForwardBiasPair(FusedOperation):
    """Forward of Bias -> Bias: ``(x + b1) + b2``, the unfused order (``x + (b1 + b2)`` rounds
    differently), the second add in place; the unfused Bias backward pairs with it."""

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, recipe=None):
        first, second = self.basic_ops
        out = first.op_forward(None, input_)  # checks the input as the unfused op does
        return out.add_(second.bias.to(out.dtype)), [(), ()]


def fuse_bias_pair_forward(ops, *, recipe=None, info):
    """Replace each Bias -> Bias window of ``ops`` with :class:`ForwardBiasPair`."""
    out, i = [], 0
    while i < len(ops):
        window, reason = match_window(ops, i, BIAS_PAIR)
        if window is not None and window[0].size == window[1].size:
            out.append(ForwardBiasPair(window))
            i += 2
            continue
        if reason is not None:
            info.note(f"op {info.index(ops[i])}: {reason}")
        out.append(ops[i])
        i += 1
    return out
