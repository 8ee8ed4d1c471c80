"""The persistent Triton grouped wgrad (``te_ops/gemm/grouped_wgrad_large_triton.py``).

CPU (CI, with or without triton): the config, argument errors, the TMA gate's reasons, the
FakeTensor / FunctionalTensor check, the program count and the group order. The interpreter
run of the kernel is in ``tests/test_grouped_wgrad_large_triton_interpret.py``; an sm_90
ahead-of-time compile (wgmma, TMA, shared memory) runs where triton is installed. CUDA
(``@pytest.mark.cuda``): dW against an fp64 per-group reference at N(0, 1) inputs on the
benchmark layers' fc1 / fc2 wgrad shapes scaled down (bf16 and fp16,
TMA and pointer loads, NaN padding rows, empty and skewed groups, dims off the tiles), the
fp32 accumulation into ``out``, ``torch.compile(fullgraph=True)`` and CUDA-graph replay with
new device offsets bitwise equal to eager, and the difference from ``torch._grouped_mm``.
"""

from __future__ import annotations

import pytest
import torch
from sm90_compile import compile_for_sm90

from te_ops.gemm import grouped_wgrad_large_triton as W

CUDA = torch.device("cuda")


# ----------------------------------------------------------------------------------- CPU
def test_config_keys():
    cfg = W.large_wgrad_config()
    assert set(cfg) == {"BLOCK_M", "BLOCK_N", "BLOCK_K", "USE_TMA", "FLAT", "TMA_STORE",
                        "num_warps", "num_stages"}
    assert cfg["FLAT"] and cfg["TMA_STORE"]
    assert (cfg["BLOCK_N"], cfg["BLOCK_K"]) == (128, 256)


def _ops(m=8, n=6, k=4, dtype=torch.bfloat16):
    return (torch.zeros(m, k, dtype=dtype), torch.zeros(m, n, dtype=dtype),
            torch.tensor([3, 8]))


