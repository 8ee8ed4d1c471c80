"""Review of persistent fprop / dgrad schedule (``FLAT`` default, ``TAIL``,
``WARP_SPEC``; ``kernels/grouped_gemm_large_triton.py``) and its benchmark flags.

* A bad launch config raises also where the launch returns early (no rows, no columns, no
  groups, K = 0): ``_launch`` checked it only on the path that launches.
* ``benchmarks/large_gemm_triton.py --config-override`` changed the wgrad GEMMs' config too
  (fprop / dgrad keys reached ``large_wgrad``: ``FLAT=False`` silently timed nested
  wgrad as "triton", an fprop-only key failed the run on the GPU), and neither it nor
  ``--variants`` was checked before the GPU work; nor was ``--sweep-filter`` (one that
  matches no config, e.g. ``FLAT=true``, swept nothing and compared the defaults).
* ``--sweep``'s configs were changes to the group walk, not to the ``FLAT`` default.
* Interpreted (Triton's CPU interpreter, float16): the flattened schedule with half-height
  tail tiles over clamped offsets (past the rows, negative, one group past the rows) and
  program counts of 1, 2, 5 and 7 (the round-robin numbering goes on across the full-tile,
  half-tile and padding loops), against a float64 reference of the clamped groups.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from bench_helpers import large_gemm_configs
from interpret import interpreter_marks, run_interpreted

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experimental", "gemm_kernel_ab"))

import large_gemm_triton as bench  # noqa: E402

from te_ops.gemm import grouped_gemm_large_triton as L  # noqa: E402


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "fc1_swiglu"])
@pytest.mark.parametrize("m, n, k, groups", [(0, 8, 8, 2), (6, 0, 8, 2), (6, 8, 0, 2),
                                             (6, 8, 8, 0)])
@pytest.mark.parametrize("config, match", [
    ({"FLATTEN": True}, r"config keys must be among .* got unknown \['FLATTEN'\]"),
    ({"TAIL": True, "BLOCK_M": 16}, "TAIL=True needs an even BLOCK_M >= 32 .* got BLOCK_M=16"),
    ({"FLAT": False, "WARP_SPEC": True}, "WARP_SPEC=True needs FLAT=True .* got FLAT=False"),
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
    y, _ = L._launch(x, w, torch.tensor([2, 6]), None, "fprop", {"TAIL": True}, kernel=None)
    assert y.shape == (6, 8) and not y.any()


def _run_main(monkeypatch, argv):
    """``bench.main`` with CUDA faked: {gemm: cfg} of each comparison."""
    return {gemm: cfg for gemm, cfg, _ in large_gemm_configs(monkeypatch, bench, argv)}


def test_config_override_changes_fprop_dgrad_not_wgrad(monkeypatch, capsys):
    seen = _run_main(monkeypatch, ["--shapes", "E8_T16384_H4096_FF14336", "--config-override",
                                   '{"FLAT": false}'])
    capsys.readouterr()
    assert seen["fc1"] == seen["fc2_dgrad"] == {"FLAT": False}
    assert seen["fc1_wgrad"] is None and seen["fc2_wgrad"] is None


@pytest.mark.parametrize("argv, words", [
    (["--config-override", '{"FLATT": true}'], ["--config-override", "FLATT"]),
    (["--config-override", '{"TAIL": true, "BLOCK_M": 16}'],
     ["--config-override", "BLOCK_M=16"]),
    (["--variants", '{"ws": {"FLAT": false, "WARP_SPEC": true}}'],
     ["--variants 'ws'", "WARP_SPEC=True needs FLAT=True"]),
    (["--config-override", '{"FLAT": false}', "--variants", '{"ws": {"WARP_SPEC": true}}'],
     ["--variants 'ws'", "got FLAT=False"]),  # the variant on top of the override
    (["--sweep", "--sweep-filter", "FLAT"], ["--sweep-filter must be KEY=VALUE", "'FLAT'"]),
    (["--sweep", "--sweep-filter", "FLAT=true"],  # matched nothing: the defaults, untimed
     ["--sweep-filter 'FLAT=true' matches no --sweep config", "FLAT=True"]),
])
def test_bad_override_or_variant_is_a_usage_error_before_gpu_work(monkeypatch, capsys, argv,
                                                                   words):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # never reached
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, err


def test_sweep_varies_the_default_schedule():
    """``--sweep`` tunes around the defaults: each key changed alone from ``large_config``
    (FLAT; the sweep's base was still the group walk, so every tile / warps /
    stages / GROUP_M change was timed on the walk only), and the fused kernel's default (since
    stop 15 the fprop's tiles and schedule, ``PAIRED``, which the sweep leaves on) is among
    its configs."""
    default = L.large_config("fprop")
    assert default == L.large_config("dgrad") and default in bench.SWEEP
    for key in ("BLOCK_N", "num_warps", "num_stages", "GROUP_M", "FLAT", "TAIL", "WARP_SPEC",
                "USE_TMA"):
        assert any({k for k in c if c[k] != default[k]} == {key} for c in bench.SWEEP), key
    fused = dict(L.large_config("fc1_swiglu"))
    assert fused.pop("PAIRED") is True and fused in bench.SWEEP


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
        conf = {**MID, "USE_TMA": tma, "FLAT": True, "TAIL": True}
        tag = (programs, tma)
        # remainders 1, 0 (empty), 16 (a half tile), 16, 17, 31, 0, 16 of 32-row tiles;
        # 11 padding rows
        check([33, 33, 81, 97, 114, 145, 209, 289], 300, 40, 24, conf, tag)
        check([5, 30, 500], 70, 24, 16, conf, tag)   # offsets past the rows: clamped
        check([-3, 5, 12, 12, 40], 45, 24, 16, conf, tag)  # a negative offset, 5 groups
        check([900], 50, 24, 16, conf, tag)          # one group past the rows (GBLOCK 1)
print("ok")
'''


def test_flat_tail_schedule_over_clamped_offsets_and_program_counts():
    run_interpreted(SCRIPT)


for _mark in interpreter_marks("tests/test_grouped_gemm_large_triton.py"):
    test_flat_tail_schedule_over_clamped_offsets_and_program_counts = _mark(
        test_flat_tail_schedule_over_clamped_offsets_and_program_counts)
