"""llama.cpp's `llama-server`, built from source when it is missing.

The llama-cpp-python sdist on PyPI vendors llama.cpp; `pip download` fetches it from the
package registry (no other network is needed), and CMake builds the `llama-server` target
(`-DLLAMA_CURL=OFF`: it never downloads models) into
`$PAGED_SERVE_CACHE/llama.cpp/<version>/build` (default `~/.cache/paged-serve/...`), once.
About 10 minutes on 2 cores.

    python -m benchmarks.llama_cpp_build          # prints the binary's path, building it if needed

`build_target` builds the tree's other tools (llama-quantize, llama-perplexity) when asked.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

SDIST_VERSION = "0.3.36"  # llama-cpp-python; the llama.cpp it vendors is what we compare against


def cache_dir(version: str = SDIST_VERSION) -> Path:
    root = Path(os.environ.get("PAGED_SERVE_CACHE", Path.home() / ".cache" / "paged-serve"))
    return root / "llama.cpp" / version


def cmake_flags(machine: str | None = None) -> list[str]:
    """The configure flags of our build on this (or the given) machine architecture."""
    # NOTE: GGML_NATIVE builds for this CPU, as our own ops are (-march=native); OpenMP on,
    # as llama.cpp's release builds have it.
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF"]
    if (machine or platform.machine()).lower() in ("x86_64", "amd64"):
        # NOTE: without llama.cpp's AMX kernels (an explicit -mno-amx-int8 outlasts -march=native):
        # on Sapphire Rapids hosts llama-server segfaults in ggml_backend_amx_mul_mat at its first
        # forward pass (ggml-org/llama.cpp#20824, open; seen here with the default Q4_1 GGUF).
        # It keeps AVX-512 and VNNI there; on CPUs without AMX the flag changes nothing.
        flags += ["-DCMAKE_C_FLAGS=-mno-amx-int8", "-DCMAKE_CXX_FLAGS=-mno-amx-int8"]
    return flags


def _stamp(build: Path) -> Path:
    return build / "paged-serve-cmake-flags.txt"


def _configured_as_today(build: Path) -> bool:
    stamp = _stamp(build)
    return stamp.is_file() and stamp.read_text() == _stamp_text()


def _stamp_text() -> str:
    return " ".join(cmake_flags())


def find_llama_server(explicit: str | None = None) -> Path | None:
    """`explicit`, $LLAMA_SERVER, a `llama-server` on PATH, or our cached build (only if it was
    configured with today's `cmake_flags`); None if none."""
    build = cache_dir() / "build"
    cached = build / "bin" / "llama-server" if _configured_as_today(build) else None
    for candidate in (explicit, os.environ.get("LLAMA_SERVER"), shutil.which("llama-server"), cached):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def build_llama_server(version: str = SDIST_VERSION, jobs: int | None = None) -> Path:
    """Download the sdist, configure and build `llama-server`; returns the binary's path."""
    base = cache_dir(version)
    base.mkdir(parents=True, exist_ok=True)
    sdist = base / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={version}", "-d", str(base)])
    source = base / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not source.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(base, filter="data")
    build = base / "build"
    if build.is_dir() and not _configured_as_today(build):
        shutil.rmtree(build)  # configured with other flags (CMake keeps a cache's old values)
    _run(["cmake", "-S", str(source), "-B", str(build)] + cmake_flags()
         + (["-G", "Ninja"] if shutil.which("ninja") else []))
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs or os.cpu_count() or 2)])
    binary = build / "bin" / "llama-server"
    if not binary.is_file():
        raise SystemExit(f"the build finished but {binary} is missing")
    _stamp(build).write_text(_stamp_text())
    return binary


def build_target(target: str, jobs: int | None = None) -> Path:
    """Another tool of the same build tree (`llama-quantize`, `llama-perplexity`), built once
    the tree is configured (by `build_llama_server`); returns its path."""
    build = cache_dir() / "build"
    binary = build / "bin" / target
    if binary.is_file():
        return binary
    if not _configured_as_today(build):
        build_llama_server(jobs=jobs)
    _run(["cmake", "--build", str(build), "--target", target, "-j", str(jobs or os.cpu_count() or 2)])
    if not binary.is_file():
        raise SystemExit(f"the build finished but {binary} is missing")
    return binary


def ensure_llama_server(explicit: str | None = None) -> Path:
    found = find_llama_server(explicit)
    if found is not None:
        return found
    print("llama-server not found: building it from the llama-cpp-python sdist (~10 min on 2 cores)",
          file=sys.stderr)
    return build_llama_server()


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)


if __name__ == "__main__":
    print(ensure_llama_server(sys.argv[1] if len(sys.argv) > 1 else None))
