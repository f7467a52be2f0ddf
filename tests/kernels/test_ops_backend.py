"""Backend selection in cuda_ext.ops: compiled by default, reference when forced or when the
build fails (with a warning); and cuda_ext.build's PAGED_SERVE_CPU_ARCH setting (flags, cache
key, the CPU check, one real portable build)."""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cuda_ext import build, ops

REPO = Path(__file__).resolve().parents[2]


def expected_backend() -> str:
    """What this host should load: CUDA where torch sees a GPU and a CUDA toolkit exists."""
    import torch

    return "cuda" if torch.cuda.is_available() and build.cuda_home() is not None else "cpu"


def test_compiled_backend_loads_by_default():
    if os.environ.get("PAGED_SERVE_OPS", "auto").lower() == "reference":
        pytest.skip("PAGED_SERVE_OPS=reference forces the reference")
    assert ops.backend() == expected_backend()


def test_build_failure_falls_back_with_warning(monkeypatch, caplog):
    def broken(kind):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(build, "load", broken)
    monkeypatch.setenv("PAGED_SERVE_OPS", "auto")
    with caplog.at_level(logging.WARNING, logger="cuda_ext.ops"):
        assert ops.backend.__wrapped__() == "reference"
    assert "no compiler here" in caplog.text


def test_build_failure_is_an_error_when_compiled_is_required(monkeypatch):
    monkeypatch.setattr(build, "load", lambda kind: (_ for _ in ()).throw(RuntimeError("boom")))
    monkeypatch.setenv("PAGED_SERVE_OPS", "compiled")
    with pytest.raises(RuntimeError, match="boom"):
        ops.backend.__wrapped__()


