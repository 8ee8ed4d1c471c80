"""Expert parallelism: te_ops' all-to-all dispatch + combine and the whole ``te_ops.MoE`` step
over ``ep`` ranks, against a plain torch peer.

Parts (``--parts``), each timed forward + backward on every rank at once:

``dispatch_combine``
    the communication alone: rows sorted by expert (from the layer's own router and permute,
    untimed) sent to the ranks owning their experts, put in local-expert order, and sent back
    (identity experts in between). te_ops: ``Sequential(AllToAllDispatch, AllToAllCombine)``;
    the peer: torchtitan's default ``ExpertParallel`` token dispatch (an all-to-all of the
    per-expert counts, their host copy, ``all_to_all_single_autograd`` with those host split
    lists, a local permute), written here in plain torch.
``layer``
    ``te_ops.MoE(..., ep_group=group)`` (router, permute, dispatch, grouped SwiGLU experts,
    combine) against the same layer in plain torch: softmax top-k router, ``argsort``
    permute, the peer's dispatch above, the experts through ``torch._grouped_mm`` on CUDA
    (a per-expert ``F.linear`` loop on the CPU), the reverse all-to-all, the routing weights
    applied and summed back with ``index_add_`` (torchtitan's ``score_before_experts=False``:
    the same math as te_ops'). Same weights, same tokens; ``max_abs_diff`` is the largest
    output difference from the peer (dropless).

Modes (``--modes``): ``dropless`` (one host read of the split sizes per layer per step, as
the peer's) and ``capacity`` (``--capacity-factor``: static splits, no host read; on CUDA
also captured in a CUDA graph, ``te_ops_graph``). The peer is dropless in both.

Every rank builds the full weights from one seed and keeps its experts; its tokens come
from its own seed. Each record is one (part, mode, peer): the median step time over
``--iters`` steps after ``--warmup``, the largest median over the ranks (the slowest rank sets
the step), and the ratio to the peer (> 1: te_ops faster).

Usage (one process per GPU; the group is every rank, ``ep`` = the world size)::

    torchrun --nproc_per_node 8 benchmarks/moe_ep.py --out runs/moe_ep      # NCCL, ep 8
    python benchmarks/moe_ep.py --out runs/moe_ep                           # one GPU, ep 1
    python benchmarks/moe_ep.py --device cpu --tokens 64 --hidden 32 --ffn 32 --experts 8 \\
        --top-k 2 --dtype float32 --iters 3 --warmup 1 --out /tmp/moe_ep    # CPU, gloo

One JSON line per record to stdout (rank 0) and ``<--out>/moe_ep.jsonl``, a table to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    JsonLines,
    add_out_argument,
    check_list,
    check_min,
    machine_info,
    out_path,
    summarize_times,
    time_steps,
)

import te_ops  # noqa: E402

PARTS = ("dispatch_combine", "layer")
MODES = ("dropless", "capacity")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# ------------------------------------------------------------------------ the torch peer
def _waited(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited for (it may come as an AsyncCollectiveTensor,
    which waits only when used)."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


class TorchDispatch:
    """torchtitan's default token dispatch / combine in plain torch (host split lists)."""

    def __init__(self, group: Any, num_experts: int) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.local = num_experts // self.ep

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor):
        """Rows sorted by global expert -> (rows in local-expert order, their counts per local
        expert, what ``combine`` needs)."""
        ep, el = self.ep, self.local
        recv_counts = funcol.wait_tensor(
            funcol.all_to_all_single(counts, [el] * ep, [el] * ep, self.group))
        splits = torch.cat([counts.view(ep, el).sum(1), recv_counts.view(ep, el).sum(1)])
        splits = splits.tolist()  # the host read
        send, recv = splits[:ep], splits[ep:]
        received = _waited(funcol.all_to_all_single_autograd(rows, recv, send, self.group))
        expert = torch.arange(ep * el, device=rows.device) % el
        expert = torch.repeat_interleave(expert, recv_counts, output_size=sum(recv))
        perm = torch.argsort(expert, stable=True)
        inverse = torch.empty_like(perm).scatter_(0, perm, torch.arange(len(perm),
                                                                       device=perm.device))
        return received[perm], recv_counts.view(ep, el).sum(0), (send, recv, inverse)

    def combine(self, out: torch.Tensor, state) -> torch.Tensor:
        send, recv, inverse = state
        return _waited(funcol.all_to_all_single_autograd(out[inverse], send, recv, self.group))


