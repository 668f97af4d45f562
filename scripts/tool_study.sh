#!/usr/bin/env bash
# GRPO-ds against STARE-O1 with a tool in the loop: experiment=tool_countdown (the calculator), seeds 1 and 2,
# each algorithm in its own chain, side by side (the tiny model keeps about one core busy per run); then the
# small summaries beside the notebooks and the seed statistics of `python -m stare_lightning.analysis.compare`.
# About 7 minutes per run on an idle 2-core CPU once the cold start is cached.
#   scripts/tool_study.sh [sweep directory (default multirun/tool_countdown)]
set -euo pipefail
OUT=${1:-multirun/tool_countdown}
PY=${PYTHON:-.venv/bin/python}
SEEDS=${SEEDS:-1,2}
DATA=notebooks/data/tool_countdown
fit() {
  OMP_NUM_THREADS=1 "$PY" -m stare_lightning fit -m experiment=tool_countdown summary=false seed="$SEEDS" \
    algorithm="$1" hydra.sweep.dir="$OUT/$1"
}
"$PY" -m stare_lightning sft experiment=tool_countdown  # the shared cold start, once, before the chains
fit grpo_ds & fit stare_o1 & wait
for sweep in "$OUT"/*/; do
  "$PY" -m stare_lightning.analysis.summaries "$sweep" "$DATA/$(basename "$sweep")"
done
"$PY" -m stare_lightning.analysis.compare "$OUT" --table "$DATA/seed_statistics.csv"
