"""Speed and memory of an MoE expert MLP, fc1 -> ScaledSwiGLU -> fc2, forward + backward.

Peers (``--peers``), each run on the same problem (same weights, inputs, skewed routing):

``torch_grouped_mm``
    the eager peer: plain PyTorch autograd through ``torch._grouped_mm`` with device offsets
    and SwiGLU(h) * probs written in torch ops; the baseline of ``ratio_vs_eager``.
``torch_grouped_mm_compiled``
    the compiled peer: the same function through ``torch.compile(fullgraph=True)`` (default
    mode, inductor); the baseline of ``ratio_vs_compiled``.
``te_ops``
    te_ops' default: ``te_ops.Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear)`` as a
    user builds it (default parameter layout, default fusions), device split sizes.
``te_ops_packed`` / ``te_ops_per_expert``
    the same with ``single_grouped_weight=True`` (one (E, out, in) ``weight``) / ``False``
    (``weight0..weight{E-1}``).
``te_ops_unfused``
    te_ops' default with ``TE_OPS_FUSION=0``.
``te_ops_microbatch``
    te_ops' default as a later micro-batch of a gradient-accumulation step
    (``is_first_microbatch=False`` after one ``True`` call: under a recipe no weight quantize;
    the kept FP8 weight copies, about the weights' bytes, live outside the step's peak).
``te_ops_graph``
    te_ops' default captured by ``te_ops.graphs.make_graphed_callable`` (CUDA only).
``te_ops_compiled``
    te_ops' default through ``torch.compile(fullgraph=True)``.
``te_ops_recompute``
    te_ops' default with ``ScaledSwiGLU(recompute_input=True)`` (h not saved; fc1 re-run).
``torch_loop``
    plain PyTorch: one ``F.linear`` per expert with host split sizes.
``torchao_fp8``
    torchao's FP8 row-wise grouped GEMM (``torchao.prototype.moe_training.
    _to_fp8_rowwise_then_scaled_grouped_mm``: dynamic row-wise E4M3 quantization with
    power-of-two scales, ``torch._scaled_grouped_mm`` with fast accumulation in all three GEMMs)
    on the eager peer's weights, SwiGLU * probs in torch ops: the FP8 peer a user would pick
    instead of te_ops' FP8 recipes. An optional dependency of this benchmark alone: without
    torchao (or without CUDA, bf16, SM89+, or tokens per expert in multiples of 16: ``--align
    16``) the peer is skipped and its record says why.

Default peers: the eager peer, the compiled peer and ``te_ops``. ``--recipe none,fp8,...`` runs
every ``te_ops*`` peer once per recipe (``+fp8`` etc. appended to its name; such records also
hold ``ratio_vs_bf16``).

Measurement: every peer of a shape is built once; then ``--rounds`` rounds (default 3), each
timing every peer in turn (``--iters`` timed forward+backward steps after ``--warmup``
untimed ones; CUDA events around each step on the GPU, the host clock on the CPU; gradients set
to ``None`` before each step, untimed). Each record (one JSON line) holds one round of one peer:
the median step time, TFLOP/s (forward = 2·T·H·2FF + 2·T·FF·H, forward+backward = 3 x
forward), the step's own peak memory (CUDA: ``max_memory_allocated`` during the step minus what
was allocated before it), the ratios to the same round's eager and compiled peers (> 1: faster)
and the largest output difference from the eager peer. The summary reports, per shape and peer,
the median over rounds. ``--interleaved`` instead times one step of each peer in turn
(A, B, C, A, ...; host clock, no memory figures): for a shared, noisy host.

Routing: each token goes to one expert drawn from a Zipf(1.2)-skewed popularity over a random
permutation of the experts (fixed seed); tokens sorted by expert, probs ~ U(0, 1). ``--align
N`` rounds each expert's tokens up to a multiple of N (the routed rows grow to their sum;
records hold ``rows`` and ``align``).

Usage::

    python benchmarks/grouped_mlp.py                     # the GPU shapes -> runs/grouped_mlp/
    python benchmarks/grouped_mlp.py --device cpu --shapes tiny --out /tmp/x   # CPU smoke run
    python benchmarks/grouped_mlp.py --shapes E64_T256_H2048_FF768 --peers te_ops,te_ops_graph
    python benchmarks/grouped_mlp.py --summarize runs/grouped_mlp/grouped_mlp.jsonl
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    JsonLines,
    add_out_argument,
    check_list,
    env_override,
    error_text,
    free_memory,
    machine_info,
    run_and_summarize,
    summarize_times,
    time_steps,
)

import te_ops  # noqa: E402

Shape = tuple[int, int, int, int]  # experts, routed rows, hidden, ffn
#: The GPU shapes (bf16): a Mixtral-like block, 128 small experts, 32 large ones, E64 decode.
SHAPES: dict[str, Shape] = {
    "E8_T16384_H4096_FF14336": (8, 16384, 4096, 14336),
    "E128_T65536_H2048_FF768": (128, 65536, 2048, 768),
    "E32_T32768_H7168_FF2048": (32, 32768, 7168, 2048),
    "E64_T256_H2048_FF768": (64, 256, 2048, 768),
}
#: The CPU shape (default with ``--device cpu``; fp32): a Mixtral-like block scaled down.
CPU_SHAPES: dict[str, Shape] = {
    "E8_T4096_H256_FF512": (8, 4096, 256, 512),
}
#: Host-bound shapes: the decode shape's expert and token counts with tiny hidden sizes, so the
#: step time is host work (Python, dispatch, autograd), not math.
HOST_SHAPES: dict[str, Shape] = {
    "E64_T256_H64_FF32": (64, 256, 64, 32),
    "E8_T4096_H8_FF8": (8, 4096, 8, 8),
    "E128_T1024_H64_FF32": (128, 1024, 64, 32),
}
#: 64-256 rows per expert: the persistent Triton GEMMs' range.
MID_SHAPES: dict[str, Shape] = {
    "E128_T8192_H2048_FF768": (128, 8192, 2048, 768),      # 64 rows per expert
    "E128_T16384_H2048_FF768": (128, 16384, 2048, 768),    # 128
    "E64_T16384_H7168_FF2048": (64, 16384, 7168, 2048),    # 256
}
#: The FP8 shapes: coarse (E8, E16) to fine-grained (E64-E128, FF 768-2048) experts, tokens per
#: expert rounded to 16 with ``--align 16`` (torchao's FP8 grouped GEMM needs it).
FP8_SHAPES: dict[str, Shape] = {
    "E8_T16384_H4096_FF14336": (8, 16384, 4096, 14336),
    "E16_T16384_H5120_FF8192": (16, 16384, 5120, 8192),
    "E32_T32768_H7168_FF2048": (32, 32768, 7168, 2048),
    "E64_T65536_H7168_FF2048": (64, 65536, 7168, 2048),
    "E128_T32768_H4096_FF1536": (128, 32768, 4096, 1536),
    "E128_T65536_H2048_FF768": (128, 65536, 2048, 768),
}
#: Tiny shapes: seconds on a CPU (argument handling and output format).
TINY_SHAPES: dict[str, Shape] = {
    "E4_T256_H64_FF64": (4, 256, 64, 64),
    "E16_T128_H32_FF48": (16, 128, 32, 48),
}
#: Names ``--shapes`` takes for a whole set.
SHAPE_SETS: dict[str, dict[str, Shape]] = {
    "gpu": SHAPES, "cpu": CPU_SHAPES, "host": HOST_SHAPES, "mid": MID_SHAPES, "fp8": FP8_SHAPES,
    "tiny": TINY_SHAPES,
}
KNOWN_SHAPES: dict[str, Shape] = {k: v for d in SHAPE_SETS.values() for k, v in d.items()}

BASELINE = "torch_grouped_mm"
COMPILED_BASELINE = "torch_grouped_mm_compiled"
DEFAULT_PEERS = [BASELINE, COMPILED_BASELINE, "te_ops"]
RECIPES = {"none": None, "fp8": te_ops.recipe.Float8CurrentScaling(),
           "fp8fast": te_ops.recipe.Float8CurrentScaling(fast_accumulate_backward=True),
           "mxfp8": te_ops.recipe.MXFP8BlockScaling(),
           "fp8block": te_ops.recipe.Float8BlockScaling()}


def resolve_shapes(parser: argparse.ArgumentParser, text: str | None,
                   device: torch.device) -> dict[str, Shape]:
    """``--shapes``: comma-separated shape names or set names (``gpu``, ``cpu``, ``host``,
    ``mid``, ``tiny``); default ``gpu`` on CUDA, ``cpu`` on the CPU. A name that is neither is
    ``parser.error`` (exit 2) naming the flag, the bad name and the known ones."""
    if text is None:
        return dict(SHAPES if device.type == "cuda" else CPU_SHAPES)
    names = check_list(parser, "--shapes", text, [*SHAPE_SETS, *KNOWN_SHAPES])
    shapes: dict[str, Shape] = {}
    for name in names:
        shapes.update(SHAPE_SETS.get(name, {name: KNOWN_SHAPES.get(name)}))
    return shapes


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
                 dtype: torch.dtype, seed: int, align: int = 1) -> Problem:
    """The shape's problem; ``align`` > 1 rounds each expert's tokens up to a multiple of it
    (the rows are then their sum, more than the shape's)."""
    experts, tokens, hidden, ffn = shape
    sizes = [-(-s // align) * align for s in skewed_sizes(experts, tokens, seed)]
    tokens = sum(sizes)  # the shape's rows when align is 1
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
    """The eager peer: ``torch._grouped_mm`` on packed (E, out, in) weights."""

    name = BASELINE

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


class TorchGroupedMMCompiled(TorchGroupedMM):
    """The compiled peer: :class:`TorchGroupedMM`'s forward (same SwiGLU * probs math) through
    ``torch.compile(fullgraph=True)``; the first warm-up step compiles."""

    name = COMPILED_BASELINE

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem)
        self.compiled = torch.compile(super().forward, fullgraph=True)

    def forward(self, x, probs):
        return self.compiled(x, probs)


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
    """te_ops' default block, built as the README shows (public API only)."""

    name = "te_ops"
    layout: dict[str, bool] = {}  # GroupedLinear(single_grouped_weight=...) when set
    recompute = False  # ScaledSwiGLU(recompute_input=...)

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem)
        p = problem
        kw = {"bias": False, "device": p.device, "dtype": p.dtype, **self.layout}
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
                if len(params) == 1:  # one packed (E, out, in) weight
                    params[0].copy_(w.view_as(params[0]))
                else:
                    for e, param in enumerate(params):
                        param.copy_(w[e])

    def parameters(self) -> list[torch.Tensor]:
        return list(self.block.parameters())

    def forward(self, x, probs):
        split = self.problem.split
        with self.autocast():
            return self.block(x, split, probs, split)


class TeOpsPacked(TeOps):
    name = "te_ops_packed"
    layout = {"single_grouped_weight": True}


class TeOpsPerExpert(TeOps):
    name = "te_ops_per_expert"
    layout = {"single_grouped_weight": False}


class TeOpsUnfused(TeOps):
    name = "te_ops_unfused"
    env = {"TE_OPS_FUSION": "0"}


class TeOpsRecompute(TeOps):
    name = "te_ops_recompute"
    recompute = True


class TeOpsMicrobatch(TeOps):
    """te_ops' default as the later micro-batches of a gradient-accumulation step: the first
    call passes ``is_first_microbatch=True``, every later one ``False`` (under a recipe the
    weights' quantized copies are reused; the weights never change here)."""

    name = "te_ops_microbatch"

    def forward(self, x, probs):
        split = self.problem.split
        first = not self.__dict__.get("_cached", False)
        self._cached = True
        with self.autocast():
            return self.block(x, split, probs, split, is_first_microbatch=first)


class TeOpsGraph(TeOps):
    """te_ops' default block captured by ``te_ops.graphs.make_graphed_callable``
    (``.grad`` is reset to ``None`` before every step here, so no gradient clone is needed)."""

    name = "te_ops_graph"

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem)
        from te_ops.graphs import make_graphed_callable

        p = problem
        with env_override(**self.env), self.autocast():
            self.graphed = make_graphed_callable(self.block, (p.x, p.split, p.probs, p.split),
                                                 clone_param_grads=False)

    def forward(self, x, probs):
        split = self.problem.split
        return self.graphed(x, split, probs, split)


