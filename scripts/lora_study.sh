#!/usr/bin/env bash
# Does STARE hold the entropy when only a low-rank update trains? experiment=smollm2_study (SmolLM2-135M-Instruct,
# 100 steps) with rank-16 LoRA adapters, GRPO-ds and STARE-O1, seeds 0-2: six jobs, each its own resumable process
# (scripts/study_jobs.sh), paired by seed to the committed full-fine-tuning runs of scripts/smollm2_study.sh.
# The LoRA learning rate was measured first, by the rule that chose the full fine-tune's (the experiment's
# comments): GRPO-ds with LoRA, seed 0, 30 steps (the probe arms, about 15 minutes each); the study's rate puts the
# halving of the entropy at the step where the full fine-tune's halves (lr 2e-6: steps 71, 64 and 81 for seeds 0-2),
# taking, as there, lr x steps at the halving as constant. At 1e-4 the entropy halved at step 21 (lr x steps 2.1e-3);
# at 2e-5 it had not halved by step 30 (as that product predicts, about step 105); 2.1e-3 / 72 = 2.9e-5, so 3e-5,
# about 15 times the full fine-tune's rate. (The third arm, 5e-4, was not needed to bracket it and was not run.)
#   ARM_NAMES="probe_2e-5 probe_1e-4 probe_5e-4" SEEDS=0 scripts/lora_study.sh   # the probe
#   scripts/lora_study.sh                                                         # the six jobs, then summaries
# Directory: the first argument (default multirun/lora_study).
# Environment: SEEDS, ARM_NAMES, LORA_LR, DATA, PYTHON, CHAINS.
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
  LORA_LR=${LORA_LR:-3e-5}  # the probe's rate (the top of this script)
  ARMS[grpo_ds_lora]="algorithm=grpo_ds optim.lr=$LORA_LR algorithm.name=grpo_ds_lora"
  ARMS[stare_o1_lora]="algorithm=stare_o1 optim.lr=$LORA_LR algorithm.name=stare_o1_lora"
fi
# shellcheck source=scripts/study_jobs.sh
source "$(dirname "$0")/study_jobs.sh"

run_study
summarize_study "$DATA" --tail 10  # entropy: steps 90-99, as the full fine-tuning study
