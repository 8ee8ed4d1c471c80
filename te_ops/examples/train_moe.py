"""Main job: train a small byte-level mixture-of-experts language model with te_ops experts.

``python -m te_ops.examples.train_moe [--steps N ...]``

The corpus is the documentation text shipped with Python (``pydoc_data.topics``), joined in
sorted key order and encoded as UTF-8 bytes (vocabulary 256); the last 10 % is the validation
split. The model is a decoder-only transformer: byte embedding + learned positions, ``--layers``
blocks of (pre-norm causal self-attention, pre-norm MoE), a final norm and an LM head tied to
the embedding. Each MoE block is one ``te_ops.MoE`` layer (:func:`moe_layer`): a softmax top-k
router with renormalized top-k probabilities and the Switch-Transformer load-balancing loss,
the (token, expert) pairs sorted by expert with device split sizes, the SwiGLU experts as one
grouped MLP ``GroupedLinear(E, d, 2 * ffn) -> ScaledSwiGLU -> GroupedLinear(E, ffn, d)`` and a
gather-sum back to token order, all in one ``te_ops.Sequential`` (no host sync in the layer).

``--hf-model {mixtral,qwen3_moe}`` trains a tiny Hugging Face transformers model of the same
sizes instead, with te_ops experts and with HF's eager experts (see ``hf_moe.py``).

``torchrun --nproc_per_node N -m te_ops.examples.train_moe --ep N`` trains the same model with
expert parallelism over the N processes (gloo on the CPU, NCCL with ``--device cuda``, one GPU
per process): each MoE block is ``te_ops.MoE(..., ep_group=...)`` holding ``--experts / N``
experts per rank, the rest of the model is data parallel (``DistributedDataParallel``), and
every rank takes its ``--batch-size / N`` sequences of the batch one process would draw, from
the one-process initial weights (:class:`ExpertParallel`), so the loss curve is the one-process
curve up to rounding. The dropless all-to-all reads its split sizes on the host once per layer
per step.

Results (config, per-eval losses, tokens/s, final validation loss over the whole validation
split, the unigram baseline, wall time, fusion plan) go to ``--out-dir/metrics.json`` and a loss
curve to ``--out-dir/loss.png``. ``TRAIN_MOE_PROGRESS=0`` (this script's own variable) hides the
progress bar.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import te_ops

__all__ = ["ExpertParallel", "MasterWeights", "MoELanguageModel", "moe_layer", "load_corpus",
           "unigram_cross_entropy", "main"]


# ---------------------------------------------------------------------------------- data
def load_corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """The byte corpus split 90/10: (train, validation), 1-D int64 tensors of byte values."""
    from pydoc_data.topics import topics

    data = "\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = int(0.9 * tokens.numel())
    return tokens[:cut], tokens[cut:]


@functools.lru_cache(maxsize=1)
def corpus_sizes() -> tuple[int, int]:
    """(train, validation) bytes of :func:`load_corpus`."""
    train, val = load_corpus()
    return train.numel(), val.numel()


def unigram_cross_entropy(train: torch.Tensor, val: torch.Tensor) -> tuple[float, float]:
    """(entropy of the training bytes, cross-entropy of the validation bytes), in nats.

    The byte distribution is estimated on the training split with add-one smoothing (so bytes
    unseen in training keep a finite cost).
    """
    counts = torch.bincount(train, minlength=256).double()
    p_train = counts / counts.sum()
    entropy = -(p_train[p_train > 0] * p_train[p_train > 0].log()).sum().item()
    p_smooth = (counts + 1) / (counts.sum() + 256)
    return entropy, -p_smooth.log()[val].mean().item()


def sample_batch(data: torch.Tensor, batch_size: int, seq_len: int,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs and next-byte targets, both (batch_size, seq_len), on the CPU."""
    if data.numel() - seq_len - 1 < 1:
        raise ValueError(f"--seq-len {seq_len} must be below {data.numel() - 1}: the split "
                         f"has {data.numel()} bytes")
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
    window = data[starts.unsqueeze(1) + torch.arange(seq_len + 1)]
    return window[:, :-1], window[:, 1:]


# ---------------------------------------------------------------------------------- model
def moe_layer(d_model: int, ffn: int, num_experts: int, top_k: int,
              ep_group: Any = None) -> te_ops.MoE:
    """The job's MoE layer: ``te_ops.MoE`` with a softmax top-k router (the k chosen
    probabilities renormalized to sum to 1) and the Switch-Transformer load-balancing loss at
    coefficient 1 (the job weights it by ``--aux-coef``); dropless, no shared experts.
    ``ep_group`` (``--ep``): expert parallel over it (this rank's experts; the loss is this
    rank's share of the group batch's); a one-process layer's state dict loads into it.

    Shapes
    ------
    input (batch, seq, d_model) -> (output of the same shape, load-balancing loss ()).
    """
    return te_ops.MoE(d_model, ffn, num_experts, top_k, score_function="softmax",
                      renormalize=True, aux_loss_coeff=1.0, ep_group=ep_group)


