"""The split-size metadata kernel (``te_ops.kernels.split_table``) on the CPU through Triton's
interpreter (``TRITON_INTERPRET=1``), against the torch path (itself checked against Python
ints in ``tests/test_split_table.py``): every accepted dtype, padding, one group, 300 groups,
and bad sizes flagged (negative, sum past the rows, fractions, NaN, sizes that would wrap).
"""

from __future__ import annotations

from interpret import interpreter_marks, run_interpreted

pytestmark = interpreter_marks("tests/test_split_table.py")

SCRIPT = r'''
import torch
from te_ops.kernels import split_table as st

BACKEND = st.split_table_backend

DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.float64,
          torch.float32, torch.float16]
gen = torch.Generator().manual_seed(0)
for dtype in DTYPES:
    for groups, rows in ((1, 5), (8, 64), (300, 100)):
        picks = torch.randint(0, groups, (rows - 3,), generator=gen)
        sizes = torch.bincount(picks, minlength=groups).to(dtype)
        table, offsets = st._launch(sizes, rows, st._split_table_kernel)
        want = st.split_table_torch(sizes, rows)
        assert torch.equal(table[:groups + 1], want.base_offsets), (dtype, groups)
        assert torch.equal(table[groups + 1:-1], want.sizes), (dtype, groups)
        assert torch.equal(offsets, want.offsets), (dtype, groups)
        assert int(table[-1]) == 1 and bool(want.valid), (dtype, groups)
for sizes, dtype, rows in (([3, -1, 2], torch.int64, 10), ([-1, 2], torch.int8, 10),
                           ([6, 5], torch.int32, 10), ([2.5, 1.0], torch.float32, 10),
                           ([float("nan"), 1.0], torch.float32, 10),
                           ([-0.5, 1.0], torch.float16, 10), ([11], torch.uint8, 10),
                           ([2 ** 62] * 3, torch.int64, 2 ** 40)):
    table, _ = st._launch(torch.tensor(sizes, dtype=dtype), rows, st._split_table_kernel)
    assert int(table[-1]) == 0, (sizes, dtype)
# split_table's and make_splits' Triton branch (views of the kernel's table), made to run on
# the CPU tensors here: the same GroupedSplits fields as the torch path
from te_ops import splits as sp
from te_ops.kernels.split_table import split_table
for dtype in (torch.int64, torch.int32, torch.float32):
    sizes = torch.tensor([0, 1, 3, 0, 17, 2, 0, 40]).to(dtype)
    want = sp.make_splits(sizes, 8, 70, torch.device("cpu"))
    st.split_table_backend = lambda t: "triton"
    got_table = split_table(sizes, 70)
    got = sp.make_splits(sizes, 8, 70, torch.device("cpu"))
    st.split_table_backend = BACKEND
    assert got_table.valid.dtype == torch.int64 and int(got_table.valid) == 1  # the kernel
    assert (got.split_sizes is sizes) is (dtype == torch.int64)
    for name in ("split_sizes", "offsets", "base_offsets"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), (dtype, name)
    assert torch.equal(got_table.ends, want.base_offsets[1:])
print("ok")
'''


def test_split_table_kernel_interpreted():
    run_interpreted(SCRIPT)


STRIDED = r'''
import torch
from te_ops.kernels import split_table as st
from te_ops import splits as sp

BACKEND = st.split_table_backend
# 1-D split sizes that are views with a stride other than 1 (a column of a per-expert
# statistics table, every other entry, a broadcast count): make_splits accepts them, and the
# kernel must read them through their stride, as the torch path does.
base = torch.tensor([[1, 100], [2, 100], [3, 100], [0, 100]])
cases = [(base[:, 0], 10), (torch.arange(12)[::3], 30), (torch.tensor(2).expand(5), 10)]
for dtype in (torch.int64, torch.int32, torch.float32):
    for sizes, rows in cases:
        sizes = sizes.to(dtype) if dtype != sizes.dtype else sizes
        if dtype != torch.int64:  # a cast copies: build the strided view in that dtype
            sizes = torch.stack([sizes, sizes], 1)[:, 0] if sizes.stride(0) else sizes
        assert not sizes.is_contiguous() or sizes.stride(0) == 0, sizes.stride()
        want = st.split_table_torch(sizes, rows)
        table, offsets = st._launch(sizes, rows, st._split_table_kernel)
        g = sizes.shape[0]
        assert torch.equal(table[:g + 1], want.base_offsets), (dtype, sizes, table)
        assert torch.equal(offsets, want.offsets), (dtype, sizes, offsets)
        assert int(table[-1]) == int(want.valid), (dtype, sizes)
        st.split_table_backend = lambda t: "triton"
        got = sp.make_splits(sizes, g, rows, torch.device("cpu"))
        st.split_table_backend = BACKEND
        assert torch.equal(got.offsets, want.offsets)
print("ok")
'''


def test_split_table_kernel_reads_strided_sizes():
    run_interpreted(STRIDED)
