"""paged-serve's OpenAI-compatible HTTP server (`python -m server`, `paged-serve`)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("paged-serve")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.1.0"
