"""The eager launch of te_ops' Triton kernels (te_ops/kernels/triton_launch.py): the grid
helpers against their definitions, the launch made on the tensors' device (CPU stand-ins for
the device calls), and on two GPUs a block whose tensors live on the non-current device.
"""

from __future__ import annotations

import pytest
import torch
from gemm_force import NO_FC1_FUSED, FC1_FUSED_ANY, with_rows

from te_ops.kernels import triton_launch


class _Kernel:
    """A stand-in ``JITFunction``: ``kernel[grid](...)`` records the launch."""

    def __init__(self) -> None:
        self.log: list = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append((grid, args, kwargs))
        return run


def test_launch_is_the_plain_triton_launch():
    """``launch(kernel, grid, *args, **kwargs)`` is ``kernel[grid](*args, **kwargs)``."""
    kernel = _Kernel()
    x = torch.zeros(4)
    triton_launch.launch(kernel, (3, 2), x, 7, BLOCK=16, num_warps=4)
    assert kernel.log == [((3, 2), (x, 7), {"BLOCK": 16, "num_warps": 4})]


def test_grid_helpers_match_their_definitions():
    """cdiv / next_power_of_2 (the launch wrappers' plain-Python grid helpers) against
    independent definitions."""
    for x in range(0, 300):
        for y in (1, 2, 3, 16, 32, 64, 128, 1024):
            assert triton_launch.cdiv(x, y) == -(-x // y) == (x // y + (x % y > 0))
    for n in list(range(1, 3000)) + [2**20 - 1, 2**20, 2**20 + 1, 2**40 + 3]:
        p = 1
        while p < n:
            p *= 2
        assert triton_launch.next_power_of_2(n) == p


def test_a_launch_runs_with_the_tensors_device_current(monkeypatch):
    """Triton launches on the current device: a call whose tensors live on another CUDA
    device makes theirs current around the launch (CPU stand-ins for the device calls)."""
    events = []

    class Guard:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            events.append(("enter", self.index))

        def __exit__(self, *exc):
            events.append(("exit", self.index))

    kernel = _Kernel()

    def record(grid):
        events.append(("launch", grid))
        return lambda *a, **k: None

    monkeypatch.setattr(type(kernel), "__getitem__", lambda self, grid: record(grid))
    monkeypatch.setattr(triton_launch.torch.cuda, "device", Guard)
    monkeypatch.setattr(triton_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(triton_launch, "_cuda_index", lambda args: 1)
    triton_launch.launch(kernel, (2,), torch.zeros(4), 3, BLOCK=16)
    assert events == [("enter", 1), ("launch", (2,)), ("exit", 1)]
    events.clear()
    monkeypatch.setattr(triton_launch, "_cuda_index", lambda args: 0)
    triton_launch.launch(kernel, (2,), torch.zeros(4), 3, BLOCK=16)
    assert events == [("launch", (2,))]


def test_cuda_index_of_cpu_tensors_is_none():
    assert triton_launch._cuda_index((torch.zeros(2), 3)) is None
    assert triton_launch._cuda_index((3, 4.0)) is None


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.cuda
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs")
def test_tensors_on_another_device_launch_there_on_its_current_stream():
    """With cuda:0 current, te_ops' Triton kernels (a block's first and repeated calls) given
    tensors on cuda:1 launch on cuda:1 and on cuda:1's current stream: inputs written on a side
    stream of cuda:1 behind a long sleep are read only after it (a launch on another stream
    would read them before); results equal a run with cuda:1 current."""
    pytest.importorskip("triton")
    import te_ops
    from te_ops.gemm import grouped_gemm_triton

    torch.manual_seed(0)
    groups, hidden, ffn, rows = 8, 64, 32, 32
    dev = torch.device("cuda", 1)
    kw = {"bias": False, "single_grouped_weight": True, "device": dev, "dtype": torch.bfloat16}

    def make():
        torch.manual_seed(0)
        return te_ops.Sequential(te_ops.GroupedLinear(groups, hidden, 2 * ffn, **kw),
                                 te_ops.ScaledSwiGLU(),
                                 te_ops.GroupedLinear(groups, ffn, hidden, **kw))

    split = torch.full((groups,), rows // groups, device=dev, dtype=torch.int64)
    src = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)
    probs = torch.rand(rows, device=dev, dtype=torch.bfloat16)
    w = torch.randn(groups, 2 * ffn, hidden, device=dev, dtype=torch.bfloat16)
    offsets = torch.cumsum(split, 0).to(torch.int32)

    def run(block, make_x=src.clone):
        x = make_x().requires_grad_()
        out = block(x, split, probs, split)
        out.backward(torch.ones_like(out))
        return [out.detach(), x.grad, *[p.grad for p in block.parameters()]]

    with torch.cuda.device(1):
        want_gemm = grouped_gemm_triton.triton_fprop(src, w, offsets)
        ref_block = make()
        want = [run(ref_block) for _ in range(3)][-1]
    torch.cuda.synchronize(dev)

    torch.cuda.set_device(0)
    side = torch.cuda.Stream(dev)
    torch.cuda.set_stream(side)  # cuda:1's current stream (this may make cuda:1 current)
    torch.cuda.set_device(0)
    try:
        assert torch.cuda.current_device() == 0
        assert torch.cuda.current_stream(dev) == side

        def late():
            """src, copied on cuda:1's side stream behind a long sleep (cuda:0 current
            again after)."""
            with torch.cuda.stream(side):
                buf = torch.full_like(src, float("nan"))
                torch.cuda._sleep(100_000_000)  # ~50 ms on an H200 before the copy
                return buf.copy_(src)

        got_gemm = grouped_gemm_triton.triton_fprop(late(), w, offsets)
        assert torch.cuda.current_device() == 0
        block = make()
        got = [run(block, late) for _ in range(3)][-1]  # the third call: the cached plan
        torch.cuda.synchronize(dev)
    finally:
        torch.cuda.set_stream(torch.cuda.default_stream(dev))
        torch.cuda.set_device(0)
    assert torch.equal(got_gemm, want_gemm)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
