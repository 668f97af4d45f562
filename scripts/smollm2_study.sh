#!/usr/bin/env bash
# GRPO-ds against STARE-O1 (fixed W, and the adaptive schedule) on experiment=smollm2_arithmetic, two seeds
# each, then the small summaries that notebooks/smollm2_study.ipynb reads. GRPO-ds's entropy falls fast at this
# learning rate, so 8 steps show it: 10-20 minutes per run on an idle 2-core CPU, 6 runs.
#   scripts/smollm2_study.sh [sweep directory (default multirun/smollm2_study)]
set -euo pipefail
OUT=${1:-multirun/smollm2_study}
PY=${PYTHON:-.venv/bin/python}
COMMON=(experiment=smollm2_arithmetic summary=false trainer.max_steps=8 trainer.val_check_interval=4
  data.val_size=16 data.val_batch_size=16 seed=0,1)
"$PY" -m stare_lightning fit -m "${COMMON[@]}" algorithm=grpo_ds,stare_o1 hydra.sweep.dir="$OUT/fixed"
# Adaptive W: from 1 toward w_max while the entropy is under its target, by alpha = 0.1 a step.
"$PY" -m stare_lightning fit -m "${COMMON[@]}" algorithm=stare_o1 algorithm.stare.adaptive=true \
  algorithm.stare.w=1.0 algorithm.stare.w_max=3.0 algorithm.stare.alpha=0.1 hydra.sweep.dir="$OUT/adaptive"
"$PY" -m stare_lightning.metrics.plots summarize "$OUT" notebooks/data/smollm2_study
