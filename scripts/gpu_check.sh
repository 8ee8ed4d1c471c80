#!/usr/bin/env bash
# GPU check of te_ops, run from the repository root on the GPU machine:
#
#     OUT=/some/dir bash scripts/gpu_check.sh                  # every step (default OUT: ./runs)
#     STEPS="env cuda_tests" bash scripts/gpu_check.sh         # the tests (limits 9.5 min)
#     STEPS="env bench" bash scripts/gpu_check.sh              # headline numbers (limits 4.5 min)
#     STEPS="env bench_fp8" bash scripts/gpu_check.sh          # the FP8 table (limits 9.5 min)
#     STEPS="env bench_fp8block" bash scripts/gpu_check.sh     # blockwise FP8 (limits 7.5 min)
#     STEPS="env bench_variants profile profile_recipe memory peak recompute" \
#         bash scripts/gpu_check.sh                            # the rest (limits 7.7 min)
#     STEPS="env moe_layer" bash scripts/gpu_check.sh          # the whole layer (limits 9.5 min)
#     STEPS="env moe_ep" bash scripts/gpu_check.sh             # expert parallelism (limits 3.5 min)
#
# On one GPU with a 10-minute limit per command: one call per line above (the limits are upper
# bounds per step; a step that hits its limit is reported as TIMEOUT and the next one runs).
#
# Each step runs under `timeout` (its limit is the number after its name below) and is logged to
# "$OUT/<step>.log" through `tee`, so the logs come back even when a step or the whole script is
# cut short. Each benchmark writes its records to its own folder "$OUT/<step>/".
# Steps:
#   env             nvidia-smi, torch / CUDA / Triton / te_ops versions, the GPU's capability
#   dist_nccl       (2+ GPUs only) tests/dist_check.py on 2 processes over NCCL (DDP, FSDP2)
#   test lane:
#     cuda_tests    python -m pytest -q -m cuda tests, CUDA_TEST_SHARDS processes at once
#                   (default 3) through scripts/sharded_pytest.py; shard logs
#                   "$OUT/cuda_tests_shard<k>.log"
#     cpu_tests     python -m pytest -q -x -m "not cuda" tests (not in the default STEPS: CI runs
#                   the CPU suite)
#     main_job_mxfp8  scripts/main_job_seeds.py: bf16 vs MXFP8 final validation loss, seeds 0-2
#   benchmark lane (every script of benchmarks/, see benchmarks/README.md):
#     bench         benchmarks/grouped_mlp.py: te_ops' default block vs the eager torch._grouped_mm
#                   peer and its torch.compile(fullgraph=True) twin, bf16, the four GPU shapes,
#                   3 rounds (the table of docs/performance.md)
#     bench_fp8     benchmarks/grouped_mlp.py --recipe none,fp8,fp8fast --align 16: te_ops under
#                   the FP8 recipes vs bf16, the eager peer and torchao's FP8 grouped GEMM
#                   (skipped, saying so, without torchao), and te_ops as the later
#                   micro-batches of an accumulation step (te_ops_microbatch), the six FP8
#                   shapes, 3 rounds
#     bench_fp8block  benchmarks/grouped_mlp.py --recipe none,fp8block --align 16: te_ops under
#                   Float8BlockScaling vs bf16 (and as later micro-batches), the six FP8 shapes
#     bench_variants  benchmarks/grouped_mlp.py: te_ops' default vs packed / per-expert weights,
#                   unfused, CUDA-graphed and compiled, E64 decode and E128, 3 rounds
#     profile       benchmarks/profile_grouped_mlp.py: top kernels / aten ops / host ops per step,
#                   te_ops vs the eager peer, the four GPU shapes
#     profile_recipe  benchmarks/profile_recipe.py: kernels of one FP8 step at E8
#     memory        benchmarks/memory_report.py on CUDA: saved bytes and op counts, fused vs not
#     peak          benchmarks/peak_memory_breakdown.py --small: what is live at one step's memory
#                   peak, the eager peer vs te_ops, E128 / E32 / E64
#     recompute     benchmarks/recompute_layers.py: 4 stacked blocks, fc1 recompute off vs on (E8)
#     moe_layer     benchmarks/moe_layer.py: te_ops.MoE (eager, compiled, CUDA-graphed) vs a
#                   torchtitan-style torch layer (eager and compiled), router to combine, fwd+bwd,
#                   bf16, the three layer shapes, 3 rounds, with saved-activation bytes and peaks
#     moe_ep        benchmarks/moe_ep.py on this one GPU (ep 1, one NCCL rank): te_ops' EP
#                   dispatch + combine and the whole te_ops.MoE step vs the plain torch
#                   all_to_all_single peer, dropless and capacity (+ CUDA graph); on N GPUs run
#                   it by hand: torchrun --nproc_per_node N benchmarks/moe_ep.py
#     main_job      scripts/compare_main_job.py: the main job at 600 steps, bf16 eager vs
#                   --cuda-graph (each te_ops.MoE layer in one CUDA graph; the loss curves must
#                   agree bit for bit)
#     main_job_seeds  scripts/main_job_seeds.py: bf16 vs FP8 (and fast accumulation) final
#                   validation loss, seeds 0-2, 2000 steps
#   summary         the step table, the test tallies and each benchmark's summary
#                   -> "$OUT/summary.log"
# With two or more GPUs the two lanes run at the same time (tests on GPU 0, benchmarks on GPU 1);
# on one GPU one after the other. The exit status is 0 only when every step passed.
# Knobs: PYTHON (default python3), STEPS (space-separated step names; default all but
# cpu_tests), CUDA_TEST_SHARDS (default 3), CPU_TESTS (default "tests"), BENCH_ARGS (extra
# benchmarks/grouped_mlp.py arguments, e.g. "--iters 5").

