"""Speed and memory of the whole MoE layer, router to combine, forward + backward.

Peers, each run on the same problem (same weights, tokens and output gradient):

``torch_layer``
    the eager peer, a torchtitan-style layer in plain PyTorch (``torchtitan/models/moe``'s
    ``TokenChoiceTopKRouter`` + ``MoE`` written out): linear router, float32 softmax, top-k,
    the k weights renormalized, the Switch load-balancing loss; tokens sorted by expert with a
    stable ``argsort`` (counts by ``scatter_add_``, no host sync); the experts through
    ``torch._grouped_mm`` with device offsets; the expert outputs times their weights
    scatter-added back to token order. The baseline of ``ratio_vs_eager``.
``torch_layer_compiled``
    the same function through ``torch.compile(fullgraph=True)``; the baseline of
    ``ratio_vs_compiled``.
``te_ops``
    ``te_ops.MoE(H, FF, E, top_k, aux_loss_coeff=1.0)``: the same math (softmax top-k
    renormalized, Switch loss, dropless) as one te_ops ``Sequential``.
``te_ops_compiled``
    ``te_ops.MoE`` through ``torch.compile(fullgraph=True)``.
``te_ops_graph``
    ``te_ops.MoE`` captured whole by ``te_ops.graphs.make_graphed_callable`` (CUDA only).

Measurement, as ``grouped_mlp.py``: every peer of a shape is built once; then ``--rounds``
rounds, each timing every peer in turn (``--iters`` timed steps after ``--warmup`` untimed ones;
CUDA events on the GPU, the host clock on the CPU; gradients set to ``None`` before each step,
untimed). A step is ``y, aux = layer(x)`` and backward of ``(y * dy).sum() + aux``. Each record
(one JSON line) holds one round of one peer: the median step time, TFLOP/s (experts and router
GEMMs: 3 x (2·R·H·2FF + 2·R·FF·H + 2·T·H·E), R = T·top_k routed rows), the step's own peak
memory (CUDA: ``max_memory_allocated`` during the step minus what was allocated before it), the
bytes the forward saves for backward (``torch.autograd.graph.saved_tensors_hooks``, each
storage counted once, parameters and the input excluded; not measured for the CUDA graph,
whose saved tensors live in its pool), the ratios to the same round's eager and compiled peers
(> 1: faster) and the largest output and aux-loss differences from the eager peer. The summary
reports, per shape and peer, the median over rounds.

Routing: router weights N(0, 1/H), tokens N(0, 1) (near-uniform routing, as an untrained
router gives).

Usage::

    python benchmarks/moe_layer.py                      # the three GPU shapes -> runs/moe_layer/
    python benchmarks/moe_layer.py --quick --device cpu --out /tmp/x   # seconds, CPU
    python benchmarks/moe_layer.py --summarize runs/moe_layer/moe_layer.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    JsonLines,
    add_out_argument,
    check_file,
    check_list,
    error_text,
    free_memory,
    machine_info,
    peak_memory_mib,
    run_and_summarize,
    summarize_times,
    time_steps,
)

import te_ops  # noqa: E402

Shape = tuple[int, int, int, int, int]  # experts, routed rows (tokens x top_k), hidden, ffn, k
#: The GPU shapes (bf16), 8192 tokens each: Mixtral-like (top-2), 32 large experts (top-4),
#: 128 small ones (top-8).
SHAPES: dict[str, Shape] = {
    "E8_T16384_H4096_FF14336_K2": (8, 16384, 4096, 14336, 2),
    "E32_T32768_H7168_FF2048_K4": (32, 32768, 7168, 2048, 4),
    "E128_T65536_H2048_FF768_K8": (128, 65536, 2048, 768, 8),
}
#: ``--quick``: seconds on a CPU (the script's plumbing, not a measurement).
QUICK_SHAPES: dict[str, Shape] = {"E4_T64_H32_FF32_K2": (4, 64, 32, 32, 2)}
SHAPE_SETS: dict[str, dict[str, Shape]] = {"gpu": SHAPES, "quick": QUICK_SHAPES}
KNOWN_SHAPES: dict[str, Shape] = {k: v for d in SHAPE_SETS.values() for k, v in d.items()}

BASELINE = "torch_layer"
COMPILED_BASELINE = "torch_layer_compiled"


@dataclass
class Problem:
    """One shape's weights and inputs, shared by every peer."""

    name: str
    experts: int
    rows: int
    hidden: int
    ffn: int
    top_k: int
    device: torch.device
    dtype: torch.dtype
    w_router: torch.Tensor  # (E, H)
    w1: torch.Tensor  # (E, 2FF, H), gate rows first
    w2: torch.Tensor  # (E, H, FF)
    x: torch.Tensor  # (tokens, H), requires grad
    dy: torch.Tensor  # (tokens, H)

    @property
    def tokens(self) -> int:
        return self.rows // self.top_k

    @property
    def flops(self) -> float:
        """Forward + backward FLOPs of the expert and router GEMMs."""
        r, h, f = self.rows, self.hidden, self.ffn
        return 3.0 * (2 * r * h * 2 * f + 2 * r * f * h + 2 * self.tokens * h * self.experts)


