"""A tiny OpenAI-compatible SSE stub, for testing the load generator (not the engine).

It streams `max_tokens` chunks of " tok" with fixed delays, reports usage, counts tokens as
len(text) // 4 on POST /tokenize, and records what it received. Runs uvicorn in a thread on a
free loopback port.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


@dataclass
class StubState:
    tokenize: bool = True  # serve POST /tokenize
    accept_ignore_eos: bool = True  # False: answer 400 to any request carrying ignore_eos
    usage: bool = True  # report usage in non-streaming answers
    ttft_s: float = 0.02  # delay before the first chunk
    token_s: float = 0.005  # delay between chunks
    bodies: list[dict] = field(default_factory=list)  # every completion request body
    in_flight: int = 0
    peak_in_flight: int = 0


def count_tokens(text: str) -> int:
    return max(1, len(text) // 4)


def make_app(state: StubState) -> Starlette:
    async def completions(request: Request):
        body = await request.json()
        state.bodies.append(body)
        if "ignore_eos" in body and not state.accept_ignore_eos:
            return JSONResponse({"error": {"message": "unknown field ignore_eos"}}, status_code=400)
        n = int(body.get("max_tokens", 16))
        if not body.get("stream"):
            answer = {"object": "text_completion", "choices": [
                {"index": 0, "text": " tok" * n, "finish_reason": "length"}]}
            if state.usage:
                p = count_tokens(body["prompt"])
                answer["usage"] = {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
            return JSONResponse(answer)

        async def events():
            state.in_flight += 1
            state.peak_in_flight = max(state.peak_in_flight, state.in_flight)
            try:
                await asyncio.sleep(state.ttft_s)
                for i in range(n):
                    if i:
                        await asyncio.sleep(state.token_s)
                    chunk = {"object": "text_completion", "created": int(time.time()),
                             "choices": [{"index": 0, "text": " tok",
                                          "finish_reason": "length" if i == n - 1 else None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                if (body.get("stream_options") or {}).get("include_usage"):
                    usage = {"prompt_tokens": count_tokens(body["prompt"]),
                             "completion_tokens": n,
                             "total_tokens": count_tokens(body["prompt"]) + n}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    async def tokenize(request: Request):
        if not state.tokenize:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        body = await request.json()
        n = count_tokens(body["prompt"])
        return JSONResponse({"count": n, "tokens": list(range(n)), "max_model_len": 2048})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/tokenize", tokenize, methods=["POST"])])


@contextmanager
def run_stub(state: StubState):
    """Serve `make_app(state)` on 127.0.0.1 and a free port; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("stub server did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()
