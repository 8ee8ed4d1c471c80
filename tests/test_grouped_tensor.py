"""GroupedTensorStorage / make_grouped_tensor_from_rowwise_data: grouping, views, the saving
protocol under a real ``torch.autograd.Function``, and the error messages."""

from __future__ import annotations

import re

import pytest
import torch

from te_ops.grouped_tensor import (
    GroupedTensor,
    GroupedTensorStorage,
    make_grouped_tensor_from_rowwise_data,
)

FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv",
          "split_sizes", "base_offsets")


# ---------------------------------------------------------------------------- uniform grouping
@pytest.mark.parametrize("data_shape", [(60,), (3, 4, 5), (12, 5)])
def test_uniform_grouping_views(data_shape):
    data = torch.arange(60, dtype=torch.float32).reshape(data_shape)
    gt = make_grouped_tensor_from_rowwise_data(3, (4, 5), data)
    assert isinstance(gt, GroupedTensor) and isinstance(gt, GroupedTensorStorage)
    assert not gt.is_split
    assert gt.num_tensors == 3 and gt.tensor_shape == (4, 5)
    assert gt.dtype == torch.float32 and gt.numel() == 60
    assert gt.split_sizes is None and gt.base_offsets is None
    assert gt.rowwise_data.data_ptr() == data.data_ptr()  # contiguous: no copy

    expected = torch.arange(60, dtype=torch.float32).view(3, 4, 5)
    assert gt.as_3d().shape == (3, 4, 5) and torch.equal(gt.as_3d(), expected)
    assert gt.as_2d().shape == (12, 5) and torch.equal(gt.as_2d(), expected.view(12, 5))
    members = gt.split_into_tensors()
    assert len(members) == 3
    for i, m in enumerate(members):
        assert m.shape == (4, 5)
        assert torch.equal(m, expected[i])
        assert m.data_ptr() == data.data_ptr() + i * 20 * data.element_size()  # views
    # views share the buffer: writing through one shows in the data
    members[1][0, 0] = -1.0
    assert data.reshape(-1)[20].item() == -1.0


def test_uniform_host_sizes_are_ignored():
    gt = make_grouped_tensor_from_rowwise_data(2, (2, 3), torch.arange(12.0))
    views = gt.split_into_tensors(host_split_sizes=[5, 7])  # uniform: sizes do not apply
    assert [tuple(v.shape) for v in views] == [(2, 3), (2, 3)]


def test_dtype_defaults_to_data_and_can_be_given():
    data = torch.zeros(2, 3, dtype=torch.bfloat16)
    assert make_grouped_tensor_from_rowwise_data(1, (2, 3), data).dtype == torch.bfloat16
    gt = make_grouped_tensor_from_rowwise_data(1, (2, 3), data, dtype=torch.float32)
    assert gt.dtype == torch.float32  # logical dtype (e.g. what quantized data dequantizes to)
    assert "uniform" in repr(gt) and "num_tensors=1" in repr(gt)


def test_static_and_module_level_factory_agree():
    data = torch.arange(8.0)
    a = GroupedTensor.make_grouped_tensor_from_rowwise_data(2, (2, 2), data)
    b = make_grouped_tensor_from_rowwise_data(2, (2, 2), data)
    assert torch.equal(a.as_3d(), b.as_3d())


# ---------------------------------------------------------------------------- split grouping
@pytest.mark.parametrize("sizes_dtype", [torch.int64, torch.int32])
def test_split_grouping_views(sizes_dtype):
    rows, cols = 10, 3
    data = torch.arange(rows * cols, dtype=torch.float32).view(rows, cols)
    sizes = torch.tensor([2, 0, 5], dtype=sizes_dtype)  # sums to 7: rows 7..9 are padding
    gt = make_grouped_tensor_from_rowwise_data(3, (rows, cols), data, split_sizes=sizes)
    assert gt.is_split and gt.numel() == rows * cols
    assert gt.split_sizes is sizes
    assert gt.base_offsets.dtype == torch.int64
    assert gt.base_offsets.tolist() == [0, 2, 2, 7]
    assert torch.equal(gt.as_2d(), data) and gt.as_2d().data_ptr() == data.data_ptr()
    with pytest.raises(ValueError, match="as_3d needs uniform grouping"):
        gt.as_3d()
    assert "split" in repr(gt)

    for views in (gt.split_into_tensors(), gt.split_into_tensors(host_split_sizes=[2, 0, 5])):
        assert [tuple(v.shape) for v in views] == [(2, cols), (0, cols), (5, cols)]
        assert torch.equal(views[0], data[0:2])
        assert torch.equal(views[2], data[2:7])
        assert views[2].data_ptr() == data[2].data_ptr()


def test_split_given_base_offsets_are_kept():
    sizes = torch.tensor([1, 2])
    offsets = torch.tensor([0, 1, 3])
    gt = GroupedTensorStorage(2, (4, 2), torch.float32, torch.zeros(8), split_sizes=sizes,
                              base_offsets=offsets)
    assert gt.base_offsets is offsets