class Block(nn.Module):
    """Pre-norm causal self-attention followed by a pre-norm MoE block, both residual."""

    def __init__(self, d_model: int, heads: int, ffn: int, experts: int, top_k: int,
                 ep_group: Any = None) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.moe = moe_layer(d_model, ffn, experts, top_k, ep_group)
        self.graphed: Any = None  # a te_ops.graphs.GraphedCallable of `moe` (--cuda-graph)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        moe = self.graphed if self.graphed is not None and self.training else self.moe
        moe_out, aux = moe(self.norm2(x))
        return x + moe_out, aux


class MoELanguageModel(nn.Module):
    """Byte-level decoder-only MoE transformer with a tied LM head.

    ``ep_group``: each MoE block is :func:`moe_layer` over it (``--ep``).

    Shapes
    ------
    input (batch, seq) int64 bytes -> (logits (batch, seq, 256), summed aux loss ()).
    """

    def __init__(self, seq_len: int, layers: int, d_model: int, heads: int, ffn: int,
                 experts: int, top_k: int, ep_group: Any = None) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model={d_model} must be divisible by heads={heads}")
        self.embed = nn.Embedding(256, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(d_model, heads, ffn, experts, top_k, ep_group)
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        aux = x.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x, block_aux = block(x)
            aux = aux + block_aux
        return self.norm(x) @ self.embed.weight.t(), aux


# ---------------------------------------------------------------------------------- training
#: The job's default length: about two minutes on 2 idle CPU cores (one torch thread). The
#: validation loss is still falling there (~0.07 nats per 50 steps) and a one-ulp change of one
#: initial weight moved the final loss by up to 4 % (H200, bf16, seeds 0-2).
DEFAULT_STEPS = 600
#: ``--preset``: named configurations; an explicit flag overrides its value. ``recipe-compare``
#: trains 2000 steps, where the loss ends on a plateau and the same one-ulp change moves it by
#: at most 0.64 %, so recipes can be compared on it (docs/recipes.md).
PRESETS: dict[str, dict[str, Any]] = {"default": {}, "recipe-compare": {"steps": 2000}}
#: --hf-model trains two models (te_ops and HF eager experts) and compares their curves: it
#: keeps the shorter run it was measured with (docs/transformers.md).
DEFAULT_HF_STEPS = 600

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m te_ops.examples.train_moe",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps (default {DEFAULT_STEPS}, about two minutes on 2 idle "
                        "CPU cores; --preset recipe-compare: 2000, where the validation loss "
                        "ends on a plateau, docs/recipes.md. With --hf-model the default is "
                        f"{DEFAULT_HF_STEPS})")
    p.add_argument("--preset", choices=tuple(PRESETS), default="default",
                   help="recipe-compare: 2000 steps (the plateaued run recipes are compared "
                        "on); flags given explicitly override the preset")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 with --device cpu, where one thread was "
                        "faster than torch's default on a loaded 2-core machine and losses "
                        "depend on the thread count; torch's default with --device cuda)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=128, help="bytes per sequence")
    p.add_argument("--layers", type=int, default=2, help="transformer layers")
    p.add_argument("--d-model", type=int, default=128, help="model (hidden) width")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--experts", type=int, default=4, help="experts per MoE layer")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (<= --experts)")
    p.add_argument("--ffn", type=int, default=256, help="hidden size of each expert")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--aux-coef", type=float, default=0.01, help="load-balancing loss weight")
    p.add_argument("--seed", type=int, default=0, help="seed of init and data sampling")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to train")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of parameters and activations (see --master-weights)")
    p.add_argument("--master-weights", choices=("fp32", "none"), default="fp32",
                   help="with --dtype bfloat16: fp32 (default) keeps fp32 master weights and "
                        "fp32 AdamW state, the bf16 gradients are cast to fp32 and the updated "
                        "masters are copied back into the bf16 parameters after each step "
                        "(Megatron-LM's mixed-precision optimizer); none updates the bf16 "
                        "parameters in place with bf16 AdamW state. No effect with float32")
    p.add_argument("--eval-every", type=int, default=50, help="steps between evals")
    p.add_argument("--eval-batches", type=int, default=4,
                   help="fixed validation batches per periodic eval (the final eval uses the "
                        "whole validation split)")
    p.add_argument("--out-dir", default="runs/train_moe",
                   help="where metrics.json and loss.png go")
    p.add_argument("--recipe", choices=tuple(RECIPES), default="none",
                   help="low-precision recipe of the expert GEMMs (te_ops.autocast): fp8 = "
                        "Float8CurrentScaling, fp8fast = the same with "
                        "fast_accumulate_backward=True (Hopper's fast accumulation in dgrad / "
                        "wgrad too), mxfp8 = MXFP8BlockScaling, fp8block = Float8BlockScaling "
                        "(DeepSeek-V3's blockwise FP8; docs/recipes.md)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="capture each layer's te_ops.MoE (router to combine, forward and "
                        "backward) in CUDA graphs with te_ops.graphs.make_graphed_callable "
                        "(needs --device cuda)")
    p.add_argument("--hf-model", choices=("mixtral", "qwen3_moe"), default=None,
                   help="instead of the te_ops model, train a tiny Hugging Face transformers "
                        "model of that family (same sizes, from a config) twice: with te_ops "
                        "experts and with HF's eager experts, and report both loss curves "
                        "(needs transformers>=5: pip install 'te_ops[hf]')")
    p.add_argument("--compile", action="store_true",
                   help="train through torch.compile(model) (fullgraph without a recipe; the "
                        "te_ops.MoE layer is one graph call, docs/torch_compile.md)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks: launch with torchrun --nproc_per_node N "
                        "(gloo on cpu, nccl on cuda); --experts and --batch-size divisible by N")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend with --compile (aot_eager: same kernels as "
                        "eager, bit-identical losses)")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = PRESETS[args.preset].get(
            "steps", DEFAULT_HF_STEPS if args.hf_model else DEFAULT_STEPS)
    if args.threads is None and args.device == "cpu":
        args.threads = 1
    if args.compile and args.cuda_graph:
        p.error("--compile and --cuda-graph are exclusive (use torch.compile's "
                "mode='reduce-overhead' for CUDA graphs of a compiled model)")
    if args.hf_model and args.compile:
        p.error("--compile does not apply to --hf-model")
    if args.hf_model and args.cuda_graph:
        p.error("--cuda-graph does not apply to --hf-model")
    if args.hf_model and args.recipe != "none":  # the HF comparison runs without a recipe
        p.error(f"--recipe {args.recipe} does not apply to --hf-model (the HF comparison runs "
                "in the parameters' precision)")
    for name in ("steps", "batch_size", "seq_len", "layers", "d_model", "heads", "experts",
                 "top_k", "ffn", "eval_every", "eval_batches", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    longest = corpus_sizes()[1] - 2  # a window of seq_len + 1 bytes inside the validation split
    if args.seq_len > longest:
        p.error(f"--seq-len must be <= {longest} (the validation split has {longest + 2} "
                f"bytes), got {args.seq_len}")
    if args.d_model % args.heads:
        p.error(f"--d-model ({args.d_model}) must be divisible by --heads, got {args.heads}")
    if args.top_k > args.experts:
        p.error(f"--top-k must be <= --experts ({args.experts}), got {args.top_k}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if not args.lr > 0:  # (also catches nan)
        p.error(f"--lr must be > 0, got {args.lr}")
    if not args.aux_coef >= 0:
        p.error(f"--aux-coef must be >= 0 (a negative weight rewards imbalance), got "
                f"{args.aux_coef}")
    if args.ep != 1:
        _check_expert_parallel(p, args)
    if args.hf_model:
        _check_transformers(p)
    if args.compile:
        _check_compile_backend(p, args.compile_backend)
    return args


def _check_expert_parallel(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--ep N``: N processes (torchrun's, or an initialized process group), divisible
    sizes, and none of the flags the dropless expert-parallel layer cannot take."""
    import torch.distributed as dist

    if args.ep < 1:
        p.error(f"--ep must be >= 1, got {args.ep}")
    world = (dist.get_world_size() if dist.is_available() and dist.is_initialized() else
             int(os.environ.get("WORLD_SIZE", "1")))
    if world != args.ep:
        p.error(f"--ep {args.ep} needs {args.ep} processes (torchrun --nproc_per_node "
                f"{args.ep} -m te_ops.examples.train_moe --ep {args.ep}), got {world}")
    for flag, value in (("--experts", args.experts), ("--batch-size", args.batch_size)):
        if value % args.ep:
            p.error(f"{flag} must be divisible by --ep {args.ep}, got {value}")
    why = ("the dropless expert-parallel layer reads its all-to-all split sizes on the host "
           "every step")
    for flag, on in (("--cuda-graph", args.cuda_graph), ("--compile", args.compile)):
        if on:
            p.error(f"{flag} does not apply to --ep ({why})")
    if args.hf_model:
        p.error("--hf-model does not apply to --ep (the HF comparison runs in one process)")


def _check_transformers(p: argparse.ArgumentParser) -> None:
    """``--hf-model`` needs transformers >= 5 (the experts interface te_ops plugs into): a
    parser error naming the install command where it is missing or older."""
    from importlib import metadata

    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        p.error("--hf-model needs transformers>=5, which is not installed: "
                "pip install 'te_ops[hf]'")
    major = version.split(".")[0]
    if not major.isdigit() or int(major) < 5:
        p.error(f"--hf-model needs transformers>=5, got {version}: "
                "pip install -U 'transformers>=5'")


def _check_compile_backend(p: argparse.ArgumentParser, name: str) -> None:
    """``--compile-backend`` must name a registered ``torch.compile`` backend."""
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        p.error(f"--compile-backend must be a torch.compile backend such as inductor or "
                f"aot_eager (torch._dynamo.list_backends()), got {name!r}")


RECIPES = {"none": None, "fp8": te_ops.recipe.Float8CurrentScaling,
           "fp8fast": functools.partial(te_ops.recipe.Float8CurrentScaling,
                                        fast_accumulate_backward=True),
           "mxfp8": te_ops.recipe.MXFP8BlockScaling,
           "fp8block": te_ops.recipe.Float8BlockScaling}


def recipe_context(args: argparse.Namespace):
    """``te_ops.autocast`` with ``--recipe`` (disabled for ``none``)."""
    cls = RECIPES[args.recipe]
    return te_ops.autocast(enabled=cls is not None, recipe=cls() if cls else None)


def capture_moe_graphs(model: MoELanguageModel, args: argparse.Namespace,
                       device: torch.device, dtype: torch.dtype) -> None:
    """``--cuda-graph``: capture each layer's ``te_ops.MoE`` (router to combine, forward and
    backward) in CUDA graphs.

    A training step always gives the layer ``(batch, seq, d_model)`` tokens and every token
    goes to ``top_k`` experts, so the layer's shapes are fixed: only the routing (split sizes,
    probs, index maps, all on the device) changes, which a graph allows. Training steps replay
    the graphs; evaluation (other shapes, no backward) runs eagerly.
    """
    from te_ops.graphs import make_graphed_callable

    for block in model.blocks:
        x = torch.randn(args.batch_size, args.seq_len, args.d_model, device=device,
                        dtype=dtype, requires_grad=True)
        try:
            with recipe_context(args):
                block.graphed = make_graphed_callable(block.moe, (x,))
        except (ValueError, RuntimeError) as exc:  # not graph-safe here: say why and stop
            raise SystemExit(f"--cuda-graph: {exc}") from exc


def eval_with_recipe(model: MoELanguageModel, batches, device: torch.device,
                     args: argparse.Namespace) -> float:
    """:func:`evaluate` under ``--recipe``."""
    with recipe_context(args):
        return evaluate(model, batches, device)


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warmup over the first 5 % of steps, then cosine decay to 10 % of the peak."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: MoELanguageModel, batches: list[tuple[torch.Tensor, torch.Tensor]],
             device: torch.device) -> float:
    """Mean next-byte cross-entropy (nats) over the given batches, weighted by tokens."""
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        logits, _ = model(x.to(device))
        total += F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten(),
                                 reduction="sum").item()
        count += y.numel()
    model.train()
    return total / count


def whole_split_batches(data: torch.Tensor, seq_len: int, tokens_per_batch: int = 8192
                        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping windows covering ``data``, about ``tokens_per_batch`` tokens a batch."""
    n = (data.numel() - 1) // seq_len
    batch_size = max(1, tokens_per_batch // seq_len)
    x = data[: n * seq_len].view(n, seq_len)
    y = data[1: n * seq_len + 1].view(n, seq_len)
    return [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, n, batch_size)]


def fusion_summary(block: te_ops.Sequential, *sample: Any) -> tuple[str, dict[str, list[str]]]:
    """``block``'s fusion plan for a training call on ``sample`` (its inputs; nothing runs):
    (the ``explain()`` text, op names per pass)."""
    plan = block.fusers()[0].plan(*sample)
    ops = {"forward": [type(op).__name__ for op, _ in plan.forward_ops],
           "backward": [type(op).__name__ for op, _ in plan.backward_ops]}
    if hasattr(block, "explain"):
        try:
            return block.explain(*sample), ops
        except ImportError as exc:
            note = f"(explain() is unavailable: {exc})"
    else:
        note = "(explain() is unavailable in this te_ops)"
    return f"{note}\nforward ops: {ops['forward']}\nbackward ops: {ops['backward']}", ops


def moe_fusion_summary(moe: te_ops.MoE, device: torch.device, dtype: torch.dtype
                       ) -> tuple[str, dict[str, list[str]]]:
    """:func:`fusion_summary` of a ``te_ops.MoE`` layer (router to combine) for 16 tokens."""
    return fusion_summary(moe.block, torch.zeros(16, moe.hidden_size, device=device,
                                                 dtype=dtype))


def save_plot(evals: list[dict[str, float]], final_val: float, baseline: float,
              path: Path) -> None:
    """Loss curves (train, validation, final whole-split validation, unigram baseline), PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    steps = [e["step"] for e in evals]
    ax.plot(steps, [e["train_loss"] for e in evals], marker="o",
            label="train (mean since last eval)")
    ax.plot(steps, [e["val_loss"] for e in evals], marker="o", label="validation (fixed batches)")
    ax.plot(steps[-1:], [final_val], marker="*", markersize=12, linestyle="none",
            label="validation (whole split)")
    ax.axhline(baseline, linestyle="--", color="gray", label="unigram baseline")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/byte)", title="te_ops MoE byte LM")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train, evaluate and write ``metrics.json`` and ``loss.png``; returns the metrics."""
    start = time.perf_counter()
    args = parse_args(argv)
    if args.cuda_graph and args.device != "cuda":
        raise SystemExit("--cuda-graph needs --device cuda")
    threads = torch.get_num_threads()
    try:
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        with torch.random.fork_rng(devices=[]):  # leave the caller's CPU RNG as it was
            torch.manual_seed(args.seed)
            if args.hf_model:
                from .hf_moe import run as run_hf_model

                return run_hf_model(args, start)
            return train_and_report(args, start)
    finally:  # leave the caller's thread count as it was
        torch.set_num_threads(threads)


def environment() -> dict[str, Any]:
    """What the losses depend on besides the flags: the Python version (its bundled
    documentation is the corpus), the torch version, the CPU threads and the CPU (its vector
    unit picks the kernels' summation order), recorded in ``metrics.json``."""
    import platform
    import sys

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"python": platform.python_version(), "python_implementation":
            platform.python_implementation(), "torch": torch.__version__,
            "te_ops": te_ops.__version__, "threads": torch.get_num_threads(),
            "cpu": cpu, "machine": platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "platform": sys.platform}


class ExpertParallel:
    """``--ep N``: the process group and what expert parallelism changes in the job.

    The model starts from the one-process initial weights: a one-process model is built from
    the seed and the expert-parallel one loads its state dict (each rank keeps its experts).
    Every rank draws the batch one process would (the same generator) and takes its
    ``batch / N`` sequences. The non-expert parameters are data parallel
    (``DistributedDataParallel`` averages their gradients over the ranks); the expert weights
    are not in DDP: their gradients, brought back by the backward all-to-all, already hold
    every rank's tokens' contributions and are divided by N. Rank r's loss is
    ``CE_r + aux_coef * N * aux_r`` (``aux_r``: its share of the batch's balancing loss), so
    the mean over the ranks is the one-process loss. Evaluation runs every batch on every rank
    (every rank's experts serve every token), so it gives the one-process numbers; rank 0
    prints and writes the results.
    """

    def __init__(self, device: torch.device) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.owns_group = not dist.is_initialized()
        if self.owns_group:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        self.group = dist.group.WORLD
        self.size, self.rank = dist.get_world_size(), dist.get_rank()
        self.expert_params: list[torch.Tensor] = []

    @staticmethod
    def device(args: argparse.Namespace) -> torch.device:
        """CPU, or the GPU of this process (``LOCAL_RANK``)."""
        if args.device == "cuda":
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")

    def build(self, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
              ) -> tuple[MoELanguageModel, nn.Module]:
        """(the expert-parallel model, its DDP wrapper for training steps)."""
        from torch.nn.parallel import DistributedDataParallel

        sizes = (args.seq_len, args.layers, args.d_model, args.heads, args.ffn, args.experts,
                 args.top_k)
        one_process = MoELanguageModel(*sizes).to(device=device, dtype=dtype)
        model = MoELanguageModel(*sizes, ep_group=self.group).to(device=device, dtype=dtype)
        model.load_state_dict(one_process.state_dict())
        experts = [n for n, _ in model.named_parameters() if ".moe.experts." in n]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts)
        self.expert_params = [model.get_parameter(n) for n in experts]
        ids = [device.index] if device.type == "cuda" else None
        return model, DistributedDataParallel(model, device_ids=ids)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's sequences of a batch."""
        return t.chunk(self.size)[self.rank]

    def finish_grads(self) -> None:
        """Expert gradients divided by N (DDP's mean over the ranks)."""
        for p in self.expert_params:
            if p.grad is not None:
                p.grad.div_(self.size)

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        """The mean of ``t`` over the ranks."""
        t = t.detach().clone()
        self.dist.all_reduce(t)
        return t / self.size

    def close(self) -> None:
        if self.owns_group:
            self.dist.destroy_process_group()


