"""The weights' column amax recorded by the forward's row-wise FP8 quantize (CPU).

Under ``Float8CurrentScaling`` a row-wise quantize of (G, N, K) weights with
``record_columnwise_amax=True`` also gives the column amax (largest finite magnitude per
(g, k) over N); backward's column-wise copy (dgrad) made from it must be byte-for-byte the copy
made from the tensor alone. Checked against a reference written here, on NaN / Inf / zero
columns, and through the whole block (fused and unfused halves, every gradient bitwise equal
with and without the recorded amax; the amax travels in ``GroupedLinearSaved.weight_amax``).
"""

from __future__ import annotations

import pytest
import torch

import te_ops
from te_ops.quantization import Float8CurrentScalingQuantizer, MXFP8Quantizer
from te_ops.quantization import quantizer as qmod

U8 = torch.uint8


def ref_column_amax(w: torch.Tensor) -> torch.Tensor:
    """(G, N, K) -> (G, K): largest |w| over N among finite values (0 when none)."""
    g, n, k = w.shape
    out = torch.zeros(g, k, dtype=torch.float32)
    for gi in range(g):
        for ki in range(k):
            col = w[gi, :, ki].double()
            fin = col[torch.isfinite(col)].abs()
            out[gi, ki] = fin.max() if fin.numel() else 0.0
    return out


def awkward_weights(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(3, 24, 10, generator=gen) * 5).to(dtype)
    w[0, 3, 2] = float("nan")
    w[1, :, 4] = float("inf")  # a column of Inf only: amax 0
    w[2, 7, 1] = -float("inf")
    w[2, :, 9] = 0.0  # a zero column
    w[1, 5, 0] = 3e38 if dtype == torch.float32 else 1e38
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recorded_amax_equals_reference(dtype):
    w = awkward_weights(dtype)
    got = Float8CurrentScalingQuantizer(rowwise=True)(w, record_columnwise_amax=True)
    plain = Float8CurrentScalingQuantizer(rowwise=True)(w)
    assert torch.equal(got.columnwise_amax, ref_column_amax(w))
    assert torch.equal(got.rowwise_data.view(U8), plain.rowwise_data.view(U8))
    assert torch.equal(got.rowwise_scale_inv, plain.rowwise_scale_inv)
    assert plain.columnwise_amax is None  # not asked for


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_columnwise_copy_from_given_amax_is_the_same_bytes(dtype):
    w = awkward_weights(dtype)
    q = Float8CurrentScalingQuantizer(rowwise=False, columnwise=True)
    given = q(w, columnwise_amax=ref_column_amax(w))
    alone = q(w)
    assert torch.equal(given.columnwise_data.view(U8), alone.columnwise_data.view(U8))
    assert torch.equal(given.columnwise_scale_inv, alone.columnwise_scale_inv)


def test_empty_groups_amax_is_zero():
    w = torch.zeros(2, 0, 5)
    got = Float8CurrentScalingQuantizer(rowwise=True)(w, record_columnwise_amax=True)
    assert torch.equal(got.columnwise_amax, torch.zeros(2, 5))


def test_switched_off_records_nothing(monkeypatch):
    monkeypatch.setattr(qmod, "WEIGHT_COLUMN_AMAX_FROM_ROWWISE", False)
    w = awkward_weights(torch.float32)
    assert Float8CurrentScalingQuantizer()(w, record_columnwise_amax=True).columnwise_amax is None


def test_bad_columnwise_amax_raises():
    w = awkward_weights(torch.float32)
    q = Float8CurrentScalingQuantizer(rowwise=False, columnwise=True)
    with pytest.raises(ValueError, match=r"shape \(3, 10\).*got \(3, 24\)"):
        q(w, columnwise_amax=torch.zeros(3, 24))
    with pytest.raises(ValueError, match="float32 tensor.*torch.float64"):
        q(w, columnwise_amax=torch.zeros(3, 10, dtype=torch.float64))
    with pytest.raises(ValueError, match="column-wise copy of a \\(G, N, K\\)"):
        Float8CurrentScalingQuantizer(rowwise=True)(w, columnwise_amax=torch.zeros(3, 10))
    with pytest.raises(ValueError, match="got x of shape \\(6, 4\\)"):
        q(torch.zeros(6, 4), [3, 3], columnwise_amax=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="MXFP8Quantizer takes no columnwise_amax"):
        MXFP8Quantizer(rowwise=False, columnwise=True)(torch.zeros(2, 32, 32),
                                                       columnwise_amax=torch.zeros(2, 32))


def _block(seed: int = 0) -> te_ops.Sequential:
    torch.manual_seed(seed)
    return te_ops.Sequential(te_ops.GroupedLinear(4, 32, 64), te_ops.ScaledSwiGLU(),
                             te_ops.GroupedLinear(4, 32, 32))


def _step(blk, x, sizes, probs, dy):
    xx = x.clone().requires_grad_(True)
    pp = probs.clone().requires_grad_(True)
    for p in blk.parameters():
        p.grad = None
    with te_ops.autocast(recipe=te_ops.recipe.Float8CurrentScaling()):
        y = blk(xx, sizes, pp, sizes)
    y.backward(dy)
    return [y.detach(), xx.grad, pp.grad] + [p.grad for p in blk.parameters()]


