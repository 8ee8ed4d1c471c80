#!/usr/bin/env bash
# GPU check of te_ops, run from the repository root on the GPU machine:
#
#     bash scripts/gpu_check.sh            # logs and JSON lines go to $OUT (default ./runs)
#
# Steps (each under `timeout`, each logged to "$OUT/<step>.log" through `tee`, so the logs come
# back even when a step or the whole script is cut short):
#   1. env        nvidia-smi, torch / CUDA / Triton versions, the GPU's capability
#   2. cuda_tests python -m pytest -q -m cuda tests      (the GPU tests)
#   3. cpu_tests  python -m pytest -q -x -m "not cuda" tests   (the CPU suite, on this box)
#   4. bench      benchmarks/grouped_mlp.py, all four shapes -> "$OUT/grouped_mlp.jsonl"
#   5. profile    benchmarks/profile_grouped_mlp.py, all four shapes, te_ops fused vs the torch
#                 peer: top kernels / aten ops / host ops per step -> "$OUT/profile.jsonl"
#   6. memory     benchmarks/memory_report.py on CUDA (saved bytes, op counts, fused vs not)
#   7. main_job   the main job on CUDA, bf16 eager vs --cuda-graph: loss curves must agree
#   8. summary    one table: step results, test tallies, benchmark table
# Total worst case ~13.5 minutes (the timeouts below add up to 800 s plus start-up).
# The exit status is 0 only when every step passed.
# Knobs (for a dry run elsewhere): PYTHON (default python3), CPU_TESTS (default "tests"),
# BENCH_ARGS (extra benchmark arguments, e.g. "--quick --device cpu"), PROFILE_ARGS (the same for
# the profile script).

set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/runs}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
STEPS=()
FAILED=0

# step NAME SECONDS COMMAND...: run COMMAND under a timeout, tee its output to $OUT/NAME.log.
step() {
    local name=$1 secs=$2
    shift 2
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
    [ "$verdict" = ok ] || FAILED=1
    STEPS+=("$(printf '%-11s %-14s %4ss' "$name" "$verdict" "$took")")
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
EOF"

step cuda_tests 150 "$PY" -m pytest -q -m cuda tests -p no:cacheprovider
# shellcheck disable=SC2086  # CPU_TESTS may name several paths
step cpu_tests 120 "$PY" -m pytest -q -x -m "not cuda" ${CPU_TESTS:-tests} -p no:cacheprovider

BENCH_JSON="$OUT/grouped_mlp.jsonl"
rm -f "$BENCH_JSON"
# shellcheck disable=SC2086  # BENCH_ARGS holds several arguments
step bench 170 "$PY" benchmarks/grouped_mlp.py --iters 15 --warmup 3 --out "$BENCH_JSON" \
    ${BENCH_ARGS:-}

PROFILE_JSON="$OUT/profile.jsonl"
rm -f "$PROFILE_JSON"
# shellcheck disable=SC2086  # PROFILE_ARGS holds several arguments
step profile 90 "$PY" benchmarks/profile_grouped_mlp.py --out "$PROFILE_JSON" ${PROFILE_ARGS:-}

step memory 90 "$PY" benchmarks/memory_report.py --device cuda --dtype bfloat16 --experts 8 \
    --tokens 16384 --hidden 1024 --ffn 2048 --out "$OUT/memory.jsonl"

# The main job on the GPU: eager bf16 vs --cuda-graph bf16, same seed; the loss curves must agree.
step main_job 150 "$PY" scripts/compare_main_job.py --out "$OUT"

{
    echo
    echo "==================== summary ===================="
    printf '%s\n' "${STEPS[@]}"
    for t in cuda_tests cpu_tests; do
        if [ -f "$OUT/$t.log" ]; then
            echo "$t: $(grep -E '^[0-9]+ (passed|failed)|(passed|failed|error|skipped).* in [0-9.]+s' "$OUT/$t.log" | tail -n 1)"
            grep -E '^(FAILED|ERROR) ' "$OUT/$t.log" | head -n 20
        fi
    done
    if [ -s "$BENCH_JSON" ]; then
        echo
        "$PY" benchmarks/grouped_mlp.py --summarize "$BENCH_JSON"
    else
        echo "no benchmark records in $BENCH_JSON"
    fi
    if [ -s "$PROFILE_JSON" ]; then
        echo
        "$PY" benchmarks/profile_grouped_mlp.py --summarize "$PROFILE_JSON" --top 6
    fi
    echo "logs: $OUT"
} 2>&1 | tee "$OUT/summary.log"

exit "$FAILED"
