"""Node health: a dead engine thread, or capacity leaked with nothing running, queued or in flight,
makes a node unhealthy (after a grace period for the unlocked reads); busy is not unhealthy."""

from __future__ import annotations

from types import SimpleNamespace

from engine.service.health import HealthWatch, leaked_capacity


def _engine(running: int = 0, waiting: int = 0, free_slots: int = 4, free_pages: int = 10) -> SimpleNamespace:
    kv = SimpleNamespace(
        num_free_slots=free_slots,
        cfg=SimpleNamespace(max_reqs=4),
        page_size=4,
        allocator=SimpleNamespace(num_free=free_pages, num_used=10 - free_pages),
        num_available=free_pages,  # no prefix cache here: what is free is what is available
        num_held=10 - free_pages,
        pages_for=lambda n: -(-n // 4),
    )
    policy = SimpleNamespace(running=[0] * running, waiting=[0] * waiting)
    return SimpleNamespace(
        scheduler=SimpleNamespace(policy=policy), kv=kv, executor=SimpleNamespace(kv_tokens_per_decode=lambda: 5)
    )


class Holder:
    def __init__(self, inflight: int = 0, stuck: str | None = None) -> None:
        self.n, self.stuck = inflight, stuck

    def inflight(self) -> int:
        return self.n

    def stuck_reason(self) -> str | None:
        return self.stuck


def test_leaked_capacity_is_only_what_nothing_uses() -> None:
    assert leaked_capacity(_engine(), Holder()) is None
    assert "request slots" in leaked_capacity(_engine(free_slots=0), Holder())
    assert "KV pages" in leaked_capacity(_engine(free_pages=1), Holder())
    assert leaked_capacity(_engine(), Holder(stuck="rows")) == "rows"
    # busy: running, queued or in flight is a full node, not a broken one
    for busy in (_engine(running=1, free_slots=0), _engine(waiting=2, free_pages=0)):
        assert leaked_capacity(busy, Holder()) is None
    assert leaked_capacity(_engine(free_slots=0), Holder(inflight=3)) is None


def test_watch_waits_out_a_grace_period_and_reports_a_dead_engine() -> None:
    alive, leak = [True], [None]
    watch = HealthWatch(lambda: alive[0], lambda: leak[0], grace_s=0.0)
    assert watch.check() is None
    leak[0] = "slots"
    assert watch.check() == "slots"
    slow = HealthWatch(lambda: True, lambda: "slots", grace_s=60.0)
    assert slow.check() is None  # not yet: one read between two scheduler steps proves nothing
    alive[0] = False
    assert watch.check() == "engine stopped"
