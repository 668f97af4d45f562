#!/usr/bin/env bash
# Does STARE hold the entropy when only a low-rank update trains? experiment=smollm2_study (SmolLM2-135M-Instruct,
# 100 steps) with rank-16 LoRA adapters, GRPO-ds and STARE-O1, seeds 0-2: six jobs, each its own resumable process
# (scripts/study_jobs.sh), paired by seed to the committed full-fine-tuning runs of scripts/smollm2_study.sh.
# The LoRA learning rate is measured first, by the same rule that chose the full fine-tune's (the experiment's
# comments): GRPO-ds with LoRA at three rates, seed 0, 30 steps (the probe arms, about 12 minutes each); the rate
# whose entropy halves nearest the step where the full fine-tune's does (lr 2e-6) is the study's LORA_LR.
#   ARM_NAMES="probe_2e-5 probe_1e-4 probe_5e-4" SEEDS=0 scripts/lora_study.sh   # the probe
#   LORA_LR=<the probe's rate> scripts/lora_study.sh                              # the six jobs, then summaries
# Directory: the first argument (default multirun/lora_study). Environment: SEEDS, ARM_NAMES, DATA, PYTHON, CHAINS.
set -euo pipefail
OUT=${1:-multirun/lora_study}
PY=${PYTHON:-.venv/bin/python}
DATA=${DATA:-notebooks/data/lora_study}
SEEDS=${SEEDS:-0 1 2}
STUDY=${STUDY:-experiment=smollm2_study model.lora.rank=16}
read -r -a ORDER <<<"${ARM_NAMES:-grpo_ds_lora stare_o1_lora}"
PROBE="algorithm=grpo_ds trainer.max_steps=30 trainer.val_check_interval=1000 validation.before_fit=false"
declare -A ARMS=(
  [probe_2e-5]="$PROBE optim.lr=2e-5 algorithm.name=probe_2e-5"
  [probe_1e-4]="$PROBE optim.lr=1e-4 algorithm.name=probe_1e-4"
  [probe_5e-4]="$PROBE optim.lr=5e-4 algorithm.name=probe_5e-4"
)
if [[ " ${ORDER[*]} " == *"_lora "* ]]; then
  : "${LORA_LR:?set LORA_LR to the rate the probe measured (see the top of this script)}"
  ARMS[grpo_ds_lora]="algorithm=grpo_ds optim.lr=$LORA_LR algorithm.name=grpo_ds_lora"
  ARMS[stare_o1_lora]="algorithm=stare_o1 optim.lr=$LORA_LR algorithm.name=stare_o1_lora"
fi
# shellcheck source=scripts/study_jobs.sh
source "$(dirname "$0")/study_jobs.sh"

run_study
summarize_study "$DATA" --tail 10  # entropy: steps 90-99, as the full fine-tuning study