class TeOpsCompiled(TeOps):
    """te_ops' default block through ``torch.compile(fullgraph=True)``; the first warm-up call
    compiles. ``te_ops.autocast`` stays outside the compiled function."""

    name = "te_ops_compiled"

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem)
        self.compiled = torch.compile(self.block, fullgraph=True)

    def forward(self, x, probs):
        split = self.problem.split
        with self.autocast():
            return self.compiled(x, split, probs, split)


class TorchaoFP8(TorchGroupedMM):
    """torchao's FP8 row-wise grouped GEMM in fc1 and fc2 (see the module docstring)."""

    name = "torchao_fp8"

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem)
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

        self.mm = _to_fp8_rowwise_then_scaled_grouped_mm

    def forward(self, x, probs):
        offs = self.problem.offsets
        # B_t (E, in, out) column-major per group: the (E, out, in) weights transposed
        kw = {"out_dtype": torch.bfloat16, "pad_token_groups_for_grouped_mm": False}
        h = self.mm(x, self.w1.transpose(-2, -1), offs, **kw)
        return self.mm(torch_swiglu(h, probs), self.w2.transpose(-2, -1), offs, **kw)


PEER_CLASSES: dict[str, type[Peer]] = {
    cls.name: cls for cls in (TorchGroupedMM, TorchGroupedMMCompiled, TeOps, TeOpsPacked,
                              TeOpsPerExpert, TeOpsUnfused, TeOpsRecompute, TeOpsMicrobatch,
                              TeOpsGraph, TeOpsCompiled, TorchLoop, TorchaoFP8)
}


