#!/usr/bin/env bash
# Does STARE need the *surprising* tokens, or only their count? STARE-O1 on the offline default with three
# selectors (algorithm.stare.selector): surprisal (the paper's), the predictive entropy at the token, and the
# random control (the same number of tokens of each advantage sign, drawn uniformly from a seeded generator),
# seeds 1, 2, 3: nine jobs, each its own resumable process (scripts/study_jobs.sh), 3 to 11 minutes each on an
# idle 2-core CPU. Then the small summaries notebooks/selector_ablation.ipynb reads, and the seed statistics
# paired against the surprisal arm.
#   scripts/selector_ablation.sh [directory (default multirun/selector_ablation)]
# Environment: SEEDS, ARM_NAMES, STUDY (overrides every job starts from; default none: the offline default),
# DATA (where the summaries go), PYTHON, CHAINS.
set -euo pipefail
OUT=${1:-multirun/selector_ablation}
PY=${PYTHON:-.venv/bin/python}
DATA=${DATA:-notebooks/data/selector_ablation}
SEEDS=${SEEDS:-1 2 3}
STUDY=${STUDY:-}
declare -A ARMS=(
  [stare_o1]="algorithm=stare_o1"
  [stare_o1_random]="algorithm=stare_o1 algorithm.stare.selector=random algorithm.name=stare_o1_random"
  [stare_o1_entropy]="algorithm=stare_o1 algorithm.stare.selector=entropy algorithm.name=stare_o1_entropy"
)
read -r -a ORDER <<<"${ARM_NAMES:-stare_o1 stare_o1_random stare_o1_entropy}"
# shellcheck source=scripts/study_jobs.sh
source "$(dirname "$0")/study_jobs.sh"

run_study
summarize_study "$DATA" --baseline stare_o1
