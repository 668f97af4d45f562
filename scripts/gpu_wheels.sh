#!/usr/bin/env bash
# The wheels a run on the offline GPU machine needs beside its image (scripts/gpu_packages.py says which and why),
# for CPython 3.12 on manylinux x86-64, into WHEELS (default gpu_wheels/, git-ignored). Run here, with the package
# registry reachable and `make install` done; the folder then travels with the checkout
# (scripts/gpu_check.sh installs it there with `pip install --no-index`). Fails when the folder exceeds 16 MiB,
# the most that may travel beside the checkout with room to spare.
# Usage: scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WHEELS=${WHEELS:-gpu_wheels}
LIMIT_BYTES=$((16 << 20))

packages=$("$PY" scripts/gpu_packages.py)
rm -rf "$WHEELS"
mkdir -p "$WHEELS"
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
for package in $packages; do
  # A wheel for the GPU machine's interpreter when the index has one; a pure-Python package published as a
  # source archive only (antlr4-python3-runtime 4.9.3) is built into a wheel here, and must come out as
  # py3-none-any, or it could not run there.
  if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --abi cp312 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
      -d "$WHEELS" "$package" 2>/dev/null; then
    "$PY" -m pip wheel -q --no-deps -w "$build" "$package"
    for wheel in "$build"/*.whl; do
      case $wheel in
        *-py3-none-any.whl | *-py2.py3-none-any.whl) mv "$wheel" "$WHEELS/" ;;
        *) echo "error: $package built as $(basename "$wheel"), not a pure-Python wheel: it cannot travel" >&2
           exit 1 ;;
      esac
    done
  fi
done
count=$(find "$WHEELS" -name '*.whl' | wc -l)
expected=$(echo "$packages" | wc -w)
if [ "$count" -ne "$expected" ]; then
  echo "error: $WHEELS holds $count wheels for $expected packages ($packages)" >&2
  exit 1
fi
bytes=$(du -cb "$WHEELS"/*.whl | tail -1 | cut -f1)
if [ "$bytes" -gt "$LIMIT_BYTES" ]; then
  echo "error: $WHEELS holds $bytes bytes, over the 16 MiB that may travel" >&2
  exit 1
fi
echo "$WHEELS: $count wheels, $((bytes / 1024)) KiB"
ls -1 "$WHEELS"