def torchao_skip_reason(problem: Problem) -> str | None:
    """Why the ``torchao_fp8`` peer cannot run on ``problem`` (``None`` when it can)."""
    if importlib.util.find_spec("torchao") is None:
        return ("torchao is not installed (an optional dependency of this benchmark alone: "
                "pip install torchao)")
    if problem.device.type != "cuda":
        return "torchao's FP8 grouped GEMM needs CUDA (torch._scaled_grouped_mm)"
    if problem.dtype != torch.bfloat16:
        return f"torchao's FP8 grouped GEMM takes bfloat16 here, got {problem.dtype}"
    if torch.cuda.get_device_capability(problem.device) < (8, 9):
        return "torchao's FP8 grouped GEMM needs SM89 or newer (FP8 tensor cores)"
    if any(s % 16 for s in problem.sizes):
        return ("torchao's FP8 grouped GEMM needs tokens per expert in multiples of 16 (its "
                "padding option is not supported in torchao 0.18): run with --align 16")
    return None


def skip_reason(peer: str, problem: Problem) -> str | None:
    """Why a peer cannot run on this device and dtype (``None`` when it can)."""
    if issubclass(PEER_CLASSES[peer], TeOpsGraph) and problem.device.type != "cuda":
        return "CUDA graphs need a CUDA device (running with --device cpu)"
    if (peer == COMPILED_BASELINE and problem.device.type == "cpu"
            and problem.dtype != torch.bfloat16):
        return (f"torch._grouped_mm's fake kernel takes bfloat16 only on CPU ({problem.dtype} "
                "fails to compile)")
    if peer.startswith("torch_grouped_mm") and not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if peer == TorchaoFP8.name:
        return torchao_skip_reason(problem)
    return None


