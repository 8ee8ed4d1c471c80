"""Low-precision recipes: quantize numerics against references written here from the specs,
the quantized grouped GEMMs against a dequantized fp64 reference, the recipes through the ops
(four-way fused x unfused bit-exact, gradients near the fp32 path) and ``te_ops.autocast``.

References (independent of te_ops):

* E4M3 (OCP 8-bit floating point, ``float8_e4m3fn``): bias 7, 3 mantissa bits, max normal 448,
  min normal 2**-6, subnormals k * 2**-9, NaN = S.1111.111, no infinities; round to nearest,
  ties to even; te_ops saturates finite values to ±448 and maps NaN / ±Inf to NaN.
* FP8 current scaling (te_ops' documented rule): one power-of-two scale per row,
  ``2 ** floor(log2(448 / amax))`` with ``amax`` the largest finite magnitude (1 for zero rows),
  the exponent clamped to fp32's normal powers of two [-126, 127].
* MXFP8 (OCP MX v1.0 section 6.3): blocks of 32, ``shared = floor(log2(amax)) - 8`` clamped to
  [-127, 127], E8M0 byte ``shared + 127``; elements ``e4m3(v / 2**shared)``; a block holding
  NaN / Inf gets byte 255.
"""

from __future__ import annotations

import itertools
import math

import pytest
import reference as ref
import torch
from test_fused_grouped_mlp import (
    CASES,
    COMBOS,
    assert_bitwise,
    make_block,
    make_inputs,
    plan_types,
    run,
    set_combo,
)

import te_ops
from te_ops.fused.grouped_mlp import BackwardGroupedMLP, ForwardGroupedMLP
from te_ops.gemm.dispatch import (
    grouped_dgrad,
    grouped_fprop,
    grouped_wgrad,
    select_backend,
)
from te_ops.quantization import (
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    QuantizedTensorStorage,
)
from te_ops.recipe import Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling
from te_ops.splits import make_splits

RECIPES = {"fp8": Float8CurrentScaling(), "mxfp8": MXFP8BlockScaling(),
           "fp8_block": Float8BlockScaling()}
#: FP8 with some GEMMs kept in high precision (Float8CurrentScaling's *_high_precision flags).
HP_RECIPES = {"fp8_wgrad_hp": Float8CurrentScaling(wgrad_high_precision=True),
              "fp8_fprop_dgrad_hp": Float8CurrentScaling(fprop_high_precision=True,
                                                         dgrad_high_precision=True)}
QUANTIZERS = {"fp8": Float8CurrentScalingQuantizer, "mxfp8": MXFP8Quantizer}


