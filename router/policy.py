"""Node selection: prefill and decode policies (round_robin, least_load, prefix_aware), and pair
selection (a decode first, then a compatible prefill). Colocated nodes use the decode policy.

Policies see only usable candidates (healthy, breaker closed or probing, not excluded) and
always return one of them; an empty candidate list is the caller's "no pair" case.

prefix_aware against least_load: least_load spreads requests evenly, so every node computes every
shared prefix (a system prompt, a conversation's history) again, once per node and again after
each eviction. prefix_aware sends a request where the nodes' published caches (router/kv_index.py)
hold most of its prompt, and gives up that hit only when the holder is busier by more than the
hit is worth: score = expected hit tokens - tokens_per_request x outstanding requests (running +
waiting as the node reported them, plus ours sent since). Defaults: 256 tokens per request for
prefill nodes (a queued request is a prompt ahead of ours: a 2k-token hit outweighs 8 more
requests than an idle node has), 64 for decode and colocated nodes (one more running request
slows a decode step by little, and a hit there also saves moving the history's KV).
It trades balance for compute: under a skewed mix (one hot prefix) the holder runs hotter than
its peers until the penalty moves traffic away, so tail latency can be worse than least_load's;
with little reuse it behaves as least_load. Cold prefixes (no node holds any of the request) of
at least `prefix_tokens` tokens go to the consistent-hash owner of their first `prefix_tokens`
tokens unless it is `balance_threshold` requests busier than the lightest, so a burst sharing a
new system prompt lands on one node before any cache reports it; shorter ones go to least_load.
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


class HitEstimator(Protocol):
    def expected_hit(self, node: NodeState, job: GenerationJob) -> int:
        """Prompt tokens of `job` that `node`'s prefix cache is believed to hold."""
        ...


class PrefixAware:
    """The node with the best expected hit less its load penalty (module docstring); with no hit
    anywhere (or no `index`), consistent hashing over the candidates on the first `prefix_tokens`
    tokens, so adding or losing a node moves only its share of prefixes. Short prompts, and a
    sticky node `balance_threshold` requests busier than the lightest, go to least-load."""

    name = "prefix_aware"

    def __init__(
        self,
        index: HitEstimator | None = None,
        prefix_tokens: int = 128,
        balance_threshold: int = 32,
        tokens_per_request: int = 256,
        replicas: int = 64,
    ) -> None:
        self.index, self.tokens_per_request = index, tokens_per_request
        self.prefix_tokens, self.balance_threshold, self.replicas = prefix_tokens, balance_threshold, replicas
        self.fallback = LeastLoad()
        self._ring_key: tuple[str, ...] = ()
        self._ring: list[tuple[int, str]] = []

    def choose(self, nodes: Sequence[NodeState], job: GenerationJob) -> NodeState:
        if self.index is not None:
            hits = [self.index.expected_hit(n, job) for n in nodes]
            if any(hits):
                owner = self._sticky(nodes, job)
                w = self.tokens_per_request

                def score(i: int) -> tuple[int, int, int, bool]:
                    # ties: the larger hit (less compute overall), then the lighter node, then the owner
                    n = nodes[i]
                    return hits[i] - w * n.load, hits[i], -n.load, n.address == owner

                return nodes[max(range(len(nodes)), key=score)]
        if len(job.input_ids) < self.prefix_tokens:
            return self.fallback.choose(nodes, job)
        address = self._sticky(nodes, job)
        sticky = next(n for n in nodes if n.address == address)
        if sticky.load - min(n.load for n in nodes) > self.balance_threshold:
            return self.fallback.choose(nodes, job)
        return sticky

    def _sticky(self, nodes: Sequence[NodeState], job: GenerationJob) -> str:
        """The consistent-hash owner of the job's first `prefix_tokens` tokens among `nodes`."""
        return self._owner(tuple(sorted(n.address for n in nodes)), _hash_ids(job.input_ids[: self.prefix_tokens]))

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
DECODE_POLICIES: dict[str, Callable[[], Policy]] = dict(PREFILL_POLICIES)  # a follow-up turn to its history


def make_policy(role: str, name: str, index: HitEstimator | None = None) -> Policy:
    """A policy by name; prefix_aware reads `index` (without one it only hashes prefixes)."""
    table = PREFILL_POLICIES if role == "prefill" else DECODE_POLICIES
    if name not in table:
        raise ValueError(f"unknown {role} policy {name!r} (choose from {', '.join(table)})")
    if name == "prefix_aware":
        return PrefixAware(index, tokens_per_request=256 if role == "prefill" else 64)
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


def pair_available(registry: NodeRegistry, local: bool = False, whole: bool = False) -> bool:
    """Could a job be placed now (a compatible PD pair, a colocated node, with `local` a decode
    that runs prompts itself, with `whole` a prefill that decodes)? Moves no policy state."""
    prefills = [n for n in registry.nodes("prefill") if n.usable()]
    decodes = [d for d in registry.nodes("decode") if d.usable()]
    return (
        any(any(compatible(p, d) for p in prefills) for d in decodes)
        or any(n.usable() for n in registry.nodes("colocated"))
        or (local and any(d.local_prefill for d in decodes))
        or (whole and any(p.local_decode for p in prefills))
    )


def select_colocated(
    registry: NodeRegistry, policy: Policy, job: GenerationJob, exclude: Collection[str] = ()
) -> NodeState | None:
    nodes = [n for n in registry.nodes("colocated") if n.usable() and n.address not in exclude]
    return policy.choose(nodes, job) if nodes else None