def build_peer(name: str, recipe: str, problem: Problem) -> Peer:
    """The peer ``name`` on ``problem``, under ``recipe`` (te_ops peers; ``none``: bf16/fp32)."""
    cls = PEER_CLASSES[name]
    if recipe != "none":
        cls = type(cls.__name__ + "_" + recipe, (cls,),
                   {"recipe": RECIPES[recipe], "name": f"{name}+{recipe}"})
    return cls(problem)


# ------------------------------------------------------------------------------ measuring
def _zero_grads(peer: Peer, problem: Problem) -> None:
    problem.x.grad = problem.probs.grad = None
    for p in peer.parameters():
        p.grad = None


def step_peak_mib(step, problem: Problem, before) -> float | None:
    """CUDA: the step's own peak (``max_memory_allocated`` during one step minus what was
    allocated when it started), MiB; ``None`` on the CPU."""
    if problem.device.type != "cuda":
        return None
    before()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - start) / 2**20


def measure(peer: Peer, problem: Problem, args: argparse.Namespace) -> tuple[dict, torch.Tensor]:
    """One round of one peer: timings, the step's own peak memory, and its output (host)."""
    x, probs, dy = problem.x, problem.probs, problem.dy

    def before() -> None:
        _zero_grads(peer, problem)

    def step() -> None:
        peer.forward(x, probs).backward(dy)

    with env_override(**peer.env):
        times = time_steps(step, problem.device, warmup=args.warmup, iters=args.iters,
                           before=before)
        peak = step_peak_mib(step, problem, before)
        with torch.no_grad():
            out = peer.forward(x, probs).detach().cpu()
    _zero_grads(peer, problem)
    stats = summarize_times(times)
    return {**stats, "tflops": problem.flops / (stats["ms_median"] * 1e-3) / 1e12,
            "peak_mib": peak}, out


