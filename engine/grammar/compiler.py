"""Compiles constraints on a worker thread, off the step loop, with an LRU cache keyed by (kind, spec)."""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

from common.defaults import GRAMMAR_BACKENDS
from common.sampling import Constraint, InvalidRequest
from engine.grammar.base import CompiledGrammar, GrammarBackend, GrammarMatcher

DEFAULT_CACHE_SIZE = 256


def make_backend(name: str, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> GrammarBackend:
    """The named backend over the model directory's tokenizer.json and the model's vocabulary."""
    if name == "llguidance":
        from engine.grammar.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend.from_dir(model_dir, vocab_size, eos_token_ids)
    if name == "xgrammar":
        from engine.grammar.xgrammar_backend import XGrammarBackend

        return XGrammarBackend.from_dir(model_dir, vocab_size, eos_token_ids)
    raise ValueError(f"unknown grammar backend {name!r}; choose one of {', '.join(GRAMMAR_BACKENDS)}")


class GrammarCompiler:
    """Compiled grammars by (kind, spec). `submit` returns a Future that a server awaits before the
    request enters the scheduler, so a slow compile never stalls a step and a bad grammar fails
    only its own request (the Future raises InvalidRequest). The backend (its vocabulary index
    takes up to a second on a large tokenizer) is built by the first compile, on the worker."""

    def __init__(
        self, backend: Callable[[], GrammarBackend], cache_size: int = DEFAULT_CACHE_SIZE, workers: int = 1
    ) -> None:
        self._make_backend = backend
        self._backend: GrammarBackend | None = None
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._size = cache_size
        self._lock = threading.Lock()
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pdserve-grammar")
        self.compiles = 0  # cache misses (what a test or a metric reads)

    def submit(self, constraint: Constraint) -> Future[CompiledGrammar]:
        key = (constraint.kind, constraint.spec)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            self.compiles += 1
            fut = self._pool.submit(self._compile, *key)
            self._cache[key] = fut
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        fut.add_done_callback(lambda f: self._forget_failure(key, f))
        return fut

    @property
    def backend(self) -> GrammarBackend:
        with self._backend_lock:  # not self._lock: a submit must never wait for this build
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def _compile(self, kind: str, spec: str) -> CompiledGrammar:
        return self.backend.compile(kind, spec)

    def _forget_failure(self, key: tuple[str, str], fut: Future[CompiledGrammar]) -> None:
        """A failed compile is not cached: the error is the request's, not the grammar's forever
        (a resource limit may pass next time)."""
        if fut.cancelled() or fut.exception() is not None:
            with self._lock:
                if self._cache.get(key) is fut:
                    del self._cache[key]

    def matcher(self, constraint: Constraint, timeout: float | None = None) -> GrammarMatcher:
        """A fresh matcher, compiling (or waiting for the compile) in the calling thread's stead."""
        fut = self.submit(constraint)
        fut.exception(timeout)  # waits; raises TimeoutError when it runs out
        return new_matcher(fut)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def new_matcher(fut: Future[CompiledGrammar]) -> GrammarMatcher:
    """A fresh matcher from a finished compile; re-raises its InvalidRequest."""
    try:
        return fut.result().matcher()
    except InvalidRequest:
        raise
    except Exception as e:  # noqa: BLE001 - a backend's own failure names the request's grammar
        raise InvalidRequest(f"constraint could not be compiled: {type(e).__name__}: {e}") from None


async def await_matcher(fut: Future[CompiledGrammar]) -> GrammarMatcher:
    """`new_matcher` for an asyncio server: waits for the compile without blocking its event loop."""
    try:
        await asyncio.wrap_future(fut)
    except Exception:  # noqa: BLE001 - new_matcher re-raises it, as the request's error
        pass
    return new_matcher(fut)
