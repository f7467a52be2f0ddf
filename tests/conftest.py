"""Session-wide fixtures: the default model is resolved (and its GGUF converted) once. Tests
marked `slow` (long soak, fuzz and stress runs, and the larger variants of some parametrized
tests) run only when asked for: `-m slow`; CI runs a representative subset."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model_dir() -> str:
    from engine.worker.models.loader import resolve_model

    return resolve_model(None, quantization="none")[0]  # the HF directory of its dequantized weights


# Opt-in markers: a test marked with one runs only when `-m` names it.
OPT_IN = {"slow": "long fuzz / soak run: opt in with -m slow",
          "container": "builds and runs the image with podman: opt in with -m container"}


def pytest_collection_modifyitems(config, items):
    selected = config.getoption("markexpr") or ""
    for marker, reason in OPT_IN.items():
        if marker in selected:
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if item.get_closest_marker(marker):
                item.add_marker(skip)