def test_split_into_tensors_wrong_host_sizes_length():
    gt = make_grouped_tensor_from_rowwise_data(3, (6, 2), torch.zeros(12),
                                               split_sizes=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"host_split_sizes must have 3 entries, got 2"):
        gt.split_into_tensors(host_split_sizes=[3, 3])


# ---------------------------------------------------------------------------- saving protocol
def _split_storage(rows=9, cols=4, sizes=(2, 0, 5)):
    data = torch.randn(rows, cols)
    split = torch.tensor(sizes)
    return data, split, make_grouped_tensor_from_rowwise_data(len(sizes), (rows, cols), data,
                                                              split_sizes=split)


def test_prepare_for_saving_empties_fields_and_restore_round_trips():
    data, split, gt = _split_storage()
    base = gt.base_offsets
    tensors, storage = gt.prepare_for_saving()
    assert storage is gt
    assert len(tensors) == len(FIELDS)
    assert tensors[0] is data and tensors[4] is split and tensors[5] is base
    assert tensors[1] is None and tensors[2] is None and tensors[3] is None
    for name in FIELDS:
        assert getattr(gt, name) is None, name
    # metadata stays
    assert gt.num_tensors == 3 and gt.tensor_shape == (9, 4) and gt.is_split

    extra_a, extra_b = torch.ones(2), torch.zeros(3)
    rest = gt.restore_from_saved([*tensors, extra_a, None, extra_b])
    assert len(rest) == 3 and rest[0] is extra_a and rest[1] is None and rest[2] is extra_b
    assert gt.rowwise_data is data and gt.split_sizes is split and gt.base_offsets is base
    assert torch.equal(gt.as_2d(), data)
    assert gt.restore_from_saved(tensors) == []  # nothing left over


@pytest.mark.parametrize("view", ["as_2d", "as_3d", "split_into_tensors"])
def test_data_access_after_prepare_for_saving_raises(view):
    gt = make_grouped_tensor_from_rowwise_data(2, (2, 3), torch.zeros(12))
    gt.prepare_for_saving()
    with pytest.raises(RuntimeError, match="restore_from_saved"):
        getattr(gt, view)()


def test_restore_from_saved_too_few_tensors():
    _, _, gt = _split_storage()
    tensors, _ = gt.prepare_for_saving()
    with pytest.raises(ValueError, match=r"tensors must hold at least 6 entries, got 5"):
        gt.restore_from_saved(tensors[:5])


class _GroupedScale(torch.autograd.Function):
    """``y_g = x_g @ W_g`` over the row groups of ``x`` (padding rows give zero).

    Forward saves ``x`` as a GroupedTensorStorage through ``prepare_for_saving`` followed by the
    weights; backward restores it, takes the weights from the returned rest and computes
    ``dW_g = x_g^T dy_g`` from the restored storage.
    """

    @staticmethod
    def forward(ctx, x, weights, split_sizes, host_sizes):
        gt = make_grouped_tensor_from_rowwise_data(weights.shape[0], tuple(x.shape), x,
                                                   split_sizes=split_sizes)
        y = x.new_zeros(x.shape[0], weights.shape[2])
        start = 0
        for g, xg in enumerate(gt.split_into_tensors(host_sizes)):
            y[start:start + xg.shape[0]] = xg @ weights[g]
            start += xg.shape[0]
        tensors, storage = gt.prepare_for_saving()
        ctx.save_for_backward(*tensors, weights)
        ctx.storage = storage
        ctx.host_sizes = host_sizes
        ctx.fields_empty_after_save = all(getattr(storage, n) is None for n in FIELDS)
        return y

    @staticmethod
    def backward(ctx, dy):
        storage = ctx.storage
        rest = storage.restore_from_saved(ctx.saved_tensors)
        assert len(rest) == 1
        (weights,) = rest
        dx = torch.zeros_like(storage.as_2d())
        dw = torch.zeros_like(weights)
        start = 0
        for g, xg in enumerate(storage.split_into_tensors(ctx.host_sizes)):
            m = xg.shape[0]
            dyg = dy[start:start + m]
            dw[g] = xg.t() @ dyg
            dx[start:start + m] = dyg @ weights[g].t()
            start += m
        return dx, dw, None, None


