"""prefix_aware on scripted cache states: the node holding a request's prefix wins unless much
busier, no hit anywhere falls back to least-load (short prompts) or the consistent-hash owner (a
shared cold prefix), and the decode side routes a follow-up turn to the node holding its history."""

from __future__ import annotations

from router.nodes import NodeSpec, NodeState
from router.policy import PrefixAware, make_policy
from tests.router.fake_nodes import job

PROMPT = tuple(range(1000, 1200))  # 200 tokens: long enough to be hashed to an owner when cold


class Scripted:
    """Expected hits by node address."""

    def __init__(self, hits: dict[str, int] | None = None) -> None:
        self.hits = hits or {}

    def expected_hit(self, node: NodeState, job) -> int:
        return self.hits.get(node.address, 0)


def nodes(role: str = "prefill", n: int = 4) -> list[NodeState]:
    return [NodeState(NodeSpec(role, f"n{i}:1", 1 if role == "prefill" else None), healthy=True) for i in range(n)]


def test_the_holder_wins_until_its_load_outweighs_the_hit():
    ns = nodes()
    pa = PrefixAware(Scripted({"n2:1": 1024}), tokens_per_request=256)
    assert pa.choose(ns, job(ids=PROMPT)).address == "n2:1"
    ns[2].running = 3  # 1024 - 3 x 256 > 0: still worth it
    assert pa.choose(ns, job(ids=PROMPT)).address == "n2:1"
    ns[2].inflight = 2  # 1024 - 5 x 256 < 0: an idle node computes it sooner
    assert pa.choose(ns, job(ids=PROMPT)).address != "n2:1"


def test_the_bigger_hit_wins_and_ties_are_stable():
    ns = nodes()
    pa = PrefixAware(Scripted({"n0:1": 256, "n3:1": 768}))
    assert pa.choose(ns, job(ids=PROMPT)).address == "n3:1"
    ns[3].running = 2  # 768 - 512 = 256 = n0's: the larger hit wins the tie
    assert pa.choose(ns, job(ids=PROMPT)).address == "n3:1"
    both = PrefixAware(Scripted({"n0:1": 512, "n1:1": 512}))
    assert len({both.choose(ns, job(ids=PROMPT)).address for _ in range(10)}) == 1


def test_no_hit_anywhere_is_least_load_for_short_prompts():
    ns = nodes()
    for i, n in enumerate(ns):
        n.running = 3 - i  # n3 is the lightest
    pa = PrefixAware(Scripted())
    assert pa.choose(ns, job(ids=PROMPT[:20])).address == "n3:1"


def test_a_shared_cold_prefix_lands_on_one_node():
    ns = nodes()
    pa = PrefixAware(Scripted())
    owners = {pa.choose(ns, job(ids=PROMPT[:128] + (i,) * 40)).address for i in range(20)}
    assert len(owners) == 1  # one system prompt, many different questions
    owner = next(n for n in ns if n.address in owners)
    owner.running = 10  # busier, but within the balance threshold: still its owner
    assert pa.choose(ns, job(ids=PROMPT)).address == owner.address
    owner.running = 40  # far busier than the lightest: least-load
    assert pa.choose(ns, job(ids=PROMPT)).address != owner.address
    others = {pa.choose(ns, job(ids=(i,) * 200)).address for i in range(40)}
    assert len(others) >= 3  # different prefixes spread over the nodes


def test_decode_nodes_route_a_follow_up_to_its_history():
    ds = nodes("decode", 3)
    history = {"n1:1": 192}  # the previous turn ran there: its prompt and reply are cached
    policy = make_policy("decode", "prefix_aware", Scripted(history))
    ds[0].running = ds[2].running = 0
    ds[1].running = 2  # a decode's penalty is 64 tokens a request: 192 - 128 > 0
    assert policy.choose(ds, job(ids=PROMPT)).address == "n1:1"
    ds[1].running = 4
    assert policy.choose(ds, job(ids=PROMPT)).address != "n1:1"
    assert make_policy("prefill", "prefix_aware").choose(nodes(), job(ids=PROMPT[:8])).address  # no index: hashing only
