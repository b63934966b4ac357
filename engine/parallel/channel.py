"""The leader rank's step-by-step instructions to its followers, over the group's host (gloo) link."""

from __future__ import annotations

import pickle
from typing import Any, Callable

import torch.distributed as dist

from engine.parallel.group import TpGroup

Op = tuple[str, Any]
STOP: Op = ("stop", None)
PLANS_KEPT = 64  # decode plans a batch may still refer to, by sequence number (formed just before launch)


class TpGroupFailed(RuntimeError):
    """A rank died or a collective missed its deadline: the node cannot step again."""


class PlanChannel:
    """Ops in the order the leader runs them; each `send` is one broadcast every follower receives
    before it runs the same device work (collectives must meet in the same order on every rank)."""

    def __init__(self, group: TpGroup, on_broken: Callable[[str], None] = lambda why: None) -> None:
        self.group, self.on_broken = group, on_broken
        self.sent = 0  # messages broadcast so far (a follower's transfer waits until it applied as many)

    def send(self, ops: list[Op]) -> None:
        self._broadcast(ops)
        self.sent += 1

    def recv(self) -> list[Op]:
        return self._broadcast(None)

    def _broadcast(self, ops: list[Op] | None) -> list[Op]:
        box: list[Any] = [ops]
        try:
            dist.broadcast_object_list(box, src=0, group=self.group.cpu_group)
        except (TypeError, AttributeError, pickle.PicklingError):
            raise  # an op that cannot be pickled: a bug of the caller's, the group is intact
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError, DistBackendError, ...
            why = f"tensor-parallel group broke: {type(e).__name__}: {e}"
            self.on_broken(why)
            raise TpGroupFailed(why) from e
        return box[0]
