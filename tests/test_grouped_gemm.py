"""Grouped GEMM kernels and their dispatch: both backends against the reference, list vs
tensor split sizes bit-identical, backend selection and its reasons, weight stacking."""

from __future__ import annotations

import pytest
import reference as ref
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import assert_close, split_arg

import te_ops
from te_ops.gemm.dispatch import (
    grouped_dgrad,
    grouped_fprop,
    grouped_mm_unsupported_reason,
    grouped_wgrad,
    select_backend,
    stack_weights,
)
from te_ops.splits import make_splits

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BACKENDS = ["loop", "grouped_mm"]
K, N = 16, 32

CASES = {**ref.EDGE_CASES, "all_padding": (2, 4, [0, 0])}


def _dtype_id(dtype):
    return str(dtype).replace("torch.", "")


def _kernels(x, w, dy, sizes, kind, backend_name, device):
    splits = make_splits(split_arg(sizes, kind, device), w.shape[0], x.shape[0], x.device)
    backend = select_backend(x.device, x.dtype, w.shape[2], w.shape[1],
                             device_split_sizes=splits.on_device)
    assert backend.name == backend_name
    return (grouped_fprop(x, w, splits, backend), grouped_dgrad(dy, w, splits, backend),
            grouped_wgrad(x, dy, splits, backend))


def _reference_kernels(x, w, dy, sizes):
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    y = ref.grouped_linear(x64, list(w64), None, sizes)
    dx = torch.zeros_like(x64)
    dw = torch.zeros_like(w64)
    start = 0
    for g, m in enumerate(sizes):
        dx[start:start + m] = dy64[start:start + m] @ w64[g]
        dw[g] = dy64[start:start + m].t() @ x64[start:start + m]
        start += m
    return y, dx, dw


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["list", "tensor"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_kernels_match_reference(device, dtype, backend, kind, case, use_backend):
    use_backend(backend, device, dtype, (K, N))
    groups, rows, sizes = CASES[case]
    x = torch.randn(rows, K, device=device, dtype=dtype)
    w = torch.randn(groups, N, K, device=device, dtype=dtype)
    dy = torch.randn(rows, N, device=device, dtype=dtype)
    y, dx, dw = _kernels(x, w, dy, sizes, kind, backend, device)
    ry, rdx, rdw = _reference_kernels(x, w, dy, sizes)
    assert y.dtype == dx.dtype == dw.dtype == dtype
    assert_close(y, ry, dtype, "fprop")
    assert_close(dx, rdx, dtype, "dgrad")
    for g in range(groups):
        assert_close(dw[g], rdw[g], dtype, f"wgrad[{g}]")
        if sizes[g] == 0:
            assert (dw[g] == 0).all(), "an empty group's weight grad must be exactly zero"
    used = sum(sizes)
    assert (y[used:] == 0).all() and (dx[used:] == 0).all()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_list_and_tensor_split_sizes_identical(device, dtype, backend, case, use_backend):
    """Host-list and device-tensor split sizes give bit-identical outputs and gradients."""
    use_backend(backend, device, dtype, (K, N))
    groups, rows, sizes = CASES[case]
    lin = te_ops.GroupedLinear(groups, K, N, scale_bias=True, device=device, dtype=dtype)
    x0 = torch.randn(rows, K, device=device, dtype=dtype)
    p0 = torch.rand(rows, device=device, dtype=dtype)
    dy = torch.randn(rows, N, device=device, dtype=dtype)

    def run(kind):
        lin.zero_grad(set_to_none=True)
        x, p = x0.clone().requires_grad_(), p0.clone().requires_grad_()
        y = lin(x, split_arg(sizes, kind, device), p)
        y.backward(dy)
        return [y, x.grad, p.grad] + [q.grad for q in lin.parameters()]

    for a, b in zip(run("list"), run("tensor")):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_backends_agree(device, dtype, monkeypatch):
    """loop and grouped_mm agree within the dtype's tolerance (on a block with padding)."""
    if grouped_mm_unsupported_reason(device, dtype, K, N) is not None:
        pytest.skip(grouped_mm_unsupported_reason(device, dtype, K, N))
    groups, rows, sizes = CASES["padding"]
    lin = te_ops.GroupedLinear(groups, K, N, device=device, dtype=dtype)
    x0 = torch.randn(rows, K, device=device, dtype=dtype)
    dy = torch.randn(rows, N, device=device, dtype=dtype)
    results = {}
    for backend in BACKENDS:
        monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", backend)
        lin.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        y = lin(x, split_arg(sizes, "tensor", device))
        y.backward(dy)
        results[backend] = [y, x.grad] + [p.grad for p in lin.parameters()]
    for a, b in zip(results["loop"], results["grouped_mm"]):
        assert_close(b, a.double(), dtype, "grouped_mm vs loop")


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 5), min_size=1, max_size=5),
       padding=st.integers(0, 3), kind=st.sampled_from(["list", "tensor"]),
       backend=st.sampled_from(BACKENDS))
