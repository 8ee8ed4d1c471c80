"""Every basic op, and the GroupedLinear -> ScaledSwiGLU -> GroupedLinear block, against the
independent float64 reference in ``reference.py``: outputs and the gradients of the input,
every ``weight{g}`` / ``bias{g}`` and ``probs``; plus float64 ``gradcheck``."""

from __future__ import annotations

import math

import pytest
import reference as ref
import torch
from reference import assert_close, leaf, split_arg

import te_ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BACKENDS = ["loop", "grouped_mm"]
KINDS = ["list", "tensor"]

CASES = ref.EDGE_CASES

K, N = 16, 32  # in/out features: 16-byte aligned for fp32/bf16/fp16 (grouped_mm can run)


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _probs(rows: int, device, dtype) -> torch.Tensor:
    return (torch.rand(rows, device=device) + 0.5).to(dtype).requires_grad_()


def _grouped_linear_leaves(lin: te_ops.GroupedLinear, **inputs: torch.Tensor | None):
    leaves = {k: leaf(v) for k, v in inputs.items() if v is not None}
    leaves.update({name: leaf(p) for name, p in lin.named_parameters()})
    return leaves


def _ref_grouped_linear(lin: te_ops.GroupedLinear, sizes, prefix: str = ""):
    """A reference closure over the leaves of one GroupedLinear (either layout)."""
    def fn(t):
        weights = ref.expert_params(t, prefix, "weight", lin.num_groups)
        biases = ref.expert_params(t, prefix, "bias", lin.num_groups)
        return ref.grouped_linear(t["x"], weights, biases, sizes,
                                  t["probs"] if lin.scale_bias else None)
    return fn


def _check_grads(module: torch.nn.Module, grads: dict, dtype: torch.dtype) -> None:
    for name, p in module.named_parameters():
        assert p.grad is not None, f"{name}: no gradient"
        assert p.grad.dtype == p.dtype, f"{name}: grad dtype {p.grad.dtype} != {p.dtype}"
        assert_close(p.grad, grads[name], dtype, f"grad of {name}")


