"""The persistent fprop / dgrad's launch config checks (``te_ops/gemm/grouped_gemm_large_triton.py``).

* A bad launch config raises also where the launch returns early (no rows, no columns, no
  groups, K = 0).
* Interpreted (Triton's CPU interpreter, float16): the flattened schedule over clamped
  offsets (past the rows, negative, one group past the rows) and program counts of 1, 2, 5
  and 7 (the round-robin numbering goes on across the tile and padding loops), against a
  float64 reference of the clamped groups.
"""

from __future__ import annotations

import pytest
import torch
from interpret import interpreter_marks, run_interpreted

from te_ops.gemm import grouped_gemm_large_triton as L


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "fc1_swiglu"])
@pytest.mark.parametrize("m, n, k, groups", [(0, 8, 8, 2), (6, 0, 8, 2), (6, 8, 0, 2),
                                             (6, 8, 8, 0)])
@pytest.mark.parametrize("config, match", [
    ({"FLATTEN": True}, r"config keys must be among .* got unknown \['FLATTEN'\]"),
    ({"FLAT": 1}, "config FLAT must be a bool, got 1"),
])
def test_bad_config_raises_where_the_launch_returns_early(kind, m, n, k, groups, config,
                                                          match):
    """No launch is needed for these shapes, but the config is still the caller's error."""
    dgrad = kind == "dgrad"
    x = torch.zeros(m, n if dgrad else k, dtype=torch.float16)
    w = torch.zeros(groups, n, k, dtype=torch.float16)
    offs = torch.full((groups,), m, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        L._launch(x, w, offs, None, kind, config, kernel=None)


def test_good_config_on_degenerate_shapes_still_gives_zeros():
    x, w = torch.zeros(6, 0, dtype=torch.float16), torch.zeros(2, 8, 0, dtype=torch.float16)
    y, _ = L._launch(x, w, torch.tensor([2, 6]), None, "fprop", {"FLAT": False}, kernel=None)
    assert y.shape == (6, 8) and not y.any()


SCRIPT = r'''
import torch
from te_ops.gemm import grouped_gemm_large_triton as L

MID = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}


def reference(x, w, offs, dgrad=False):
    """float64 per-group products over the kernel's clamped rows; padding rows 0."""
    m = x.shape[0]
    out = torch.zeros(m, w.shape[2] if dgrad else w.shape[1], dtype=torch.float64)
    prev = 0
    for g, off in enumerate(offs):
        end = min(max(off, 0), m)
        start = min(max(prev, 0), end)
        wg = w[g].double()
        out[start:end] = x[start:end].double() @ (wg if dgrad else wg.t())
        prev = off
    return out


def check(offs, m, n, k, conf, tag):
    gen = torch.Generator().manual_seed(m + n + k)
    g = len(offs)
    total = min(max(offs[-1], 0), m)
    w = (torch.randn(g, n, k, generator=gen) * k ** -0.5).half()
    o = torch.tensor(offs, dtype=torch.int32)
    for kind, cols in (("fprop", k), ("dgrad", n)):
        x = torch.randn(m, cols, generator=gen).half()
        x[total:] = float("nan")  # padding rows: garbage
        y, _ = L._launch(x, w, o, None, kind, conf, L._large_kernel)
        want = reference(x, w, offs, dgrad=kind == "dgrad")
        assert not y[total:].any(), (tag, kind)
        err = (y.double() - want).abs().max().item()
        assert err <= 2e-3 * max(1.0, want.abs().max().item()), (tag, kind, err)


for programs in (1, 2, 5, 7):
    L._CPU_PROGRAMS = programs
    for tma in (True, False):
        conf = {**MID, "USE_TMA": tma, "FLAT": True}
        tag = (programs, tma)
        # last row tiles of 1, 0 (empty), 16, 16, 17, 31, 0, 16 rows (32-row tiles);
        # 11 padding rows
        check([33, 33, 81, 97, 114, 145, 209, 289], 300, 40, 24, conf, tag)
        check([5, 30, 500], 70, 24, 16, conf, tag)   # offsets past the rows: clamped
        check([-3, 5, 12, 12, 40], 45, 24, 16, conf, tag)  # a negative offset, 5 groups
        check([900], 50, 24, 16, conf, tag)          # one group past the rows (GBLOCK 1)
print("ok")
'''


def test_flat_schedule_over_clamped_offsets_and_program_counts():
    run_interpreted(SCRIPT)


for _mark in interpreter_marks("tests/test_grouped_gemm_large_triton.py"):
    test_flat_schedule_over_clamped_offsets_and_program_counts = _mark(
        test_flat_schedule_over_clamped_offsets_and_program_counts)
