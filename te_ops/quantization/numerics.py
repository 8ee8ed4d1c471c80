"""Quantize / dequantize kernels of the low-precision recipes (PyTorch ops, on the device).

Element format: OCP 8-bit floating point E4M3 (``torch.float8_e4m3fn``): max normal 448, no
infinities, NaN = ``0x7F`` / ``0xFF``. Conversions round to nearest, ties to even (RNE), after the
scaled value is clamped to ±448 (saturation); NaN stays NaN and ±Inf becomes NaN (E4M3 has no
infinity, and saturating an overflow to a finite value would hide it).

Three scalings
--------------
FP8 current scaling (:func:`fp8_quantize_rows`)
    one fp32 scale per row of the last dim, computed from the current tensor:
    ``scale = 2 ** floor(log2(448 / amax))`` (a power of two, as torchao's FP8 rowwise MoE
    training rounds its scales; dequantization ``q * scale_inv`` is then exact in bf16 and fp32),
    the exponent clamped to [-126, 127] (fp32's normal powers of two).
    ``amax`` is the largest *finite* magnitude of the row (NaN / ±Inf are left out, so they do not
    wipe out the scale of the finite values); an all-zero row gets scale 1.
MXFP8 (:func:`mx_quantize_rows`)
    OCP Microscaling Formats (MX) v1.0, section 6.3: blocks of 32 consecutive elements along the
    last dim share one E8M0 scale ``X = 2 ** (floor(log2(amax)) - 8)`` (8 = the exponent of E4M3's
    largest normal), stored as the biased exponent byte ``e + 127`` clamped to [0, 254];
    elements are ``RNE(clamp(v / X, ±448))``. A block holding NaN or ±Inf gets the E8M0 NaN byte
    ``0xFF`` and NaN elements; an all-zero block gets the smallest scale (byte 0) and zeros. A last
    partial block (last dim not a multiple of 32) is a block of its own.
Blockwise FP8 (:func:`block_quantize_rows`, :func:`block_quantize_2d`)
    DeepSeek-V3 / TransformerEngine ``Float8BlockScaling``: one fp32 scale per 1 x 128 tile
    (activations, gradients) or 128 x 128 block (weights) from the tile's largest finite
    magnitude, by TransformerEngine's ``compute_scale_from_amax`` (:func:`block_scale_from_amax`;
    power-of-two or plain fp32 scales, an amax floor); partial tiles at the edges are tiles of
    their own.

Everything runs as device tensor ops: no host reads, so quantizing is graph-safe.
"""

from __future__ import annotations

import torch

from ..tracing import tracing

__all__ = [
    "E4M3_MAX",
    "MX_BLOCK",
    "fp8_quantize_rows",
    "fp8_dequantize_rows",
    "mx_quantize_rows",
    "mx_dequantize_rows",
    "e8m0_to_float",
    "FP8_BLOCK",
    "block_scale_from_amax",
    "block_quantize_rows",
    "block_dequantize_rows",
    "block_quantize_2d",
    "block_dequantize_2d",
]

E4M3_MAX = 448.0
#: log2 of E4M3's largest power of two (emax of the element format, OCP MX v1.0 table 2).
E4M3_EMAX = 8
MX_BLOCK = 32
FP8 = torch.float8_e4m3fn


