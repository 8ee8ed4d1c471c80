"""Blockwise FP8 (``Float8BlockScaling``): quantized bytes and scales against a reference written
here from the DeepSeek-V3 paper and TransformerEngine's rule, the blockwise GEMM emulation
against a float64 per-expert product of the dequantized operands, the recipe through the ops
(four-way fused x unfused bit-exact with several 128-blocks per dim, ``torch.compile``, a few
training steps) and the recipe's argument checks.

Reference (independent of te_ops; plain Python floats, numpy only for fp32 rounding):

* Tiles: activations and gradients 1 x 128 along the reduced dim, weights 128 x 128 (DeepSeek-V3,
  arXiv:2412.19437, section 3.3.2); a last partial tile holds the valid elements only.
* Scale (TransformerEngine ``compute_scale_from_amax``): ``amax`` = largest finite magnitude of
  the tile (te_ops leaves NaN / Inf out), raised to ``amax_epsilon``; 0 -> scale 1; else
  ``scale = fp32(448 / amax)``, the input dtype's largest finite value where that is infinite,
  and with power-of-two scales the fp32 mantissa bits cleared. ``scale_inv = fp32(1 / scale)``.
* Elements: ``e4m3(fp32(v * scale))`` (saturating, NaN / Inf -> NaN; ``test_quantization``'s
  ``e4m3_bits``).
"""

from __future__ import annotations

import itertools
import math
import struct

import numpy as np
import pytest
import reference as ref
import torch
import torch.nn.functional as F
from test_fused_grouped_mlp import (
    COMBOS,
    Case,
    assert_bitwise,
    make_block,
    make_inputs,
    plan_types,
    run,
    set_combo,
)
from test_quantization import bytes_of, e4m3_bits, same_bits

import te_ops
from te_ops.fused.grouped_mlp import BackwardGroupedMLP, ForwardGroupedMLP
from te_ops.gemm.dispatch import grouped_dgrad, grouped_fprop, grouped_wgrad, select_backend
from te_ops.quantization import Float8BlockQuantizer
from te_ops.recipe import Float8BlockScaling
from te_ops.splits import make_splits

F32 = np.float32


# ------------------------------------------------------------------------------ reference
def ref_scale(amax: float, pow2: bool, eps: float, in_max: float) -> float:
    amax = max(float(F32(amax)), eps)
    if amax == 0:
        return 1.0
    with np.errstate(over="ignore"):
        scale = F32(448.0) / F32(amax)
    if math.isinf(scale):
        scale = F32(in_max)
    if pow2:  # clear the fp32 mantissa bits
        bits = struct.unpack("<I", struct.pack("<f", float(scale)))[0] & 0xFF800000
        scale = F32(struct.unpack("<f", struct.pack("<I", bits))[0])
    return float(scale)


def ref_tile(values: list[float], pow2: bool, eps: float, in_max: float
             ) -> tuple[list[int], float]:
    """E4M3 bytes and scale_inv of one tile."""
    amax = max((abs(v) for v in values if math.isfinite(v)), default=0.0)
    scale = ref_scale(amax, pow2, eps, in_max)
    return ([e4m3_bits(float(F32(v) * F32(scale))) if math.isfinite(v) else 0x7F
             for v in values], float(F32(1.0) / F32(scale)))


def ref_rows(x: torch.Tensor, pow2: bool = True, eps: float = 0.0
             ) -> tuple[list[list[int]], list[list[float]]]:
    """1 x 128 tiles along the last dim of 2-D ``x``."""
    in_max = torch.finfo(x.dtype).max
    bits, scales = [], []
    for row in x.double().tolist():
        rb, rs = [], []
        for i in range(0, len(row), 128):
            b, s = ref_tile(row[i:i + 128], pow2, eps, in_max)
            rb += b
            rs.append(s)
        bits.append(rb)
        scales.append(rs)
    return bits, scales


def ref_blocks(w: torch.Tensor, pow2: bool = True, eps: float = 0.0
               ) -> tuple[list[list[int]], list[list[float]]]:
    """128 x 128 blocks of 2-D ``w``: bytes (rows, cols) and scale_inv per block."""
    in_max = torch.finfo(w.dtype).max
    vals = w.double().tolist()
    rows, cols = len(vals), len(vals[0])
    bits = [[0] * cols for _ in range(rows)]
    scales = []
    for r0 in range(0, rows, 128):
        srow = []
        for c0 in range(0, cols, 128):
            idx = [(r, c) for r in range(r0, min(rows, r0 + 128))
                   for c in range(c0, min(cols, c0 + 128))]
            b, s = ref_tile([vals[r][c] for r, c in idx], pow2, eps, in_max)
            for (r, c), v in zip(idx, b):
                bits[r][c] = v
            srow.append(s)
        scales.append(srow)
    return bits, scales