def test_env_forces_reference():
    code = "from cuda_ext import ops; print(ops.backend())"
    env = {**os.environ, "PAGED_SERVE_OPS": "reference", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "reference"


def test_source_hash_changes_with_kind():
    assert build.source_hash("cpu") != build.source_hash("cuda")


# ------------------------------------------------------------------ CUDA architectures
@pytest.mark.parametrize(("env", "capability", "archs"), [
    (None, (9, 0), ["9.0"]),
    ("8.0;9.0", (9, 0), ["8.0", "9.0"]),
    (" 8.0, 9.0a 9.0+PTX ", None, ["8.0", "9.0a", "9.0+PTX"]),
])
def test_cuda_archs(monkeypatch, env, capability, archs):
    if env is None:
        monkeypatch.delenv(build.CUDA_ARCH_ENV, raising=False)
    else:
        monkeypatch.setenv(build.CUDA_ARCH_ENV, env)
    assert build.cuda_archs(capability) == archs


def test_cuda_archs_refuses_bad_entries_and_no_gpu(monkeypatch):
    monkeypatch.setenv(build.CUDA_ARCH_ENV, "9.0;sm_90")
    with pytest.raises(ValueError, match="sm_90"):
        build.cuda_archs()
    monkeypatch.delenv(build.CUDA_ARCH_ENV)
    monkeypatch.setattr(build, "device_capability", lambda: None)
    with pytest.raises(ValueError, match="no visible CUDA GPU"):
        build.cuda_archs()


def test_cuda_arch_flags():
    assert build.cuda_arch_flags(["8.0", "9.0+PTX", "9.0a"]) == (
        "-gencode", "arch=compute_80,code=sm_80",
        "-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_90,code=compute_90",
        "-gencode", "arch=compute_90a,code=sm_90a")


@pytest.mark.parametrize(("archs", "capability", "runs"), [
    (["9.0"], (9, 0), True),
    (["9.0"], (8, 0), False),   # an H200 build on an A100
    (["8.0"], (9, 0), False),   # machine code runs within one major version only
    (["8.0"], (8, 6), True),
    (["8.0+PTX"], (9, 0), True),  # PTX is compiled by the driver for newer GPUs
    (["9.0a"], (10, 0), False),
])
def test_arch_runs_on(archs, capability, runs):
    assert build.arch_runs_on(archs, capability) is runs


def test_cuda_cache_key_has_the_arch_list_and_the_gpu(monkeypatch):
    """A CUDA build for one GPU is never loaded on another from a shared cache."""
    monkeypatch.delenv(build.CUDA_ARCH_ENV, raising=False)
    keys = set()
    for capability in ((8, 0), (9, 0)):
        monkeypatch.setattr(build, "device_capability", lambda c=capability: c)
        keys.add(build.source_hash("cuda"))
        cpu_key = build.source_hash("cpu")
    monkeypatch.setenv(build.CUDA_ARCH_ENV, "8.0;9.0")
    keys.add(build.source_hash("cuda"))
    assert len(keys) == 3
    assert build.source_hash("cpu") == cpu_key  # the CPU build does not depend on the GPU


def test_load_refuses_an_arch_list_without_code_for_this_gpu(monkeypatch):
    """Refused before compiling (cuda_ext.ops then falls back with a warning), not at the first
    launch with "no kernel image is available"."""
    monkeypatch.setattr(build, "device_capability", lambda: (9, 0))
    monkeypatch.setattr(build, "cuda_home", lambda: Path("/usr/local/cuda"))
    monkeypatch.setenv(build.CUDA_ARCH_ENV, "8.0;8.6")
    with pytest.raises(RuntimeError, match="no code that this GPU .compute capability 9.0. runs"):
        build.load("cuda")


# ------------------------------------------------------------------ PAGED_SERVE_CPU_ARCH
ARCH_FLAGS = [
    ("native", "x86_64", ("-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-fno-math-errno")),
    ("portable", "x86_64", ("-O3", "-march=x86-64-v2", "-fopenmp", "-fno-trapping-math", "-fno-math-errno")),
    ("portable", "aarch64", ("-O3", "-march=armv8-a", "-fopenmp", "-fno-trapping-math", "-fno-math-errno")),
    ("portable", "riscv64", ("-O3", "-fopenmp", "-fno-trapping-math", "-fno-math-errno")),  # no known baseline: the compiler's default
    ("x86-64-v3", "x86_64", ("-O3", "-march=x86-64-v3", "-fopenmp", "-fno-trapping-math", "-fno-math-errno")),
]


@pytest.mark.parametrize(("arch", "machine", "flags"), ARCH_FLAGS)
def test_cpu_flags_per_setting(arch, machine, flags):
    assert build.cpu_flags(arch, machine) == flags


@pytest.mark.parametrize(("value", "arch"), [(None, "native"), ("", "native"), ("portable", "portable"),
                                             (" x86-64-v3 ", "x86-64-v3")])
def test_cpu_arch_setting(monkeypatch, value, arch):
    if value is None:
        monkeypatch.delenv(build.CPU_ARCH_ENV, raising=False)
    else:
        monkeypatch.setenv(build.CPU_ARCH_ENV, value)
    assert build.cpu_arch() == arch


def test_cpu_arch_setting_rejects_a_flag_injection(monkeypatch):
    monkeypatch.setenv(build.CPU_ARCH_ENV, "native -fno-builtin")
    with pytest.raises(ValueError, match="PAGED_SERVE_CPU_ARCH"):
        build.cpu_arch()


def test_cache_key_has_the_cpu_model_only_for_native(monkeypatch):
    """A native build is keyed by this CPU (another CPU builds its own); a portable one is not,
    so a library built in an image loads on any host of the same architecture."""
    keys = {}
    for cpu in ("model name: CPU A\nflags: sse avx2", "model name: CPU B\nflags: sse"):
        monkeypatch.setattr(build, "_cpu_signature", lambda cpu=cpu: cpu)
        keys[cpu] = {arch: build.source_hash("cpu", arch) for arch in ("native", "portable", "x86-64-v3")}
    a, b = keys.values()
    assert a["native"] != b["native"]
    assert a["portable"] == b["portable"] and a["x86-64-v3"] == b["x86-64-v3"]
    assert len({a["native"], a["portable"], a["x86-64-v3"]}) == 3
    monkeypatch.setattr(build.platform, "machine", lambda: "aarch64")
    assert build.source_hash("cpu", "portable") != a["portable"]  # still keyed by the architecture


def test_source_hash_follows_the_setting(monkeypatch):
    monkeypatch.setenv(build.CPU_ARCH_ENV, "portable")
    assert build.source_hash("cpu") == build.source_hash("cpu", "portable")
    monkeypatch.delenv(build.CPU_ARCH_ENV)
    assert build.source_hash("cpu") == build.source_hash("cpu", "native")


V3_HOST = set(build.X86_64_LEVELS["x86-64-v2"] + build.X86_64_LEVELS["x86-64-v3"])


@pytest.mark.parametrize(("arch", "flags", "missing"), [
    ("portable", V3_HOST, []),
    ("x86-64-v3", V3_HOST, []),
    ("x86-64-v4", V3_HOST, list(build.X86_64_LEVELS["x86-64-v4"])),
    ("x86-64-v3", V3_HOST - {"avx2", "fma"}, ["avx2", "fma"]),
    ("portable", V3_HOST - {"sse4_2"}, ["sse4_2"]),  # e.g. a VM with QEMU's default CPU model
    ("native", set(), []),
    ("znver3", set(), []),  # not a level: the operator's word is taken
])
def test_missing_cpu_features(monkeypatch, arch, flags, missing):
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    assert build.missing_cpu_features(arch, flags) == missing


def test_load_refuses_a_target_this_cpu_lacks(monkeypatch):
    """Refused before any compiler runs; cuda_ext.ops then falls back to the reference."""
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(build, "_cpuinfo_flags", lambda: V3_HOST - {"avx2"})
    monkeypatch.setenv(build.CPU_ARCH_ENV, "x86-64-v3")
    with pytest.raises(RuntimeError, match="no avx2"):
        build.load("cpu")


PORTABLE_RUN = """
import torch
from cuda_ext import build, ops, reference
assert ops.backend() == "cpu"
torch.manual_seed(0)
kc, vc = torch.randn(8, 2, 4, 32), torch.randn(8, 2, 4, 32)
q = torch.randn(3, 4, 32)
tables = torch.tensor([[5, 1, 7], [0, 2, 3], [6, 4, 0]], dtype=torch.int32)
lens = torch.tensor([9, 12, 1], dtype=torch.int32)
out, ref = torch.empty_like(q), torch.empty_like(q)
ops.paged_attention(out, q, kc, vc, tables, lens, 32 ** -0.5, 12)
reference.paged_attention(ref, q, kc, vc, tables, lens, 32 ** -0.5, 12)
torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
print(build.load("cpu"))
"""


@pytest.mark.skipif(build.PORTABLE_MARCH.get(platform.machine().lower()) != "x86-64-v2", reason="x86-64 only")
def test_portable_build_runs_and_uses_no_avx(tmp_path, portable_ext_cache):
    """A real portable build into an empty cache (minutes on two cores): it loads, matches the
    reference, and its code has no AVX instructions (no ymm/zmm registers), so it runs on any
    x86-64-v2. The cache holds the lock file a killed build leaves behind: the build must not
    wait on it. The session's portable cache when still empty (test_quant_matmul then reuses
    the build), else a fresh one."""
    if not any(portable_ext_cache.iterdir()):
        tmp_path = portable_ext_cache
    stale = tmp_path / f"paged_serve_ops_cpu_{build.source_hash('cpu', 'portable')}" / build.TORCH_BATON
    stale.parent.mkdir()
    stale.write_text("")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PAGED_SERVE_EXT_CACHE": str(tmp_path),
           build.CPU_ARCH_ENV: "portable", "PAGED_SERVE_OPS": "compiled", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", PORTABLE_RUN], env=env, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "left by a build that was killed" in result.stderr
    build_dir = Path(result.stdout.strip().splitlines()[-1])
    assert build_dir.parent == tmp_path and build_dir.name.endswith(build.source_hash("cpu", "portable"))
    if shutil.which("objdump") is None:
        pytest.skip("no objdump to inspect the library")
    library = next(build_dir.glob("*.so"))
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True,
                         check=True).stdout
    assert "%xmm" in asm  # vectorised with SSE
    assert "%ymm" not in asm and "%zmm" not in asm


