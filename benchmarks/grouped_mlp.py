"""Speed and memory of an MoE expert MLP, fc1 -> ScaledSwiGLU -> fc2, forward + backward.

Peers, run one after another in this process on the same problem (same weights, inputs,
skewed routing):

``torch_grouped_mm``
    plain PyTorch autograd through ``torch._grouped_mm`` with device offsets and a SwiGLU
    written in torch ops; the baseline of ``ratio_vs_grouped_mm``.
``torch_loop``
    plain PyTorch: one ``F.linear`` per expert with host split sizes.
``te_ops_unfused`` / ``te_ops_fused``
    ``te_ops.Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear)`` with device split sizes,
    ``TE_OPS_FUSION=0`` / ``1``.
``te_ops_fused_graph``
    the fused block captured by ``te_ops.graphs.make_graphed_callable`` (CUDA only).
``te_ops_fused_recompute`` / ``te_ops_fused_single_recompute`` /
``te_ops_fused_single_graph_noclone_recompute`` (not in the default list)
    the same te_ops peers with ``ScaledSwiGLU(recompute_input=True)``: h is not saved, the
    backward re-runs fc1's GEMM (one more GEMM; the FLOP count stays the one of the step).
``te_ops_compiled`` / ``torch_grouped_mm_compiled``
    ``te_ops_fused`` / ``torch_grouped_mm`` through ``torch.compile(fullgraph=True)`` (default
    mode, inductor); the first warm-up step compiles (not timed; keep ``--warmup`` >= 2 so the
    timed steps run the compiled forward and backward).

``--recipe none,fp8,mxfp8`` runs every ``te_ops_*`` peer once per recipe: ``none`` in bf16 (the
names above), ``fp8`` under ``te_ops.autocast(recipe=Float8CurrentScaling())`` (names get
``+fp8``; ``fp8fast``: with ``fast_accumulate_backward=True``), ``mxfp8`` under
``MXFP8BlockScaling`` (``+mxfp8``); such records also hold
``ratio_vs_bf16``, the same peer's bf16 time over its time with the recipe.

Each record (one JSON line, to stdout and appended to ``--out``) holds the median time of
``--iters`` timed forward+backward steps after ``--warmup`` (CUDA events around each step;
gradients are set to ``None`` before each step, untimed), TFLOP/s counted the same way for
every peer (forward = 2·T·H·2FF + 2·T·FF·H, forward+backward = 3 × forward), the peak memory of
one step minus the parameter bytes (``max_memory_allocated`` after a reset; inputs, gradients,
activations, workspaces and a CUDA graph's pool count), the ratio of the
``torch_grouped_mm`` time to the peer's time (> 1: faster than the baseline) and the largest
output difference from the baseline (bf16 rounding and the fp32 SwiGLU of te_ops differ).

Routing: each token goes to one expert drawn from a Zipf(1.2)-skewed popularity over a random
permutation of the experts (fixed seed); tokens are already sorted by expert, probs ~ U(0, 1).

Usage::

    python benchmarks/grouped_mlp.py [--shapes E8_T16384_H4096_FF14336,...] [--out FILE]
    python benchmarks/grouped_mlp.py --quick --device cpu        # tiny CPU smoke run
    python benchmarks/grouped_mlp.py --device cpu --interleaved  # the CPU shape, fp32
    python benchmarks/grouped_mlp.py --device cpu --interleaved --threads 1 \
        --shapes E64_T256_H64_FF32                               # host overhead (E64 decode)
    python benchmarks/grouped_mlp.py --summarize FILE            # table of a JSON-lines file
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    JsonLines,
    env_override,
    free_memory,
    machine_info,
    peak_memory_mib,
    recorded_run,
    summarize_times,
    time_steps,
)

import te_ops  # noqa: E402

SHAPES: dict[str, tuple[int, int, int, int]] = {
    "E8_T16384_H4096_FF14336": (8, 16384, 4096, 14336),
    "E128_T65536_H2048_FF768": (128, 65536, 2048, 768),
    "E32_T32768_H7168_FF2048": (32, 32768, 7168, 2048),
    "E64_T256_H2048_FF768": (64, 256, 2048, 768),
}
#: The CPU shape (run by default with ``--device cpu``): a Mixtral-like block scaled down,
#: 2048 tokens routed top-2 (4096 rows), fp32.
CPU_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "E8_T4096_H256_FF512": (8, 4096, 256, 512),
}
#: Host-bound shapes (``--shapes E64_T256_H64_FF32 --device cpu``): the E64 T256 decode
#: shape's expert and token counts with tiny hidden sizes, so the step time is te_ops' and
#: autograd's host work (Python, dispatch, one AccumulateGrad per parameter), not math.
HOST_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "E64_T256_H64_FF32": (64, 256, 64, 32),
    # The CPU shape's expert and row counts with (almost) no math: its host work.
    "E8_T4096_H8_FF8": (8, 4096, 8, 8),
    # 128 experts (the issue-10 shapes' count; 256 per-expert weight Parameters) with tiny
    # hidden sizes: the per-parameter host work (autograd edges, AccumulateGrad, grad views).
    "E128_T1024_H64_FF32": (128, 1024, 64, 32),
}
#: Fewer rows per expert than the large shapes (``--shapes``, not run by default): where the
#: persistent Triton kernels' rules apply below the issue-10 shapes (64-256 rows per expert:
#: fprop / dgrad and wgrad in Triton; ``large_gemm_triton.py``'s ``MID_SHAPES``).
MID_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "E128_T8192_H2048_FF768": (128, 8192, 2048, 768),      # 64 rows per expert
    "E128_T16384_H2048_FF768": (128, 16384, 2048, 768),    # 128
    "E64_T16384_H7168_FF2048": (64, 16384, 7168, 2048),    # 256
}
QUICK_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "E4_T256_H64_FF64": (4, 256, 64, 64),
    "E16_T128_H32_FF48": (16, 128, 32, 48),
}
PEERS = ["torch_grouped_mm", "torch_loop", "te_ops_unfused", "te_ops_fused",
         "te_ops_fused_graph", "te_ops_fused_single", "te_ops_fused_single_graph",
         "te_ops_fused_single_graph_noclone", "te_ops_compiled", "torch_grouped_mm_compiled"]
#: Peers run only when named in ``--peers`` (the opt-in fc1 recompute; the Gluon wgrad off;
#: fc1's SwiGLU epilogue off).
EXTRA_PEERS = ["te_ops_fused_recompute", "te_ops_fused_single_recompute",
               "te_ops_fused_single_graph_noclone_recompute", "te_ops_fused_nogluon",
               "te_ops_fused_single_nogluon", "te_ops_fused_single_nofc1epi"]
BASELINE = "torch_grouped_mm"
RECIPES = {"none": None, "fp8": te_ops.recipe.Float8CurrentScaling(),
           "fp8fast": te_ops.recipe.Float8CurrentScaling(fast_accumulate_backward=True),
           "mxfp8": te_ops.recipe.MXFP8BlockScaling()}


# ------------------------------------------------------------------------------ the problem
@dataclass
class Problem:
    """One shape's inputs, shared by every peer."""

    name: str
    experts: int
    tokens: int
    hidden: int
    ffn: int
    device: torch.device
    dtype: torch.dtype
    seed: int
    sizes: list[int]
    split: torch.Tensor  # (E,) int64 on the device
    offsets: torch.Tensor  # (E,) int32 cumulative ends on the device
    x: torch.Tensor  # (T, H) leaf, requires grad
    probs: torch.Tensor  # (T,) fp32 leaf, requires grad
    dy: torch.Tensor  # (T, H)

    @property
    def flops(self) -> float:
        """Forward + backward FLOPs: 3 x (2·T·H·2FF + 2·T·FF·H)."""
        t, h, f = self.tokens, self.hidden, self.ffn
        return 3.0 * (2 * t * h * 2 * f + 2 * t * f * h)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fc1 (E, 2FF, H) and fc2 (E, H, FF) weights, regenerated identically on each call."""
        gen = torch.Generator(device=self.device).manual_seed(self.seed + 1)
        e, h, f = self.experts, self.hidden, self.ffn
        kw = {"generator": gen, "device": self.device, "dtype": self.dtype}
        w1 = torch.randn(e, 2 * f, h, **kw).mul_(h ** -0.5)
        w2 = torch.randn(e, h, f, **kw).mul_(f ** -0.5)
        return w1, w2


def skewed_sizes(experts: int, tokens: int, seed: int, alpha: float = 1.2) -> list[int]:
    """Tokens per expert under a Zipf(alpha) popularity over a random expert order."""
    gen = torch.Generator().manual_seed(seed)
    popularity = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** alpha
    popularity = popularity[torch.randperm(experts, generator=gen)]
    picks = torch.multinomial(popularity, tokens, replacement=True, generator=gen)
    return torch.bincount(picks, minlength=experts).tolist()


def make_problem(name: str, shape: tuple[int, int, int, int], device: torch.device,
                 dtype: torch.dtype, seed: int) -> Problem:
    experts, tokens, hidden, ffn = shape
    sizes = skewed_sizes(experts, tokens, seed)
    split = torch.tensor(sizes, dtype=torch.int64, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device=device, dtype=dtype).requires_grad_()
    probs = torch.rand(tokens, generator=gen, device=device).requires_grad_()
    dy = torch.randn(tokens, hidden, generator=gen, device=device, dtype=dtype)
    return Problem(name, experts, tokens, hidden, ffn, device, dtype, seed, sizes, split,
                   torch.cumsum(split, 0).to(torch.int32), x, probs, dy)


# -------------------------------------------------------------------------------- the peers
def torch_swiglu(h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """SiLU(first half) * second half * probs, in plain torch ops (input dtype)."""
    a, b = h.chunk(2, dim=-1)
    return F.silu(a) * b * probs.unsqueeze(-1).to(h.dtype)


class Peer:
    """A way to run the block: ``forward(x, probs)`` and its parameters."""

    name = ""
    env: dict[str, str | None] = {}
    recipe = None  # a te_ops recipe (te_ops peers only)

    def __init__(self, problem: Problem) -> None:
        self.problem = problem

    def autocast(self):
        """The recipe's ``te_ops.autocast`` context (disabled without a recipe)."""
        return te_ops.autocast(enabled=self.recipe is not None, recipe=self.recipe)

    def parameters(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class TorchGroupedMM(Peer):
    name = "torch_grouped_mm"

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem)
        w1, w2 = problem.weights()
        self.w1 = torch.nn.Parameter(w1)
        self.w2 = torch.nn.Parameter(w2)

    def parameters(self) -> list[torch.Tensor]:
        return [self.w1, self.w2]

    def forward(self, x, probs):
        offs = self.problem.offsets
        h = torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(torch_swiglu(h, probs), self.w2.transpose(-2, -1), offs=offs)


