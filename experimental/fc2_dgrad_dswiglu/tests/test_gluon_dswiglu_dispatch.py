"""Review of the Gluon merges (gtail17: the 4-stage ``C_HALF`` fprop/dgrad and its
dispatch; gdsw17: the Gluon fc2 dgrad + dSwiGLU kernel and ``TE_OPS_FC2_DSWIGLU_KERNEL``).

CPU: the dispatch text claims no speed-up the rule entries were not measured at; the
Gluon fprop/dgrad config rejects values of the wrong kind naming the key; the dSwiGLU kernel's
config rejects launches over SM90's shared memory (and the benchmark's ``--gluon`` turns that
into a usage error); ``explain()`` says why the fused launch runs the Triton kernel under
``TE_OPS_FC2_DSWIGLU_KERNEL=auto``; a non-contiguous dy (copied by the launch) does not keep
the Gluon kernel out. sm_90 ahead-of-time compiles (Triton 3.6 on the path, skipped
otherwise): the exact ``DISPATCH_CONFIG`` build, and the dSwiGLU kernel's shared-memory
estimate against the compiled size.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

from te_ops.fused import fc2_dgrad_epilogue as fe
from te_ops.kernels import dgrad_dswiglu_gluon as GD
from te_ops.gemm import grouped_gemm_gluon as GG

N128 = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "WORKER_REGS": 128,
        "CONSUMER_REGS": 128}


# ------------------------------------------------------------------ gtail17: dispatch text
@pytest.mark.parametrize("features, rows, kinds", [
    ((4096, 28672), "2048", ("fprop", "dgrad")),
    ((7168, 4096), "1024", ("dgrad",)),  # E32 fc1: its fprop back in Triton
    ((768, 2048), "512", ("fprop", "dgrad"))])
def test_gluon_dispatch_text_claims_what_was_measured(monkeypatch, features, rows, kinds):
    """The entries (E8 / E32) measured 1.006-1.037x the Triton kernel: the choice's
    reason must not say ">= 1.03x" (the threshold); it names the rule's entries."""
    from te_ops.gemm import dispatch as grouped_gemm

    monkeypatch.setattr(grouped_gemm, "large_auto_reason", lambda *a: None)
    both = ("fprop", "dgrad")
    choice = grouped_gemm._select_backend(torch.device("cpu"), torch.bfloat16, *features,
                                          True, "auto", "auto", (), both, kinds)
    assert choice.gluon_kinds == kinds
    assert "1.03x" not in choice.reason
    assert "measured faster than the persistent Triton kernel in two runs" in choice.reason
    assert "GLUON_RULE=" + ",".join(f"{k}@{rows}" for k in kinds) in choice.reason


@pytest.mark.parametrize("change, match", [
    ({"STAGES": 0}, "config STAGES must be an int >= 1, got 0"),
    ({"SPLIT": 1, "num_warps": 4}, "config SPLIT must be a bool, got 1"),
    ({"C_HALF": "yes"}, "config C_HALF must be a bool, got 'yes'"),
    ({"LAG": True}, "config LAG must be an int >= 1, got True"),
    ({"SUB_M": 2.0}, r"config SUB_M must be an int >= 1, got 2\.0"),
])
def test_gluon_gemm_config_values_name_the_key(change, match):
    with pytest.raises(ValueError, match=match):
        GG._resolve(change)


# ------------------------------------------------------- gdsw17: the dSwiGLU kernel's config
def test_dswiglu_config_rejects_launches_over_shared_memory():
    """The default tiles with a fourth stage need 256 KiB (compiled: 262768 bytes on sm_90)
    and 128 x 256 tiles 336 KiB: a ValueError naming the sizes, not a launch failure."""
    with pytest.raises(ValueError, match=r"config STAGES=4 BLOCK_M=64 BLOCK_N=256 BLOCK_K=64 "
                                         r"needs 262400 bytes of shared memory"):
        GD._resolve({"STAGES": 4})
    with pytest.raises(ValueError, match="BLOCK_M=128 BLOCK_N=256 .* needs 344576 bytes"):
        GD._resolve({**N128, "BLOCK_N": 256})
    for ok in (None, N128, {**N128, "STAGES": 4}, {**N128, "SPLIT": True, "num_warps": 4}):
        cfg = GD._resolve(ok)
        assert GD.shared_bytes(cfg) <= GG.SHARED_LIMIT
    assert GD.shared_bytes(GD.gluon_dswiglu_config()) == 3 * 40960 + 3 * 32768 + 256


def test_benchmark_rejects_a_dswiglu_config_over_shared_memory(capsys):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import large_gemm_triton as bench

    with pytest.raises(SystemExit):
        bench.main(["--gemms", "fc2_dswiglu", "--gluon", '{"gluon": {"STAGES": 4}}'])
    assert "needs 262400 bytes of shared memory" in capsys.readouterr().err


