"""Every bad input raises at once, with a message naming the argument and giving the expected
and the actual value."""

from __future__ import annotations

import pytest
import torch

import te_ops
from te_ops.gemm import grouped_mm_unsupported_reason

G, K, N = 3, 16, 32
ROWS = 10


@pytest.fixture
def lin(device):
    return te_ops.GroupedLinear(G, K, N, device=device)


@pytest.fixture
def x(device):
    return torch.randn(ROWS, K, device=device, requires_grad=True)


# --------------------------------------------------------------------------- split sizes
def test_host_split_sizes_sum_past_rows(lin, x):
    with pytest.raises(ValueError,
                       match=r"split_sizes must sum to at most the input's rows \(10\), "
                             r"got sum 12"):
        lin(x, [4, 4, 4])


def test_device_split_sizes_sum_past_rows_device_assert(lin, x, device):
    if device.type == "cuda":
        pytest.skip("a CUDA device-side assert poisons the context; checked on CPU only")
    with pytest.raises(RuntimeError, match=r"split_sizes must be non-negative and sum to at "
                                           r"most the input's rows \(10\)"):
        lin(x, torch.tensor([4, 4, 4], device=device))


def test_device_split_sizes_sum_past_rows_eager_check(lin, x, device, monkeypatch):
    monkeypatch.setenv("TE_OPS_CHECK_SPLIT_SIZES", "1")
    with pytest.raises(ValueError, match=r"split_sizes must sum to at most the input's rows "
                                         r"\(10\), got sum 12"):
        lin(x, torch.tensor([4, 4, 4], device=device))


@pytest.mark.parametrize("kind", ["list", "tensor"])
def test_split_sizes_wrong_length(lin, x, device, kind):
    sizes = [5, 5] if kind == "list" else torch.tensor([5, 5], device=device)
    with pytest.raises(ValueError, match=r"split_sizes must have num_groups=3 entries, got 2"):
        lin(x, sizes)


def test_host_split_sizes_negative_entry(lin, x):
    with pytest.raises(ValueError, match=r"split_sizes\[1\] must be >= 0, got -1"):
        lin(x, [3, -1, 2])


def test_device_split_sizes_negative_entry(lin, x, device, monkeypatch):
    if device.type != "cuda":
        with pytest.raises(RuntimeError, match=r"split_sizes must be non-negative"):
            lin(x, torch.tensor([3, -1, 2], device=device))
    monkeypatch.setenv("TE_OPS_CHECK_SPLIT_SIZES", "1")
    with pytest.raises(ValueError, match=r"split_sizes\[1\] must be >= 0, got -1"):
        lin(x, torch.tensor([3, -1, 2], device=device))


def test_split_sizes_bool_tensor(lin, x, device):
    with pytest.raises(TypeError, match=r"split_sizes must have an integer dtype \(or a "
                                        r"floating dtype .*\), got torch.bool"):
        lin(x, torch.tensor([True, True, False], device=device))


def test_split_sizes_fractional_float_tensor(lin, x, device, monkeypatch):
    if device.type != "cuda":
        with pytest.raises(RuntimeError, match=r"split_sizes must be whole"):
            lin(x, torch.tensor([3.5, 2.5, 4.0], device=device))
    monkeypatch.setenv("TE_OPS_CHECK_SPLIT_SIZES", "1")
    with pytest.raises(ValueError, match=r"split_sizes\[0\] must be a whole number, got 3.5"):
        lin(x, torch.tensor([3.5, 2.5, 4.0], device=device))


def test_split_sizes_list_of_tensors(lin, x, device):
    sizes = [torch.tensor(3, device=device), torch.tensor(3, device=device),
             torch.tensor(4, device=device)]
    with pytest.raises(TypeError, match=r"split_sizes must be a list of ints or one 1-D "
                                        r"tensor, got a list of 3 tensors: pass one tensor"):
        lin(x, sizes)


def test_split_sizes_2d_tensor(lin, x, device):
    with pytest.raises(ValueError, match=r"split_sizes must be a 1-D tensor, got shape \(1, 3\)"):
        lin(x, torch.tensor([[3, 3, 4]], device=device))


def test_split_sizes_wrong_device(lin, x):
    sizes = torch.tensor([3, 3, 4], device="meta")
    with pytest.raises(ValueError, match=r"split_sizes must be on the input's device .*, got "
                                         r"meta"):
        lin(x, sizes)


@pytest.mark.parametrize("bad", [[3.0, 3, 4], [3, "3", 4], [3, True, 4]],
                         ids=["float", "str", "bool"])
def test_split_sizes_non_int_entries(lin, x, bad):
    with pytest.raises(TypeError, match=r"split_sizes\[\d\] must be an int, got"):
        lin(x, bad)


def test_split_sizes_not_a_list(lin, x):
    with pytest.raises(TypeError, match=r"split_sizes must be a list of ints or a 1-D integer "
                                        r"tensor, got int"):
        lin(x, 10)