class TorchLoop(Peer):
    name = "torch_loop"

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem)
        w1, w2 = problem.weights()
        self.w1 = [torch.nn.Parameter(w.clone()) for w in w1.unbind(0)]
        self.w2 = [torch.nn.Parameter(w.clone()) for w in w2.unbind(0)]

    def parameters(self) -> list[torch.Tensor]:
        return self.w1 + self.w2

    def forward(self, x, probs):
        sizes = self.problem.sizes
        h = torch.cat([F.linear(xe, w) for xe, w in zip(x.split(sizes), self.w1)])
        g = torch_swiglu(h, probs)
        return torch.cat([F.linear(ge, w) for ge, w in zip(g.split(sizes), self.w2)])


class TeOps(Peer):
    name = "te_ops_fused"
    env = {"TE_OPS_FUSION": "1"}
    single = False  # GroupedLinear(single_grouped_weight=...)
    recompute = False  # ScaledSwiGLU(recompute_input=...)

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem)
        p = problem
        kw = {"bias": False, "single_grouped_weight": self.single, "device": p.device,
              "dtype": p.dtype}
        with env_override(**self.env):
            self.block = te_ops.Sequential(
                te_ops.GroupedLinear(p.experts, p.hidden, 2 * p.ffn, **kw),
                te_ops.ScaledSwiGLU(recompute_input=self.recompute),
                te_ops.GroupedLinear(p.experts, p.ffn, p.hidden, **kw),
            )
        w1, w2 = problem.weights()
        with torch.no_grad():
            for fc, w in ((self.block[0], w1), (self.block[2], w2)):
                params = fc.weights()
                for e, param in enumerate(params):
                    param.copy_(w if self.single else w[e])

    def parameters(self) -> list[torch.Tensor]:
        return list(self.block.parameters())

    def forward(self, x, probs):
        split = self.problem.split
        with self.autocast():
            return self.block(x, split, probs, split)


