#!/usr/bin/env bash
# Which arithmetic task can SmolLM2-135M-Instruct learn but not finish? The starting policy of
# experiment=smollm2_arithmetic validated on 64 held-out problems x 8 samples (temperature 0.7) for each candidate
# task; the study wants a start between 0.2 and 0.4 (avg@8). Each candidate is its own process and its own
# directory; one already measured is skipped, so running the script again finishes the probe. Then one table.
#   scripts/smollm2_task_probe.sh [directory (default multirun/smollm2_task_probe)]
set -euo pipefail
OUT=${1:-multirun/smollm2_task_probe}
PY=${PYTHON:-.venv/bin/python}
K=data.task_kwargs
declare -A CANDIDATES=(
  [sum_2x2d]="$K.num_operands=2 $K.digits=2 $K.ops=+"
  [sum_2x2d_128]="$K.num_operands=2 $K.digits=2 $K.ops=+ rollout.max_new_tokens=128"
  [sum_3x1d]="$K.num_operands=3 $K.digits=1 $K.ops=+"
  [sum_4x1d]="$K.num_operands=4 $K.digits=1 $K.ops=+"
  [chain_3x1d]="$K.num_operands=3 $K.digits=1 $K.ops=+-"
  [mixed_2x2d]="$K.num_operands=2 $K.digits=2 $K.ops=+-"
  [product_2x1d]="$K.num_operands=2 $K.digits=1 $K.ops=*"
  [product_or_difference_2x1d]="$K.num_operands=2 $K.digits=1 $K.ops=-*"
)
for name in $(printf '%s\n' "${!CANDIDATES[@]}" | sort); do
  dir="$OUT/$name"
  [[ -f "$dir/logs/metrics.csv" ]] && { echo "$name: measured already"; continue; }
  # shellcheck disable=SC2086 # each candidate is a list of overrides
  "$PY" -m stare_lightning validate experiment=smollm2_arithmetic summary=false output_dir="$dir" \
    data.val_size=64 data.val_batch_size=64 rollout.val_n=8 validation.pass_k=[1,8] ${CANDIDATES[$name]}
done
"$PY" - "$OUT" <<'PY'
import csv, sys
from pathlib import Path
print(f"{'task':<28} {'avg@8':>6} {'pass@8':>6} {'length':>6} {'cut':>5}")
for metrics in sorted(Path(sys.argv[1]).glob("*/logs/metrics.csv")):
    row = [r for r in csv.DictReader(open(metrics)) if r.get("val/avg@n")][-1]
    name = metrics.parent.parent.name
    print(f"{name:<28} {float(row['val/avg@n']):6.3f} {float(row['val/pass@8']):6.3f} "
          f"{float(row['val/response_length/mean']):6.1f} {float(row['val/response_length/truncated_frac']):5.2f}")
PY
