"""The request id: the client's X-Request-Id (or one made up), echoed on every response, bound to the
router's log lines and sent to the nodes as the base of their request ids.

Nodes key their requests by id, so two requests in flight must never share one (or have one extend
the other: a request's node-side ids add `-N` per choice and `-retryN` per retry). A client reusing
an id still in flight, as a proxy retrying a request that timed out does, gets a unique tail on its
node-side ids; the echoed header stays what it sent.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from common.logs import bind_request_id, unbind_request_id

log = logging.getLogger(__name__)

HEADER = "X-Request-Id"
_KEY = HEADER.lower().encode()  # as ASGI spells header names
MAX_LEN = 128


def valid(value: str) -> bool:
    """Printable ASCII without spaces, 1 to MAX_LEN characters: safe in headers, logs and ids."""
    return 0 < len(value) <= MAX_LEN and all("!" <= c <= "~" for c in value)


def _clashes(a: str, b: str) -> bool:
    return a == b or a.startswith(b + "-") or b.startswith(a + "-")


class RequestIdMiddleware:
    """Pure ASGI middleware (like metrics.ResponseCounter, it must not wrap streaming bodies): sets
    `scope["state"]["request_id"]` (echoed) and `["node_request_id"]` (unique among requests in
    flight here) for the whole response, streamed ones included."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.in_flight: set[str] = set()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = self._from_client(scope) or uuid.uuid4().hex
        node_rid = self._unique(rid)
        scope.setdefault("state", {}).update(request_id=rid, node_request_id=node_rid)

        async def echoing_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (_KEY, rid.encode())]
                log.debug("%s %s -> %d", scope.get("method"), scope.get("path"), message["status"])
            await send(message)

        self.in_flight.add(node_rid)
        token = bind_request_id(rid)
        try:
            await self.app(scope, receive, echoing_send)
        finally:
            unbind_request_id(token)
            self.in_flight.discard(node_rid)

    def _unique(self, rid: str) -> str:
        """`rid`, with a random tail when it would share node-side ids with a request in flight."""
        return rid if not any(_clashes(rid, other) for other in self.in_flight) else f"{rid}-{uuid.uuid4().hex[:8]}"

    @staticmethod
    def _from_client(scope: Any) -> str | None:
        for name, value in scope.get("headers", []):
            if name == _KEY:
                text = value.decode("latin-1")
                if valid(text):
                    return text
                log.debug("ignoring an invalid %s (%d characters); using a new id", HEADER, len(text))
        return None


def request_id_of(request: Any) -> str:
    """The id the middleware gave this request (a fresh one outside it)."""
    return request.scope.get("state", {}).get("request_id") or uuid.uuid4().hex


def node_request_id_of(request: Any) -> str:
    """The base of the request's node-side ids."""
    return request.scope.get("state", {}).get("node_request_id") or uuid.uuid4().hex
