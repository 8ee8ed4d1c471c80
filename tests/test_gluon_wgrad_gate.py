"""The Gluon wgrad's gate and dispatch.

* The Gluon launch goes through ``triton_launch.launch``, which makes the tensors' device
  current: Triton launches on the *current* CUDA device, so x on ``cuda:1`` while ``cuda:0``
  is current would run the kernel (and allocate its TMA-descriptor scratch) on the wrong one.
* The auto ``triton`` choice's reason says where a wgrad into an fp32 ``main_grad`` runs
  (``wgrad_into``: ``torch._grouped_mm`` with ``out_dtype``), not the Gluon (or persistent /
  few-rows Triton) kernel, as the forced text does.
* The gate checks the 16-byte row pitch on ``K`` (``in_features``), the pitch the kernel's
  descriptors use, not on ``stride(0)``: a contiguous one-row x sliced from a wider buffer
  (``stride(0) != K``) with ``K * 2`` bytes not a multiple of 16 is refused.
* The rule and the gate take only the Gluon API the kernel is written for: Triton 3.5 (torch
  2.9, inside the supported torch >= 2.8) imports the same modules with another
  ``gl.warp_specialize`` API, where the kernel would fail to compile in the backward.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from te_ops.gemm import dispatch as grouped_gemm
from te_ops.gemm import grouped_gemm_large_triton
from te_ops.kernels import triton_launch
from te_ops.gemm import grouped_wgrad_gluon as G


def test_gluon_launch_runs_on_the_tensors_device(monkeypatch):
    """x on cuda:1 while cuda:0 is current: the kernel is called inside ``torch.cuda.device(1)``
    (the scratch allocator runs inside the launch, so it gets device 1 too)."""
    entered: list[int] = []
    calls: list[list[int]] = []

    class Guard:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(self.index)

        def __exit__(self, *exc):
            entered.pop()

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append(list(entered))

    monkeypatch.setattr(torch.cuda, "device", Guard)
    monkeypatch.setattr(triton_launch, "_cuda_index", lambda args: 1)
    monkeypatch.setattr(triton_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(G, "_gluon_wgrad_kernel", Kernel(), raising=False)
    monkeypatch.setattr(G, "gluon_unsupported_reason", lambda *a, **k: None)
    monkeypatch.setattr(G, "sm_count", lambda device: 4)
    monkeypatch.setattr(grouped_gemm_large_triton, "_ensure_allocator", lambda: None)
    x = torch.zeros(8, 256, dtype=torch.bfloat16)
    dy = torch.zeros(8, 128, dtype=torch.bfloat16)
    G._launch(x, dy, torch.tensor([3, 8], dtype=torch.int32), None)
    assert calls == [[1]]


@pytest.mark.parametrize("small, large, gluon", [
    ((), (), ("wgrad",)),  # the Gluon wgrad
    ((), ("fprop", "dgrad", "wgrad"), ()),  # the persistent wgrad (64-256 rows per group)
    (("fprop", "dgrad", "wgrad"), (), ()),  # the few-rows wgrad
])
def test_auto_reason_says_where_a_main_grad_wgrad_runs(monkeypatch, small, large, gluon):
    monkeypatch.setattr(grouped_gemm, "large_auto_reason", lambda *a: None)
    monkeypatch.setattr(grouped_gemm, "triton_auto_reason", lambda *a: None)
    choice = grouped_gemm._select_backend(torch.device("cpu"), torch.bfloat16, 16, 256, True,
                                          "auto", "auto", small, large, gluon)
    assert "wgrad" in choice.gluon_kinds + choice.large_kinds + choice.triton_kinds
    assert "wgrad into an fp32 main_grad in torch._grouped_mm" in choice.reason


def test_auto_reason_without_a_triton_wgrad_names_no_main_grad_route(monkeypatch):
    monkeypatch.setattr(grouped_gemm, "large_auto_reason", lambda *a: None)
    choice = grouped_gemm._select_backend(torch.device("cpu"), torch.bfloat16, 16, 256, True,
                                          "auto", "auto", (), ("fprop", "dgrad"), ())
    assert "main_grad" not in choice.reason


def test_gate_checks_the_row_pitch_the_kernel_uses():
    """(1, 12) bf16 sliced from a (1, 16) buffer is contiguous with stride(0) = 16 (32 bytes),
    but the kernel's pitch is K = 12 (24 bytes): not a TMA row pitch."""
    x = torch.zeros(1, 16, dtype=torch.bfloat16)[:, :12]
    dy = torch.zeros(1, 128, dtype=torch.bfloat16)
    assert x.is_contiguous() and x.stride(0) * x.element_size() % 16 == 0
    why = G.gluon_unsupported_reason(x, dy)
    assert why is not None and "x's rows" in why and "16-byte" in why
    with pytest.raises(RuntimeError, match="x's rows"):
        G.gluon_wgrad(x, dy, torch.tensor([1], dtype=torch.int32))


# Gluon is experimental: Triton 3.5 (torch 2.9's, inside the supported torch >= 2.8) has
# triton.experimental.gluon with the Hopper module but gl.warp_specialize(default_args,
# default_partition, worker_args, worker_partitions, worker_num_warps, worker_num_regs); the
# kernel is written against 3.6's warp_specialize(functions_and_args, worker_num_warps,
# worker_num_regs). The rule and the gate took any importable Gluon, so auto dispatch sent the
# wgrad there and the backward failed in the kernel's compile.
def _ws_35(default_args, default_partition, worker_args, worker_partitions, worker_num_warps,
           worker_num_regs, _semantic=None, _generator=None):
    """Triton 3.5's gl.warp_specialize signature."""


def _ws_36(functions_and_args, worker_num_warps, worker_num_regs, _semantic=None,
           _generator=None):
    """Triton 3.6's gl.warp_specialize signature."""


def _descriptor(*args):
    """tma.make_tensor_descriptor stand-in."""


@pytest.mark.parametrize("ws, tma, match", [
    (_ws_35, SimpleNamespace(make_tensor_descriptor=_descriptor), "warp_specialize"),
    (_ws_36, SimpleNamespace(), "make_tensor_descriptor"),
    (None, SimpleNamespace(make_tensor_descriptor=_descriptor), "warp_specialize"),
])
def test_gluon_api_other_than_the_kernels_is_refused(ws, tma, match):
    why = G.gluon_api_reason(SimpleNamespace(warp_specialize=ws), tma)
    assert why is not None and match in why


def test_gluon_api_of_triton_36_is_taken():
    assert G.gluon_api_reason(SimpleNamespace(warp_specialize=_ws_36),
                              SimpleNamespace(make_tensor_descriptor=_descriptor)) is None


def test_rule_and_gate_refuse_another_gluon_api(monkeypatch):
    monkeypatch.setattr(G, "gluon", object())  # importable ...
    # ... but not 3.6's API
    monkeypatch.setattr(G, "GLUON_API_REASON", "another gl.warp_specialize API")
    assert G.gluon_unavailable_reason(256) == "another gl.warp_specialize API"
    x = torch.zeros(8, 256, dtype=torch.bfloat16)
    dy = torch.zeros(8, 256, dtype=torch.bfloat16)
    assert G.gluon_unsupported_reason(x, dy) == "another gl.warp_specialize API"
