"""Build and load the compiled op library: JIT through ``torch.utils.cpp_extension`` into a
persistent cache directory keyed by a hash of the sources and the toolchain.

* ``kind="cpu"``  : ``csrc/bindings.cpp`` + ``csrc/cpu/*.cpp`` (any machine with a C++ compiler).
* ``kind="cuda"`` : the same plus ``csrc/cuda/*.cu``, with ``-DPAGED_SERVE_WITH_CUDA`` (needs a
  CUDA build of torch and nvcc). One library registers both the CPU and the CUDA kernels.

The first build takes about a minute (a log line says so); later processes load the cached
``.so`` in well under a second. Cache root: ``$PAGED_SERVE_EXT_CACHE``, else
``~/.cache/paged-serve/torch_extensions``. ``PAGED_SERVE_BUILD_VERBOSE=1`` shows the compiler
commands.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
CPU_SOURCES = ("bindings.cpp", "cpu/attention.cpp", "cpu/cache.cpp")
CUDA_SOURCES = ("cuda/attention.cu", "cuda/cache.cu")

# NOTE: -march=native is safe because the cache key includes this machine's CPU flags, so a
# cache directory shared between different machines never hands out a foreign binary.
CPU_FLAGS = ("-O3", "-march=native", "-fopenmp-simd")
CUDA_FLAGS = ("-O3", "-lineinfo", "-DPAGED_SERVE_WITH_CUDA")


def cache_root() -> Path:
    """Where built libraries are kept between processes."""
    env = os.environ.get("PAGED_SERVE_EXT_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "paged-serve" / "torch_extensions"


def cuda_home() -> Path | None:
    """The CUDA toolkit directory (with include/cuda_runtime.h and bin/nvcc), or None.

    NOTE: torch guesses the directory above the first ``nvcc`` on PATH, which is wrong when
    that is a wrapper script (``/usr/local/bin/nvcc`` execs ``/usr/local/cuda-13.0/bin/nvcc``).
    """
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parents[1]))
    for home in filter(None, candidates):
        path = Path(home)
        if (path / "include" / "cuda_runtime.h").exists() and (path / "bin" / "nvcc").exists():
            return path
    return None


def _cpu_signature() -> str:
    """The CPU model and ISA flags, so -march=native builds are not shared across machines."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("flags", "model name"))}))
    except OSError:
        return platform.processor() or platform.machine()


def source_hash(kind: str) -> str:
    """Digest of everything that decides the built binary: sources, headers, flags, toolchain."""
    h = hashlib.sha256()
    for path in sorted(CSRC.rglob("*")):
        if kind == "cpu" and path.is_relative_to(CSRC / "cuda"):
            continue  # the CPU build compiles nothing from cuda/
        if path.is_file() and path.suffix in {".cpp", ".cu", ".h", ".cuh"}:
            h.update(str(path.relative_to(CSRC)).encode())
            h.update(path.read_bytes())
    h.update(repr((kind, CPU_FLAGS, CUDA_FLAGS, torch.__version__, torch.version.cuda)).encode())
    h.update(_cpu_signature().encode())
    return h.hexdigest()[:16]


def load(kind: str) -> Path:
    """Build (if not cached) and load the op library into this process; return its directory.

    Raises whatever the compiler or loader raises; :mod:`cuda_ext.ops` turns that into a
    fallback to the reference.
    """
    from torch.utils import cpp_extension  # imported lazily: it pulls in setuptools

    if kind not in ("cpu", "cuda"):
        raise ValueError(f"unknown build kind {kind!r}")
    name = f"paged_serve_ops_{kind}_{source_hash(kind)}"
    build_dir = cache_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    sources = [str(CSRC / s) for s in CPU_SOURCES]
    if kind == "cuda":
        sources += [str(CSRC / s) for s in CUDA_SOURCES]
        home = cuda_home()
        if home is None:
            raise RuntimeError("no CUDA toolkit found (set CUDA_HOME)")
        # cpp_extension read CUDA_HOME when it was imported; correct a wrong guess of its own.
        cpp_extension.CUDA_HOME = str(home)
    first = not (build_dir / f"{name}.so").exists()
    if first:
        logger.info(
            "building the %s PagedAttention ops (first build, about a minute) in %s",
            kind.upper(), build_dir,
        )
    start = time.perf_counter()
    cpp_extension.load(
        name=name,
        sources=sources,
        extra_cflags=list(CPU_FLAGS) + (["-DPAGED_SERVE_WITH_CUDA"] if kind == "cuda" else []),
        extra_cuda_cflags=list(CUDA_FLAGS),
        build_directory=str(build_dir),
        with_cuda=kind == "cuda",
        is_python_module=False,
        verbose=os.environ.get("PAGED_SERVE_BUILD_VERBOSE", "") not in ("", "0"),
    )
    if first:
        logger.info("built the %s ops in %.1f s", kind.upper(), time.perf_counter() - start)
    return build_dir