class TeOpsUnfused(TeOps):
    name = "te_ops_unfused"
    env = {"TE_OPS_FUSION": "0"}


class TeOpsFusedGraph(TeOps):
    name = "te_ops_fused_graph"
    env = {"TE_OPS_FUSION": "1"}
    clone_param_grads = True  # .grad is reset to None every iteration here, so False is safe

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem)
        from te_ops.graphs import make_graphed_callable

        p = problem
        with env_override(**self.env), self.autocast():
            self.graphed = make_graphed_callable(self.block, (p.x, p.split, p.probs, p.split),
                                                 clone_param_grads=self.clone_param_grads)

    def forward(self, x, probs):
        split = self.problem.split
        return self.graphed(x, split, probs, split)


class TeOpsFusedSingle(TeOps):
    name = "te_ops_fused_single"
    single = True


class TeOpsFusedSingleGraph(TeOpsFusedGraph):
    name = "te_ops_fused_single_graph"
    single = True


class TeOpsFusedSingleGraphNoClone(TeOpsFusedSingleGraph):
    name = "te_ops_fused_single_graph_noclone"
    clone_param_grads = False


class TeOpsFusedRecompute(TeOps):
    name = "te_ops_fused_recompute"
    recompute = True


class TeOpsFusedSingleRecompute(TeOpsFusedSingle):
    name = "te_ops_fused_single_recompute"
    recompute = True


