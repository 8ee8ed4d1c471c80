"""``benchmarks/dispatch_ab.py``: patch parsing, the tables' restore, the summary (CPU; the
measurement needs CUDA and NVML)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
dispatch_ab = pytest.importorskip("dispatch_ab")


def test_parse_patches():
    assert dispatch_ab.parse_patch("-fprop/7168/4096") == ("rule", "-", "fprop", 7168, 4096,
                                                           None)
    assert dispatch_ab.parse_patch("+fc1/7168/4096@1024") == ("rule", "+", "fc1", 7168, 4096,
                                                              1024.0)
    assert dispatch_ab.parse_patch("TE_OPS_FC1_SWIGLU_EPILOGUE=1") == (
        "env", "TE_OPS_FC1_SWIGLU_EPILOGUE", "1")
    variants = dispatch_ab.parse_variants("a:-dgrad/1/2;X=3,b:+fprop/4/5@8")
    assert list(variants) == ["default", "a", "b"]
    assert variants["a"] == [("rule", "-", "dgrad", 1, 2, None), ("env", "X", "3")]


@pytest.mark.parametrize("text, match", [
    ("fprop/1/2", "expected -KIND"),
    ("+fprop/1/2", "needs @ROWS"),
    ("+fprop/1/2@x", "ROWS must be a number, got 'x'"),
    ("-wgrad/1/2", "expected -KIND"),
    ("-fprop/1", "expected -KIND"),
    ("=1", "NAME=VALUE"),
    ("large:TAIL", "expected large:KEY=JSON"),
    ("gluon:=1", "expected gluon:KEY=JSON"),
    ("large:TAIL=yes", "the value must be JSON"),
])
def test_bad_patch_named(text, match):
    with pytest.raises(ValueError, match=match):
        dispatch_ab.parse_patch(text)


@pytest.mark.parametrize("text, match", [("nolabel", "expected label:patch"),
                                         ("default:-fprop/1/2", "given twice"),
                                         ("a:X=1,a:Y=2", "given twice")])
def test_bad_variants_named(text, match):
    with pytest.raises(ValueError, match=match):
        dispatch_ab.parse_variants(text)


def test_patched_restores_tables_and_env(monkeypatch):
    from te_ops.gemm import fc1_swiglu_gluon as fg
    from te_ops.gemm import grouped_gemm_gluon as gg
    before = (dict(gg.GLUON_RULE), dict(fg.GLUON_FC1_RULE))
    monkeypatch.delenv("TE_OPS_AB_PROBE", raising=False)
    patches = dispatch_ab.parse_variants(
        "v:-dgrad/7168/4096;+dgrad/2048/7168@1024;+fc1/7168/4096@1024;TE_OPS_AB_PROBE=1")["v"]
    with dispatch_ab.patched(patches):
        assert ("dgrad", 7168, 4096) not in gg.GLUON_RULE
        assert gg.GLUON_RULE[("dgrad", 2048, 7168)] == 1024.0
        assert fg.GLUON_FC1_RULE[(7168, 4096)] == 1024.0
        assert os.environ["TE_OPS_AB_PROBE"] == "1"
    assert (dict(gg.GLUON_RULE), dict(fg.GLUON_FC1_RULE)) == before
    assert "TE_OPS_AB_PROBE" not in os.environ
    with pytest.raises(KeyError, match="holds no"):
        with dispatch_ab.patched([("rule", "-", "fprop", 1, 2, None)]):
            pass
    assert (dict(gg.GLUON_RULE), dict(fg.GLUON_FC1_RULE)) == before


def test_summary_ratios_per_round():
    recs = [{"shape": "S", "variant": v, "round": r, "ms_median": ms, "sm_mhz_mean": 1000}
            for v, r, ms in [("peer", 0, 12.0), ("default", 0, 10.0), ("x", 0, 8.0),
                             ("peer", 1, 11.0), ("default", 1, 11.0), ("x", 1, 10.0)]]
    rows = {r["variant"]: r for r in dispatch_ab.summarize(recs)}
    assert rows["x"]["vs_default"] == pytest.approx((10 / 8 + 11 / 10) / 2)
    assert rows["x"]["x_peer"] == pytest.approx((12 / 8 + 11 / 10) / 2)
    assert rows["default"]["vs_default"] == pytest.approx(1.0)
    assert [r["variant"] for r in dispatch_ab.summarize(recs)] == ["peer", "default", "x"]


def test_usage_errors(capsys):
    for argv, match in [(["--shape", "E9"], "--shape: unknown"),
                        (["--variants", "a"], "--variants: variant 'a'"),
                        (["--peer", "nope"], "--peer: unknown"),
                        (["--rounds", "0"], "--rounds must be >= 1")]:
        with pytest.raises(SystemExit) as exc:
            dispatch_ab.main(argv)
        assert exc.value.code == 2
        assert match in capsys.readouterr().err


def test_aligned_sizes_keep_the_total():
    sizes = [173, 10499, 0, 64, 1000, 20984]  # sums to 32720 + 48
    sizes[-1] += 32768 - sum(sizes)
    out = dispatch_ab.aligned_sizes(sizes, 128)
    assert sum(out) == 32768 and all(s % 128 == 0 for s in out)
    assert all(abs(a - b) < 128 for a, b in zip(out, sizes))
    assert dispatch_ab.aligned_sizes([3, 5], 1) == [3, 5]
    with pytest.raises(ValueError, match=r"total of sizes \(9\) must be a multiple of align"):
        dispatch_ab.aligned_sizes([4, 5], 2)
    with pytest.raises(ValueError, match="align must be >= 1, got 0"):
        dispatch_ab.aligned_sizes([4], 0)


def test_with_sizes_rebuilds_split_and_offsets():
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from grouped_mlp import make_problem
    p = make_problem("tiny", (4, 64, 8, 8), torch.device("cpu"), torch.float32, 0)
    q = dispatch_ab.with_sizes(p, [16, 16, 0, 32])
    assert q.sizes == [16, 16, 0, 32] and q.split.tolist() == [16, 16, 0, 32]
    assert q.offsets.tolist() == [16, 32, 32, 64] and q.offsets.dtype == torch.int32
    assert q.x is p.x


def test_align_splits_usage_error(capsys):
    with pytest.raises(SystemExit):
        dispatch_ab.main(["--align-splits", "100"])
    assert "--align-splits must be >= 1 and divide the shape's 32768 tokens, got 100" in \
        capsys.readouterr().err


def test_config_patches_apply_and_restore():
    from te_ops.gemm import grouped_gemm_gluon as gg
    from te_ops.gemm import grouped_gemm_large_triton as lg
    assert dispatch_ab.parse_patch("large:TAIL=true") == ("config", "large", "TAIL", True)
    assert dispatch_ab.parse_patch("gluon:GROUP_M=16") == ("config", "gluon", "GROUP_M", 16)
    before = dict(gg.DISPATCH_CONFIG)
    with dispatch_ab.patched([("config", "gluon", "SKIP_TAIL", True),
                              ("config", "large", "TAIL", True)]):
        assert gg.DISPATCH_CONFIG["SKIP_TAIL"] is True
        assert lg._resolve("fprop", None, 8)["TAIL"] is True
        assert lg._resolve("dgrad", None, 8)["TAIL"] is True
    assert gg.DISPATCH_CONFIG == before
    assert lg._resolve("fprop", None, 8)["TAIL"] is False
    for bad in (("config", "gluon", "NOPE", 1), ("config", "large", "NOPE", 1)):
        with pytest.raises(KeyError, match="not a key of the"):
            with dispatch_ab.patched([bad]):
                pass
    assert gg.DISPATCH_CONFIG == before and lg._resolve("fprop", None, 8)["TAIL"] is False


def test_check_patches_before_any_step():
    """A removal of an entry the tables no longer hold (the docstring's old example,
    -fprop/7168/4096, after stop 20) and an env patch the peer's own env would override are
    refused before CUDA is touched, naming the variant."""
    ok = dispatch_ab.parse_variants(
        "a:+fprop/7168/4096@1024;-dgrad/7168/4096,b:+fc1/4096/28672@2048")
    dispatch_ab.check_patches(ok, {"TE_OPS_FUSION": "1"})
    with pytest.raises(ValueError, match=r"variant 'gone': patch -fprop/7168/4096: GLUON_RULE "
                                         r"holds no \('fprop', 7168, 4096\)"):
        dispatch_ab.check_patches(dispatch_ab.parse_variants("gone:-fprop/7168/4096"))
    with pytest.raises(ValueError, match=r"patch -fc1/4096/28672: GLUON_FC1_RULE holds no"):
        dispatch_ab.check_patches(dispatch_ab.parse_variants("e8:-fc1/4096/28672"))
    with pytest.raises(ValueError, match="variant 'f': TE_OPS_FUSION=0 would be overridden"):
        dispatch_ab.check_patches(dispatch_ab.parse_variants("f:TE_OPS_FUSION=0"),
                                  {"TE_OPS_FUSION": "1"})


def test_main_refuses_a_stale_removal(capsys):
    with pytest.raises(SystemExit) as exc:
        dispatch_ab.main(["--variants", "x:-fprop/7168/4096"])
    assert exc.value.code == 2
    assert "--variants: variant 'x': patch -fprop/7168/4096: GLUON_RULE holds no" in \
        capsys.readouterr().err


def test_summary_refuses_appended_runs(tmp_path, capsys):
    recs = [{"shape": "S", "variant": "default", "round": 0, "ms_median": ms,
             "sm_mhz_mean": None} for ms in (10.0, 11.0)]
    with pytest.raises(ValueError, match="two records of shape S, variant 'default', round 0"):
        dispatch_ab.summarize(recs)
    one = dispatch_ab.summarize(recs[:1])
    assert one[0]["mhz"] is None
    dispatch_ab.print_summary(one)  # no clock: printed as "-"
    assert "10.000      -" in capsys.readouterr().out
    import json
    path = tmp_path / "ab.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(SystemExit):
        dispatch_ab.main(["--summarize", str(path)])
    assert "--summarize" in capsys.readouterr().err


def test_summary_of_the_stop20_e8_final_check():
    """The numbers docs/benchmarks.md quotes for the final check's E8 row: the median of the
    per-round ratios (0.990), not the ratio of the medians (0.992)."""
    import json
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results",
                        "h200_final_dispatch_ab_e8_2026-12-01_stop20.jsonl")
    with open(path) as f:
        rows = {r["variant"]: r for r in dispatch_ab.summarize([json.loads(x) for x in f])}
    v = rows["fc1_swiglu_gluon"]
    assert round(v["ms"], 3) == 27.670 and round(v["vs_default"], 3) == 0.990
    assert round(v["x_peer"], 3) == 1.160 and round(rows["default"]["x_peer"], 3) == 1.172


def test_usage_errors_of_the_timing_knobs(capsys):
    with pytest.raises(SystemExit):
        dispatch_ab.main(["--interval-ms", "0"])
    assert "--interval-ms > 0" in capsys.readouterr().err
