"""HTTP helpers shared by the server tests."""

from __future__ import annotations

import json
import time

import httpx


def wait_http_ok(url: str, timeout: float, proc=None, interval: float = 0.2) -> str:
    """GET `url` until it answers 200 ("ok"), `proc` (a Popen, if given) has exited
    ("exited"), or `timeout` seconds have passed ("timeout")."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            return "exited"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return "ok"
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            return "timeout"
        time.sleep(interval)


def post(server, path: str, body, headers: dict | None = None, timeout: float = 120) -> httpx.Response:
    """POST `body` (a JSON value, or raw str/bytes sent as is) as application/json."""
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=timeout,
                      headers={"content-type": "application/json", **(headers or {})})


def assert_error(resp: httpx.Response, status: int, param: str | None = "<any>") -> dict:
    """`resp` is `status` with an OpenAI error body (and `param` when given); returns the error."""
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param != "<any>":
        assert error["param"] == param, error
    return error


def sse_events(text: str) -> list:
    """The JSON events of an SSE body that ends with `data: [DONE]`, and "[DONE]" last."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    frames = text.split("\n\n")
    assert frames[-1] == ""
    events = []
    for frame in frames[:-1]:
        assert frame.startswith("data: "), frame
        payload = frame[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def block_pool_is_free(url: str) -> bool:
    """No KV block is in use, shared or swapped (free blocks may still cache a prefix)."""
    m = httpx.get(url + "/kv/blocks", timeout=30).json()
    # 0 free, 3 cached (free, holding a reusable prefix); nothing used, shared or swapped.
    return all(s in (0, 3) for s in m["blocks"]) and not any(m["ref_counts"]) and not any(m["cpu_blocks"])


def wait_pool_free(url: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not block_pool_is_free(url):
        assert time.monotonic() < deadline, httpx.get(url + "/kv/blocks").json()
        time.sleep(0.05)
