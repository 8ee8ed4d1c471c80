"""CPU tests of the persistent kernels' host-side caches (``triton_launch.sm_count`` /
``capability``, the entry points' default configs and their eager fake-tensor check): the
device properties read once per device, the default config copied out, plain tensors answered
without the fake-tensor walk."""

from __future__ import annotations

import pytest
import torch

from te_ops.gemm import grouped_gemm_large_triton as L
from te_ops.gemm import grouped_wgrad_large_triton as W
from te_ops.kernels import triton_launch


def test_device_properties_are_read_once_per_device(monkeypatch):
    reads = []

    class Props:
        multi_processor_count, major, minor = 132, 9, 0

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: reads.append(index) or Props)
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda index: reads.append(("capability", index)) or (9, 0))
    monkeypatch.setattr(triton_launch, "_SM_COUNTS", {})
    monkeypatch.setattr(triton_launch, "_CAPABILITIES", {})
    dev = torch.device("cuda", 3)
    for _ in range(3):
        assert triton_launch.sm_count(dev) == 132
        assert triton_launch.capability(dev) == (9, 0)
        assert L.grid_size(dev, 1 << 20, 8, 4096, 128, 256) == 132
        assert W.grid_size(dev, 64, 4096, 4096, 128, 256) == 132
    assert sorted(reads, key=str) == [("capability", 3), 3]
    assert L.grid_size(torch.device("cpu"), 1 << 20, 8, 4096, 128, 256) == L._CPU_PROGRAMS


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "fc1_swiglu"])
@pytest.mark.parametrize("groups", [8, L.FLAT_MAX_GROUPS + 1])
def test_default_config_is_resolved_once_and_copied_out(kind, groups):
    first = L._resolve(kind, None, groups)
    assert first == L._resolve(kind, {}, groups)
    # every kind's default is the flattened schedule (fc1_swiglu too, with its PAIRED
    # accumulator), the group walk above FLAT_MAX_GROUPS
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
