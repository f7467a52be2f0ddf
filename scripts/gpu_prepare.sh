#!/usr/bin/env bash
# Builds the carry folder for scripts/gpu_check.sh, here, where the package registry is
# reachable: wheels of what that script needs and the GPU machine (no network; its own
# python3 with a CUDA torch) may lack, for that machine's Python (default 3.12, x86-64
# manylinux). Each package at the version installed in this checkout's environment, so the
# GPU runs what was tested here. gpu_check.sh installs (pip install --no-index --target) only
# the wheels whose package is missing there or older, so carrying one too many is harmless.
#
#   scripts/gpu_prepare.sh                    # into .gpu_carry/ (ignored by git)
#   GPU_PY_VERSION=3.11 GPU_CARRY=/tmp/c scripts/gpu_prepare.sh
#
# Then name the folder in the device run's `carry` list (it must stay under 64 MiB with the
# working tree; this script prints its size and fails above GPU_CARRY_MAX_MIB, default 48).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
DEST=${GPU_CARRY:-.gpu_carry}
PY_VERSION=${GPU_PY_VERSION:-3.12}
MAX_MIB=${GPU_CARRY_MAX_MIB:-48}

# The build and test tools (ninja: the JIT build; pytest), then the daemon's pure-Python and
# binary dependencies that the GPU image is not known to hold (fastapi's and pydantic's stack,
# uvicorn, llguidance, gguf). torch, transformers, tokenizers, safetensors, httpx, numpy, ...
# are there already (.library/device/KINDS.md lists that image's packages).
PACKAGES=(ninja pytest pluggy iniconfig packaging pygments pytest-timeout
          fastapi starlette pydantic pydantic-core annotated-types annotated-doc typing-inspection
          typing-extensions opentelemetry-api uvicorn h11 click anyio sniffio idna llguidance gguf)

specs=()
for name in "${PACKAGES[@]}"; do
  version=$("$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" 2>/dev/null) \
    || { echo "gpu_prepare: $name is not installed in $PYTHON's environment (make sure .venv is set up)" >&2; exit 1; }
  specs+=("$name==$version")
done

rm -rf "$DEST/wheels"
mkdir -p "$DEST/wheels"
platforms=()
for p in manylinux_2_39_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 linux_x86_64; do
  platforms+=(--platform "$p")
done
# NOTE: --no-deps: the list above is the closure that matters; a resolver run for a foreign
# Python would also fetch what the GPU image already has (numpy, pyyaml, tqdm, ...).
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  "${platforms[@]}" -d "$DEST/wheels" "${specs[@]}"

printf '%s\n' "${specs[@]}" >"$DEST/requirements.txt"
size_kib=$(du -sk "$DEST" | cut -f1)
echo "gpu_prepare: ${#specs[@]} wheels for CPython $PY_VERSION in $DEST ($((size_kib / 1024)) MiB, $size_kib KiB)"
if (( size_kib > MAX_MIB * 1024 )); then
  echo "gpu_prepare: $DEST is over ${MAX_MIB} MiB: too large to carry" >&2
  exit 1
fi
