#!/usr/bin/env bash
# bench_transfer.py across two hosts of scripts/cluster.sh (root): `serve` (SmolLM2-135M-Instruct, fp32, one server
# pinned to CPU 1) on node1, the pushes from node2 (pinned to CPU 0), files through the cluster's shared directory
# and the network over the cluster's bridge. Brings its own cluster up and down; extra arguments go to the script
# (--pushes, --json).
#   sudo benchmarks/bench_transfer_cluster.sh --json transfer_cluster.json      # about two minutes on 2 cores
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
export STARE_CLUSTER_NAME=${STARE_CLUSTER_NAME:-benchtx} STARE_CLUSTER_SUBNET=${STARE_CLUSTER_SUBNET:-10.214.0}
export STARE_CLUSTER_DIR=/var/tmp/stare-cluster-$STARE_CLUSTER_NAME
PY=${PYTHON:-$(command -v python)}
CLUSTER=$REPO/scripts/cluster.sh
SHARED=$STARE_CLUSTER_DIR/shared

bash "$CLUSTER" up 2
trap 'bash "$CLUSTER" down >/dev/null; rm -rf "$STARE_CLUSTER_DIR"' EXIT
STARE_LIGHTNING_SERVER_TOKEN=$("$PY" -c 'import secrets; print(secrets.token_urlsafe(32))')
export STARE_LIGHTNING_SERVER_TOKEN OMP_NUM_THREADS=1
bash "$CLUSTER" run node1 "$PY" -m stare_lightning serve model=smollm2 model.dtype=float32 rollout=server \
  rollout.server.host=0.0.0.0 rollout.server.port=8000 "rollout.server.cpus=['1']" output_dir="$SHARED/serve" \
  >"$SHARED/serve.out" 2>&1 &
SERVE=$!
until curl -sf "http://$STARE_CLUSTER_SUBNET.1:8000/health" >/dev/null; do
  kill -0 "$SERVE" 2>/dev/null || { cat "$SHARED/serve.out" >&2; exit 1; }
  sleep 2
done
bash "$CLUSTER" run node2 "$PY" "$REPO/benchmarks/bench_transfer.py" --url http://node1:8000 --transfer-dir "$SHARED" \
  --trainer-cpu 0 "$@"
