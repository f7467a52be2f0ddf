"""llama.cpp's `llama-server`, built from source when it is missing.

The llama-cpp-python sdist on PyPI vendors llama.cpp; `pip download` fetches it from the
package registry (no other network is needed), and CMake builds the `llama-server` target
(`-DLLAMA_CURL=OFF`: it never downloads models) into
`$PAGED_SERVE_CACHE/llama.cpp/<version>/build` (default `~/.cache/paged-serve/...`), once.
About 10 minutes on 2 cores.

    python -m benchmarks.llama_cpp_build          # prints the binary's path, building it if needed
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

SDIST_VERSION = "0.3.36"  # llama-cpp-python; the llama.cpp it vendors is what we compare against


def cache_dir(version: str = SDIST_VERSION) -> Path:
    root = Path(os.environ.get("PAGED_SERVE_CACHE", Path.home() / ".cache" / "paged-serve"))
    return root / "llama.cpp" / version


def find_llama_server(explicit: str | None = None) -> Path | None:
    """`explicit`, $LLAMA_SERVER, a `llama-server` on PATH, or our cached build; None if none."""
    for candidate in (explicit, os.environ.get("LLAMA_SERVER"), shutil.which("llama-server"),
                      cache_dir() / "build" / "bin" / "llama-server"):
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
    # NOTE: GGML_NATIVE builds for this CPU, as our own ops are (-march=native); OpenMP on,
    # as llama.cpp's release builds have it.
    _run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
          "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
          "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF"]
         + (["-G", "Ninja"] if shutil.which("ninja") else []))
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs or os.cpu_count() or 2)])
    binary = build / "bin" / "llama-server"
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
