#!/usr/bin/env bash
# Does STARE hold entropy on a pretrained LM? experiment=smollm2_study (SmolLM2-135M-Instruct, 100 steps) for
# GRPO-ds, STARE-O1, STARE-C2 and STARE-O1 with the adaptive schedule, seeds 0, 1, 2: twelve jobs, each its own
# process in its own directory ($OUT/<arm>/seed<k>), seed by seed so that a partial study is already paired.
# - A job that holds checkpoints/last.ckpt resumes from it (ckpt_path=last); a finished one (a `finished` file
#   beside its logs) is skipped, so running the script again after a kill finishes the study. A finished job's
#   checkpoints are deleted (about 1.6 GB each); its logs stay.
# - Two runners on one directory never take the same job (a lock per job). CHAINS=2 runs two queues side by side,
#   one thread each; on a 2-core CPU that is no faster (measured: 40 s a step each, against 18.5 s alone, with the
#   same start-up), so one queue is the default: about 35-40 min per job, 7-8 hours for the study.
# - Then the small summaries that notebooks/smollm2_study.ipynb reads, and the seed statistics.
#   scripts/smollm2_study.sh [directory (default multirun/smollm2_study)]
set -euo pipefail
OUT=${1:-multirun/smollm2_study}
PY=${PYTHON:-.venv/bin/python}
DATA=${DATA:-notebooks/data/smollm2_study}
SEEDS=${SEEDS:-0 1 2}
declare -A ARMS=(
  [grpo_ds]="algorithm=grpo_ds"
  [stare_o1]="algorithm=stare_o1"
  [stare_c2]="algorithm=stare_c2"
  # From the paper's W = 1.1 toward w_max = 4 while the entropy is under its target, back toward 1 while over it.
  # The step, 0.25, follows from the first seed pair: STARE-O1's gate opened at step 60 of 100 and W = 3.2 would
  # have zeroed its first-order entropy change, so W must reach that within a few of the ~40 gate-open steps. The
  # paper's 0.05 (for thousands of steps) would get there at step ~100; 0.25 spans 1 to 4 in 12 steps.
  [stare_o1_adaptive]="algorithm=stare_o1 algorithm.stare.adaptive=true algorithm.stare.w=1.1 algorithm.stare.w_max=4.0 algorithm.stare.alpha=0.25"
)
ORDER=(grpo_ds stare_o1 stare_c2 stare_o1_adaptive)

run_job() {  # run_job ARM SEED: fit (or resume) one job unless it is finished or another runner holds it
  local arm=$1 seed=$2 dir="$OUT/$1/seed$2"
  mkdir -p "$dir"
  [[ -f "$dir/finished" ]] && { echo "$arm seed $seed: finished already"; return; }
  exec {lock}>"$dir/.lock"
  flock -n "$lock" || { echo "$arm seed $seed: another runner has it"; return; }
  echo "$arm seed $seed: $( [[ -f "$dir/checkpoints/last.ckpt" ]] && echo resuming || echo starting ) ($(date +%H:%M))"
  # shellcheck disable=SC2086 # an arm is a list of overrides
  if "$PY" -m stare_lightning fit experiment=smollm2_study summary=false seed="$seed" output_dir="$dir" \
    ckpt_path=last ${ARMS[$arm]} >>"$dir/runner.log" 2>&1; then
    touch "$dir/finished"
    rm -rf "$dir/checkpoints"
  else
    echo "$arm seed $seed: failed, see $dir/runner.log" >&2
  fi
  flock -u "$lock"
}

queue() {  # queue I N: every N-th job starting at I, seed by seed
  local i=0
  for seed in $SEEDS; do
    for arm in "${ORDER[@]}"; do
      (( i++ % $2 == $1 )) && run_job "$arm" "$seed"
    done
  done
  return 0
}

if [[ "${CHAINS:-1}" == 2 ]]; then
  # One thread each, and vLLM's decode threads pinned to a core of their own.
  OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=0 queue 0 2 &
  OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=1 queue 1 2 &
  wait
else
  queue 0 1
fi
for arm in "${ORDER[@]}"; do
  ls "$OUT/$arm"/seed*/finished >/dev/null 2>&1 || continue
  "$PY" -m stare_lightning.metrics.plots summarize "$OUT/$arm" "$DATA"
done
"$PY" -m stare_lightning.compare "$OUT" --table "$DATA/seed_statistics.csv"