def train_and_report(args: argparse.Namespace, start: float) -> dict[str, Any]:
    """The body of :func:`main` (``start``: its ``time.perf_counter()`` at entry)."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    ep = None
    if args.ep > 1:
        device = ExpertParallel.device(args)
        ep = ExpertParallel(device)
    try:
        return _train_and_report(args, start, device, dtype, ep)
    finally:
        if ep is not None:
            ep.close()


def _train_and_report(args: argparse.Namespace, start: float, device: torch.device,
                      dtype: torch.dtype, ep: ExpertParallel | None) -> dict[str, Any]:
    main_rank = ep is None or ep.rank == 0
    say = print if main_rank else (lambda *a, **k: None)
    train, val = load_corpus()
    entropy, baseline = unigram_cross_entropy(train, val)
    say(f"corpus: {train.numel()} train / {val.numel()} validation bytes; unigram entropy "
        f"{entropy:.4f} nats, unigram cross-entropy on validation {baseline:.4f} nats")

    if ep is None:
        model = MoELanguageModel(args.seq_len, args.layers, args.d_model, args.heads, args.ffn,
                                 args.experts, args.top_k).to(device=device, dtype=dtype)
        step_model: nn.Module = model
    else:
        model, step_model = ep.build(args, device, dtype)
    if args.cuda_graph:
        capture_moe_graphs(model, args, device, dtype)
    parallel = "" if ep is None else f" ({args.experts // ep.size} per rank, ep {ep.size})"
    say(f"model: {sum(p.numel() for p in model.parameters())} parameters"
        f"{' on this rank' if ep else ''}, {args.layers} layers, {args.experts} experts"
        f"{parallel}, top-{args.top_k}, {device}, {dtype}")
    eval_gen = torch.Generator().manual_seed(args.seed + 1)
    eval_batches = [sample_batch(val, args.batch_size, args.seq_len, eval_gen)
                    for _ in range(args.eval_batches)]
    evals, train_time = train_loop(model, train, eval_batches, args, device, start,
                                   step_model=step_model, ep=ep)

    with recipe_context(args):
        final_val = evaluate(model, whole_split_batches(val, args.seq_len), device)
        explain_text, fusions = moe_fusion_summary(model.blocks[0].moe, device, dtype)
    wall = time.perf_counter() - start
    metrics: dict[str, Any] = {
        "config": dict(vars(args)),
        "fp32_master_weights": keeps_fp32_masters(args),
        "evals": evals,
        "final_val_loss": final_val,
        "unigram_baseline": baseline,
        "unigram_train_entropy": entropy,
        "improvement_over_unigram": baseline - final_val,
        "train_tokens_per_s": args.steps * args.batch_size * args.seq_len / train_time,
        "wall_time_s": wall,
        "fusions": fusions,
        "versions": {"te_ops": te_ops.__version__, "torch": torch.__version__},
        "environment": environment(),
    }
    out_dir = Path(args.out_dir)
    if main_rank:
        out_dir.mkdir(parents=True, exist_ok=True)
    if not main_rank:
        return metrics
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    save_plot(evals, final_val, baseline, out_dir / "loss.png")
    print("\n=== summary ===")
    print(f"final validation loss (whole split): {final_val:.4f} nats/byte")
    print(f"unigram baseline:                    {baseline:.4f} nats/byte "
          f"(improvement {baseline - final_val:.4f})")
    print(f"training throughput: {metrics['train_tokens_per_s']:.0f} tokens/s; "
          f"wall time {wall:.1f} s")
    print("fusions in layer 0's MoE layer:")
    print(explain_text)
    print(f"wrote {out_dir / 'metrics.json'} and {out_dir / 'loss.png'}")
    return metrics


def keeps_fp32_masters(args: argparse.Namespace) -> bool:
    """Whether :func:`train_loop` keeps fp32 master weights (``--master-weights fp32`` with a
    low-precision ``--dtype``; no effect with float32): recorded in every job's metrics."""
    return args.master_weights == "fp32" and args.dtype != "float32"


