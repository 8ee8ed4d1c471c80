"""te_ops' persistent Triton grouped GEMMs against ``torch._grouped_mm`` (CUDA, bf16).

For the issue-10 shapes (``benchmarks/grouped_mlp.py``'s E8 T16384 H4096 FF14336, E128 T65536
H2048 FF768, E32 T32768 H7168 FF2048; Zipf(1.2)-skewed split sizes as there; ``MID_SHAPES``
with 32-256 rows per group on request) it times, per
GEMM, with CUDA events around each call, the calls interleaved round by round (every variant
sees the same clock and power history; docs/benchmarks.md "Why te_ops' GEMMs timed slower than
the peer's"), median of ``--reps`` (>= 20) rounds:

* ``fc1`` (x (T, H) @ W1_g^T, W1 (E, 2FF, H)):
  ``grouped_mm`` (``torch._grouped_mm`` with the ``W^T`` view: te_ops' and the peer's call),
  ``triton`` (``grouped_gemm_large_triton.large_fprop``),
  ``grouped_mm_swiglu`` (``_grouped_mm`` then the Triton ScaledSwiGLU forward: what te_ops
  runs now), ``triton_swiglu`` (the Triton fprop then the same SwiGLU) and ``fused``
  (``large_fc1_swiglu``: h and a in one launch);
* ``fc2`` (a (T, FF) @ W2_g^T, W2 (E, H, FF)): ``grouped_mm`` and ``triton``;
* ``fc1_dgrad`` / ``fc2_dgrad`` (the layer's output gradient (T, N) @ W_g, W (E, N, K)):
  ``grouped_mm`` (``torch._grouped_mm(dy, w, offs=offs)``) and ``triton``
  (``grouped_gemm_large_triton.large_dgrad``);
* ``fc1_wgrad`` (dW1_g = dh_g^T @ x_g: x (T, H), dh (T, 2FF) -> (E, 2FF, H)) and
  ``fc2_wgrad`` (dW2_g = dy_g^T @ a_g: a (T, FF), dy (T, H) -> (E, H, FF)): ``grouped_mm``
  (``torch._grouped_mm(dy.t(), x, offs=offs)``, te_ops' wgrad call) and ``triton``
  (``grouped_wgrad_large_triton.large_wgrad``).

Each record (``bench: "large_gemm_triton"``) has the medians (``*_ms``), p10/p90, TFLOP/s of the
GEMM, the ratios ``triton_x`` = grouped_mm / triton and ``fused_x`` = grouped_mm_swiglu / fused
(> 1: the Triton path is faster; issue 10 asks for the whole block >= 1.15x), the config and
whether TMA loads ran, and checks: ``max_abs_diff`` of the Triton output against
``_grouped_mm``'s and ``a_equal`` (the fused ``a`` equals the Triton SwiGLU on the fused
``h`` bit for bit), ``bitwise_equal`` (the Triton output equals ``_grouped_mm``'s); for fc1
also ``fused_vs_triton_swiglu`` = triton_swiglu / fused (the fused launch against what te_ops
runs unfused at these rows) and ``fused_h_equal_triton`` (the fused ``h`` equals
``large_fprop``'s bit for bit). ``--fused-variants JSON`` times other fc1 + SwiGLU launch
configs in the same rounds (``fused_NAME_ms``, ``fused_NAME_vs_triton_swiglu``).
``--sweep`` times the launch configurations of :data:`SWEEP` (tiles, ``GROUP_M``, warps,
stages, the FLAT schedule, TMA or pointer loads; :data:`WGRAD_SWEEP` for the wgrad kinds;
``sweep`` records, ``ms`` median of ``--sweep-reps``, errors such as out-of-resources
recorded, not raised) for each shape and kind, then runs the comparison with the fastest
configuration of each (shape, kind).
``--variants JSON`` (``{"name": {config changes}}``) times other fprop/dgrad launch configs
beside the default in the same rounds (``triton_NAME_ms``, ``triton_NAME_x`` against
``_grouped_mm``, ``triton_NAME_vs_triton`` against the default, ``bitwise_equal_NAME``);
``--config-override JSON`` changes the fprop/dgrad default itself (the wgrad GEMMs keep
theirs; both flags are checked against ``large_config`` before any GPU work); ``--loops``
first records each
variant's compiled loop structure (``large_gemm_triton_loops``: ``scf.for`` count and nesting
in the TTGIR, warp-specialized partitions, shared memory; whether ``FLAT`` was flattened).
``--gluon JSON`` (``{"gluon": {}, "gluon_NAME": {config changes}}``) times the
warp-specialized Gluon fprop/dgrad (``kernels/grouped_gemm_gluon.py``) in the same rounds
(``NAME_ms``, ``NAME_x`` against ``_grouped_mm``, ``NAME_vs_triton`` against the Triton
kernel, ``bitwise_equal_NAME``, ``NAME_equal_triton``); fc1 then leaves out the SwiGLU and
fused calls, and the wgrad GEMMs are not affected.
``--gluon-fc1 JSON`` (``{"gfc1": {}, "gfc1_NAME": {config changes}}``) times the Gluon fc1 +
SwiGLU kernel (``kernels/fc1_swiglu_gluon.py``: h and a in one warp-specialized launch) in
fc1's rounds, beside ``triton_swiglu`` (the persistent fprop + the Triton SwiGLU pass it
replaces) and ``fused``: ``NAME_ms``, ``NAME_vs_triton_swiglu``, ``NAME_x`` (against
``grouped_mm_swiglu``), ``NAME_vs_grouped_mm`` (the plain ``_grouped_mm`` fprop against the
fused launch: what issue 10 compares), ``NAME_h_equal_triton`` (h equals ``large_fprop``'s
bit for bit) and ``NAME_a_equal`` (a equals ``swiglu_forward(large_fprop(...), probs)``).
``--summarize FILE`` prints a table of a results file (no GPU needed).

``--gemms fc2_dswiglu`` (not in the default list) times fc2's backward front half
(``dswiglu`` records, dy (T, H), W2 (E, H, FF) at init scale, h (T, 2FF) ~ N(0, 1), probs):
``dgrad`` (``large_dgrad`` alone; ``dgrad_fused_tiles``: with the fused kernel's default
tile, so ``epilogue_ms`` = fused - that is what the epilogue adds), ``two_launches``
(``large_dgrad`` then the Triton SwiGLU backward with the output written: what the fused
backward runs without the epilogue) and
``fused`` (``dgrad_dswiglu_triton.large_dgrad_dswiglu``: one launch), interleaved;
``fused_x`` = two_launches / fused; checks ``dh_equal`` and ``a_equal`` (bitwise) and
``dprobs_max_abs_diff`` / ``dprobs_max_rel_diff`` against the two launches.
``--dswiglu-variants JSON`` times other launch configs of the fused kernel beside its default
(``fused_NAME_ms``, ``fused_NAME_x``, ``dh_equal_NAME``).
With ``--gluon JSON`` (``{"gluon": {}, "gluon_NAME": {config changes}}``) the record also
times the warp-specialized Gluon fused kernel (``dgrad_dswiglu_gluon.gluon_dgrad_dswiglu``,
configs of ``gluon_dswiglu_config``: ``NAME_ms``, ``NAME_x`` = two_launches / NAME,
``NAME_vs_gluon_pair`` against ``two_launches_gluon`` (the Gluon dgrad then the SwiGLU
backward), ``dgrad_gluon_n128`` (the Gluon dgrad with the fused kernel's 128 x 128 tiles),
``dh_equal_NAME`` / ``a_equal_NAME`` bitwise, ``dprobs_max_rel_diff_NAME``).

Usage (one device call; see docs/benchmarks.md "Large-shape Triton grouped GEMM")::

    python benchmarks/large_gemm_triton.py [--shapes ...] [--gemms fc1,fc2,fc1_wgrad,fc2_wgrad]
        [--reps 30] [--sweep] [--variants '{"walk": {"FLAT": false}}'] [--loops] [--out FILE]
    python benchmarks/large_gemm_triton.py --summarize FILE
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from typing import Any

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))  # common.py
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    JsonLines,
    check_file,
    check_list,
    check_min,
    machine_info,
    read_records,
    recorded_run,
    summarize_times,
)
from grouped_mlp import skewed_sizes  # noqa: E402

BENCH = "large_gemm_triton"
SHAPES = {  # experts, tokens, hidden, ffn (benchmarks/grouped_mlp.py's large shapes)
    "E8_T16384_H4096_FF14336": (8, 16384, 4096, 14336),
    "E128_T65536_H2048_FF768": (128, 65536, 2048, 768),
    "E32_T32768_H7168_FF2048": (32, 32768, 7168, 2048),
}
#: Fewer rows per group (selectable with ``--shapes``, not run by default): where the rule
#: ``MIN_ROWS_PER_GROUP`` stops (E128 T65536 is 512 rows per group on average), and one shape
#: below it (16 rows, where ``torch._grouped_mm`` runs fprop and the few-rows kernel does not).
MID_SHAPES = {
    "E128_T32768_H2048_FF768": (128, 32768, 2048, 768),    # 256 rows per group
    "E128_T16384_H2048_FF768": (128, 16384, 2048, 768),    # 128
    "E64_T16384_H7168_FF2048": (64, 16384, 7168, 2048),    # 256
    "E128_T8192_H2048_FF768": (128, 8192, 2048, 768),      # 64
    "E64_T4096_H7168_FF2048": (64, 4096, 7168, 2048),      # 64
    "E128_T4096_H2048_FF768": (128, 4096, 2048, 768),      # 32
    "E128_T2048_H2048_FF768": (128, 2048, 2048, 768),      # 16 (below the rule: measured only)
}
ALL_SHAPES = {**SHAPES, **MID_SHAPES}
GEMMS = ("fc1", "fc2", "fc1_dgrad", "fc2_dgrad", "fc1_wgrad", "fc2_wgrad")
#: Selectable with ``--gemms``, not run by default: fc2's dgrad + the SwiGLU backward, two
#: launches against the fused kernel (module docstring).
EXTRA_GEMMS = ("fc2_dswiglu",)
WGRADS = ("fc1_wgrad", "fc2_wgrad")
DEVICE = "cuda"  # the CPU smoke test (tests/test_large_gemm_bench.py) sets "cpu"

#: Launch configurations of ``--sweep``: changes to ``large_config("fprop")`` (the default,
#: ``FLAT``, is the first of the tile / warps / stages product; BLOCK_N is the plain fprop's
#: tile and the fused kernel's gate + up accumulator, ``PAIRED`` by default).
_BASE = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "USE_TMA": True,
         "FLAT": True, "WARP_SPEC": False, "TAIL": False, "num_warps": 8, "num_stages": 3}
SWEEP = [{**_BASE, **change} for change in (
    *({"BLOCK_N": bn, "num_warps": w, "num_stages": s}
      for bn, w, s in itertools.product((256, 128), (8, 4), (3, 4))),
    {"FLAT": False}, {"FLAT": False, "num_stages": 4},  # the group walk
    {"WARP_SPEC": True}, {"TAIL": True}, {"TAIL": True, "num_stages": 4},
    {"FLAT": False, "TAIL": True},
    {"BLOCK_M": 64, "num_warps": 4, "num_stages": 4},
    {"GROUP_M": 4}, {"GROUP_M": 16},
    {"BLOCK_N": 128, "BLOCK_K": 128},
    {"USE_TMA": False},
)]
#: Launch configurations of ``--sweep`` for the wgrad kinds: changes to
#: ``large_wgrad_config()`` (the flat schedule with per-group TMA bounds and a TMA-store
#: epilogue; dW tile BLOCK_N x BLOCK_K, BLOCK_M rows per step; every one fits SM90's shared
#: memory, stages plus the epilogue tile, and the fp32 accumulator stays <= 128 registers
#: per thread). ``FLAT=False`` is the nested schedule (a k-loop per tile).
_WGRAD_BASE = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 256, "USE_TMA": True,
               "SORTED": True, "FLAT": True, "DESC_BOUNDS": True, "TMA_STORE": True,
               "SUBTILE": 1, "WARP_SPEC": False, "num_warps": 8, "num_stages": 3}
WGRAD_SWEEP = [{**_WGRAD_BASE, **change} for change in (
    {}, {"FLAT": False, "TMA_STORE": False}, {"FLAT": False, "TMA_STORE": False,
                                              "num_stages": 4},
    {"TMA_STORE": False}, {"DESC_BOUNDS": False},
    {"SUBTILE": 2}, {"SUBTILE": 2, "num_stages": 4},
    {"BLOCK_N": 256, "BLOCK_K": 128}, {"BLOCK_M": 128, "BLOCK_K": 128},
    {"WARP_SPEC": True}, {"USE_TMA": False}, {"SORTED": False},
)]


def _operands(shape: tuple[int, int, int, int], gemm: str, seed: int) -> dict[str, Any]:
    experts, tokens, hidden, ffn = shape
    dev = torch.device(DEVICE)
    sizes = skewed_sizes(experts, tokens, seed)
    offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    gen = torch.Generator(device=dev).manual_seed(seed)
    k, n = (hidden, 2 * ffn) if gemm.startswith("fc1") else (ffn, hidden)
    flop = 2.0 * tokens * n * k
    if gemm in WGRADS:  # x (T, k), dy (T, n) -> dW (E, n, k)
        x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16, generator=gen)
        dy = torch.randn(tokens, n, device=dev, dtype=torch.bfloat16, generator=gen)
        return {"x": x, "dy": dy, "offs": offs, "sizes": sizes, "flop": flop}
    w = torch.randn(experts, n, k, device=dev, dtype=torch.bfloat16, generator=gen) * k ** -0.5
    # dgrad: the layer's output gradient (T, N) is the operand, dx (T, K) the output
    x = torch.randn(tokens, n if gemm.endswith("dgrad") else k, device=dev,
                    dtype=torch.bfloat16, generator=gen)
    probs = torch.rand(tokens, device=dev, generator=gen)
    return {"x": x, "w": w, "offs": offs, "probs": probs, "sizes": sizes, "flop": flop}


def _calls(ops: dict[str, Any], gemm: str, cfg: dict | None, fused_cfg: dict | None,
           variants: dict[str, dict] | None = None,
           fused_variants: dict[str, dict] | None = None,
           gluon: dict[str, dict] | None = None,
           gluon_fc1: dict[str, dict] | None = None) -> dict[str, Any]:
    from te_ops.gemm import grouped_gemm_large_triton as lg
    from te_ops.gemm import grouped_wgrad_large_triton as lw
    from te_ops.kernels import swiglu_triton as st

    if gemm in WGRADS:
        x, dy, offs = ops["x"], ops["dy"], ops["offs"]
        return {"grouped_mm": lambda: torch._grouped_mm(dy.t(), x, offs=offs),
                "triton": lambda: lw.large_wgrad(x, dy, offs, cfg or {})}
    x, w, offs, probs = ops["x"], ops["w"], ops["offs"], ops["probs"]
    run = lg.large_dgrad if gemm.endswith("dgrad") else lg.large_fprop
    calls = {"grouped_mm": ((lambda: torch._grouped_mm(x, w, offs=offs)) if gemm.endswith("dgrad")
                            else (lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs))),
             "triton": lambda: run(x, w, offs, cfg or {})}
    for name, change in (variants or {}).items():  # --variants: other launch configs
        calls[f"triton_{name}"] = lambda c={**(cfg or {}), **change}: run(x, w, offs, c)
    if gluon is not None:  # --gluon: the warp-specialized Gluon kernel, plain GEMMs only
        from te_ops.gemm import grouped_gemm_gluon as gg

        grun = gg.gluon_dgrad if gemm.endswith("dgrad") else gg.gluon_fprop
        for name, change in gluon.items():
            calls[name] = lambda c=change: grun(x, w, offs, c)
        return calls
    if gemm.endswith("dgrad"):
        return calls
    if gemm == "fc1":
        calls["grouped_mm_swiglu"] = lambda: st.swiglu_forward(calls["grouped_mm"](), probs)
        calls["triton_swiglu"] = lambda: st.swiglu_forward(calls["triton"](), probs)
        calls["fused"] = lambda: lg.large_fc1_swiglu(x, w, offs, probs, fused_cfg or {})
        for name, change in (fused_variants or {}).items():  # --fused-variants
            calls[f"fused_{name}"] = lambda c={**(fused_cfg or {}), **change}: (
                lg.large_fc1_swiglu(x, w, offs, probs, c))
        if gluon_fc1:  # --gluon-fc1: the warp-specialized Gluon fc1 + SwiGLU
            from te_ops.gemm import fc1_swiglu_gluon as fg

            for name, change in gluon_fc1.items():
                calls[name] = lambda c=change: fg.gluon_fc1_swiglu(x, w, offs, probs, c)
    return calls


def _time_interleaved(calls: dict[str, Any], reps: int, warmup: int) -> dict[str, list[float]]:
    """Milliseconds of each call per round; the calls run one after the other in each round."""
    for _ in range(warmup):
        for fn in calls.values():
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        events = []
        for fn in calls.values():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        for name, (start, end) in zip(calls, events):
            times[name].append(start.elapsed_time(end))
    return times


def _checks(calls: dict[str, Any], gemm: str, probs: torch.Tensor | None,
            variants: dict[str, dict] | None = None) -> dict[str, Any]:
    """Triton output against ``_grouped_mm``'s (each ``--variants`` config's too); for fc1
    also the fused h, and a's bits."""
    from te_ops.kernels import swiglu_triton as st

    want = calls["grouped_mm"]()
    got = calls["triton"]()
    out = {"max_abs_diff": (got.float() - want.float()).abs().max().item(),
           "ref_max_abs": want.float().abs().max().item(),
           "bitwise_equal": bool(torch.equal(got, want))}
    for name in variants or {}:
        out[f"bitwise_equal_{name}"] = bool(torch.equal(calls[f"triton_{name}"](), want))
    for name in (n for n in calls if n.startswith("gluon")):
        y = calls[name]()
        out[f"bitwise_equal_{name}"] = bool(torch.equal(y, want))
        out[f"{name}_max_abs_diff"] = (y.float() - want.float()).abs().max().item()
        out[f"{name}_equal_triton"] = bool(torch.equal(y, got))
    if "fused" not in calls:
        return out
    if "fused" in calls:
        h, a = calls["fused"]()
        out["fused_h_max_abs_diff"] = (h.float() - want.float()).abs().max().item()
        out["fused_h_equal_triton"] = bool(torch.equal(h, got))  # the persistent fprop's bits
        out["a_equal"] = bool(torch.equal(a, st.swiglu_forward(h, probs)))
        two = st.swiglu_forward(got, probs)  # the two launches' a
        for name in (n for n in calls if n.startswith("gfc1")):  # --gluon-fc1
            h, a = calls[name]()
            out[f"{name}_h_equal_triton"] = bool(torch.equal(h, got))
            out[f"{name}_a_equal"] = bool(torch.equal(a, two))
    return out