# --------------------------------------------------------------------------- inputs
def test_wrong_in_features(lin, device):
    with pytest.raises(ValueError, match=r"input must have last dim in_features=16, got shape "
                                         r"\(10, 8\)"):
        lin(torch.randn(ROWS, 8, device=device), [3, 3, 4])


def test_input_dtype_differs_from_weights(lin, device):
    with pytest.raises(ValueError, match=r"input must match the weights' dtype torch.float32"
                                         r".*got torch.bfloat16"):
        lin(torch.randn(ROWS, K, device=device, dtype=torch.bfloat16), [3, 3, 4])


def test_input_unsupported_dtype(lin, device):
    with pytest.raises(TypeError, match=r"input: input dtype torch.int64 is not one of"):
        lin(torch.ones(ROWS, K, device=device, dtype=torch.int64), [3, 3, 4])


def test_input_not_a_tensor(lin):
    with pytest.raises(TypeError, match=r"input must be a torch.Tensor, got list"):
        lin([[0.0] * K] * ROWS, [3, 3, 4])


def test_bias_wrong_last_dim(device):
    with pytest.raises(ValueError, match=r"input must have last dim size=8, got shape \(4, 6\)"):
        te_ops.Bias(8, device=device)(torch.randn(4, 6, device=device))


@pytest.mark.parametrize("interleave, width, step", [(None, 7, 2), (4, 12, 8)])
def test_swiglu_bad_last_dim(device, interleave, width, step):
    op = te_ops.SwiGLU(glu_interleave_size=interleave)
    with pytest.raises(ValueError, match=rf"input must have a last dim divisible by {step}, got "
                                         rf"shape \(4, {width}\)"):
        op(torch.randn(4, width, device=device))


# --------------------------------------------------------------------------- probs
def _probs_cases(device):
    return {
        "shape": (torch.rand(ROWS - 1, device=device), ValueError,
                  r"probs must have shape \(10,\), got \(9,\)"),
        "2d": (torch.rand(ROWS, 1, device=device), ValueError,
               r"probs must have shape \(10,\), got \(10, 1\)"),
        "int": (torch.ones(ROWS, dtype=torch.int64, device=device), TypeError,
                r"probs must have a floating-point dtype, got torch.int64"),
        "device": (torch.rand(ROWS, device="meta"), ValueError,
                   r"probs must be on the input's device .*, got meta"),
        "none": (None, TypeError, r"probs must be a torch.Tensor of shape \(10,\), got NoneType"),
    }


@pytest.mark.parametrize("case", ["shape", "2d", "int", "device", "none"])
def test_grouped_linear_bad_probs(device, x, case):
    lin = te_ops.GroupedLinear(G, K, N, scale_bias=True, device=device)
    probs, exc, match = _probs_cases(device)[case]
    with pytest.raises(exc, match=match):
        lin(x, [3, 3, 4], probs)


@pytest.mark.parametrize("case", ["shape", "2d", "int", "device", "none"])
def test_scaled_swiglu_bad_probs(device, case):
    probs, exc, match = _probs_cases(device)[case]
    with pytest.raises(exc, match=match):
        te_ops.ScaledSwiGLU()(torch.randn(ROWS, 8, device=device), probs)


