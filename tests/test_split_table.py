"""Split-size metadata (``te_ops.kernels.split_table``): the one-launch Triton kernel and its
torch path.

CPU (CI): the torch path against an independent reference built from Python ints (cumulative
sums, the int32 ends, the validity rule: every size and end in ``[0, rows]``, floats whole),
for every accepted dtype and for bad sizes (negative, sum past the rows, fractions, NaN, inf,
sizes that would wrap int64). The Triton kernel runs on CPU through Triton's interpreter in
``tests/test_split_table_interpret.py``. CUDA: the kernel equal to the torch path for every
dtype at 7 and 8192 groups (one program), ``make_splits`` on CUDA equal to the CPU one,
CUDA-graph replay with new sizes and ``torch.compile(fullgraph=True)`` equal to eager; the
tuned decode GEMM configurations bitwise equal to other tile choices (the same k-steps in the
same order), and against the fp64 reference at the E64 layer shapes.
"""

from __future__ import annotations

import math

import pytest
import torch

from te_ops.kernels import split_table as st
from te_ops.splits import make_splits

CUDA = torch.device("cuda")
DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.float64,
          torch.float32, torch.float16, torch.bfloat16]


def _expected(sizes: list[float], rows: int) -> tuple[list[int], list[int], bool]:
    """(table without its flag entry, int32 ends, valid) from Python numbers."""
    ints = [int(v) if math.isfinite(v) else 0 for v in sizes]
    ends = [sum(ints[:i + 1]) for i in range(len(ints))]
    whole = all(math.isfinite(v) and v == int(v) for v in sizes)
    valid = whole and all(0 <= v <= rows for v in ints + ends)
    return [0] + ends + ints, ends, valid


def _check(got: st.SplitTable, sizes, rows):
    want_table, want_ends, want_valid = _expected(sizes, rows)
    groups = len(sizes)
    assert got.base_offsets.shape == (groups + 1,) and got.base_offsets.dtype == torch.int64
    assert got.ends.dtype == torch.int64 and got.sizes.dtype == torch.int64
    assert got.offsets.shape == (groups,) and got.offsets.dtype == torch.int32
    assert bool(got.valid) is want_valid, (sizes, rows)
    if want_valid:
        assert got.base_offsets.tolist() == want_table[:groups + 1]
        assert got.ends.tolist() == want_ends and got.sizes.tolist() == want_table[groups + 1:]
        assert got.offsets.tolist() == want_ends


def _assert_same(got: st.SplitTable, want: st.SplitTable) -> None:
    for name in ("base_offsets", "ends", "sizes", "offsets"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()), name


