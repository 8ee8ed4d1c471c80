"""The persistent GEMMs' host checks and the flat wgrad's in-kernel group order.

1. The fake-tensor test of the persistent kernels' TMA gates (``_fake`` in
   ``grouped_gemm_large_triton`` and ``grouped_wgrad_large_triton``) treats a
   functorch-wrapped tensor (``torch.func.grad`` / ``vmap``: a C++ wrapper whose Python type
   is ``torch.Tensor``) around a FakeTensor as fake (``is_fake`` unwraps it), so
   ``tma_unsupported_reason`` reads its storage offset, never its data pointer (which raises
   "Cannot access data pointer of Tensor that doesn't have storage").
2. ``triton_launch.sm_count`` / ``capability`` (public, in ``__all__``) raise ``ValueError``
   naming ``device`` for a device that is not CUDA (a CPU device's index is ``None``, which
   would read as "the current CUDA device": a silent wrong answer).
3. The persistent wgrad's launch rejects ``config`` keys that are not
   :func:`large_wgrad_config`'s with a ``ValueError`` naming them (as the fprop's
   ``_resolve`` does), also where no launch is needed: ``_launch_plan`` puts
   ``ACCUMULATE=False`` *before* the config's keys for the flat schedule, so a config holding
   ``ACCUMULATE`` would turn the launch into an accumulation into the uninitialised output,
   and a misspelt key would reach the kernel as an unknown keyword.
4. The flat wgrad's in-register group order with offsets that decrease, are negative or run
   past M (the same bits as the index order and the nested schedule's torch order: every
   tile once) and with more than 1024 groups (2048 sort lanes).
"""

from __future__ import annotations

import pytest
import torch
from interpret import interpreter_marks, run_interpreted

from te_ops.gemm import grouped_gemm_large_triton as L
from te_ops.gemm import grouped_wgrad_large_triton as W
from te_ops.kernels import triton_launch


def _wrapped_fakes() -> list:
    """(how, the tensor as the function sees it) for a FakeTensor under torch.func.grad and
    torch.func.vmap (functorch wrappers of Python type torch.Tensor)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen = []
    with FakeTensorMode():
        x = torch.zeros(4, 8)

        def grab(how):
            def f(t):
                seen.append((how, t))
                return t.sum()
            return f
        torch.func.grad(grab("grad"))(x)
        torch.func.vmap(grab("vmap"))(x)
    return seen


@pytest.mark.parametrize("module", [L, W], ids=["fprop_dgrad", "wgrad"])
def test_fake_sees_functorch_wrapped_fake_tensors(module):
    from torch._subclasses.fake_tensor import is_fake

    seen = _wrapped_fakes()
    assert [h for h, _ in seen] == ["grad", "vmap"]
    for how, t in seen:
        assert type(t) is torch.Tensor and is_fake(t), how  # the case the shortcut missed
        assert module._fake(t), how
    real = []
    torch.func.grad(lambda t: real.append(t) or t.sum())(torch.zeros(3))
    assert not module._fake(real[0])  # a wrapped real tensor is not fake


def test_tma_gates_read_the_storage_offset_of_wrapped_fake_operands(monkeypatch):
    """Under torch.func.grad of FakeTensors the gates answer from the storage offsets (as
    for unwrapped FakeTensors) instead of raising on the data pointer."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(L, "_tma_layout_reason", lambda x, w: None)
    monkeypatch.setattr(W, "_tma_layout_reason", lambda x, dy: None)
    got = []
    with FakeTensorMode():
        buf = torch.zeros(64 * 64 + 8, dtype=torch.float16)
        w = torch.zeros(2, 64, 64, dtype=torch.float16)

        def f(t):
            for off in (8, 1):  # 16 bytes (aligned), 2 bytes (not)
                v = t[off:off + 64 * 64].view(64, 64)
                got.append((off, L.tma_unsupported_reason(v, w),
                            W.tma_unsupported_reason(v, v)))
            return t.sum()
        torch.func.grad(f)(buf)
    assert got[0] == (8, None, None)
    assert got[1][0] == 1 and "storage offset" in got[1][1] and "storage offset" in got[1][2]


@pytest.mark.parametrize("fn", [triton_launch.sm_count, triton_launch.capability])
def test_device_facts_reject_a_non_cuda_device(fn, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: pytest.fail("read a CUDA device for a CPU one"))
    with pytest.raises(ValueError, match=r"device must be a CUDA device, got cpu"):
        fn(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"device must be a CUDA device, got meta"):
        fn(torch.device("meta"))


