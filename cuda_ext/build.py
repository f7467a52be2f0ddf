"""Build and load the compiled op library: JIT through ``torch.utils.cpp_extension`` into a
persistent cache directory keyed by a hash of the sources and the toolchain.

* ``kind="cpu"``  : ``csrc/bindings.cpp`` + ``csrc/cpu/*.cpp`` (any machine with a C++ compiler).
* ``kind="cuda"`` : the same plus ``csrc/cuda/*.cu``, with ``-DPAGED_SERVE_WITH_CUDA`` (needs a
  CUDA build of torch and nvcc). One library registers both the CPU and the CUDA kernels.

The first build takes about a minute (a log line says so); later processes load the cached
``.so`` in well under a second. Cache root: ``$PAGED_SERVE_EXT_CACHE``, else
``~/.cache/paged-serve/torch_extensions``. ``PAGED_SERVE_BUILD_VERBOSE=1`` shows the compiler
commands.

``PAGED_SERVE_CPU_ARCH`` chooses the instruction set of the C++ code (the CPU kernels, and the
host side of the CUDA build):

* ``native`` (default): ``-march=native``, code for this machine's CPU. The cache key
  includes this CPU's model and ISA flags, so another machine (or a container started on one)
  builds its own copy instead of loading a binary that may not run there.
* ``portable``: a conservative baseline that any x86-64 server of the last ~15 years runs,
  ``-march=x86-64-v2`` (SSE4.2, POPCNT; ``-march=armv8-a`` on aarch64), and a cache key
  without the CPU model: a library built once (e.g. in a container image) loads on any machine
  with the same sources, toolchain and architecture. For container images.
* any other value is passed as ``-march=<value>`` (e.g. ``x86-64-v3`` for AVX2 hosts), with
  the same CPU-independent key as ``portable``; the operator vouches that every host runs it.

``load`` refuses (RuntimeError, before compiling) an ``x86-64-vN`` target whose features this
CPU lacks, rather than load a library that dies of SIGILL; ``cuda_ext.ops`` then falls back to
the reference with a warning.

The CUDA build is compiled for explicit GPU architectures (``-gencode``), and they are part of
its cache key together with the visible GPU's compute capability, so that a library built for
one GPU (an H200: sm_90) is never loaded on another (an A100: sm_80) from a shared cache:

* ``TORCH_CUDA_ARCH_LIST`` (torch's variable, e.g. ``"8.0;9.0"`` or ``"9.0+PTX"``) when set;
  ``load`` refuses a list with no code the visible GPU runs;
* otherwise the visible GPU's capability alone (``torch.cuda.get_device_capability()``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import re
import shutil
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
# NOTE: the longest compiles first (ninja starts them in this order): the four files of the
# quantized micro-kernels (quant_tiles.h's run_rows) take most of a portable build, 18-85 s
# each on CI's two cores; started last, the longest ran alone at the end.
CPU_SOURCES = ("cpu/quant_tiles_rows_4_8.cpp", "cpu/quant_tiles_rows_3_7.cpp", "cpu/quant_tiles_rows_2_6.cpp",
               "cpu/quant_tiles_rows_1_5.cpp", "bindings.cpp", "cpu/attention.cpp", "cpu/cache.cpp",
               "cpu/decoder_stack.cpp", "cpu/fused.cpp", "cpu/linear.cpp", "cpu/prefill_attention.cpp",
               "cpu/quant_matmul.cpp", "cpu/quant_pack.cpp", "cpu/quant_quantize.cpp", "cpu/sampling.cpp",
               "cpu/scoring.cpp")
CUDA_SOURCES = ("cuda/attention.cu", "cuda/cache.cu")

CUDA_FLAGS = ("-O3", "-lineinfo", "-DPAGED_SERVE_WITH_CUDA")
CPU_ARCH_ENV = "PAGED_SERVE_CPU_ARCH"
# The `portable` baseline per machine architecture (platform.machine()); elsewhere no -march.
PORTABLE_MARCH = {"x86_64": "x86-64-v2", "amd64": "x86-64-v2", "aarch64": "armv8-a", "arm64": "armv8-a"}
_MARCH_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+_-]*")


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


def cpu_arch() -> str:
    """The ``PAGED_SERVE_CPU_ARCH`` setting: ``native`` (default), ``portable`` or a -march name."""
    arch = os.environ.get(CPU_ARCH_ENV, "").strip() or "native"
    if not _MARCH_NAME.fullmatch(arch):
        raise ValueError(f"{CPU_ARCH_ENV} must be native, portable or a -march name, not {arch!r}")
    return arch


def _march(arch: str, machine: str | None = None) -> str | None:
    """The -march value of a setting on this (or the given) machine architecture; None: none."""
    if arch == "portable":
        return PORTABLE_MARCH.get((machine or platform.machine()).lower())
    return arch


def cpu_flags(arch: str, machine: str | None = None) -> tuple[str, ...]:
    """The C++ compiler flags for a ``PAGED_SERVE_CPU_ARCH`` setting on this (or the given)
    machine architecture."""
    march = _march(arch, machine)
    # NOTE: -fopenmp, not just -fopenmp-simd: at::parallel_for is a header template that runs
    # its range serially unless the extension itself is compiled with OpenMP (_OPENMP). The
    # extension then needs libgomp.so.1, which resolves to the copy torch has already loaded,
    # so both share one thread pool and torch.set_num_threads governs the kernels too.
    # NOTE: -fno-trapping-math -fno-math-errno, as torch itself is built: with trapping math
    # GCC will not if-convert a float comparison, so a loop with one (a clamp, a masked sum) is
    # not vectorised; the sampler's exp loop ran 7x slower without it. Results do not change.
    return ("-O3",) + ((f"-march={march}",) if march else ()) + ("-fopenmp", "-fno-trapping-math", "-fno-math-errno")


# The x86-64 micro-architecture levels as /proc/cpuinfo flags (glibc's hwcaps checks; "pni" is
# SSE3, "abm" LZCNT); each level needs those of the levels before it too.
X86_64_LEVELS = {
    "x86-64-v2": ("cx16", "lahf_lm", "pni", "popcnt", "sse4_1", "sse4_2", "ssse3"),
    "x86-64-v3": ("abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"),
    "x86-64-v4": ("avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl"),
}


def _cpuinfo_flags() -> set[str] | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return None


def missing_cpu_features(arch: str, flags: set[str] | None = None) -> list[str]:
    """The CPU flags that a setting's x86-64-vN target needs and this CPU (or `flags`) lacks,
    so a portable library is refused with a message instead of dying of SIGILL. Empty for
    other targets, or where the CPU's flags cannot be read."""
    march = _march(arch)
    if march not in X86_64_LEVELS:
        return []
    flags = _cpuinfo_flags() if flags is None else flags
    if flags is None:
        return []
    levels = list(X86_64_LEVELS)
    needed = [f for level in levels[: levels.index(march) + 1] for f in X86_64_LEVELS[level]]
    return [f for f in needed if f not in flags]


