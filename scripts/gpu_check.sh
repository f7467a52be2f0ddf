#!/usr/bin/env bash
# GPU check for cuda_ext, for one machine with a CUDA GPU, a CUDA build of torch and nvcc (no
# network needed): builds the CUDA ops, runs the CUDA kernel tests, then the CUDA kernel
# benchmark. Sized to finish in well under 8 minutes (the first CUDA build is most of it).
#
#   scripts/gpu_check.sh            # uses python from $PYTHON, else .venv, else PATH
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export PAGED_SERVE_OPS=compiled          # a failed build is an error here, never a fallback
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() { echo; echo "== $* ($(date +%T))"; }

# torch guesses CUDA_HOME from the directory above `nvcc`, which is wrong when nvcc is a
# wrapper script (e.g. /usr/local/bin/nvcc): point it at a directory with the CUDA headers.
if [[ -z ${CUDA_HOME:-} ]]; then
  for home in /usr/local/cuda "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /)")")")"; do
    if [[ -f $home/include/cuda_runtime.h ]]; then export CUDA_HOME=$home; break; fi
  done
fi

step "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
command -v nvcc >/dev/null && nvcc --version | tail -1
echo "CUDA_HOME=${CUDA_HOME:-unset}"
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"

step "build the CUDA ops"
timeout 360 "$PYTHON" - <<'PY'
import logging, time
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
t = time.perf_counter()
from cuda_ext import ops
assert ops.backend() == "cuda", ops.backend()
print(f"backend {ops.backend()} ready in {time.perf_counter() - t:.1f} s")
PY

step "CUDA kernel tests"
timeout 240 "$PYTHON" -m pytest -q -m cuda -p no:cacheprovider tests/kernels

step "CUDA kernel benchmark"
timeout 120 "$PYTHON" benchmarks/kernels/bench_paged_attention.py --device cuda

step "done"