set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/runs}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
: > "$OUT/steps.txt"
WANT=" ${STEPS:-env dist_nccl cuda_tests main_job_mxfp8 bench bench_fp8 bench_fp8block bench_variants profile profile_recipe memory peak recompute moe_layer moe_ep main_job main_job_seeds} "
GPU_SHAPES=E8_T16384_H4096_FF14336,E128_T65536_H2048_FF768,E32_T32768_H7168_FF2048,E64_T256_H2048_FF768

# step NAME SECONDS COMMAND...: run COMMAND under a timeout, tee its output to $OUT/NAME.log.
step() {
    local name=$1 secs=$2
    shift 2
    [[ "$WANT" == *" $name "* ]] || return 0
    echo "=== [$name] $* (timeout ${secs}s)"
    local start=$SECONDS
    timeout --kill-after=15 "$secs" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    local took=$((SECONDS - start))
    local verdict=ok
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        verdict="TIMEOUT"
    elif [ "$rc" -ne 0 ]; then
        verdict="FAILED(rc=$rc)"
    fi
    printf '%-15s %-14s %4ss\n' "$name" "$verdict" "$took" >> "$OUT/steps.txt"
    echo "=== [$name] $verdict in ${took}s"
}

step env 30 bash -c "nvidia-smi || echo 'nvidia-smi not available'; $PY - <<'EOF'
import torch
print('torch', torch.__version__, 'cuda', torch.version.cuda,
      'available', torch.cuda.is_available())
if torch.cuda.is_available():
    print('gpu', torch.cuda.get_device_name(), 'capability', torch.cuda.get_device_capability())
try:
    import triton
    print('triton', triton.__version__)
except ImportError as exc:
    print('triton not importable:', exc)
import te_ops
print('te_ops', te_ops.__version__, 'from', te_ops.__file__)
EOF
git log -1 --format='commit %H' 2>/dev/null || true"

NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${NGPU:-0}" -ge 2 ]; then
    step dist_nccl 240 "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests/dist_check.py --backend nccl
fi

test_lane() {
    step cuda_tests 540 "$PY" scripts/sharded_pytest.py --shards "${CUDA_TEST_SHARDS:-3}" \
        --log-dir "$OUT" --name cuda_tests -- -q -m cuda tests -p no:cacheprovider --durations=8
    # shellcheck disable=SC2086  # CPU_TESTS may name several paths
    step cpu_tests 420 "$PY" -m pytest -q -x -m "not cuda" ${CPU_TESTS:-tests} -p no:cacheprovider
    step main_job_mxfp8 240 "$PY" scripts/main_job_seeds.py --device cuda --recipes none,mxfp8 \
        --seeds 0,1,2 --parallel 6 --out "$OUT/main_job_mxfp8"
}

