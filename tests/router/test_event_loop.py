"""The router's event loop (router/main.py serve_router, --event-loop): uvloop where installed
unless asyncio is asked for, a clear error for an unknown name or a missing uvloop."""

from __future__ import annotations

import asyncio
import builtins

import pytest

import router.main
from common.router_options import RouterOptions


@pytest.fixture
def loops(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The module of each loop run_router ran on."""
    seen: list[str] = []

    async def fake_run_router(options: RouterOptions) -> None:
        seen.append(type(asyncio.get_running_loop()).__module__.split(".")[0])

    monkeypatch.setattr(router.main, "run_router", fake_run_router)
    return seen


def test_auto_takes_uvloop_where_installed_and_asyncio_when_asked(loops: list[str]) -> None:
    pytest.importorskip("uvloop")
    router.main.serve_router(RouterOptions())
    router.main.serve_router(RouterOptions(event_loop="uvloop"))
    router.main.serve_router(RouterOptions(event_loop="asyncio"))
    assert loops == ["uvloop", "uvloop", "asyncio"]


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused(
    loops: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_import = builtins.__import__

    def no_uvloop(name: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "uvloop":
            raise ImportError("no uvloop here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    router.main.serve_router(RouterOptions())
    assert loops == ["asyncio"]
    with pytest.raises(ValueError, match="uvloop is not installed"):
        router.main.serve_router(RouterOptions(event_loop="uvloop"))


def test_an_unknown_loop_is_refused_by_name(loops: list[str]) -> None:
    with pytest.raises(ValueError, match="--event-loop 'trio'"):
        router.main.serve_router(RouterOptions(event_loop="trio"))
    assert not loops
