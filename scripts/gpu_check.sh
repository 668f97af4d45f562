#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py says what it runs): for a bare GPU machine with no network. No `make install`:
# the project is imported from this checkout, and the packages the machine's image lacks are installed from the
# wheel folder that scripts/gpu_wheels.sh filled beforehand (it travels with the checkout), with --no-index.
# Results: $OUT/gpu_check.json and $OUT/gpu_check.md (OUT defaults to outputs/gpu_check).
# Usage: scripts/gpu_check.sh [--cpu-dry-run] [--steps STEP ...]
#   PY: the interpreter (default: the GPU image's /opt/torch/.venv/bin/python3, else .venv/bin/python, else python3)
#   WHEELS: the wheel folder (default gpu_wheels/; when it is absent the interpreter's own packages are used)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
  for candidate in /opt/torch/.venv/bin/python3 .venv/bin/python python3; do
    if command -v "$candidate" >/dev/null 2>&1; then PY=$candidate; break; fi
  done
fi
WHEELS=${WHEELS:-gpu_wheels}
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target "$site" "$WHEELS"/*.whl
  echo "[gpu_check] installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $site"
else
  echo "[gpu_check] no wheels in $WHEELS: using $PY's own packages"
fi
# The checkout first, then the carried packages, then the interpreter's own. Nothing may reach a hub.
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$PY" scripts/gpu_check.py "$@"
