#!/usr/bin/env bash
# Build the folder of wheels a GPU machine without network needs to run tools/gpu_check.py
# (docs/how-to/gpu-check.md): the machine has Python 3.12 with torch, triton and transformers; this brings
# megatron-core, mbridge, this package and the pure-Python / small binary packages it imports.
# Run where PyPI is reachable:  tools/gpu_wheels.sh [OUT_DIR]   (default wheels/, gitignored)
# Nothing here touches torch: every wheel is installed with --no-deps on the device.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/wheels}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
TARGET_PY="${GPU_PYTHON_VERSION:-3.12}"  # the device's interpreter, not this one
LIMIT_MIB=64  # what one device call carries beside the working tree

# name==version pins the device must match exactly; the rest take the newest cp312 wheel.
# The lent H100/H200 image already holds einops, psutil, pyarrow and aiohttp with its
# dependencies (seen there 2026-11-26), and pyarrow alone is 55 MB of the 64 MiB a device call
# carries: they are fetched only with GPU_WHEELS_ALL=1, for a machine that lacks them.
PACKAGES=(megatron-core==0.16.1 mbridge==0.15.1 omegaconf bm25s)
if [ "${GPU_WHEELS_ALL:-0}" = 1 ]; then
  PACKAGES+=(einops psutil pyarrow aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl idna)
fi

rm -rf "$OUT"
mkdir -p "$OUT"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux_2_12_x86_64 manylinux2010_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64 any; do
  platforms+=(--platform "$p")
done
for pkg in "${PACKAGES[@]}"; do
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp \
    --python-version "$TARGET_PY" "${platforms[@]}" --dest "$OUT" "$pkg"
done
# this package (pure Python: sorl_megatron and the Triton kernels' sorl_kernels)
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$OUT" "$ROOT"

ls -1 "$OUT"
bytes=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
mib=$(( (bytes + 1048575) / 1048576 ))
echo "wheels: $(ls "$OUT"/*.whl | wc -l) files, $mib MiB in $OUT"
if [ "$mib" -ge "$LIMIT_MIB" ]; then
  echo "wheels: $mib MiB is over the $LIMIT_MIB MiB a device call carries" >&2
  exit 1
fi