def test_build_lock_waits_for_a_live_builder_and_clears_a_dead_ones_baton(tmp_path, caplog):
    """The flock is exclusive: a second taker waits (and says so) until the holder lets go;
    the baton file of a builder that died is removed once the lock is held."""
    import threading

    (tmp_path / build.TORCH_BATON).write_text("")
    entered = threading.Event()
    release = threading.Event()

    def holder():
        with build.build_lock(tmp_path):
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    assert entered.wait(10)
    assert not (tmp_path / build.TORCH_BATON).exists()
    (tmp_path / build.TORCH_BATON).write_text("")  # the live holder's own baton: must survive
    got = threading.Event()

    def waiter():
        with build.build_lock(tmp_path):
            got.set()

    caplog.set_level("INFO", logger=build.logger.name)
    second = threading.Thread(target=waiter)
    second.start()
    assert not got.wait(0.5)  # blocked while the holder builds
    assert (tmp_path / build.TORCH_BATON).exists()
    (tmp_path / build.TORCH_BATON).unlink()  # the holder's build finishes and removes its baton
    release.set()
    assert got.wait(10)
    thread.join(10)
    second.join(10)
    assert any("waiting for it" in r.getMessage() for r in caplog.records)


def test_build_lock_without_a_writable_directory(tmp_path, caplog):
    """A cache directory that cannot hold the lock file still lets the build run (unlocked)."""
    missing = tmp_path / "not-there"
    ran = False
    with build.build_lock(missing):
        ran = True
    assert ran
    assert any("building without a lock" in r.getMessage() for r in caplog.records)