def tricky_rows(k: int = 300) -> torch.Tensor:
    """Rows of ``k`` (3 tiles: 128, 128, 44) with a random, an all-zero, a tiny (1e-30), a huge
    (1e30), a NaN / Inf-holding and an fp32-subnormal tile, saturation and E4M3 ties."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(8, k, generator=gen) * 3
    x[0, 128:256] = 0.0
    x[1, :128] *= 1e-30
    x[1, 256:] *= 1e30
    x[2, 5] = float("nan")
    x[2, 130] = float("inf")
    x[2, 260] = -float("inf")
    x[3, 256:] = 1e-40 * torch.arange(1, k - 255)
    x[4, :4] = torch.tensor([448.0, 464.0, -1e6, 1.0])
    x[5, 128:256] = torch.tensor([1 + (2 * j + 1) / 16 for j in range(128)])
    x[6] = 0.0
    x[7, 256:] = 1e-3  # the partial tile alone: its scale from its own 44 elements
    x[7, :256] = 100.0
    return x


def deq(bits: list[list[int]], scales: list[list[float]], tile_of) -> torch.Tensor:
    """The values ``e4m3 * scale_inv``, the product rounded to fp32."""
    from test_quantization import e4m3_value
    return torch.tensor([[float(F32(e4m3_value(b)) * F32(scales[r][tile_of(r, c)]))
                          for c, b in enumerate(row)] for r, row in enumerate(bits)],
                        dtype=torch.float64)


# ------------------------------------------------------------------------------ numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pow2,eps", [(True, 0.0), (False, 0.0), (True, 1e-3), (False, 1e-3)])
def test_rowwise_tiles_match_reference(dtype, pow2, eps):
    x = tricky_rows().to(dtype)
    q = Float8BlockQuantizer(force_pow_2_scales=pow2, amax_epsilon=eps)(x)
    assert q.rowwise_data.dtype == torch.float8_e4m3fn and q.rowwise_data.shape == x.shape
    assert q.rowwise_scale_inv.dtype == torch.float32 and q.rowwise_scale_inv.shape == (8, 3)
    bits, scales = ref_rows(x, pow2, eps)
    same_bits(bytes_of(q.rowwise_data), bits, "1x128 rowwise")
    assert q.rowwise_scale_inv.tolist() == scales
    got = q.dequantize(torch.float64)
    exp = deq(bits, scales, lambda r, c: c // 128)
    torch.testing.assert_close(got, exp, equal_nan=True, rtol=0, atol=0)


def test_scale_rules_at_the_edges():
    """Zero tile -> scale 1; pow2 is 448 / amax rounded down to a power of two; NaN / Inf
    leave the finite values' scale alone and quantize to NaN; a tile's NaN touches no other
    tile; epsilon raises a zero tile's amax."""
    x = torch.zeros(1, 384)
    x[0, 128:131] = torch.tensor([3.0, float("nan"), float("inf")])
    x[0, 256:259] = torch.tensor([1.0, 2.0, -3.0])
    q = Float8BlockQuantizer()(x)
    assert q.rowwise_scale_inv.tolist() == [[1.0, 1 / 128, 1 / 128]]  # 448 / 3 -> 2**7
    d = q.dequantize()
    assert d[0, 128].item() == 3.0 and torch.isnan(d[0, 129:131]).all()
    assert d[0, 256:259].tolist() == [1.0, 2.0, -3.0]
    q = Float8BlockQuantizer(force_pow_2_scales=False)(x)
    assert q.rowwise_scale_inv[0, 1].item() == float(F32(1) / (F32(448) / F32(3)))
    q = Float8BlockQuantizer(amax_epsilon=0.5)(x)
    assert q.rowwise_scale_inv[0, 0].item() == 2.0 ** -9  # 448 / 0.5 = 896 -> 2**9


