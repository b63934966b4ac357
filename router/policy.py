"""Node selection: prefill policies (round_robin, least_load, prefix_aware), decode policies
(round_robin, least_load), and pair selection (a decode first, then a compatible prefill).

Policies see only usable candidates (healthy, breaker closed or probing, not excluded) and
always return one of them; an empty candidate list is the caller's "no pair" case.
"""

from __future__ import annotations

import bisect
import hashlib
from typing import Callable, Collection, Protocol, Sequence

from router.contract import GenerationJob
from router.nodes import NodeRegistry, NodeState, compatible


class Policy(Protocol):
    name: str

    def choose(self, nodes: Sequence[NodeState], job: GenerationJob) -> NodeState: ...


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, nodes: Sequence[NodeState], job: GenerationJob) -> NodeState:
        # Order by address so the rotation is stable while nodes come and go.
        ordered = sorted(nodes, key=lambda n: n.address)
        node = ordered[self._next % len(ordered)]
        self._next += 1
        return node


class LeastLoad:
    """Fewest outstanding requests (node-reported running + waiting, plus our in-flight);
    ties rotate, so an idle cluster still spreads requests."""

    name = "least_load"

    def __init__(self) -> None:
        self._tie = RoundRobin()

    def choose(self, nodes: Sequence[NodeState], job: GenerationJob) -> NodeState:
        lightest = min(n.load for n in nodes)
        return self._tie.choose([n for n in nodes if n.load == lightest], job)


class PrefixAware:
    """Requests sharing their first `prefix_tokens` tokens go to the same prefill (its radix
    cache holds that prefix) by consistent hashing over the candidates, so adding or losing a
    node moves only its share of prefixes. Short prompts, and a sticky node that is much busier
    than the lightest (`balance_threshold` more outstanding requests), go to least-load."""

    name = "prefix_aware"

    def __init__(self, prefix_tokens: int = 128, balance_threshold: int = 32, replicas: int = 64) -> None:
        self.prefix_tokens, self.balance_threshold, self.replicas = prefix_tokens, balance_threshold, replicas
        self.fallback = LeastLoad()
        self._ring_key: tuple[str, ...] = ()
        self._ring: list[tuple[int, str]] = []

    def choose(self, nodes: Sequence[NodeState], job: GenerationJob) -> NodeState:
        if len(job.input_ids) < self.prefix_tokens:
            return self.fallback.choose(nodes, job)
        address = self._owner(tuple(sorted(n.address for n in nodes)), _hash_ids(job.input_ids[: self.prefix_tokens]))
        sticky = next(n for n in nodes if n.address == address)
        if sticky.load - min(n.load for n in nodes) > self.balance_threshold:
            return self.fallback.choose(nodes, job)
        return sticky

    def _owner(self, addresses: tuple[str, ...], key: int) -> str:
        if addresses != self._ring_key:  # rebuilt only when the candidate set changes
            self._ring = sorted((_hash_bytes(f"{a}#{i}".encode()), a) for a in addresses for i in range(self.replicas))
            self._ring_key = addresses
        i = bisect.bisect(self._ring, (key, ""))
        return self._ring[i % len(self._ring)][1]


def _hash_bytes(data: bytes) -> int:
    # Stable across processes (unlike hash()), so several routers agree on the owner.
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def _hash_ids(ids: Sequence[int]) -> int:
    return _hash_bytes(b"".join(i.to_bytes(4, "little", signed=False) for i in ids))


PREFILL_POLICIES: dict[str, Callable[[], Policy]] = {
    "round_robin": RoundRobin,
    "least_load": LeastLoad,
    "prefix_aware": PrefixAware,
}
DECODE_POLICIES: dict[str, Callable[[], Policy]] = {"round_robin": RoundRobin, "least_load": LeastLoad}


def make_policy(role: str, name: str) -> Policy:
    table = PREFILL_POLICIES if role == "prefill" else DECODE_POLICIES
    if name not in table:
        raise ValueError(f"unknown {role} policy {name!r} (choose from {', '.join(table)})")
    return table[name]()


def select_pair(
    registry: NodeRegistry,
    prefill_policy: Policy,
    decode_policy: Policy,
    job: GenerationJob,
    exclude: Collection[str] = (),
) -> tuple[NodeState, NodeState] | None:
    """A decode (among those with at least one compatible prefill), then a compatible prefill."""
    prefills = [n for n in registry.nodes("prefill") if n.usable() and n.address not in exclude]
    decodes = [
        n
        for n in registry.nodes("decode")
        if n.usable() and n.address not in exclude and any(compatible(p, n) for p in prefills)
    ]
    if not decodes:
        return None
    decode = decode_policy.choose(decodes, job)
    prefill = prefill_policy.choose([p for p in prefills if compatible(p, decode)], job)
    return prefill, decode


def pair_available(registry: NodeRegistry, local: bool = False) -> bool:
    """Could a job be placed now (a compatible PD pair, a colocated node, or with `local` a decode
    that runs prompts itself)? Moves no policy state."""
    prefills = [n for n in registry.nodes("prefill") if n.usable()]
    decodes = [d for d in registry.nodes("decode") if d.usable()]
    return (
        any(any(compatible(p, d) for p in prefills) for d in decodes)
        or any(n.usable() for n in registry.nodes("colocated"))
        or (local and any(d.local_prefill for d in decodes))
    )


def select_colocated(
    registry: NodeRegistry, policy: Policy, job: GenerationJob, exclude: Collection[str] = ()
) -> NodeState | None:
    nodes = [n for n in registry.nodes("colocated") if n.usable() and n.address not in exclude]
    return policy.choose(nodes, job) if nodes else None
