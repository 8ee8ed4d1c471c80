"""The grouped GEMM rules table (``te_ops/gemm/rules.py``), evaluated on CPU.

The reference below is an independent statement of the same dispatch (thresholds per kernel
module, the Gluon rules as equality on the measured rows per group): at every measured shape
the table must pick the same kernel, and off the Gluon boxes everywhere on the grid.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from te_ops.gemm import rules
from te_ops.gemm.rules import Rule, around, at_most, choose

BF16, FP16 = torch.bfloat16, torch.float16

# -- the reference: the rules before the table ----------------------------------------------
_MAX_ROWS = {"fprop": 8, "dgrad": 4, "wgrad": 32}          # few-rows Triton kernels
_MIN_ROWS = {"fprop": 32, "dgrad": 32}                      # persistent Triton fprop/dgrad
_WGRAD_ROWS = (64, 256)                                     # persistent Triton wgrad
_FORCED_MIN_ROWS = 512
_GLUON_WGRAD_MID, _GLUON_WGRAD_MIN = 512, 1024
_GLUON_RULE = {
    ("fprop", 768, 2048): 512.0, ("dgrad", 768, 2048): 512.0,
    ("dgrad", 2048, 1536): 512.0, ("fprop", 2048, 1536): 512.0,
    ("fprop", 4096, 28672): 2048.0, ("dgrad", 4096, 28672): 2048.0,
    ("fprop", 14336, 4096): 2048.0, ("dgrad", 14336, 4096): 2048.0,
    ("dgrad", 7168, 4096): 1024.0, ("fprop", 2048, 7168): 1024.0,
}
_GLUON_FC1_RULE = {(2048, 1536): 512.0}
_FC1_FEW_ROWS = 8


def reference(kind: str, rows: float, n_in: int, n_out: int, arch: int, dtype: torch.dtype,
              mode: str = "auto") -> tuple[str, str] | None:
    """(kernel, config) the pre-table dispatch ran ``kind`` in (``None``: torch._grouped_mm
    for a GEMM kind, two launches for fc1_swiglu)."""
    if mode == "forced":
        if kind == "fc1_swiglu" or dtype not in (BF16, FP16):
            return None
        return ("triton_persistent" if rows >= _FORCED_MIN_ROWS else "triton_rows", "default")
    if kind == "fc1_swiglu":
        if dtype in (BF16, FP16) and rows <= _FC1_FEW_ROWS:
            return ("triton_rows", "default")
        if arch == 9 and dtype == BF16 and _GLUON_FC1_RULE.get((n_in, n_out)) == rows:
            return ("gluon", "default")
        return None
    if arch != 9 or dtype != BF16:
        return None
    if kind == "wgrad":
        if rows >= _GLUON_WGRAD_MID:
            return ("gluon", "default" if rows >= _GLUON_WGRAD_MIN else "mid_rows")
        if rows <= _MAX_ROWS["wgrad"]:
            return ("triton_rows", "default")
        if _WGRAD_ROWS[0] <= rows <= _WGRAD_ROWS[1]:
            return ("triton_persistent", "default")
        return None
    if rows <= _MAX_ROWS[kind]:
        return ("triton_rows", "default")
    if rows >= _MIN_ROWS[kind]:
        if _GLUON_RULE.get((kind, n_in, n_out)) == rows:
            return ("gluon", "default")
        return ("triton_persistent", "default")
    return None


def picked(kind, rows, n_in, n_out, arch=9, dtype=BF16, mode="auto"):
    rule = choose(kind, rows, n_in, n_out, arch=arch, dtype=dtype, mode=mode)
    return None if rule is None else (rule.kernel, rule.config)


# The benchmark shapes: (E, routed rows T, H, FF) -> rows per group T / E, and the layers.
SHAPES = {
    "E8 T16384 H4096 FF14336": (8, 16384, 4096, 14336),
    "E32 T32768 H7168 FF2048": (32, 32768, 7168, 2048),
    "E128 T65536 H2048 FF768": (128, 65536, 2048, 768),
    "E64 T256 H2048 FF768": (64, 256, 2048, 768),
    "E128 T16384 H2048 FF768": (128, 16384, 2048, 768),
}


def layers(h: int, ff: int) -> list[tuple[int, int]]:
    return [(h, 2 * ff), (ff, h)]  # fc1, fc2


ALL_LAYERS = sorted({lay for (_, _, h, ff) in SHAPES.values() for lay in layers(h, ff)})
ALL_ROWS = sorted({t / e for (e, t, _, _) in SHAPES.values()})


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("kind", rules.KINDS)
def test_table_picks_todays_kernel_at_the_benchmark_shapes(name, kind):
    e, t, h, ff = SHAPES[name]
    for n_in, n_out in layers(h, ff):
        if kind == "fc1_swiglu" and (n_in, n_out) != (h, 2 * ff):
            continue
        assert picked(kind, t / e, n_in, n_out) == reference(kind, t / e, n_in, n_out, 9, BF16), \
            (name, kind, n_in, n_out)


def test_the_benchmark_shapes_pick_what_was_measured():
    """Spot checks, spelled out: the kernels at the measured points."""
    assert picked("fprop", 2048.0, 4096, 28672) == ("gluon", "default")       # E8 fc1
    assert picked("fprop", 1024.0, 7168, 4096) == ("triton_persistent", "default")  # E32 fc1
    assert picked("dgrad", 1024.0, 2048, 7168) == ("triton_persistent", "default")  # E32 fc2
    assert picked("wgrad", 512.0, 2048, 1536) == ("gluon", "mid_rows")        # E128
    assert picked("wgrad", 1024.0, 7168, 4096) == ("gluon", "default")        # E32
    assert picked("fc1_swiglu", 512.0, 2048, 1536) == ("gluon", "default")   # E128 fc1
    assert picked("fc1_swiglu", 2048.0, 4096, 28672) is None                  # E8: two launches
    assert picked("fprop", 4.0, 2048, 1536) == ("triton_rows", "default")     # E64 T256
    assert picked("dgrad", 4.0, 768, 2048) == ("triton_rows", "default")
    assert picked("fc1_swiglu", 4.0, 2048, 1536) == ("triton_rows", "default")


GRID_ROWS = sorted({0.0, 0.5, 1, 2, 3, 4, 4.5, 5, 8, 8.5, 9, 16, 31, 31.9, 32, 33, 63, 64, 100,
                    128, 200, 256, 256.5, 300, 511, 511.9, 512, 513, 700, 1000, 1023, 1024,
                    1025, 1500, 2047, 2048, 2049, 4096, 1e6} | set(ALL_ROWS))
GRID_LAYERS = ALL_LAYERS + [(512, 1024), (1024, 1024), (3072, 8192), (8192, 3072),
                            (1000, 2000), (6144, 12288)]


def _in_gluon_box(kind, rows, n_in, n_out):
    return any(r.kernel == "gluon" and r.kind == kind and r.in_features != (0, math.inf)
               and r.holds("auto", 9, BF16, kind, rows, n_in, n_out) for r in rules.RULES)


@pytest.mark.parametrize("kind", rules.KINDS)
@pytest.mark.parametrize("arch,dtype", [(9, BF16), (9, FP16), (9, torch.float32), (8, BF16),
                                        (10, BF16)])
def test_table_equals_the_reference_on_a_grid(kind, arch, dtype):
    """Everywhere but inside the ranges around the Gluon shapes (which the table widens from
    a point to the interval between the neighbouring measured points), the reference; inside
    them, the Gluon kernel where the reference had the persistent kernel (or two launches)."""
    for rows, (n_in, n_out) in itertools.product(GRID_ROWS, GRID_LAYERS):
        ref = reference(kind, rows, n_in, n_out, arch, dtype)
        got = picked(kind, rows, n_in, n_out, arch, dtype)
        if got != ref:
            assert arch == 9 and dtype == BF16 and _in_gluon_box(kind, rows, n_in, n_out), \
                (kind, rows, n_in, n_out, arch, dtype, got, ref)
            assert got == ("gluon", "default")
            assert ref in (("triton_persistent", "default"), None)
            assert (rows, n_in, n_out) not in {(r, i, o) for r in ALL_ROWS
                                              for (i, o) in ALL_LAYERS}


@pytest.mark.parametrize("rows,n_in,n_out", [(r, i, o) for r in ALL_ROWS for (i, o) in ALL_LAYERS])
@pytest.mark.parametrize("kind", rules.KINDS)
def test_every_measured_combination_keeps_todays_choice(kind, rows, n_in, n_out):
    """Every measured rows per group with every measured layer (not only the pairs that
    occur): the boxes' edges are open at the neighbouring measured points."""
    assert picked(kind, rows, n_in, n_out) == reference(kind, rows, n_in, n_out, 9, BF16)


