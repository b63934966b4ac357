"""Clients that hang up: while sending their body, before their first token, mid-stream. Each is one
log line and a count by stage on /metrics, never a traceback or a 500; the jobs are cancelled."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.tokenizer import Tokenizer
from fixtures.waiting import wait_until
from tests.router.fake_dispatcher import Script, server, wait_for
from tests.router.test_app import MODEL, make


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


class _Records(logging.Handler):
    """Every record of the router's loggers and uvicorn's (which logs unhandled app errors, with
    their traceback, on `uvicorn.error` and does not propagate to the root)."""

    NAMES = ("router", "uvicorn", "uvicorn.error", "starlette", "fastapi")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._levels: dict[str, int] = {}

    def attach(self) -> None:
        """After the server started: uvicorn's logging setup replaces its loggers' handlers."""
        for name in self.NAMES:
            lg = logging.getLogger(name)
            self._levels.setdefault(name, lg.level)
            lg.addHandler(self)
        logging.getLogger("router").setLevel(logging.DEBUG)

    def detach(self) -> None:
        for name, level in self._levels.items():
            logging.getLogger(name).removeHandler(self)
            logging.getLogger(name).setLevel(level)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str:
        return "\n".join(
            f"{r.levelname} {r.name}: {r.getMessage()}" + (" [exc_info]" if r.exc_info else "") for r in self.records
        )


@pytest.fixture
def logs() -> Iterator[_Records]:
    handler = _Records()
    try:
        yield handler
    finally:
        handler.detach()


def _metric(url: str, needle: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(needle):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _disconnects(url: str, stage: str) -> float:
    return _metric(url, f'pdserve_router_client_disconnects_total{{stage="{stage}"}}')


class BodyReads:
    """The app behind a counter of its receive() calls: the app asks for body bytes through them, so
    a new call means it is reading a request's body."""

    def __init__(self, app: ASGIApp) -> None:
        self.app, self.calls = app, 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def counted() -> Message:
            self.calls += 1
            return await receive()

        await self.app(scope, counted, send)


def send_partial_body(url: str, reads: BodyReads, path: str = "/v1/chat/completions") -> None:
    """Headers announcing a large body, a few bytes of it, then, once the app reads it, a closed socket."""
    host, port = url.removeprefix("http://").split(":")
    before = reads.calls
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            "Content-Length: 100000\r\n\r\n".encode()
            + b'{"model": "tiny-chat", "mess'
        )
        wait_until(lambda: reads.calls > before, 5.0, "the app to read the request body")


def test_disconnect_while_the_body_is_read(tok: Tokenizer, logs: _Records) -> None:
    app, fake = make(tok)
    reads = BodyReads(app)
    with server(reads) as url:
        logs.attach()
        for _ in range(2):
            send_partial_body(url, reads)
        assert wait_for(lambda: _disconnects(url, "body") == 2), logs.text()
        assert httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 200
        status_500 = _metric(url, 'pdserve_router_requests_total{endpoint="/v1/chat/completions",status="500"}')
    text = logs.text()
    assert "Traceback" not in text and "[exc_info]" not in text and "ClientDisconnect" not in text, text
    assert not any(r.levelno >= logging.WARNING for r in logs.records), text
    lines = [r for r in logs.records if "while sending its request body" in r.getMessage()]
    assert len(lines) == 2 and all(r.levelno == logging.INFO for r in lines), text
    assert status_500 == 0 and len(fake.jobs) == 1


def test_disconnects_before_the_first_token_and_mid_stream_are_counted(tok: Tokenizer, logs: _Records) -> None:
    app, fake = make(tok, lambda job: Script(delay_s=30.0))  # no event for 30 s
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    with server(app) as url, httpx.Client(base_url=url) as http:
        logs.attach()
        for stream in (True, False):
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/chat/completions", json={**body, "stream": stream}, timeout=0.5)
        assert wait_for(lambda: _disconnects(url, "before_first_token") == 2)
        assert wait_for(lambda: len(fake.cancelled) == 2)
        fake.script = lambda job: Script(hang=True)  # the reply, then nothing: the client leaves mid-stream
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}, timeout=10) as r:
            lines = r.iter_lines()
            next(lines)
        assert wait_for(lambda: _disconnects(url, "streaming") == 1)
        assert wait_for(lambda: len(fake.cancelled) == 3)
        assert _disconnects(url, "body") == 0
    assert "Traceback" not in logs.text() and "[exc_info]" not in logs.text(), logs.text()
