#!/usr/bin/env bash
# GPU smoke test (a few minutes): a bf16 FSDP2 fit (FSDP2 MixedPrecisionPolicy, fp32 master weights) of SmolLM2-135M-Instruct with vLLM rollouts for a few
# steps on every visible GPU, then the step time, rollout tokens/s and peak GPU memory it logged.
# Usage: scripts/gpu_smoke.sh [extra overrides]    (run `make install` first)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/gpu_smoke}
GPUS=$(nvidia-smi -L | wc -l)
rm -rf "$OUT"
start=$(date +%s)
timeout 300 "$PY" -m stare_lightning fit experiment=smollm2_countdown trainer=fsdp trainer.accelerator=gpu \
  trainer.devices="$GPUS" trainer.max_steps=5 trainer.val_check_interval=100 \
  validation.before_fit=false callbacks=minimal summary=false rollout=vllm rollout.gpu_memory_utilization=0.3 \
  output_dir="$OUT" "$@"
end=$(date +%s)
"$PY" - "$OUT" "$((end - start))" <<'PY'
import csv, sys
rows = [r for r in csv.DictReader(open(f"{sys.argv[1]}/logs/metrics.csv")) if r.get("train/entropy")]
def mean(key):
    values = [float(r[key]) for r in rows if r.get(key)]
    return sum(values) / len(values) if values else float("nan")
print(f"steps: {len(rows)}  wall (incl. start-up): {sys.argv[2]} s")
print(f"rollout tokens/s: {mean('train/rollout/tokens_per_s'):.0f}")
print(f"step time s: {mean('train/time/step_s'):.2f}  peak GPU memory GiB: {mean('train/memory/peak_gib'):.2f}")
PY
