"""Shared by the kernel tests: one extension cache for the portable (x86-64-v2) build, which two
tests need (test_ops_backend's real portable build, test_quant_matmul's portable kernels).

NOTE: a portable build takes over two minutes on CI's two cores; in a fresh checkout's cache
each test would compile it again, so they share this session's folder."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def portable_ext_cache(tmp_path_factory) -> Path:
    """An extension cache folder for this session's portable build (empty until one test builds it)."""
    return tmp_path_factory.mktemp("portable_ext_cache")
