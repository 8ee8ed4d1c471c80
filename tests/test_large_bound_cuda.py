"""The fast path's bound call sites of the persistent many-rows GEMMs and the flat wgrad's
in-kernel group order, on the GPU (``@pytest.mark.cuda``; the CPU twins are
``tests/test_large_bound_interpret.py`` and
``tests/test_grouped_wgrad_large_triton_interpret.py``).

* The fused grouped MLP's fast path (``te_ops.fast_step``) with the persistent kinds bound
  gives the general path's outputs and gradients bit for bit at 64-256 rows per expert (auto:
  fprop, dgrad and the flat wgrad persistent) and at 512 (auto: fprop / dgrad; forced
  ``triton``: all three), skewed sizes with an empty expert and padding rows, one grouped
  weight and per-expert weights; and its launches go through the bound sites.
* A bound site equals its eager entry point bit for bit; an operand whose base pointer is
  not 16-byte aligned takes the entry point (pointer loads) and still equals it.
* The flat wgrad's order (sorted in the kernel) gives the bits of the index order and of the
  nested schedule (torch's argsort order), and the in-register order equals
  ``group_order``.
"""

from __future__ import annotations

import pytest
import torch

import te_ops

pytestmark = pytest.mark.cuda

H, FF, GROUPS = 256, 128, 8


def _sizes(rows_per_group: int) -> list[int]:
    """Skewed sizes summing to GROUPS * rows_per_group - 3 (three padding rows), one empty."""
    sizes = [rows_per_group] * GROUPS
    sizes[0] += rows_per_group // 2 + 5
    sizes[1] -= rows_per_group // 2 + 5
    sizes[2] += sizes[3]
    sizes[3] = 0
    sizes[-1] -= 3
    return sizes


def _block(single: bool) -> te_ops.Sequential:
    torch.manual_seed(0)
    kw = {"single_grouped_weight": single, "bias": False, "device": "cuda",
          "dtype": torch.bfloat16}
    block = te_ops.Sequential(te_ops.GroupedLinear(GROUPS, H, 2 * FF, **kw),
                              te_ops.ScaledSwiGLU(),
                              te_ops.GroupedLinear(GROUPS, FF, H, **kw))
    for w in block.parameters():
        torch.nn.init.normal_(w, std=0.05)
    return block


