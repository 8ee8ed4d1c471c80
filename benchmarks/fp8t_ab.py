"""Same-process A/B of the FP8 quantize settings per shape (H200): E32's regression and E8.

Usage::

    PYTHONPATH=. python benchmarks/fp8t_ab.py --out results.jsonl [--parts kernels,steps]

On the operands of E8 T16384 H4096 FF14336 and E32 T32768 H7168 FF2048 (``--shapes``):

* ``kernels``: the weights' row-wise + column-amax kernel (``fp8_rows_column_amax``, forward)
  on W1 / W2 under ``ROWS_VARIANTS`` (bytes, scales and column amax checked against variant 0);
  pass 2 of the column-wise copies written without a row-wise copy (W1 / W2 from the given
  amax, fc2's input ``a`` split) with and without the 512-row tiles (``COLS_CONFIG
  ["COLS_ONLY"]``; bytes checked); the SwiGLU -> FP8 row-wise kernel (``fp8_swiglu``) against
  the SwiGLU kernel + row-wise kernel (bytes checked). Kernel times from ``torch.profiler``.
* ``steps``: te_ops fused forward + backward (``benchmarks/grouped_mlp.py``'s block and
  routing) in bf16, FP8 and FP8 fast-accum under each of ``SETS`` (module settings of
  ``fp8_triton`` / ``fp8_swiglu``), ``--rounds`` interleaved rounds (set after set), median of
  ``--iters`` steps each; every FP8 set's output and gradients are checked bitwise equal to
  set 0's.
* ``profile``: one FP8 fast-accum step per shape under ``--profile-set``, kernel table and
  every launch (``benchmarks/profile_recipe.py --calls``'s listing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    append_jsonl,
    check_device,
    check_list,
    check_min,
    time_steps,
)
from fp8_cols_tiles import split_prep, weight_cols_args  # noqa: E402
from fp8_pass_variants import kernel_ms as _kernel_ms  # noqa: E402
from fp8_pass_variants import same  # noqa: E402
from grouped_mlp import QUICK_SHAPES, RECIPES, SHAPES, TeOps, make_problem  # noqa: E402
from profile_recipe import print_calls  # noqa: E402

from te_ops.kernels import swiglu_triton  # noqa: E402
from te_ops.quantization import fp8_swiglu, fp8_triton  # noqa: E402

MAIN_ROWS = ((8192, 64, 2), (32768, 32, 1))
ALL_SHAPES = {**SHAPES, **QUICK_SHAPES}  # quick shapes: a CPU dry run (TRITON_INTERPRET=1)
DEVICE = torch.device("cuda")
#: ``fp8_triton.ROWS_COLAMAX_SETTINGS`` variants (largest BLOCK_K, rows per program, rows per
#: tile[, warps]); variant 0 is main's.
ROWS_VARIANTS: list[tuple[tuple[int, ...], ...]] = [
    MAIN_ROWS,
    ((32768, 32, 1),),  # stop 8's
    ((4096, 64, 2), (32768, 32, 1)),
    ((4096, 64, 2), (8192, 64, 1), (32768, 32, 1)),
    ((8192, 64, 2, 16), (32768, 32, 1)),
    ((8192, 64, 2), (32768, 64, 1, 16)),
    ((8192, 64, 2), (32768, 16, 1, 16)),
]
NO_COLS_ONLY = 1 << 40  # COLS_ONLY_MIN_ROWS that no operand reaches

#: Step-level settings sets: module attributes set before the steps (set 0: main's).
SETS: dict[str, dict] = {
    "main": {},
    "rows_stop8": {"rows": ((32768, 32, 1),)},
    "rows_k4096": {"rows": ((4096, 64, 2), (32768, 32, 1))},
    "cols128": {"cols_only_min_rows": NO_COLS_ONLY},
    "swiglu_fp8": {"swiglu_fp8": True},
    "k4096_swiglu_fp8": {"rows": ((4096, 64, 2), (32768, 32, 1)), "swiglu_fp8": True},
    # this branch's defaults
    "fp8t": {"rows": fp8_triton.ROWS_COLAMAX_SETTINGS, "swiglu_fp8": True},
}


@contextlib.contextmanager
def settings(rows=MAIN_ROWS, cols_only_min_rows: int = 0, swiglu_fp8: bool = False):
    """Module settings for the block; restored after."""
    saved = (fp8_triton.ROWS_COLAMAX_SETTINGS, dict(fp8_triton.COLS_CONFIG), fp8_swiglu.ENABLED)
    fp8_triton.ROWS_COLAMAX_SETTINGS = rows
    fp8_triton.COLS_CONFIG["COLS_ONLY_MIN_ROWS"] = cols_only_min_rows
    fp8_swiglu.ENABLED = swiglu_fp8
    try:
        yield
    finally:
        fp8_triton.ROWS_COLAMAX_SETTINGS = saved[0]
        fp8_triton.COLS_CONFIG.clear()
        fp8_triton.COLS_CONFIG.update(saved[1])
        fp8_swiglu.ENABLED = saved[2]


def kernel_ms(fn, names: tuple[str, ...], iters: int) -> float:
    """``fp8_pass_variants.kernel_ms`` on CUDA; on the CPU (dry run) one call, 0 ms."""
    if DEVICE.type != "cuda":
        fn()
        return 0.0
    return _kernel_ms(fn, names, iters)


def _eq(a: tuple, b: tuple) -> bool:
    return same(tuple(a), tuple(b))


def rows_part(shape: str, ws: dict[str, torch.Tensor], iters: int) -> list[dict]:
    lines = []
    refs: dict[str, tuple] = {}
    for i, rows in enumerate(ROWS_VARIANTS):
        rec: dict = {"bench": "fp8t_rows_colamax", "shape": shape, "variant": i,
                     "settings": [list(t) for t in rows], "check": "ok"}
        with settings(rows=rows):
            for op, w in ws.items():
                g, n, k = w.shape
                rec[f"{op}_setting"] = list(fp8_triton._rows_colamax_setting(k)) + [
                    fp8_triton.rows_colamax_per_prog(n, k)]
                res = fp8_triton.fp8_rows_column_amax(w)
                if i == 0:
                    refs[op] = tuple(r.clone() for r in res)
                elif not _eq(res, refs[op]):
                    rec["check"] = f"{op} differs from variant 0"
                del res
                ms = kernel_ms(lambda w=w: fp8_triton.fp8_rows_column_amax(w),
                               ("_fp8_rows_colamax_kernel",), iters)
                rec[f"{op}_ms"] = round(ms, 4)
                rec[f"{op}_TBps"] = round(w.numel() * 3 / max(ms, 1e-9) / 1e9, 2)
        print(json.dumps(rec), flush=True)
        lines.append(rec)
    return lines


def cols_part(shape: str, ws: dict[str, torch.Tensor], a: torch.Tensor, sizes: torch.Tensor,
              iters: int) -> list[dict]:
    """Pass 2 without a row-wise copy: weights from the given amax, ``a`` split (both
    passes; pass 2 timed)."""
    prep = split_prep(a, sizes)
    amaxes = {op: fp8_triton.fp8_rows_column_amax(w)[2] for op, w in ws.items()}

    def run(op):
        if op == "a":
            splits, layout = prep
            g = splits.num_groups
            out = torch.empty(a.shape[1], layout.capacity, dtype=torch.float8_e4m3fn,
                              device=a.device)
            return out, fp8_triton.launch_cols(a, out, splits.base_offsets[:g],
                                               splits.split_sizes, layout.starts,
                                               layout.capacity, 16, 0, layout.capacity, False)
        out, args = weight_cols_args(ws[op])
        return out, fp8_triton.launch_cols(*args, amax=amaxes[op])

    lines = []
    refs: dict[str, tuple] = {}
    for i, (name, min_rows) in enumerate((("cols_only_512", 0), ("no_cols_only", NO_COLS_ONLY))):
        rec: dict = {"bench": "fp8t_cols_pass2", "shape": shape, "variant": name,
                     "check": "ok"}
        with settings(cols_only_min_rows=min_rows):
            for op in ("W1", "W2", "a"):
                res = run(op)
                if i == 0:
                    refs[op] = tuple(r.clone() for r in res)
                elif not _eq(res, refs[op]):
                    rec["check"] = f"{op} differs"
                del res
                rec[f"{op}_quant_ms"] = round(kernel_ms(lambda op=op: run(op),
                                                        ("_fp8_cols_quant_kernel",), iters), 4)
        print(json.dumps(rec), flush=True)
        lines.append(rec)
    return lines


def swiglu_part(shape: str, h: torch.Tensor, probs: torch.Tensor, iters: int) -> dict:
    rec: dict = {"bench": "fp8t_swiglu_fp8", "shape": shape, "h": list(h.shape)}
    # the eager calls' launches (what swiglu_fp8_rows / fp8_rows / swiglu_forward run)
    def fused():
        return fp8_swiglu.launch(h, probs)

    def two():
        return fp8_triton.launch_rows(swiglu_triton._forward(h, probs,
                                                             swiglu_triton._fwd_kernel))

    rec["check"] = "ok" if _eq(fused(), two()) else "bytes differ"
    rec["fused_ms"] = round(kernel_ms(fused, ("_swiglu_fp8_rows_kernel",), iters), 4)
    rec["two_kernels_ms"] = round(kernel_ms(two, ("_fwd_kernel", "_fp8_rows_kernel"), iters),
                                  4)
    print(json.dumps(rec), flush=True)
    return rec


def kernels(shape: str, iters: int) -> list[dict]:
    p = make_problem(shape, ALL_SHAPES[shape], DEVICE, torch.bfloat16, 0)
    w1, w2 = (w.detach() for w in p.weights())
    ws = {"W1": w1, "W2": w2}
    lines = rows_part(shape, ws, iters)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    a = torch.randn(p.tokens, p.ffn, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    lines += cols_part(shape, ws, a, torch.as_tensor(p.split, device=DEVICE), iters)
    del a
    h = torch.randn(p.tokens, 2 * p.ffn, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    lines.append(swiglu_part(shape, h, p.probs.detach(), iters))
    return lines


def _peer(problem, recipe: str):
    cls = type("AB_" + recipe, (TeOps,), {"recipe": RECIPES[recipe],
                                          "name": f"te_ops_fused+{recipe}"})
    return cls(problem)


def steps(shape: str, sets: list[str], rounds: int, iters: int, warmup: int) -> list[dict]:
    problem = make_problem(shape, ALL_SHAPES[shape], DEVICE, torch.bfloat16, 0)
    x, probs, dy = problem.x, problem.probs, problem.dy
    peers = {r: _peer(problem, r) for r in ("none", "fp8", "fp8fast")}
    times: dict[tuple[str, str], list[float]] = {}
    refs: dict[str, list[torch.Tensor]] = {}
    checks: dict[tuple[str, str], str] = {}
    for round_ in range(rounds):
        for set_name in sets:
            with settings(**SETS[set_name]):
                for recipe, peer in peers.items():
                    if recipe == "none" and set_name != sets[0]:
                        continue  # bf16 does not read these settings: once per round
                    params = peer.parameters()

                    def zero(params=params):
                        x.grad = probs.grad = None
                        for q in params:
                            q.grad = None

                    def step(peer=peer):
                        peer.forward(x, probs).backward(dy)

                    ts = time_steps(step, problem.device, warmup=warmup, iters=iters,
                                    before=zero)
                    times.setdefault((set_name, recipe), []).append(statistics.median(ts))
                    if round_ == 0 and recipe != "none":
                        zero()
                        y = peer.forward(x, probs)
                        y.backward(dy)
                        got = [y.detach(), x.grad, probs.grad] + [q.grad for q in params]
                        if set_name == sets[0]:
                            refs[recipe] = [t.clone() for t in got]
                        else:
                            checks[(set_name, recipe)] = (
                                "ok" if all(torch.equal(a, b) for a, b in
                                            zip(got, refs[recipe])) else "differs from set 0")
                        del got, y
                        zero()
    lines = []
    bf16 = statistics.median(times[(sets[0], "none")])
    for (set_name, recipe), ts in times.items():
        med = statistics.median(ts)
        rec = {"bench": "fp8t_steps", "shape": shape, "set": set_name,
               "settings": {k: v for k, v in SETS[set_name].items()}, "recipe": recipe,
               "ms_rounds": [round(t, 3) for t in ts], "ms_median": round(med, 3),
               "x_bf16": round(bf16 / med, 4), "iters": iters, "rounds": rounds,
               "check": checks.get((set_name, recipe), "reference" if recipe != "none"
                                   else "-")}
        print(json.dumps(rec), flush=True)
        lines.append(rec)
    del peers, problem
    return lines


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def profile(shape: str, set_name: str) -> None:
    problem = make_problem(shape, ALL_SHAPES[shape], DEVICE, torch.bfloat16, 0)
    peer = _peer(problem, "fp8fast")
    x, probs, dy = problem.x, problem.probs, problem.dy
    params = peer.parameters()

    def step():
        x.grad = probs.grad = None
        for q in params:
            q.grad = None
        peer.forward(x, probs).backward(dy)

    with settings(**SETS[set_name]):
        for _ in range(3):
            step()
        _sync()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            _sync()
    print(f"# profile {shape} fp8fast set {set_name}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                    max_name_column_width=60))
    print_calls(prof)


def _compiled(obj, depth: int = 0):
    """CompiledKernel-like objects (with ``n_spills``) inside a JIT function's caches."""
    if hasattr(obj, "n_spills"):
        yield obj
    elif depth < 4 and isinstance(obj, dict):
        for v in obj.values():
            yield from _compiled(v, depth + 1)
    elif depth < 4 and isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _compiled(v, depth + 1)


