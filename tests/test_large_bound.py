"""CPU tests of the persistent kernels' bound call sites and the entry points' host caches
(``te_ops/kernels/grouped_gemm_large_bound.py``, ``triton_launch.sm_count`` /
``capability``): which fast-path calls bind to which site, the argument error, the caches
read once, the default config copied out, the eager fake-tensor check. The launches
themselves: ``tests/test_large_bound_interpret.py`` (interpreter) and
``tests/test_large_bound_cuda.py`` (GPU, bitwise against the general path)."""

from __future__ import annotations

import pytest
import torch

from te_ops import fast_step
from te_ops.gemm import grouped_gemm_large_triton as L
from te_ops.gemm import grouped_wgrad_large_triton as W
from te_ops.kernels import triton_launch
from te_ops.gemm.dispatch import BackendChoice
from te_ops.gemm.grouped_gemm_large_bound import BoundLarge
from te_ops.kernels.triton_launch import LaunchBatch


def test_fast_path_binds_the_persistent_kinds_to_their_sites(monkeypatch):
    """Few-rows kinds bind to BoundRows / BoundWgrad, persistent ones to BoundLarge /
    BoundLargeWgrad, the rest dispatch with the recorded backend; without a batch (a trace)
    every kind dispatches."""
    calls = []

    def site(name):
        class Site:
            def __init__(self, *args):
                self.made = args

            def __call__(self, a, b, offsets):
                calls.append((name, *self.made[:-1], a, b, offsets, self.made[-1]))
        return Site

    monkeypatch.setattr(fast_step, "BoundRows", site("rows"))
    monkeypatch.setattr(fast_step, "BoundWgrad", lambda batch: site("rows")("wgrad", batch))
    monkeypatch.setattr(fast_step, "BoundLarge", site("large"))
    monkeypatch.setattr(fast_step, "BoundLargeWgrad",
                        lambda batch: site("large")("wgrad", batch))
    for name in ("grouped_fprop", "grouped_dgrad", "grouped_wgrad"):
        monkeypatch.setattr(fast_step, name,
                            lambda *a, backend, _n=name: calls.append((_n, backend)))
    splits = type("S", (), {"offsets": "OFFS"})()
    batch = LaunchBatch()
    mixed = BackendChoice("triton", "test", True, triton_kinds=("wgrad",),
                          large_kinds=("fprop", "dgrad"))
    for f, a, b in zip(fast_step._gemm_calls(mixed, batch), ("X", "DY", "X"),
                       ("W", "W", "DY")):
        f(a, b, splits)
    assert calls == [("large", "fprop", "X", "W", "OFFS", batch),
                     ("large", "dgrad", "DY", "W", "OFFS", batch),
                     ("rows", "wgrad", "X", "DY", "OFFS", batch)]
    calls.clear()
    every = BackendChoice("triton", "test", True, large_kinds=("fprop", "dgrad", "wgrad"))
    fast_step._gemm_calls(every, batch)[2]("X", "DY", splits)
    assert calls == [("large", "wgrad", "X", "DY", "OFFS", batch)]
    calls.clear()
    for f in fast_step._gemm_calls(every):  # no batch: the dispatching calls
        f("A", "B", splits)
    assert [c[0] for c in calls] == ["grouped_fprop", "grouped_dgrad", "grouped_wgrad"]


def test_bound_large_kind_error_names_the_argument():
    with pytest.raises(ValueError, match="kind must be 'fprop' or 'dgrad', got 'wgrad'"):
        BoundLarge("wgrad", LaunchBatch())


def test_device_properties_are_read_once_per_device(monkeypatch):
    reads = []

    class Props:
        multi_processor_count, major, minor = 132, 9, 0

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: reads.append(index) or Props)
    monkeypatch.setattr(triton_launch, "_SM_COUNTS", {})
    monkeypatch.setattr(triton_launch, "_CAPABILITIES", {})
    dev = torch.device("cuda", 3)
    for _ in range(3):
        assert triton_launch.sm_count(dev) == 132
        assert triton_launch.capability(dev) == (9, 0)
        assert L.grid_size(dev, 1 << 20, 8, 4096, 128, 256) == 132
        assert W.grid_size(dev, 64, 4096, 4096, 128, 256) == 132
    assert reads == [3]
    assert L.grid_size(torch.device("cpu"), 1 << 20, 8, 4096, 128, 256) == L._CPU_PROGRAMS


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "fc1_swiglu"])
@pytest.mark.parametrize("groups", [8, L.FLAT_MAX_GROUPS + 1])
def test_default_config_is_resolved_once_and_copied_out(kind, groups):
    first = L._resolve(kind, None, groups)
    assert first == L._resolve(kind, {}, groups)
    # every kind's default is the flattened schedule (fc1_swiglu too since its PAIRED
    # accumulator, stop 15), the group walk above FLAT_MAX_GROUPS
    assert first["FLAT"] == (groups <= L.FLAT_MAX_GROUPS)
    first["USE_TMA"] = "changed by a launch"
    assert L._resolve(kind, None, groups)["USE_TMA"] is True


def test_plain_tensors_skip_the_fake_tensor_walk(monkeypatch):
    """An eager tensor or Parameter is answered without ``is_fake`` (microseconds per call
    in the persistent kernels' TMA gate); a FakeTensor still is fake (the compile path)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.zeros(4, 8)
    p = torch.nn.Parameter(torch.zeros(2, 4, 8))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
    for check in (L._fake, W._fake):
        assert check(fake)
    monkeypatch.setattr(torch._subclasses.fake_tensor, "is_fake",
                        lambda t: pytest.fail("is_fake called for a plain tensor"))
    for check in (L._fake, W._fake):
        assert not check(x) and not check(p)
    assert W._fake(torch.zeros(2, device="meta"))
