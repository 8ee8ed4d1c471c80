"""Which FP8 GEMM adds how much gradient error in the main job's model.

Trains the main job's model (``te_ops.examples.train_moe`` defaults, fp32 parameters, no recipe)
for ``--warm`` steps, then runs one forward+backward on the next training batch without a recipe
and under ``Float8CurrentScaling`` variants that quantize only some GEMMs (the others kept in
high precision with the recipe's ``*_high_precision`` flags). For each variant it prints one JSON
line: the loss and the relative Frobenius error of the gradients against the no-recipe ones,
grouped as fc1 weights, fc2 weights and the rest of the model (attention, norms, router,
embeddings). fp32 parameters keep bf16 rounding out of the comparison. Usage:
``python benchmarks/recipe_gemm_error.py [--warm 300] [--device cpu] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import JsonLines, machine_info  # noqa: E402

import te_ops  # noqa: E402
from te_ops.examples import train_moe  # noqa: E402
from te_ops.recipe import Float8CurrentScaling  # noqa: E402

#: variant name -> the GEMMs it keeps in high precision
VARIANTS = {
    "fp8": (),
    "fp8_fprop_only": ("dgrad", "wgrad"),
    "fp8_dgrad_only": ("fprop", "wgrad"),
    "fp8_wgrad_only": ("fprop", "dgrad"),
    "fp8_wgrad_high_precision": ("wgrad",),
}


def warm_model(args: argparse.Namespace, device: torch.device):
    """The main job's model after ``args.warm`` AdamW steps (its schedule, fp32, no recipe),
    and the next training batch."""
    d = train_moe.parse_args([])
    torch.manual_seed(args.seed)
    train, _ = train_moe.load_corpus()
    model = train_moe.MoELanguageModel(d.seq_len, d.layers, d.d_model, d.heads, d.ffn,
                                       d.experts, d.top_k).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=d.lr, weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    for step in range(args.warm):
        x, y = (t.to(device) for t in train_moe.sample_batch(train, d.batch_size, d.seq_len, gen))
        for group in opt.param_groups:
            group["lr"] = train_moe.lr_at(step, d.steps, d.lr)
        logits, aux = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) + d.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    batch = tuple(t.to(device) for t in train_moe.sample_batch(train, d.batch_size, d.seq_len,
                                                               gen))
    return model, batch, d.aux_coef


def gradients(model, batch, aux_coef: float, recipe) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, flattened fp64 gradients of fc1 weights / fc2 weights / the rest)."""
    x, y = batch
    model.zero_grad(set_to_none=True)
    with te_ops.autocast(enabled=recipe is not None, recipe=recipe):
        logits, aux = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    (loss + aux_coef * aux).backward()
    parts: dict[str, list[torch.Tensor]] = {"fc1": [], "fc2": [], "rest": []}
    for name, p in model.named_parameters():
        key = ("fc1" if ".experts.0." in name else "fc2" if ".experts.2." in name else "rest")
        parts[key].append(p.grad.detach().double().flatten())
    return loss.item(), {k: torch.cat(v) for k, v in parts.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--warm", type=int, default=300, help="no-recipe training steps first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = p.parse_args()
    device = torch.device(args.device)
    model, batch, aux_coef = warm_model(args, device)
    out = JsonLines(args.out)
    loss0, g0 = gradients(model, batch, aux_coef, None)
    for name, keep in VARIANTS.items():
        recipe = Float8CurrentScaling(**{f"{g}_high_precision": True for g in keep})
        loss, g = gradients(model, batch, aux_coef, recipe)
        out.write({"bench": "recipe_gemm_error", "variant": name, "warm_steps": args.warm,
                   "seed": args.seed, "loss": loss, "loss_no_recipe": loss0,
                   **{f"grad_rel_err_{k}": ((g[k] - g0[k]).norm() / g0[k].norm()).item()
                      for k in g0},
                   **machine_info(device)})
    out.close()


if __name__ == "__main__":
    main()
