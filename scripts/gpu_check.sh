#!/usr/bin/env bash
# GPU check of te_ops, run from the repository root on the GPU machine:
#
#     bash scripts/gpu_check.sh            # logs and JSON lines go to $OUT (default ./runs)
#
# Steps (each under `timeout`, each logged to "$OUT/<step>.log" through `tee`, so the logs come
# back even when a step or the whole script is cut short):
#   env         nvidia-smi, torch / CUDA / Triton versions, the GPU's capability
#   dist_nccl   (2+ GPUs only) tests/dist_check.py on 2 processes over NCCL (DDP, FSDP2)
#   test lane:
#     cuda_tests  python -m pytest -q -m cuda tests      (the GPU tests; CUDA_TEST_SHARDS processes
#                 at once, default 3, through scripts/sharded_pytest.py)
#     cpu_tests   python -m pytest -q -x -m "not cuda" tests   (the CPU suite, on this box; not in
#                 the default STEPS: CI runs it, and the test lane's 10 minutes are full)
#   benchmark lane:
#     bench       benchmarks/grouped_mlp.py, all four shapes -> "$OUT/grouped_mlp.jsonl"
#     bench_large the three large shapes sequentially, 3 rounds of 20 timed steps per peer (the
#                 peer, te_ops fused per-expert and single weight): issue 10's 1.15x goal in steady
#                 state -> "$OUT/grouped_mlp_large.jsonl"
#     bench_fp8   benchmarks/grouped_mlp.py --recipe none,fp8,fp8fast, te_ops fused, four shapes
#                 -> "$OUT/grouped_mlp_fp8.jsonl"
#     bench_e64   the E64 T256 decode shape, 3 rounds (each round times one peer after the
#                 other): the peer, te_ops single weight eager and graphed (issue 10's decode
#                 goals) -> "$OUT/grouped_mlp_e64.jsonl"
#     bench_e64_interleaved  the same E64 peers (and te_ops per-expert), one step of each in turn
#                 -> "$OUT/grouped_mlp_e64_interleaved.jsonl"
#     bench_interleaved  the peer and te_ops fused (per-expert, single weight) on the three large
#                 shapes, one step of each in turn -> "$OUT/grouped_mlp_interleaved.jsonl"
#     bench_mid   the same, interleaved, at 64-256 rows per expert (grouped_mlp.py's MID_SHAPES:
#                 E128 T8192 / T16384 H2048 FF768, E64 T16384 H7168 FF2048)
#                 -> "$OUT/grouped_mlp_mid.jsonl"
#     profile     benchmarks/profile_grouped_mlp.py, all four shapes, te_ops fused vs the torch
#                 peer: top kernels / aten ops / host ops per step -> "$OUT/profile.jsonl"
#     tgemm       benchmarks/triton_grouped_gemm.py --rows 1,2,4,8: each Triton decode GEMM vs
#                 torch._grouped_mm -> "$OUT/tgemm.jsonl"
#     large_gemm  benchmarks/large_gemm_triton.py: each persistent Triton GEMM (fprop, dgrad,
#                 wgrad of fc1 / fc2) vs torch._grouped_mm on the three large shapes, the
#                 dispatch rule MIN_ROWS_PER_GROUP -> "$OUT/large_gemm.jsonl"
#     gluon_wgrad benchmarks/gluon_wgrad.py --check: the Gluon wgrad's correctness cases, then
#                 its time vs torch._grouped_mm and the Triton wgrad -> "$OUT/gluon_wgrad.jsonl"
#     gluon_fc1   benchmarks/large_gemm_triton.py --gemms fc1 --gluon-fc1: the Gluon fc1 + SwiGLU
#                 kernel (dispatched default, SPLIT, C_HALF + 4 stages) vs the fprop + SwiGLU
#                 pass, bitwise checks -> "$OUT/gluon_fc1.jsonl"
#     profile_graph  benchmarks/profile_graph_e64.py: every kernel of one replay of the graphed
#                 E64 step, gaps between them, GEMM / other sums -> "$OUT/profile_graph.jsonl"
#     gaps        benchmarks/profile_gaps.py, the three large shapes: device idle time between
#                 kernels of back-to-back steps and the host ops that launched late
#     gaps_mid    the same at 64-256 rows per expert (MID_SHAPES E128 T8192 / T16384), where te_ops'
#                 device time is below the peer's and the host decides the step -> "$OUT/gaps_mid.jsonl"
#     host_costs  benchmarks/host_launch_costs.py: host us per call of the small device calls and
#                 of the persistent kernels' entry points vs torch._grouped_mm -> "$OUT/host_costs.jsonl"
#     host_ab     (with HOST_AB_BASE set) benchmarks/host_ab.py --general: E64 and E128 eager,
#                 a baseline te_ops copy vs this tree, fast path on and off, one process
#     memory      benchmarks/memory_report.py on CUDA (saved bytes, op counts, fused vs not)
#     power       benchmarks/power_clock.py: SM clock, board power, power-cap share and energy per
#                 step of 150 back-to-back steps, the peer vs te_ops fused, three large shapes
#                 -> "$OUT/power.jsonl" (the step ratios at the 700 W cap follow the energy)
#     peak        benchmarks/peak_memory_breakdown.py --small: what is live at one step's memory
#                 peak (the torch peer vs te_ops fused, per-expert and single weight, E128 / E32 /
#                 E64), every block under 1 MiB in bytes -> "$OUT/peak.log"
#     ncu         benchmarks/ncu_step.sh: Nsight Compute counters (DRAM / L2 bytes, instructions,
#                 clock) of every kernel of one step, the peer vs te_ops fused (single weight),
#                 E32 and E8 -> "$OUT/ncu/"
#     sustained   benchmarks/sustained_gemm.py: each te_ops GEMM kernel, the Triton kernel and
#                 torch._grouped_mm in power-capped blocks of back-to-back calls, E32 and E8
#                 -> "$OUT/sustained.jsonl" (where a kernel's energy shows as its time)
#     main_job    the main job on CUDA at 600 steps, bf16 eager vs --cuda-graph (the loss
#                 curves must agree bit for bit)
#     main_job_seeds  scripts/main_job_seeds.py: bf16 vs FP8 (default, and with fast accumulation
#                 in backward too) final validation loss on seeds 0-2
#                 at the main job's default 2000 steps
#     main_job_mxfp8  (test lane) scripts/main_job_seeds.py: bf16 vs MXFP8 on seeds 0-2 at 2000 steps
#   summary     one table: step results, test tallies, benchmark tables
# With two or more GPUs (device kind nvidia-h200-x2) the two lanes run at the same time, the
# test lane on GPU 0 and the benchmark lane on GPU 1; on one GPU one after the other (pass STEPS
# to pick, e.g. STEPS="cuda_tests bench"). The device tool stops a command after 10 minutes:
# the benchmark lane's steps together take longer, so a final check on nvidia-h200-x2 picks
# STEPS="env cuda_tests main_job_mxfp8 bench_fp8 bench_e64 bench_e64_interleaved
# bench_interleaved profile tgemm profile_graph gaps host_ab main_job" (stop 11's final check;
# main_job_seeds too when the recipes' losses are in question: 82 s).
# The exit status is 0 only when every step passed.
# Knobs (for a dry run elsewhere): PYTHON (default python3), CPU_TESTS (default "tests"),
# BENCH_ARGS (extra benchmark arguments, e.g. "--quick --device cpu"; the E64 steps name their
# shape, so a CPU dry run of them also needs a small one: "--quick --device cpu --shapes
# E16_T128_H32_FF48 --iters 5"), PROFILE_ARGS (the same for the profile script), CUDA_TEST_SHARDS
# (default 3), HOST_AB_BASE (see host_ab), LARGE_GEMM_ARGS (extra large_gemm arguments, e.g.
# "--gemms fc1,fc2"), STEPS (space-separated step names to run; default all
# but cpu_tests).

