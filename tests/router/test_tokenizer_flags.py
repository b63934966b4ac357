"""The router's --tokenizer and --chat-template, through a real router process in front of a fake
colocated node (in this process): the prompt the node receives is the one they make, and a bad
template or path (or an unknown --tool-call-parser) stops the router at start-up. Every wait is
bounded."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from common.tokenizer import Tokenizer
from fixtures.procs import Node
from tests.router.fake_nodes import FakeNode

pytestmark = pytest.mark.slow  # a real router process

TEMPLATE = "{% for m in messages %}<<{{ m.role }}|{{ m.content }}>>{% endfor %}ASSISTANT:"
MESSAGES = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def node() -> Iterator[FakeNode]:
    """A fake colocated node served from its own event loop thread (it reports /models/fake, a
    tokenizer directory that does not exist)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    fake = asyncio.run_coroutine_threadsafe(FakeNode("colocated").start(), loop).result(10)
    try:
        yield fake
    finally:
        asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def router(node: FakeNode, *args: str) -> Node:
    return Node(["router", "--host", "127.0.0.1", "--port", "0", "--colocated", node.address, *args])


def chat_prompt_ids(r: Node, node: FakeNode) -> list[int]:
    url = f"http://127.0.0.1:{r.wait_ready(60).ports['http']}"
    resp = httpx.post(
        f"{url}/v1/chat/completions", timeout=30, json={"model": "fake-model", "messages": MESSAGES, "max_tokens": 2}
    )
    assert resp.status_code == 200, resp.text
    return list(node.requests[-1].tokenized.input_ids)


@pytest.mark.parametrize("inline", [False, True], ids=["file", "inline"])
def test_tokenizer_and_chat_template_make_the_prompt(
    node: FakeNode, tiny_llama_dir: Path, tmp_path: Path, inline: bool
) -> None:
    template_file = tmp_path / "chat.jinja"
    template_file.write_text(TEMPLATE)
    r = router(node, "--tokenizer", str(tiny_llama_dir), "--chat-template", TEMPLATE if inline else str(template_file))
    try:
        ids = chat_prompt_ids(r, node)
    finally:
        r.kill()
    tok = Tokenizer.from_dir(tiny_llama_dir)
    assert ids == tok.encode("<<user|hi there>>ASSISTANT:", add_special_tokens=False)


def test_without_tokenizer_the_nodes_model_directory_is_used(node: FakeNode) -> None:
    r = router(node)
    try:
        assert r.proc.wait(60) == 2
    finally:
        r.kill()
    assert any("/models/fake" in line for line in r.lines), r.lines[-5:]


@pytest.mark.parametrize(
    "template, needle",
    [
        ("{% for m in messages %}{{ m.content }", "does not compile"),
        ("no-such-template.jinja", "no such file"),
    ],
)
def test_a_bad_template_stops_the_router_before_it_waits_for_nodes(
    tiny_llama_dir: Path, template: str, needle: str
) -> None:
    # nothing listens on the node's port: only a start-up check can end the router this fast
    r = Node(
        [
            "router",
            "--port",
            "0",
            "--colocated",
            "127.0.0.1:9",
            "--tokenizer",
            str(tiny_llama_dir),
            "--chat-template",
            template,
        ]
    )
    try:
        assert r.proc.wait(30) == 2
    finally:
        r.kill()
    errors = [line for line in r.lines if line.startswith("error: ")]
    assert len(errors) == 1 and needle in errors[0] and "--chat-template" in errors[0], r.lines[-5:]
    assert not any("Traceback" in line for line in r.lines)


def test_a_missing_tokenizer_directory_stops_the_router(tmp_path: Path) -> None:
    missing = tmp_path / "nothing-here"
    r = Node(["router", "--port", "0", "--colocated", "127.0.0.1:9", "--tokenizer", str(missing)])
    try:
        assert r.proc.wait(30) == 2
    finally:
        r.kill()
    assert any(line.startswith("error: ") and str(missing) in line for line in r.lines), r.lines[-5:]


def test_an_unknown_tool_call_parser_stops_the_router() -> None:
    r = Node(["router", "--port", "0", "--colocated", "127.0.0.1:9", "--tool-call-parser", "pythonic"])
    try:
        assert r.proc.wait(30) == 2
    finally:
        r.kill()
    errors = [line for line in r.lines if line.startswith("error: ")]
    assert len(errors) == 1 and "pythonic" in errors[0] and "hermes" in errors[0], r.lines[-5:]
