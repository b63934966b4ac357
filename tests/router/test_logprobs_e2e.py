"""Logprobs through the router, as clients read them: PD (EAGLE and plain) equals colocated plain
decoding, streamed and not, completions and chat; the first token's logprob is there (it was
sampled on the prefill node), the joined tokens are the text, and text_offset adds up."""

from __future__ import annotations

import json
import urllib.request

import pytest

from engine.kv_transfer import nixl_available
from fixtures.procs import Node
from tests.router.stack import start_stack, wait_status

pytestmark = [
    pytest.mark.slow,  # real node processes
    pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed"),
]
PROMPTS = ["def fibonacci(n):\n", "import os\n\n"]
TOL = 1e-3


def _post(url: str, path: str, body: dict) -> bytes:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read()


def _completion(url: str, model: str, prompt: str, stream: bool) -> tuple[str, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 3, "stream": stream}
    raw = _post(url, "/v1/completions", body)
    if not stream:
        choice = json.loads(raw)["choices"][0]
        return choice["text"], choice["logprobs"]
    text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            c = json.loads(line[6:])["choices"][0]
            text += c["text"]
            for k in lp:
                lp[k] += (c["logprobs"] or {}).get(k, [])
    return text, lp


def _chat(url: str, model: str, prompt: str) -> list[dict]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    return json.loads(_post(url, "/v1/chat/completions", body))["choices"][0]["logprobs"]["content"]


def _collect(url: str, model: str) -> dict:
    out = {}
    for p in PROMPTS:
        for stream in (False, True):
            out[(p, stream)] = _completion(url, model, p, stream)
        out[(p, "chat")] = _chat(url, model, p)
    return out


def _colocated(algorithm: str) -> tuple[Node, Node]:
    node = Node(["serve", "--port", "0", "--speculative-algorithm", algorithm])
    node.wait_ready(120)
    router = Node(
        ["router", "--host", "127.0.0.1", "--port", "0", "--colocated", f"127.0.0.1:{node.ports['scheduler']}"]
    )
    router.wait_ready(60)
    return node, router


def test_pd_and_speculative_logprobs_equal_colocated_plain() -> None:
    node, router = _colocated("NONE")
    stacks = []
    try:
        url = f"http://127.0.0.1:{router.ports['http']}"
        wait_status(url + "/ready", 200, 60)
        model = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=10).read())["data"][0]["id"]
        want = _collect(url, model)
        for algo in ("EAGLE", "NONE"):
            stack = start_stack(None, decodes=1, node_args=("--speculative-algorithm", algo))
            stacks.append(stack)
            got = _collect(stack.url, model)
            for key, w in want.items():
                g = got[key]
                if key[1] == "chat":
                    assert [e["token"] for e in g] == [e["token"] for e in w], (algo, key)
                    for ge, we in zip(g, w):
                        assert abs(ge["logprob"] - we["logprob"]) < TOL
                        assert ge["top_logprobs"][0]["token"] == ge["token"]  # greedy: top-1 chosen
                        assert [t["token"] for t in ge["top_logprobs"]] == [t["token"] for t in we["top_logprobs"]]
                    continue
                (text, lp), (wtext, wlp) = g, w
                assert text == wtext and lp["tokens"] == wlp["tokens"], (algo, key)
                assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["top_logprobs"])  # first one too
                assert "".join(lp["tokens"]) == text
                assert lp["text_offset"] == wlp["text_offset"]
                offsets = [lp["text_offset"][0] + len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
                assert lp["text_offset"] == offsets
                for a, b, tok, top in zip(
                    lp["token_logprobs"], wlp["token_logprobs"], lp["tokens"], lp["top_logprobs"]
                ):
                    assert abs(a - b) < TOL and max(top, key=top.get) == tok
    finally:
        for s in stacks:
            s.kill()
        node.kill()
        router.kill()