CASES = {  # name -> (sizes, rows)
    "decode": ([0, 1, 3, 0, 17, 2, 0, 40], 64),
    "padding": ([3, 0, 5, 1], 20),
    "exact": ([5, 5], 10),
    "all_empty": ([0, 0, 0], 9),
    "one_group": ([7], 7),
    "no_rows": ([0, 0], 0),
    "sum_past_rows": ([6, 5], 10),
    "one_size_past_rows": ([11, 0], 10),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_torch_path_matches_reference(case, dtype):
    sizes, rows = CASES[case]
    t = torch.tensor(sizes).to(dtype)
    _check(st.split_table_torch(t, rows), sizes, rows)


BAD = [  # (sizes, dtype, rows): each is flagged invalid
    ([3, -1, 2], torch.int64, 10), ([-1, 2], torch.int8, 10), ([6, 5], torch.int32, 10),
    ([2.5, 1.0], torch.float32, 10), ([float("nan"), 1.0], torch.bfloat16, 10),
    ([float("inf"), 0.0], torch.float64, 10), ([-0.5, 1.0], torch.float16, 10),
    ([2.0 ** 62] * 3, torch.float64, 2 ** 40), ([2 ** 62] * 3, torch.int64, 2 ** 40),
    ([11], torch.uint8, 10),
]


@pytest.mark.parametrize("sizes, dtype, rows", BAD)
def test_torch_path_flags_bad_sizes(sizes, dtype, rows):
    assert not bool(st.split_table_torch(torch.tensor(sizes, dtype=dtype), rows).valid)


def test_torch_path_without_check_has_no_flag():
    got = st.split_table_torch(torch.tensor([1, 2]), 3, check=False)
    assert got.valid is None and got.base_offsets.tolist() == [0, 1, 3]
    assert got.offsets.tolist() == [1, 3]


def test_backend_choice():
    assert st.split_table_backend(torch.zeros(4, dtype=torch.int64)) == "torch"
    assert st.split_table_backend(torch.zeros(4, device="meta", dtype=torch.int64)) == "torch"


@pytest.mark.parametrize("dtype", [torch.int32, torch.float32], ids=str)
def test_make_splits_uses_the_table(dtype):
    splits = make_splits(torch.tensor([2, 0, 3], dtype=dtype), 3, 6, torch.device("cpu"))
    assert splits.base_offsets.tolist() == [0, 2, 2, 5]
    assert splits.offsets.tolist() == [2, 2, 5] and splits.offsets.dtype == torch.int32
    assert splits.split_sizes.tolist() == [2, 0, 3]
    assert splits.split_sizes.dtype == torch.int64 and splits.has_padding is True


def test_make_splits_bad_device_sizes_still_raise():
    with pytest.raises(RuntimeError, match="non-negative and sum to at most"):
        make_splits(torch.tensor([4, 3]), 2, 6, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="whole, non-negative"):
        make_splits(torch.tensor([1.5, 3.0]), 2, 6, torch.device("cpu"))


def test_group_id_searches_take_boundaries_at_storage_offset_zero(monkeypatch):
    """Every ``torch.searchsorted`` of a block step (bias rows; the blockwise-FP8 column layout)
    gets boundaries at storage offset 0: inductor's lowering in torch 2.11 ignores a sliced
    view's offset (pytorch/pytorch#182343) and gave compiled CUDA blocks the wrong groups.
    Meta tensors take the device branch (the CPU one counts ends without a search)."""
    import te_ops
    from te_ops.recipe import Float8BlockScaling
    from test_graph_safety import inputs, make_block

    offsets: list[int] = []
    real = torch.searchsorted

    def recording(boundaries, values, **kw):
        offsets.append(boundaries.storage_offset())
        return real(boundaries, values, **kw)

    monkeypatch.setattr(torch, "searchsorted", recording)
    block = make_block(device="meta", bias=True, hidden=160, ffn=136)
    x, sizes, probs = inputs("meta", hidden=160)
    with te_ops.autocast(recipe=Float8BlockScaling()):
        y = block(x, sizes, probs, sizes)
    y.backward(torch.empty_like(y))
    assert len(offsets) >= 2 and set(offsets) == {0}, offsets


def test_group_ids_of_padding_and_empty_groups():
    sizes = [3, 0, 2, 0]
    splits = make_splits(torch.tensor(sizes), 4, 7, torch.device("cpu"))
    assert splits.group_ids.tolist() == [0, 0, 0, 2, 2, 4, 4]
    for sizes in (torch.zeros(0, dtype=torch.int64), []):  # no groups: every row is padding
        none = make_splits(sizes, 0, 3, torch.device("cpu"))
        assert none.group_ids.tolist() == [0, 0, 0] and none.has_padding is True


# ------------------------------------------------------------------------------ CUDA
def _random_sizes(groups: int, rows: int, dtype: torch.dtype, gen: torch.Generator):
    # int8 / uint8 hold up to 127, bfloat16 whole numbers exactly up to 256
    cap = 100 if dtype in (torch.int8, torch.uint8, torch.bfloat16, torch.float16) else rows
    picks = torch.randint(0, groups, (min(cap, rows),), generator=gen)
    return torch.bincount(picks, minlength=groups).to(dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("groups", [7, 8192])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_equals_torch_path(groups, dtype):
    gen = torch.Generator().manual_seed(groups)
    rows = 4096
    for sizes in (_random_sizes(groups, rows, dtype, gen), torch.zeros(groups, dtype=dtype)):
        dev = sizes.to(CUDA)
        assert st.split_table_backend(dev) == "triton"
        got = st.split_table(dev, rows)
        want = st.split_table_torch(sizes, rows)
        _assert_same(got, want)
        assert int(got.valid) == 1 and bool(want.valid)
        assert (got.sizes is dev) is (dtype == torch.int64)


@pytest.mark.cuda
@pytest.mark.parametrize("sizes, dtype, rows", BAD)
def test_kernel_flags_bad_sizes(sizes, dtype, rows):
    assert int(st.split_table(torch.tensor(sizes, dtype=dtype, device=CUDA), rows).valid) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32], ids=str)
def test_kernel_reads_strided_sizes(dtype):
    """A 1-D view with another stride (a column of a per-expert table, a broadcast count):
    the kernel reads it through its stride, not as contiguous entries."""
    table = torch.tensor([[0, 9], [1, 9], [3, 9], [0, 9], [17, 9], [2, 9]], dtype=dtype,
                         device=CUDA)
    for sizes in (table[:, 0], torch.tensor(2, dtype=dtype, device=CUDA).expand(6)):
        assert sizes.stride(0) != 1
        got = st.split_table(sizes, 30)
        _assert_same(got, st.split_table_torch(sizes.cpu(), 30))
        assert int(got.valid) == 1


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32], ids=str)
def test_make_splits_cuda_equals_cpu(dtype):
    sizes = torch.tensor([0, 1, 3, 0, 17, 2, 0, 40], dtype=dtype)
    dev = sizes.to(CUDA)
    gpu = make_splits(dev, 8, 70, dev.device)
    cpu = make_splits(sizes, 8, 70, torch.device("cpu"))
    for name in ("split_sizes", "offsets", "base_offsets", "group_ids"):
        a, b = getattr(gpu, name), getattr(cpu, name)
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b), name
    want = [g for g, n in enumerate([0, 1, 3, 0, 17, 2, 0, 40]) for _ in range(n)]
    assert cpu.group_ids.tolist() == want + [8] * (70 - len(want))  # padding rows: G
    torch.cuda.synchronize()  # the device-side assert passed


