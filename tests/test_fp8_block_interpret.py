"""The blockwise FP8 Triton GEMMs (``quantization/fp8_block_triton.py``) through Triton's CPU
interpreter, against the emulation of the same bytes (``quantization/gemm.py``: the same
per-128-block loop with fp32 products; the interpreter's ``tl.dot`` is an fp32 product too, so
the two agree to fp32 rounding of the block sums).

Runs where triton is installed and no GPU is; the GPU runs the compiled kernels in
``tests/test_fp8_block_cuda.py``. Shapes: reduced dims not multiples of 128 (a partial last
block), an empty group, a group spanning several row blocks and programs (``SPLIT``), padding
rows (zero), power-of-two and fp32 scales.
"""

from __future__ import annotations

from interpret import interpreter_marks, run_interpreted

pytestmark = interpreter_marks("tests/test_fp8_block_cuda.py")

SCRIPT = r'''
import torch
from te_ops.quantization import Float8BlockQuantizer, fp8_block_triton as fbt
from te_ops.quantization.gemm import _block_operands, block_grouped_gemm_emulated
from te_ops.quantization.layout import column_layout
from te_ops.splits import make_splits

torch.manual_seed(0)
for sizes, k, n, pow2 in (([5, 0, 140, 40], 200, 136, True), ([300], 128, 256, False),
                          ([0, 0], 130, 64, True)):
    rows = sum(sizes) + 3
    x, dy = torch.randn(rows, k), torch.randn(rows, n)
    w = torch.randn(len(sizes), n, k)
    splits = make_splits(torch.tensor(sizes), len(sizes), rows, torch.device("cpu"))
    q = lambda **kw: Float8BlockQuantizer(rowwise=True, columnwise=True,
                                          force_pow_2_scales=pow2, **kw)
    xq, dyq, wq = q()(x, splits), q()(dy, splits), q(block_dim=2)(w)
    for kind, a, b in (("fprop", xq, wq), ("dgrad", dyq, wq), ("wgrad", xq, dyq)):
        qa, sa, qb, sb = _block_operands(kind, a, b)
        if kind == "wgrad":
            lay = column_layout(splits.split_sizes, splits.base_offsets, rows, 128)
            got = fbt._wgrad_launch(qa, sa, qb, sb, lay.starts, lay.offsets, torch.float32,
                                    fbt._fp8_block_wgrad_kernel)
        else:
            got = fbt._rows_launch(qa, sa, qb, sb, splits.offsets, torch.float32,
                                   fbt._fp8_block_rows_kernel)
            assert not got[sum(sizes):].any(), (kind, "padding rows")
        emu = block_grouped_gemm_emulated(kind, a, b, splits)
        tol = 1e-6 * max(emu.abs().max().item(), 1.0)
        torch.testing.assert_close(got, emu, rtol=1e-6, atol=tol, msg=f"{kind} {sizes}")
print("ok")
'''


def test_blockwise_fp8_kernels_interpreted():
    run_interpreted(SCRIPT)
