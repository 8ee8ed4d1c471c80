"""A GEMM backend as a kernel file: one torch.mm per group (the docs' example backend).

In te_ops it would be ``te_ops/gemm/backends/loop_mm.py`` ending in the ``register_kernel``
call below; here tests/test_extension_examples.py registers it for its tests only.
"""

from __future__ import annotations

import torch


def _groups(splits):
    start = 0
    for g, m in enumerate(splits.sizes_on_host()):
        yield g, slice(start, start + m)
        start += m


def loop_mm_fprop(x, weights, splits):
    """y_g = x_g @ W_g^T: x (M, K), weights (G, N, K) -> (M, N); padding rows zero."""
    out = x.new_zeros(x.shape[0], weights.shape[1])
    for g, rows in _groups(splits):
        out[rows] = x[rows] @ weights[g].t()
    return out


def loop_mm_dgrad(dy, weights, splits):
    """dx_g = dy_g @ W_g: dy (M, N), weights (G, N, K) -> (M, K); padding rows zero."""
    out = dy.new_zeros(dy.shape[0], weights.shape[2])
    for g, rows in _groups(splits):
        out[rows] = dy[rows] @ weights[g]
    return out


def loop_mm_wgrad(x, dy, splits):
    """dW_g = dy_g^T @ x_g: x (M, K), dy (M, N) -> (G, N, K); zero for empty groups."""
    out = x.new_zeros(splits.num_groups, dy.shape[1], x.shape[1])
    for g, rows in _groups(splits):
        out[g] = dy[rows].t() @ x[rows]
    return out


def unavailable_reason(device, dtype, in_features, out_features):
    """Why loop_mm cannot run here (None: it can): it reads the split sizes on the host."""
    return "loop_mm needs real tensors, not meta ones" if device.type == "meta" else None


REGISTRATION = dict(fprop=loop_mm_fprop, dgrad=loop_mm_dgrad, wgrad=loop_mm_wgrad,
                    unavailable_reason=unavailable_reason, description="one torch.mm per group")
# in te_ops/gemm/backends/loop_mm.py:  register_kernel("loop_mm", **REGISTRATION)