# ------------------------------------------------------------------------------ references
def e4m3_bits(v: float) -> int:
    """The E4M3 byte of ``v`` (saturating; NaN / Inf -> 0x7F with the sign bit)."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    if not math.isfinite(v):
        return sign | 0x7F
    a = min(abs(v), 448.0)
    if a == 0:
        return sign
    e = max(math.floor(math.log2(a)), -6)
    quantum = 2.0 ** (e - 3)
    q = a / quantum
    n = math.floor(q)
    rem = q - n
    if rem > 0.5 or (rem == 0.5 and n % 2 == 1):
        n += 1
    val = n * quantum
    if val < 2.0 ** -6:  # subnormal: k * 2**-9
        return sign | int(round(val / 2.0 ** -9))
    exp = math.floor(math.log2(val))
    mant = int(round((val / 2.0 ** exp - 1) * 8))
    return sign | ((exp + 7) << 3) | mant


def e4m3_value(b: int) -> float:
    s = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 0xF, b & 7
    if e == 0xF and m == 7:
        return float("nan")
    return s * (m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def ref_fp8_rows(x: torch.Tensor) -> tuple[list[list[int]], list[float]]:
    rows, scales = [], []
    for row in x.double().tolist():
        finite = [abs(v) for v in row if math.isfinite(v)]
        amax = max(finite, default=0.0)
        exp = min(127, max(-126, math.frexp(448.0 / amax)[1] - 1)) if amax else 0
        scale = 2.0 ** exp  # fp32 powers of two: exponent in [-126, 127]
        rows.append([e4m3_bits(v * scale) for v in row])
        scales.append(1.0 / scale)
    return rows, scales


def ref_mx_rows(x: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
    rows, scales = [], []
    for row in x.double().tolist():
        bits, sc = [], []
        for i in range(0, len(row), 32):
            block = row[i:i + 32]
            if not all(math.isfinite(v) for v in block):
                sc.append(255)
                bits += [0x7F] * len(block)
                continue
            amax = max(abs(v) for v in block)
            shared = -127 if amax == 0 else max(-127, min(127, math.frexp(amax)[1] - 1 - 8))
            sc.append(shared + 127)
            bits += [e4m3_bits(v / 2.0 ** shared) for v in block]
        rows.append(bits)
        scales.append(sc)
    return rows, scales


def nasty_rows(k: int = 70) -> torch.Tensor:
    """fp32 rows with ties, saturation, subnormals, zeros, NaN, Inf and tiny magnitudes."""
    torch.manual_seed(5)
    x = torch.randn(12, k) * torch.logspace(-3, 3, 12).unsqueeze(1)
    x[1] = 0.0
    x[2, :] = torch.tensor([2.0 ** -9 * j for j in range(k)])  # e4m3 subnormal grid and ties
    x[3, 7] = float("nan")
    x[4, min(40, k - 1)] = float("inf")
    x[5, 0] = -float("inf")
    x[6] = torch.tensor([1e-40 * (j + 1) for j in range(k)])  # fp32 subnormals
    x[7, :4] = torch.tensor([448.0, 464.0, 480.0, -1e6])
    x[8] = torch.tensor([(1 + (2 * j + 1) / 16) for j in range(k)])  # exact E4M3 ties
    x[9] = -0.0
    x[10, min(33, k - 1)] = 3e38
    return x


def bytes_of(data: torch.Tensor) -> list[list[int]]:
    return data.view(torch.uint8).reshape(-1, data.shape[-1]).tolist()


def same_bits(actual: list[list[int]], expected: list[list[int]], what: str) -> None:
    for r, (a_row, e_row) in enumerate(zip(actual, expected)):
        for c, (a, e) in enumerate(zip(a_row, e_row)):
            if (e & 0x7F) == 0x7F:  # NaN: any sign
                assert (a & 0x7F) == 0x7F, f"{what}[{r},{c}]: {a:#x}, expected NaN"
            else:
                assert a == e, f"{what}[{r},{c}]: {a:#04x} != expected {e:#04x}"


# ------------------------------------------------------------------------------ numerics
def test_e4m3_reference_self_check():
    assert [e4m3_bits(v) for v in (448.0, 1.0, 2.0 ** -9, 2.0 ** -6, 0.0, 500.0)] == [
        0x7E, 0x38, 0x01, 0x08, 0x00, 0x7E]
    for b in range(256):
        v = e4m3_value(b)
        if not math.isnan(v):
            assert e4m3_bits(v) == b or v == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_rowwise_bytes_match_spec(dtype):
    x = nasty_rows().to(dtype)
    q = Float8CurrentScalingQuantizer()(x)
    assert q.rowwise_data.dtype == torch.float8_e4m3fn and q.rowwise_data.shape == x.shape
    assert q.rowwise_scale_inv.dtype == torch.float32 and q.rowwise_scale_inv.shape == (12,)
    bits, scale_inv = ref_fp8_rows(x)
    same_bits(bytes_of(q.rowwise_data), bits, "fp8 rowwise")
    assert q.rowwise_scale_inv.tolist() == scale_inv
    deq = q.dequantize(torch.float32)
    exp = torch.tensor([[e4m3_value(b) * s for b in row] for row, s in zip(bits, scale_inv)])
    torch.testing.assert_close(deq, exp.float(), equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("k", [70, 64, 31])
def test_mxfp8_rowwise_bytes_match_ocp_mx(k):
    x = nasty_rows(k)
    q = MXFP8Quantizer()(x)
    assert q.rowwise_data.dtype == torch.float8_e4m3fn and q.rowwise_data.shape == x.shape
    assert q.rowwise_scale_inv.dtype == torch.uint8
    assert q.rowwise_scale_inv.shape == (12, -(-k // 32))
    bits, scales = ref_mx_rows(x)
    assert q.rowwise_scale_inv.tolist() == scales
    same_bits(bytes_of(q.rowwise_data), bits, "mx rowwise")
    if hasattr(torch, "float8_e8m0fnu"):  # the bytes are E8M0 as torch knows it
        finite = q.rowwise_scale_inv != 255
        as_e8m0 = q.rowwise_scale_inv.view(torch.float8_e8m0fnu).float()
        assert torch.equal(as_e8m0[finite],
                           torch.exp2(q.rowwise_scale_inv[finite].float() - 127))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_nonfinite_row_does_not_touch_other_rows(fmt):
    x = torch.randn(6, 64)
    clean = QUANTIZERS[fmt]()(x)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[2, 5] = bad
        q = QUANTIZERS[fmt]()(y)
        keep = [0, 1, 3, 4, 5]
        assert torch.equal(q.rowwise_scale_inv[keep], clean.rowwise_scale_inv[keep])
        assert torch.equal(q.rowwise_data.view(torch.uint8)[keep],
                           clean.rowwise_data.view(torch.uint8)[keep])
        assert torch.isnan(q.dequantize()[2, 5])


def test_fp8_finite_values_keep_their_scale_next_to_inf():
    x = torch.tensor([[1.0, 2.0, float("inf"), -3.0]])
    q = Float8CurrentScalingQuantizer()(x)
    assert q.rowwise_scale_inv.item() == 1 / 128  # 448 / 3 -> 2**7
    d = q.dequantize()
    assert d[0, [0, 1, 3]].tolist() == [1.0, 2.0, -3.0] and torch.isnan(d[0, 2])


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
@pytest.mark.parametrize("sizes", [[5, 0, 37, 16], [64, 32, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
def test_columnwise_split_is_per_group_and_aligned(fmt, sizes):
    rows = sum(sizes) + 3  # + padding rows holding garbage
    x = torch.randn(rows, 40) * 10
    x[sum(sizes):] = 1e30
    splits = make_splits(torch.tensor(sizes), len(sizes), rows, torch.device("cpu"))
    q = QUANTIZERS[fmt](rowwise=False, columnwise=True)(x, splits)
    assert q.rowwise_data is None and isinstance(q, QuantizedTensorStorage)
    align = 16 if fmt == "fp8" else 32
    cap = q.columnwise_data.shape[1]
    assert q.columnwise_data.shape[0] == 40 and cap % align == 0
    data = q.columnwise_data.view(torch.uint8)
    start, pstart = 0, 0
    for g, m in enumerate(sizes):
        block = x[start:start + m].t()  # (K, m): this group's columns
        got = data[:, pstart:pstart + m].tolist()
        if fmt == "fp8":
            bits, sinv = ref_fp8_rows(block)
            assert q.columnwise_scale_inv[g].tolist() == sinv
        else:
            bits, sc = ref_mx_rows(block)
            nblk = -(-m // 32)
            assert q.columnwise_scale_inv[:, pstart // 32:pstart // 32 + nblk].tolist() == sc
        same_bits(got, bits, f"group {g}")
        start += m
        pstart += -(-m // align) * align
    assert not data[:, pstart:].any(), "gaps and unused capacity are zero"
    deq = q.dequantize()
    deq_rows = QUANTIZERS[fmt]()(x).dequantize()  # not equal (other axis) but same zeros
    assert deq.shape == x.shape and not deq[sum(sizes):].any()
    assert deq_rows.shape == x.shape


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_weight_columnwise_is_rowwise_of_transpose(fmt):
    w = torch.randn(3, 48, 40)
    q = QUANTIZERS[fmt](rowwise=True, columnwise=True)(w)
    t = QUANTIZERS[fmt]()(w.transpose(-2, -1).contiguous())
    assert q.columnwise_data.shape == (3, 40, 48)
    assert torch.equal(q.columnwise_data.view(torch.uint8), t.rowwise_data.view(torch.uint8))
    assert torch.equal(q.columnwise_scale_inv, t.rowwise_scale_inv)


def test_quantizer_errors():
    with pytest.raises(ValueError, match="rowwise=True or columnwise=True"):
        Float8CurrentScalingQuantizer(rowwise=False, columnwise=False)
    with pytest.raises(TypeError, match="float32 or bfloat16.*float16"):
        Float8CurrentScalingQuantizer()(torch.zeros(2, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="2-D or 3-D"):
        MXFP8Quantizer(columnwise=True)(torch.zeros(2, 2, 2, 4))
    with pytest.raises(ValueError, match="role must be one of"):
        Float8CurrentScaling().quantizer("bias", rowwise=True, columnwise=False)


def test_storage_saves_and_restores_quantized_fields():
    x = torch.randn(20, 32)
    splits = make_splits([7, 13], 2, 20, torch.device("cpu"))
    q = Float8CurrentScalingQuantizer(rowwise=True, columnwise=True)(x, splits)
    before = q.dequantize()
    tensors, obj = q.prepare_for_saving()
    assert tensors[0] is not None and tensors[1] is not None and tensors[2] is not None
    assert q.rowwise_data is None and q.columnwise_data is None
    assert obj.restore_from_saved(tensors + ["rest"]) == ["rest"]
    assert torch.equal(q.dequantize(), before)


# ------------------------------------------------------------------------------ GEMMs
@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
def test_quantized_gemms_match_dequantized_fp64(fmt, dtype, backend, use_backend):
    use_backend(backend, "cpu", dtype, (32, 48))
    sizes = [5, 0, 19, 4]
    rows = sum(sizes) + 2
    x = torch.randn(rows, 32, dtype=dtype)
    dy = torch.randn(rows, 48, dtype=dtype)
    w = torch.randn(4, 48, 32, dtype=dtype)
    splits = make_splits(torch.tensor(sizes), 4, rows, torch.device("cpu"))
    choice = select_backend(x.device, dtype, 32, 48, True)
    qf = QUANTIZERS[fmt]
    xq, wq = qf(columnwise=True)(x, splits), qf(columnwise=True)(w)
    dyq = qf(columnwise=True)(dy, splits)
    xc, dyc = qf(rowwise=False, columnwise=True)(x, splits), qf(rowwise=False, columnwise=True)(
        dy, splits)
    xr, wr, dyr = (t.dequantize(torch.float64) for t in (xq, wq, dyq))
    wc = qf(rowwise=False, columnwise=True)(w).dequantize(torch.float64)
    xcd, dycd = xc.dequantize(torch.float64), dyc.dequantize(torch.float64)
    ws = list(wr.unbind(0))
    y_ref = ref.grouped_linear(xr, ws, None, sizes)
    dx_ref = ref.grouped_linear(dyr, [m.t() for m in wc.unbind(0)], None, sizes)
    dw_ref = torch.stack([dycd[s:s + m].t() @ xcd[s:s + m] for s, m in
                          zip(itertools.accumulate([0] + sizes[:-1]), sizes)])
    ref.assert_close(grouped_fprop(xq, wq, splits, choice), y_ref, dtype, "fprop")
    ref.assert_close(grouped_dgrad(dyq, wq, splits, choice), dx_ref, dtype, "dgrad")
    ref.assert_close(grouped_wgrad(xc, dyc, splits, choice), dw_ref, dtype, "wgrad")


def test_quantized_gemm_needs_both_operands_quantized():
    x = torch.randn(8, 16)
    splits = make_splits([8], 1, 8, torch.device("cpu"))
    choice = select_backend(x.device, x.dtype, 16, 16, False)
    with pytest.raises(TypeError, match="both operands must be quantized"):
        grouped_fprop(Float8CurrentScalingQuantizer()(x), torch.randn(1, 16, 16), splits, choice)


def test_native_forced_where_it_cannot_run_raises(monkeypatch):
    monkeypatch.setenv("TE_OPS_QUANTIZED_GEMM", "native")
    blk = te_ops.GroupedLinear(2, 16, 16)
    with te_ops.autocast(recipe=Float8CurrentScaling()), pytest.raises(
            RuntimeError, match="TE_OPS_QUANTIZED_GEMM=native cannot run: no FP8 grouped GEMM"):
        blk(torch.randn(4, 16), [2, 2])


# ------------------------------------------------------------------------------ ops
@pytest.mark.parametrize("recipe", list(RECIPES) + list(HP_RECIPES))
@pytest.mark.parametrize("case_name", ["base", "padding_rows", "zero_token_groups", "empty_batch",
                                       "scale_bias", "nd_input_padding",
                                       "loop_backend_odd_dims"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_four_combinations_bit_identical_under_recipe(monkeypatch, recipe, case_name, dtype):
    case = CASES[case_name]
    torch.manual_seed(0)
    master = make_block(case, dtype)
    inp = make_inputs(case, dtype, "tensor")
    results = {}
    for fwd, bwd in COMBOS:
        set_combo(monkeypatch, fwd, bwd)
        blk = make_block(case, dtype)
        blk.load_state_dict(master.state_dict())
        with te_ops.autocast(recipe={**RECIPES, **HP_RECIPES}[recipe]):
            results[fwd, bwd] = run(blk, case, inp)
        fwd_types, bwd_types = plan_types(blk)
        assert (ForwardGroupedMLP in fwd_types) == fwd
        assert (BackwardGroupedMLP in bwd_types) == bwd
    plain = run(master, case, inp)
    for combo, result in results.items():
        assert_bitwise(result, results[False, False], f"{recipe} {combo} vs unfused")
    if case.rows and sum(case.sizes):  # the recipe really changed the numbers
        (y, grads), (y0, grads0) = results[True, True], plain
        assert not torch.equal(y, y0) or any(
            g is not None and not torch.equal(g, grads0[k]) for k, g in grads.items())


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


#: Stated tolerance (docs/recipes.md): relative Frobenius error of the output and of every
#: gradient against the same block in fp32. E4M3 keeps 3 mantissa bits (about 2.5 % RMS rounding
#: error per element); the OCP MX floor rule puts a block's largest magnitude in [256, 512) and
#: saturates the part above 448 (up to 12.5 % on the element that dominates a dot product), so
#: MXFP8 gets a wider bound. Measured here: FP8 0.05 / 0.07, MXFP8 0.08 / 0.11, blockwise FP8
#: (Float8BlockScaling) 0.05 / 0.07.
GRAD_TOL = {"fp8": {"output": 0.07, "grad": 0.10}, "mxfp8": {"output": 0.10, "grad": 0.15},
            "fp8_block": {"output": 0.07, "grad": 0.10}}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_gradients_close_to_fp32(recipe):
    torch.manual_seed(3)
    blk = te_ops.Sequential(te_ops.GroupedLinear(4, 64, 256), te_ops.ScaledSwiGLU(),
                            te_ops.GroupedLinear(4, 128, 64))
    x = torch.randn(300, 64)
    sizes = torch.tensor([100, 37, 0, 150])
    probs = torch.rand(300)
    dy = torch.randn(300, 64)

    def go(enabled):
        xx = x.clone().requires_grad_(True)
        pp = probs.clone().requires_grad_(True)
        for p in blk.parameters():
            p.grad = None
        with te_ops.autocast(enabled=enabled, recipe=RECIPES[recipe]):
            y = blk(xx, sizes, pp, sizes)
        y.backward(dy)
        grads = {"x": xx.grad, "probs": pp.grad}
        grads.update({n: p.grad.clone() for n, p in blk.named_parameters()})
        return y.detach(), grads

    y0, g0 = go(False)
    y1, g1 = go(True)
    assert rel_err(y1, y0) < GRAD_TOL[recipe]["output"]
    for k in g0:
        if g0[k].abs().sum() == 0:  # empty group's weights
            assert torch.equal(g1[k], g0[k]), k
        else:
            assert rel_err(g1[k], g0[k]) < GRAD_TOL[recipe]["grad"], (k, rel_err(g1[k], g0[k]))


def _gemm_operands(gemm: str, keep: bool, a: torch.Tensor, b: torch.Tensor, splits
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp64 operands one GEMM of a GroupedLinear reads: the tensors themselves when the
    recipe keeps the GEMM in high precision, else their FP8 copies along the reduced dim
    (docs/recipes.md's table), dequantized."""
    if keep:
        return a.detach().double(), b.detach().double()
    q = Float8CurrentScalingQuantizer
    if gemm == "fprop":  # x row-wise, W (G, N, K) row-wise
        return (q()(a).dequantize(torch.float64), q()(b).dequantize(torch.float64))
    if gemm == "dgrad":  # dy row-wise, W column-wise (over N)
        return (q()(a).dequantize(torch.float64),
                q(rowwise=False, columnwise=True)(b).dequantize(torch.float64))
    col = q(rowwise=False, columnwise=True)  # wgrad: x and dy per (expert, column)
    return col(a, splits).dequantize(torch.float64), col(b, splits).dequantize(torch.float64)


