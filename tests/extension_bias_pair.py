"""A fusion: Bias -> Bias forward in one buffer. In te_ops: te_ops/fused/bias_pair.py, ending
in ``register_forward_fusion(fuse_bias_pair_forward, name="bias_pair_forward")``."""

import te_ops
from te_ops.fuser import match_window
from te_ops.op import FusedOperation

BIAS_PAIR = [("the first Bias", te_ops.Bias), ("the second Bias", te_ops.Bias)]


class ForwardBiasPair(FusedOperation):
    """``(x + b1) + b2``, the unfused order; the unfused Bias backward pairs with it."""

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, recipe=None):
        first, second = self.basic_ops
        out = first.op_forward(None, input_)  # checks the input as the unfused op does
        return out.add_(second.bias.to(out.dtype)), [(), ()]


def fuse_bias_pair_forward(ops, *, recipe=None, info):
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