def print_registers() -> None:
    """Registers and spills of every compiled variant of the kernels this script runs."""
    for fn in (fp8_triton._fp8_rows_colamax_kernel, fp8_triton._fp8_cols_quant_kernel,
               fp8_swiglu._swiglu_fp8_rows_kernel):
        for attr in ("device_caches", "cache"):
            for k in _compiled(getattr(fn, attr, {})):
                consts = getattr(getattr(k, "src", None), "constants", None)
                rec = {"bench": "fp8t_registers", "kernel": getattr(k, "name", "?"),
                       "n_regs": k.n_regs, "n_spills": k.n_spills,
                       "num_warps": getattr(k.metadata, "num_warps", None),
                       "constants": {str(a): v for a, v in (consts or {}).items()
                                     if isinstance(v, (int, bool))}}
                print(json.dumps(rec), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="E8_T16384_H4096_FF14336,E32_T32768_H7168_FF2048")
    parser.add_argument("--parts", default="kernels,steps,profile")
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--profile-set", default="fp8t")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script")
    parser.add_argument("--out", default=None, help="append JSON lines to this file")
    args = parser.parse_args(argv)
    check_device(parser, "--device", args.device)
    check_list(parser, "--shapes", args.shapes, ALL_SHAPES)
    check_list(parser, "--parts", args.parts, ("kernels", "steps", "profile"))
    check_list(parser, "--sets", args.sets, SETS)
    check_list(parser, "--profile-set", args.profile_set, SETS)
    for flag, minimum in (("--iters", 1), ("--warmup", 0), ("--rounds", 1)):
        check_min(parser, flag, getattr(args, flag[2:]), minimum)
    global DEVICE
    DEVICE = torch.device(args.device)
    parts = args.parts.split(",")
    failed = 0
    for shape in args.shapes.split(","):
        for part in ("steps", "kernels", "profile"):
            if part not in parts or (part == "profile" and DEVICE.type != "cuda"):
                continue
            try:  # one part failing must not cost the others (one device session)
                if part == "kernels":
                    append_jsonl(args.out, kernels(shape, args.iters))
                elif part == "steps":
                    append_jsonl(args.out, steps(shape, args.sets.split(","), args.rounds,
                                                 args.iters, args.warmup))
                else:
                    profile(shape, args.profile_set)
            except Exception:  # noqa: BLE001
                failed += 1
                traceback.print_exc()
            if DEVICE.type == "cuda":
                torch.cuda.empty_cache()
    if DEVICE.type == "cuda":
        try:
            print_registers()
        except Exception:  # noqa: BLE001 - Triton's cache layout differs by version
            traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