@pytest.mark.parametrize("keep", [("fprop",), ("dgrad",), ("wgrad",), ("fprop", "dgrad", "wgrad")])
def test_high_precision_gemms_follow_the_recipe(keep):
    """Each ``*_high_precision`` flag takes exactly its GEMM out of FP8: every GEMM of one
    GroupedLinear matches the fp64 product of the operands it should read (unquantized for the
    kept GEMMs, dequantized FP8 copies for the others)."""
    torch.manual_seed(1)
    sizes, rows = [5, 0, 19, 4], 30  # two padding rows
    blk = te_ops.GroupedLinear(4, 32, 48, bias=False)
    x = torch.randn(rows, 32, requires_grad=True)
    dy = torch.randn(rows, 48)
    dy[sum(sizes):] = 0  # padding rows get no gradient (their output is constant zero)
    recipe = Float8CurrentScaling(**{f"{g}_high_precision": True for g in keep})
    assert recipe.high_precision_gemms() == frozenset(keep)
    with te_ops.autocast(recipe=recipe):
        y = blk(x, torch.tensor(sizes))
    y.backward(dy)
    w = blk.weight.detach()  # (G, N, K)
    splits = make_splits(sizes, 4, rows, torch.device("cpu"))
    xa, wa = _gemm_operands("fprop", "fprop" in keep, x, w, splits)
    ref.assert_close(y, ref.grouped_linear(xa, list(wa.unbind(0)), None, sizes),
                     torch.float32, "fprop")
    dya, wc = _gemm_operands("dgrad", "dgrad" in keep, dy, w, splits)
    ref.assert_close(x.grad, ref.grouped_linear(dya, [m.t() for m in wc.unbind(0)], None,
                                                sizes), torch.float32, "dgrad")
    xc, dyc = _gemm_operands("wgrad", "wgrad" in keep, x, dy, splits)
    starts = itertools.accumulate([0] + sizes[:-1])
    for g, (s, m) in enumerate(zip(starts, sizes)):
        ref.assert_close(blk.weight.grad[g], dyc[s:s + m].t() @ xc[s:s + m],
                         torch.float32, f"wgrad {g}")


