"""Container tests are opt-in: they run only when selected with `-m container`."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    if "container" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="builds and runs the image with podman: opt in with -m container")
    for item in items:
        if item.get_closest_marker("container"):
            item.add_marker(skip)