def compare(shape_name: str, gemm: str, args: argparse.Namespace, cfg: dict | None = None,
            fused_cfg: dict | None = None) -> dict[str, Any]:
    """The interleaved comparison record of one (shape, GEMM) (module docstring)."""
    from te_ops.gemm import grouped_gemm_large_triton as lg
    from te_ops.gemm import grouped_wgrad_large_triton as lw

    ops = _operands(ALL_SHAPES[shape_name], gemm, args.seed)
    variants = {} if gemm in WGRADS else (getattr(args, "variants", None) or {})
    fused_variants = (getattr(args, "fused_variants", None) or {}) if gemm == "fc1" else {}
    gluon = getattr(args, "gluon", None) if gemm not in WGRADS else None
    gluon_fc1 = getattr(args, "gluon_fc1", None) if gemm == "fc1" else None
    calls = _calls(ops, gemm, cfg, fused_cfg, variants, fused_variants, gluon, gluon_fc1)
    rec: dict[str, Any] = {"bench": BENCH, "shape": shape_name, "gemm": gemm,
                           "reps": args.reps, "split_sizes": ops["sizes"]}
    if gemm in WGRADS:
        rec["config"] = {**lw.large_wgrad_config(), **(cfg or {})}
        rec["tma_reason"] = lw.tma_unsupported_reason(ops["x"], ops["dy"])
    else:
        rec["config"] = {**lg.large_config("fprop"), **(cfg or {})}
        rec["tma_reason"] = lg.tma_unsupported_reason(ops["x"], ops["w"])
    if gluon:
        from te_ops.gemm import grouped_gemm_gluon as gg

        rec["gluon_configs"] = {n: {**gg.gluon_config(), **c} for n, c in gluon.items()}
    if "fused" in calls:
        rec["fused_config"] = {**lg.large_config("fc1_swiglu"), **(fused_cfg or {})}
    rec.update(_checks(calls, gemm, ops.get("probs"), variants))
    if variants:
        rec["variants"] = {n: {**rec["config"], **c} for n, c in variants.items()}
    times = _time_interleaved(calls, args.reps, args.warmup)
    for name, ts in times.items():
        s = summarize_times(ts)
        rec[f"{name}_ms"] = s["ms_median"]
        rec[f"{name}_p10_ms"], rec[f"{name}_p90_ms"] = s["ms_p10"], s["ms_p90"]
    for name in ("grouped_mm", "triton"):
        rec[f"{name}_tflops"] = ops["flop"] / rec[f"{name}_ms"] / 1e9
    rec["triton_x"] = rec["grouped_mm_ms"] / rec["triton_ms"]
    for name in variants:  # against the peer, and against the default Triton config
        rec[f"triton_{name}_x"] = rec["grouped_mm_ms"] / rec[f"triton_{name}_ms"]
        rec[f"triton_{name}_vs_triton"] = rec["triton_ms"] / rec[f"triton_{name}_ms"]
    for name in (n for n in calls if n.startswith("gluon")):  # --gluon
        rec[f"{name}_tflops"] = ops["flop"] / rec[f"{name}_ms"] / 1e9
        rec[f"{name}_x"] = rec["grouped_mm_ms"] / rec[f"{name}_ms"]
        rec[f"{name}_vs_triton"] = rec["triton_ms"] / rec[f"{name}_ms"]
    if "fused" in calls:
        rec["fused_x"] = rec["grouped_mm_swiglu_ms"] / rec["fused_ms"]
        rec["triton_swiglu_x"] = rec["grouped_mm_swiglu_ms"] / rec["triton_swiglu_ms"]
        # the fused launch against what te_ops runs unfused there: the persistent fprop + SwiGLU
        rec["fused_vs_triton_swiglu"] = rec["triton_swiglu_ms"] / rec["fused_ms"]
        for name, change in fused_variants.items():
            rec[f"fused_{name}_config"] = {**rec["fused_config"], **change}
            rec[f"fused_{name}_vs_triton_swiglu"] = (rec["triton_swiglu_ms"]
                                                     / rec[f"fused_{name}_ms"])
    if gluon_fc1 and "fused" in calls:
        from te_ops.gemm import fc1_swiglu_gluon as fg

        rec["gluon_fc1_configs"] = {n: {**fg.gluon_fc1_config(), **c}
                                    for n, c in gluon_fc1.items()}
        for name in gluon_fc1:
            rec[f"{name}_vs_triton_swiglu"] = rec["triton_swiglu_ms"] / rec[f"{name}_ms"]
            rec[f"{name}_x"] = rec["grouped_mm_swiglu_ms"] / rec[f"{name}_ms"]
            rec[f"{name}_vs_grouped_mm"] = rec["grouped_mm_ms"] / rec[f"{name}_ms"]
            rec[f"{name}_tflops"] = ops["flop"] / rec[f"{name}_ms"] / 1e9
    return rec