def make_problem(name: str, shape: Shape, device: torch.device, dtype: torch.dtype,
                 seed: int) -> Problem:
    experts, rows, hidden, ffn, top_k = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    kw = {"generator": gen, "device": device, "dtype": dtype}
    w_router = torch.randn(experts, hidden, **kw).mul_(hidden ** -0.5)
    w1 = torch.randn(experts, 2 * ffn, hidden, **kw).mul_(hidden ** -0.5)
    w2 = torch.randn(experts, hidden, ffn, **kw).mul_(ffn ** -0.5)
    x = torch.randn(rows // top_k, hidden, **kw).requires_grad_()
    dy = torch.randn(rows // top_k, hidden, **kw)
    return Problem(name, experts, rows, hidden, ffn, top_k, device, dtype, w_router, w1, w2,
                   x, dy)


# -------------------------------------------------------------------------------- the peers
class Peer:
    """A way to run the layer: ``forward(x) -> (y, aux)`` and its parameters."""

    name = ""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem

    def parameters(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class TorchLayer(Peer):
    """The eager peer: the layer in plain PyTorch, torchtitan's way."""

    name = BASELINE

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem)
        self.w_router, self.w1, self.w2 = (torch.nn.Parameter(w.clone()) for w in (
            problem.w_router, problem.w1, problem.w2))

    def parameters(self) -> list[torch.Tensor]:
        return [self.w_router, self.w1, self.w2]

    def forward(self, x):
        e, k = self.problem.experts, self.problem.top_k
        scores = torch.softmax(F.linear(x, self.w_router).float(), dim=-1)  # (T, E)
        top, idx = scores.topk(k, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        flat = idx.reshape(-1)
        counts = torch.zeros(e, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        aux = e * (counts.float() / flat.numel() * scores.mean(0)).sum()  # Switch loss
        order = torch.argsort(flat, stable=True)
        token = order // k
        offs = torch.cumsum(counts, 0).to(torch.int32)
        h = torch._grouped_mm(x[token], self.w1.transpose(-2, -1), offs=offs)
        a, b = h.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(a) * b, self.w2.transpose(-2, -1), offs=offs)
        y = (y.float() * top.reshape(-1)[order, None]).to(x.dtype)
        out = torch.zeros_like(x).scatter_add_(0, token[:, None].expand(-1, x.shape[1]), y)
        return out, aux


class TorchLayerCompiled(TorchLayer):
    """:class:`TorchLayer`'s forward through ``torch.compile(fullgraph=True)``."""

    name = COMPILED_BASELINE
    backend = "inductor"

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem)
        self.compiled = torch.compile(super().forward, fullgraph=True, backend=self.backend)

    def forward(self, x):
        return self.compiled(x)


class TeOps(Peer):
    """``te_ops.MoE`` with the eager peer's weights."""

    name = "te_ops"

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem)
        p = problem
        self.layer = te_ops.MoE(p.hidden, p.ffn, p.experts, p.top_k, aux_loss_coeff=1.0,
                                device=p.device, dtype=p.dtype)
        with torch.no_grad():
            self.layer.router.weight.copy_(p.w_router)
            self.layer.experts[0].weight.copy_(p.w1)
            self.layer.experts[2].weight.copy_(p.w2)

    def parameters(self) -> list[torch.Tensor]:
        return list(self.layer.parameters())

    def forward(self, x):
        return self.layer(x)


class TeOpsCompiled(TeOps):
    """``te_ops.MoE`` through ``torch.compile(fullgraph=True)``."""

    name = "te_ops_compiled"
    backend = "inductor"

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem)
        self.compiled = torch.compile(self.layer, fullgraph=True, backend=self.backend)

    def forward(self, x):
        return self.compiled(x)


