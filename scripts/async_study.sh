#!/usr/bin/env bash
# Does STARE still hold its entropy target when its samples are K policy versions old, and what does the off-policy
# correction buy? The offline default (tiny model, countdown, 300 steps) with rollout=server and
# rollout.max_staleness=K for K in 0, 1, 2, 4, for GRPO-ds and STARE-O1, with the decoupled correction (the clip
# against the trainer's own log-probs at the step's start, the behaviour-to-proximal ratio masked above its cap:
# algorithm.mismatch.correction=token, mode=mask), plus STARE-O1 at K=4 without any correction; seeds 1, 2, 3:
# 27 jobs, each its own resumable process (scripts/study_jobs.sh), 5-9 minutes each on an otherwise idle 2-core CPU
# (the launched server's threads spin: other work on the same cores crawls). Then the summaries
# notebooks/async_study.ipynb reads, and the seed statistics paired against each algorithm's K=0 arm.
#   scripts/async_study.sh [directory (default multirun/async_study)]
# Environment: SEEDS, ARM_NAMES, STUDY (overrides every job starts from), DATA (where the summaries go), PYTHON.
set -euo pipefail
OUT=${1:-multirun/async_study}
PY=${PYTHON:-.venv/bin/python}
DATA=${DATA:-notebooks/data/async_study}
SEEDS=${SEEDS:-1 2 3}
STUDY=${STUDY:-rollout=server}
DECOUPLED="algorithm.mismatch.correction=token algorithm.mismatch.mode=mask"
declare -A ARMS=()
for k in 0 1 2 4; do
  ARMS[grpo_ds_k$k]="algorithm=grpo_ds rollout.max_staleness=$k $DECOUPLED algorithm.name=grpo_ds_k$k"
  ARMS[stare_o1_k$k]="algorithm=stare_o1 rollout.max_staleness=$k $DECOUPLED algorithm.name=stare_o1_k$k"
done
ARMS[stare_o1_k4_uncorrected]="algorithm=stare_o1 rollout.max_staleness=4 algorithm.name=stare_o1_k4_uncorrected"
read -r -a ORDER <<<"${ARM_NAMES:-grpo_ds_k0 stare_o1_k0 grpo_ds_k1 stare_o1_k1 grpo_ds_k2 stare_o1_k2 grpo_ds_k4 stare_o1_k4 stare_o1_k4_uncorrected}"
# shellcheck source=scripts/study_jobs.sh
source "$(dirname "$0")/study_jobs.sh"

run_study
summarize_study "$DATA" --baseline grpo_ds_k0
"$PY" -m stare_lightning.analysis.compare "$OUT" --baseline stare_o1_k0 --table "$DATA/seed_statistics_stare_o1.csv"
