"""common/logs.py: levels, text and JSON lines, and request ids attached from the context."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Iterator

import pytest

from common.logs import bind_request_id, context_without_request, setup_logging, unbind_request_id


class _Captured:
    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys

    def getvalue(self) -> str:
        return self.capsys.readouterr().err


@pytest.fixture
def stderr(capsys: pytest.CaptureFixture[str]) -> Iterator[_Captured]:
    """What the process logs (the handler writes to the sys.stderr of its set-up), with the root
    logger put back afterwards."""
    root = logging.getLogger()
    saved = (root.level, root.handlers[:])
    yield _Captured(capsys)
    root.handlers[:] = saved[1]
    root.setLevel(saved[0])


def test_json_lines_carry_the_bound_request_id(stderr: _Captured) -> None:
    setup_logging("info", "json")
    log = logging.getLogger("pdserve.test")
    log.info("outside %d", 1)
    token = bind_request_id("req-9")
    log.warning("inside")
    log.debug("below the level")
    unbind_request_id(token)
    log.info("explicit", extra={"request_id": "given"})
    try:
        raise KeyError("k")
    except KeyError:
        log.exception("failed")
    lines = [json.loads(line) for line in stderr.getvalue().splitlines()]
    assert [(x["level"], x["message"], x.get("request_id")) for x in lines] == [
        ("info", "outside 1", None),
        ("warning", "inside", "req-9"),
        ("info", "explicit", "given"),
        ("error", "failed", None),
    ]
    assert all(x["logger"] == "pdserve.test" and x["time"].endswith("+00:00") for x in lines)
    assert "KeyError" in lines[-1]["exception"]


def test_each_task_sees_only_its_own_request(stderr: _Captured) -> None:
    setup_logging("debug", "json")
    log = logging.getLogger("pdserve.test")

    async def handle(rid: str) -> None:
        bind_request_id(rid)  # as a node's Generate does: never reset, the task ends
        await asyncio.sleep(0.01)
        log.debug("work")

    async def main() -> None:
        await asyncio.gather(handle("a"), handle("b"))
        log.debug("after")

    asyncio.run(main())
    lines = [x for x in map(json.loads, stderr.getvalue().splitlines()) if x["logger"] == "pdserve.test"]
    assert sorted(x.get("request_id", "-") for x in lines) == ["-", "a", "b"]


def test_text_lines_end_with_the_request_id(stderr: _Captured) -> None:
    setup_logging("warning", "text")
    log = logging.getLogger("pdserve.test")
    token = bind_request_id("r1")
    log.warning("hello")
    log.info("hidden")
    unbind_request_id(token)
    log.error("bye")
    first, second = stderr.getvalue().splitlines()
    assert first.endswith("WARNING pdserve.test: hello request_id=r1") and second.endswith("ERROR pdserve.test: bye")


@pytest.mark.parametrize("level, fmt, bad", [("verbose", "text", "--log-level"), ("info", "xml", "--log-format")])
def test_bad_values_name_the_flag(level: str, fmt: str, bad: str) -> None:
    with pytest.raises(ValueError, match=bad):
        setup_logging(level, fmt)


def test_a_shared_task_started_by_a_request_does_not_carry_its_id(stderr: _Captured) -> None:
    setup_logging("info", "json")
    log = logging.getLogger("pdserve.test")

    async def main() -> None:
        bind_request_id("first")
        await asyncio.create_task(_log(log, "shared"), context=context_without_request())
        await asyncio.create_task(_log(log, "own"))

    asyncio.run(main())
    lines = [x for x in map(json.loads, stderr.getvalue().splitlines()) if x["logger"] == "pdserve.test"]
    assert [(x["message"], x.get("request_id")) for x in lines] == [("shared", None), ("own", "first")]


async def _log(log: logging.Logger, message: str) -> None:
    log.info(message)
