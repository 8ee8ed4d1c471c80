"""The main job's ``--hf-model`` mode: a tiny Hugging Face transformers MoE model, with te_ops
experts and with HF's eager experts, on the main job's corpus.

``python -m te_ops.examples.train_moe --hf-model {mixtral,qwen3_moe}`` builds the model from a
config (random init, no download) with the main job's sizes (``--layers --d-model --heads
--experts --top-k --ffn --seq-len``, byte vocabulary of 256), then trains it twice from the same
initial weights on the same batches: once with ``experts_implementation="te_ops"`` (through
:func:`te_ops.integrations.transformers.use_te_ops`) and once with HF's ``"eager"`` experts
loop. It reports both loss curves and the relative difference of the final validation losses.
Needs transformers >= 5 (``pip install 'te_ops[hf]'``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import te_ops

HF_MODELS = ("mixtral", "qwen3_moe")


def hf_config(name: str, args: argparse.Namespace) -> Any:
    """A transformers config of the main job's sizes (every layer sparse, no dropout)."""
    import transformers

    common = dict(vocab_size=256, hidden_size=args.d_model, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.heads,
                  max_position_embeddings=args.seq_len, num_experts_per_tok=args.top_k,
                  router_aux_loss_coef=args.aux_coef, tie_word_embeddings=True)
    if name == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=args.ffn,
                                          num_local_experts=args.experts)
    if name == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=args.ffn,
                                           moe_intermediate_size=args.ffn,
                                           num_experts=args.experts, norm_topk_prob=True,
                                           head_dim=args.d_model // args.heads)
    raise ValueError(f"--hf-model must be one of {HF_MODELS}, got {name!r}")


class HFCausalLM(nn.Module):
    """Adapts an HF ``*ForCausalLM`` to the main job's interface: ``idx -> (logits, aux)``.

    Shapes: idx (batch, seq) int64 -> logits (batch, seq, 256), aux () (HF's load-balancing
    loss while training, 0 in eval).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(input_ids=idx, output_router_logits=self.training, use_cache=False)
        aux = out.aux_loss if out.aux_loss is not None else out.logits.new_zeros(())
        return out.logits, aux.float()


def build(name: str, args: argparse.Namespace, implementation: str, device: torch.device,
          dtype: torch.dtype) -> HFCausalLM:
    """The HF model (seeded init: both implementations start from the same weights)."""
    import transformers

    from te_ops.integrations.transformers import use_te_ops

    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name, args))
    model = model.to(device=device, dtype=dtype)
    if implementation == "te_ops":
        use_te_ops(model)
    else:
        model.set_experts_implementation(implementation)
    return HFCausalLM(model)


def run(args: argparse.Namespace, start: float) -> dict[str, Any]:
    """Train with te_ops experts, then with HF eager experts; write metrics and a plot."""
    from te_ops.integrations.transformers import experts_block

    from . import train_moe as job

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    train, val = job.load_corpus()
    entropy, baseline = job.unigram_cross_entropy(train, val)
    eval_gen = torch.Generator().manual_seed(args.seed + 1)
    eval_batches = [job.sample_batch(val, args.batch_size, args.seq_len, eval_gen)
                    for _ in range(args.eval_batches)]
    runs: dict[str, dict[str, Any]] = {}
    explain_text, fusions = "", {}
    for impl in ("te_ops", "eager"):
        model = build(args.hf_model, args, impl, device, dtype)
        print(f"{args.hf_model} ({impl} experts): "
              f"{sum(p.numel() for p in model.parameters())} parameters")
        t0 = time.perf_counter()
        evals, train_time = job.train_loop(model, train, eval_batches, args, device, t0)
        final = job.evaluate(model, job.whole_split_batches(val, args.seq_len), device)
        runs[impl] = {"evals": evals, "final_val_loss": final, "train_time_s": train_time,
                      "train_tokens_per_s": args.steps * args.batch_size * args.seq_len
                      / train_time}
        if impl == "te_ops":
            experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
            explain_text, fusions = experts_fusion_summary(experts_block(experts), device,
                                                           dtype)
    rel = abs(runs["te_ops"]["final_val_loss"] - runs["eager"]["final_val_loss"]) / abs(
        runs["eager"]["final_val_loss"])
    metrics: dict[str, Any] = {
        "config": dict(vars(args)), "hf_model": args.hf_model, "runs": runs,
        "evals": runs["te_ops"]["evals"], "final_val_loss": runs["te_ops"]["final_val_loss"],
        "final_val_loss_rel_diff": rel, "fp32_master_weights": job.keeps_fp32_masters(args),
        "unigram_baseline": baseline,
        "unigram_train_entropy": entropy, "wall_time_s": time.perf_counter() - start,
        "fusions": fusions,
        "versions": {"te_ops": te_ops.__version__, "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__},
        "environment": job.environment(),
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    save_plot(runs, baseline, args.hf_model, out_dir / "loss.png")
    print(f"\n=== summary ({args.hf_model}) ===")
    for impl, r in runs.items():
        print(f"{impl:7s} experts: final validation loss {r['final_val_loss']:.4f} nats/byte, "
              f"{r['train_tokens_per_s']:.0f} tokens/s")
    print(f"relative difference of the final losses: {rel:.2e}; unigram baseline "
          f"{baseline:.4f}; wall time {metrics['wall_time_s']:.1f} s")
    print("fusions in layer 0's te_ops expert block:")
    print(explain_text)
    print(f"wrote {out_dir / 'metrics.json'} and {out_dir / 'loss.png'}")
    return metrics


def experts_fusion_summary(block: te_ops.Sequential, device: torch.device, dtype: torch.dtype
                           ) -> tuple[str, dict[str, list[str]]]:
    """The main job's ``fusion_summary`` of a te_ops expert block ``GroupedLinear ->
    ScaledSwiGLU -> GroupedLinear`` for two rows per expert."""
    from . import train_moe as job

    e = block[0].num_groups
    x = torch.zeros(2 * e, block[0].in_features, device=device, dtype=dtype)
    split = torch.full((e,), 2, device=device)
    return job.fusion_summary(block, x, split, torch.ones(2 * e, device=device, dtype=dtype),
                              split)


def save_plot(runs: dict[str, dict[str, Any]], baseline: float, name: str, path: Path) -> None:
    """Validation and train curves of both runs beside each other, PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for impl, style in (("te_ops", "-"), ("eager", "--")):
        evals = runs[impl]["evals"]
        steps = [e["step"] for e in evals]
        ax.plot(steps, [e["train_loss"] for e in evals], style, marker="o",
                label=f"train, {impl} experts")
        ax.plot(steps, [e["val_loss"] for e in evals], style, marker="s",
                label=f"validation, {impl} experts")
    ax.axhline(baseline, linestyle=":", color="gray", label="unigram baseline")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/byte)",
           title=f"transformers {name}: te_ops vs eager experts")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