class TeOpsGraph(TeOps):
    """``te_ops.MoE`` in one CUDA graph (``.grad`` is reset before every step here, so no
    gradient clone is needed)."""

    name = "te_ops_graph"

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem)
        from te_ops.graphs import make_graphed_callable

        self.graphed = make_graphed_callable(self.layer, (problem.x,), clone_param_grads=False)

    def forward(self, x):
        return self.graphed(x)


PEER_CLASSES: dict[str, type[Peer]] = {
    cls.name: cls for cls in (TorchLayer, TorchLayerCompiled, TeOps, TeOpsCompiled, TeOpsGraph)}
DEFAULT_PEERS = list(PEER_CLASSES)


def skip_reason(peer: str, problem: Problem) -> str | None:
    """Why a peer cannot run on this device and dtype (``None`` when it can)."""
    if peer == "te_ops_graph" and problem.device.type != "cuda":
        return "CUDA graphs need a CUDA device (running with --device cpu)"
    if not hasattr(torch, "_grouped_mm") and peer.startswith("torch_layer"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    return None


# ------------------------------------------------------------------------------ measuring
def _zero_grads(peer: Peer, problem: Problem) -> None:
    problem.x.grad = None
    for p in peer.parameters():
        p.grad = None


def _backward(peer: Peer, problem: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    y, aux = peer.forward(problem.x)
    torch.autograd.backward((y, aux), (problem.dy, torch.ones_like(aux)))
    return y, aux


def saved_bytes(peer: Peer, problem: Problem) -> int:
    """Bytes the forward saves for backward, each storage once (parameters and the input
    excluded: they live anyway)."""
    live = {p.untyped_storage().data_ptr() for p in peer.parameters()}
    live.add(problem.x.untyped_storage().data_ptr())
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in live:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, aux = peer.forward(problem.x)
    torch.autograd.backward((y, aux), (problem.dy, torch.ones_like(aux)))
    _zero_grads(peer, problem)
    return sum(seen.values())


def measure(peer: Peer, problem: Problem, args: argparse.Namespace
            ) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """One round of one peer: timings, peak memory, saved bytes, its output and aux (host)."""
    def before() -> None:
        _zero_grads(peer, problem)

    def step() -> None:
        _backward(peer, problem)

    times = time_steps(step, problem.device, warmup=args.warmup, iters=args.iters,
                       before=before)
    peak = None
    if problem.device.type == "cuda":
        before()
        peak = peak_memory_mib(step, problem.device, torch.cuda.memory_allocated())
    saved = None if isinstance(peer, TeOpsGraph) else saved_bytes(peer, problem)
    with torch.no_grad():
        y, aux = peer.forward(problem.x)
        y, aux = y.detach().float().cpu(), aux.detach().float().cpu()
    _zero_grads(peer, problem)
    stats = summarize_times(times)
    return {**stats, "tflops": problem.flops / (stats["ms_median"] * 1e-3) / 1e12,
            "peak_mib": peak, "saved_mib": None if saved is None else saved / 2**20}, y, aux


def add_ratios(records: list[dict]) -> None:
    """``ratio_vs_eager`` / ``ratio_vs_compiled``: the eager / compiled peer's median over the
    record's, same round (> 1: faster)."""
    by_name = {r["peer"]: r for r in records if "ms_median" in r}
    for r in records:
        for key, base in (("ratio_vs_eager", BASELINE), ("ratio_vs_compiled", COMPILED_BASELINE)):
            if "ms_median" in r and base in by_name:
                r[key] = by_name[base]["ms_median"] / r["ms_median"]


def build_peers(problem: Problem, args: argparse.Namespace, out: JsonLines,
                base: dict) -> dict[str, Peer]:
    """Every peer of ``args.peers`` that can run (a skip record with the reason for the
    others), the eager and compiled peers first."""
    order = [p for p in (BASELINE, COMPILED_BASELINE) if p in args.peers]
    order += [p for p in args.peers if p not in order]
    peers: dict[str, Peer] = {}
    for name in order:
        reason = skip_reason(name, problem)
        cls = PEER_CLASSES[name]
        if hasattr(cls, "backend"):
            cls = type(cls.__name__, (cls,), {"backend": args.compile_backend})
        try:
            if reason is None:
                peers[name] = cls(problem)
        except Exception as exc:  # one peer failing must not stop the others
            reason = error_text(exc)
        if reason is not None:
            out.write({**base, "peer": name, "skipped": reason})
            print(f"# skip {name} on {problem.name}: {reason}", file=sys.stderr, flush=True)
    return peers


def run_shape(name: str, shape: Shape, args: argparse.Namespace, out: JsonLines,
              device: torch.device) -> None:
    """Every peer on one shape: built once, measured ``args.rounds`` times in turn."""
    problem = make_problem(name, shape, device, getattr(torch, args.dtype), args.seed)
    base = {"bench": "moe_layer", "shape": name, "E": shape[0], "T": shape[1], "H": shape[2],
            "FF": shape[3], "top_k": shape[4], "tokens": problem.tokens,
            "dtype": {"bfloat16": "bf16", "float32": "fp32"}[args.dtype],
            "device": device.type, "compile_backend": args.compile_backend,
            "iters": args.iters, "warmup": args.warmup}
    peers = build_peers(problem, args, out, base)
    for round_ in range(args.rounds):
        records, reference = [], None
        for label, peer in peers.items():
            record = {"peer": label, "round": round_}
            try:
                stats, y, aux = measure(peer, problem, args)
                record.update(stats)
                if label == BASELINE:
                    reference = (y, aux)
                if reference is not None:
                    record["max_abs_diff"] = (y - reference[0]).abs().max().item()
                    record["aux_abs_diff"] = (aux - reference[1]).abs().item()
            except Exception as exc:  # one peer failing must not stop the others
                record["error"] = error_text(exc)
            records.append(record)
        add_ratios(records)
        for record in records:
            out.write({**base, **record})
    peers.clear()
    del problem
    torch._dynamo.reset()  # compiled peers of the next shape start from an empty cache
    free_memory()


# ------------------------------------------------------------------------------- summary
def summarize(path: str) -> str:
    """Per shape and peer, the median over rounds of the step time, TFLOP/s, peak and saved
    memory and the ratios to the eager and the compiled peer."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.startswith("{")]
    groups: dict[tuple[str, str], list[dict]] = {}
    notes = []
    for r in rows:
        if r.get("bench") != "moe_layer":
            continue
        if "ms_median" in r:
            groups.setdefault((r["shape"], r["peer"]), []).append(r)
        else:
            notes.append(f"{r['shape']:<28} {r['peer']:<22} "
                         f"{(r.get('skipped') or r.get('error') or '')[:70]}")
    header = (f"{'shape':<28} {'peer':<22} {'rounds':>6} {'ms':>9} {'TFLOP/s':>8} "
              f"{'peak MiB':>9} {'saved MiB':>9} {'x eager':>8} {'x compiled':>10}")
    lines = [header, "-" * len(header)]
    for (shape, peer), g in groups.items():
        def med(key: str, spec: str) -> str:
            values = [r[key] for r in g if r.get(key) is not None]
            return format(statistics.median(values), spec) if values else "-"
        lines.append(f"{shape:<28} {peer:<22} {len(g):>6} {med('ms_median', '9.3f'):>9} "
                     f"{med('tflops', '8.1f'):>8} {med('peak_mib', '9.0f'):>9} "
                     f"{med('saved_mib', '9.1f'):>9} {med('ratio_vs_eager', '8.3f'):>8} "
                     f"{med('ratio_vs_compiled', '10.3f'):>10}")
    return "\n".join(lines + notes)


# ---------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict[str, Shape]]:
    """The command line (``parser.error``, exit 2, naming the flag on a bad value) and the
    shapes it names."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=None,
                        help="comma-separated shape or set names; sets: " + ", ".join(SHAPE_SETS)
                             + "; shapes: " + ", ".join(KNOWN_SHAPES) + " (default: gpu)")
    parser.add_argument("--quick", action="store_true",
                        help="the quick shape, 1 round of 2 steps after 1 warm-up (seconds on "
                             "a CPU; flags given explicitly override these)")
    parser.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                        help="comma-separated peers: " + ", ".join(PEER_CLASSES))
    parser.add_argument("--device", default=None, choices=["cuda", "cpu"],
                        help="cuda (default when present) or cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="of weights and tokens (default bfloat16)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3)")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed steps per peer and round (default 10)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps per peer and round (default 3)")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend of the compiled peers (aot_eager: the eager "
                             "kernels, quick to compile)")
    parser.add_argument("--seed", type=int, default=0)
    add_out_argument(parser, "moe_layer")
    parser.add_argument("--summarize", metavar="FILE", default=None,
                        help="print the summary of a JSON-lines file of this script and exit")
    args = parser.parse_args(argv)
    if args.summarize is not None:
        check_file(parser, "--summarize", args.summarize)
        return args, {}
    args.peers = check_list(parser, "--peers", args.peers, PEER_CLASSES)
    quick = {"rounds": 1, "iters": 2, "warmup": 1}
    default = {"rounds": 3, "iters": 10, "warmup": 3}
    for key, minimum in (("rounds", 1), ("iters", 1), ("warmup", 0)):
        if getattr(args, key) is None:
            setattr(args, key, (quick if args.quick else default)[key])
        if getattr(args, key) < minimum:
            parser.error(f"--{key} must be >= {minimum}, got {getattr(args, key)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    import torch._dynamo

    if args.compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
        parser.error(f"--compile-backend must be a torch.compile backend such as inductor or "
                     f"aot_eager, got {args.compile_backend!r}")
    text = args.shapes or ("quick" if args.quick else "gpu")
    names = check_list(parser, "--shapes", text, [*SHAPE_SETS, *KNOWN_SHAPES])
    shapes: dict[str, Shape] = {}
    for name in names:
        shapes.update(SHAPE_SETS.get(name, {name: KNOWN_SHAPES.get(name)}))
    return args, shapes


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; writes ``<--out>/moe_layer.jsonl`` and ``<--out>/summary.txt`` and
    prints the summary. Returns 0, or 1 when a peer raised."""
    args, shapes = parse_args(argv)
    if args.summarize is not None:
        print(summarize(args.summarize))
        return 0
    device = torch.device(args.device)
    run_record = {"bench": "moe_layer_run", **machine_info(device), "te_ops": te_ops.__version__,
                  "device": device.type, "dtype": args.dtype, "shapes": list(shapes),
                  "peers": args.peers, "rounds": args.rounds,
                  "argv": sys.argv[1:] if argv is None else argv}

    def run(out: JsonLines) -> None:
        for name, shape in shapes.items():
            run_shape(name, shape, args, out, device)

    return run_and_summarize(args.out, "moe_layer", run_record, run, summarize)


if __name__ == "__main__":
    sys.exit(main())
