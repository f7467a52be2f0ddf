"""Backend selection in cuda_ext.ops: compiled by default, reference when forced or when the
build fails (with a warning)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cuda_ext import build, ops

REPO = Path(__file__).resolve().parents[2]


def test_compiled_backend_loads_by_default():
    if os.environ.get("PAGED_SERVE_OPS", "auto").lower() == "reference":
        pytest.skip("PAGED_SERVE_OPS=reference forces the reference")
    assert ops.backend() in ("cpu", "cuda")


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
