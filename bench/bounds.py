"""Offline bounds on the fleet's token hit rate, from the request sequence alone.

Two caches see every request of a run in arrival order, with vLLM's rules: 16-token
blocks named by chained hashes (the simulator's :func:`vllm_sim.hash_blocks`), a hit is
the longest leading run of cached blocks capped at ``(prompt - 1) // 16`` blocks, and a
request leaves behind the KV of its prompt and of all its generated tokens but the last.

``infinite``
    A cache that never evicts: only first sightings miss. No router can beat it.
``fleet_lru``
    One LRU cache as large as the whole fleet (the sum of every instance's KV blocks).
    A request touches its blocks tail first, so its head ends most recently used (vLLM
    frees a request's blocks in reverse order, so its tail is evicted first).
    A router that sent every request to "the" cache would get this; a fleet of separate
    caches gets it only if no prefix is cached twice and none is evicted early.

Both ignore timing (blocks of running requests, pinned blocks, concurrent misses on the
same prefix), so they bound what the fleet measures. Hit rate = hit tokens / prompt tokens,
as ``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total``.

Cost: O(blocks) per request; memory O(distinct blocks) for ``infinite``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from vllm_sim.prefix_cache import BlockHash, hash_blocks, hash_seed

BLOCK_SIZE = 16


class RequestHits(NamedTuple):
    """One request's hit tokens in each of the two caches."""

    infinite: int
    fleet_lru: int


@dataclass(frozen=True, slots=True)
class CacheBounds:
    infinite: float
    fleet_lru: float
    queried_tokens: int
    capacity_blocks: int


class BoundsTracker:
    """Feed requests in arrival order with :meth:`add`; read :meth:`result`."""

    def __init__(self, *, capacity_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity = capacity_blocks
        self.block_size = block_size
        self._seen: set[BlockHash] = set()
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()
        self.queries = 0
        self.infinite_hits = 0
        self.lru_hits = 0

    def add(
        self, hashes: Sequence[BlockHash], *, prompt_tokens: int, total_tokens: int
    ) -> RequestHits:
        """One request: ``hashes`` of the full blocks of prompt + output, in order; its hit
        tokens in each cache.

        ``total_tokens`` is prompt + output; the blocks left cached are the full blocks
        among its first ``total_tokens - 1`` tokens.
        """
        bs = self.block_size
        limit = min(len(hashes), max(0, (prompt_tokens - 1) // bs))
        kept = min(len(hashes), max(0, total_tokens - 1) // bs)
        self.queries += prompt_tokens
        seen, lru = self._seen, self._lru
        infinite = 0
        while infinite < limit and hashes[infinite] in seen:
            infinite += 1
        self.infinite_hits += infinite * bs
        hit = 0
        while hit < limit and hashes[hit] in lru:
            hit += 1
        self.lru_hits += hit * bs
        for i in range(kept - 1, -1, -1):
            h = hashes[i]
            seen.add(h)
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)
        return RequestHits(infinite * bs, hit * bs)

    def add_tokens(
        self, prompt: Sequence[int], output: Sequence[int], *, model: str
    ) -> RequestHits:
        """One request given as token ids (hashed as the simulator hashes them)."""
        tokens = [*prompt, *output]
        hashes = hash_blocks(tokens, block_size=self.block_size, seed=hash_seed(model, None))
        return self.add(hashes, prompt_tokens=len(prompt), total_tokens=len(tokens))

    def result(self) -> CacheBounds:
        q = max(1, self.queries)
        return CacheBounds(
            infinite=self.infinite_hits / q,
            fleet_lru=self.lru_hits / q,
            queried_tokens=self.queries,
            capacity_blocks=self.capacity,
        )
