"""Helpers shared by the observability tests."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

DASHBOARD_HTML = Path(__file__).resolve().parents[2] / "server" / "static" / "dashboard.html"


def chromium_path() -> str | None:
    """Debian's chromium (apt-get install chromium), or $CHROMIUM_PATH."""
    for candidate in (os.environ.get("CHROMIUM_PATH"), "/usr/bin/chromium",
                      shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