def test_wgrad_high_precision_saves_the_input_unquantized():
    blk = te_ops.Sequential(te_ops.GroupedLinear(2, 32, 16))
    x = torch.randn(20, 32, requires_grad=True)
    with te_ops.autocast(recipe=Float8CurrentScaling(wgrad_high_precision=True)):
        y = blk(x, torch.tensor([7, 13]))
        text = blk.explain(x, torch.tensor([7, 13]))
    saved = [t for t in y.grad_fn.saved_tensors if t is not None]
    assert not any(t.dtype == torch.float8_e4m3fn for t in saved)
    assert any(t.dtype == torch.float32 and t.shape == (20, 32) for t in saved)
    assert "wgrad in high precision" in text
    y.sum().backward()
    assert x.grad is not None


def test_recipe_quantizer_is_none_for_high_precision_gemms():
    r = Float8CurrentScaling(wgrad_high_precision=True)
    assert r.quantizer("input", rowwise=False, columnwise=True) is None
    assert r.quantizer("grad_output", rowwise=False, columnwise=True) is None
    assert r.quantizer("grad_output", rowwise=True, columnwise=False) is not None
    # a copy that also feeds a quantized GEMM is still quantized
    assert r.quantizer("input", rowwise=True, columnwise=True) is not None
    assert MXFP8BlockScaling().high_precision_gemms() == frozenset()