def add_ratios(records: list[dict]) -> None:
    """``ratio_vs_eager`` / ``ratio_vs_compiled`` (the eager / compiled peer's median over the
    record's, same round) and ``ratio_vs_bf16`` (a recipe record against its peer's bf16 one)."""
    by_name = {r["peer"]: r for r in records if "ms_median" in r}
    for r in records:
        if "ms_median" not in r:
            continue
        for key, base in (("ratio_vs_eager", BASELINE), ("ratio_vs_compiled", COMPILED_BASELINE)):
            if base in by_name:
                r[key] = by_name[base]["ms_median"] / r["ms_median"]
        bf16 = by_name.get(r["peer"].split("+")[0])
        if "+" in r["peer"] and bf16 is not None:
            r["ratio_vs_bf16"] = bf16["ms_median"] / r["ms_median"]


def measure_interleaved(peers: dict[str, Peer], problem: Problem, args: argparse.Namespace
                        ) -> list[dict]:
    """One step of each peer in turn (A, B, C, A, B, C, ...), host clock around each step
    (synchronized on CUDA), so a shared host's changing load hits every peer alike."""
    x, probs, dy = problem.x, problem.probs, problem.dy
    times: dict[str, list[float]] = {name: [] for name in peers}
    for i in range(args.warmup + args.iters):
        for name, peer in peers.items():
            with env_override(**peer.env):
                _zero_grads(peer, problem)
                if problem.device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                peer.forward(x, probs).backward(dy)
                if problem.device.type == "cuda":
                    torch.cuda.synchronize()
                if i >= args.warmup:
                    times[name].append((time.perf_counter() - t0) * 1e3)
    for peer in peers.values():
        _zero_grads(peer, problem)
    records = []
    for name, ts in times.items():
        stats = summarize_times(ts)
        records.append({"peer": name, "round": 0, "interleaved": True, **stats,
                        "tflops": problem.flops / (stats["ms_median"] * 1e-3) / 1e12})
    return records


