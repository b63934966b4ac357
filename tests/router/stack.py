"""A real PD stack on loopback for end-to-end router tests: one prefill node, N decode nodes and
the router in front of them, all as `pdserve` processes (fixtures.procs.Node). Bounded waits only;
`kill()` ends every process the stack ever started."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from fixtures.pdkit import stub, wait_idle
from fixtures.procs import Node

NODE_ARGS = ("--page-size", "4")


def _model_args(model: str | None) -> list[str]:
    """None: the built-in pair (pycoder with its EAGLE head)."""
    return [] if model is None else ["--model", model]


def decode_node(model: str | None, port: int = 0, extra: tuple[str, ...] = ()) -> Node:
    return Node(["decode", *_model_args(model), "--port", str(port), *NODE_ARGS, *extra])


def http_status(url: str, timeout: float = 5.0) -> int | None:
    """GET status code, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def wait_status(url: str, want: int, timeout: float) -> float:
    """Poll `url` until it answers `want` (bounded); returns the seconds it took."""
    start = time.monotonic()
    while (got := http_status(url)) != want:
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{url} answered {got}, not {want}, for {timeout} s")
        time.sleep(0.1)
    return time.monotonic() - start


@dataclass
class Stack:
    model: str | None
    prefill: Node
    decodes: list[Node]
    router: Node
    spares: list[Node] = field(default_factory=list)  # nodes started later (restarts)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router.ports['http']}"

    @property
    def served_model(self) -> str:
        with urllib.request.urlopen(f"{self.url}/v1/models", timeout=10) as r:
            return json.load(r)["data"][0]["id"]

    def live_nodes(self) -> list[Node]:
        return [n for n in [self.prefill, *self.decodes, *self.spares] if n.proc.poll() is None]

    def wait_all_idle(self, timeout: float = 20.0) -> None:
        for n in self.live_nodes():
            load = wait_idle(stub(n.ports["scheduler"]), timeout)
            assert load.num_used_tokens == 0

    def kill(self) -> None:
        for n in [self.router, self.prefill, *self.decodes, *self.spares]:
            n.kill()


def start_stack(
    model: str | None,
    decodes: int = 2,
    ready_timeout: float = 60.0,
    router_args: tuple[str, ...] = (),
    node_args: tuple[str, ...] = (),
    prefill_args: tuple[str, ...] = (),
) -> Stack:
    """Nodes start in parallel; then the router; then /ready must turn 200 (a real handoff).
    `node_args` go to every node, `prefill_args` to the prefill node alone."""
    prefill = Node(
        ["prefill", *_model_args(model), "--port", "0", "--bootstrap-port", "0", *NODE_ARGS, *node_args, *prefill_args]
    )
    ds = [decode_node(model, extra=node_args) for _ in range(decodes)]
    started: list[Node] = [prefill, *ds]
    try:
        for n in started:
            n.wait_ready(120)
        router = Node(
            [
                "router",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--prefill",
                f"127.0.0.1:{prefill.ports['scheduler']},{prefill.ports['bootstrap']}",
                *[a for d in ds for a in ("--decode", f"127.0.0.1:{d.ports['scheduler']}")],
                *router_args,
            ]
        )
        started.append(router)
        router.wait_ready(60)
        stack = Stack(model, prefill, ds, router)
        wait_status(f"{stack.url}/ready", 200, ready_timeout)
        return stack
    except BaseException:
        for n in started:
            n.kill()
        raise


@contextmanager
def running_stack(model: str | None, **kw: Any) -> Iterator[Stack]:
    """start_stack's stack, killed on exit."""
    s = start_stack(model, **kw)
    try:
        yield s
    finally:
        s.kill()