@pytest.mark.parametrize("field", ["fast_accumulate_backward", "fprop_high_precision",
                                   "dgrad_high_precision", "wgrad_high_precision"])
def test_recipe_flags_must_be_bools(field):
    with pytest.raises(TypeError, match=f"{field} must be a bool, got int"):
        Float8CurrentScaling(**{field: 1})


def test_autocast_reaches_ops_and_replans():
    blk = te_ops.Sequential(te_ops.GroupedLinear(2, 16, 32), te_ops.SwiGLU(),
                            te_ops.GroupedLinear(2, 16, 16))
    x = torch.randn(10, 16)
    sizes = torch.tensor([4, 6])
    y0 = blk(x, sizes, sizes)
    fuser = blk.fusers()[0]
    assert fuser._plan.info.recipe is None
    with te_ops.autocast(recipe=MXFP8BlockScaling()):
        y1 = blk(x, sizes, sizes)
        assert fuser._plan.info.recipe == MXFP8BlockScaling()
        with te_ops.autocast(enabled=False):
            assert torch.equal(blk(x, sizes, sizes), y0)
        with te_ops.autocast():  # default recipe
            y2 = blk(x, sizes, sizes)
            assert fuser._plan.info.recipe == Float8CurrentScaling()
    assert not torch.equal(y1, y0) and not torch.equal(y2, y1)
    assert torch.equal(blk(x, sizes, sizes), y0) and te_ops.quantization.current_recipe() is None
    with te_ops.autocast(recipe=Float8CurrentScaling()):
        text = blk.explain(x, sizes, sizes)
    assert "recipe Float8CurrentScaling: emulated (no FP8 grouped GEMM kernel on cpu)" in text