@pytest.mark.parametrize("pow2", [True, False])
def test_weight_blocks_match_reference_and_transpose(pow2):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(2, 200, 300, generator=gen)
    w[0, :128, 128:256] = 0.0
    w[0, 128:, :128] *= 1e30
    w[1, 5, 5] = float("nan")
    w[1, 150:, 256:] *= 1e-30
    q = Float8BlockQuantizer(rowwise=True, columnwise=True, block_dim=2,
                             force_pow_2_scales=pow2)(w)
    assert q.rowwise_scale_inv.shape == (2, 2, 3) and q.columnwise_scale_inv.shape == (2, 3, 2)
    assert q.columnwise_data.shape == (2, 300, 200)
    for g in range(2):
        bits, scales = ref_blocks(w[g], pow2)
        same_bits(bytes_of(q.rowwise_data[g]), bits, f"128x128 group {g}")
        assert q.rowwise_scale_inv[g].tolist() == scales
    # dgrad's copy: the same blocks transposed, bytes and scales (TE's 2-D transpose)
    assert torch.equal(q.columnwise_data.view(torch.uint8),
                       q.rowwise_data.view(torch.uint8).transpose(1, 2))
    assert torch.equal(q.columnwise_scale_inv, q.rowwise_scale_inv.transpose(1, 2))
    torch.testing.assert_close(q.dequantize(copy="columnwise"), q.dequantize(copy="rowwise"),
                               equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("sizes", [[130, 0, 5, 300], [0, 0, 0, 0], [128, 256, 1, 127]])
def test_token_tiles_restart_at_each_expert(sizes):
    """wgrad's copies: 128 x 1 tiles along each expert's tokens, the first at its first row,
    the last partial one over its own rows; gaps and unused capacity zero; padding rows out."""
    rows = sum(sizes) + 3
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(rows, 20, generator=gen) * torch.logspace(-2, 2, rows).unsqueeze(1)
    x[sum(sizes):] = 1e30  # padding rows: never in any tile
    if sizes[0]:
        x[min(2, sizes[0] - 1), 3] = float("nan")
    splits = make_splits(torch.tensor(sizes), len(sizes), rows, torch.device("cpu"))
    q = Float8BlockQuantizer(rowwise=False, columnwise=True)(x, splits)
    cap = q.columnwise_data.shape[1]
    assert cap % 128 == 0 and q.columnwise_scale_inv.shape == (20, cap // 128)
    data = q.columnwise_data.view(torch.uint8)
    start, pstart = 0, 0
    for g, m in enumerate(sizes):
        bits, scales = ref_rows(x[start:start + m].t())  # (K, m): tiles from the group's row 0
        same_bits(data[:, pstart:pstart + m].tolist(), bits, f"group {g}")
        nt = -(-m // 128)
        if m:
            assert q.columnwise_scale_inv[:, pstart // 128:pstart // 128 + nt].tolist() == scales
        assert not data[:, pstart + m:pstart + nt * 128].any(), "tail of the last tile"
        start += m
        pstart += nt * 128
    assert not data[:, pstart:].any() and (q.columnwise_scale_inv[:, pstart // 128:] == 1).all()
    back = q.dequantize()
    assert back.shape == x.shape and not back[sum(sizes):].any()


def test_quantizer_and_recipe_errors():
    with pytest.raises(ValueError, match="block_dim must be 1 .* or 2 .*got 3"):
        Float8BlockQuantizer(block_dim=3)
    with pytest.raises(ValueError, match="block_dim=2.*uniform .G, N, K.*split"):
        Float8BlockQuantizer(columnwise=True, block_dim=2)(torch.zeros(4, 8), [4])
    with pytest.raises(ValueError, match="block_dim=2.*at least 2 dims"):
        Float8BlockQuantizer(block_dim=2)(torch.zeros(8))
    with pytest.raises(TypeError, match="force_pow_2_scales must be a bool, got int"):
        Float8BlockScaling(force_pow_2_scales=1)
    with pytest.raises(TypeError, match="amax_epsilon must be a float, got str"):
        Float8BlockScaling(amax_epsilon="0")
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="amax_epsilon must be finite and >= 0"):
            Float8BlockScaling(amax_epsilon=bad)
    assert Float8BlockScaling(amax_epsilon=0).amax_epsilon == 0.0
    r = Float8BlockScaling()
    assert r.quantizer("weight", rowwise=True, columnwise=False).block_dim == 2
    assert r.quantizer("input", rowwise=True, columnwise=False).block_dim == 1
    assert r.quantizer("grad_output", rowwise=True, columnwise=True).block_dim == 1


# ------------------------------------------------------------------------------ GEMMs
def _dequantized_reference(sizes, x, w, dy, pow2):
    q = Float8BlockQuantizer
    rows = x.shape[0]
    splits = make_splits(torch.tensor(sizes), len(sizes), rows, torch.device("cpu"))
    xq = q(rowwise=True, columnwise=True, force_pow_2_scales=pow2)(x, splits)
    dyq = q(rowwise=True, columnwise=True, force_pow_2_scales=pow2)(dy, splits)
    wq = q(rowwise=True, columnwise=True, block_dim=2, force_pow_2_scales=pow2)(w)
    xr, dyr, wr = (t.dequantize(torch.float64) for t in (xq, dyq, wq))
    xc, dyc = (t.dequantize(torch.float64, copy="columnwise") for t in (xq, dyq))
    starts = list(itertools.accumulate([0] + sizes[:-1]))
    y = torch.zeros(rows, w.shape[1], dtype=torch.float64)
    dx = torch.zeros(rows, w.shape[2], dtype=torch.float64)
    for g, (s, m) in enumerate(zip(starts, sizes)):
        y[s:s + m] = F.linear(xr[s:s + m], wr[g])
        dx[s:s + m] = F.linear(dyr[s:s + m], wr[g].t())
    dw = torch.stack([F.linear(dyc[s:s + m].t(), xc[s:s + m].t()) for s, m in zip(starts, sizes)])
    return splits, (xq, wq, dyq), (y, dx, dw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("sizes", [[5, 0, 140, 40], [0, 0, 0, 0], [256, 1]])
def test_emulated_gemms_match_float64_per_expert_linear(dtype, pow2, sizes):
    rows = sum(sizes) + 3  # three padding rows
    gen = torch.Generator().manual_seed(2)
    k, n = 200, 136  # two 128-blocks each, the second partial
    x = torch.randn(rows, k, generator=gen).to(dtype)
    dy = torch.randn(rows, n, generator=gen).to(dtype)
    w = torch.randn(len(sizes), n, k, generator=gen).to(dtype)
    splits, (xq, wq, dyq), (y, dx, dw) = _dequantized_reference(sizes, x, w, dy, pow2)
    choice = select_backend(x.device, dtype, k, n, True)
    ref.assert_close(grouped_fprop(xq, wq, splits, choice), y, dtype, "fprop")
    ref.assert_close(grouped_dgrad(dyq, wq, splits, choice), dx, dtype, "dgrad")
    ref.assert_close(grouped_wgrad(xq, dyq, splits, choice), dw, dtype, "wgrad")


def test_native_forced_where_it_cannot_run_raises(monkeypatch):
    monkeypatch.setenv("TE_OPS_QUANTIZED_GEMM", "native")
    blk = te_ops.GroupedLinear(2, 16, 16)
    with te_ops.autocast(recipe=Float8BlockScaling()), pytest.raises(
            RuntimeError, match="TE_OPS_QUANTIZED_GEMM=native cannot run: no blockwise FP8 "
                                "grouped GEMM kernel on cpu"):
        blk(torch.randn(4, 16), [2, 2])


# ------------------------------------------------------------------------------ ops
#: Dims with two 128-blocks (the second partial) in every reduced dim of the block's GEMMs.
WIDE = Case(groups=3, hidden=160, ffn=136, out=144, sizes=(130, 0, 60), lead=(195,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pow2", [True, False])
def test_four_combinations_bit_identical_wide(monkeypatch, dtype, pow2):
    torch.manual_seed(0)
    master = make_block(WIDE, dtype)
    inp = make_inputs(WIDE, dtype, "tensor")
    recipe = Float8BlockScaling(force_pow_2_scales=pow2)
    results = {}
    for fwd, bwd in COMBOS:
        set_combo(monkeypatch, fwd, bwd)
        blk = make_block(WIDE, dtype)
        blk.load_state_dict(master.state_dict())
        with te_ops.autocast(recipe=recipe):
            results[fwd, bwd] = run(blk, WIDE, inp)
        fwd_types, bwd_types = plan_types(blk)
        assert (ForwardGroupedMLP in fwd_types) == fwd
        assert (BackwardGroupedMLP in bwd_types) == bwd
    for combo, result in results.items():
        assert_bitwise(result, results[False, False], f"fp8_block {combo} vs unfused")


def test_explain_names_the_emulation():
    blk = te_ops.Sequential(te_ops.GroupedLinear(2, 32, 16))
    x = torch.randn(20, 32)
    with te_ops.autocast(recipe=Float8BlockScaling()):
        text = blk.explain(x, torch.tensor([7, 13]))
    assert "recipe Float8BlockScaling: emulated (no blockwise FP8 grouped GEMM kernel on cpu)" \
        in text


def test_weights_and_input_saved_as_blockwise_fp8():
    """The forward keeps x's column-wise copy (K, capacity) with its token-tile scales; no
    weight copy (backward quantizes the weights: the same 128 x 128 blocks)."""
    blk = te_ops.GroupedLinear(2, 32, 16, bias=False)
    x = torch.randn(20, 32, requires_grad=True)
    with te_ops.autocast(recipe=Float8BlockScaling()):
        y = blk(x, torch.tensor([7, 13]))
    saved = [t for t in y.grad_fn.saved_tensors if t is not None]
    fp8 = [tuple(t.shape) for t in saved if t.dtype == torch.float8_e4m3fn]
    assert fp8 == [(32, 384)]  # round_up(20 + 2 * 127, 128) aligned tokens
    assert any(t.dtype == torch.float32 and tuple(t.shape) == (32, 3) for t in saved)
    y.sum().backward()
    assert x.grad is not None and blk.weight.grad is not None


def test_training_steps_track_the_unquantized_run():
    """Eight Adam steps of the expert block (fused, device split sizes) under the recipe and
    without it, from the same weights: the recipe's losses are finite, fall, and stay within
    5 % of the unquantized run's at every step; every expert with tokens moves."""
    def train(recipe):
        torch.manual_seed(4)
        blk = te_ops.Sequential(te_ops.GroupedLinear(4, 64, 256), te_ops.ScaledSwiGLU(),
                                te_ops.GroupedLinear(4, 128, 64))
        gen = torch.Generator().manual_seed(5)
        x, target = torch.randn(300, 64, generator=gen), torch.randn(300, 64, generator=gen)
        sizes, probs = torch.tensor([100, 37, 0, 163]), torch.rand(300, generator=gen)
        before = blk[0].weight.detach().clone()
        opt = torch.optim.Adam(blk.parameters(), lr=1e-2)
        losses = []
        for _ in range(8):
            opt.zero_grad()
            with te_ops.autocast(enabled=recipe is not None, recipe=recipe):
                loss = F.mse_loss(blk(x, sizes, probs, sizes), target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        moved = (blk[0].weight.detach() != before).flatten(1).any(1).tolist()
        return losses, moved

    fp8, moved = train(Float8BlockScaling())
    plain, _ = train(None)
    assert all(math.isfinite(v) for v in fp8) and fp8[-1] < 0.9 * fp8[0], fp8
    assert all(abs(a - b) < 0.05 * b for a, b in zip(fp8, plain)), (fp8, plain)
    assert moved == [True, True, False, True]  # expert 2 gets no tokens


def test_main_job_recipe_flag(tmp_path, monkeypatch, capsys):
    from test_examples import TINY

    from te_ops.examples import train_moe

    monkeypatch.setenv("TRAIN_MOE_PROGRESS", "0")
    args = list(TINY)
    args[args.index("--steps") + 1] = "2"
    res = train_moe.main([*args, "--recipe", "fp8block", "--out-dir", str(tmp_path)])
    assert res["config"]["recipe"] == "fp8block" and math.isfinite(res["final_val_loss"])
    assert "recipe Float8BlockScaling: emulated" in capsys.readouterr().out


@pytest.mark.parametrize("fusion", ["0", "1"])
def test_meta_forward_backward_reads_no_device_value(monkeypatch, fusion):
    """The CPU proof of graph safety (docs/graph_safety.md): forward and backward of the block
    under the recipe with every tensor on the meta device (no values: a host read raises)."""
    from test_graph_safety import inputs
    from test_graph_safety import make_block as meta_block

    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    monkeypatch.setenv("TE_OPS_GRAPH_SAFE", "1")
    block = meta_block(device="meta", hidden=160, ffn=136)
    x, sizes, probs = inputs("meta", hidden=160)
    with te_ops.autocast(recipe=Float8BlockScaling()):
        y = block(x, sizes, probs, sizes)
    y.backward(torch.empty_like(y))
    assert y.device.type == "meta" and y.shape == x.shape
    assert x.grad is not None and x.grad.shape == x.shape
    assert all(p.grad is not None and p.grad.shape == p.shape for p in block.parameters())
