"""A GEMM backend, one torch.mm per group: te_ops/gemm/backends/loop_mm.py would end in
``register_kernel("loop_mm", **REGISTRATION)`` (from te_ops.gemm.registry)."""


def _groups(splits):
    start = 0
    for g, m in enumerate(splits.sizes_on_host()):
        yield g, slice(start, start + m)
        start += m


def loop_mm_fprop(x, weights, splits):  # x (M, K), weights (G, N, K) -> (M, N)
    out = x.new_zeros(x.shape[0], weights.shape[1])  # padding rows stay zero
    for g, rows in _groups(splits):
        out[rows] = x[rows] @ weights[g].t()
    return out


def loop_mm_dgrad(dy, weights, splits):  # dy (M, N), weights (G, N, K) -> (M, K)
    out = dy.new_zeros(dy.shape[0], weights.shape[2])
    for g, rows in _groups(splits):
        out[rows] = dy[rows] @ weights[g]
    return out


def loop_mm_wgrad(x, dy, splits):  # x (M, K), dy (M, N) -> (G, N, K)
    out = x.new_zeros(splits.num_groups, dy.shape[1], x.shape[1])  # empty groups: zero
    for g, rows in _groups(splits):
        out[g] = dy[rows].t() @ x[rows]
    return out


def unavailable_reason(device, dtype, in_features, out_features):
    return "loop_mm reads the split sizes: not on meta" if device.type == "meta" else None


REGISTRATION = dict(fprop=loop_mm_fprop, dgrad=loop_mm_dgrad, wgrad=loop_mm_wgrad,
                    unavailable_reason=unavailable_reason, description="one torch.mm per group")