def test_autocast_errors():
    with pytest.raises(TypeError, match="recipe must be a te_ops.recipe.Recipe, got str"):
        with te_ops.autocast(recipe="fp8"):
            pass
    blk = te_ops.GroupedLinear(2, 16, 16, dtype=torch.float16)
    with te_ops.autocast(), pytest.raises(TypeError, match="float32 or bfloat16.*float16"):
        blk(torch.randn(4, 16, dtype=torch.float16), [2, 2])


def test_quantized_input_is_saved_columnwise(monkeypatch):
    blk = te_ops.GroupedLinear(2, 32, 16)
    x = torch.randn(20, 32, requires_grad=True)
    with te_ops.autocast(recipe=MXFP8BlockScaling()):
        y = blk(x, torch.tensor([7, 13]))
    node_saved = [t for t in y.grad_fn.saved_tensors if t is not None]
    fp8 = [t for t in node_saved if t.dtype == torch.float8_e4m3fn]
    # x: (K, capacity = round_up(20 + 2 * 31, 32)), no row-wise copy; no weight copy
    # (test_weights_columnwise_not_saved)
    assert [tuple(t.shape) for t in fp8] == [(32, 96)]
    assert not any(t.dtype == torch.float32 and t.shape == (20, 32) for t in node_saved)
    y.sum().backward()
    assert x.grad is not None


