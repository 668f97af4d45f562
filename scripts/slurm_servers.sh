#!/usr/bin/env bash
#SBATCH --job-name=stare_lightning_servers
#SBATCH --nodes=3
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --time=48:00:00
# Rollout nodes and trainer nodes in one allocation: the first ROLLOUT_NODES nodes run `serve` (one vLLM server per
# GPU, listening on the cluster network behind the shared credential), the others train with FSDP2 and reach every
# server by URL (rollout.server.launch=false). Weight pushes go through OUTPUT_DIR/weights, which every node must
# mount (a shared file system).
# Usage: sbatch scripts/slurm_servers.sh experiment=paper_7b_short_cot [more overrides, for both sides]
# Environment: ROLLOUT_NODES (default 1), PORT (first port, default 8000), PYTHON, OUTPUT_DIR,
# STARE_LIGHTNING_SERVER_TOKEN (default: a fresh secret for this job).
set -euo pipefail
PY=${PYTHON:-python}
ROLLOUT_NODES=${ROLLOUT_NODES:-1}
PORT=${PORT:-8000}
GPUS=${SLURM_GPUS_ON_NODE:-8}
OUT=${OUTPUT_DIR:-$PWD/runs/$SLURM_JOB_ID}
STARE_LIGHTNING_SERVER_TOKEN=${STARE_LIGHTNING_SERVER_TOKEN:-$("$PY" -c 'import secrets; print(secrets.token_urlsafe(32))')}
export STARE_LIGHTNING_SERVER_TOKEN
mkdir -p "$OUT/weights" && chmod 700 "$OUT/weights"

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
ROLLOUT=("${NODES[@]:0:$ROLLOUT_NODES}")
TRAIN=("${NODES[@]:$ROLLOUT_NODES}")
GPU_LIST=$(seq -s, 0 $((GPUS - 1)))
URLS=()
for node in "${ROLLOUT[@]}"; do
  for gpu in $(seq 0 $((GPUS - 1))); do URLS+=("http://$node:$((PORT + gpu))"); done
done

# One `serve` per rollout node: GPUS servers, server k on GPU k and port PORT + k.
srun --nodes="$ROLLOUT_NODES" --ntasks-per-node=1 --nodelist="$(IFS=,; echo "${ROLLOUT[*]}")" \
  bash -c "exec \"$PY\" -m stare_lightning serve rollout=server rollout.server.host=0.0.0.0 \
    rollout.server.port=$PORT rollout.server.count=$GPUS 'rollout.server.gpus=[$GPU_LIST]' \
    output_dir=$OUT/rollout/\$SLURMD_NODENAME $*" &
SERVE=$!
trap 'kill $SERVE 2>/dev/null; wait $SERVE 2>/dev/null' EXIT
for url in "${URLS[@]}"; do  # every server healthy before the trainer starts
  until curl -sf "$url/health" >/dev/null; do
    kill -0 "$SERVE" 2>/dev/null || { echo "serve ended before $url answered" >&2; exit 1; }
    sleep 10
  done
done

srun --nodes="${#TRAIN[@]}" --ntasks-per-node="$GPUS" --nodelist="$(IFS=,; echo "${TRAIN[*]}")" \
  "$PY" -m stare_lightning fit trainer=fsdp trainer.devices="$GPUS" trainer.num_nodes="${#TRAIN[@]}" \
  rollout=server rollout.server.launch=false "rollout.server.urls=[$(IFS=,; echo "${URLS[*]}")]" \
  rollout.server.transfer_dir="$OUT/weights" output_dir="$OUT" "$@"
