#!/usr/bin/env bash
# Compile-check every CUDA source of cuda_ext with `nvcc -c` for sm_80 and sm_90 and print the
# ptxas register / spill counts of every kernel. Needs nvcc only: no GPU, no CUDA torch (the
# .cu files include no torch headers). Then, where python has torch, syntax-checks the CUDA
# half of bindings.cpp (the torch glue) with the host compiler. Exits non-zero on any error.
#
#   scripts/nvcc_check.sh            # both architectures
#   ARCHS="90" NVCC=/path/nvcc PYTHON=.venv/bin/python scripts/nvcc_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC=${NVCC:-nvcc}
ARCHS=${ARCHS:-"80 90"}
command -v "$NVCC" >/dev/null || { echo "nvcc_check: $NVCC not found" >&2; exit 1; }
# c++filt (binutils) demangles the names inside a line; without it the names stay mangled.
DEMANGLE=$(command -v c++filt || echo cat)

gencode=()
for arch in $ARCHS; do gencode+=(-gencode "arch=compute_${arch},code=sm_${arch}"); done
# NOTE: the same defines torch.utils.cpp_extension passes, so this checks what the JIT builds.
flags=(-std=c++17 -O3 -lineinfo -DPAGED_SERVE_WITH_CUDA -D__CUDA_NO_HALF_OPERATORS__
       -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
       -Xptxas -v)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$NVCC" --version | tail -1
failed=0
for cu in cuda_ext/csrc/cuda/*.cu; do
  name=$(basename "$cu" .cu)
  start=$SECONDS
  if ! "$NVCC" -c "${flags[@]}" "${gencode[@]}" "$cu" -o "$work/$name.o" >"$work/$name.log" 2>&1; then
    echo "FAIL $cu"
    grep -v '^ptxas info' "$work/$name.log" >&2 || true
    failed=1
    continue
  fi
  echo "ok   $cu ($((SECONDS - start)) s)"
  grep -E 'warning' "$work/$name.log" | sed 's/^/     /' || true
  # ptxas prints, per kernel: "Compiling entry function '<mangled>' for 'sm_XX'", then the
  # spill line, then "Used N registers".
  awk '
    /Compiling entry function/ { match($0, /\x27[^\x27]+\x27 for \x27sm_[0-9]+\x27/); s = substr($0, RSTART, RLENGTH);
                                 split(s, parts, "\x27"); kernel = parts[2]; arch = parts[4]; next }
    /spill stores/ { stores = $5; loads = $9; next }
    /Used [0-9]+ registers/ { match($0, /Used [0-9]+ registers/); regs = substr($0, RSTART + 5, RLENGTH - 15);
                              printf "     %-6s regs %3d  spill st/ld %s/%s B  %s\n", arch, regs, stores, loads, kernel }
  ' "$work/$name.log" | "$DEMANGLE" \
    | sed -E 's/void //; s/paged_serve::cuda::[a-z_]+:://; s/\(([^()]|\([^()]*\))*\)$//'
done

# The torch glue compiled with -DPAGED_SERVE_WITH_CUDA, syntax only. A CPU build of torch ships
# the c10/cuda headers but not the generated cuda_cmake_macros.h: a one-line stub stands in.
PYTHON=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
if includes=$("$PYTHON" -c "
import sysconfig
from torch.utils.cpp_extension import include_paths
print(' '.join(['-isystem ' + p for p in include_paths()] + ['-isystem ' + sysconfig.get_paths()['include']]))
" 2>/dev/null); then
  mkdir -p "$work/stub/c10/cuda/impl"
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >"$work/stub/c10/cuda/impl/cuda_cmake_macros.h"
  cuda_include=${CUDA_HOME:-/usr/local/cuda}/include
  [[ -f $cuda_include/cuda_runtime_api.h ]] || cuda_include=$(dirname "$(dirname "$(command -v "$NVCC")")")/include
  start=$SECONDS
  # shellcheck disable=SC2086 # $includes is a list of flags
  if ${CXX:-c++} -std=c++20 -fsyntax-only -Wall -DPAGED_SERVE_WITH_CUDA $includes -isystem "$work/stub" \
       -isystem "$cuda_include" cuda_ext/csrc/bindings.cpp; then
    echo "ok   cuda_ext/csrc/bindings.cpp with -DPAGED_SERVE_WITH_CUDA, syntax only ($((SECONDS - start)) s)"
  else
    echo "FAIL cuda_ext/csrc/bindings.cpp with -DPAGED_SERVE_WITH_CUDA"
    failed=1
  fi
else
  echo "skip cuda_ext/csrc/bindings.cpp: $PYTHON has no torch"
fi
exit "$failed"
