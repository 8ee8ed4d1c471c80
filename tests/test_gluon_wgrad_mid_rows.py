"""The Gluon wgrad at 512-1023 rows per group with its 4-stage subtiled-epilogue config
(the ``mid_rows`` Gluon wgrad row of ``te_ops.gemm.rules``, ``MID_ROWS_CONFIG``;
the rule at >= 1024 and the kernel: ``tests/test_gluon_wgrad_dispatch.py``,
``tests/test_gluon_wgrad.py``).

CPU (CI): the rule's decisions at 511 / 512 / 1023 / 1024 rows per group, off SM90, for
other dtypes than bfloat16, with a rules row put first, with ``out_features`` not a
multiple of ``BLOCK_N``; the config each takes (also from the choice cache); the reason and
``explain()`` text; that ``grouped_wgrad`` launches the
choice's config, and the op ``te_ops::grouped_wgrad_gluon`` under ``torch.compile`` carries
it. CUDA (SM90): a block at 565 rows per group launches the 4-stage config for both wgrads
(first and repeated call), matches the fp64 per-expert reference and is bitwise the block with
the kernel off (``torch._grouped_mm``'s wgrad); CUDA-graph replay and ``torch.compile
(fullgraph=True)`` of the block equal eager bit for bit.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from gemm_force import GLUON_WGRAD_ANY, NO_GLUON_WGRAD, with_rows
from block_replay import (
    assert_block_matches_reference,
    assert_graph_and_compile_match_eager,
    run_block,
)

import te_ops
from te_ops.gemm import dispatch as grouped_gemm
from te_ops.gemm import grouped_gemm_large_triton
from te_ops.gemm import grouped_wgrad_gluon as gw

CUDA0 = torch.device("cuda", 0)
MID, HIGH = 512, 1024  # the Gluon wgrad rows of te_ops.gemm.rules: mid_rows, then default
BLOCK_N = gw.gluon_wgrad_config()["BLOCK_N"]


def test_constants_are_the_measured_rule():
    assert (MID, HIGH) == (512, 1024)
    assert gw.MID_ROWS_CONFIG == {"STAGES": 4, "EPI_SPLIT": 4, "EPI_BUFS": 2}
    assert gw.PRESETS == {"default": {}, "mid_rows": gw.MID_ROWS_CONFIG}
    mid = gw._RESOLVED["mid_rows"]
    assert mid == {**gw.gluon_wgrad_config(), **gw.MID_ROWS_CONFIG}
    assert gw._RESOLVED["default"] == gw.gluon_wgrad_config()
    assert (mid["STAGES"], mid["EPI_SPLIT"], mid["EPI_BUFS"]) == (4, 4, 2)


@pytest.fixture
def with_gluon(monkeypatch):
    """The rule as with Triton 3.6's Gluon installed (CI has no Triton)."""
    monkeypatch.setattr(gw, "gluon", object())
    monkeypatch.setattr(gw, "GLUON_API_REASON", None)