@pytest.mark.parametrize("dtype", [BF16, FP16, torch.float32])
@pytest.mark.parametrize("arch", [8, 9, 12])
def test_forced_rows(dtype, arch):
    for kind, rows in itertools.product(("fprop", "dgrad", "wgrad"), GRID_ROWS):
        assert picked(kind, rows, 2048, 1536, arch, dtype, "forced") == \
            reference(kind, rows, 2048, 1536, arch, dtype, "forced")


def test_unknown_rows_pick_nothing():
    for kind in rules.KINDS:
        assert choose(kind, None, 2048, 1536, arch=9, dtype=BF16) is None


def test_available_skips_a_row_whose_kernel_cannot_run():
    """Without Gluon the Gluon fprop row is skipped: the persistent row holds next."""
    rule = choose("fprop", 2048.0, 4096, 28672, arch=9, dtype=BF16,
                  available=lambda r: r.kernel != "gluon")
    assert rule.kernel == "triton_persistent"
    assert choose("wgrad", 2048.0, 4096, 28672, arch=9, dtype=BF16,
                  available=lambda r: r.kernel != "gluon") is None


def test_every_row_cites_a_measurement():
    for rule in rules.RULES:
        section = rule.why.split(":", 1)[0]
        assert section in rules.SECTIONS, rule
        assert len(rule.why) > len(section) + 10