class TeOpsFusedNoGluon(TeOps):
    """te_ops fused with the Gluon wgrad off (``TE_OPS_GLUON_WGRAD=0``): its A/B peer."""
    name = "te_ops_fused_nogluon"
    env = {"TE_OPS_FUSION": "1", "TE_OPS_GLUON_WGRAD": "0"}


class TeOpsFusedSingleNoGluon(TeOpsFusedSingle):
    name = "te_ops_fused_single_nogluon"
    env = {"TE_OPS_FUSION": "1", "TE_OPS_GLUON_WGRAD": "0"}


class TeOpsFusedSingleNoFc1Epilogue(TeOpsFusedSingle):
    """te_ops fused (single weight) with fc1's SwiGLU epilogue off
    (``TE_OPS_FC1_SWIGLU_EPILOGUE=0``: fc1's fprop then the SwiGLU pass): the A/B peer of the
    Gluon fc1 + SwiGLU kernel."""
    name = "te_ops_fused_single_nofc1epi"
    env = {"TE_OPS_FUSION": "1", "TE_OPS_FC1_SWIGLU_EPILOGUE": "0"}


class TeOpsFusedSingleGraphNoCloneRecompute(TeOpsFusedSingleGraphNoClone):
    name = "te_ops_fused_single_graph_noclone_recompute"
    recompute = True


class TeOpsCompiled(TeOps):
    """The fused te_ops block through ``torch.compile(fullgraph=True)`` (default mode); the
    first warm-up call compiles. ``te_ops.autocast`` stays outside the compiled function
    (Dynamo cannot trace its ContextVar; te_ops reads the recipe as a guarded constant)."""

    name = "te_ops_compiled"

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem)
        self.compiled = torch.compile(self.block, fullgraph=True)

    def forward(self, x, probs):
        split = self.problem.split
        with self.autocast():
            return self.compiled(x, split, probs, split)


class TorchGroupedMMCompiled(TorchGroupedMM):
    """The plain torch block (``torch._grouped_mm``) through ``torch.compile(fullgraph=True)``."""

    name = "torch_grouped_mm_compiled"

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem)
        self.compiled = torch.compile(super().forward, fullgraph=True)

    def forward(self, x, probs):
        return self.compiled(x, probs)


PEER_CLASSES: dict[str, type[Peer]] = {
    cls.name: cls for cls in (TorchGroupedMM, TorchLoop, TeOpsUnfused, TeOps, TeOpsFusedGraph,
                              TeOpsFusedSingle, TeOpsFusedSingleGraph,
                              TeOpsFusedSingleGraphNoClone, TeOpsCompiled,
                              TorchGroupedMMCompiled, TeOpsFusedRecompute,
                              TeOpsFusedSingleRecompute, TeOpsFusedSingleGraphNoCloneRecompute,
                              TeOpsFusedNoGluon, TeOpsFusedSingleNoGluon,
                              TeOpsFusedSingleNoFc1Epilogue)
}


