"""Session-wide fixtures: the default model is resolved (and its GGUF converted) once."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model_dir() -> str:
    from engine.models.loader import resolve_model

    return resolve_model(None)[0]