def test_main_job_recipe_flag(tmp_path, monkeypatch, capsys):
    from test_examples import TINY

    from te_ops.examples import train_moe

    monkeypatch.setenv("TRAIN_MOE_PROGRESS", "0")
    args = list(TINY)
    args[args.index("--steps") + 1] = "2"
    fp8 = train_moe.main([*args, "--recipe", "fp8", "--out-dir", str(tmp_path / "fp8")])
    assert fp8["config"]["recipe"] == "fp8"
    assert math.isfinite(fp8["final_val_loss"])
    # the recipe reached the experts: the plan printed by the job names it
    assert "recipe Float8CurrentScaling: emulated" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        train_moe.parse_args(["--recipe", "fp4"])


def test_weights_columnwise_not_saved():
    """The forward keeps no FP8 weight copy for dgrad (keeping it measured within noise on the
    H200; the memory is one byte per weight element per layer): backward quantizes them."""
    blk = te_ops.GroupedLinear(2, 32, 16, bias=False)
    with te_ops.autocast(recipe=Float8CurrentScaling()):
        y = blk(torch.randn(20, 32, requires_grad=True), torch.tensor([7, 13]))
    assert not [t for t in y.grad_fn.saved_tensors
                if t is not None and t.dtype == torch.float8_e4m3fn and t.dim() == 3]


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("fused", [False, True])
def test_combined_dy_bit_exact(monkeypatch, recipe, fused):
    """Quantizing dy / dh both ways at once gives the bytes (so the outputs and gradients) of
    quantizing each copy where it is used."""
    import te_ops.basic.grouped_linear as gl

    case = CASES["padding_rows"]
    torch.manual_seed(0)
    master = make_block(case, torch.float32)
    inp = make_inputs(case, torch.float32, "tensor")
    set_combo(monkeypatch, fused, fused)
    results = []
    for combined in (True, False):
        monkeypatch.setattr(gl.GroupedLinear, "quantize_grad_output",
                            staticmethod(gl.GroupedLinear.quantize_grad_output) if combined
                            else staticmethod(lambda saved, dy2d, need_dgrad: None))
        blk = make_block(case, torch.float32)
        blk.load_state_dict(master.state_dict())
        with te_ops.autocast(recipe=RECIPES[recipe]):
            results.append(run(blk, case, inp))
    assert_bitwise(results[0], results[1], f"{recipe} fused={fused}")


@pytest.mark.parametrize("fmt", list(QUANTIZERS))
def test_both_copies_equal_separate_copies(fmt):
    """One quantizer call for both copies gives the bytes of two single-copy calls (split
    activations with padding rows and an empty group; uniform weights)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(70, 48, generator=gen) * 9
    x[3, 2] = float("nan")
    sizes = [17, 0, 33, 1]  # 19 padding rows
    cls = QUANTIZERS[fmt]
    w = torch.randn(3, 40, 48, generator=gen)
    for t, splits in ((x, sizes), (w, None)):
        both = cls(rowwise=True, columnwise=True)(t, splits)
        row = cls(rowwise=True, columnwise=False)(t, splits)
        col = cls(rowwise=False, columnwise=True)(t, splits)
        for a, b in ((both.rowwise_data, row.rowwise_data),
                     (both.columnwise_data, col.columnwise_data)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert torch.equal(both.rowwise_scale_inv, row.rowwise_scale_inv)
        assert torch.equal(both.columnwise_scale_inv, col.columnwise_scale_inv)
