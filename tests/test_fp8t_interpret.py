"""The SwiGLU -> FP8 row-wise kernel and the row-wise + column-amax kernel's warps setting,
through Triton's interpreter.

Runs where triton is installed and no GPU is (as ``tests/test_fp8q_interpret.py``; the GPU runs
the compiled kernels in ``tests/test_fp8t_cuda.py``). Kernel against kernels (the interpreter's
float -> E4M3 conversion differs from the hardware's for some values):

* ``fp8_swiglu.launch`` writes the bytes and scales of the SwiGLU forward kernel followed by the
  row-wise quantize kernel: with and without probs, bf16 and fp32, F not a power of two, rows
  with NaN / Inf / all zeros, one row, probs of zero;
* ``fp8_rows_column_amax`` with a warps entry in ``ROWS_COLAMAX_SETTINGS`` equals the default;
* the FP8 expert block with the kernel in the fused forward (every Triton kernel interpreted on
  CPU tensors) gives bitwise the output and gradients of the fused forward without it and of
  the unfused ops, and the kernel runs once per fused forward.
"""

from __future__ import annotations

from interpret import interpreter_marks, run_interpreted

pytestmark = interpreter_marks("tests/test_fp8t_cuda.py")

SCRIPT = r'''
import torch
from te_ops.kernels import swiglu_triton
from te_ops.quantization import fp8_swiglu, fp8_triton

U8 = torch.uint8


def two_kernels(h, probs):
    a = swiglu_triton._forward(h, probs, swiglu_triton._fwd_kernel)
    return fp8_triton.launch_rows(a)


def swiglu_case(rows, f, dtype, with_probs):
    gen = torch.Generator().manual_seed(rows * 31 + f)
    h = (torch.randn(rows, 2 * f, generator=gen) * 4).to(dtype)
    if rows > 3:
        h[1, 2] = float("nan")
        h[2, f + 1] = float("inf")
        h[3] = 0
    probs = torch.rand(rows, generator=gen) if with_probs else None
    if with_probs and rows > 4:
        probs[4] = 0
    q, s = fp8_swiglu.launch(h, probs)
    q0, s0 = two_kernels(h, probs)
    assert q.shape == (rows, f) and s.shape == (rows,), (q.shape, s.shape)
    assert torch.equal(q.view(U8), q0.view(U8)), (rows, f, dtype, with_probs)
    assert torch.equal(s, s0), (rows, f, dtype, with_probs)


for dtype in (torch.bfloat16, torch.float32):
    for with_probs in (False, True):
        swiglu_case(9, 40, dtype, with_probs)
swiglu_case(1, 16, torch.bfloat16, True)
swiglu_case(6, 100, torch.bfloat16, False)

w = torch.randn(3, 32, 24, generator=torch.Generator().manual_seed(5)) * 3
w[0, 1, 2] = float("nan")
fp8_triton.ROWS_COLAMAX_SETTINGS = ((32768, 16, 2),)
ref = fp8_triton.launch_rows_colamax(w)
for warps in (2, 4):
    fp8_triton.ROWS_COLAMAX_SETTINGS = ((32768, 16, 2, warps),)
    assert fp8_triton._rows_colamax_setting(24) == (16, 2, warps)
    got = fp8_triton.launch_rows_colamax(w)
    assert all(torch.equal(p.view(U8) if p.dtype == torch.float8_e4m3fn else p,
                           r.view(U8) if r.dtype == torch.float8_e4m3fn else r)
               for p, r in zip(got, ref)), warps
print("ok")
'''


BLOCK_SCRIPT = r'''
import os

import torch
import te_ops
from te_ops.kernels import swiglu_triton
from te_ops.quantization import fp8_swiglu, fp8_triton
from te_ops.recipe import Float8CurrentScaling

# Interpreter stand-ins: the Triton kernels take CPU tensors here.
_orig = fp8_triton.unsupported_reason


def _cpu_ok(x):
    if (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and x.is_contiguous() and x.numel()):
        return None
    return _orig(x)


fp8_triton.unsupported_reason = _cpu_ok
fp8_swiglu.unsupported_reason = lambda h, p: _cpu_ok(h) or fp8_swiglu.shape_reason(h, p)
swiglu_triton.unsupported_reason = lambda x, i: None if i is None and x.is_contiguous() else "no"
calls = []
launch = fp8_swiglu.launch
fp8_swiglu.launch = lambda *a, **k: calls.append(1) or launch(*a, **k)

def run(fusion, enabled):
    os.environ["TE_OPS_FUSION"] = fusion
    fp8_swiglu.ENABLED = enabled
    torch.manual_seed(0)
    e, t, hid, ff = 4, 96, 32, 48
    blk = te_ops.Sequential(te_ops.GroupedLinear(e, hid, 2 * ff, dtype=torch.bfloat16),
                            te_ops.ScaledSwiGLU(),
                            te_ops.GroupedLinear(e, ff, hid, dtype=torch.bfloat16))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(t, hid, generator=gen).bfloat16().requires_grad_()
    probs = torch.rand(t, generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(t, hid, generator=gen).bfloat16()
    sizes = torch.tensor([30, 0, 41, 20])
    with te_ops.autocast(recipe=Float8CurrentScaling()):
        y = blk(x, sizes, probs, sizes)
    y.backward(dy)
    return [y.detach(), x.grad, probs.grad] + [p.grad for p in blk.parameters()]

on = run("1", True)
assert len(calls) == 1, calls
off = run("1", False)
unf = run("0", True)
assert len(calls) == 1, calls
for a, b, c in zip(on, off, unf):
    assert torch.equal(a, b) and torch.equal(a, c)
print("ok")
'''


def test_swiglu_fp8_rows_and_colamax_warps_interpreted():
    run_interpreted(SCRIPT)


def test_block_with_swiglu_fp8_kernel_interpreted():
    run_interpreted(BLOCK_SCRIPT)
