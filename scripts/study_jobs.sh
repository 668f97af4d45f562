# Sourced by the study scripts (smollm2_study.sh, selector_ablation.sh): each job its own process in its own
# directory ($OUT/<arm>/seed<k>), seed by seed so that a partial study is already paired.
# - A job that holds checkpoints/last.ckpt resumes from it (ckpt_path=last); a finished one (a `finished` file
#   beside its logs) is skipped, so running the script again after a kill finishes the study. A finished job's
#   checkpoints are deleted; its logs stay.
# - Two runners on one directory never take the same job (a lock per job). CHAINS=2 runs two queues side by side.
# - Killing the runner (TERM or INT) stops its job too (TERM, then KILL after 30 s), so no job runs on unowned.
# The caller sets OUT, PY, SEEDS, STUDY (the overrides every job starts from), ARMS (arm -> its overrides) and
# ORDER (the arms to run, in order), then calls run_study, then summarize_study with where the summaries go and
# the arguments of `python -m stare_lightning.analysis.compare` after the directory.

FIT=
stop_fit() {  # on TERM/INT: the running fit goes down with the runner; its last checkpoint stays for a resume
  if [[ -n "$FIT" ]]; then
    kill -TERM "$FIT" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$FIT" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$FIT" 2>/dev/null || true
  fi
  exit 143
}

run_job() {  # run_job ARM SEED: fit (or resume) one job unless it is finished or another runner holds it
  local arm=$1 seed=$2 dir="$OUT/$1/seed$2"
  mkdir -p "$dir"
  [[ -f "$dir/finished" ]] && { echo "$arm seed $seed: finished already"; return; }
  exec {lock}>"$dir/.lock"
  flock -n "$lock" || { echo "$arm seed $seed: another runner has it"; exec {lock}>&-; return; }
  echo "$arm seed $seed: $( [[ -f "$dir/checkpoints/last.ckpt" ]] && echo resuming || echo starting ) ($(date +%H:%M))"
  # In the background and waited for, so that a signal to the runner reaches stop_fit while the fit runs.
  # shellcheck disable=SC2086 # the study and an arm are lists of overrides
  "$PY" -m stare_lightning fit $STUDY summary=false seed="$seed" output_dir="$dir" ckpt_path=last ${ARMS[$arm]} \
    >>"$dir/runner.log" 2>&1 &
  FIT=$!
  if wait "$FIT"; then
    touch "$dir/finished"
    rm -rf "$dir/checkpoints"
  else
    echo "$arm seed $seed: failed, see $dir/runner.log" >&2
  fi
  FIT=
  flock -u "$lock"
  exec {lock}>&-  # closed, so that later jobs' fits do not inherit it
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

run_study() {
for arm in "${ORDER[@]}"; do
  [[ -v "ARMS[$arm]" ]] || { echo "ARM_NAMES: unknown arm '$arm' (known: ${!ARMS[*]})" >&2; exit 2; }
done
if [[ "${CHAINS:-1}" == 2 ]]; then
  # One thread each, and vLLM's decode threads pinned to a core of their own; each queue stops its own fit.
  (trap stop_fit TERM INT; OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=0 queue 0 2) &
  (trap stop_fit TERM INT; OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=1 queue 1 2) &
  trap 'kill -TERM $(jobs -p) 2>/dev/null; wait; exit 143' TERM INT
  wait
else
  trap stop_fit TERM INT
  queue 0 1
fi
trap - TERM INT
}

summarize_study() {  # summarize_study DATA [compare arguments...]: the finished arms' summaries and seed statistics
  local data=$1
  shift
  for arm in "${ORDER[@]}"; do
    ls "$OUT/$arm"/seed*/finished >/dev/null 2>&1 || continue
    "$PY" -m stare_lightning.analysis.summaries "$OUT/$arm" "$data"
  done
  "$PY" -m stare_lightning.analysis.compare "$OUT" "$@" --table "$data/seed_statistics.csv"
}