def skip_reason(peer: str, problem: Problem) -> str | None:
    """Why a peer cannot run on this device (``None`` when it can)."""
    if issubclass(PEER_CLASSES[peer], TeOpsFusedGraph) and problem.device.type != "cuda":
        return "CUDA graphs need a CUDA device (running with --device cpu)"
    if (peer == "torch_grouped_mm_compiled" and problem.device.type == "cpu"
            and problem.dtype != torch.bfloat16):
        return (f"torch._grouped_mm's fake kernel takes bfloat16 only on CPU ({problem.dtype} "
                "fails to compile; te_ops_compiled has its own fake)")
    if peer.startswith("torch_grouped_mm") and not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    return None


# ------------------------------------------------------------------------------ measuring
def measure(peer_name: str, problem: Problem, args: argparse.Namespace,
            reference: dict[str, torch.Tensor], recipe: str = "none") -> dict:
    """Build one peer, time it, measure its memory, compare its output; free it."""
    cls = PEER_CLASSES[peer_name]
    if recipe != "none":
        cls = type(cls.__name__ + "_" + recipe, (cls,),
                   {"recipe": RECIPES[recipe], "name": f"{peer_name}+{recipe}"})
    peer = cls(problem)
    try:
        return _measure_peer(peer, problem, args, reference)
    finally:
        problem.x.grad = None
        problem.probs.grad = None
        for p in peer.parameters():
            p.grad = None
        del peer
        free_memory()


def _measure_peer(peer: Peer, problem: Problem, args: argparse.Namespace,
                  reference: dict[str, torch.Tensor]) -> dict:
    params = peer.parameters()
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    x, probs, dy = problem.x, problem.probs, problem.dy

    def zero_grads() -> None:
        x.grad = None
        probs.grad = None
        for p in params:
            p.grad = None

    def step() -> None:
        peer.forward(x, probs).backward(dy)

    with env_override(**peer.env):
        times = time_steps(step, problem.device, warmup=args.warmup, iters=args.iters,
                           before=zero_grads)
        peak = peak_memory_mib(step, problem.device, param_bytes, before=zero_grads)
        with torch.no_grad():
            # Kept on the host: a device copy of the baseline's output would stay allocated
            # during the later peers' peak-memory step and count against them.
            out = peer.forward(x, probs).detach().cpu()
    stats = summarize_times(times)
    record: dict = dict(stats)
    record["tflops"] = problem.flops / (stats["ms_median"] * 1e-3) / 1e12
    record["peak_mib"] = peak
    record["param_mib"] = param_bytes / 2**20
    if peer.name == BASELINE:
        reference["out"] = out
        reference["ms"] = stats["ms_median"]
    if "out" in reference:
        ref = reference["out"]
        record["max_abs_diff"] = (out.float() - ref.float()).abs().max().item()
        record["ref_max_abs"] = ref.float().abs().max().item()
    if "ms" in reference:
        record["ratio_vs_grouped_mm"] = reference["ms"] / stats["ms_median"]
    base_name = peer.name.split("+")[0]
    if peer.recipe is None:
        reference[f"ms:{base_name}"] = stats["ms_median"]
    elif f"ms:{base_name}" in reference:
        record["ratio_vs_bf16"] = reference[f"ms:{base_name}"] / stats["ms_median"]
    return record


def measure_interleaved(order: list[str], problem: Problem, args: argparse.Namespace
                        ) -> list[dict]:
    """All peers built at once; timed one step each in turn (A, B, C, A, B, C, ...), so a
    shared host's changing load hits every peer alike. Host clock (for the CPU); on the CPU
    with one intra-op thread also this thread's CPU time (``cpu_ms_*``,
    ``cpu_ratio_vs_grouped_mm``), which other jobs on a loaded host do not inflate."""
    peers = [PEER_CLASSES[name](problem) for name in order]
    x, probs, dy = problem.x, problem.probs, problem.dy
    times: list[list[float]] = [[] for _ in peers]
    # With one intra-op thread on the CPU every op (forward and the autograd engine's backward)
    # runs on this thread, so its CPU time is the step's work without other jobs' share of a
    # loaded host (cache and memory-bandwidth contention still count).
    thread_clock = problem.device.type == "cpu" and torch.get_num_threads() == 1
    cpu_times: list[list[float]] = [[] for _ in peers]
    for i in range(args.warmup + args.iters):
        for peer, ts, cs in zip(peers, times, cpu_times):
            params = peer.parameters()
            with env_override(**peer.env):
                x.grad = probs.grad = None
                for p in params:
                    p.grad = None
                if problem.device.type == "cuda":
                    torch.cuda.synchronize()
                t0, c0 = time.perf_counter(), time.thread_time()
                peer.forward(x, probs).backward(dy)
                if problem.device.type == "cuda":
                    torch.cuda.synchronize()
                if i >= args.warmup:
                    ts.append((time.perf_counter() - t0) * 1e3)
                    cs.append((time.thread_time() - c0) * 1e3)
    records = []
    for name, ts, cs in zip(order, times, cpu_times):
        stats = summarize_times(ts)
        cpu = {}
        if thread_clock:
            cpu = {f"cpu_{k}": v for k, v in summarize_times(cs).items()}
            cpu["cpu_ratio_vs_grouped_mm"] = (
                summarize_times(cpu_times[0])["ms_median"] / cpu["cpu_ms_median"]
                if order[0] == BASELINE else None)
        records.append({"peer": name, "interleaved": True, **stats, **cpu,
                        "tflops": problem.flops / (stats["ms_median"] * 1e-3) / 1e12,
                        "ratio_vs_grouped_mm": (summarize_times(times[0])["ms_median"]
                                                / stats["ms_median"])
                        if order[0] == BASELINE else None})
    x.grad = probs.grad = None
    return records


