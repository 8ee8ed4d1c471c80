#!/usr/bin/env bash
# Two-GPU check (device kind nvidia-h200-x2), from the repository root:
#     OUT=/some/dir bash scripts/gpu_x2_check.sh
# 1. NCCL: tests/dist_check.py on 2 processes, one GPU each (DDP + FSDP2, per-expert and single
#    grouped weight) -> $OUT/dist_nccl.log
# 2. then, in parallel: GPU 0 runs the CUDA tests of training / FP8 / compile and
#    benchmarks/main_grad.py; GPU 1 runs the FP8 step profile (E8) and the host profile (E64).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/runs}"; mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/env.log"
timeout 240 torchrun --nproc_per_node 2 tests/dist_check.py --backend nccl 2>&1 | tee "$OUT/dist_nccl.log"
echo "dist_nccl rc=${PIPESTATUS[0]}" | tee -a "$OUT/dist_nccl.log"
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 300 python3 -m pytest -q -m cuda tests/test_training.py tests/test_quantization_cuda.py \
      tests/test_torch_compile_cuda.py -p no:cacheprovider > "$OUT/gpu0_tests.log" 2>&1
  echo "tests rc=$?" >> "$OUT/gpu0_tests.log"
  timeout 120 python3 benchmarks/main_grad.py --out "$OUT/main_grad.jsonl" > "$OUT/main_grad.log" 2>&1
  echo "main_grad rc=$?" >> "$OUT/main_grad.log"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 150 python3 benchmarks/profile_recipe.py --recipe fp8fast --rows 40 > "$OUT/profile_fp8fast.log" 2>&1
  echo "rc=$?" >> "$OUT/profile_fp8fast.log"
  timeout 150 python3 benchmarks/profile_grouped_mlp.py --shapes E64_T256_H2048_FF768 --cprofile \
      --top 30 --out "$OUT/profile_e64.jsonl" > "$OUT/profile_e64.log" 2>&1
  echo "rc=$?" >> "$OUT/profile_e64.log"
) &
wait
tail -3 "$OUT"/*.log