def _sm90(monkeypatch, capability=(9, 0)):
    """select_backend as on a CUDA GPU of ``capability`` with Triton (the measured-rule gate
    itself runs: dtype and capability), torch._grouped_mm available and settled."""
    monkeypatch.setattr(grouped_gemm, "triton_unsupported_reason", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(grouped_gemm, "grouped_mm_unsupported_reason", lambda *a: None)
    monkeypatch.setattr(grouped_gemm, "grouped_mm_host_sync_reason", lambda *a: None)
    monkeypatch.setattr(grouped_gemm, "_MEASURED_ON", {})
    monkeypatch.setattr(grouped_gemm, "_CHOICES", {})
    for dtype in (torch.bfloat16, torch.float16):
        monkeypatch.setitem(grouped_gemm._PROBE_CACHE, ("cuda", 0, dtype), None)


def _choose(rows, out_features=768, dtype=torch.bfloat16):
    return grouped_gemm.select_backend(CUDA0, dtype, 256, out_features, True,
                                       rows_per_group=float(rows))


@pytest.mark.parametrize("rows, gluon, preset", [
    (MID - 1, False, None), (MID, True, "mid_rows"), (HIGH - 1, True, "mid_rows"),
    (HIGH, True, "default"),
])
def test_select_backend_auto_at_the_bounds(monkeypatch, with_gluon, rows, gluon, preset):
    _sm90(monkeypatch)
    choice = _choose(rows)
    assert ("wgrad" in choice.gluon_kinds) == gluon
    assert choice.large_kinds == ("fprop", "dgrad")  # the persistent rule, unchanged
    if gluon:
        assert choice.gluon_wgrad_preset == preset
        assert "wgrad in the warp-specialized Gluon wgrad" in choice.reason
        assert f"launch config {preset!r}" in choice.reason
        assert ("the 4-stage mid_rows config" in choice.reason) == (preset == "mid_rows")
    else:  # 511 rows: wgrad stays in torch._grouped_mm
        assert choice.gluon_kinds == () and choice.gluon_wgrad_preset == "default"
        assert choice.reason.endswith("wgrad in torch._grouped_mm")
        assert "Gluon wgrad" not in choice.reason


def test_choice_cache_keeps_the_configs_apart(monkeypatch, with_gluon):
    """Same layer and env, rows per group across the 1024 bound and back: each call gets its
    band's config (the cache key holds it)."""
    _sm90(monkeypatch)
    got = [_choose(rows).gluon_wgrad_preset for rows in (600, 2048, 600, 1023, 1024)]
    assert got == ["mid_rows", "default", "mid_rows", "mid_rows", "default"]
    assert _choose(600) is _choose(700)  # one band: one cached choice


@pytest.mark.parametrize("capability, dtype, match", [
    ((8, 0), torch.bfloat16, "SM90 only, not SM80"),
    ((10, 0), torch.bfloat16, "SM90 only, not SM100"),
    ((9, 0), torch.float16, "bfloat16 only"),
])
def test_not_off_sm90_or_bf16(monkeypatch, with_gluon, capability, dtype, match):
    _sm90(monkeypatch, capability)
    asked = []
    monkeypatch.setattr(grouped_gemm, "gemm_rules", lambda *a: asked.append(a) or {})
    for rows in (MID, HIGH - 1):
        choice = _choose(rows, dtype=dtype)
        assert choice.name == "grouped_mm" and choice.gluon_kinds == () and not asked
        assert match in choice.reason


@pytest.mark.parametrize("rows", [MID, HIGH - 1])
def test_a_row_first_and_out_features(monkeypatch, with_gluon, rows):
    _sm90(monkeypatch)
    with_rows(monkeypatch, first=NO_GLUON_WGRAD)
    assert _choose(rows).gluon_kinds == ()
    with_rows(monkeypatch)
    choice = _choose(rows, out_features=BLOCK_N * 6 + 64)  # not a multiple of BLOCK_N
    assert choice.gluon_kinds == () and "Gluon wgrad" not in choice.reason
    assert choice.reason.endswith("wgrad in torch._grouped_mm")


def _recording_gluon_wgrad(monkeypatch):
    seen = []

    def fake(x, dy, offsets, config=None, preset="default"):
        seen.append((config, preset))
        return x.new_zeros(offsets.shape[0], dy.shape[1], x.shape[1])
    monkeypatch.setattr(grouped_gemm, "gluon_wgrad", fake)
    monkeypatch.setattr(grouped_gemm, "gluon_unsupported_reason", lambda *a: None)
    return seen


@pytest.mark.parametrize("preset", ["mid_rows", "default"])
def test_grouped_wgrad_launches_the_choices_config(monkeypatch, preset):
    """``grouped_wgrad`` passes the choice's preset to the Gluon wgrad."""
    seen = _recording_gluon_wgrad(monkeypatch)
    choice = grouped_gemm.BackendChoice("triton", "test", True, large_kinds=("fprop", "dgrad"),
                                        gluon_kinds=("wgrad",), gluon_wgrad_preset=preset)
    x, dy = torch.zeros(10, 16, dtype=torch.bfloat16), torch.zeros(10, 128, dtype=torch.bfloat16)
    splits = te_ops.splits.make_splits(torch.tensor([4, 6]), 2, 10, torch.device("cpu"))
    grouped_gemm.grouped_wgrad(x, dy, splits, choice)
    assert seen == [(None, preset)]


def test_preset_reaches_the_launch(monkeypatch):
    """``gluon_wgrad(..., preset="mid_rows")`` launches with MID_ROWS_CONFIG's parameters (a
    stand-in kernel records them); a bad preset raises naming the argument."""
    launched = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(kwargs)

    monkeypatch.setattr(gw, "_gluon_wgrad_kernel", Kernel(), raising=False)
    monkeypatch.setattr(gw, "gluon_unsupported_reason", lambda *a, **k: None)
    monkeypatch.setattr(gw, "sm_count", lambda device: 4)
    monkeypatch.setattr(grouped_gemm_large_triton, "_ensure_allocator", lambda: None)
    x, dy = torch.zeros(8, 256, dtype=torch.bfloat16), torch.zeros(8, 128, dtype=torch.bfloat16)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    gw.gluon_wgrad(x, dy, offs, preset="mid_rows")
    gw.gluon_wgrad(x, dy, offs)
    gw.gluon_wgrad(x, dy, offs, {"EPI_BUFS": 1}, preset="mid_rows")  # config over the preset
    assert launched[0] == gw._RESOLVED["mid_rows"]
    assert launched[1] == gw.gluon_wgrad_config()
    assert launched[2] == {**gw._RESOLVED["mid_rows"], "EPI_BUFS": 1}
    with pytest.raises(ValueError, match=r"preset must be one of \['default', 'mid_rows'\], "
                                         r"got 'mid'"):
        gw.gluon_wgrad(x, dy, offs, preset="mid")
    with pytest.raises(ValueError, match="preset must be one of"):
        torch.ops.te_ops.grouped_wgrad_gluon(x, dy, offs, "mid")


def test_compile_traces_the_op_with_the_preset():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def fn(x, dy, offs):
        return gw.gluon_wgrad(x, dy, offs, preset="mid_rows")

    x, dy = torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(8, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="the Gluon grouped wgrad cannot run"):
        torch.compile(fn, fullgraph=True, backend=backend)(
            x, dy, torch.tensor([3, 8], dtype=torch.int32))  # CPU: the op runs and raises
    assert len(graphs) == 1 and "te_ops.grouped_wgrad_gluon" in graphs[0].code
    assert "'mid_rows'" in graphs[0].code
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.ops.te_ops.grouped_wgrad_gluon(torch.empty(9, 64, dtype=torch.bfloat16),
                                                   torch.empty(9, 384, dtype=torch.bfloat16),
                                                   torch.empty(3, dtype=torch.int32),
                                                   "mid_rows")
        assert tuple(out.shape) == (3, 384, 64)


def test_explain_reports_the_config(monkeypatch, with_gluon):
    """The layer's dispatch record (what ``explain()`` prints after a call) names the config
    and why: a call at 600 rows per group as on an SM90 GPU (stand-in input and splits: only
    device, dtype and the row counts are read)."""
    _sm90(monkeypatch)
    torch.manual_seed(0)
    block = te_ops.Sequential(te_ops.GroupedLinear(4, 64, 256, bias=False),
                              te_ops.ScaledSwiGLU(), te_ops.GroupedLinear(4, 128, 64, bias=False))
    x, probs = torch.randn(8, 64), torch.rand(8)
    split = torch.tensor([2, 2, 2, 2])
    block(x, split, probs, split).sum().backward()
    fake_input = SimpleNamespace(device=CUDA0, dtype=torch.bfloat16)
    for rows, preset in ((600, "mid_rows"), (4096, "default")):
        fake_splits = SimpleNamespace(on_device=True, num_rows=4 * rows, num_groups=4)
        block[0].select_backend(fake_input, fake_splits)
        text = block.explain()
        assert "wgrad in the warp-specialized Gluon wgrad" in text
        assert f"launch config {preset!r}" in text
        assert ("the 4-stage mid_rows config" in text) == (preset == "mid_rows")
    block[0].select_backend(fake_input, SimpleNamespace(on_device=True, num_rows=4 * 511,
                                                        num_groups=4))
    (record,) = [r for r in block[0].dispatch_records() if r.startswith("grouped GEMM")]
    assert "Gluon wgrad" not in record and "wgrad in torch._grouped_mm" in record
    assert record in block.explain()


# ---------------------------------------------------------------------------------- CUDA
def _needs_gluon_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon wgrad is dispatched on SM90 only")
    if gw.gluon is None or gw.GLUON_API_REASON is not None:
        pytest.skip("no Gluon of Triton 3.6's API in the installed Triton")


def _block(experts=4, hidden=256, ffn=384, seed=0):
    torch.manual_seed(seed)
    kw = {"bias": False, "device": "cuda", "dtype": torch.bfloat16}
    return te_ops.Sequential(te_ops.GroupedLinear(experts, hidden, 2 * ffn, **kw),
                             te_ops.ScaledSwiGLU(),
                             te_ops.GroupedLinear(experts, ffn, hidden, **kw))


def _record_presets(monkeypatch):
    """Wrap ``grouped_wgrad_gluon._launch``: each launch appends its (config, preset)."""
    seen = []
    launch = gw._launch

    def recorded(x, dy, offsets, config, preset="default"):
        seen.append(preset if config is None else (config, preset))
        return launch(x, dy, offsets, config, preset)
    monkeypatch.setattr(gw, "_launch", recorded)
    return seen


@pytest.mark.cuda
def test_block_at_mid_rows_takes_the_4_stage_config(monkeypatch):
    """4 experts, 2260 of 2304 rows (576 per group on average, padding included; one empty
    group, 44 padding rows of NaN): auto runs both wgrads in the Gluon kernel with
    MID_ROWS_CONFIG, on the first and the second call; the results
    match the fp64 reference and are bitwise those with the kernel off (torch._grouped_mm's
    wgrad, the same fprop/dgrad kernels), fused and unfused."""
    _needs_gluon_sm90()
    seen = _record_presets(monkeypatch)
    sizes = [1000, 0, 700, 560]
    rows, hidden = 2304, 256
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    x[sum(sizes):] = float("nan")
    probs = torch.rand(rows, device="cuda", generator=gen).to(torch.bfloat16)
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    split = torch.tensor(sizes, device="cuda")
    block = _block()
    first, path1 = run_block(block, x, split, probs, dy)
    assert seen == ["mid_rows", "mid_rows"] and path1 == "_FuserFunctionBackward"
    assert "launch config 'mid_rows'" in block.explain()
    again, path2 = run_block(block, x, split, probs, dy)
    assert path2 == "_FuserFunctionBackward"  # the repeated call: the same plan, same config
    assert seen == ["mid_rows"] * 4
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    for fusion, mode in (("0", "auto"), ("1", "0")):
        monkeypatch.setenv("TE_OPS_FUSION", fusion)
        with_rows(monkeypatch, first=NO_GLUON_WGRAD if mode == "0" else ())
        other = run_block(_block(), x, split, probs, dy)[0]
        for i, (a, b) in enumerate(zip(first, other)):
            assert torch.equal(a, b), f"tensor {i}: fusion {fusion}, mode {mode} differs"
    assert seen == ["mid_rows"] * 6  # the unfused block too; none with the kernel off
    assert_block_matches_reference(_block(), x, probs, sizes, dy, first)


@pytest.mark.cuda
def test_block_at_mid_rows_graph_replay_and_compile_bitwise_equal_to_eager(monkeypatch):
    """At 512 rows per group (auto, MID_ROWS_CONFIG): the block captured in one CUDA graph and
    replayed with new split sizes, and compiled with fullgraph=True (the op
    ``te_ops::grouped_wgrad_gluon`` with the preset): bitwise the eager values."""
    _needs_gluon_sm90()
    seen = _record_presets(monkeypatch)
    rows, hidden = 2048, 256
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    probs = torch.rand(rows, device="cuda", generator=gen)
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    split = torch.tensor([900, 0, 700, 400], device="cuda")
    assert_graph_and_compile_match_eager(_block(), x, split, probs, dy, [10, 1300, 0, 700],
                                         "launch config 'mid_rows'")
    assert seen and set(seen) == {"mid_rows"}
