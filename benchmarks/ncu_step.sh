#!/usr/bin/env bash
# Nsight Compute counters of one fwd+bwd step per (shape, peer): benchmarks/ncu_step.py's CSVs
# and its --summarize table. Usage: bash benchmarks/ncu_step.sh OUTDIR [SHAPES] [PEERS]
# (space-separated lists; defaults: E32 and E8, te_ops_fused_single and torch_grouped_mm).
set -uo pipefail
out=${1:?usage: ncu_step.sh OUTDIR [SHAPES] [PEERS]}
shapes=${2:-"E32_T32768_H7168_FF2048 E8_T16384_H4096_FF14336"}
peers=${3:-"torch_grouped_mm te_ops_fused_single"}
py=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$out"
command -v ncu > /dev/null || { echo "ncu (Nsight Compute) is not on the PATH"; exit 2; }
metrics=$("$py" benchmarks/ncu_step.py --metrics)
status=0
for shape in $shapes; do
  files=()
  for peer in $peers; do
    f="$out/ncu_${shape%%_*}_${peer}.csv"
    ncu --clock-control none --profile-from-start off --csv --page raw --metrics "$metrics" \
      "$py" benchmarks/ncu_step.py --shape "$shape" --peer "$peer" > "$f" 2> "$f.err" \
      || { echo "ncu failed for $shape $peer"; tail -5 "$f.err"; status=1; }
    files+=("$f")
  done
  "$py" benchmarks/ncu_step.py --summarize "${files[@]}" > "$out/ncu_${shape%%_*}_summary.txt" \
    || status=1
  cat "$out/ncu_${shape%%_*}_summary.txt"
done
exit $status
