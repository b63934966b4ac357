"""Process logging for nodes and the router: the level, text or JSON lines, and the id of the request
a line concerns, taken from a context variable so that no call has to pass it along."""

from __future__ import annotations

import contextvars
import json
import logging
from datetime import datetime, timezone

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Set where a request enters a process (the router's HTTP middleware, a node's Generate call). Each
# HTTP request and each gRPC call runs in its own asyncio task, and tasks copy the context they are
# created in, so the id covers everything done for that request in this process and nothing else.
_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdserve_request_id", default=None)


def bind_request_id(request_id: str | None) -> contextvars.Token[str | None]:
    """Mark the current task's later log lines as concerning `request_id`."""
    return _REQUEST_ID.set(request_id or None)


def unbind_request_id(token: contextvars.Token[str | None]) -> None:
    _REQUEST_ID.reset(token)


def context_without_request() -> contextvars.Context:
    """The current context minus the request id: for a task that outlives or serves more than the
    request that happens to start it (asyncio.create_task(..., context=...))."""
    ctx = contextvars.copy_context()
    ctx.run(_REQUEST_ID.set, None)
    return ctx


class _RequestIdFilter(logging.Filter):
    """Gives every record a `request_id` attribute: its own (`extra=`), else the context's, else None."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = _REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, request_id, exception."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if rid := getattr(record, "request_id", None):
            out["request_id"] = rid
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """The classic line, with ` request_id=...` at the end when the record concerns a request."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # the line before any traceback
        line = super().formatMessage(record)
        rid = getattr(record, "request_id", None)
        return f"{line} request_id={rid}" if rid else line


def setup_logging(level: str, fmt: str) -> None:
    """Configure the root logger (stderr) once per process; ValueError names a bad level or format."""
    if level.lower() not in LEVELS:
        raise ValueError(f"--log-level {level!r}: use one of {', '.join(LEVELS)}")
    if fmt.lower() not in FORMATS:
        raise ValueError(f"--log-format {fmt!r}: use one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler()
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt.lower() == "json" else TextFormatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # grpc logs a line per call at debug that says nothing about the call; keep debug readable
    logging.getLogger("grpc._cython.cygrpc").setLevel(max(logging.INFO, logging.getLogger().level))
