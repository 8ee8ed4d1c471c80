"""The Gluon fc1 + SwiGLU epilogue (``te_ops/gemm/fc1_swiglu_gluon.py``) and its dispatch
(``te_ops/fused/fc1_epilogue.py``).

* The Gluon ``fc1_swiglu`` row holds only on the device and dtype it was measured on (SM90,
  bfloat16), not on the shape alone: under ``TE_OPS_GROUPED_GEMM_BACKEND=triton``
  (persistent kernels on any CUDA GPU and in float16) auto keeps the two launches at a row's
  shape on another GPU (where the fused launch would be the unmeasured ``large_fc1_swiglu``,
  0.97-0.99x the two launches on the H200) or in float16, and ``explain()`` does not name
  the Gluon kernel there.
* Where the operands rule the Gluon kernel out at run time (a base pointer off 16 bytes:
  ``gluon_fc1_dispatched`` runs ``large_fc1_swiglu``), ``explain()`` names the launch that
  runs and why.
"""

from __future__ import annotations

import pytest
import torch
from gemm_force import FC1_GLUON_ROW, FC1_FUSED_ANY, NO_FC1_FUSED, with_rows
from fc1_dispatch_stubs import ACT, LARGE, fused_fc1
from fc1_dispatch_stubs import RecordingAct as _Act
from torch._subclasses.fake_tensor import FakeTensorMode

from te_ops.gemm import fc1_swiglu as fc1_swiglu_mod
from te_ops.gemm import fc1_swiglu_reason
from te_ops.gemm import fc1_swiglu_gluon as FG
from te_ops.gemm import dispatch as grouped_gemm

CUDA = torch.device("cuda")
RULE = (2048, 1536)  # the Gluon fc1_swiglu row's measured shape (E128 T65536 fc1), 512 rows
ROWS = 512.0