def run_shape(name: str, shape: Shape, args: argparse.Namespace, out: JsonLines,
              device: torch.device) -> None:
    """Every (peer, recipe) of ``args`` on one shape: built once, measured ``args.rounds``
    times in turn (or interleaved step by step); one record per round and peer."""
    dtype = getattr(torch, args.dtype)
    problem = make_problem(name, shape, device, dtype, args.seed, args.align)
    base = {"bench": "grouped_mlp", "shape": name,
            "E": shape[0], "T": shape[1], "H": shape[2], "FF": shape[3],
            "rows": problem.tokens, "align": args.align,
            "dtype": {"bfloat16": "bf16", "float32": "fp32"}[args.dtype], "device": device.type,
            "routing": "zipf1.2", "max_expert_tokens": max(problem.sizes),
            "empty_experts": sum(1 for s in problem.sizes if s == 0),
            "iters": args.iters, "warmup": args.warmup}
    order = [p for p in (BASELINE, COMPILED_BASELINE) if p in args.peers]
    order += [p for p in args.peers if p not in order]
    peers: dict[str, Peer] = {}
    for peer_name in order:
        for recipe in args.recipes:
            if recipe != "none" and not peer_name.startswith("te_ops"):
                continue
            label = peer_name if recipe == "none" else f"{peer_name}+{recipe}"
            reason = skip_reason(peer_name, problem)
            try:
                if reason is None:
                    peers[label] = build_peer(peer_name, recipe, problem)
            except Exception as exc:  # one peer failing must not stop the others
                reason = error_text(exc)
            if reason is not None:
                out.write({**base, "peer": label, "skipped": reason})
                print(f"# skip {label} on {name}: {reason}", file=sys.stderr, flush=True)
    if args.interleaved:
        rounds = [measure_interleaved(peers, problem, args)]
    else:
        rounds = []
        for round_ in range(args.rounds):
            records, reference = [], None
            for label, peer in peers.items():
                record = {"peer": label, "round": round_}
                try:
                    stats, output = measure(peer, problem, args)
                    record.update(stats)
                    if reference is None and label == BASELINE:
                        reference = output.float()
                    if reference is not None:
                        record["max_abs_diff"] = (output.float() - reference).abs().max().item()
                except Exception as exc:  # one peer failing must not stop the others
                    record["error"] = error_text(exc)
                records.append(record)
            rounds.append(records)
    for records in rounds:
        add_ratios(records)
        for record in records:
            out.write({**base, **record})
    peers.clear()
    del problem
    torch._dynamo.reset()  # compiled peers of the next shape start from an empty cache
    free_memory()


