#!/usr/bin/env bash
# The offline default's trade-off study: GRPO-ds against STARE-O1 at the default W = 3, then STARE variants
# (W = 2, C2 with M = 0.9, the adaptive W schedule), three seeds each (1, 2, 3: not seed 0, on which the default
# was tuned), then the small summaries that notebooks/offline_tradeoff.ipynb reads and the seed statistics of
# `python -m stare_lightning.analysis.compare`. About 6 minutes per run on an idle 2-core CPU, 15 runs; CHAINS=2
# runs the two halves side by side (the tiny model keeps about one core busy per run).
#   scripts/offline_tradeoff_study.sh [sweep directory (default multirun/offline_tradeoff)]
set -euo pipefail
OUT=${1:-multirun/offline_tradeoff}
PY=${PYTHON:-.venv/bin/python}
SEEDS=${SEEDS:-1,2,3}
DATA=notebooks/data/offline_tradeoff
COMMON=(summary=false seed="$SEEDS")
fit() { local name=$1; shift; "$PY" -m stare_lightning fit -m "${COMMON[@]}" "$@" hydra.sweep.dir="$OUT/$name"; }

default_pair() { fit default algorithm=grpo_ds,stare_o1; }
variants() {
  fit stare_o1_w2 algorithm=stare_o1 algorithm.stare.w=2.0
  fit stare_c2 algorithm=stare_c2
  # Adaptive W: from the paper's 1.1 toward w_max = 4 while the entropy is under its target, by 0.05 a step.
  fit stare_o1_adaptive algorithm=stare_o1 algorithm.stare.adaptive=true algorithm.stare.w=1.1 \
    algorithm.stare.w_max=4.0 algorithm.stare.alpha=0.05
}
if [[ "${CHAINS:-1}" == 2 ]]; then
  default_pair & variants & wait
else
  default_pair
  variants
fi
for sweep in "$OUT"/*/; do
  "$PY" -m stare_lightning.analysis.summaries "$sweep" "$DATA/$(basename "$sweep")"
done
"$PY" -m stare_lightning.analysis.compare "$OUT" --table "$DATA/seed_statistics.csv"  # the PNG stays beside the runs
