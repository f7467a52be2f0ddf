"""`python -m server` / `paged-serve`: parse flags, build the app, serve until signalled."""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable
from typing import Any

import uvicorn

from engine.loop.engine_args import EngineArgs
from server.app import create_app
from server.cli import parse_args
from server.shutdown import DrainingServer


def _engine_factory(engine_args: EngineArgs, dotted: str | None) -> Callable[[], Any]:
    if dotted:
        module, _, name = dotted.partition(":")
        factory = getattr(importlib.import_module(module), name)
        return lambda: factory(engine_args)

    def build() -> Any:
        from engine.loop.llm_engine import LLMEngine

        return LLMEngine.from_engine_args(engine_args)

    return build


def main(argv: list[str] | None = None) -> int:
    cli = parse_args(argv)
    settings = cli.settings
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server: DrainingServer | None = None

    def on_load_failure(exc: BaseException) -> None:
        # NOTE: the engine thread has logged why (one line for a bad model file)
        logging.getLogger("server").error("Exiting: the engine failed to load")
        if server is not None:
            server.exit_now(1)

    app = create_app(settings, _engine_factory(cli.engine_args, cli.engine_factory), on_load_failure)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            access_log=settings.access_log, timeout_graceful_shutdown=5, log_config=None)
    server = DrainingServer(config, app.state.ctx)
    server.run()
    return server.exit_code


if __name__ == "__main__":
    sys.exit(main())