@pytest.mark.parametrize("change, match", [
    ({"x": torch.zeros(8, 4, 1)}, r"x must be 2-D \(rows, in_features\), got shape \(8, 4, 1\)"),
    ({"dy": torch.zeros(7, 6, dtype=torch.bfloat16)},
     r"dy must be 2-D \(8, out_features\) torch.bfloat16 on cpu, got shape \(7, 6\)"),
    ({"dy": torch.zeros(8, 6)}, r"dy must be .* got shape \(8, 6\) torch.float32"),
    ({"offs": torch.tensor([[3, 8]])}, r"offsets must be 1-D int32/int64 \(G,\) on cpu, got "
                                       r"torch.int64 \(1, 2\)"),
    ({"offs": torch.tensor([3.0, 8.0])}, "offsets must be 1-D int32/int64 .* got torch.float32"),
    ({"out": torch.zeros(2, 6, 4, dtype=torch.bfloat16)},
     r"out must be a contiguous torch.float32 tensor of shape \(2, 6, 4\) on cpu, got "
     r"torch.bfloat16 \(2, 6, 4\)"),
    ({"out": torch.zeros(3, 6, 4)}, r"out must be .* shape \(2, 6, 4\) .* got torch.float32 "
                                    r"\(3, 6, 4\)"),
    ({"out": torch.zeros(2, 4, 6).transpose(1, 2)}, r"\(2, 6, 4\) on cpu \(not contiguous\)"),
])
def test_argument_errors_name_the_argument(change, match):
    x, dy, offs = _ops()
    x, dy, offs = change.get("x", x), change.get("dy", dy), change.get("offs", offs)
    with pytest.raises(ValueError, match=match):
        W.large_wgrad(x, dy, offs, out=change.get("out"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_raises_with_the_reason(dtype):
    with pytest.raises(RuntimeError, match="wgrad cannot run: device type cpu is not cuda"):
        W.large_wgrad(*_ops(dtype=dtype))


def test_fake_check_sees_functional_tensors():
    """The TMA gate must not read the data pointer of a FakeTensor, also when a
    FunctionalTensor wraps it (what torch.compile passes to a triton_op body)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    with FakeTensorMode():
        fake = torch.empty(8, 16, dtype=torch.float16)
    with FunctionalTensorMode():
        wrapped = FunctionalTensor.to_functional(fake)
    assert W._fake(fake) and W._fake(wrapped)
    assert not W._fake(torch.empty(8, 16))
    if W.tl is not None and hasattr(W.tl, "make_tensor_descriptor"):
        assert W.tma_unsupported_reason(fake, fake) is None


def test_tma_reasons():
    x = torch.zeros(8, 16, dtype=torch.float16)
    dy = torch.zeros(8, 24, dtype=torch.float16)
    if W.tl is None or not hasattr(W.tl, "make_tensor_descriptor"):
        assert "make_tensor_descriptor" in W.tma_unsupported_reason(x, dy)
        return
    assert W.tma_unsupported_reason(x, dy) is None
    assert W.tma_unsupported_reason(x.t(), dy) == "x is not contiguous"
    assert W.tma_unsupported_reason(x, dy[:, :8]) == "dy is not contiguous"
    assert "dy's row stride (9 elements)" in W.tma_unsupported_reason(x, dy[:, :9].contiguous())
    shifted = torch.zeros(8 * 16 + 1, dtype=torch.float16)[1:].view(8, 16)  # base 2 bytes off
    assert "16-byte boundary" in W.tma_unsupported_reason(shifted, dy)


def test_grid_size_is_bounded_by_tiles():
    cpu = torch.device("cpu")
    assert W.grid_size(cpu, 1, 16, 16, 16, 16) == 1
    assert W.grid_size(cpu, 0, 16, 16, 16, 16) == 1
    assert W.grid_size(cpu, 2, 40, 24, 16, 16) == W._CPU_PROGRAMS  # 2 * 3 * 2 tiles


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_group_order_is_by_decreasing_rows_ties_by_index(dtype):
    offs = torch.tensor([3, 3, 8, 13, 14], dtype=dtype)  # sizes 3, 0, 5, 5, 1
    order = W.group_order(offs)
    assert order.dtype == torch.int64 and order.tolist() == [2, 3, 0, 4, 1]


def test_ops_are_registered_with_the_mutation():
    """The compile-time ops: the accumulating one declares that it writes ``out``."""
    pytest.importorskip("triton")
    acc = torch.ops.te_ops.grouped_wgrad_large_accumulate.default._schema
    plain = torch.ops.te_ops.grouped_wgrad_large.default._schema
    assert [a.alias_info is not None and a.alias_info.is_write for a in acc.arguments] == [
        False, False, False, True]
    assert not any(a.alias_info for a in plain.arguments) and len(plain.returns) == 1


SIGNATURE = {"x_ptr": "*bf16", "dy_ptr": "*bf16", "out_ptr": "*bf16", "offs_ptr": "*i32",
             "order_ptr": "*i64", "M": "i32", "N": "i32", "K": "i32", "G": "i32", "P": "i32"}
#: The flat kernel's: no order table (it sorts the groups itself).
FLAT_SIGNATURE = {k: v for k, v in SIGNATURE.items() if k != "order_ptr"}


@pytest.mark.parametrize("tma, accumulate", [(True, False), (False, False), (True, True)])
def test_compiles_for_sm90_with_wgmma_and_tma(tma, accumulate):
    """Ahead-of-time compile of the default config for SM90 (no GPU needed): the dots are
    wgmma, the TMA variant's loads are TMA copies and its 3 stages fit in shared memory.
    Checked with Triton 3.6.0 (the H200's)."""
    pytest.importorskip("triton")  # the kernel exists only with triton
    cfg = W.large_wgrad_config()
    const = {"ACCUMULATE": accumulate, "USE_TMA": tma,
             **{k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}}
    sig = {**SIGNATURE, "out_ptr": "*fp32" if accumulate else "*bf16"}
    kernel = compile_for_sm90(W._wgrad_large_kernel, sig, const, cfg["num_warps"],
                              cfg["num_stages"])
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx
    assert ("cp.async.bulk.tensor" in ptx) == tma
    assert kernel.metadata.shared <= 227 * 1024
    if tma:  # the row loop is pipelined: num_stages buffers of the dy and x tiles
        step = (cfg["BLOCK_N"] + cfg["BLOCK_K"]) * cfg["BLOCK_M"] * 2
        assert kernel.metadata.shared >= cfg["num_stages"] * step


def test_flat_kernel_compiles_for_sm90_as_one_pipelined_loop():
    """Ahead-of-time compile of the flat schedule for SM90 (no GPU needed): one loop in the
    TTGIR (no nested k-loop left), wgmma dots, TMA loads and a TMA store, and the shared
    memory of the stages and the epilogue tile within SM90's 227 KiB. Checked with Triton
    3.6.0 (the H200's)."""
    pytest.importorskip("triton")  # the kernel exists only with triton
    cfg = W.large_wgrad_config()
    const = {"ACCUMULATE": False, "USE_TMA": True, "TMA_STORE": True, "G_POW2": 8,
             **{k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}}
    kernel = compile_for_sm90(W._wgrad_flat_kernel, FLAT_SIGNATURE, const, cfg["num_warps"],
                              cfg["num_stages"])
    assert kernel.asm["ttgir"].count("scf.for") == 1
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx and "global.shared::cta" in ptx  # loads and store
    assert kernel.metadata.shared <= 227 * 1024


# ---------------------------------------------------------------------------------- CUDA
def _reference(x, dy, sizes):
    out = torch.zeros(len(sizes), dy.shape[1], x.shape[1], dtype=torch.float64,
                      device=x.device)
    start = 0
    for g, n in enumerate(sizes):
        out[g] = dy[start:start + n].double().t() @ x[start:start + n].double()
        start += n
    return out


def _operands(sizes, m, n, k, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(sizes)
    x = torch.randn(m, k, generator=gen, device=CUDA).to(dtype)
    dy = torch.randn(m, n, generator=gen, device=CUDA).to(dtype)
    x[total:] = float("nan")
    dy[total:] = float("nan")
    offs = torch.tensor(sizes, device=CUDA).cumsum(0).to(torch.int32)
    return x, dy, offs


def _assert_close(got, want, dtype):
    """Within the output rounding (half an ulp of the dtype) plus fp32 summation error."""
    rel = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    err = (got.double() - want).abs() - rel * want.abs()
    assert err.max().item() <= 1e-2, err.max().item()


#: The benchmark layers' wgrad shapes scaled down: (split sizes, M incl. padding, N, K); fc1 wgrad
#: dW1 (E, 2FF, H) from x (T, H) and dh (T, 2FF), fc2 wgrad dW2 (E, H, FF) from a (T, FF).
CASES = [
    ([700, 0, 300, 17, 520, 129, 250, 100], 2100, 2 * 448, 512),  # E8 H4096 FF14336 fc1 /8
    ([700, 0, 300, 17, 520, 129, 250, 100], 2100, 512, 448),      # ... fc2
    ([64] * 12 + [0, 5, 300, 131], 1300, 2 * 96, 256),            # E128 H2048 FF768 fc1 /8
    ([64] * 12 + [0, 5, 300, 131], 1300, 256, 96),                # ... fc2
    ([1000, 3, 0, 250], 1300, 2 * 256, 896),                      # E32 H7168 FF2048 fc1 /8
    ([1000, 3, 0, 250], 1300, 896, 256),                          # ... fc2
    ([0, 0], 50, 136, 200),                                       # padding only, off tiles
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("sizes, m, n, k", CASES)
def test_wgrad_against_fp64_reference(dtype, tma, sizes, m, n, k):
    x, dy, offs = _operands(sizes, m, n, k, dtype)
    dw = W._launch(x, dy, offs, None, {"USE_TMA": tma})
    assert dw.shape == (len(sizes), n, k) and dw.dtype == dtype
    _assert_close(dw, _reference(x, dy, sizes), dtype)
    for g, size in enumerate(sizes):
        if size == 0:
            assert not dw[g].any()


@pytest.mark.cuda
@pytest.mark.parametrize("tma", [True, False])
def test_accumulate_into_fp32_out(tma):
    sizes, m, n, k = [300, 0, 17, 129], 460, 384, 256
    x, dy, offs = _operands(sizes, m, n, k, torch.bfloat16)
    main_grad = torch.randn(len(sizes), n, k, device=CUDA)
    before = main_grad.clone()
    got = W._launch(x, dy, offs, main_grad, {"USE_TMA": tma})
    assert got is main_grad
    want = before.double() + _reference(x, dy, sizes)
    assert (main_grad.double() - want).abs().max().item() <= 1e-3
    assert torch.equal(main_grad[1], before[1])  # the empty group adds nothing


@pytest.mark.cuda
@pytest.mark.parametrize("tma", [True, False])
def test_non_contiguous_operands_give_the_same_bits(tma):
    """Column-major views of x and dy (the TMA gate refuses them; the launch makes them
    contiguous first) give the contiguous operands' result bit for bit."""
    x, dy, offs = _operands([100, 60], 170, 256, 128, torch.bfloat16)
    xt, dyt = x.t().contiguous().t(), dy.t().contiguous().t()
    assert W.tma_unsupported_reason(xt, dy) == "x is not contiguous"
    cfg = {"USE_TMA": tma}
    assert torch.equal(W._launch(xt, dyt, offs, None, cfg), W._launch(x, dy, offs, None, cfg))


@pytest.mark.cuda
def test_graph_replay_and_compile_bitwise_equal_to_eager():
    """Captured in a CUDA graph and replayed with new split sizes (new device offsets, same
    rows), and under torch.compile(fullgraph=True): bitwise the eager values, with and
    without ``out``."""
    x, dy, offs = _operands([300, 0, 200], 520, 512, 256, torch.bfloat16)
    want = W.large_wgrad(x, dy, offs)
    static_offs = offs.clone()
    W.large_wgrad(x, dy, static_offs)  # compile outside the capture
    acc = torch.zeros(3, 512, 256, device=CUDA)
    W.large_wgrad(x, dy, static_offs, out=acc)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = W.large_wgrad(x, dy, static_offs)
        acc.zero_()
        W.large_wgrad(x, dy, static_offs, out=acc)
    new = torch.tensor([10, 400, 90], device=CUDA).cumsum(0).to(torch.int32)
    static_offs.copy_(new)
    graph.replay()
    assert torch.equal(out, W.large_wgrad(x, dy, new))
    assert torch.equal(acc, W.large_wgrad(x, dy, new, out=torch.zeros_like(acc)))
    compiled = torch.compile(lambda *a: W.large_wgrad(*a), fullgraph=True)
    assert torch.equal(compiled(x, dy, offs), want)

    def step(x, dy, offs, main_grad):
        W.large_wgrad(x, dy, offs, out=main_grad)
        return main_grad * 1.0

    main_grad = torch.ones(3, 512, 256, device=CUDA)
    got = torch.compile(step, fullgraph=True)(x, dy, offs, main_grad)
    eager = W.large_wgrad(x, dy, offs, out=torch.ones_like(main_grad))
    assert torch.equal(got, eager) and torch.equal(main_grad, eager)


@pytest.mark.cuda
@pytest.mark.parametrize("sizes, m, n, k", CASES[:6])
def test_difference_from_grouped_mm(sizes, m, n, k):
    """Against ``torch._grouped_mm(dy.t(), x, offs)`` (CUTLASS): both round fp32 sums to bf16,
    in different summation orders, so the difference is a few bf16 ulps at most (printed:
    bitwise equality would be a bonus). Padding rows are zeros here: _grouped_mm's own
    handling of garbage past offsets[-1] is not what this compares."""
    x, dy, offs = _operands(sizes, m, n, k, torch.bfloat16)
    x[sum(sizes):] = 0
    dy[sum(sizes):] = 0
    got = W.large_wgrad(x, dy, offs)
    want = torch._grouped_mm(dy.t(), x, offs=offs)
    diff = (got.float() - want.float()).abs()
    print(f"max_abs_diff {diff.max().item():.3g} of max {want.abs().max().item():.3g}, "
          f"bitwise equal: {torch.equal(got, want)}")
    assert (diff <= 2.0 ** -7 * want.float().abs() + 1e-2).all()


#: The FLAT schedule's variants (TMA or pointer stores; pointer loads; other tiles).
FLAT_CONFIGS = [
    {"FLAT": True},
    {"FLAT": True, "TMA_STORE": False},
    {"FLAT": True, "USE_TMA": False},
    {"FLAT": True, "BLOCK_N": 256, "BLOCK_K": 128},
]


@pytest.mark.cuda
@pytest.mark.parametrize("cfg", FLAT_CONFIGS, ids=str)
@pytest.mark.parametrize("sizes, m, n, k", CASES)
def test_flat_schedule_against_fp64_reference(cfg, sizes, m, n, k):
    """The flat schedule (NaN padding rows, empty groups, groups ending inside a row step)
    against the fp64 reference, and bitwise equal to the nested schedule."""
    x, dy, offs = _operands(sizes, m, n, k, torch.bfloat16)
    dw = W._launch(x, dy, offs, None, cfg)
    _assert_close(dw, _reference(x, dy, sizes), torch.bfloat16)
    for g, size in enumerate(sizes):
        if size == 0:
            assert not dw[g].any()
    nested = {**cfg, "FLAT": False}
    nested.pop("TMA_STORE", None)
    assert torch.equal(dw, W._launch(x, dy, offs, None, nested))


@pytest.mark.cuda
def test_flat_schedule_is_not_used_to_accumulate():
    """With ``out`` the launch keeps the nested schedule (the flat one failed this test on
    the H200): FLAT or not, the same bits."""
    sizes, m, n, k = [300, 0, 17, 129], 460, 384, 256
    x, dy, offs = _operands(sizes, m, n, k, torch.bfloat16)
    main_grad = torch.randn(len(sizes), n, k, device=CUDA)
    flat = W._launch(x, dy, offs, main_grad.clone(), {"FLAT": True})
    assert torch.equal(flat, W._launch(x, dy, offs, main_grad.clone(), {"FLAT": False}))


@pytest.mark.cuda
def test_flat_schedule_graph_replay_bitwise_equal_to_eager():
    """Captured with one set of split sizes, replayed with others (groups emptied, grown):
    bitwise the eager flat result."""
    cfg = {"FLAT": True}
    x, dy, offs = _operands([300, 0, 200], 520, 512, 256, torch.bfloat16)
    static_offs = offs.clone()
    W._launch(x, dy, static_offs, None, cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = W._launch(x, dy, static_offs, None, cfg)
    for sizes in ([10, 400, 90], [0, 0, 500], [493, 7, 0]):  # rows 500: NaN padding
        new = torch.tensor(sizes, device=CUDA).cumsum(0).to(torch.int32)
        static_offs.copy_(new)
        graph.replay()
        assert torch.equal(out, W._launch(x, dy, new, None, cfg))
