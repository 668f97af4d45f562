#!/usr/bin/env bash
# Entropy controllers on one harness: which controller, with what target, buys accuracy on the offline default
# (tiny model, countdown, 300 steps, the settings of scripts/offline_headline.sh), seeds 1 to 10, each job its own
# resumable process (scripts/study_jobs.sh), about 5 to 9 minutes a job on an idle 2-core CPU (CHAINS=2 runs two
# at a time).
#
# Arms. Three are the committed runs of scripts/offline_headline.sh (notebooks/data/offline_headline/, same base
# settings and seeds, so every new arm pairs with them seed by seed); they are not run again unless ARM_NAMES names
# them: grpo_ds; stare_o1 (STARE-O1, W = 3, constant target 0.3, the offline default); stare_o1_w2 (W = 2).
# New arms:
# - stare_o1_linear: STARE-O1 (W = 3) with its gate's target annealed linearly from 0.35 to 0.20 nats over the
#   300 steps (algorithm.stare.target_schedule=linear).
# - entropic_pi: GRPO-ds with the PI controller (algorithm=entropic_pi): target 0.3, kp 2, ki 0.1, integral
#   limit 2 nat-steps, signal bound 0.5 (the schema's defaults).
# - entropy_bonus_adaptive: GRPO-ds with the adaptive entropy bonus toward 0.3 nats: the coefficient starts at 0,
#   moves by 0.002 per step (up while the entropy is under target, down above) within [0, 0.1].
#
# Why these settings, from the committed curves (means over the ten seeds of notebooks/data/offline_headline/):
# GRPO-ds's entropy starts at 0.47 nats, crosses 0.35 at step 36 and 0.30 at step 55, then falls by 0.0012 nats a
# step (steps 50-150) to 0.165 over the last 50 steps; STARE-O1 at W = 3 holds 0.288 there (W = 2: 0.266). The
# step-to-step noise of the measured entropy is about 0.017 nats.
# - Annealing: 0.35 lies under the initial entropy, so the gate opens where GRPO-ds's entropy reaches it (about
#   step 36) and STARE then explores above the constant arm's 0.3 early on; the end, 0.20, is GRPO-ds's own level at
#   step 200, so late in the run the target lets the policy sharpen as far as GRPO-ds does, not further. The target
#   averages 0.275 over the run and 0.21 over the last 50 steps: the arm tests Entrocraft's claim that annealing
#   the target beats holding it (explore early, exploit late), at a target no lower than GRPO-ds reaches anyway.
# - PI gains: the same target as STARE's constant arm (0.3), so the arm differs from STARE-O1 in the controller
#   only. kp = 2 turns the measurement noise (0.017) into weight jitter of about +-3%, while a 0.1-nat shortfall
#   moves the weights by 20%. ki = 0.1 with the integral bounded at 2 nat-steps lets the integral carry at most 0.2
#   of the signal: enough to remove a standing shortfall like STARE-O1's 0.012 within about 100 steps, and bounded
#   so that the 40-step descent from 0.47 (an error of about -0.1 a step, which would otherwise wind the integral to
#   about -4) unwinds in at most 2 / 0.05 = 40 steps once the entropy sits 0.05 under target. The signal bound 0.5
#   keeps the weights in [0.5, 1.5], the range of STARE's adaptive W and M (w_max 1.5, m_min 0.5).
# - Adaptive bonus: 0.002 a step reaches the bound 0.1 after 50 steps under target, so within the 245 steps after
#   GRPO-ds crosses 0.3 the coefficient can reach any value up to its bound, and it cannot swing by more than 0.1 in
#   less than 50 steps.
#
# Evaluation window, fixed before any run (the same as scripts/offline_headline.sh): accuracy (val/pass@1, which
# with n = 4 samples is val/avg@4, and val/pass@4) is the mean of the last three validations (steps 200, 250 and
# 300; `python -m stare_lightning.analysis.compare`'s default), entropy and distinct correct answers the mean of the
# last 50 training steps.
#
# Decision criterion, fixed before any run. Each arm is compared with STARE-O1 at W = 3 (the offline default) by
# paired differences over seeds 1-10 (arm minus STARE-O1, same seed), each with its 95% Student-t interval (the
# table `--baseline stare_o1` writes). An arm WINS when either
#   (a) its pass@1 difference has a lower bound above 0 and its pass@4 difference an upper bound above 0 (better
#       pass@1, and pass@4 not clearly worse), or
#   (b) its pass@1 interval contains 0 and its pass@4 difference has a lower bound above 0 (better pass@4 at no
#       clear cost in pass@1).
# Anything else does not win; entropy and distinct correct answers are reported and decide nothing (the question
# is what buys accuracy, and holding entropy is what STARE-O1 already does). Several winners are ranked: (a)
# before (b); then by the larger mean pass@1 difference; if two such means are within 0.005 of each other, by the
# larger mean pass@4 difference; if those too are within 0.005, the arm with fewer settings changed from the
# offline default wins (stare_o1_w2 before stare_o1_linear before the rest). The top winner becomes the candidate
# offline default; with no winner STARE-O1 at W = 3 stays.
#
#   scripts/entropy_controller_study.sh [directory (default multirun/entropy_controllers)]
# Environment: SEEDS, ARM_NAMES (default: the three new arms), DATA (where the summaries go), PYTHON, CHAINS,
# HEADLINE (the committed summaries the new arms pair with).
set -euo pipefail
OUT=${1:-multirun/entropy_controllers}
PY=${PYTHON:-.venv/bin/python}
DATA=${DATA:-notebooks/data/entropy_controllers}
HEADLINE=${HEADLINE:-notebooks/data/offline_headline}
SEEDS=${SEEDS:-1 2 3 4 5 6 7 8 9 10}
STUDY=${STUDY:-}
declare -A ARMS=(
  [grpo_ds]="algorithm=grpo_ds"
  [stare_o1]="algorithm=stare_o1"
  [stare_o1_w2]="algorithm=stare_o1 algorithm.stare.w=2.0 algorithm.name=stare_o1_w2"
  [stare_o1_linear]="algorithm=stare_o1 algorithm.name=stare_o1_linear algorithm.stare.target_schedule=linear \
algorithm.stare.target_entropy=0.35 algorithm.stare.target_end=0.2 algorithm.stare.target_horizon=300"
  [entropic_pi]="algorithm=entropic_pi"
  [entropy_bonus_adaptive]="algorithm=grpo_ds algorithm.name=entropy_bonus_adaptive \
algorithm.entropy_bonus.target=0.3 algorithm.entropy_bonus.coef=0.0 algorithm.entropy_bonus.coef_lr=0.002 \
algorithm.entropy_bonus.coef_max=0.1"
)
read -r -a ORDER <<<"${ARM_NAMES:-stare_o1_linear entropic_pi entropy_bonus_adaptive}"
# shellcheck source=scripts/study_jobs.sh
source "$(dirname "$0")/study_jobs.sh"

run_study
# The new arms' summaries, then the seed statistics over them and the committed arms they pair with: against
# GRPO-ds (compare's default baseline) and against STARE-O1 at W = 3, which the criterion reads.
for arm in "${ORDER[@]}"; do
  ls "$OUT/$arm"/seed*/finished >/dev/null 2>&1 || continue
  "$PY" -m stare_lightning.analysis.summaries "$OUT/$arm" "$DATA"
done
# Pooled in $OUT/pooled (rebuilt each time), where compare also draws its comparison.png.
POOL="$OUT/pooled"
rm -rf "$POOL"
mkdir -p "$POOL"
cp -r "$HEADLINE"/*_seed* "$POOL"/
cp -r "$DATA"/*_seed* "$POOL"/ 2>/dev/null || true
"$PY" -m stare_lightning.analysis.compare "$POOL" --table "$DATA/seed_statistics.csv"
"$PY" -m stare_lightning.analysis.compare "$POOL" --baseline stare_o1 --table "$DATA/seed_statistics_vs_stare_o1.csv"
