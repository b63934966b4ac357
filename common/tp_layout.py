"""How a model splits over tensor-parallel ranks: heads, KV heads, MLP columns and vocabulary rows."""

from __future__ import annotations

from dataclasses import dataclass


class TpLayoutError(ValueError):
    """A model that cannot be split over this many ranks; the message names the dimension."""


@dataclass(frozen=True, slots=True)
class TpLayout:
    """One rank's share of a Llama-family model at tensor-parallel size `size`.

    Query heads split evenly. Each rank keeps the KV heads its query heads read: a contiguous range
    that is its share when the KV heads divide evenly, and overlaps its neighbours' (the KV heads are
    replicated) when there are fewer KV heads than ranks or the groups straddle ranks. The MLP's
    intermediate columns split evenly; vocabulary rows split into equal blocks of ceil(V / size), the
    last padded, so every rank's logits block has one shape (an all-gather needs that)."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise TpLayoutError(f"rank {self.rank} is outside a tensor-parallel group of {self.size}")
        for name, n in (("attention heads", self.num_heads), ("intermediate size", self.intermediate_size)):
            if n % self.size:
                raise TpLayoutError(f"{name} {n} do not divide over --tp-size {self.size}")
        if self.num_heads % self.num_kv_heads:
            raise TpLayoutError(f"{self.num_heads} heads do not group over {self.num_kv_heads} KV heads")
        for r in range(self.size):  # attention groups a rank's heads evenly over its KV heads
            if not self.at(r, checked=False).groups_evenly():
                raise TpLayoutError(
                    f"{self.num_heads} heads over {self.num_kv_heads} KV heads do not split over --tp-size "
                    f"{self.size}: rank {r}'s heads would share KV heads unevenly"
                )

    @staticmethod
    def single(num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int) -> "TpLayout":
        return TpLayout(0, 1, num_heads, num_kv_heads, intermediate_size, vocab_size)

    def at(self, rank: int, checked: bool = True) -> "TpLayout":
        """The same split seen from another rank."""
        layout = object.__new__(TpLayout)
        for name, value in zip(
            ("rank", "size", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size"),
            (rank, self.size, self.num_heads, self.num_kv_heads, self.intermediate_size, self.vocab_size),
        ):
            object.__setattr__(layout, name, value)
        if checked and not 0 <= rank < self.size:
            raise TpLayoutError(f"rank {rank} is outside a tensor-parallel group of {self.size}")
        return layout

    def groups_evenly(self) -> bool:
        """Local head j reads local KV head j // (local heads / local KV heads), as the attention
        backends assume, for every head of this rank."""
        heads, kv = self.heads, self.kv_heads
        if len(heads) % len(kv):
            return False
        per_kv, group = len(heads) // len(kv), self.num_heads // self.num_kv_heads
        return all(h // group - kv.start == j // per_kv for j, h in enumerate(heads))

    @property
    def heads(self) -> range:
        n = self.num_heads // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def kv_heads(self) -> range:
        group = self.num_heads // self.num_kv_heads
        return range(self.heads.start // group, (self.heads.stop - 1) // group + 1)

    @property
    def intermediate(self) -> range:
        n = self.intermediate_size // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def vocab_block(self) -> int:
        return -(-self.vocab_size // self.size)

    @property
    def vocab(self) -> range:
        """The vocabulary rows this rank holds (the last rank's block may run short: padding)."""
        start = self.rank * self.vocab_block
        return range(min(start, self.vocab_size), min(start + self.vocab_block, self.vocab_size))

    def kv_head_owner(self, head: int) -> int:
        """The lowest rank holding KV head `head` (the one a transfer reads it from)."""
        return next(r for r in range(self.size) if head in self.at(r).kv_heads)

    def describe(self) -> dict[str, int]:
        """What the compatibility fingerprint and node info carry."""
        return {"tp_size": self.size, "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads}