def _machine_key(arch: str) -> str:
    """What of the machine goes into the cache key: with ``native``, its CPU model and ISA
    flags (a -march=native binary may not run elsewhere); otherwise only its architecture."""
    return _cpu_signature() if arch == "native" else platform.machine()


CUDA_ARCH_ENV = "TORCH_CUDA_ARCH_LIST"
_CUDA_ARCH = re.compile(r"(\d+)\.(\d+)([a-z]?)(\+PTX)?")


def device_capability() -> tuple[int, int] | None:
    """The visible CUDA GPU's compute capability, e.g. (9, 0); None without a GPU."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())


def cuda_archs(capability: tuple[int, int] | None = None) -> list[str]:
    """The GPU architectures to build for, as ``"9.0"`` / ``"9.0+PTX"`` / ``"9.0a"`` entries:
    ``TORCH_CUDA_ARCH_LIST`` (separated by ``;``, ``,`` or spaces) if set, else the visible GPU's
    capability (or `capability`). Raises ValueError for a malformed entry or for no GPU at all."""
    env = os.environ.get(CUDA_ARCH_ENV, "").strip()
    if env:
        archs = [a for a in re.split(r"[;,\s]+", env) if a]
        bad = [a for a in archs if not _CUDA_ARCH.fullmatch(a)]
        if bad:
            raise ValueError(f"{CUDA_ARCH_ENV} entries must look like 8.0, 9.0a or 9.0+PTX, not {bad}")
        return archs
    capability = capability or device_capability()
    if capability is None:
        raise ValueError(f"no visible CUDA GPU and no {CUDA_ARCH_ENV}: nothing to build the CUDA ops for")
    return [f"{capability[0]}.{capability[1]}"]


def cuda_arch_flags(archs: list[str]) -> tuple[str, ...]:
    """nvcc ``-gencode`` flags: machine code (sm_XY) for every entry, plus PTX (compute_XY) for
    ``+PTX`` entries. NOTE: with a -gencode flag given, torch adds none of its own."""
    flags: list[str] = []
    for arch in archs:
        major, minor, suffix, ptx = _CUDA_ARCH.fullmatch(arch).groups()
        num = f"{major}{minor}{suffix}"
        flags += ["-gencode", f"arch=compute_{num},code=sm_{num}"]
        if ptx:
            flags += ["-gencode", f"arch=compute_{num},code=compute_{num}"]
    return tuple(flags)


def arch_runs_on(archs: list[str], capability: tuple[int, int]) -> bool:
    """Whether code built for `archs` runs on a GPU of `capability`: machine code for the same
    major and a minor <= its own (an ``a`` entry: exactly its own), or PTX for one <= it."""
    for arch in archs:
        major, minor, suffix, ptx = _CUDA_ARCH.fullmatch(arch).groups()
        built = (int(major), int(minor))
        if suffix and built == capability:
            return True
        if not suffix and built[0] == capability[0] and built[1] <= capability[1]:
            return True
        if ptx and not suffix and built <= capability:
            return True
    return False


def _gpu_key() -> str:
    """What of the GPU goes into a CUDA build's cache key: the arch list and the visible
    device's capability ("none" where neither is known: such a build is refused by ``load``)."""
    try:
        archs = cuda_archs()
    except ValueError:
        archs = None
    return repr((archs, device_capability()))