@pytest.mark.parametrize("case", ["shape", "int"])
def test_block_bad_probs(device, x, case):
    block = te_ops.Sequential(te_ops.GroupedLinear(G, K, N, device=device), te_ops.ScaledSwiGLU(),
                              te_ops.GroupedLinear(G, N // 2, K, device=device))
    probs, exc, match = _probs_cases(device)[case]
    with pytest.raises(exc, match=match):
        block(x, [3, 3, 4], probs, [3, 3, 4])


# --------------------------------------------------------------------------- extra inputs
@pytest.mark.parametrize("count", [0, 2, 4])
def test_sequential_wrong_number_of_extra_inputs(device, x, count):
    block = te_ops.Sequential(te_ops.GroupedLinear(G, K, N, device=device), te_ops.ScaledSwiGLU(),
                              te_ops.GroupedLinear(G, N // 2, K, device=device))
    extra = [[3, 3, 4], torch.rand(ROWS, device=device), [3, 3, 4], None][:count]
    with pytest.raises(ValueError, match=rf"extra_inputs: expected 3 extra inputs after the main "
                                         rf"input.*got {count}"):
        block(x, *extra)


@pytest.mark.parametrize("count", [0, 2])
def test_standalone_op_wrong_number_of_extra_inputs(lin, x, count):
    extra = [[3, 3, 4], [3, 3, 4]][:count]
    with pytest.raises(ValueError, match=rf"extra_inputs: expected 1 extra inputs .*"
                                         rf"GroupedLinear:1.*got {count}"):
        lin(x, *extra)


# --------------------------------------------------------------------------- constructors
@pytest.mark.parametrize("kwargs, match", [
    (dict(num_groups=0, in_features=4, out_features=4), r"num_groups must be a positive int, "
                                                        r"got 0"),
    (dict(num_groups=2, in_features=-1, out_features=4), r"in_features must be a positive int, "
                                                         r"got -1"),
    (dict(num_groups=2, in_features=4, out_features=2.0), r"out_features must be a positive "
                                                          r"int, got 2.0"),
    (dict(num_groups=True, in_features=4, out_features=4), r"num_groups must be a positive int, "
                                                           r"got True"),
    (dict(num_groups=2, in_features=4, out_features=4, bias=False, scale_bias=True),
     r"scale_bias=True needs bias=True, got bias=False"),
    (dict(num_groups=2, in_features=4, out_features=4, dtype=torch.int32),
     r"dtype must be one of .*, got torch.int32"),
])
def test_grouped_linear_bad_constructor_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        te_ops.GroupedLinear(**kwargs)


@pytest.mark.parametrize("cls", [te_ops.SwiGLU, te_ops.ScaledSwiGLU])
@pytest.mark.parametrize("size", [-2, 1.5, True])
def test_swiglu_bad_interleave(cls, size):
    with pytest.raises(ValueError, match=rf"glu_interleave_size must be a positive int, 0 or "
                                         rf"None, got {size!r}"):
        cls(glu_interleave_size=size)


@pytest.mark.parametrize("size", [0, -1, 2.0])
def test_bias_bad_size(size):
    with pytest.raises(ValueError, match=rf"size must be a positive int, got {size!r}"):
        te_ops.Bias(size)


def test_sequential_rejects_non_module():
    with pytest.raises(TypeError, match=r"modules\[1\] must be a torch.nn.Module, got function"):
        te_ops.Sequential(te_ops.Identity(), lambda t: t)


def test_fuser_rejects_non_op():
    with pytest.raises(TypeError, match=r"ops\[0\] must be a te_ops FusibleOperation"):
        te_ops.OperationFuser([torch.nn.Identity()])


# --------------------------------------------------------------------------- environment
@pytest.mark.parametrize("name, value", [
    ("TE_OPS_FUSION", "2"),
    ("TE_OPS_FUSION", "yes"),
    ("TE_OPS_GROUPED_GEMM_BACKEND", "cublas"),
    ("TE_OPS_GRAPH_SAFE", "maybe"),
    ("TE_OPS_CHECK_SPLIT_SIZES", "true"),
    ("TE_OPS_QUANTIZED_GEMM", "cublas"),
])
def test_malformed_env_value(lin, x, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"environment variable {name} must be one of .*, got "
                                         rf"'{value}'"):
        lin(x, [3, 3, 4])


def test_forced_grouped_mm_misaligned(device, monkeypatch):
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "grouped_mm")
    lin = te_ops.GroupedLinear(2, 3, 8, device=device)
    with pytest.raises(RuntimeError, match=r"TE_OPS_GROUPED_GEMM_BACKEND=grouped_mm cannot run: "
                                           r"in_features=3 x 4 bytes is not a multiple of 16"):
        lin(torch.randn(4, 3, device=device), [2, 2])


def test_forced_grouped_mm_unsupported_dtype(device, monkeypatch):
    reason = grouped_mm_unsupported_reason(device, torch.float64, 16, 16)
    if reason is None:
        pytest.skip("torch._grouped_mm runs float64 here")
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "grouped_mm")
    lin = te_ops.GroupedLinear(2, 16, 16, device=device, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"TE_OPS_GROUPED_GEMM_BACKEND=grouped_mm cannot run: "
                                           r".*float64"):
        lin(torch.randn(4, 16, device=device, dtype=torch.float64), [2, 2])


def test_graph_safe_with_host_split_sizes(lin, x, monkeypatch):
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "1")
    with pytest.raises(RuntimeError, match=r"TE_OPS_GRAPH_SAFE=1 but the graph-safe path is "
                                           r"unsupported: split sizes are a host list"):
        lin(x, [3, 3, 4])


def test_graph_safe_with_loop_backend(lin, x, device, monkeypatch):
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "1")
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "loop")
    with pytest.raises(RuntimeError, match=r"TE_OPS_GRAPH_SAFE=1 but the graph-safe path is "
                                           r"unsupported: the loop backend copies split sizes "
                                           r"to the host"):
        lin(x, torch.tensor([3, 3, 4], device=device))


def test_graph_safe_misaligned_device_split_sizes(device, monkeypatch):
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "1")
    lin = te_ops.GroupedLinear(2, 3, 8, device=device)
    with pytest.raises(RuntimeError, match=r"TE_OPS_GRAPH_SAFE=1 .*in_features=3 x 4 bytes"):
        lin(torch.randn(4, 3, device=device), torch.tensor([2, 2], device=device))


def test_env_read_unknown_variable():
    with pytest.raises(KeyError):
        te_ops.env.read("TE_OPS_NOT_A_VARIABLE")