set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/runs}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
: > "$OUT/steps.txt"
WANT=" ${STEPS:-env dist_nccl cuda_tests main_job main_job_seeds main_job_mxfp8 bench bench_large bench_fp8 bench_e64 bench_e64_interleaved bench_interleaved bench_mid profile tgemm large_gemm gluon_wgrad gluon_fc1 profile_graph gaps gaps_mid host_costs host_ab memory peak power ncu sustained} "

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
    printf '%-11s %-14s %4ss\n' "$name" "$verdict" "$took" >> "$OUT/steps.txt"
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

NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${NGPU:-0}" -ge 2 ]; then
    step dist_nccl 240 "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests/dist_check.py --backend nccl
fi

test_lane() {
    # 2026-11-30 stop 10: tests/test_fp8q_cuda.py's 28 PACK4 cases took 430 s (each compiles
    # its own Triton specializations); cut to 12, all 1011 GPU tests then took 495 s on one
    # H200: close to this step's limit, so keep new GPU tests lean.
    # Stop 11: three processes at once, each on a third of the tests (scripts/sharded_pytest.py,
    # TEST_SHARD in tests/conftest.py); shard logs: $OUT/cuda_tests_shard<k>.log.
    step cuda_tests 540 "$PY" scripts/sharded_pytest.py --shards "${CUDA_TEST_SHARDS:-3}" \
        --log-dir "$OUT" --name cuda_tests -- -q -m cuda tests -p no:cacheprovider --durations=8
    # MXFP8 (emulated on SM90, ~30k tokens/s) against bf16 on seeds 0-2 at the default 2000
    # steps, six runs at once; in the test lane since the sharded tests left it room (seed 0
    # alone, two runs, took 112 s at stop 9).
    step main_job_mxfp8 240 "$PY" scripts/main_job_seeds.py --device cuda --recipes none,mxfp8 \
        --seeds 0,1,2 --parallel 6 --out "$OUT/seeds_mxfp8"
    # shellcheck disable=SC2086  # CPU_TESTS may name several paths
    step cpu_tests 120 "$PY" -m pytest -q -x -m "not cuda" ${CPU_TESTS:-tests} -p no:cacheprovider
}