def test_ranges_helpers():
    lo, hi = at_most(8)
    assert lo <= 8 < hi and not 8.000001 < hi
    assert around(512.0, rules.MEASURED_ROWS)[0] > 128 and around(512.0, rules.MEASURED_ROWS)[1] == 1024
    assert around(2048.0, rules.MEASURED_ROWS)[1] > 2048 and not 2048.001 < around(
        2048.0, rules.MEASURED_ROWS)[1]
    with pytest.raises(ValueError, match="value must be one of the measured points"):
        around(600.0, rules.MEASURED_ROWS)


@pytest.mark.parametrize("field,value,message", [
    ("kind", "fc2_dswiglu", "Rule kind must be one of"),
    ("kernel", "", "Rule kernel must be a kernel's name"),
    ("mode", "sometimes", "Rule mode must be 'auto' or 'forced'"),
    ("rows", (8.0, 8.0), "Rule rows must be a range"),
])
def test_bad_rule_raises_naming_the_field(field, value, message):
    args = {"kind": "fprop", "kernel": "gluon", "rows": (0.0, 8.0), "why": "x"}
    args[field] = value
    with pytest.raises(ValueError, match=message):
        Rule(**args)


def test_choose_rejects_a_holding_row_that_names_an_unknown_kernel():
    table = (Rule("fprop", "cutlass", (0.0, math.inf), "x"),)
    with pytest.raises(ValueError, match="names kernel 'cutlass', which is neither built-in nor"):
        choose("fprop", 8.0, 1, 1, arch=9, dtype=BF16, table=table)
    assert choose("dgrad", 8.0, 1, 1, arch=9, dtype=BF16, table=table) is None  # not held


def test_device_field_limits_rows_to_their_device_type():
    cuda_row = Rule("fprop", "gluon", (0.0, math.inf), "x", arch=None)
    any_row = Rule("fprop", "gluon", (0.0, math.inf), "x", arch=None, device=None)
    sm9_any_device = Rule("fprop", "gluon", (0.0, math.inf), "x", device=None)
    for device in ("cpu", "meta"):
        assert not cuda_row.holds("auto", None, BF16, "fprop", 8.0, 1, 1, device)
        assert any_row.holds("auto", None, BF16, "fprop", 8.0, 1, 1, device)
        assert not sm9_any_device.holds("auto", None, BF16, "fprop", 8.0, 1, 1, device)
    assert cuda_row.holds("auto", 8, BF16, "fprop", 8.0, 1, 1, "cuda")
    assert sm9_any_device.holds("auto", 9, BF16, "fprop", 8.0, 1, 1, "cuda")
    assert not sm9_any_device.holds("auto", 8, BF16, "fprop", 8.0, 1, 1, "cuda")
    # no measured row holds off CUDA
    assert all(not r.holds(r.mode, None, r.dtypes[0], r.kinds[0], r.rows[0], r.in_features[0],
                           r.out_features[0], "cpu") for r in rules.RULES)


def test_choose_rejects_a_bad_kind():
    with pytest.raises(ValueError, match="kind must be one of"):
        choose("fc3", 8.0, 1, 1, arch=9, dtype=BF16)


def test_override_puts_rows_first_and_restores():
    row = Rule("wgrad", "gluon", (0.0, math.inf), "Gluon wgrad: test", config="default")
    version = rules.VERSION[0]
    with rules.override(row):
        assert choose("wgrad", 4.0, 2048, 1536, arch=9, dtype=BF16) is row
    assert choose("wgrad", 4.0, 2048, 1536, arch=9, dtype=BF16).kernel == "triton_rows"
    assert rules.VERSION[0] == version + 2


def test_rules_text_lists_every_row():
    text = rules.rules_text()
    assert len(text.splitlines()) == len(rules.RULES)
    assert "rows (128, 1024)" in text and "rows [0, 8]" in text


def test_a_row_may_cover_several_kinds():
    row = Rule(("fprop", "wgrad"), "triton_rows", (0.0, 8.0), "x")
    assert row.kinds == ("fprop", "wgrad")
    assert row.holds("auto", 9, BF16, "fprop", 4.0, 1, 1, "cuda")
    assert row.holds("auto", 9, BF16, "wgrad", 4.0, 1, 1, "cuda")
    assert not row.holds("auto", 9, BF16, "dgrad", 4.0, 1, 1, "cuda")
    assert choose("wgrad", 4.0, 1, 1, arch=9, dtype=BF16, table=(row,)) is row
    assert choose("dgrad", 4.0, 1, 1, arch=9, dtype=BF16, table=(row,)) is None


@pytest.mark.parametrize("kind", [(), ("fprop", "fprop"), ("fprop", "fc3"), ["fprop"], 3])
def test_a_row_rejects_bad_kinds(kind):
    with pytest.raises(ValueError, match="Rule kind must be one of"):
        Rule(kind, "triton_rows", (0.0, 8.0), "x")
