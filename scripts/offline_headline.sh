#!/usr/bin/env bash
# The README's headline on ten seeds: on the offline default (tiny model, countdown, 300 steps), GRPO with dynamic
# sampling against STARE-O1 at the default gate weight W = 3 and at W = 2, seeds 1 to 10 (not seed 0, on which the
# default was tuned): thirty jobs, each its own resumable process (scripts/study_jobs.sh), about 5 to 9 minutes each
# on an idle 2-core CPU (CHAINS=2 runs two at a time). Then the small summaries notebooks/offline_headline.ipynb
# reads, and the seed statistics paired against GRPO-ds.
# Evaluation window, fixed before the runs: accuracy is the mean of the last three validations (steps 200, 250 and
# 300; `python -m stare_lightning.analysis.compare`'s default), entropy and distinct correct answers the mean of
# the last 50 training steps.
#   scripts/offline_headline.sh [directory (default multirun/offline_headline)]
# Environment: SEEDS, ARM_NAMES, DATA (where the summaries go), PYTHON, CHAINS.
set -euo pipefail
OUT=${1:-multirun/offline_headline}
PY=${PYTHON:-.venv/bin/python}
DATA=${DATA:-notebooks/data/offline_headline}
SEEDS=${SEEDS:-1 2 3 4 5 6 7 8 9 10}
STUDY=${STUDY:-}
declare -A ARMS=(
  [grpo_ds]="algorithm=grpo_ds"
  [stare_o1]="algorithm=stare_o1"
  [stare_o1_w2]="algorithm=stare_o1 algorithm.stare.w=2.0 algorithm.name=stare_o1_w2"
)
read -r -a ORDER <<<"${ARM_NAMES:-grpo_ds stare_o1 stare_o1_w2}"
# shellcheck source=scripts/study_jobs.sh
source "$(dirname "$0")/study_jobs.sh"

run_study
summarize_study "$DATA"