def _dswiglu_operands(shape: tuple[int, int, int, int], seed: int) -> dict[str, Any]:
    """fc2's backward front half at ``shape``: dy (T, H), W2 (E, H, FF) at init scale, h
    (T, 2FF) ~ N(0, 1) (fc1's output at N(0, 1) inputs and init-scale weights), probs."""
    experts, tokens, hidden, ffn = shape
    dev = torch.device(DEVICE)
    sizes = skewed_sizes(experts, tokens, seed)
    gen = torch.Generator(device=dev).manual_seed(seed)
    return {"dy": torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16, generator=gen),
            "w": torch.randn(experts, hidden, ffn, device=dev, dtype=torch.bfloat16,
                             generator=gen) * ffn ** -0.5,
            "h": torch.randn(tokens, 2 * ffn, device=dev, dtype=torch.bfloat16, generator=gen),
            "probs": torch.rand(tokens, device=dev, generator=gen),
            "offs": torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32), "sizes": sizes}


def _dswiglu_calls(ops: dict[str, Any], variants: dict[str, dict],
                   gluon: dict[str, dict] | None = None) -> dict[str, Any]:
    """The timed calls of ``--gemms fc2_dswiglu`` (h is not overwritten: dh goes to a new
    buffer in both, the same bytes as over h)."""
    from te_ops.kernels import dgrad_dswiglu_triton as dd
    from te_ops.gemm import grouped_gemm_large_triton as lg
    from te_ops.kernels import swiglu_triton as st

    dy, w, h, probs, offs = ops["dy"], ops["w"], ops["h"], ops["probs"], ops["offs"]

    def two_launches():
        da = lg.large_dgrad(dy, w, offs)
        return st.swiglu_backward(h, da, probs, write_output=True)

    # "lead_in" (not reported as a result) takes the first slot of each round: the first call
    # after the round's synchronize meets an idle GPU (run 1 timed the dgrad alone slower
    # than the dgrad + SwiGLU pass behind it).
    tiles = {k: dd.dswiglu_config()[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps")}
    calls = {"lead_in": lambda: lg.large_dgrad(dy, w, offs),
             "dgrad": lambda: lg.large_dgrad(dy, w, offs),
             "dgrad_fused_tiles": lambda: lg.large_dgrad(dy, w, offs, tiles),
             "two_launches": two_launches,
             "fused": lambda: dd.large_dgrad_dswiglu(dy, w, offs, h, probs)}
    for name, change in variants.items():
        calls[f"fused_{name}"] = lambda c=change: dd.large_dgrad_dswiglu(dy, w, offs, h, probs,
                                                                         config=c)
    if gluon:  # --gluon: the warp-specialized Gluon fused kernel and the Gluon dgrad's pair
        from te_ops.kernels import dgrad_dswiglu_gluon as gd
        from te_ops.gemm import grouped_gemm_gluon as gg

        def gluon_two_launches():
            da = gg.gluon_grouped_gemm(dy, w, offs, True)
            return st.swiglu_backward(h, da, probs, write_output=True)

        calls["dgrad_gluon"] = lambda: gg.gluon_grouped_gemm(dy, w, offs, True)
        calls["dgrad_gluon_n128"] = lambda: gg.gluon_dgrad(dy, w, offs, {"BLOCK_N": 128})
        calls["two_launches_gluon"] = gluon_two_launches
        for name, change in gluon.items():
            calls[name] = lambda c=change: gd.gluon_dgrad_dswiglu(dy, w, offs, h, probs,
                                                                  config=c or None)
    return calls


def compare_dswiglu(shape_name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The interleaved comparison record of fc2's dgrad + SwiGLU backward at one shape
    (module docstring, ``--gemms fc2_dswiglu``)."""
    from te_ops.kernels import dgrad_dswiglu_triton as dd

    ops = _dswiglu_operands(ALL_SHAPES[shape_name], args.seed)
    variants = getattr(args, "dswiglu_variants", None) or {}
    gluon = getattr(args, "gluon", None)
    calls = _dswiglu_calls(ops, variants, gluon)
    rec: dict[str, Any] = {"bench": BENCH + "_dswiglu", "shape": shape_name,
                           "gemm": "fc2_dswiglu", "reps": args.reps,
                           "split_sizes": ops["sizes"], "config": dd.dswiglu_config()}
    dh0, dp0, a0 = calls["two_launches"]()
    dh, dp, a = calls["fused"]()
    rec["dh_equal"] = bool(torch.equal(dh, dh0))
    rec["a_equal"] = bool(torch.equal(a, a0))
    diff = (dp.double() - dp0.double()).abs()
    rec["dprobs_max_abs_diff"] = diff.max().item()
    rec["dprobs_max_rel_diff"] = (diff / dp0.double().abs().clamp_min(1e-30)).max().item()
    rec["dprobs_ref_max_abs"] = dp0.double().abs().max().item()
    for name in variants:
        dhv, _, av = calls[f"fused_{name}"]()
        rec[f"dh_equal_{name}"] = bool(torch.equal(dhv, dh0) and torch.equal(av, a0))
    if gluon:
        from te_ops.kernels import dgrad_dswiglu_gluon as gd

        rec["gluon_configs"] = {n: {**gd.gluon_dswiglu_config(), **c} for n, c in gluon.items()}
        dhg, dpg, ag = calls["two_launches_gluon"]()
        rec["two_launches_gluon_equal"] = bool(torch.equal(dhg, dh0) and torch.equal(ag, a0)
                                               and torch.equal(dpg, dp0))
        for name in gluon:
            dhv, dpv, av = calls[name]()
            rec[f"dh_equal_{name}"] = bool(torch.equal(dhv, dh0))
            rec[f"a_equal_{name}"] = bool(torch.equal(av, a0))
            dv = (dpv.double() - dp0.double()).abs()
            rec[f"dprobs_max_rel_diff_{name}"] = (
                dv / dp0.double().abs().clamp_min(1e-30)).max().item()
            rec[f"dprobs_max_abs_diff_{name}"] = dv.max().item()
            del dhv, dpv, av
        del dhg, dpg, ag
    del dh0, dp0, a0, dh, dp, a
    times = _time_interleaved(calls, args.reps, args.warmup)
    for name, ts in times.items():
        stats = summarize_times(ts)
        rec[f"{name}_ms"] = stats["ms_median"]
        rec[f"{name}_p10_ms"], rec[f"{name}_p90_ms"] = stats["ms_p10"], stats["ms_p90"]
    rec["fused_x"] = rec["two_launches_ms"] / rec["fused_ms"]
    rec["epilogue_ms"] = rec["fused_ms"] - rec["dgrad_fused_tiles_ms"]
    rec["swiglu_pass_ms"] = rec["two_launches_ms"] - rec["dgrad_ms"]
    if variants:
        rec["variants"] = {n: {**rec["config"], **c} for n, c in variants.items()}
    for name in variants:
        rec[f"fused_{name}_x"] = rec["two_launches_ms"] / rec[f"fused_{name}_ms"]
    for name in gluon or {}:  # against the faster of the two unfused pairs
        rec[f"{name}_x"] = rec["two_launches_ms"] / rec[f"{name}_ms"]
        rec[f"{name}_vs_gluon_pair"] = rec["two_launches_gluon_ms"] / rec[f"{name}_ms"]
        # (no per-config epilogue share: the Triton fused-tile dgrad is no baseline for a
        # Gluon config's own tile shape, e.g. 64 x 256)
    return rec


def _check_dswiglu_variants(parser: argparse.ArgumentParser, variants: dict[str, dict]
                            ) -> None:
    """A usage error (before any GPU work) where a ``--dswiglu-variants`` config is not a
    launch config of the fused fc2 dgrad + dSwiGLU kernel."""
    if not variants:
        return
    from te_ops.kernels import dgrad_dswiglu_triton as dd

    for name, change in variants.items():
        try:
            dd._resolve(change, 1)
        except ValueError as exc:
            parser.error(f"--dswiglu-variants {name!r}: {exc}")


def _check_gluon_dswiglu(parser: argparse.ArgumentParser, gluon: dict[str, dict]) -> None:
    """A usage error (before any GPU work) where a ``--gluon`` config is not a launch config
    of the Gluon fc2 dgrad + dSwiGLU kernel (``--gemms fc2_dswiglu``)."""
    from te_ops.kernels import dgrad_dswiglu_gluon as gd

    for name, change in gluon.items():
        try:
            gd._resolve(change)
        except ValueError as exc:
            parser.error(f"--gluon {name!r} (fc2_dswiglu): {exc}")


def sweep(shape_name: str, gemm: str, args: argparse.Namespace, out: JsonLines
          ) -> tuple[dict | None, dict | None]:
    """Time every :data:`SWEEP` config of the plain fprop (and, for fc1, of the fused kernel,
    whose BLOCK_N is its gate + up accumulator's width; for the wgrad kinds every
    :data:`WGRAD_SWEEP` config of the wgrad kernel); return the fastest of each (``None``
    when none ran)."""
    ops = _operands(ALL_SHAPES[shape_name], gemm, args.seed)
    kinds = _sweep_kinds(ops, gemm, fused=not getattr(args, "no_fused_sweep", False))
    best: dict[str, tuple[float, dict]] = {}
    want = _calls(ops, gemm, None, None)["grouped_mm"]()
    for kind, fn in kinds.items():
        for cfg in _filtered(WGRAD_SWEEP if kind == "wgrad" else SWEEP,
                             getattr(args, "sweep_filter", None)):
            rec = {"bench": BENCH + "_sweep", "shape": shape_name, "gemm": gemm, "kind": kind,
                   "config": cfg}
            try:
                ms = statistics.median(_time_interleaved({"k": lambda c=cfg, f=fn: f(c)},
                                                         args.sweep_reps, 2)["k"])
            except Exception as exc:  # noqa: BLE001 - out of resources etc.: record, go on
                rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                out.write(rec)
                torch.cuda.synchronize()
                continue
            rec["ms"] = ms
            rec["tflops"] = ops["flop"] / ms / 1e9
            if kind != "fc1_swiglu":  # every config's output against _grouped_mm's
                rec["bitwise_equal"] = bool(torch.equal(fn(cfg), want))
            out.write(rec)
            if best.get(kind) is None or ms < best[kind][0]:
                best[kind] = (ms, cfg)
    first = "wgrad" if gemm in WGRADS else "fprop"
    return tuple(None if best.get(k) is None else best[k][1] for k in (first, "fc1_swiglu"))


def _filtered(configs: list[dict], spec: str | None) -> list[dict]:
    """The configs whose values match ``spec`` (``KEY=VALUE,...``, values as Python
    literals; a config without the key does not match); all of them without a spec."""
    if not spec:
        return configs
    want = dict(item.split("=", 1) for item in spec.split(","))
    return [c for c in configs if all(k in c and str(c[k]) == v for k, v in want.items())]


def _check_sweep_filter(parser: argparse.ArgumentParser, spec: str | None) -> None:
    """A usage error where ``--sweep-filter`` is not ``KEY=VALUE[,KEY=VALUE]`` or selects no
    config of :data:`SWEEP` nor of :data:`WGRAD_SWEEP` (e.g. ``FLAT=true``: values are
    compared as Python literals, ``True``); a filter matching nothing would time no config
    and compare the defaults."""
    if not spec:
        return
    if any("=" not in item for item in spec.split(",")):
        parser.error(f"--sweep-filter must be KEY=VALUE[,KEY=VALUE], got {spec!r}")
    if not _filtered(SWEEP, spec) and not _filtered(WGRAD_SWEEP, spec):
        keys = sorted(set(SWEEP[0]) | set(WGRAD_SWEEP[0]))
        parser.error(f"--sweep-filter {spec!r} matches no --sweep config (keys {keys}, "
                     "values as Python literals, e.g. FLAT=True)")


def _sweep_kinds(ops: dict[str, Any], gemm: str, fused: bool = True) -> dict[str, Any]:
    """The kernels ``sweep`` times for ``gemm``, by kind, each a function of the config."""
    from te_ops.gemm import grouped_gemm_large_triton as lg
    from te_ops.gemm import grouped_wgrad_large_triton as lw

    x, offs = ops["x"], ops["offs"]
    if gemm in WGRADS:
        return {"wgrad": lambda c: lw.large_wgrad(x, ops["dy"], offs, c)}
    w, probs = ops["w"], ops["probs"]
    if gemm.endswith("dgrad"):
        return {"fprop": lambda c: lg.large_dgrad(x, w, offs, c)}
    kinds = {"fprop": lambda c: lg.large_fprop(x, w, offs, c)}
    if gemm == "fc1" and fused:
        kinds["fc1_swiglu"] = lambda c: lg.large_fc1_swiglu(x, w, offs, probs, c)
    return kinds


def summarize(path: str) -> str:
    """A table of the comparison records of ``path`` (and the best sweep config per kind)."""
    lines = [f"{'shape':26} {'gemm':9} {'grouped_mm':>10} {'triton':>8} {'x':>5} "
             f"{'mm+swiglu':>9} {'fused':>8} {'x':>5} {'tma':>4} {'a_equal':>7} "
             f"{'max_diff':>8} {'bits':>5}"]
    for r in read_records(path, BENCH):
        fused = (f"{r['grouped_mm_swiglu_ms']:9.3f} {r['fused_ms']:8.3f} {r['fused_x']:5.2f}"
                 if "fused_ms" in r else f"{'':9} {'':8} {'':5}")
        lines.append(f"{r['shape']:26} {r['gemm']:9} {r['grouped_mm_ms']:10.3f} "
                     f"{r['triton_ms']:8.3f} {r['triton_x']:5.2f} {fused} "
                     f"{'no' if r.get('tma_reason') else 'yes':>4} {str(r.get('a_equal', '')):>7} "
                     f"{r['max_abs_diff']:8.3g} {str(r.get('bitwise_equal', '')):>5}")
        if "fused_vs_triton_swiglu" in r:
            lines.append(f"  fused vs triton fprop + SwiGLU ({r['triton_swiglu_ms']:.3f} ms): "
                         f"{r['fused_vs_triton_swiglu']:5.3f}x, h bits "
                         f"{r.get('fused_h_equal_triton')}")
            for key in r:
                if key.startswith("fused_") and key.endswith("_vs_triton_swiglu") and \
                        key != "fused_vs_triton_swiglu":
                    name = key[len("fused_"):-len("_vs_triton_swiglu")]
                    lines.append(f"  fused variant {name}: {r[f'fused_{name}_ms']:.3f} ms, "
                                 f"{r[key]:5.3f}x")
        for name in r.get("gluon_fc1_configs", {}):  # --gluon-fc1
            lines.append(f"  {name:20} {r[f'{name}_ms']:8.3f} ms  vs triton+swiglu "
                         f"{r[f'{name}_vs_triton_swiglu']:5.3f}  vs grouped_mm fprop "
                         f"{r[f'{name}_vs_grouped_mm']:5.3f}  h/a bits "
                         f"{r.get(f'{name}_h_equal_triton')}/{r.get(f'{name}_a_equal')}")
        for name in r.get("gluon_configs", {}):  # --gluon
            lines.append(f"  {name:20} {r[f'{name}_ms']:8.3f} ms  x {r[f'{name}_x']:5.3f}  "
                         f"vs triton {r[f'{name}_vs_triton']:5.3f}  bits "
                         f"{r.get(f'bitwise_equal_{name}')}")
        for name in r.get("variants", {}):
            lines.append(f"  variant {name:12} {r[f'triton_{name}_ms']:8.3f} ms  x "
                         f"{r[f'triton_{name}_x']:5.3f}  vs default "
                         f"{r[f'triton_{name}_vs_triton']:5.3f}  bits "
                         f"{r.get(f'bitwise_equal_{name}')}")
    for r in read_records(path, BENCH + "_dswiglu"):
        lines.append(f"{r['shape']:26} fc2 dgrad+dSwiGLU: dgrad {r['dgrad_ms']:.3f} two "
                     f"{r['two_launches_ms']:.3f} fused {r['fused_ms']:.3f} x "
                     f"{r['fused_x']:.3f} dh/a bits {r['dh_equal']}/{r['a_equal']} dprobs "
                     f"rel {r['dprobs_max_rel_diff']:.2g}")
        for name in r.get("variants", {}):
            lines.append(f"  variant {name:12} {r[f'fused_{name}_ms']:8.3f} ms  x "
                         f"{r[f'fused_{name}_x']:5.3f}  bits {r[f'dh_equal_{name}']}")
        if r.get("gluon_configs"):
            lines.append(f"  gluon dgrad {r['dgrad_gluon_ms']:.3f} ms (128 x 128 tiles "
                         f"{r['dgrad_gluon_n128_ms']:.3f}), gluon pair "
                         f"{r['two_launches_gluon_ms']:.3f} ms (bits "
                         f"{r['two_launches_gluon_equal']})")
        for name in r.get("gluon_configs", {}):
            lines.append(f"  {name:20} {r[f'{name}_ms']:8.3f} ms  x {r[f'{name}_x']:5.3f}  "
                         f"vs gluon pair {r[f'{name}_vs_gluon_pair']:5.3f}  dh/a bits "
                         f"{r[f'dh_equal_{name}']}/{r[f'a_equal_{name}']} dprobs rel "
                         f"{r[f'dprobs_max_rel_diff_{name}']:.2g}")
    best: dict[tuple, dict] = {}
    for r in read_records(path, BENCH + "_sweep"):
        key = (r["shape"], r["gemm"], r["kind"])
        if "ms" in r and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    for (shape, gemm, kind), r in sorted(best.items()):
        lines.append(f"best sweep {shape} {gemm} {kind}: {r['ms']:.3f} ms "
                     f"({r['tflops']:.0f} TFLOP/s) {r['config']}")
    return "\n".join(lines)


def _json_arg(parser: argparse.ArgumentParser, flag: str, value: str | None,
              nested: bool = False) -> dict:
    """``value`` parsed as a JSON object (of objects when ``nested``); a usage error else."""
    if value is None:
        return {}
    try:
        got = json.loads(value)
    except json.JSONDecodeError as exc:
        parser.error(f"{flag} must be a JSON object, got {value!r} ({exc})")
    if not isinstance(got, dict) or (nested and not all(isinstance(v, dict)
                                                        for v in got.values())):
        parser.error(f"{flag} must be a JSON object{' of objects' if nested else ''}, got "
                     f"{value!r}")
    return got


def _check_configs(parser: argparse.ArgumentParser, override: dict,
                   variants: dict[str, dict]) -> None:
    """A usage error (before any GPU work) where ``--config-override`` or a ``--variants``
    config is not a valid fprop / dgrad launch config (``large_config`` keys, the
    ``WARP_SPEC`` / ``TAIL`` checks); the message names the flag and the kernel's reason."""
    from te_ops.gemm import grouped_gemm_large_triton as lg

    for flag, change in (("--config-override", override),
                         *((f"--variants {name!r}", {**override, **c})
                           for name, c in variants.items())):
        try:
            for kind in ("fprop", "dgrad"):
                lg._resolve(kind, change, 1)
        except ValueError as exc:
            parser.error(f"{flag}: {exc}")


def _check_fused_config(parser: argparse.ArgumentParser, change: dict,
                        flag: str = "--fused-config") -> None:
    """A usage error (before any GPU work) where ``--fused-config`` (or a ``--fused-variants``
    config over it: ``flag`` names it) is not a valid launch config of the fc1 + SwiGLU
    kernel (``large_config("fc1_swiglu")`` keys and checks)."""
    from te_ops.gemm import grouped_gemm_large_triton as lg

    try:
        lg._resolve("fc1_swiglu", change, 1)
    except ValueError as exc:
        parser.error(f"{flag}: {exc}")


def for_nesting(ttgir: str) -> int:
    """The deepest nesting of ``scf.for`` loops in a TTGIR listing (1: no loop inside a loop,
    e.g. a flattened tile loop)."""
    stack: list[bool] = []
    deepest = 0
    for line in ttgir.splitlines():
        is_for = "scf.for " in line
        for ch in line:
            if ch == "{":
                stack.append(is_for)
            elif ch == "}" and stack:
                stack.pop()
        deepest = max(deepest, sum(stack))
    return deepest


def loop_report(kind: str, change: dict) -> dict[str, Any]:
    """Compile the persistent kernel of ``kind`` (bf16, TMA as configured) ahead of time for
    this machine's GPU and describe its loops: ``scf_for`` (count in the TTGIR),
    ``for_nesting`` (:func:`for_nesting`), ``warp_specialize_ops`` (``ttg.warp_specialize``
    partitions), ``shared`` bytes, or ``error``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from te_ops.gemm import grouped_gemm_large_triton as lg

    cfg = {**lg.large_config(kind), **change}
    sig = {name: "*bf16" for name in ("x_ptr", "w_ptr", "h_ptr", "a_ptr")}
    sig.update({"p_ptr": "*fp32", "offs_ptr": "*i32"})
    sig.update({name: "i32" for name in ("M", "N", "K", "G", "P", "stride_wg", "stride_wn",
                                          "stride_wk")})
    const = {"SWIGLU": kind == "fc1_swiglu", "HAS_P": False, "W_KN": kind == "dgrad",
             "GBLOCK": 256 if cfg["FLAT"] else 1, "PAIRED": cfg.get("PAIRED", False),
             **{k: cfg[k] for k in ("USE_TMA", "FLAT", "WARP_SPEC", "TAIL", "BLOCK_M",
                                    "BLOCK_N", "BLOCK_K", "GROUP_M")}}
    cap = (torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0))
    src = ASTSource(lg._large_kernel, {**sig, **{k: "constexpr" for k in const}},
                    constexprs=const)
    rec: dict[str, Any] = {"config": cfg, "triton": triton.__version__}
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", cap[0] * 10 + cap[1], 32),
                                options={"num_warps": cfg["num_warps"],
                                         "num_stages": cfg["num_stages"]})
    except Exception as exc:  # noqa: BLE001 - record the compiler's refusal, go on
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        return rec
    ttgir = kernel.asm["ttgir"]
    rec.update(scf_for=ttgir.count("scf.for "), for_nesting=for_nesting(ttgir),
               warp_specialize_ops=ttgir.count("ttg.warp_specialize"),
               shared=kernel.metadata.shared)
    return rec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--gemms", default=",".join(GEMMS))
    parser.add_argument("--reps", type=int, default=30, help="timed rounds (>= 20)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="time SWEEP's configs first")
    parser.add_argument("--sweep-reps", type=int, default=20)
    parser.add_argument("--sweep-filter", default=None, metavar="KEY=VALUE[,KEY=VALUE]",
                        help="sweep only the configs with these values (e.g. FLAT=True)")
    parser.add_argument("--no-fused-sweep", action="store_true",
                        help="--sweep: leave out the fc1 + SwiGLU kernel's configs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", default=None, metavar="JSON",
                        help='fprop/dgrad launch configs timed beside the default, interleaved: '
                             '{"name": {config changes}, ...} (records triton_NAME_ms, '
                             'triton_NAME_x, bitwise_equal_NAME)')
    parser.add_argument("--config-override", default=None, metavar="JSON",
                        help="changes to the default fprop/dgrad launch config (not --sweep; "
                             "the wgrad GEMMs keep theirs)")
    parser.add_argument("--fused-config", default=None, metavar="JSON",
                        help="changes to the fc1 + SwiGLU kernel's default launch config "
                             "(large_config('fc1_swiglu'); not --sweep), e.g. "
                             '\'{"FLAT": true}\'')
    parser.add_argument("--fused-variants", default=None, metavar="JSON",
                        help='fc1 + SwiGLU kernel configs timed beside the default, '
                             'interleaved: {"name": {config changes}, ...} (records '
                             'fused_NAME_ms, fused_NAME_vs_triton_swiglu)')
    parser.add_argument("--dswiglu-variants", default=None, metavar="JSON",
                        help="--gemms fc2_dswiglu: launch configs of the fused kernel timed "
                             'beside its default: {"name": {config changes}, ...}')
    parser.add_argument("--loops", action="store_true",
                        help="first record the loop structure of the compiled kernel of each "
                             "variant (scf.for count and nesting in the TTGIR, warp-"
                             "specialized partitions, shared memory)")
    parser.add_argument("--gluon", default=None, metavar="JSON",
                        help='time the warp-specialized Gluon fprop/dgrad '
                             '(kernels/grouped_gemm_gluon.py) beside the others, interleaved: '
                             '{"gluon": {}, "gluon_NAME": {config changes}, ...} (names start '
                             'with "gluon"; records NAME_ms, NAME_x, NAME_vs_triton, '
                             'bitwise_equal_NAME); fc1 then leaves out the SwiGLU / fused calls')
    parser.add_argument("--gluon-fc1", default=None, metavar="JSON",
                        help='time the Gluon fc1 + SwiGLU kernel (kernels/fc1_swiglu_gluon.py) '
                             'in fc1\'s rounds: {"gfc1": {}, "gfc1_NAME": {config changes}} '
                             '(names start with "gfc1"; records NAME_ms, '
                             'NAME_vs_triton_swiglu, NAME_h_equal_triton, NAME_a_equal)')
    parser.add_argument("--out", default=None, help="append JSON lines here")
    parser.add_argument("--summarize", metavar="FILE", default=None)
    args = parser.parse_args(argv)
    shapes = check_list(parser, "--shapes", args.shapes, ALL_SHAPES)
    gemms = check_list(parser, "--gemms", args.gemms, GEMMS + EXTRA_GEMMS)
    check_min(parser, "--reps", args.reps, 20)
    check_min(parser, "--sweep-reps", args.sweep_reps, 5)
    check_min(parser, "--warmup", args.warmup, 0)
    check_file(parser, "--summarize", args.summarize)
    args.variants = _json_arg(parser, "--variants", args.variants, nested=True)
    override = _json_arg(parser, "--config-override", args.config_override)
    _check_configs(parser, override, args.variants)
    fused_override = _json_arg(parser, "--fused-config", args.fused_config)
    _check_fused_config(parser, fused_override)
    args.fused_variants = _json_arg(parser, "--fused-variants", args.fused_variants,
                                    nested=True)
    for name, change in args.fused_variants.items():
        _check_fused_config(parser, {**fused_override, **change}, f"--fused-variants {name!r}")
    args.dswiglu_variants = _json_arg(parser, "--dswiglu-variants", args.dswiglu_variants,
                                      nested=True)
    _check_dswiglu_variants(parser, args.dswiglu_variants)
    _check_sweep_filter(parser, args.sweep_filter)
    args.gluon = _json_arg(parser, "--gluon", args.gluon, nested=True) or None
    for name in args.gluon or {}:
        if not name.startswith("gluon"):
            parser.error(f"--gluon names must start with 'gluon', got {name!r}")
    args.gluon_fc1 = _json_arg(parser, "--gluon-fc1", args.gluon_fc1, nested=True) or None
    for name, change in (args.gluon_fc1 or {}).items():
        if not name.startswith("gfc1"):
            parser.error(f"--gluon-fc1 names must start with 'gfc1', got {name!r}")
        from te_ops.gemm import fc1_swiglu_gluon as fg
        try:
            fg._resolve(change)
        except ValueError as exc:
            parser.error(f"--gluon-fc1 {name!r}: {exc}")
    if args.gluon_fc1 and args.gluon:
        parser.error("--gluon-fc1 needs fc1's SwiGLU calls, which --gluon leaves out: give "
                     "one of them")
    if args.gluon and "fc2_dswiglu" in gemms:
        _check_gluon_dswiglu(parser, args.gluon)
    for flag, given, gemm in (("--gluon-fc1", args.gluon_fc1, "fc1"),
                              ("--fused-config", fused_override, "fc1"),
                              ("--fused-variants", args.fused_variants, "fc1"),
                              ("--dswiglu-variants", args.dswiglu_variants, "fc2_dswiglu")):
        if given and gemm not in gemms:
            parser.error(f"{flag} applies to --gemms {gemm} only, got --gemms {args.gemms!r}")
    for flag, given in (("--config-override", override), ("--fused-config", fused_override)):
        if args.sweep and given:
            parser.error(f"{flag} has no effect with --sweep (the sweep's fastest config is "
                         f"timed instead), got {flag} {json.dumps(given)} with --sweep")
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    if not torch.cuda.is_available():
        parser.error("measuring needs CUDA (torch.cuda.is_available() is False); "
                     "--summarize FILE works without it")
    with recorded_run(args.out, summarize) as out:
        out.write({"bench": BENCH + "_machine", **machine_info(torch.device("cuda"))})
        if args.loops:
            for name, change in {"default": {}, **args.variants}.items():
                for kind in ("fprop", "dgrad"):
                    out.write({"bench": BENCH + "_loops", "variant": name, "kind": kind,
                               **loop_report(kind, {**override, **change})})
        for shape, gemm in itertools.product(shapes, gemms):
            if gemm == "fc2_dswiglu":
                out.write(compare_dswiglu(shape, args))
                torch.cuda.empty_cache()
                continue
            # the override and the variants are fprop / dgrad configs: wgrad keeps its own
            cfg = None if gemm in WGRADS else override or None
            fused_cfg = fused_override or None
            if args.sweep:
                cfg, fused_cfg = sweep(shape, gemm, args, out)
            out.write(compare(shape, gemm, args, cfg, fused_cfg))
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