# --------------------------------------------------------------------------- GroupedLinear
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("bias_mode", ["none", "bias", "scale_bias"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_grouped_linear_matches_reference(device, dtype, backend, kind, bias_mode, case,
                                          use_backend):
    groups, rows, sizes = CASES[case]
    use_backend(backend, device, dtype, (K, N))
    lin = te_ops.GroupedLinear(groups, K, N, bias=bias_mode != "none",
                               scale_bias=bias_mode == "scale_bias", device=device, dtype=dtype)
    x = torch.randn(rows, K, device=device, dtype=dtype, requires_grad=True)
    probs = _probs(rows, device, dtype) if bias_mode == "scale_bias" else None
    extra = [split_arg(sizes, kind, device)] + ([probs] if probs is not None else [])

    y = lin(x, *extra)
    dy = torch.randn_like(y)
    y.backward(dy)

    leaves = _grouped_linear_leaves(lin, x=x, probs=probs)
    out, grads = ref.forward_backward(_ref_grouped_linear(lin, sizes), leaves, dy)
    assert y.dtype == dtype and y.shape == (rows, N)
    assert_close(y, out, dtype, "output")
    assert_close(x.grad, grads["x"], dtype, "grad of input")
    _check_grads(lin, grads, dtype)
    if probs is not None:
        assert probs.grad.dtype == probs.dtype
        assert_close(probs.grad, grads["probs"], dtype, "grad of probs")

    used = sum(sizes)
    assert (y[used:] == 0).all(), "padding rows of the output must be zero"
    assert (x.grad[used:] == 0).all(), "padding rows of the input grad must be zero"
    if probs is not None:
        assert (probs.grad[used:] == 0).all(), "padding rows of the probs grad must be zero"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_grouped_linear_fp32_probs_with_low_precision_input(device, dtype, kind):
    """probs may be float32 while the activations are bf16/fp16 (common in MoE routers)."""
    lin = te_ops.GroupedLinear(2, K, N, scale_bias=True, device=device, dtype=dtype)
    sizes = [3, 4]
    x = torch.randn(8, K, device=device, dtype=dtype, requires_grad=True)
    probs = _probs(8, device, torch.float32)
    y = lin(x, split_arg(sizes, kind, device), probs)
    dy = torch.randn_like(y)
    y.backward(dy)
    out, grads = ref.forward_backward(_ref_grouped_linear(lin, sizes),
                                      _grouped_linear_leaves(lin, x=x, probs=probs), dy)
    assert y.dtype == dtype and probs.grad.dtype == torch.float32
    assert_close(y, out, dtype, "output")
    assert_close(probs.grad, grads["probs"], dtype, "grad of probs")
    _check_grads(lin, grads, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_linear_flattens_leading_dims(device, backend, use_backend):
    dtype = torch.float32
    use_backend(backend, device, dtype, (K, N))
    lin = te_ops.GroupedLinear(3, K, N, device=device, dtype=dtype)
    sizes = [2, 5, 1]
    x = torch.randn(2, 5, K, device=device, dtype=dtype, requires_grad=True)
    y = lin(x, split_arg(sizes, "tensor", device))
    assert y.shape == (2, 5, N)
    dy = torch.randn_like(y)
    y.backward(dy)
    out, grads = ref.forward_backward(_ref_grouped_linear(lin, sizes),
                                      _grouped_linear_leaves(lin, x=x), dy)
    assert_close(y, out, dtype, "output")
    assert x.grad.shape == x.shape
    assert_close(x.grad, grads["x"], dtype, "grad of input")
    _check_grads(lin, grads, dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_grouped_linear_nan_in_padding_rows(device, dtype, backend, kind, use_backend):
    """NaN in the input's padding rows never reaches the outputs or any gradient."""
    use_backend(backend, device, dtype, (K, N))
    lin = te_ops.GroupedLinear(3, K, N, scale_bias=True, device=device, dtype=dtype)
    sizes = [3, 0, 4]
    x = torch.randn(10, K, device=device, dtype=dtype)
    x[7:] = float("nan")
    x.requires_grad_()
    probs = _probs(10, device, dtype)
    y = lin(x, split_arg(sizes, kind, device), probs)
    assert torch.isfinite(y).all()
    assert (y[7:] == 0).all()
    dy = torch.randn_like(y)
    y.backward(dy)

    leaves = _grouped_linear_leaves(lin, x=x, probs=probs)
    out, grads = ref.forward_backward(_ref_grouped_linear(lin, sizes), leaves, dy)
    assert_close(y, out, dtype, "output")
    assert_close(x.grad, grads["x"], dtype, "grad of input")
    assert_close(probs.grad, grads["probs"], dtype, "grad of probs")
    _check_grads(lin, grads, dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_linear_padding_values_do_not_matter(device, backend, kind, use_backend):
    """Large values in the padding rows of input, probs and grad output change nothing."""
    dtype = torch.float32
    use_backend(backend, device, dtype, (K, N))
    lin = te_ops.GroupedLinear(3, K, N, scale_bias=True, device=device, dtype=dtype)
    sizes = [2, 4, 1]
    used, rows = sum(sizes), 11

    def run(pad_value: float):
        torch.manual_seed(0)
        x = torch.randn(rows, K, device=device, dtype=dtype)
        probs = torch.rand(rows, device=device, dtype=dtype)
        dy = torch.randn(rows, N, device=device, dtype=dtype)
        x[used:], probs[used:], dy[used:] = pad_value, pad_value, pad_value
        x.requires_grad_()
        probs.requires_grad_()
        lin.zero_grad(set_to_none=True)
        y = lin(x, split_arg(sizes, kind, device), probs)
        y.backward(dy)
        return y, x.grad, probs.grad, [p.grad.clone() for p in lin.parameters()]

    base = run(0.0)
    big = run(1e4)
    assert torch.equal(base[0], big[0])
    assert torch.equal(base[1], big[1])
    assert torch.equal(base[2], big[2])
    for a, b in zip(base[3], big[3]):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- SwiGLU
@pytest.mark.parametrize("shape", [(6, 32), (2, 3, 32)], ids=["2d", "3d"])
@pytest.mark.parametrize("interleave", [None, 1, 4, 8])
@pytest.mark.parametrize("scaled", [False, True], ids=["SwiGLU", "ScaledSwiGLU"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_swiglu_matches_reference(device, dtype, scaled, interleave, shape):
    op_cls = te_ops.ScaledSwiGLU if scaled else te_ops.SwiGLU
    op = op_cls(glu_interleave_size=interleave)
    x = (2 * torch.randn(shape, device=device)).to(dtype).requires_grad_()
    tokens = math.prod(shape[:-1])
    probs = _probs(tokens, device, dtype) if scaled else None
    y = op(x, probs) if scaled else op(x)
    assert y.shape == (*shape[:-1], shape[-1] // 2) and y.dtype == dtype
    dy = torch.randn_like(y)
    y.backward(dy)

    leaves = {"x": leaf(x)}
    if scaled:
        leaves["probs"] = leaf(probs)
        out, grads = ref.forward_backward(
            lambda t: ref.scaled_swiglu(t["x"], t["probs"], interleave), leaves, dy)
        assert probs.grad.shape == (tokens,)
        assert_close(probs.grad, grads["probs"], dtype, "grad of probs")
    else:
        out, grads = ref.forward_backward(lambda t: ref.swiglu(t["x"], interleave), leaves, dy)
    assert_close(y, out, dtype, "output")
    assert_close(x.grad, grads["x"], dtype, "grad of input")


def test_swiglu_gates_the_first_half(device):
    """a = first half, b = second half, out = silu(a) * b (not torch's F.glu convention)."""
    a = torch.tensor([[1.0, -2.0]], device=device)
    b = torch.tensor([[3.0, 0.5]], device=device)
    y = te_ops.SwiGLU()(torch.cat([a, b], -1))
    torch.testing.assert_close(y, torch.nn.functional.silu(a) * b)
    assert not torch.allclose(y, torch.nn.functional.silu(b) * a)


def test_swiglu_interleaved_layout(device):
    """glu_interleave_size=s: blocks of s columns alternate a, b, a, b, ..."""
    s = 2
    a = torch.randn(3, 4, device=device)
    b = torch.randn(3, 4, device=device)
    x = torch.cat([a[:, :2], b[:, :2], a[:, 2:], b[:, 2:]], -1)
    y = te_ops.SwiGLU(glu_interleave_size=s)(x)
    torch.testing.assert_close(y, torch.nn.functional.silu(a) * b)


# --------------------------------------------------------------------------- Bias, Identity
@pytest.mark.parametrize("shape", [(5, 8), (2, 3, 8), (0, 8)], ids=["2d", "3d", "empty"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_bias_matches_reference(device, dtype, shape):
    op = te_ops.Bias(8, device=device, dtype=dtype)
    assert (op.bias == 0).all()
    with torch.no_grad():
        op.bias.copy_(torch.randn(8))
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    y = op(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    out, grads = ref.forward_backward(lambda t: ref.bias(t["x"], t["bias"]),
                                      {"x": leaf(x), "bias": leaf(op.bias)}, dy)
    assert y.dtype == dtype
    assert_close(y, out, dtype, "output")
    assert_close(x.grad, grads["x"], dtype, "grad of input")
    assert_close(op.bias.grad, grads["bias"], dtype, "grad of bias")


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_identity(device, dtype):
    x = torch.randn(4, 6, device=device, dtype=dtype, requires_grad=True)
    y = te_ops.Identity()(x)
    assert torch.equal(y, x) and y.dtype == dtype
    dy = torch.randn_like(y)
    y.backward(dy)
    assert torch.equal(x.grad, dy)


# --------------------------------------------------------------------------- the MoE block
F_HIDDEN = N // 2  # fc1: K -> 2F, SwiGLU: 2F -> F, fc2: F -> K


def _block(groups, device, dtype, *, bias=True, fc2_scale_bias=False, interleave=None):
    return te_ops.Sequential(
        te_ops.GroupedLinear(groups, K, 2 * F_HIDDEN, bias=bias, device=device, dtype=dtype),
        te_ops.ScaledSwiGLU(glu_interleave_size=interleave),
        te_ops.GroupedLinear(groups, F_HIDDEN, K, bias=bias, scale_bias=fc2_scale_bias,
                             device=device, dtype=dtype),
    )


def _run_block_and_reference(block, x, sizes, ss, probs, *, interleave=None):
    fc1, _, fc2 = block
    extra = [ss, probs, ss] + ([probs] if fc2.scale_bias else [])
    y = block(x, *extra)
    dy = torch.randn_like(y)
    y.backward(dy)

    leaves = {"x": leaf(x), "probs": leaf(probs)}
    leaves.update({name: leaf(p) for name, p in block.named_parameters()})

    def fn(t):
        g = fc1.num_groups
        return ref.grouped_mlp(
            t["x"], sizes, t["probs"],
            ref.expert_params(t, "0.", "weight", g),
            ref.expert_params(t, "0.", "bias", g),
            ref.expert_params(t, "2.", "weight", g),
            ref.expert_params(t, "2.", "bias", g),
            interleave=interleave, fc2_probs=t["probs"] if fc2.scale_bias else None,
        )

    out, grads = ref.forward_backward(fn, leaves, dy)
    return y, out, grads


def _check_block(block, x, probs, y, out, grads, dtype, used):
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, out, dtype, "output")
    assert_close(x.grad, grads["x"], dtype, "grad of input")
    assert_close(probs.grad, grads["probs"], dtype, "grad of probs")
    _check_grads(block, grads, dtype)
    assert (y[used:] == 0).all()
    assert (x.grad[used:] == 0).all()
    assert (probs.grad[used:] == 0).all()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fusion", ["0", "1"], ids=["unfused", "fused"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_grouped_mlp_block_matches_reference(device, dtype, backend, kind, fusion, case,
                                             use_backend, monkeypatch):
    groups, rows, sizes = CASES[case]
    use_backend(backend, device, dtype, (K, 2 * F_HIDDEN), (F_HIDDEN, K))
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = _block(groups, device, dtype)
    x = torch.randn(rows, K, device=device, dtype=dtype, requires_grad=True)
    probs = _probs(rows, device, dtype)
    y, out, grads = _run_block_and_reference(block, x, sizes, split_arg(sizes, kind, device),
                                             probs)
    _check_block(block, x, probs, y, out, grads, dtype, sum(sizes))


@pytest.mark.parametrize("interleave", [None, 4])
@pytest.mark.parametrize("variant", ["no_bias", "fc2_scale_bias"])
@pytest.mark.parametrize("fusion", ["0", "1"], ids=["unfused", "fused"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_grouped_mlp_block_variants(device, dtype, backend, fusion, variant, interleave,
                                    use_backend, monkeypatch):
    use_backend(backend, device, dtype, (K, 2 * F_HIDDEN), (F_HIDDEN, K))
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    groups, rows, sizes = CASES["padding"]
    block = _block(groups, device, dtype, bias=variant != "no_bias",
                   fc2_scale_bias=variant == "fc2_scale_bias", interleave=interleave)
    x = torch.randn(rows, K, device=device, dtype=dtype, requires_grad=True)
    probs = _probs(rows, device, dtype)
    y, out, grads = _run_block_and_reference(block, x, sizes, split_arg(sizes, "tensor", device),
                                             probs, interleave=interleave)
    _check_block(block, x, probs, y, out, grads, dtype, sum(sizes))


@pytest.mark.parametrize("fusion", ["0", "1"], ids=["unfused", "fused"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_mlp_block_nan_in_padding_rows(device, backend, kind, fusion, use_backend,
                                               monkeypatch):
    dtype = torch.float32
    use_backend(backend, device, dtype, (K, 2 * F_HIDDEN), (F_HIDDEN, K))
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    groups, rows, sizes = CASES["padding"]
    used = sum(sizes)
    block = _block(groups, device, dtype)
    x = torch.randn(rows, K, device=device, dtype=dtype)
    x[used:] = float("nan")
    x.requires_grad_()
    probs = _probs(rows, device, dtype)
    y, out, grads = _run_block_and_reference(block, x, sizes, split_arg(sizes, kind, device),
                                             probs)
    _check_block(block, x, probs, y, out, grads, dtype, used)


def test_grouped_mlp_block_without_input_grad(device):
    """Only parameters need grad: the input gets none, parameter grads are still right."""
    dtype = torch.float32
    groups, rows, sizes = CASES["padding"]
    block = _block(groups, device, dtype)
    x = torch.randn(rows, K, device=device, dtype=dtype)
    probs = _probs(rows, device, dtype).detach()
    ss = split_arg(sizes, "tensor", device)
    y = block(x, ss, probs, ss)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert x.grad is None and probs.grad is None
    out, grads = ref.block_forward_backward(block, groups, sizes, x, probs, dy)
    assert_close(y, out, dtype, "output")
    _check_grads(block, grads, dtype)


def test_no_grad_forward_matches(device):
    dtype = torch.float32
    groups, rows, sizes = CASES["padding"]
    block = _block(groups, device, dtype)
    x = torch.randn(rows, K, device=device, dtype=dtype)
    probs = _probs(rows, device, dtype).detach()
    ss = split_arg(sizes, "list", device)
    with torch.no_grad():
        y0 = block(x, ss, probs, ss)
    y1 = block(x.requires_grad_(), ss, probs, ss)
    assert not y0.requires_grad and y1.requires_grad
    assert torch.equal(y0, y1.detach())


# --------------------------------------------------------------------------- gradcheck (fp64)
def _gradcheck(module: torch.nn.Module, inputs: dict[str, torch.Tensor], make_args) -> None:
    """gradcheck over the differentiable inputs *and* every parameter of ``module``."""
    param_names = [n for n, _ in module.named_parameters()]
    params = [p.detach().clone().requires_grad_() for _, p in module.named_parameters()]
    input_names = list(inputs)

    def fn(*tensors):
        named = dict(zip(input_names, tensors[:len(input_names)]))
        state = dict(zip(param_names, tensors[len(input_names):]))
        return torch.func.functional_call(module, state, make_args(named))

    assert torch.autograd.gradcheck(fn, (*inputs.values(), *params), eps=1e-6, atol=1e-7,
                                    rtol=1e-5)


GC_GROUPS, GC_ROWS, GC_SIZES = 3, 8, [3, 0, 4]  # one zero-token group, one padding row


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias_mode", ["none", "bias", "scale_bias"])
@pytest.mark.parametrize("backend", ["auto", "loop", "grouped_mm"])
def test_gradcheck_grouped_linear(device, backend, bias_mode, kind, use_backend):
    dtype = torch.float64
    k, n = 4, 6
    if backend != "auto":
        use_backend(backend, device, dtype, (k, n))
    lin = te_ops.GroupedLinear(GC_GROUPS, k, n, bias=bias_mode != "none",
                               scale_bias=bias_mode == "scale_bias", device=device, dtype=dtype)
    ss = split_arg(GC_SIZES, kind, device)
    inputs = {"x": torch.randn(GC_ROWS, k, device=device, dtype=dtype, requires_grad=True)}
    if bias_mode == "scale_bias":
        inputs["probs"] = _probs(GC_ROWS, device, dtype)
        _gradcheck(lin, inputs, lambda t: (t["x"], ss, t["probs"]))
    else:
        _gradcheck(lin, inputs, lambda t: (t["x"], ss))


@pytest.mark.parametrize("interleave", [None, 2])
def test_gradcheck_scaled_swiglu(device, interleave):
    dtype = torch.float64
    op = te_ops.ScaledSwiGLU(glu_interleave_size=interleave)
    inputs = {"x": torch.randn(5, 8, device=device, dtype=dtype, requires_grad=True),
              "probs": _probs(5, device, dtype)}
    _gradcheck(op, inputs, lambda t: (t["x"], t["probs"]))


@pytest.mark.parametrize("fusion", ["0", "1"], ids=["unfused", "fused"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ["auto", "loop", "grouped_mm"])
def test_gradcheck_grouped_mlp_block(device, backend, kind, fusion, use_backend, monkeypatch):
    dtype = torch.float64
    k, f = 4, 4
    if backend != "auto":
        use_backend(backend, device, dtype, (k, 2 * f), (f, k))
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    block = te_ops.Sequential(
        te_ops.GroupedLinear(GC_GROUPS, k, 2 * f, device=device, dtype=dtype),
        te_ops.ScaledSwiGLU(),
        te_ops.GroupedLinear(GC_GROUPS, f, k, scale_bias=True, device=device, dtype=dtype),
    )
    ss = split_arg(GC_SIZES, kind, device)
    inputs = {"x": torch.randn(GC_ROWS, k, device=device, dtype=dtype, requires_grad=True),
              "probs": _probs(GC_ROWS, device, dtype)}
    _gradcheck(block, inputs, lambda t: (t["x"], ss, t["probs"], ss, t["probs"]))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fusion", ["0", "1"], ids=["unfused", "fused"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sum_backward_expanded_grad(device, backend, kind, fusion, case, use_backend,
                                    monkeypatch):
    """``y.sum().backward()`` hands the ops a zero-stride grad (for an empty batch too)."""
    dtype = torch.float32
    use_backend(backend, device, dtype, (K, 2 * F_HIDDEN), (F_HIDDEN, K))
    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    groups, rows, sizes = CASES[case]
    block = _block(groups, device, dtype, fc2_scale_bias=True)
    x = torch.randn(rows, K, device=device, dtype=dtype, requires_grad=True)
    probs = _probs(rows, device, dtype)
    ss = split_arg(sizes, kind, device)
    y = block(x, ss, probs, ss, probs)
    y.sum().backward()

    leaves = {"x": leaf(x), "probs": leaf(probs)}
    leaves.update({name: leaf(p) for name, p in block.named_parameters()})

    def fn(t):
        return ref.grouped_mlp(t["x"], sizes, t["probs"],
                               ref.expert_params(t, "0.", "weight", groups),
                               ref.expert_params(t, "0.", "bias", groups),
                               ref.expert_params(t, "2.", "weight", groups),
                               ref.expert_params(t, "2.", "bias", groups),
                               fc2_probs=t["probs"])

    out, grads = ref.forward_backward(fn, leaves, torch.ones_like(y))
    _check_block(block, x, probs, y, out, grads, dtype, sum(sizes))


@pytest.mark.parametrize("kind", KINDS)
def test_grouped_linear_nan_probs_in_padding_rows(device, kind):
    lin = te_ops.GroupedLinear(3, K, N, scale_bias=True, device=device)
    x = torch.randn(10, K, device=device, requires_grad=True)
    probs = torch.rand(10, device=device)
    probs[8:] = float("nan")
    probs.requires_grad_()
    y = lin(x, split_arg([3, 0, 5], kind, device), probs)
    y.backward(torch.randn_like(y))
    assert (y[8:] == 0).all()
    assert all(torch.isfinite(p.grad).all() for p in lin.parameters())
    assert (probs.grad[8:] == 0).all()