def source_hash(kind: str, arch: str | None = None) -> str:
    """Digest of everything that decides the built binary: sources, headers, flags, toolchain,
    and the CPU (``native``) or the machine architecture (other settings); for ``cuda``, also
    the GPU architectures built for and the visible GPU's capability. `arch` defaults to the
    ``PAGED_SERVE_CPU_ARCH`` setting."""
    arch = arch or cpu_arch()
    h = hashlib.sha256()
    for path in sorted(CSRC.rglob("*")):
        if kind == "cpu" and path.is_relative_to(CSRC / "cuda"):
            continue  # the CPU build compiles nothing from cuda/
        if path.is_file() and path.suffix in {".cpp", ".cu", ".h", ".cuh"}:
            h.update(str(path.relative_to(CSRC)).encode())
            h.update(path.read_bytes())
    h.update(repr((kind, cpu_flags(arch), CUDA_FLAGS, torch.__version__, torch.version.cuda)).encode())
    h.update(_machine_key(arch).encode())
    # NOTE: cpp_extension writes absolute source paths into build.ninja and rebuilds when they
    # change, so two checkouts sharing one key would rebuild the library in turn on every start.
    h.update(str(CSRC).encode())
    if kind == "cuda":
        h.update(_gpu_key().encode())
    return h.hexdigest()[:16]


def load(kind: str) -> Path:
    """Build (if not cached) and load the op library into this process; return its directory.

    Raises whatever the compiler or loader raises; :mod:`cuda_ext.ops` turns that into a
    fallback to the reference.
    """
    from torch.utils import cpp_extension  # imported lazily: it pulls in setuptools

    if kind not in ("cpu", "cuda"):
        raise ValueError(f"unknown build kind {kind!r}")
    arch = cpu_arch()
    missing = missing_cpu_features(arch)
    if missing:
        raise RuntimeError(
            f"{CPU_ARCH_ENV}={arch} builds for {_march(arch)}, which this CPU does not support "
            f"(no {', '.join(missing)}); set {CPU_ARCH_ENV}=native to build for this machine"
        )
    cuda_cflags = list(CUDA_FLAGS)
    if kind == "cuda":
        archs, capability = cuda_archs(), device_capability()
        if capability is not None and not arch_runs_on(archs, capability):
            raise RuntimeError(
                f"{CUDA_ARCH_ENV}={';'.join(archs)} has no code that this GPU (compute capability "
                f"{capability[0]}.{capability[1]}) runs; add {capability[0]}.{capability[1]} to it"
            )
        cuda_cflags += cuda_arch_flags(archs)
    name = f"paged_serve_ops_{kind}_{source_hash(kind, arch)}"
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
            "building the %s PagedAttention ops for CPU arch %s (first build, about a minute) in %s",
            kind.upper(), arch, build_dir,
        )
    start = time.perf_counter()
    cflags = list(cpu_flags(arch))
    with build_lock(build_dir):
        cpp_extension.load(
            name=name,
            sources=sources,
            extra_cflags=cflags + (["-DPAGED_SERVE_WITH_CUDA"] if kind == "cuda" else []),
            extra_cuda_cflags=cuda_cflags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            with_cuda=kind == "cuda",
            is_python_module=False,
            verbose=os.environ.get("PAGED_SERVE_BUILD_VERBOSE", "") not in ("", "0"),
        )
    if first:
        logger.info("built the %s ops in %.1f s", kind.upper(), time.perf_counter() - start)
    return build_dir


LOCK_NAME = "paged_serve.lock"
TORCH_BATON = "lock"  # cpp_extension's FileBaton: a plain file, left behind by a killed build


@contextlib.contextmanager
def build_lock(build_dir: Path):
    """Hold an exclusive ``flock`` on ``build_dir`` while cpp_extension builds or loads there.

    cpp_extension guards a build with a lock *file* that a killed builder never deletes; every
    later process then waits on it forever (a server stuck "loading" with nothing logged). An
    flock is dropped by the kernel when its holder dies, so once we hold ours, no live process
    of ours is building here and a leftover baton is stale: it is removed, with a warning.
    Waiting for a live builder is logged. A directory we cannot lock (read-only cache, a file
    system without flock) is used without the lock, as before.
    """
    try:
        fd = os.open(build_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        logger.warning("cannot lock %s (%s); building without a lock", build_dir, exc)
        yield
        return
    try:
        if _flock(fd, build_dir):
            baton = build_dir / TORCH_BATON
            if baton.exists():
                logger.warning("removing %s, left by a build that was killed", baton)
                with contextlib.suppress(FileNotFoundError):
                    baton.unlink()
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def _flock(fd: int, build_dir: Path) -> bool:
    """Take the exclusive lock on `fd`, waiting (logged) for a holder; False if locks fail."""
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another process is building the ops in %s; waiting for it", build_dir)
            fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as exc:  # e.g. ENOLCK on some network file systems
        logger.warning("cannot lock %s (%s); building without a lock", build_dir, exc)
        return False
    return True