def show_progress() -> bool:
    """``TRAIN_MOE_PROGRESS``: 1 (default) shows the tqdm progress bar, 0 hides it.

    Raises
    ------
    ValueError
        Any other value; the message names the variable.
    """
    value = os.environ.get("TRAIN_MOE_PROGRESS", "1").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(f"environment variable TRAIN_MOE_PROGRESS must be 0 or 1, got {value!r}")
    return value == "1"


class MasterWeights:
    """fp32 master copies of low-precision parameters (``--master-weights fp32``).

    The optimizer steps the masters; :meth:`take_grads` hands them the model's gradients cast
    to fp32 and :meth:`copy_back` writes the updated masters into the model's parameters in
    place (their storage does not move, so CUDA graphs that read them stay valid). This is the
    scheme of Megatron-LM's ``Float16OptimizerWithFloat16Params`` (bf16 compute, fp32 weights
    and optimizer state), which is how bf16 and FP8 models are trained in practice.

    Parameters
    ----------
    params : iterable of torch.Tensor
        The model's floating-point parameters, each once (``model.parameters()`` or a list);
        taken into a list, so a generator is read once here.

    Raises
    ------
    TypeError
        ``params`` is one tensor or a module, or an element is not a tensor (an optimizer's
        param-group dict is named as such), or not floating point (its dtype is named).
    ValueError
        ``params`` is empty (e.g. an exhausted generator), or the same tensor appears twice
        (its position is named: two masters would diverge).
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        if isinstance(params, (torch.Tensor, nn.Module)):
            got = (f"one tensor of shape {tuple(params.shape)}"
                   if isinstance(params, torch.Tensor) else f"a {type(params).__name__} module")
            raise TypeError("params must be an iterable of parameters (e.g. "
                            f"model.parameters()), got {got}")
        self.params = list(params)
        if not self.params:
            raise ValueError("params must hold at least one parameter, got an empty iterable "
                             "(an exhausted model.parameters() generator?)")
        seen: dict[int, int] = {}
        for i, p in enumerate(self.params):
            if isinstance(p, dict):
                raise TypeError(f"params[{i}] must be a floating-point tensor, got a dict "
                                f"with keys {sorted(map(str, p))[:8]} (optimizer param "
                                "groups are not taken: pass the tensors, then build the "
                                "groups from .masters)")
            if not isinstance(p, torch.Tensor) or not p.is_floating_point():
                got = p.dtype if isinstance(p, torch.Tensor) else type(p).__name__
                raise TypeError(f"params[{i}] must be a floating-point tensor, got {got}")
            if id(p) in seen:
                raise ValueError(f"params[{i}] is the same tensor as params[{seen[id(p)]}]: "
                                 "pass each parameter once")
            seen[id(p)] = i
        self.masters = [nn.Parameter(p.detach().float().clone()) for p in self.params]

    def take_grads(self) -> None:
        """``master.grad = param.grad.float()`` (``None`` stays ``None``)."""
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def copy_back(self) -> None:
        """Round the masters into the parameters (in place)."""
        torch._foreach_copy_(self.params, self.masters)

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        """``{"masters": [fp32 tensors]}`` in ``params`` order (save it with the optimizer's:
        the bf16 parameters alone lose the masters' low bits on resume)."""
        return {"masters": [m.detach().clone() for m in self.masters]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, list[torch.Tensor]]) -> None:
        """Restore the masters (in place, so the optimizer keeps its references) and round
        them into the parameters.

        Raises
        ------
        ValueError
            ``state`` is not a dict with a ``"masters"`` entry (its type or keys are named),
            ``state["masters"]`` has another length, or an entry is not a float32 tensor of
            its master's shape (the index, expected and actual values are named: a bf16
            entry would load without the low bits the masters exist to keep). Nothing is
            loaded when it raises.
        """
        if not isinstance(state, dict) or "masters" not in state:
            got = (f"a dict with keys {sorted(map(str, state))[:8]}" if isinstance(state, dict)
                   else type(state).__name__)
            raise ValueError("state must be a dict with a 'masters' entry (from "
                             f"MasterWeights.state_dict()), got {got}")
        saved = state["masters"]
        if not isinstance(saved, (list, tuple)) or len(saved) != len(self.masters):
            got = (f"{len(saved)}" if isinstance(saved, (list, tuple))
                   else type(saved).__name__)
            raise ValueError(f"state['masters'] must be a list of {len(self.masters)} "
                             f"tensors, got {got}")
        for i, (m, t) in enumerate(zip(self.masters, saved)):
            if not isinstance(t, torch.Tensor) or t.shape != m.shape or t.dtype != m.dtype:
                got = (f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                       else type(t).__name__)
                raise ValueError(f"state['masters'][{i}] must be a {m.dtype} tensor of shape "
                                 f"{tuple(m.shape)}, got {got}")
        for m, t in zip(self.masters, saved):
            m.copy_(t)
        self.copy_back()