BENCH_JSON="$OUT/grouped_mlp.jsonl"
FP8_JSON="$OUT/grouped_mlp_fp8.jsonl"
PROFILE_JSON="$OUT/profile.jsonl"
ILV_JSON="$OUT/grouped_mlp_interleaved.jsonl"
E64_JSON="$OUT/grouped_mlp_e64.jsonl"
E64I_JSON="$OUT/grouped_mlp_e64_interleaved.jsonl"
LARGE_JSON="$OUT/grouped_mlp_large.jsonl"
bench_lane() {
    rm -f "$BENCH_JSON" "$FP8_JSON" "$PROFILE_JSON" "$ILV_JSON" "$E64_JSON" "$E64I_JSON" \
        "$LARGE_JSON"
    # shellcheck disable=SC2086  # BENCH_ARGS holds several arguments
    step bench 200 "$PY" benchmarks/grouped_mlp.py --iters 15 --warmup 3 --out "$BENCH_JSON" \
        ${BENCH_ARGS:-}
    # shellcheck disable=SC2086
    step bench_large 150 "$PY" benchmarks/grouped_mlp.py --rounds 3 --iters 20 --warmup 3 \
        --peers torch_grouped_mm,te_ops_fused,te_ops_fused_single --out "$LARGE_JSON" \
        --shapes E8_T16384_H4096_FF14336,E128_T65536_H2048_FF768,E32_T32768_H7168_FF2048 \
        ${BENCH_ARGS:-}
    # shellcheck disable=SC2086
    step bench_fp8 150 "$PY" benchmarks/grouped_mlp.py --peers torch_grouped_mm,te_ops_fused \
        --recipe none,fp8,fp8fast --iters 10 --warmup 3 --out "$FP8_JSON" ${BENCH_ARGS:-}
    # shellcheck disable=SC2086
    step bench_e64 60 "$PY" benchmarks/grouped_mlp.py --shapes E64_T256_H2048_FF768 --rounds 3 \
        --peers torch_grouped_mm,te_ops_fused_single,te_ops_fused_single_graph_noclone \
        --iters 50 --warmup 10 --out "$E64_JSON" ${BENCH_ARGS:-}
    # The decode shape with the peers timed one step each in turn as well (each step's wall time
    # from launch to synchronize): host-bound rows of the sequential run above swung by up to
    # 0.9 ms between rounds at stop 11 while the same process's interleaved A/B did not.
    # shellcheck disable=SC2086
    step bench_e64_interleaved 60 "$PY" benchmarks/grouped_mlp.py --interleaved --iters 100 \
        --warmup 10 --shapes E64_T256_H2048_FF768 --out "$E64I_JSON" \
        --peers torch_grouped_mm,te_ops_fused_single,te_ops_fused,te_ops_fused_single_graph_noclone \
        ${BENCH_ARGS:-}
    # Peers timed one step each in turn (A, B, C, A, ...): no order / clock drift between peers.
    # shellcheck disable=SC2086
    step bench_interleaved 60 "$PY" benchmarks/grouped_mlp.py --interleaved --iters 20 \
        --peers torch_grouped_mm,te_ops_fused,te_ops_fused_single --out "$ILV_JSON" \
        --shapes E8_T16384_H4096_FF14336,E128_T65536_H2048_FF768,E32_T32768_H7168_FF2048 \
        ${BENCH_ARGS:-}
    # The same at 64-256 rows per expert (grouped_mlp.py's MID_SHAPES): the persistent Triton
    # fprop / dgrad and, there, wgrad (WGRAD_ROWS_PER_GROUP) against the peer's CUTLASS calls.
    # shellcheck disable=SC2086
    step bench_mid 60 "$PY" benchmarks/grouped_mlp.py --interleaved --iters 20 \
        --peers torch_grouped_mm,te_ops_fused,te_ops_fused_single --out "$OUT/grouped_mlp_mid.jsonl" \
        --shapes E128_T8192_H2048_FF768,E128_T16384_H2048_FF768,E64_T16384_H7168_FF2048 \
        ${BENCH_ARGS:-}
    # shellcheck disable=SC2086  # PROFILE_ARGS holds several arguments
    step profile 50 "$PY" benchmarks/profile_grouped_mlp.py --out "$PROFILE_JSON" ${PROFILE_ARGS:-}
    # Per-GEMM Triton decode kernels vs torch._grouped_mm at 1-8 rows per expert, E64 and E128
    # layers: the dispatch rule (MAX_ROWS_PER_GROUP) with stop 11's tiles.
    step tgemm 90 "$PY" benchmarks/triton_grouped_gemm.py --rows 1,2,4,8 --out "$OUT/tgemm.jsonl"
    # Per-GEMM persistent Triton kernels vs torch._grouped_mm at the large shapes (the rule
    # MIN_ROWS_PER_GROUP; wgrad measured, not dispatched).
    # shellcheck disable=SC2086
    step large_gemm 150 "$PY" benchmarks/large_gemm_triton.py --out "$OUT/large_gemm.jsonl" \
        ${LARGE_GEMM_ARGS:-}
    # The warp-specialized Gluon wgrad vs torch._grouped_mm and the Triton flat wgrad on the
    # three large shapes' wgrads, after its correctness cases (stop 16; dispatched at >= 1024
    # rows per group).
    step gluon_wgrad 120 "$PY" benchmarks/gluon_wgrad.py --check --reps 20 \
        --out "$OUT/gluon_wgrad.jsonl"
    # The Gluon fc1 + SwiGLU kernel's configs against fc1's fprop + the SwiGLU pass (stop 17:
    # the default dispatched at GLUON_FC1_RULE's shapes; C_HALF + 4 stages built, not measured).
    step gluon_fc1 150 "$PY" benchmarks/large_gemm_triton.py --gemms fc1 \
        --out "$OUT/gluon_fc1.jsonl" --gluon-fc1 '{"gfc1": {}, "gfc1_split": {"SPLIT": true, "num_warps": 4}, "gfc1_c4": {"SPLIT": true, "num_warps": 4, "C_HALF": true, "STAGES": 4}}'
    # Every kernel of the graphed E64 step (and the eager peers'), with the gaps between them.
    step profile_graph 60 "$PY" benchmarks/profile_graph_e64.py --out "$OUT/profile_graph.jsonl"
    # Idle device time between kernels of back-to-back steps, and which host ops launched late
    # (16 s for the three large shapes x three peers on one H200, 2026-11-30).
    step gaps 60 "$PY" benchmarks/profile_gaps.py --steps 4 --warmup 3 --out "$OUT/gaps.jsonl"
    step gaps_mid 60 "$PY" benchmarks/profile_gaps.py --steps 4 --warmup 3 \
        --shapes E128_T8192_H2048_FF768,E128_T16384_H2048_FF768 \
        --peers torch_grouped_mm,te_ops_fused,te_ops_fused_single --out "$OUT/gaps_mid.jsonl"
    step host_costs 40 "$PY" benchmarks/host_launch_costs.py --out "$OUT/host_costs.jsonl"
    # Host-overhead A/B in one process against a baseline copy of te_ops (made with
    # `benchmarks/host_ab.py --make-baseline OLD/te_ops DIR`; HOST_AB_BASE=DIR), with this
    # tree's general path (TE_OPS_FAST_STEP=0) as a third variant. Skipped without HOST_AB_BASE.
    if [ -n "${HOST_AB_BASE:-}" ]; then
        step host_ab 120 env PYTHONPATH="$PYTHONPATH:$HOST_AB_BASE" "$PY" benchmarks/host_ab.py \
            --general --rounds 3 --iters 30 --warmup 5 \
            --shapes E64_T256_H2048_FF768,E128_T65536_H2048_FF768 --out "$OUT/host_ab.jsonl"
    fi
    step memory 30 "$PY" benchmarks/memory_report.py --device cuda --dtype bfloat16 --experts 8 \
        --tokens 16384 --hidden 1024 --ffn 2048 --out "$OUT/memory.jsonl"
    # The KiB-scale peak differences (split tables, kernel scratch, CUTLASS argument buffers).
    step peak 90 "$PY" benchmarks/peak_memory_breakdown.py --small \
        --shapes E128_T65536_H2048_FF768,E32_T32768_H7168_FF2048,E64_T256_H2048_FF768 \
        --peers torch_grouped_mm,te_ops_fused,te_ops_fused_single
    step ncu 150 bash benchmarks/ncu_step.sh "$OUT/ncu"
    step sustained 150 "$PY" benchmarks/sustained_gemm.py --out "$OUT/sustained.jsonl" \
        --shapes E32_T32768_H7168_FF2048,E8_T16384_H4096_FF14336 \
        --gemms fc1,fc2,fc1_dgrad,fc2_dgrad,fc1_wgrad,fc2_wgrad --rounds 3 --block-ms 300
    step power 150 "$PY" benchmarks/power_clock.py --steps 150 --out "$OUT/power.jsonl" \
        --shapes E32_T32768_H7168_FF2048,E8_T16384_H4096_FF14336,E128_T65536_H2048_FF768 \
        --peers torch_grouped_mm,te_ops_fused_single,te_ops_fused
    # The main job: eager vs --cuda-graph bf16 at 600 steps (same seed, curves must agree).
    step main_job 90 "$PY" scripts/compare_main_job.py --out "$OUT"
    # Issue 9's loss goal: FP8 within 2 % of bf16 on the same seed (fp32 master weights), at the
    # job's default 2000 steps. Six runs at once took 70-89 s on one H200 (2026-11-30); the
    # nine runs with fp8fast are all started at once too (--parallel 9: the default of at most
    # 8 would leave the ninth for a second wave, near this step's limit; 82 s on one H200 at stop 11).
    step main_job_seeds 160 "$PY" scripts/main_job_seeds.py --device cuda \
        --recipes none,fp8,fp8fast --parallel 9 \
        --seeds 0,1,2 --out "$OUT/seeds"
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
    for f in "$BENCH_JSON" "$LARGE_JSON" "$FP8_JSON" "$E64_JSON" "$E64I_JSON" "$ILV_JSON" \
             "$OUT/grouped_mlp_mid.jsonl"; do
        if [ -s "$f" ]; then
            echo
            "$PY" benchmarks/grouped_mlp.py --summarize "$f"
        else
            echo "no benchmark records in $f"
        fi
    done
    grep -hE '^(recipe |max \|eager| +eager:| +cuda-graph:)' "$OUT/main_job.log" 2>/dev/null
    grep -hE '^(recipe|none|fp8|fp8fast|mxfp8) ' "$OUT/main_job_seeds.log" "$OUT/main_job_mxfp8.log" \
        2>/dev/null
    if [ -s "$OUT/large_gemm.jsonl" ]; then
        echo
        "$PY" benchmarks/large_gemm_triton.py --summarize "$OUT/large_gemm.jsonl"
    fi
    if [ -s "$OUT/profile_graph.jsonl" ]; then
        echo
        "$PY" benchmarks/profile_graph_e64.py --summarize "$OUT/profile_graph.jsonl" | tail -n 40
    fi
    for f in "$OUT/gaps.jsonl" "$OUT/gaps_mid.jsonl"; do  # span / busy / idle per shape and peer
        if [ -s "$f" ]; then
            echo
            "$PY" benchmarks/profile_gaps.py --summarize "$f" | grep -E '^## '
        fi
    done
    if [ -s "$OUT/host_costs.jsonl" ]; then
        echo
        grep '"call"' "$OUT/host_costs.jsonl"
    fi
    if [ -s "$OUT/power.log" ]; then  # ms, MHz, W, power-capped share, J per step
        echo
        grep -E "^(# power|shape|E[0-9])" "$OUT/power.log"
    fi
    if [ -s "$OUT/peak.log" ]; then  # each peer's peak in bytes (the step's own)
        echo
        grep -E "^## |step's own peak" "$OUT/peak.log"
    fi
    if [ -s "$PROFILE_JSON" ]; then
        echo
        "$PY" benchmarks/profile_grouped_mlp.py --summarize "$PROFILE_JSON" --top 6
    fi
    echo "logs: $OUT"
} 2>&1 | tee "$OUT/summary.log"

if grep -qv " ok " "$OUT/steps.txt"; then exit 1; fi
exit 0