@pytest.mark.parametrize("rows", [6, 0])  # a launch; no launch needed (no rows)
@pytest.mark.parametrize("bad", [{"ACCUMULATE": True}, {"BLOCKM": 32}, {"G_POW2": 4}])
def test_wgrad_config_rejects_unknown_keys(bad, rows):
    x, dy = torch.zeros(rows, 16), torch.zeros(rows, 16)
    offs = torch.tensor([rows // 2, rows], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"config keys must be among \[.*\], got unknown "
                       + repr(sorted(bad)).replace("[", r"\[").replace("]", r"\]")):
        W._launch(x, dy, offs, None, {"BLOCK_M": 16, **bad})


SCRIPT = r'''
import torch
import triton
import triton.language as tl
from te_ops.gemm import grouped_wgrad_large_triton as W

SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}
gen = torch.Generator().manual_seed(0)

# bad offsets (decreasing, negative, past M; int64 past 2**31): the flat schedule's
# in-kernel order gives the bits of the nested schedule's torch order, and the clamped
# groups' sums (each tile once)
m, n, k = 64, 32, 16
x = torch.randn(m, k, generator=gen).half()
dy = torch.randn(m, n, generator=gen).half()
for ends, odt in (([20, 10, 40, -5, 30, 100, 60], torch.int32),
                  ([0, 0, 70, 70, 3, 2**40], torch.int64)):
    offs = torch.tensor(ends, dtype=odt)
    outs = [W._launch(x, dy, offs, None, {**SMALL, **cfg})
            for cfg in ({}, {"FLAT": False})]
    assert all(torch.equal(o, outs[0]) for o in outs[1:]), ends
    want = torch.zeros(len(ends), n, k, dtype=torch.float64)
    for g, e in enumerate(ends):
        end = min(max(e, 0), m)
        start = 0 if g == 0 else min(max(ends[g - 1], 0), end)
        want[g] = dy[start:end].double().t() @ x[start:end].double()
    err = ((outs[0].double() - want).abs() - 2.0 ** -10 * want.abs()).max().item()
    assert err <= 1e-2, (ends, err)


@triton.jit
def _order_kernel(offs_ptr, out_ptr, M, G, G_POW2: tl.constexpr):
    r = tl.arange(0, G_POW2).to(tl.int64)
    valid = r < G
    tl.store(out_ptr + r, W._rank_order(offs_ptr, r, valid, M, G_POW2), mask=valid)


# more groups than the fprop's FLAT_MAX_GROUPS (2048 sort lanes), many ties
for g in (1025, 1500):
    sizes = torch.randint(0, 4, (g,), generator=gen)
    offs = sizes.cumsum(0).to(torch.int32)
    out = torch.full((g,), -1, dtype=torch.int32)
    _order_kernel[(1,)](offs, out, int(offs[-1]), g, G_POW2=W.next_power_of_2(g))
    assert torch.equal(out.long(), W.group_order(offs)), g
print("ok")
'''


_INTERPRETER = interpreter_marks("tests/test_grouped_wgrad_large_triton.py")


@_INTERPRETER[0]
@_INTERPRETER[1]
def test_flat_wgrad_order_with_bad_offsets_and_many_groups_interpreted():
    run_interpreted(SCRIPT)


@pytest.mark.cuda
def test_wgrad_entry_point_rejects_an_accumulate_config_on_the_gpu():
    """The launch on the GPU: a config with ``ACCUMULATE`` raises (it ran an accumulation
    into the uninitialised output) and the default call still runs."""
    x = torch.randn(256, 128, device="cuda").bfloat16()
    dy = torch.randn(256, 64, device="cuda").bfloat16()
    offs = torch.tensor([100, 256], device="cuda")
    with pytest.raises(ValueError, match=r"got unknown \['ACCUMULATE'\]"):
        W._launch(x, dy, offs, None, {"ACCUMULATE": True})
    want = torch.stack([dy[:100].float().t() @ x[:100].float(),
                        dy[100:].float().t() @ x[100:].float()])
    torch.testing.assert_close(W.large_wgrad(x, dy, offs).float(), want, rtol=1.6e-2,
                               atol=1e-1)