@pytest.mark.parametrize("host", [True, False], ids=["host_sizes", "device_sizes"])
def test_round_trip_under_real_autograd_function(host):
    torch.manual_seed(0)
    sizes = [3, 0, 4]
    x = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)  # rows 7, 8 are padding
    w = torch.randn(3, 5, 2, dtype=torch.float64, requires_grad=True)
    split = torch.tensor(sizes)
    host_sizes = sizes if host else None
    dy = torch.randn(9, 2, dtype=torch.float64)

    y = _GroupedScale.apply(x, w, split, host_sizes)
    y.backward(dy)
    assert y.grad_fn is not None

    x_ref = x.detach().clone().requires_grad_(True)
    w_ref = w.detach().clone().requires_grad_(True)
    pieces, start = [], 0
    for g, m in enumerate(sizes):
        pieces.append(x_ref[start:start + m] @ w_ref[g])
        start += m
    pieces.append(x_ref.new_zeros(9 - start, 2))
    torch.cat(pieces).backward(dy)
    torch.testing.assert_close(y, torch.cat(pieces).detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=0, atol=1e-12)
    assert w.grad[1].abs().sum() == 0  # the empty group gets a zero gradient
    assert x.grad[7:].abs().sum() == 0  # padding rows too

    assert torch.autograd.gradcheck(
        lambda a, b: _GroupedScale.apply(a, b, split, host_sizes), (x, w))


def test_fields_are_empty_between_forward_and_backward():
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(2, 3, 3, requires_grad=True)
    y = _GroupedScale.apply(x, w, torch.tensor([1, 3]), [1, 3])
    storage = y.grad_fn.storage
    assert y.grad_fn.fields_empty_after_save
    assert storage.rowwise_data is None and storage.split_sizes is None
    with pytest.raises(RuntimeError, match="restore_from_saved"):
        storage.as_2d()
    y.sum().backward()
    assert storage.rowwise_data is not None  # restored in backward
    assert x.grad is not None and w.grad is not None


# ---------------------------------------------------------------------------- non-contiguous
def test_non_contiguous_is_copied_by_default():
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    data = base.t()  # shape (6, 4), strides (1, 6)
    assert not data.is_contiguous()
    gt = make_grouped_tensor_from_rowwise_data(2, (3, 4), data)
    assert gt.rowwise_data.is_contiguous()
    assert gt.rowwise_data.data_ptr() != base.data_ptr()
    assert torch.equal(gt.as_2d(), data)
    assert torch.equal(gt.as_3d(), data.reshape(2, 3, 4))


def test_non_contiguous_rejected_without_copy():
    data = torch.arange(24, dtype=torch.float32).view(4, 6).t()
    with pytest.raises(ValueError) as info:
        make_grouped_tensor_from_rowwise_data(2, (3, 4), data, copy_if_noncontiguous=False)
    msg = str(info.value)
    assert "rowwise_data" in msg and "contiguous" in msg
    assert "(6, 4)" in msg, msg
    assert "(1, 6)" in msg, msg


def test_storage_constructor_rejects_non_contiguous():
    data = torch.zeros(4, 6)[:, ::2]  # (4, 3), strides (6, 2)
    with pytest.raises(ValueError, match=re.escape("shape (4, 3) with strides (6, 2)")):
        GroupedTensorStorage(1, (4, 3), torch.float32, data)


# ---------------------------------------------------------------------------- errors
def test_wrong_element_count_uniform():
    with pytest.raises(ValueError, match=r"rowwise_data must have 24 elements, got 23"):
        make_grouped_tensor_from_rowwise_data(2, (3, 4), torch.zeros(23))


def test_wrong_element_count_split():
    # split grouping: tensor_shape is the whole matrix, not one member
    with pytest.raises(ValueError, match=r"rowwise_data must have 12 elements, got 24"):
        make_grouped_tensor_from_rowwise_data(2, (3, 4), torch.zeros(24),
                                              split_sizes=torch.tensor([1, 2]))


@pytest.mark.parametrize("split", [torch.tensor([1, 2, 3]), torch.tensor([[1, 2]])])
def test_wrong_split_sizes_length(split):
    with pytest.raises(ValueError, match=re.escape("split_sizes must have shape (2,)")):
        make_grouped_tensor_from_rowwise_data(2, (6, 1), torch.zeros(6), split_sizes=split)


@pytest.mark.parametrize("shape", [(12,), (2, 3, 2), ()])
def test_tensor_shape_not_2d(shape):
    with pytest.raises(ValueError, match=re.escape(f"tensor_shape must have 2 dims, got {shape}")):
        make_grouped_tensor_from_rowwise_data(1, shape, torch.zeros(12))


@pytest.mark.parametrize("n", [0, -1])
def test_num_tensors_must_be_positive(n):
    with pytest.raises(ValueError, match=f"num_tensors must be >= 1, got {n}"):
        GroupedTensorStorage(n, (2, 2), torch.float32, torch.zeros(4))


def test_rowwise_data_must_be_a_tensor():
    with pytest.raises(TypeError, match="rowwise_data must be a torch.Tensor"):
        make_grouped_tensor_from_rowwise_data(1, (2, 2), [0.0] * 4)


def test_storage_without_data_raises_on_access():
    gt = GroupedTensorStorage(2, (2, 2), torch.float32, None)
    with pytest.raises(RuntimeError, match="restore_from_saved"):
        gt.as_3d()