@pytest.mark.parametrize("fusion", ["0", "1"])
def test_block_bitwise_equal_with_and_without_recorded_amax(fusion, monkeypatch):
    """The recorded amax is saved (``weight_amax``) and dgrad's weights copy made from it is
    the copy made in backward from the weights alone: every output and gradient bitwise."""
    from te_ops.basic.grouped_linear import GroupedLinearSaved

    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    gen = torch.Generator().manual_seed(1)
    x, probs, dy = (torch.randn(40, 32, generator=gen), torch.rand(40, generator=gen),
                    torch.randn(40, 32, generator=gen))
    sizes = torch.tensor([10, 0, 25, 3])  # 38 rows: 2 padding rows
    blk = _block()
    seen = []
    load = GroupedLinearSaved.load

    def spy(ctx):
        saved = load(ctx)
        seen.append(saved.weight_amax)
        return saved

    monkeypatch.setattr(GroupedLinearSaved, "load", staticmethod(spy))
    with_amax = _step(blk, x, sizes, probs, dy)
    assert seen and all(a is not None and a.dtype == torch.float32 for a in seen)
    monkeypatch.setattr(qmod, "WEIGHT_COLUMN_AMAX_FROM_ROWWISE", False)
    seen.clear()
    without = _step(blk, x, sizes, probs, dy)
    assert seen and all(a is None for a in seen)
    for a, b in zip(with_amax, without):
        assert torch.equal(a, b)


def test_record_amax_where_it_cannot_apply_raises():
    """``record_columnwise_amax=True`` on a call that cannot record it raises, naming the shape
    / quantizer (not a silent ``columnwise_amax=None``)."""
    w = awkward_weights(torch.float32)
    qr = Float8CurrentScalingQuantizer(rowwise=True)
    with pytest.raises(ValueError, match=r"\(G, N, K\) tensor without splits, got x of shape "
                                         r"\(6, 4\)"):
        qr(torch.zeros(6, 4), record_columnwise_amax=True)
    with pytest.raises(ValueError, match=r"got x of shape \(6, 4\)"):
        qr(torch.zeros(6, 4), [3, 3], record_columnwise_amax=True)
    for cw in (dict(rowwise=True, columnwise=True), dict(rowwise=False, columnwise=True)):
        with pytest.raises(ValueError, match=r"row-wise-only quantizer"):
            Float8CurrentScalingQuantizer(**cw)(w, record_columnwise_amax=True)
    with pytest.raises(TypeError, match="record_columnwise_amax must be a bool, got str"):
        qr(w, record_columnwise_amax="no")
    # A format that makes no such amax answers None (documented), and False records nothing.
    mx = MXFP8Quantizer(rowwise=True)(torch.zeros(2, 32, 32), record_columnwise_amax=True)
    assert mx.columnwise_amax is None
    assert qr(w, record_columnwise_amax=False).columnwise_amax is None


def test_columnwise_amax_wrong_device_or_type_raises():
    w = awkward_weights(torch.float32)
    q = Float8CurrentScalingQuantizer(rowwise=False, columnwise=True)
    with pytest.raises(ValueError, match=r"shape \(3, 10\) on cpu, got \(3, 10\) "
                                         r"torch.float32 on meta"):
        q(w, columnwise_amax=torch.zeros(3, 10, device="meta"))
    with pytest.raises(ValueError, match=r"on cpu, got list"):
        q(w, columnwise_amax=[[0.0] * 10] * 3)
    # A non-contiguous amax with the right values gives the same bytes.
    amax = ref_column_amax(w).t().contiguous().t()
    assert not amax.is_contiguous()
    assert torch.equal(q(w, columnwise_amax=amax).columnwise_data.view(U8),
                       q(w).columnwise_data.view(U8))


@pytest.mark.parametrize("shape", [(3, 40, 32), (1, 16, 8), (2, 5, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_columnwise_copy_from_recorded_amax_has_the_same_bytes_and_layout(shape, dtype):
    """The CPU column-wise weights copy made from a recorded amax is the copy made from the
    weights alone: same bytes, same scales and the same contiguous (G, K, N) layout (a strided
    copy sent the dgrad GEMM down another CPU matmul path, which summed 1 ulp differently on
    AVX2 machines: found on such a machine)."""
    q = Float8CurrentScalingQuantizer(rowwise=False, columnwise=True)
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(*shape, generator=gen).to(dtype)
    _, amax = q.quantize_rows_column_amax(w)
    assert amax is not None
    from_amax, sinv_amax = q.quantize_columns_uniform(w, amax)
    alone, sinv_alone = q.quantize_columns_uniform(w)
    assert from_amax.is_contiguous() and alone.is_contiguous()
    assert from_amax.shape == alone.shape == (shape[0], shape[2], shape[1])
    assert torch.equal(from_amax.view(torch.uint8), alone.view(torch.uint8))
    assert torch.equal(sinv_amax, sinv_alone)