# ------------------------------------------------------ gdsw17: kernel choice and explain()
def _fused_call(monkeypatch, dy2d):
    """fc2_dgrad_dswiglu with the gate open and the launch recorded, not run: the text
    recorded for explain() and the kernel passed to the launch."""
    rows, f, g = dy2d.shape[0], 8, 2
    records, launches = [], []
    h = torch.zeros(rows, 2 * f, dtype=torch.bfloat16)
    act = SimpleNamespace(glu_interleave_size=None,
                          record_dispatch=lambda kind, text: records.append(text))
    saved2 = SimpleNamespace(
        splits=SimpleNamespace(num_rows=rows, num_groups=g, offsets=torch.tensor([3, rows])),
        backend=None, weights_view=torch.zeros(g, dy2d.shape[1], f, dtype=torch.bfloat16))
    saved_act = SimpleNamespace(backend=None, input=lambda: h, probs=None)
    monkeypatch.setattr(fe, "fc2_dgrad_epilogue_reason", lambda *a: None)

    def run(dy, w, offs, h2d, p, write_output, grad_into_input, kernel):
        launches.append(kernel)
        return h2d, None, None

    monkeypatch.setattr(fe, "run_dgrad_dswiglu", run)
    layer = SimpleNamespace(has_bias=False, in_features=f)
    fe.fc2_dgrad_dswiglu(layer, act, layer, saved2, saved_act, dy2d, None, True)
    return records[-1], launches[-1]


def test_explain_says_why_the_fused_launch_runs_in_triton(monkeypatch):
    """Under TE_OPS_FC2_DSWIGLU_KERNEL=auto the Triton kernel runs where the Gluon one cannot:
    the recorded text carries the reason (a silent fallback before), and the forced choice."""
    dy = torch.zeros(8, 6, dtype=torch.bfloat16)
    monkeypatch.setenv("TE_OPS_FC2_DSWIGLU_KERNEL", "auto")
    text, kernel = _fused_call(monkeypatch, dy)
    assert kernel == "triton"
    assert text.startswith("one Triton launch for fc2's dgrad and the activation backward "
                           "(the Gluon kernel cannot run: ")
    monkeypatch.setenv("TE_OPS_FC2_DSWIGLU_KERNEL", "triton")
    text, _ = _fused_call(monkeypatch, dy)
    assert text.endswith("(forced by TE_OPS_FC2_DSWIGLU_KERNEL=triton)")
    monkeypatch.setattr(GD, "gluon_dswiglu_unsupported_reason", lambda *a: None)
    monkeypatch.setenv("TE_OPS_FC2_DSWIGLU_KERNEL", "auto")
    text, kernel = _fused_call(monkeypatch, dy)
    assert kernel == "gluon" and text.startswith("one warp-specialized Gluon launch for fc2's "
                                                 "dgrad and the activation backward (measured")


def test_a_non_contiguous_dy_does_not_keep_the_gluon_kernel_out(monkeypatch):
    """The launch copies a non-contiguous dy (the expanded gradient of ``out.sum()``) before
    its TMA loads, so the reason judges the contiguous copy: Gluon under auto, no raise under
    ``gluon``; the TMA checks stand in for the CUDA ones (this runs on the CPU)."""
    monkeypatch.setattr(GD, "gluon_unsupported_reason",
                        lambda x, w: None if x.is_contiguous() else "x is not contiguous")
    dy = torch.ones(1, 6, dtype=torch.bfloat16).expand(8, 6)
    w = torch.zeros(2, 6, 8, dtype=torch.bfloat16)
    h = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert not dy.is_contiguous()
    assert GD.gluon_dswiglu_unsupported_reason(dy, w, h) is None
    monkeypatch.setenv("TE_OPS_FC2_DSWIGLU_KERNEL", "gluon")
    assert fe.dswiglu_kernel(dy, w, h)[0] == "gluon"
    # the other operands are still judged as given: h is written in place
    assert "h is not contiguous" in GD.gluon_dswiglu_unsupported_reason(
        dy, w, torch.zeros(16, 8, dtype=torch.bfloat16).t())


# ---------------------------------------------------------------- sm_90 AOT (Triton 3.6)
@pytest.mark.parametrize("dgrad", [False, True], ids=["fprop", "dgrad"])
def test_dispatch_config_itself_compiles_for_sm90(dgrad):
    """The dispatched build (``SPLIT`` + ``C_HALF`` + 4 stages, no ``SKIP_TAIL``, ``LAG`` 1):
    the compile tests above it cover ``C_HALF`` only with ``SKIP_TAIL`` on. Shared memory
    between the estimate and 227 KiB, one wgmma group in flight, no spills."""
    from test_gluon_fprop import _compile_sm90

    kernel = _compile_sm90(dgrad, extra=GG.DISPATCH_CONFIG)
    ptx = kernel.asm["ptx"]
    assert GG._shared_bytes(GG._resolve(GG.DISPATCH_CONFIG)) <= kernel.metadata.shared
    assert kernel.metadata.shared <= 227 * 1024
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    assert "wgmma.wait_group.sync.aligned 2;" not in ptx
    assert "st.local" not in ptx and "ld.local" not in ptx


@pytest.mark.parametrize("change", [None, N128, {**N128, "STAGES": 4}],
                         ids=["default", "n128", "n128_4stages"])
def test_dswiglu_shared_estimate_matches_the_compiled_kernel(change):
    """:func:`dgrad_dswiglu_gluon.shared_bytes` is the compiled size less the barriers (a
    few hundred bytes), so the config check's margin (2 KiB) holds."""
    from test_dgrad_dswiglu_gluon import _compile_sm90

    kernel = _compile_sm90(change)
    est = GD.shared_bytes(GD._resolve(change))
    assert est <= kernel.metadata.shared <= est + 1024
    assert kernel.metadata.shared <= 227 * 1024