def _steps(block, sizes: list[int], steps: int = 3) -> list:
    rows = sum(sizes) + 3
    split = torch.tensor(sizes, device="cuda")
    runs = []
    for i in range(steps):
        torch.manual_seed(10 + i)
        x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        probs = torch.rand(rows, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
        for t in (x, probs, *block.parameters()):
            t.grad = None
        out = block(x, split, probs, split)
        fast = type(out.grad_fn).__name__ == "_FastGroupedMLPBackward"
        out.backward(dy)
        runs.append((fast, out.detach(), [t.grad.clone() for t in
                                         (x, probs, *block.parameters())]))
    return runs


@pytest.mark.parametrize("single", [True, False])
@pytest.mark.parametrize("rows_per_group, backend, kinds", [
    (64, "auto", ("fprop", "dgrad", "wgrad")),
    (256, "auto", ("fprop", "dgrad", "wgrad")),
    (512, "auto", ("fprop", "dgrad")),
    (512, "triton", ("fprop", "dgrad", "wgrad")),
])
def test_fast_path_bound_persistent_kinds_bitwise_equal_general(monkeypatch, single,
                                                                rows_per_group, backend,
                                                                kinds):
    from te_ops.gemm import grouped_gemm_large_triton as L
    from te_ops.gemm import grouped_wgrad_large_triton as W
    from te_ops.kernels.triton_launch import direct_launcher

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the persistent kinds are auto-dispatched on SM90 only")
    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", backend)
    sizes = _sizes(rows_per_group)
    results = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("TE_OPS_FAST_STEP", flag)
        block = _block(single)
        before = (direct_launcher(L._large_kernel).bound,
                  direct_launcher(W._wgrad_flat_kernel).bound)
        results[flag] = _steps(block, sizes)
        after = (direct_launcher(L._large_kernel).bound,
                 direct_launcher(W._wgrad_flat_kernel).bound)
        if flag == "1":
            assert [r[0] for r in results[flag]] == [False, True, True]
            assert after[0] > before[0], "the persistent fprop/dgrad launched unbound"
            assert (after[1] > before[1]) == ("wgrad" in kinds), (after, before)
        else:
            assert after == before and not any(r[0] for r in results[flag])
    for (_, o1, g1), (_, o2, g2) in zip(results["1"], results["0"]):
        assert torch.equal(o1, o2)
        assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_bound_sites_equal_entry_points_and_fall_back_on_unaligned_pointers():
    from te_ops.gemm import grouped_gemm_large_triton as L
    from te_ops.gemm import grouped_wgrad_large_triton as W
    from te_ops.gemm.grouped_gemm_large_bound import BoundLarge, BoundLargeWgrad
    from te_ops.kernels.triton_launch import LaunchBatch, direct_launcher

    sizes = _sizes(128)
    m, n, k = sum(sizes) + 3, 384, 256
    offs = torch.tensor(sizes, device="cuda").cumsum(0)
    batch = LaunchBatch()
    fprop, dgrad, wgrad = BoundLarge("fprop", batch), BoundLarge("dgrad", batch), \
        BoundLargeWgrad(batch)
    for call in range(3):
        gen = torch.Generator(device="cuda").manual_seed(call)
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        w = torch.randn(GROUPS, n, k, device="cuda", generator=gen).bfloat16()
        dy = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
        batch.begin(x.device)
        assert torch.equal(fprop(x, w, offs), L.large_fprop(x, w, offs))
        assert torch.equal(dgrad(dy, w, offs), L.large_dgrad(dy, w, offs))
        assert torch.equal(wgrad(x, dy, offs), W.large_wgrad(x, dy, offs))
    assert fprop.plan[4] and wgrad.plan[3]  # TMA loads
    bound = direct_launcher(L._large_kernel).bound
    batch.begin(x.device)
    fprop(x, w, offs)
    assert direct_launcher(L._large_kernel).bound == bound + 1  # the direct launch
    # base pointers 2 bytes past a 16-byte boundary: the entry point (pointer loads)
    xs = torch.empty(m * k + 1, device="cuda", dtype=torch.bfloat16)[1:].view(m, k)
    xs.copy_(x)
    dys = torch.empty(m * n + 1, device="cuda", dtype=torch.bfloat16)[1:].view(m, n)
    dys.copy_(dy)
    assert L.tma_unsupported_reason(xs, w) is not None
    batch.begin(x.device)
    assert torch.equal(fprop(xs, w, offs), L.large_fprop(xs, w, offs))
    assert torch.equal(dgrad(dys, w, offs), L.large_dgrad(dys, w, offs))
    assert torch.equal(wgrad(xs, dys, offs), W.large_wgrad(xs, dys, offs))
    assert direct_launcher(L._large_kernel).bound == bound + 1  # none of those bound
    assert torch.equal(fprop(x, w, offs), L.large_fprop(x, w, offs))  # aligned again


def test_flat_wgrad_in_kernel_order_bits_and_order():
    triton = pytest.importorskip("triton")
    tl = pytest.importorskip("triton.language")
    from te_ops.gemm import grouped_wgrad_large_triton as W

    @triton.jit
    def order_kernel(offs_ptr, out_ptr, M, G, G_POW2: tl.constexpr):
        r = tl.arange(0, G_POW2).to(tl.int64)
        valid = r < G
        tl.store(out_ptr + r, W._rank_order(offs_ptr, r, valid, M, G_POW2), mask=valid)

    gen = torch.Generator().manual_seed(3)
    for g in (1, 7, 128, 300):
        sizes = torch.randint(0, 40, (g,), generator=gen)
        sizes[torch.randint(0, g, (g // 3,), generator=gen)] = 5  # ties
        for dtype in (torch.int32, torch.int64):
            offs = sizes.cumsum(0).to(dtype).cuda()
            out = torch.full((g,), -1, dtype=torch.int32, device="cuda")
            order_kernel[(1,)](offs, out, int(offs[-1]), g,
                               G_POW2=W.next_power_of_2(g))
            assert torch.equal(out.long(), W.group_order(offs)), (g, dtype)
    sizes = [700, 3, 0, 129, 64, 64, 1, 250]
    m, n, k = sum(sizes) + 5, 256, 384
    x = torch.randn(m, k, device="cuda").bfloat16()
    dy = torch.randn(m, n, device="cuda").bfloat16()
    offs = torch.tensor(sizes, device="cuda").cumsum(0)
    sorted_ = W.large_wgrad(x, dy, offs)
    assert torch.equal(sorted_, W.large_wgrad(x, dy, offs, config={"SORTED": False}))
    assert torch.equal(sorted_, W.large_wgrad(x, dy, offs, config={"FLAT": False}))