def test_random_split_sizes_property(monkeypatch, sizes, padding, kind, backend):
    """Random split sizes (zeros, one group, padding) on CPU, fp32: reference match."""
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", backend)
    groups, rows = len(sizes), sum(sizes) + padding
    torch.manual_seed(0)
    lin = te_ops.GroupedLinear(groups, 4, 8, scale_bias=True)
    x = torch.randn(rows, 4, requires_grad=True)
    probs = torch.rand(rows, requires_grad=True)
    y = lin(x, split_arg(sizes, kind, "cpu"), probs)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref.assert_module_matches_reference(
        lin, lambda t: ref.grouped_linear(t["x"], ref.expert_params(t, "", "weight", groups),
                                          ref.expert_params(t, "", "bias", groups), sizes,
                                          t["probs"]),
        x, probs, y, dy, torch.float32)


# --------------------------------------------------------------------------- dispatch
def test_select_backend_auto(device):
    fp32 = torch.float32
    aligned = select_backend(device, fp32, 16, 32, device_split_sizes=True)
    reason = grouped_mm_unsupported_reason(device, fp32, 16, 32)
    if reason is None:
        assert aligned.name == "grouped_mm"
    else:
        assert aligned.name == "loop" and aligned.reason == reason
    misaligned = select_backend(device, fp32, 3, 32, device_split_sizes=True)
    assert misaligned.name == "loop" and not misaligned.graph_safe
    assert "in_features=3 x 4 bytes is not a multiple of 16 bytes" in misaligned.reason
    out_misaligned = select_backend(device, torch.bfloat16, 16, 12, device_split_sizes=False)
    assert out_misaligned.name == "loop"
    assert "out_features=12 x 2 bytes" in out_misaligned.reason


def test_select_backend_float64_on_cpu():
    reason = grouped_mm_unsupported_reason(torch.device("cpu"), torch.float64, 16, 16)
    choice = select_backend(torch.device("cpu"), torch.float64, 16, 16, device_split_sizes=True)
    if reason is None:
        assert choice.name == "grouped_mm"
    else:
        assert choice.name == "loop" and "float64" in choice.reason


def test_select_backend_forced_and_graph_safe_toggles(device, monkeypatch):
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "loop")
    choice = select_backend(device, torch.float32, 16, 32, device_split_sizes=True)
    assert choice.name == "loop" and "forced" in choice.reason and not choice.graph_safe
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "auto")
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "0")
    choice = select_backend(device, torch.float32, 16, 32, device_split_sizes=True)
    assert choice.name == "loop" and "TE_OPS_GRAPH_SAFE=0" in choice.reason
    host = select_backend(device, torch.float32, 16, 32, device_split_sizes=False)
    assert not host.graph_safe


@pytest.mark.parametrize("device_sizes", [True, False])
def test_graph_safe_0_with_forced_grouped_mm_raises(monkeypatch, device_sizes: bool):
    """TE_OPS_GRAPH_SAFE=0 with TE_OPS_GROUPED_GEMM_BACKEND=grouped_mm and device split sizes
    would run grouped_mm on the device offsets (graph-safe: make_graphed_callable would accept
    it), against "0 forbids it": the conflict raises naming both variables. Host lists are
    not graph-safe anyway and run. Values checked against the per-expert F.linear loop."""
    cpu = torch.device("cpu")
    if grouped_mm_unsupported_reason(cpu, torch.float32, 16, 32) is not None:
        pytest.skip("grouped_mm does not run here")
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "grouped_mm")
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "0")
    lin = te_ops.Sequential(te_ops.GroupedLinear(3, 16, 32))
    x = torch.randn(7, 16)
    sizes = [3, 0, 4]
    split = torch.tensor(sizes) if device_sizes else sizes
    if device_sizes:
        with pytest.raises(RuntimeError, match=r"TE_OPS_GRAPH_SAFE=0 forbids the graph-safe "
                                               r"path, but TE_OPS_GROUPED_GEMM_BACKEND="
                                               r"grouped_mm keeps"):
            lin(x, split)
        return
    expected = ref.grouped_linear(ref.leaf(x), [ref.leaf(w) for w in lin[0].weights()],
                                  [ref.leaf(b) for b in lin[0].biases()], sizes)
    assert_close(lin(x, split), expected, torch.float32)


