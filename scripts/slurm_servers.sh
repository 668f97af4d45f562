#!/usr/bin/env bash
#SBATCH --job-name=stare_lightning_servers
#SBATCH --nodes=3
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=48:00:00
# Rollout nodes and trainer nodes in one allocation: the first ROLLOUT_NODES nodes run `serve` (one vLLM server per
# GPU the job holds there, one on CPU nodes, listening on the cluster network behind the shared credential), the
# others train with FSDP2 (one process per GPU, one on CPU nodes) and reach every server by URL
# (rollout.server.launch=false). --exclusive gives the job whole nodes, whatever CPUs they have. The trainer's ranks
# meet at the first node of their own step, not of the job (stare_lightning/trainer/rendezvous.py).
# Weights reach the servers over the network (rollout.server.transfer=auto picks it for servers on other nodes:
# docs/guides/servers.md); to push through a directory every node mounts instead, add rollout.server.transfer_dir=DIR.
# Usage: sbatch scripts/slurm_servers.sh experiment=paper_7b_short_cot [more overrides, for both sides]
#        sbatch --gpus-per-node=0 scripts/slurm_servers.sh ...   (CPU nodes)
# Environment: ROLLOUT_NODES (default 1), PORT (first port, default 8000), PYTHON, OUTPUT_DIR,
# STARE_LIGHTNING_SERVER_TOKEN (default: a fresh secret for this job).
set -euo pipefail
PY=${PYTHON:-python}
ROLLOUT_NODES=${ROLLOUT_NODES:-1}
PORT=${PORT:-8000}
# The GPUs this job holds on each node (SLURM sets the count when it allocated any): a server or a training process
# on each, else one a node.
GPUS=${SLURM_GPUS_ON_NODE:-0}
if ((GPUS > 0)); then
  PER_NODE=$GPUS SERVER_DEVICES=("rollout.server.gpus=[$(seq -s, 0 $((GPUS - 1)))]") TRAIN_DEVICE=()
else
  PER_NODE=1 SERVER_DEVICES=() TRAIN_DEVICE=(trainer.accelerator=cpu)
fi
OUT=${OUTPUT_DIR:-$PWD/runs/$SLURM_JOB_ID}
STARE_LIGHTNING_SERVER_TOKEN=${STARE_LIGHTNING_SERVER_TOKEN:-$("$PY" -c 'import secrets; print(secrets.token_urlsafe(32))')}
export STARE_LIGHTNING_SERVER_TOKEN
export OUT

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
ROLLOUT=("${NODES[@]:0:$ROLLOUT_NODES}")
TRAIN=("${NODES[@]:$ROLLOUT_NODES}")
((${#TRAIN[@]} > 0)) || { echo "ROLLOUT_NODES=$ROLLOUT_NODES leaves no node of ${#NODES[@]} to train on" >&2; exit 1; }
URLS=()
for node in "${ROLLOUT[@]}"; do
  for k in $(seq 0 $((PER_NODE - 1))); do URLS+=("http://$node:$((PORT + k))"); done
done

# One `serve` per rollout node: PER_NODE servers, server k on GPU k and port PORT + k.
srun --nodes="$ROLLOUT_NODES" --ntasks-per-node=1 --nodelist="$(IFS=,; echo "${ROLLOUT[*]}")" \
  bash -c 'exec "$0" -m stare_lightning serve "$@" output_dir="$OUT/rollout/$SLURMD_NODENAME"' "$PY" \
  trainer=fsdp rollout=server rollout.server.host=0.0.0.0 rollout.server.port="$PORT" rollout.server.count="$PER_NODE" \
  "${SERVER_DEVICES[@]}" "$@" &
SERVE=$!
# At the end, SIGTERM to the servers' step (the job's first): `serve` stops its servers and exits.
trap 'status=$?; scancel --signal=TERM "$SLURM_JOB_ID.0" 2>/dev/null || true; wait $SERVE 2>/dev/null || true; exit $status' EXIT
for url in "${URLS[@]}"; do  # every server healthy before the trainer starts
  until curl -sf "$url/health" >/dev/null; do
    kill -0 "$SERVE" 2>/dev/null || { echo "serve ended before $url answered" >&2; exit 1; }
    sleep 2
  done
done

srun --kill-on-bad-exit=1 --nodes="${#TRAIN[@]}" --ntasks-per-node="$PER_NODE" --nodelist="$(IFS=,; echo "${TRAIN[*]}")" \
  "$PY" -m stare_lightning fit trainer=fsdp trainer.devices="$PER_NODE" trainer.num_nodes="${#TRAIN[@]}" "${TRAIN_DEVICE[@]}" \
  rollout=server rollout.server.launch=false "rollout.server.urls=[$(IFS=,; echo "${URLS[*]}")]" \
  output_dir="$OUT" "$@"