def backward_step(forward: nn.Module, model: MoELanguageModel, x: torch.Tensor,
                  y: torch.Tensor, args: argparse.Namespace, ep: ExpertParallel | None
                  ) -> torch.Tensor:
    """One training step's forward and backward: the parameters' gradients of
    ``cross-entropy + aux_coef * aux`` (under ``--ep`` DDP's mean over the ranks of
    :class:`ExpertParallel`'s per-rank loss); returns the cross-entropy."""
    with recipe_context(args):
        logits, aux = forward(x)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    model.zero_grad(set_to_none=True)
    ranks = 1 if ep is None else ep.size
    (loss + args.aux_coef * ranks * aux).backward()  # aux: this rank's share under --ep
    if ep is not None:
        ep.finish_grads()
    return loss


def train_loop(model: MoELanguageModel, train: torch.Tensor,
               eval_batches: list[tuple[torch.Tensor, torch.Tensor]], args: argparse.Namespace,
               device: torch.device, start: float, step_model: nn.Module | None = None,
               ep: ExpertParallel | None = None) -> tuple[list[dict[str, float]], float]:
    """AdamW training with periodic evals; returns (eval records, seconds spent training).
    ``step_model``: what the training steps call (``model``, or its DDP wrapper under
    ``--ep``, whose steps :class:`ExpertParallel` describes)."""
    from tqdm.auto import tqdm

    params = list(model.parameters())
    master = None
    if keeps_fp32_masters(args) and any(p.dtype != torch.float32 for p in params):
        master = MasterWeights(params)
    optimizer = torch.optim.AdamW(master.masters if master else params, lr=args.lr,
                                  weight_decay=0.1)
    forward = model if step_model is None else step_model
    ranks = 1 if ep is None else ep.size
    if args.compile:  # training forward only; evaluation runs the eager model
        forward = torch.compile(model, fullgraph=args.recipe == "none",
                                backend=args.compile_backend)
    gen = torch.Generator().manual_seed(args.seed)
    evals: list[dict[str, float]] = []
    running = torch.zeros((), device=device)  # summed on the device: no sync per step
    running_steps, train_time, interval_time = 0, 0.0, 0.0
    shown = ep is None or ep.rank == 0
    progress = tqdm(range(args.steps), disable=not (show_progress() and shown),
                    desc="train", dynamic_ncols=True)
    for step in progress:
        t0 = time.perf_counter()
        x, y = sample_batch(train, args.batch_size, args.seq_len, gen)
        if ep is not None:
            x, y = ep.rows(x), ep.rows(y)
        x, y = x.to(device), y.to(device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr)
        loss = backward_step(forward, model, x, y, args, ep)
        if master is not None:
            master.take_grads()
        optimizer.step()
        if master is not None:
            master.copy_back()
        running += loss.detach()
        running_steps += 1
        log_now = (step + 1) % args.eval_every == 0 or step + 1 == args.steps
        if log_now and ep is not None:
            running = ep.mean(running)
        train_loss = running.item() / running_steps if log_now else 0.0  # syncs
        dt = time.perf_counter() - t0
        train_time, interval_time = train_time + dt, interval_time + dt
        if log_now:
            record = {
                "step": step + 1,
                "train_loss": train_loss,
                "val_loss": eval_with_recipe(model, eval_batches, device, args),
                "tokens_per_s": running_steps * x.numel() * ranks / interval_time,
                "elapsed_s": time.perf_counter() - start,
            }
            evals.append(record)
            progress.set_postfix(train=f"{record['train_loss']:.3f}",
                                 val=f"{record['val_loss']:.3f}")
            if shown:
                tqdm.write(f"step {record['step']:5d}  train {record['train_loss']:.4f}  "
                           f"val {record['val_loss']:.4f}  {record['tokens_per_s']:.0f} "
                           "tokens/s")
            running.zero_()
            running_steps, interval_time = 0, 0.0
    progress.close()
    return evals, train_time


if __name__ == "__main__":
    main()