@pytest.mark.cuda
def test_graph_replay_equals_eager():
    """make_splits captured in a CUDA graph: replays with new sizes written into the same
    buffer equal eager calls."""
    buf = torch.tensor([4, 0, 9, 3], device=CUDA)
    make_splits(buf, 4, 20, buf.device)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = make_splits(buf, 4, 20, buf.device)
    for sizes in ([4, 0, 9, 3], [0, 0, 20, 0], [1, 1, 1, 1], [0, 0, 0, 0]):
        buf.copy_(torch.tensor(sizes))
        graph.replay()
        want = make_splits(buf, 4, 20, buf.device)
        assert torch.equal(got.base_offsets, want.base_offsets), sizes
        assert torch.equal(got.offsets, want.offsets), sizes
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_torch_compile_fullgraph_equals_eager():
    from torch._dynamo.testing import CompileCounterWithBackend

    def fn(sizes):
        s = make_splits(sizes, sizes.shape[0], 64, sizes.device)
        return s.base_offsets * 1, s.offsets * 1, s.split_sizes * 1

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, fullgraph=True, backend=cnt)
    for dtype in (torch.int64, torch.int32):
        sizes = torch.tensor([0, 1, 3, 0, 17, 2, 0, 40], dtype=dtype, device=CUDA)
        for got, want in zip(compiled(sizes), fn(sizes)):
            assert torch.equal(got, want)
    assert cnt.frame_count >= 1
    torch.cuda.synchronize()


# ------------------------------------------------- CUDA: the tuned decode GEMM configurations
_OLD_ROWS = {"fprop": {"BLOCK_J": 32, "BLOCK_R": 256}, "dgrad": {"BLOCK_J": 64, "BLOCK_R": 128}}


@pytest.mark.cuda
@pytest.mark.parametrize("layer", ["fc1", "fc2"])
def test_decode_configs_bitwise_equal_to_earlier_and_match_fp64(layer):
    """E64's layer shapes (fc1: N 1536, K 2048; fc2: N 2048, K 768) over 16 experts at ~4 rows
    each (skewed, some empty, 5 padding rows): the tuned fprop / dgrad tiles give the same bits
    as the sweep's other tiles (fprop 32 / 256, dgrad 64 / 128, 32 columns), and match fp64."""
    import torch.nn.functional as F
    from reference import assert_close

    from te_ops.gemm import grouped_gemm_triton as tg

    n, k = (1536, 2048) if layer == "fc1" else (2048, 768)
    sizes = [0, 3, 9, 1, 0, 4, 4, 2, 12, 0, 5, 3, 1, 6, 4, 5]
    rows = sum(sizes) + 5
    gen = torch.Generator(device=CUDA).manual_seed(1)
    x = torch.randn(rows, k, device=CUDA, dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(rows, n, device=CUDA, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(len(sizes), n, k, device=CUDA, dtype=torch.bfloat16, generator=gen) * k ** -0.5
    offs = torch.cumsum(torch.tensor(sizes, device=CUDA), 0).to(torch.int32)
    y, dx = tg.triton_fprop(x, w, offs), tg.triton_dgrad(dy, w, offs)
    for kind, got, a, j in (("fprop", y, x, n), ("dgrad", dx, dy, k)):
        cfg = {**tg.rows_config(kind, rows / len(sizes), j, len(sizes), rows), **_OLD_ROWS[kind]}
        call = tg.triton_fprop if kind == "fprop" else tg.triton_dgrad
        assert torch.equal(got, call(a, w, offs, cfg)), kind
        assert torch.equal(got, call(a, w, offs, {**cfg, "BLOCK_J": 32})), kind
    want_y = torch.zeros(rows, n, dtype=torch.float64)
    want_dx = torch.zeros(rows, k, dtype=torch.float64)
    xd, dyd, wd = x.double().cpu(), dy.double().cpu(), w.double().cpu()
    start = 0
    for g, m in enumerate(sizes):
        want_y[start:start + m] = F.linear(xd[start:start + m], wd[g])
        want_dx[start:start + m] = F.linear(dyd[start:start + m], wd[g].t())
        start += m
    assert_close(y, want_y, torch.bfloat16, "fprop")
    assert_close(dx, want_dx, torch.bfloat16, "dgrad")
    assert torch.count_nonzero(y[start:]) == 0 and torch.count_nonzero(dx[start:]) == 0