def to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> E4M3 with saturation; NaN and ±Inf -> NaN."""
    finite = torch.isfinite(v)
    v = torch.where(finite, v.clamp(-E4M3_MAX, E4M3_MAX), torch.full_like(v, float("nan")))
    return v.to(FP8)


def finite_abs(x: torch.Tensor) -> torch.Tensor:
    a = x.float().abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a))


def pow2_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """fp32 ``2 ** floor(log2(448 / amax))``, the exponent clamped to [-126, 127]; 1 where
    ``amax`` is 0.

    With ``amax = m * 2**e`` (``frexp``, m in [0.5, 1)): ``448 / amax = (448 / m) * 2**-e`` and
    ``448 / m`` lies in (448, 896], so ``floor(log2(448 / amax)) = -e + (8 if m > 0.875 else 9)``
    (``448 / 0.875 = 512``). Exact, no division and no float64 (inductor's CPU code for a
    float64 ``frexp`` does not compile).
    """
    amax = amax.float()
    m, e = torch.frexp(amax)
    exp = torch.where(m > 0.875, 8 - e, 9 - e).clamp(-126, 127)
    scale = torch.ldexp(torch.ones_like(amax), exp)
    return torch.where(amax > 0, scale, torch.ones_like(amax))


def fp8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Current scaling along the last dim.

    Shapes: x (..., K) any float dtype -> data (..., K) float8_e4m3fn, scale_inv (...,) fp32
    (``x ≈ data * scale_inv[..., None]``).
    """
    amax = finite_abs(x).amax(-1) if x.shape[-1] else x.new_zeros(x.shape[:-1]).float()
    scale = pow2_scale_from_amax(amax)
    data = to_e4m3(x.float() * scale.unsqueeze(-1))
    return data, scale.reciprocal()


def fp8_dequantize_rows(data: torch.Tensor, scale_inv: torch.Tensor,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * scale_inv[..., None]`` in ``dtype`` (exact for power-of-two scales)."""
    return (data.float() * scale_inv.unsqueeze(-1)).to(dtype)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 or float8_e8m0fnu) -> fp32 ``2 ** (byte - 127)``; byte 255 -> NaN."""
    b = scale.view(torch.uint8).to(torch.int32)
    val = torch.ldexp(torch.ones(b.shape, dtype=torch.float32, device=b.device), b - 127)
    return torch.where(b == 255, torch.full_like(val, float("nan")), val)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """(..., K) -> (..., ceil(K/32), 32) fp32, zero-filled past K."""
    k = x.shape[-1]
    nb = -(-k // MX_BLOCK)
    pad = nb * MX_BLOCK - k
    xf = x.float()
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    return xf.reshape(*x.shape[:-1], nb, MX_BLOCK)


def mx_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 (E4M3 elements, E8M0 scales) along the last dim, blocks of 32.

    Shapes: x (..., K) -> data (..., K) float8_e4m3fn, scale (..., ceil(K / 32)) uint8 (E8M0
    biased exponents; view as ``torch.float8_e8m0fnu`` where torch has it). Rule: OCP MX v1.0
    section 6.3 (see the module docstring).
    """
    k = x.shape[-1]
    blocks = _blocks(x)
    bad = ~torch.isfinite(blocks).all(-1)
    amax = blocks.abs().amax(-1) if blocks.numel() else blocks.new_zeros(blocks.shape[:-1])
    amax = torch.where(bad, torch.zeros_like(amax), amax)
    _, e = torch.frexp(amax)  # amax = m * 2**e, m in [0.5, 1): floor(log2(amax)) = e - 1
    shared = torch.where(amax > 0, e - 1 - E4M3_EMAX, torch.full_like(e, -127)).clamp(-127, 127)
    # v / X as two power-of-two multiplies (each factor a normal fp32 power of two): exact for
    # every value that does not round to zero in E4M3.
    half = torch.div(-shared, 2, rounding_mode="floor")
    scaled = torch.ldexp(torch.ldexp(blocks, half.unsqueeze(-1)), (-shared - half).unsqueeze(-1))
    scaled = torch.where(bad.unsqueeze(-1), torch.full_like(scaled, float("nan")), scaled)
    data = to_e4m3(scaled.reshape(*x.shape[:-1], blocks.shape[-2] * MX_BLOCK)[..., :k])
    byte = torch.where(bad, torch.full_like(shared, 255), shared + 127).to(torch.uint8)
    return data, byte


def mx_dequantize_rows(data: torch.Tensor, scale: torch.Tensor,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * 2 ** (scale - 127)`` per block of 32 along the last dim, in ``dtype``."""
    k = data.shape[-1]
    s = e8m0_to_float(scale).repeat_interleave(MX_BLOCK, dim=-1)[..., :k]
    return (data.float() * s).to(dtype)


# ---------------------------------------------------------------- blockwise FP8 (128-element tiles)
#: Edge of a blockwise-FP8 tile: 1 x 128 tiles along the reduction dim for activations and
#: gradients, 128 x 128 blocks for weights (DeepSeek-V3 section 3.3.2; TransformerEngine's
#: ``Float8BlockScaling``).
FP8_BLOCK = 128


def block_scale_from_amax(amax: torch.Tensor, *, pow2: bool, epsilon: float,
                          value_for_inf: float) -> torch.Tensor:
    """fp32 scales of blockwise FP8 from each tile's ``amax`` (fp32, finite, >= 0).

    TransformerEngine's rule (``compute_scale_from_amax``, ``recipe_common.cuh``): ``amax`` is
    raised to ``epsilon``; an ``amax`` of 0 gives scale 1; otherwise ``scale = 448 / amax``
    (fp32, rounded to nearest), ``value_for_inf`` where that overflows to infinity, and with
    ``pow2`` the mantissa bits cleared: ``2 ** floor(log2(448 / amax))``, the same power of two
    as :func:`pow2_scale_from_amax` gives (whose exponent clamp at 127 is where TE's overflow
    value ``2**127`` lands).
    """
    amax = torch.clamp_min(amax.float(), epsilon) if epsilon else amax.float()
    if pow2:
        return pow2_scale_from_amax(amax)
    scale = torch.full_like(amax, E4M3_MAX) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, value_for_inf), scale)
    return torch.where(amax > 0, scale, torch.ones_like(amax))


