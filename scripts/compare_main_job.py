"""Run the main job on CUDA eagerly and with --cuda-graph (bf16, same seed); compare the curves.

With ``--recipes fp8,mxfp8`` the job also runs under those recipes (same seed) and prints each
final validation loss against bf16's.

Exit status 0 when every logged train/validation loss agrees within ``--tol`` (default 0:
bit-identical, since the graph replays the same kernels on the same inputs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from te_ops.examples import train_moe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs")
    parser.add_argument("--tol", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--recipes", default="",
                        help="comma-separated recipes (fp8, mxfp8) also run eagerly; their "
                             "final validation loss is printed against bf16's (information "
                             "only: the exit status is the eager / cuda-graph comparison)")
    args = parser.parse_args()
    os.environ["TRAIN_MOE_PROGRESS"] = "0"
    common = ["--device", "cuda", "--dtype", "bfloat16", "--steps", str(args.steps)]
    eager = train_moe.main([*common, "--out-dir", f"{args.out}/job_eager"])
    graph = train_moe.main([*common, "--cuda-graph", "--out-dir", f"{args.out}/job_graph"])
    for name, m in (("eager", eager), ("cuda-graph", graph)):
        print(f"{name:>10}: final val loss {m['final_val_loss']:.4f}, "
              f"{m['train_tokens_per_s']:.0f} tokens/s, wall {m['wall_time_s']:.1f} s")
    pairs = list(zip(eager["evals"], graph["evals"], strict=True))
    diff = max(abs(a[k] - b[k]) for a, b in pairs for k in ("train_loss", "val_loss"))
    diff = max(diff, abs(eager["final_val_loss"] - graph["final_val_loss"]))
    print(f"max |eager - cuda-graph| over {len(pairs)} evals and the final loss: {diff:.3g}")
    print(json.dumps({"eager": eager["evals"][-1], "graph": graph["evals"][-1]}))
    for recipe in filter(None, args.recipes.split(",")):
        m = train_moe.main([*common, "--recipe", recipe, "--out-dir", f"{args.out}/job_{recipe}"])
        rel = m["final_val_loss"] / eager["final_val_loss"] - 1
        print(f"recipe {recipe}: final val loss {m['final_val_loss']:.4f} ({rel:+.2%} vs bf16), "
              f"{m['train_tokens_per_s']:.0f} tokens/s")
        print(json.dumps({"recipe": recipe, "final_val_loss": m["final_val_loss"],
                          "bf16_final_val_loss": eager["final_val_loss"], "rel": rel}))
    return 0 if diff <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