bench_lane() {
    # shellcheck disable=SC2086  # BENCH_ARGS holds several arguments
    step bench 240 "$PY" benchmarks/grouped_mlp.py --shapes "$GPU_SHAPES" --rounds 3 \
        --iters 20 --warmup 3 --out "$OUT/bench" ${BENCH_ARGS:-}
    # shellcheck disable=SC2086
    step bench_fp8 540 "$PY" benchmarks/grouped_mlp.py --shapes fp8 \
        --peers torch_grouped_mm,te_ops,te_ops_microbatch,torchao_fp8 \
        --recipe none,fp8,fp8fast --align 16 \
        --rounds 3 --iters 6 --warmup 2 --out "$OUT/bench_fp8" ${BENCH_ARGS:-}
    # shellcheck disable=SC2086
    step bench_fp8block 420 "$PY" benchmarks/grouped_mlp.py --shapes fp8 \
        --peers te_ops,te_ops_microbatch --recipe none,fp8block --align 16 \
        --rounds 3 --iters 6 --warmup 2 --out "$OUT/bench_fp8block" ${BENCH_ARGS:-}
    # shellcheck disable=SC2086
    step bench_variants 180 "$PY" benchmarks/grouped_mlp.py \
        --shapes E64_T256_H2048_FF768,E128_T65536_H2048_FF768 \
        --peers torch_grouped_mm,te_ops,te_ops_packed,te_ops_per_expert,te_ops_unfused,te_ops_graph,te_ops_compiled \
        --rounds 3 --iters 20 --warmup 3 --out "$OUT/bench_variants" ${BENCH_ARGS:-}
    step profile 60 "$PY" benchmarks/profile_grouped_mlp.py --shapes "$GPU_SHAPES" \
        --out "$OUT/profile"
    step profile_recipe 40 "$PY" benchmarks/profile_recipe.py --shape E8_T16384_H4096_FF14336 \
        --recipe fp8 --out "$OUT/profile_recipe"
    step memory 30 "$PY" benchmarks/memory_report.py --device cuda --dtype bfloat16 --experts 8 \
        --tokens 16384 --hidden 1024 --ffn 2048 --out "$OUT/memory"
    step peak 60 "$PY" benchmarks/peak_memory_breakdown.py --small \
        --shapes E128_T65536_H2048_FF768,E32_T32768_H7168_FF2048,E64_T256_H2048_FF768 \
        --peers torch_grouped_mm,te_ops --out "$OUT/peak"
    step recompute 60 "$PY" benchmarks/recompute_layers.py --shape E8_T16384_H4096_FF14336 \
        --layers 4 --out "$OUT/recompute"
    step moe_layer 540 "$PY" benchmarks/moe_layer.py --rounds 3 --iters 10 --warmup 3 \
        --out "$OUT/moe_layer"
    step moe_ep 180 "$PY" benchmarks/moe_ep.py --iters 20 --warmup 5 --out "$OUT/moe_ep"
    step main_job 90 "$PY" scripts/compare_main_job.py --out "$OUT/main_job"
    step main_job_seeds 160 "$PY" scripts/main_job_seeds.py --device cuda \
        --recipes none,fp8,fp8fast --parallel 9 --seeds 0,1,2 --out "$OUT/main_job_seeds"
}

if [ "${NGPU:-0}" -ge 2 ]; then
    (export CUDA_VISIBLE_DEVICES=0; test_lane) &
    (export CUDA_VISIBLE_DEVICES=1; bench_lane) &
    wait
else
    test_lane
    bench_lane
fi

{
    echo
    echo "==================== summary ===================="
    cat "$OUT/steps.txt"
    for t in cuda_tests cpu_tests; do
        if [ -f "$OUT/$t.log" ]; then
            echo "$t: $(grep -E '^[0-9]+ (passed|failed)|(passed|failed|error|skipped).* in [0-9.]+s' "$OUT/$t.log" | tail -n 1)"
            grep -E '^(FAILED|ERROR) ' "$OUT/$t.log" | head -n 20
        fi
    done
    for b in bench bench_fp8 bench_fp8block bench_variants moe_layer; do
        if [ -s "$OUT/$b/summary.txt" ]; then
            echo
            echo "## $b"
            cat "$OUT/$b/summary.txt"
        fi
    done
    if [ -s "$OUT/profile/profile.jsonl" ]; then
        echo
        "$PY" benchmarks/profile_grouped_mlp.py --summarize "$OUT/profile/profile.jsonl" --top 6
    fi
    grep -hE '^(recipe |max \|eager| +eager:| +cuda-graph:)' "$OUT/main_job.log" 2>/dev/null
    grep -hE '^(recipe|none|fp8|fp8fast|mxfp8) ' "$OUT/main_job_seeds.log" \
        "$OUT/main_job_mxfp8.log" 2>/dev/null
    if [ -s "$OUT/peak.log" ]; then  # each peer's peak (the step's own)
        echo
        grep -E "^## " "$OUT/peak.log"
    fi
    echo "logs: $OUT"
} 2>&1 | tee "$OUT/summary.log"

if grep -qv " ok " "$OUT/steps.txt"; then exit 1; fi
exit 0