def test_graph_safe_on_cpu_with_device_split_sizes(monkeypatch):
    """CPU has no host/device boundary: grouped_mm with tensor split sizes is graph-safe."""
    cpu = torch.device("cpu")
    if grouped_mm_unsupported_reason(cpu, torch.float32, 16, 32) is not None:
        pytest.skip("grouped_mm does not run here")
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "1")
    choice = select_backend(cpu, torch.float32, 16, 32, device_split_sizes=True)
    assert choice.name == "grouped_mm" and choice.graph_safe
    lin = te_ops.GroupedLinear(2, 16, 32)
    x = torch.randn(5, 16, requires_grad=True)
    lin(x, torch.tensor([2, 2])).sum().backward()
    assert x.grad is not None and (x.grad[4] == 0).all()


@pytest.mark.parametrize("in_features, out_features, dtype, name", [
    (3, 16, torch.float32, "in_features=3 x 4 bytes"),
    (16, 6, torch.float32, "out_features=6 x 4 bytes"),
    (12, 16, torch.bfloat16, "in_features=12 x 2 bytes"),
])
def test_grouped_mm_alignment_reason(device, in_features, out_features, dtype, name):
    reason = grouped_mm_unsupported_reason(device, dtype, in_features, out_features)
    assert reason is not None and name in reason and "16 bytes" in reason


# --------------------------------------------------------------------------- weight stacking
def test_stack_weights_view_for_grouped_linear(device):
    lin = te_ops.GroupedLinear(4, 8, 12, single_grouped_weight=False, device=device)
    stacked = stack_weights(lin.weights())
    assert stacked.shape == (4, 12, 8)
    assert stacked.data_ptr() == lin.weight0.data_ptr() and stacked._is_view()
    biases = stack_weights(lin.biases())
    assert biases.shape == (4, 12) and biases.data_ptr() == lin.bias0.data_ptr()
    for g, w in enumerate(lin.weights()):
        assert torch.equal(stacked[g], w)


def test_stack_weights_copies_when_not_adjacent(device):
    ws = [torch.randn(3, 2, device=device) for _ in range(3)]
    stacked = stack_weights(ws)
    assert torch.equal(stacked, torch.stack(ws))
    reordered = [ws[1], ws[0], ws[2]]
    assert torch.equal(stack_weights(reordered), torch.stack(reordered))
    buffer = torch.randn(3, 3, 2, device=device)
    views = list(buffer.unbind(0))
    assert stack_weights(views).data_ptr() == buffer.data_ptr()
    assert torch.equal(stack_weights(views[::-1]), buffer.flip(0))


def test_replaced_weight_still_computes(device):
    """A weight replaced by a non-adjacent Parameter is stacked by copy, results stay right."""
    lin = te_ops.GroupedLinear(2, 8, 8, bias=False, single_grouped_weight=False, device=device)
    lin.weight1 = torch.nn.Parameter(torch.randn(8, 8, device=device))
    assert stack_weights(lin.weights()).data_ptr() != lin.weight0.data_ptr()
    x = torch.randn(5, 8, device=device, requires_grad=True)
    y = lin(x, [2, 3])
    dy = torch.randn_like(y)
    y.backward(dy)
    leaves = {"x": ref.leaf(x), "weight0": ref.leaf(lin.weight0),
              "weight1": ref.leaf(lin.weight1)}
    out, grads = ref.forward_backward(
        lambda t: ref.grouped_linear(t["x"], [t["weight0"], t["weight1"]], None, [2, 3]),
        leaves, dy)
    assert_close(y, out, torch.float32, "output")
    assert_close(lin.weight1.grad, grads["weight1"], torch.float32, "grad of weight1")


def test_stack_weights_memo_notices_repointed_weight(device):
    """After a remembered (view) result, re-pointing one weight's data gives a correct copy."""
    lin = te_ops.GroupedLinear(4, 8, 6, bias=False, single_grouped_weight=False, device=device)
    ws = lin.weights()
    assert stack_weights(ws).data_ptr() == ws[0].data_ptr()
    assert stack_weights(ws).data_ptr() == ws[0].data_ptr()  # the remembered path
    with torch.no_grad():
        ws[2].data = torch.randn(6, 8, device=device)
    stacked = stack_weights(ws)
    assert stacked.data_ptr() != ws[0].data_ptr()
    assert torch.equal(stacked, torch.stack([w.detach() for w in ws]))


def test_group_ids_built_on_first_use(device):
    """Device split sizes: no per-row group ids until an op needs them; then the right ones."""
    sizes = torch.tensor([2, 0, 3], device=device)
    splits = make_splits(sizes, 3, 7, sizes.device)  # the input's device (cuda:0, not "cuda")
    assert splits.to_tensors()[3] is None
    expected = torch.tensor([0, 0, 2, 2, 2, 3, 3], device=device)
    assert torch.equal(splits.group_ids, expected)
    assert splits.to_tensors()[3] is splits.group_ids