# ------------------------------------------------------------------------------- summary
def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(path: str) -> str:
    """Per shape and peer, the median over rounds of the step time, TFLOP/s, peak memory and
    the ratios to the eager and the compiled peer (a JSON-lines file of this script)."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.startswith("{")]
    rows = [r for r in rows if r.get("bench") == "grouped_mlp"]
    groups: dict[tuple[str, str], list[dict]] = {}
    notes = []
    for r in rows:
        if "ms_median" in r:
            groups.setdefault((r["shape"], r["peer"]), []).append(r)
        else:
            note = r.get("skipped") or r.get("error") or ""
            notes.append(f"{r['shape']:<26} {r['peer']:<28} {note[:70]}")
    header = (f"{'shape':<26} {'peer':<28} {'rounds':>6} {'ms':>9} {'TFLOP/s':>8} "
              f"{'peak MiB':>9} {'x eager':>8} {'x compiled':>10} {'x bf16':>7}")
    lines = [header, "-" * len(header)]
    for (shape, peer), g in groups.items():
        def med(key: str) -> float | None:
            return _median([r[key] for r in g if r.get(key) is not None])
        lines.append(f"{shape:<26} {peer:<28} {len(g):>6} {_fmt(med('ms_median'), '9.3f'):>9} "
                     f"{_fmt(med('tflops'), '8.1f'):>8} {_fmt(med('peak_mib'), '9.0f'):>9} "
                     f"{_fmt(med('ratio_vs_eager'), '8.3f'):>8} "
                     f"{_fmt(med('ratio_vs_compiled'), '10.3f'):>10} "
                     f"{_fmt(med('ratio_vs_bf16'), '7.3f'):>7}")
    return "\n".join(lines + notes)


# ---------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict[str, Shape]]:
    """The command line (``parser.error``, exit 2, naming the flag on a bad value) and the
    shapes it names."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=None,
                        help="comma-separated shape or set names; sets: " + ", ".join(SHAPE_SETS)
                             + "; shapes: " + ", ".join(KNOWN_SHAPES))
    parser.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                        help="comma-separated peers: " + ", ".join(PEER_CLASSES))
    parser.add_argument("--device", default=None, choices=["cuda", "cpu"],
                        help="cuda (default when present) or cpu")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                        help="bfloat16 (default on cuda) or float32 (default on cpu)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds; each times every peer in turn (the summary: medians)")
    parser.add_argument("--interleaved", action="store_true",
                        help="time one step of each peer in turn instead (host clock)")
    parser.add_argument("--iters", type=int, default=20, help="timed steps per peer and round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per peer and round")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (CPU intra-op threads; default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--align", type=int, default=1,
                        help="round each expert's tokens up to a multiple of this (default 1; "
                             "torchao_fp8 needs 16)")
    parser.add_argument("--recipe", default="none",
                        help="comma-separated recipes for the te_ops peers: " + ", ".join(RECIPES))
    add_out_argument(parser, "grouped_mlp")
    parser.add_argument("--summarize", metavar="FILE", default=None,
                        help="print the summary of a JSON-lines file of this script and exit")
    args = parser.parse_args(argv)
    if args.summarize is not None:
        if not os.path.isfile(args.summarize):
            parser.error(f"--summarize: expected an existing file, got {args.summarize!r}")
        return args, {}
    args.peers = check_list(parser, "--peers", args.peers, PEER_CLASSES)
    args.recipes = check_list(parser, "--recipe", args.recipe, RECIPES)
    if args.interleaved and args.recipes != ["none"]:
        parser.error(f"--interleaved measures without a recipe, got --recipe {args.recipe}")
    for flag, value, minimum in (("--iters", args.iters, 1), ("--warmup", args.warmup, 0),
                                 ("--rounds", args.rounds, 1), ("--align", args.align, 1)):
        if value < minimum:
            parser.error(f"{flag} must be >= {minimum}, got {value}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    shapes = resolve_shapes(parser, args.shapes, torch.device(args.device))
    return args, shapes


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; writes ``<--out>/grouped_mlp.jsonl`` and ``<--out>/summary.txt``
    and prints the summary. Returns 0, or 1 when a peer raised."""
    args, shapes = parse_args(argv)
    if args.summarize is not None:
        print(summarize(args.summarize))
        return 0
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    run_record = {"bench": "grouped_mlp_run", **machine_info(device),
                  "te_ops": te_ops.__version__, "device": device.type, "dtype": args.dtype,
                  "shapes": list(shapes), "peers": args.peers, "recipes": args.recipes,
                  "rounds": args.rounds, "interleaved": args.interleaved,
                  "argv": sys.argv[1:] if argv is None else argv}

    def run(out: JsonLines) -> None:
        for name, shape in shapes.items():
            run_shape(name, shape, args, out, device)

    return run_and_summarize(args.out, "grouped_mlp", run_record, run, summarize)


if __name__ == "__main__":
    sys.exit(main())
