#!/usr/bin/env bash
# GPU smoke test (a few minutes): a bf16 FSDP2 fit (FSDP2 MixedPrecisionPolicy, fp32 master weights) of
# SmolLM2-135M-Instruct with colocated vLLM rollouts for a few steps on every visible GPU, three times: as
# configured; with the memory levers on (vLLM sleep mode during the update, packed micro-batches, the fused LM
# head); and in fp16 as the reference code trains (trainer.strategy.param_dtype=float16, i.e. trainer=fsdp_fp16:
# fp16 compute and rollout engine, the dynamic loss scale; the steps it skipped on overflow and its last scale are printed).
# A fourth run generates on a separate stock vLLM server instead (rollout=server): the server on GPU 0, the
# trainer on the other GPUs; with one GPU both share it and the server takes SERVER_SHARE of its memory.
# Each run prints its step time, rollout tokens/s, weight-sync time and peak GPU memory.
# Usage: scripts/gpu_smoke.sh [extra overrides for every run]    (run `make install` first)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/gpu_smoke}
GPUS=$(nvidia-smi -L | wc -l)
SERVER_SHARE=${SERVER_SHARE:-0.3}
LEVERS=(rollout.enable_sleep_mode=true forward.packed_sequences=true forward.fused_lm_head=true
  telemetry.same_batch_entropy=false)
COLOCATED=(rollout=vllm rollout.gpu_memory_utilization=0.3)

smoke() {  # smoke NAME SECONDS TRAINER_GPUS [overrides...]: a 5-step fit on TRAINER_GPUS GPUs, killed after SECONDS
  local name=$1 limit=$2 devices=$3 dir="$OUT/$1"
  shift 3
  rm -rf "$dir"
  local start end
  start=$(date +%s)
  timeout "$limit" "$PY" -m stare_lightning fit experiment=smollm2_countdown trainer=fsdp trainer.accelerator=gpu \
    trainer.devices="$devices" trainer.max_steps=5 trainer.val_check_interval=100 \
    validation.before_fit=false callbacks=minimal summary=false output_dir="$dir" "$@"
  end=$(date +%s)
  "$PY" - "$dir" "$name" "$((end - start))" <<'PY'
import csv, sys
rows = [r for r in csv.DictReader(open(f"{sys.argv[1]}/logs/metrics.csv")) if r.get("train/entropy")]
def mean(key):
    values = [float(r[key]) for r in rows if r.get(key)]
    return sum(values) / len(values) if values else float("nan")
print(f"[{sys.argv[2]}] steps: {len(rows)}  wall (incl. start-up): {sys.argv[3]} s")
print(f"[{sys.argv[2]}] rollout tokens/s: {mean('train/rollout/tokens_per_s'):.0f}")
skipped = [float(r["train/nonfinite_skipped"]) for r in rows if r.get("train/nonfinite_skipped")]
scale = [r["train/loss_scale"] for r in rows if r.get("train/loss_scale")]
print(f"[{sys.argv[2]}] optimizer steps skipped (non-finite, e.g. fp16 overflow): {int(skipped[-1]) if skipped else 0}"
      + (f", loss scale at the end: {scale[-1]}" if scale else ""))
print(f"[{sys.argv[2]}] step time s: {mean('train/time/step_s'):.2f}  weight sync s: {mean('train/time/sync'):.3f}  "
      f"peak GPU memory GiB: {mean('train/memory/peak_gib'):.2f}")
PY
}

smoke plain 300 "$GPUS" "${COLOCATED[@]}" "$@"
smoke levers 300 "$GPUS" "${COLOCATED[@]}" "${LEVERS[@]}" "$@"
smoke fp16 300 "$GPUS" "${COLOCATED[@]}" trainer.strategy.param_dtype=float16 "$@"
# The server compiles its model and captures CUDA graphs before it answers: a longer limit. Its log is in
# $OUT/server/servers/.
if [ "$GPUS" -gt 1 ]; then  # the trainer sees GPUs 1..; the server's CUDA_VISIBLE_DEVICES=0 is set by the launcher
  CUDA_VISIBLE_DEVICES=$(seq -s, 1 $((GPUS - 1))) smoke server 600 $((GPUS - 1)) rollout=server \
    'rollout.server.gpus=["0"]' "$@"
else
  smoke server 600 1 rollout=server 'rollout.server.gpus=["0"]' \
    rollout.server.gpu_memory_utilization="$SERVER_SHARE" "$@"
fi