def _on(monkeypatch, capability: tuple[int, int]) -> None:
    """Gluon installed, Triton runnable, a CUDA GPU of ``capability`` (fresh caches)."""
    monkeypatch.setattr(FG, "gluon", object())
    monkeypatch.setattr(grouped_gemm, "_MEASURED_ON", {})
    monkeypatch.setattr(grouped_gemm, "triton_unsupported_reason",
                        lambda d, t: None if d.type == "cuda" else "not cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)


@pytest.mark.parametrize("capability, dtype, takes", [
    ((9, 0), torch.bfloat16, True), ((9, 0), torch.float16, False),
    ((10, 0), torch.bfloat16, False), ((8, 0), torch.bfloat16, False)])
def test_rule_holds_where_measured_only(monkeypatch, capability, dtype, takes):
    _on(monkeypatch, capability)
    def gluon(*args):
        rule = fc1_swiglu_mod.fc1_swiglu_rule(*args)
        return rule is not None and rule.kernel == "gluon"

    assert gluon(*RULE, ROWS, CUDA, dtype) is takes
    assert not gluon(*RULE, ROWS, torch.device("cpu"), torch.bfloat16)
    assert gluon(*RULE, ROWS - 0.125, CUDA, dtype) is takes  # inside the measured range
    assert not gluon(*RULE, 128.0, CUDA, dtype)  # the neighbouring measured point
    why = fc1_swiglu_reason(LARGE, ACT, None, False, None, ROWS, CUDA, features=RULE,
                              dtype=dtype)
    assert (why is None) is takes


@pytest.mark.parametrize("capability, dtype", [((9, 0), torch.float16),
                                               ((10, 0), torch.bfloat16)])
def test_forced_triton_off_the_measured_device_keeps_two_launches_under_auto(
        monkeypatch, capability, dtype):
    """The persistent fprop of the forced triton backend at a rule shape: auto keeps the
    two launches (``LARGE_AUTO``) unless on SM90 in bfloat16; ``1`` runs
    ``large_fc1_swiglu`` and ``explain()`` says so."""
    _on(monkeypatch, capability)
    args = (LARGE, ACT, None, False, None, ROWS, CUDA)
    why = fc1_swiglu_reason(*args, features=RULE, dtype=dtype)
    assert why is not None and "persistent many-rows Triton kernel" in why
    with_rows(monkeypatch, last=FC1_FUSED_ANY)
    gluon, large = [], []
    monkeypatch.setattr(FG, "gluon_fc1_dispatched", lambda *a: gluon.append(a) or ("g", "g"))
    monkeypatch.setattr(fc1_swiglu_mod, "large_fc1_swiglu", lambda *a: large.append(a) or ("h", "a"))
    fc1 = type("Fc1", (), {"has_bias": False, "out_features": RULE[1]})()
    act = _Act()
    with FakeTensorMode():
        x = torch.empty(8 * 512, RULE[0], device=CUDA, dtype=dtype)
        w = torch.empty(8, RULE[1], RULE[0], device=CUDA, dtype=dtype)
        splits = type("S", (), {"num_rows": 8 * 512, "num_groups": 8,
                                "offsets": torch.empty(8, device=CUDA, dtype=torch.int32)})()
        out = fused_fc1(fc1, act, x, w, splits, LARGE, None, None)
    assert out == ("h", "a", ACT) and len(large) == 1 and not gluon
    assert "large_fc1_swiglu; the fc1_swiglu row" in act.records[-1][1]
    assert "Gluon kernel, gluon_fc1_swiglu" not in act.records[-1][1]


def test_features_without_device_and_dtype_raise():
    with pytest.raises(ValueError, match=r"features=\(2048, 1536\) needs the call's device "
                                         r"and dtype .* got device=None, dtype=None"):
        fc1_swiglu_reason(LARGE, ACT, None, False, None, ROWS, features=RULE)


def test_explain_names_the_run_time_fallback(monkeypatch):
    """At a rule shape whose operands the Gluon kernel cannot take: ``explain()`` names
    ``large_fc1_swiglu`` and the reason; the launch is still ``gluon_fc1_dispatched``
    (which falls back with the same bits)."""
    monkeypatch.setattr(fc1_swiglu_mod, "fc1_swiglu_rule", lambda *a, **k: FC1_GLUON_ROW)
    seen, calls = [], []
    monkeypatch.setattr(FG, "gluon_fc1_unsupported_reason",
                        lambda x, w: seen.append(x) or "x or weights do not start on a "
                                                       "16-byte boundary")
    monkeypatch.setattr(FG, "gluon_fc1_dispatched",
                        lambda x, w, off, p: calls.append(x) or ("h", "a"))
    fc1 = type("Fc1", (), {"has_bias": False, "out_features": 8})()
    act = _Act()
    with FakeTensorMode():
        x = torch.empty(128, 4, device=CUDA, dtype=torch.bfloat16)
        w = torch.empty(2, 8, 4, device=CUDA, dtype=torch.bfloat16)
        splits = type("S", (), {"num_rows": 128, "num_groups": 2,
                                "offsets": torch.empty(2, device=CUDA, dtype=torch.int32)})()
        assert fused_fc1(fc1, act, x, w, splits, LARGE, None, None) == \
            ("h", "a", ACT)
    text = act.records[-1][1]
    assert ("large_fc1_swiglu; the Gluon kernel cannot take the operands: x or weights do not "
            "start on a 16-byte boundary") in text
    assert calls[0] is seen[0] is x


@pytest.mark.cuda
def test_block_on_a_misaligned_input_says_so_and_keeps_the_bits(monkeypatch):
    """SM90: the rule patched to take the Gluon kernel, an input whose base is off 16 bytes:
    ``explain()`` names ``large_fc1_swiglu`` and the reason; the output equals the run with
    the epilogue off bit for bit."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    import te_ops

    torch.manual_seed(0)
    kw = {"bias": False, "device": CUDA, "dtype": torch.bfloat16}

    def block():
        torch.manual_seed(0)
        return te_ops.Sequential(te_ops.GroupedLinear(4, 256, 768, **kw), te_ops.ScaledSwiGLU(),
                                 te_ops.GroupedLinear(4, 384, 256, **kw))

    rows = 300
    buf = torch.randn(rows * 256 + 1, device=CUDA).to(torch.bfloat16)
    x = buf[1:].view(rows, 256).detach().requires_grad_(True)  # base 2 bytes off
    assert x.data_ptr() % 16
    split = torch.tensor([150, 0, 47, 103], device=CUDA)
    probs = torch.rand(rows, device=CUDA, dtype=torch.bfloat16)
    with_rows(monkeypatch, first=NO_FC1_FUSED)
    want = block()(x, split, probs, split)
    with_rows(monkeypatch)
    monkeypatch.setattr(fc1_swiglu_mod, "fc1_swiglu_rule", lambda *a, **k: FC1_GLUON_ROW)
    fused = block()
    got = fused(x, split, probs, split)
    assert "cannot take the operands" in fused.explain()
    assert torch.equal(got, want)


@pytest.mark.parametrize("with_probs", [True, False])
def test_fake_kernel_matches_the_op_contract(with_probs):
    """The op's fake kernel (what ``torch.compile`` traces): h (M, 2F) and a (M, F),
    contiguous, in x's dtype and on x's device, as ``_launch`` allocates them."""
    with FakeTensorMode():
        x = torch.empty(300, 64, device=CUDA, dtype=torch.float16)
        w = torch.empty(3, 2 * 96, 64, device=CUDA, dtype=torch.float16)
        offs = torch.empty(3, device=CUDA, dtype=torch.int64)
        probs = torch.empty(300, device=CUDA) if with_probs else None
        h, a = torch.ops.te_ops.grouped_fc1_swiglu_gluon(x, w, offs, probs)
    assert (h.shape, a.shape) == ((300, 192), (300, 96))
    assert h.dtype == a.dtype == torch.float16 and h.device == a.device == x.device
    assert h.is_contiguous() and a.is_contiguous()


@pytest.mark.cuda
def test_opcheck_on_sm90():
    """``torch.library.opcheck`` of ``te_ops::grouped_fc1_swiglu_gluon`` (schema, fake kernel
    against the real op, AOT dispatch with dynamic shapes) on SM90."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    gen = torch.Generator(device=CUDA).manual_seed(0)
    x = torch.randn(300, 64, generator=gen, device=CUDA).to(torch.bfloat16)
    w = (torch.randn(3, 256, 64, generator=gen, device=CUDA) * 0.125).to(torch.bfloat16)
    offs = torch.tensor([100, 100, 290], device=CUDA, dtype=torch.int32)
    for probs in (torch.rand(300, generator=gen, device=CUDA), None):
        torch.library.opcheck(torch.ops.te_ops.grouped_fc1_swiglu_gluon, (x, w, offs, probs))


@pytest.mark.cuda
def test_outputs_past_2_to_the_31_elements_and_int64_offsets():
    """h has more than 2**31 elements (65544 x 33024): the last rows' pointers need int64.
    Their h and a against the fp64 reference and bitwise the two launches, padding rows
    zero; int64 offsets; two groups, the second ending 8 rows before M."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    import torch.nn.functional as F

    from te_ops.gemm import grouped_gemm_large_triton as L
    from te_ops.kernels.swiglu_triton import swiglu_forward

    m, ffn, k, total = 65544, 16512, 64, 65536
    assert m * 2 * ffn > 2 ** 31
    gen = torch.Generator(device=CUDA).manual_seed(0)
    x = torch.randn(m, k, generator=gen, device=CUDA).to(torch.bfloat16)
    w = (torch.randn(2, 2 * ffn, k, generator=gen, device=CUDA) * k ** -0.5).to(torch.bfloat16)
    offs = torch.tensor([30000, total], device=CUDA, dtype=torch.int64)
    probs = torch.rand(m, generator=gen, device=CUDA)
    h, a = FG.gluon_fc1_swiglu(x, w, offs, probs)
    assert not h[total:].any() and not a[total:].any()
    tail = slice(total - 64, total)
    h_ref = F.linear(x[tail].double(), w[1].double())  # bf16 rounding: relative 2**-9
    assert ((h[tail].double() - h_ref).abs() <= h_ref.abs() * 2 ** -7 + 1e-3).all()
    got = h[tail].double()  # a is computed from the rounded h
    a_ref = F.silu(got[:, :ffn]) * got[:, ffn:] * probs[tail].double()[:, None]
    assert ((a[tail].double() - a_ref).abs() <= a_ref.abs() * 2 ** -7 + 1e-5).all()
    plain = L.large_fprop(x, w, offs)
    assert torch.equal(h[tail], plain[tail]) and torch.equal(h[:64], plain[:64])
    del plain
    assert torch.equal(a[tail], swiglu_forward(h[tail].contiguous(), probs[tail].contiguous()))
