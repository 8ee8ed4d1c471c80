"""Padding-row zeroing (``te_ops.kernels.padding``): only rows past the device total change.

Every path (CPU slice, mask, CUDA Triton op) is checked against an independent expectation:
rows below the total keep their exact bits, rows past it become zero, whatever garbage (NaN)
they held. CUDA tests also run the op under ``torch.compile(fullgraph=True)`` and inside a
captured CUDA graph replayed with new totals.
"""

from __future__ import annotations

import pytest
import torch

from te_ops.kernels import padding
from te_ops.kernels.padding import padding_backend, zero_padding_rows_

TOTALS = [0, 1, 31, 32, 33, 100, 127]  # M = 127: block edges of the Triton kernel and ends


def _case(device, dtype, m: int, n: int, total: int, groups: int = 3):
    gen = torch.Generator(device=device).manual_seed(total * 131 + n)
    out = torch.randn(m, n, device=device, dtype=dtype, generator=gen)
    out[total:] = float("nan")  # the allocator may hand back anything
    sizes = [total // groups] * (groups - 1)
    sizes.append(total - sum(sizes))
    offsets = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    expected = out.clone()
    expected[total:] = 0
    return out, offsets, expected


def _check(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert not out.isnan().any()
    assert torch.equal(out, expected)


@pytest.mark.parametrize("total", TOTALS)
@pytest.mark.parametrize("n", [1, 48, 300])
def test_cpu_slice_path(total, n):
    out, offsets, expected = _case("cpu", torch.float32, 127, n, total)
    assert padding_backend(out) == "slice"
    assert zero_padding_rows_(out, offsets) is out
    _check(out, expected)


@pytest.mark.parametrize("total", [0, 5, 127])
@pytest.mark.parametrize("with_mask", [False, True])
def test_mask_path(monkeypatch, total, with_mask):
    out, offsets, expected = _case("cpu", torch.bfloat16, 127, 20, total)
    monkeypatch.setattr(padding, "padding_backend", lambda t: "mask")
    mask = (torch.arange(127) >= total).unsqueeze(-1) if with_mask else None
    zero_padding_rows_(out, offsets, mask)
    _check(out, expected)


def test_meta_takes_mask_path():
    out = torch.empty(10, 4, device="meta")
    offsets = torch.empty(3, dtype=torch.int32, device="meta")
    assert padding_backend(out) == "mask"
    assert zero_padding_rows_(out, offsets).shape == (10, 4)


def test_empty_is_a_no_op():
    out = torch.empty(0, 8)
    assert zero_padding_rows_(out, torch.zeros(2, dtype=torch.int32)) is out


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="out must be 2-D"):
        zero_padding_rows_(torch.zeros(4), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="offsets must be 1-D"):
        zero_padding_rows_(torch.zeros(4, 2), torch.zeros(1, 1, dtype=torch.int32))


def _need_triton() -> None:
    if padding.triton is None:
        pytest.skip("triton is not installed")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("total", TOTALS)
@pytest.mark.parametrize("n", [1, 48, 300, 4096])
def test_triton_op(dtype, total, n):
    _need_triton()
    out, offsets, expected = _case("cuda", dtype, 127, n, total)
    assert padding_backend(out) == "triton"
    zero_padding_rows_(out, offsets)
    _check(out, expected)


@pytest.mark.cuda
def test_triton_op_strided_rows():
    """A row-strided view (unit column stride) only has its own columns touched."""
    _need_triton()
    base = torch.randn(64, 40, device="cuda")
    out = base[:, :24]
    offsets = torch.tensor([10, 20], device="cuda", dtype=torch.int32)
    expected = base.clone()
    expected[20:, :24] = 0
    zero_padding_rows_(out, offsets)
    assert torch.equal(base, expected)


@pytest.mark.cuda
def test_triton_op_compiles_fullgraph():
    _need_triton()

    def f(out, offsets):
        torch.ops.te_ops.zero_rows_past_total_(out, offsets)
        return out * 2

    compiled = torch.compile(f, fullgraph=True)
    out, offsets, expected = _case("cuda", torch.bfloat16, 127, 300, 33)
    got = compiled(out.clone(), offsets)
    _check(got, expected * 2)


@pytest.mark.cuda
def test_triton_op_in_cuda_graph():
    """Capture once, replay with other totals copied into the static offsets."""
    _need_triton()
    static_out = torch.empty(127, 300, device="cuda", dtype=torch.bfloat16)
    static_off = torch.zeros(3, device="cuda", dtype=torch.int32)
    zero_padding_rows_(static_out, static_off)  # warm up (compile) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        zero_padding_rows_(static_out, static_off)
    for total in TOTALS:
        out, offsets, expected = _case("cuda", torch.bfloat16, 127, 300, total)
        static_out.copy_(out)
        static_off.copy_(offsets)
        graph.replay()
        torch.cuda.synchronize()
        _check(static_out, expected)


@pytest.mark.cuda
def test_registered_op_eager_matches_direct_launch():
    """``torch.ops.te_ops.zero_rows_past_total_`` (the registered op) and the eager launch
    give the same result."""
    _need_triton()
    out, offsets, expected = _case("cuda", torch.bfloat16, 127, 300, 33)
    torch.ops.te_ops.zero_rows_past_total_(out, offsets)
    _check(out, expected)
