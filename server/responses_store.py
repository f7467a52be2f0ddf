"""`ResponseStore`: the responses /v1/responses keeps (`store`, true by default) so that
`previous_response_id` continues their conversation and `GET` / `DELETE /v1/responses/{id}`
find them; with each, its request's input items (`input_item_list`), which `GET
/v1/responses/{id}/input_items` lists a page at a time (`input_items_page`).

Bounded by count and by bytes (--responses-store-max-count, --responses-store-max-bytes): a put
that goes past either evicts the oldest responses first (a record larger than the whole byte
bound is not kept at all). In memory by default; with --responses-store PATH the records live in
a SQLite file (WAL) and survive restarts, while an index of ids and sizes (oldest first) stays
in memory for the bounds. Thread-safe: the route calls it on worker threads (`asyncio.to_thread`),
since serialising a large conversation or writing it to disk would stall the event loop.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from server.responses_api import new_id
from server.responses_output import output_text

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the Responses object as answered (what GET returns)
    messages: list[dict]  # the whole conversation as chat messages (ChatMessage's shape), this output included
    input_items: list[dict] = field(default_factory=list)  # this request's input (`input_item_list`)

    def to_json(self) -> str:
        return json.dumps({"response": self.response, "messages": self.messages, "input_items": self.input_items},
                          ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "StoredResponse":
        data = json.loads(text)
        # NOTE: a record written before input items were kept has none
        return cls(data["response"], data["messages"], data.get("input_items", []))


MAX_ITEM_ID = 128  # an input item's own id longer than this is replaced


def input_item_list(items: str | list[dict[str, Any]]) -> list[dict]:
    """A request's `input` (already checked by server/responses_api.py's `input_messages`) as
    OpenAI lists a stored response's input items: each with an id (its own if it sent a short
    one), messages with their content as parts, and a status."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    listed = []
    for item in items:
        kind = item.get("type", "message")
        own = item.get("id")
        entry: dict[str, Any] = {"id": own if isinstance(own, str) and 0 < len(own) <= MAX_ITEM_ID else None,
                                 "type": kind}
        if kind == "message":
            role, content = item["role"], item["content"]
            texts = [content] if isinstance(content, str) else [part.get("text") or "" for part in content]
            parts = ([output_text(t) for t in texts] if role == "assistant"
                     else [{"type": "input_text", "text": t} for t in texts])
            entry |= {"id": entry["id"] or new_id("msg"), "role": role, "content": parts, "status": "completed"}
        elif kind == "function_call":
            entry |= {"id": entry["id"] or new_id("fc"), "call_id": item["call_id"], "name": item["name"],
                      "arguments": item["arguments"], "status": "completed"}
        elif kind == "function_call_output":
            output = item["output"]
            if not isinstance(output, str):
                output = "\n".join(part.get("text") or "" for part in output)
            entry |= {"id": entry["id"] or new_id("fco"), "call_id": item["call_id"], "output": output,
                      "status": "completed"}
        else:  # reasoning
            entry |= {"id": entry["id"] or new_id("rs"), "summary": item.get("summary") or []}
        listed.append(entry)
    return listed


def input_items_page(items: list[dict], limit: int, order: str, after: str | None) -> dict | None:
    """OpenAI's list object of `items` in `order` ("asc": as sent, "desc": newest first), at
    most `limit` of them after the item with id `after`; None if no item has that id."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            return None
        start = ids.index(after) + 1
    page = ordered[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(ordered)}


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int, path: str | None = None) -> None:
        """`path`: a SQLite file to keep the records in (created if missing); None: memory."""
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.path = path
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # id -> bytes, oldest first
        self._bytes = 0
        self._memory: dict[str, str] = {}
        self._db: sqlite3.Connection | None = None
        if path is not None:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS responses "
                             "(seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, body TEXT NOT NULL)")
            for rid, size in self._db.execute("SELECT id, length(CAST(body AS BLOB)) FROM responses ORDER BY seq"):
                self._index[rid] = size
                self._bytes += size
            with self._lock:
                self._evict()  # the bounds may have shrunk since the file was written

    def __len__(self) -> int:
        return len(self._index)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, rid: str, record: StoredResponse) -> bool:
        """Keep `record` as `rid` (the newest), evicting the oldest past the bounds. False when
        the record alone is larger than the byte bound (then it is not kept)."""
        body = record.to_json()
        size = len(body.encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            logger.warning("response %s not stored: %d bytes exceed --responses-store-max-bytes (%d)",
                           rid, size, self.max_bytes)
            return False
        with self._lock:
            self._remove(rid)
            if self._db is not None:
                self._db.execute("INSERT INTO responses (id, body) VALUES (?, ?)", (rid, body))
            else:
                self._memory[rid] = body
            self._index[rid] = size
            self._bytes += size
            self._evict()
        return True

    def get(self, rid: str) -> StoredResponse | None:
        with self._lock:
            if rid not in self._index:
                return None
            if self._db is not None:
                row = self._db.execute("SELECT body FROM responses WHERE id = ?", (rid,)).fetchone()
                body = row[0] if row else None
            else:
                body = self._memory.get(rid)
        return None if body is None else StoredResponse.from_json(body)

    def delete(self, rid: str) -> bool:
        """Forget `rid`; False if it was not stored."""
        with self._lock:
            return self._remove(rid)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def _remove(self, rid: str) -> bool:
        size = self._index.pop(rid, None)
        if size is None:
            return False
        self._bytes -= size
        if self._db is not None:
            self._db.execute("DELETE FROM responses WHERE id = ?", (rid,))
        else:
            self._memory.pop(rid, None)
        return True

    def _evict(self) -> None:
        while self._index and (len(self._index) > self.max_count or self._bytes > self.max_bytes):
            self._remove(next(iter(self._index)))