class TorchMoE(torch.nn.Module):
    """The layer in plain torch with the te_ops layer's weights (see the module docstring)."""

    def __init__(self, moe: te_ops.MoE, group: Any) -> None:
        super().__init__()
        self.top_k = moe.router.top_k
        self.num_experts = moe.router.num_experts
        self.router = torch.nn.Parameter(moe.router.weight.detach().clone())
        self.w1 = torch.nn.Parameter(moe.experts[0].weight.detach().clone())
        self.w2 = torch.nn.Parameter(moe.experts[2].weight.detach().clone())
        self.a2a = TorchDispatch(group, self.num_experts)

    def experts(self, h: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if h.is_cuda:
            offs = torch.cumsum(counts, 0).to(torch.int32)
            a, b = torch._grouped_mm(h, self.w1.transpose(-2, -1), offs=offs).chunk(2, -1)
            return torch._grouped_mm(F.silu(a) * b, self.w2.transpose(-2, -1), offs=offs)
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            a, b = F.linear(h[start:start + n], self.w1[e]).chunk(2, -1)
            outs.append(F.linear(F.silu(a) * b, self.w2[e]))
            start += n
        return torch.cat(outs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = F.linear(x, self.router).float().softmax(-1)
        top_p, top_i = scores.topk(self.top_k, -1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        flat = top_i.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        token = order // self.top_k
        h, local_counts, state = self.a2a.dispatch(x[token], counts)
        back = self.a2a.combine(self.experts(h, local_counts), state)
        weighted = back * top_p.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, weighted)


# ------------------------------------------------------------------------------ setup
def init_group(device_type: str) -> Any:
    """The process group of every rank: torchrun's (``WORLD_SIZE`` set) or, run as a plain
    script, a one-rank group; NCCL on CUDA, gloo on the CPU."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            import tempfile

            from torch.distributed import FileStore

            store = FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
            dist.init_process_group(backend, store=store, rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=300))
        else:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300))
    return dist.group.WORLD


def build_layer(args: argparse.Namespace, group: Any, device: torch.device, mode: str
                ) -> tuple[te_ops.MoE, te_ops.MoE]:
    """This rank's EP layer and the same layer without EP (every expert, no all-to-all ops),
    both from one seed."""
    torch.manual_seed(0)
    kw = dict(device=device, dtype=DTYPES[args.dtype])
    if mode == "capacity":
        kw["capacity_factor"] = args.capacity_factor
    full = te_ops.MoE(args.hidden, args.ffn, args.experts, args.top_k, **kw)
    moe = te_ops.MoE(args.hidden, args.ffn, args.experts, args.top_k, ep_group=group, **kw)
    moe.load_state_dict(full.state_dict())  # this rank's experts of the full layer
    return moe, full


def tokens(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(100 + dist.get_rank())
    shape = (args.tokens, args.hidden)
    x = torch.randn(shape, generator=gen, device=device, dtype=DTYPES[args.dtype])
    return x.requires_grad_(), torch.randn(shape, generator=gen, device=device, dtype=x.dtype)


def layer_steps(moe: te_ops.MoE, full: te_ops.MoE, peer: TorchMoE, x: torch.Tensor,
                dy: torch.Tensor, mode: str, device: torch.device) -> dict[str, Any]:
    """The timed layer steps: te_ops with EP, the torch peer, and ``te_ops_no_ep`` (the layer
    without EP on this rank's tokens, every expert local: at ep 1 the cost of the
    communication ops themselves); in capacity mode on CUDA also both te_ops layers in one
    CUDA graph."""
    def step_of(layer: te_ops.MoE):
        def te_step() -> None:
            y, aux = layer(x)
            y.backward(dy)
        return te_step

    def peer_step() -> None:
        peer(x).backward(dy)

    steps = {"te_ops": step_of(moe), "torch_a2a": peer_step, "te_ops_no_ep": step_of(full)}
    if mode == "capacity" and device.type == "cuda":
        for name, layer in (("te_ops_graph", moe), ("te_ops_no_ep_graph", full)):
            graphed = te_ops.graphs.make_graphed_callable(layer.block, (x,))

            def graph_step(graphed=graphed) -> None:
                y, *_ = graphed(x)
                y.backward(dy)

            steps[name] = graph_step
    return steps


def comm_steps(moe: te_ops.MoE, peer: TorchMoE, x: torch.Tensor, mode: str
               ) -> dict[str, Any]:
    """The dispatch + combine alone on the layer's own sorted rows."""
    with torch.no_grad():
        _, idx, probs, _ = moe.router(x)
        rows, split_sizes, row_probs, *_ = moe.permute(x, idx, probs)
    rows = rows.detach().requires_grad_()
    dispatch = te_ops.AllToAllDispatch(moe.router.num_experts, moe.ep_dispatch.group,
                                       capacity=mode == "capacity")
    combine = te_ops.AllToAllCombine(dispatch)
    for name in ("a2a_splits", "recv_index", "local_index"):
        combine.feed_extra_input(name, dispatch, name)
    block = te_ops.Sequential(dispatch, combine)
    dy = torch.randn_like(rows)

    def te_step() -> None:
        out, *_ = block(rows, split_sizes, row_probs)
        out.backward(dy)

    def peer_step() -> None:
        h, _, state = peer.a2a.dispatch(rows, split_sizes)
        peer.a2a.combine(h, state).backward(dy)

    return {"te_ops": te_step, "torch_a2a": peer_step}


def no_ep_of(peer: str) -> str:
    """The no-EP twin of a te_ops peer name (``te_ops_graph`` -> ``te_ops_no_ep_graph``)."""
    return peer.replace("te_ops", "te_ops_no_ep", 1) if peer.startswith("te_ops") and \
        "no_ep" not in peer else ""


def slowest_rank(ms: float, device: torch.device) -> float:
    t = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def run(args: argparse.Namespace, group: Any, device: torch.device, out: JsonLines | None
        ) -> list[dict]:
    records = []
    for mode in args.modes:
        records += run_mode(args, group, device, mode)
    for rec in records if out is not None else ():
        out.write(rec)
    return records


def run_mode(args: argparse.Namespace, group: Any, device: torch.device, mode: str
             ) -> list[dict]:
    moe, full = build_layer(args, group, device, mode)
    peer = TorchMoE(moe, group)
    x, dy = tokens(args, device)
    diff = None
    if mode == "dropless":
        with torch.no_grad():
            diff = slowest_rank(float((moe(x)[0].float() - peer(x).float()).abs().max()),
                                device)

    def clear_grads() -> None:
        x.grad = None
        for p in (*moe.parameters(), *full.parameters(), *peer.parameters()):
            p.grad = None

    records = []
    for part in args.parts:
        steps = (layer_steps(moe, full, peer, x, dy, mode, device) if part == "layer" else
                 comm_steps(moe, peer, x, mode))
        medians = {}
        for name, fn in steps.items():
            times = time_steps(fn, device, warmup=args.warmup, iters=args.iters,
                               before=clear_grads)
            medians[name] = slowest_rank(summarize_times(times)["ms_median"], device)
        for name, ms in medians.items():
            records.append({
                "bench": "moe_ep", "part": part, "mode": mode, "peer": name,
                "ep": dist.get_world_size(group), "experts": args.experts,
                "tokens_per_rank": args.tokens, "hidden": args.hidden, "ffn": args.ffn,
                "top_k": args.top_k, "dtype": args.dtype, "ms_median_slowest_rank": ms,
                "ratio_vs_torch_a2a": medians["torch_a2a"] / ms,
                # > 1: faster than the same layer without EP (graphed vs graphed)
                "ratio_vs_no_ep": (medians[no_ep_of(name)] / ms
                                   if no_ep_of(name) in medians else None),
                "max_abs_diff": diff if part == "layer" else None,
                "backend": te_ops.comm.backend(group), **machine_info(device)})
    return records


def table(records: list[dict]) -> str:
    lines = [f"{'part':17} {'mode':9} {'peer':18} {'ep':>3} {'ms':>9} {'vs torch':>8} "
             f"{'vs no-EP':>8}"]
    for r in records:
        no_ep = "" if r["ratio_vs_no_ep"] is None else f"{r['ratio_vs_no_ep']:.3f}"
        lines.append(f"{r['part']:17} {r['mode']:9} {r['peer']:18} {r['ep']:>3} "
                     f"{r['ms_median_slowest_rank']:>9.3f} {r['ratio_vs_torch_a2a']:>8.2f} "
                     f"{no_ep:>8}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--experts", type=int, default=64, help="all experts (divisible by ep)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=768, help="per expert")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    add_out_argument(parser, "moe_ep")
    args = parser.parse_args(argv)
    args.parts = check_list(parser, "--parts", args.parts, PARTS)
    args.modes = check_list(parser, "--modes", args.modes, MODES)
    for flag, value in (("--experts", args.experts), ("--tokens", args.tokens),
                        ("--hidden", args.hidden), ("--ffn", args.ffn),
                        ("--top-k", args.top_k), ("--iters", args.iters)):
        check_min(parser, flag, value, 1)
    check_min(parser, "--warmup", args.warmup, 0)
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark on every rank (torchrun's group, an initialized one, or one rank);
    rank 0 writes the records. Returns them (on every rank)."""
    args = parse_args(argv)
    device = torch.device(args.device if args.device == "cpu" else
                          f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = init_group(device.type)
    out = JsonLines(out_path(args.out, "moe_ep.jsonl")) if dist.get_rank() == 0 else None
    try:
        records = run(args, group, device, out)
    finally:
        if out is not None:
            out.close()
    if out is not None:
        print(table(records), file=sys.stderr)
    return records


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