def _tiles_last(x: torch.Tensor) -> torch.Tensor:
    """(..., K) -> (..., ceil(K / 128), 128) fp32, zero-filled past K."""
    k = x.shape[-1]
    nb = -(-k // FP8_BLOCK)
    xf = x.float()
    if nb * FP8_BLOCK != k:
        xf = torch.nn.functional.pad(xf, (0, nb * FP8_BLOCK - k))
    return xf.reshape(*x.shape[:-1], nb, FP8_BLOCK)


def _tile_amax(tiles: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """The largest finite magnitude over ``dims`` of fp32 ``tiles`` (0 for an empty or
    all-zero tile; NaN / +-Inf left out)."""
    a = finite_abs(tiles)
    if a.numel() == 0:
        shape = [s for i, s in enumerate(a.shape) if i not in {d % a.dim() for d in dims}]
        return a.new_zeros(shape)
    return a.amax(dim=dims)


def block_quantize_rows(x: torch.Tensor, *, pow2: bool = True, epsilon: float = 0.0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise FP8 with 1 x 128 tiles along the last dim (:func:`_block_quantize_rows`;
    under ``torch.compile`` the opaque op ``te_ops::block_quantize``, so inductor cannot
    rewrite the scale arithmetic and the compiled bytes equal eager's)."""
    if tracing():
        return torch.ops.te_ops.block_quantize(x, False, pow2, float(epsilon))
    return _block_quantize_rows(x, pow2=pow2, epsilon=epsilon)


def _block_quantize_rows(x: torch.Tensor, *, pow2: bool = True, epsilon: float = 0.0
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise FP8 with 1 x 128 tiles along the last dim.

    Shapes: x (..., K) fp32 / bf16 -> data (..., K) float8_e4m3fn, scale_inv
    (..., ceil(K / 128)) fp32 (``x ≈ data * scale_inv`` tile by tile). A last partial tile
    (K not a multiple of 128) is a tile of its own; its amax is over its valid elements only.
    Rule: :func:`block_scale_from_amax` on the tile's largest finite magnitude;
    ``value_for_inf`` is the largest finite value of ``x``'s dtype (TransformerEngine's).
    """
    k = x.shape[-1]
    tiles = _tiles_last(x)
    amax = _tile_amax(tiles, (-1,))
    scale = block_scale_from_amax(amax, pow2=pow2, epsilon=epsilon,
                                  value_for_inf=torch.finfo(x.dtype).max)
    data = to_e4m3(tiles * scale.unsqueeze(-1))
    data = data.reshape(*x.shape[:-1], tiles.shape[-2] * FP8_BLOCK)[..., :k]
    return data.contiguous(), scale.reciprocal()


def block_dequantize_rows(data: torch.Tensor, scale_inv: torch.Tensor,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * scale_inv`` per 1 x 128 tile along the last dim, in ``dtype``."""
    k = data.shape[-1]
    s = scale_inv.repeat_interleave(FP8_BLOCK, dim=-1)[..., :k]
    return (data.float() * s).to(dtype)


def block_quantize_2d(x: torch.Tensor, *, pow2: bool = True, epsilon: float = 0.0
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise FP8 with 128 x 128 blocks over the last two dims (:func:`_block_quantize_2d`;
    traced: ``te_ops::block_quantize``, as :func:`block_quantize_rows`)."""
    if tracing():
        return torch.ops.te_ops.block_quantize(x, True, pow2, float(epsilon))
    return _block_quantize_2d(x, pow2=pow2, epsilon=epsilon)


def _block_quantize_2d(x: torch.Tensor, *, pow2: bool = True, epsilon: float = 0.0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise FP8 with 128 x 128 blocks over the last two dims (weights).

    Shapes: x (..., R, C) -> data (..., R, C) float8_e4m3fn, scale_inv
    (..., ceil(R / 128), ceil(C / 128)) fp32. Partial blocks at the edges take the amax of
    their valid elements; the scale rule is :func:`block_quantize_rows`'.
    """
    r, c = x.shape[-2:]
    nr, nc = -(-r // FP8_BLOCK), -(-c // FP8_BLOCK)
    xf = x.float()
    if (nr * FP8_BLOCK, nc * FP8_BLOCK) != (r, c):
        xf = torch.nn.functional.pad(xf, (0, nc * FP8_BLOCK - c, 0, nr * FP8_BLOCK - r))
    blocks = xf.reshape(*x.shape[:-2], nr, FP8_BLOCK, nc, FP8_BLOCK)
    amax = _tile_amax(blocks, (-3, -1))
    scale = block_scale_from_amax(amax, pow2=pow2, epsilon=epsilon,
                                  value_for_inf=torch.finfo(x.dtype).max)
    data = to_e4m3(blocks * scale[..., :, None, :, None])
    data = data.reshape(*x.shape[:-2], nr * FP8_BLOCK, nc * FP8_BLOCK)[..., :r, :c]
    return data.contiguous(), scale.reciprocal()


def block_dequantize_2d(data: torch.Tensor, scale_inv: torch.Tensor,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * scale_inv`` per 128 x 128 block of the last two dims, in ``dtype``."""
    r, c = data.shape[-2:]
    s = scale_inv.repeat_interleave(FP8_BLOCK, dim=-2).repeat_interleave(FP8_BLOCK, dim=-1)
    return (data.float() * s[..., :r, :c]).to(dtype)


@torch.library.custom_op("te_ops::block_quantize", mutates_args=())
def _block_quantize_op(x: torch.Tensor, blocks_2d: bool, pow2: bool, epsilon: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_quantize_2d` (``blocks_2d``) or :func:`block_quantize_rows` as one op."""
    fn = _block_quantize_2d if blocks_2d else _block_quantize_rows
    return fn(x, pow2=pow2, epsilon=epsilon)


@_block_quantize_op.register_fake
def _block_quantize_fake(x: torch.Tensor, blocks_2d: bool, pow2: bool, epsilon: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    data = x.new_empty(x.shape, dtype=FP8)
    if blocks_2d:
        r, c = x.shape[-2:]
        shape = (*x.shape[:-2], -(-r // FP8_BLOCK), -(-c // FP8_BLOCK))
    else:
        shape = (*x.shape[:-1], -(-x.shape[-1] // FP8_BLOCK))
    return data, x.new_empty(shape, dtype=torch.float32)
