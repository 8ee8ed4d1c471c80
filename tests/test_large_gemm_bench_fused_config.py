"""``benchmarks/large_gemm_triton.py --fused-config``: the fc1 + SwiGLU kernel's launch config
reaches only the fused kernel's comparison, and a bad one is a usage error before GPU work."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from bench_helpers import large_gemm_configs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import large_gemm_triton as bench  # noqa: E402


def _run_main(monkeypatch, argv):
    """``bench.main`` with CUDA faked: {gemm: (cfg, fused_cfg)} of each comparison."""
    seen = large_gemm_configs(monkeypatch, bench, argv)
    return {gemm: (cfg, fused) for gemm, cfg, fused in seen}


def test_fused_config_reaches_the_fused_kernel_only(monkeypatch, capsys):
    seen = _run_main(monkeypatch, ["--shapes", "E8_T16384_H4096_FF14336", "--gemms",
                                   "fc1,fc2_wgrad", "--fused-config", '{"FLAT": true}'])
    capsys.readouterr()
    assert seen["fc1"] == (None, {"FLAT": True})
    assert seen["fc2_wgrad"][0] is None


def test_no_fused_config_keeps_the_default(monkeypatch, capsys):
    seen = _run_main(monkeypatch, ["--shapes", "E8_T16384_H4096_FF14336", "--gemms", "fc1"])
    capsys.readouterr()
    assert seen["fc1"] == (None, None)


@pytest.mark.parametrize("value, words", [
    ('{"FLATT": true}', ["--fused-config", "FLATT"]),
    ("[1]", ["--fused-config must be a JSON object"]),
    ("{", ["--fused-config must be a JSON object"]),
])
def test_bad_fused_config_is_a_usage_error_before_gpu_work(monkeypatch, capsys, value, words):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # never reached
    with pytest.raises(SystemExit) as info:
        bench.main(["--fused-config", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, err


def test_profile_scripts_take_the_mid_and_host_shapes_by_name():
    """``profile_gaps.py`` / ``profile_graph_e64.py`` accept ``grouped_mlp``'s MID and HOST
    shapes (stop 15: the mid-shape profile), and still name the known shapes on a typo."""
    import argparse

    from common import check_trace_args, gpu_shapes
    from grouped_mlp import HOST_SHAPES, MID_SHAPES, SHAPES

    assert set(gpu_shapes()) == {*SHAPES, *HOST_SHAPES, *MID_SHAPES}
    parser = argparse.ArgumentParser()
    ok = argparse.Namespace(steps=1, warmup=0, summarize=None, peers="te_ops_fused",
                            shapes="E128_T16384_H2048_FF768,E32_T32768_H7168_FF2048")
    check_trace_args(parser, ok)  # no usage error
    bad = argparse.Namespace(**{**vars(ok), "shapes": "E128_T16384_H2048_FF76"})
    with pytest.raises(SystemExit):
        check_trace_args(parser, bad)
