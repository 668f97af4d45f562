#!/usr/bin/env bash
# Shows that scripts/gpu_check.sh needs nothing but the GPU image and the wheel folder: a fresh virtual environment
# holding only packages of the image (at its listed versions; torch as the CPU build of this machine, since a CUDA
# build cannot run here), then the check's CPU dry run with no network at all (`unshare -n`: a network namespace
# with nothing but its own loopback). Run here after scripts/gpu_wheels.sh; needs root (unshare) and the registry.
# Usage: scripts/gpu_offline_proof.sh [VENV_DIR]    (default: a temporary directory, removed afterwards)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-$(mktemp -d)/image-venv}
[ -n "${1:-}" ] || trap 'rm -rf "$(dirname "$venv")"' EXIT
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q torch==2.13.0
# The image's packages that the project or the check touches, at the image's versions where its listing names one.
"$venv/bin/pip" install -q lightning==2.6.6 pytorch-lightning==2.6.6 torchmetrics==1.9.0 transformers==5.17.0 \
  accelerate==1.15.0 safetensors tokenizers peft pandas pyarrow matplotlib tensorboard rich sympy pytest pyyaml \
  numpy packaging psutil requests jinja2 filelock fsspec
echo "image-like environment: $("$venv/bin/python" -c 'import torch, lightning, transformers; print("torch", torch.__version__, "lightning", lightning.__version__, "transformers", transformers.__version__)')"
for missing in hydra omegaconf math_verify; do
  if "$venv/bin/python" -c "import $missing" 2>/dev/null; then
    echo "error: $missing is importable before the wheels are installed: the proof would prove nothing" >&2
    exit 1
  fi
done
out=$(mktemp -d)
# The namespace's loopback is brought up (the GPU machine has one; the single-process NCCL or gloo group of an FSDP fit
# meets on it); nothing else is reachable.
unshare -n sh -c 'ip link set lo up && exec env "$@"' sh PY="$venv/bin/python" OUT="$out" \
  STARE_LIGHTNING_CACHE="$out/cache" scripts/gpu_check.sh --cpu-dry-run
echo "offline dry run passed; report: $out/gpu_check.md"
cat "$out/gpu_check.md"