def run_shape(name: str, shape: tuple[int, int, int, int], peers: list[str],
              args: argparse.Namespace, out: JsonLines, device: torch.device) -> None:
    dtype = getattr(torch, args.dtype)
    problem = make_problem(name, shape, device, dtype, args.seed)
    base = {
        "bench": "grouped_mlp",
        "shape": name,
        "E": shape[0], "T": shape[1], "H": shape[2], "FF": shape[3],
        "dtype": {"bfloat16": "bf16", "float32": "fp32"}[args.dtype],
        "device": device.type,
        "routing": "zipf1.2",
        "max_expert_tokens": max(problem.sizes),
        "empty_experts": sum(1 for s in problem.sizes if s == 0),
        "iters": args.iters,
        "warmup": args.warmup,
    }
    reference: dict[str, torch.Tensor] = {}
    order = [BASELINE] + [p for p in peers if p != BASELINE] if BASELINE in peers else peers
    if args.interleaved:  # bf16/fp32 peers only (no --recipe)
        for peer in order:  # a peer that cannot run is recorded with the reason, as below
            reason = skip_reason(peer, problem)
            if reason is not None:
                out.write({**base, "peer": peer, "interleaved": True, "skipped": reason})
                print(f"# skip {peer} on {name}: {reason}", file=sys.stderr, flush=True)
        order = [p for p in order if skip_reason(p, problem) is None]
        for record in measure_interleaved(order, problem, args):
            out.write({**base, **record})
        return
    runs = [(round_, peer, r) for round_ in range(args.rounds) for peer in order
            for r in args.recipe.split(",") if r == "none" or peer.startswith("te_ops")]
    for round_, peer, recipe in runs:
        label = peer if recipe == "none" else f"{peer}+{recipe}"
        record = {**base, "peer": label, "recipe": recipe, "round": round_}
        reason = skip_reason(peer, problem)
        if reason is not None:
            record["skipped"] = reason
            print(f"# skip {label} on {name}: {reason}", file=sys.stderr, flush=True)
        else:
            try:
                record.update(measure(peer, problem, args, reference, recipe))
            except Exception as exc:  # one peer failing must not stop the others
                record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                traceback.print_exc(file=sys.stderr)
                free_memory()
        out.write(record)
    del problem
    free_memory()


# ------------------------------------------------------------------------------- summary
def _fmt(record: dict, key: str, spec: str) -> str:
    value = record.get(key)
    return "-" if value is None else format(value, spec)


def summarize(path: str) -> str:
    """A fixed-width table of a JSON-lines file written by this script."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                rec = json.loads(line)
                if rec.get("bench") == "grouped_mlp":
                    rows.append(rec)
    header = (f"{'shape':<26} {'peer':<26} {'ms':>9} {'TFLOP/s':>8} {'peak MiB':>9} "
              f"{'x grouped_mm':>12} {'x bf16':>7} {'max|diff|':>10}")
    lines = [header, "-" * len(header)]
    for r in rows:
        if "skipped" in r or "error" in r:
            note = r.get("skipped") or r.get("error")
            lines.append(f"{r['shape']:<26} {r['peer']:<26} {note[:60]}")
            continue

        lines.append(
            f"{r['shape']:<26} {r['peer']:<26} {_fmt(r, 'ms_median', '9.3f'):>9} "
            f"{_fmt(r, 'tflops', '8.1f'):>8} {_fmt(r, 'peak_mib', '9.0f'):>9} "
            f"{_fmt(r, 'ratio_vs_grouped_mm', '12.2f'):>12} "
            f"{_fmt(r, 'ratio_vs_bf16', '7.2f'):>7} "
            f"{_fmt(r, 'max_abs_diff', '10.3g'):>10}"
        )
    return "\n".join(lines + _round_medians(rows))


def _round_medians(rows: list[dict]) -> list[str]:
    """With ``--rounds`` > 1: per shape and peer, the median over rounds of the step median
    and of the per-round ratio to the baseline."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if "ms_median" in r:
            groups.setdefault((r["shape"], r["peer"]), []).append(r)
    if all(len(g) < 2 for g in groups.values()):
        return []
    lines = ["", f"{'shape':<26} {'peer':<20} {'rounds':>6} {'median ms':>10} {'x grouped_mm':>12}"]
    for (shape, peer), g in groups.items():
        ratios = [r["ratio_vs_grouped_mm"] for r in g if "ratio_vs_grouped_mm" in r]
        ratio = f"{statistics.median(ratios):12.3f}" if ratios else f"{'-':>12}"
        lines.append(f"{shape:<26} {peer:<20} {len(g):>6} "
                     f"{statistics.median(r['ms_median'] for r in g):10.3f} {ratio}")
    return lines


# ---------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=None,
                        help="comma-separated shape names (default: all of the chosen set): "
                             + ", ".join([*SHAPES, *CPU_SHAPES, *HOST_SHAPES, *MID_SHAPES,
                                          *QUICK_SHAPES]))
    parser.add_argument("--peers", default=",".join(PEERS),
                        help="comma-separated peers: " + ", ".join(PEERS + EXTRA_PEERS))
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke run)")
    parser.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                        help="bfloat16 (default on cuda) or float32 (default on cpu)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every peer this many times, interleaved (peer A, B, .., "
                             "A, B, ..): on a shared host compare the per-round medians")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (CPU intra-op threads; default: torch's)")
    parser.add_argument("--interleaved", action="store_true",
                        help="build every peer at once and time single steps in turn "
                             "(A, B, C, A, ...): for a shared CPU host; no memory figures")
    parser.add_argument("--iters", type=int, default=20, help="timed steps per peer")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per peer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--recipe", default="none",
                        help="comma-separated recipes for the te_ops peers: "
                             + ", ".join(RECIPES))
    parser.add_argument("--out", default=None, help="also append JSON lines to this file")
    parser.add_argument("--summarize", metavar="FILE", default=None,
                        help="print a table of a JSON-lines file and exit")
    args = parser.parse_args(argv)
    bad = [r for r in args.recipe.split(",") if r not in RECIPES]
    if bad:
        parser.error(f"--recipe must be a comma-separated subset of {list(RECIPES)}, got {bad}")
    if args.interleaved and args.recipe != "none":
        parser.error(f"--interleaved measures without a recipe, got --recipe {args.recipe}")
    if args.iters < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error(f"--iters must be >= 1 and --warmup >= 0, got {args.iters}, {args.warmup}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    known = {**SHAPES, **CPU_SHAPES, **HOST_SHAPES, **MID_SHAPES, **QUICK_SHAPES}
    default = QUICK_SHAPES if args.quick else (CPU_SHAPES if device.type == "cpu" else SHAPES)
    args.dtype = args.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    names = args.shapes.split(",") if args.shapes else list(default)
    unknown = [n for n in names if n not in known]
    peers = args.peers.split(",")
    bad_peers = [p for p in peers if p not in PEER_CLASSES]
    if unknown or bad_peers:
        print(f"unknown shapes {unknown} / peers {bad_peers}; shapes: {list(known)}, "
              f"peers: {PEERS + EXTRA_PEERS}", file=sys.stderr)
        return 2
    with recorded_run(args.out, summarize) as out:
        out.write({"bench": "grouped_mlp_run", **machine_info(device), "device": device.type,
                   "shapes": names, "peers": peers})
        for name in names:
            run_shape(name, known[name], peers, args, out, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
