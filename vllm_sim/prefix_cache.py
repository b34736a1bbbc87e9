"""KV block pool with automatic prefix caching, modelled on vLLM's v1 KV cache manager.

Pure and synchronous: no clock, no I/O, so every rule below is unit-testable by hand.

Hashing. A sequence's tokens are cut into blocks of ``block_size``; only full blocks are
hashed. ``hash(block i) = H(hash(block i-1) || token ids of block i)`` and block 0's parent
is a *seed* derived from the served model name (LoRA adapters are model names) and the
request's ``cache_salt``, so different salts or adapters never share a block.

Lookup. A hit is the longest leading run of blocks whose hashes are cached, capped so that at
least one token is computed: at most ``(n_tokens - 1) // block_size`` blocks.

Pinning and eviction. Blocks held by running sequences are pinned (``ref > 0``). A released
block goes to the tail of an LRU free list; a sequence releases its blocks in reverse order,
so its tail blocks are evicted before its head. Free blocks keep their hash (and stay
hittable) until they are handed out again. Never-used blocks are handed out first, as
vLLM's free queue starts with every block in order. Blocks filled while decoding are
registered too, so a follow-up that resends prompt + answer hits them.

Complexity: lookup O(hit blocks); allocate/release O(blocks touched); O(1) per eviction.
Invariant: ``num_free == blocks with ref 0`` and every hash in the index names a block that
carries exactly that hash.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

BlockHash = bytes
_DIGEST = 16


def hash_seed(model: str, cache_salt: str | None) -> BlockHash:
    """Parent hash of block 0: the extra keys vLLM mixes into a sequence's first block."""
    material = f"{model}\x00{'' if cache_salt is None else 's:' + cache_salt}".encode()
    return hashlib.blake2b(material, digest_size=_DIGEST).digest()


def hash_blocks(
    tokens: Sequence[int],
    *,
    block_size: int,
    seed: BlockHash,
    start_block: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``tokens`` from ``start_block`` on.

    Pass the hash of block ``start_block - 1`` as ``parent`` to extend an existing chain.
    """
    n_blocks = len(tokens) // block_size
    if start_block >= n_blocks:
        return []
    raw = array("Q", tokens[start_block * block_size : n_blocks * block_size]).tobytes()
    step = 8 * block_size
    prev = seed if start_block == 0 or parent is None else parent
    hashes: list[BlockHash] = []
    blake = hashlib.blake2b
    for offset in range(0, len(raw), step):
        prev = blake(prev + raw[offset : offset + step], digest_size=_DIGEST).digest()
        hashes.append(prev)
    return hashes


@dataclass(slots=True)
class BlockTable:
    """Blocks held by one sequence, in token order; ``num_registered`` lead blocks are hashed."""

    blocks: list[int] = field(default_factory=list)
    num_registered: int = 0


class PrefixCache:
    """Block pool + hash index + LRU free list of one instance (see module docstring)."""

    def __init__(self, *, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ref = array("q", [0]) * num_blocks
        self._hash_of: dict[int, BlockHash] = {}
        self._index: dict[BlockHash, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._next_fresh = 0

    # -- queries --------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks not pinned by any sequence (cached-but-free blocks included)."""
        return len(self._lru) + self.num_blocks - self._next_fresh

    @property
    def usage(self) -> float:
        """Fraction of blocks pinned by sequences: vLLM's ``kv_cache_usage_perc``."""
        return 1.0 - self.num_free / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that carry a hash and can be hit (pinned or free)."""
        return len(self._index)

    def lookup(self, hashes: Sequence[BlockHash], num_tokens: int) -> list[int]:
        """Block ids of the longest cached leading run, at most ``(num_tokens-1)//bs`` blocks."""
        if not self.enable_caching:
            return []
        limit = min(len(hashes), max(0, (num_tokens - 1) // self.block_size))
        hits: list[int] = []
        index = self._index
        for i in range(limit):
            block = index.get(hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits

    def free_order(self) -> list[int]:
        """Evictable blocks that carry state, next victim first (for tests and debugging)."""
        return list(self._lru)

    # -- mutations ------------------------------------------------------------------------

    def allocate(self, table: BlockTable, num_tokens: int, hits: Sequence[int] = ()) -> bool:
        """Grow ``table`` to cover ``num_tokens``, first taking the ``hits`` from :meth:`lookup`.

        All or nothing: returns False and changes nothing when the free blocks do not suffice
        (the scheduler then preempts or waits). Hits are only taken by an empty table.
        """
        if hits and table.blocks:
            raise ValueError("cache hits can only start an empty block table")
        needed = -(-num_tokens // self.block_size) - len(table.blocks) - len(hits)
        ref = self._ref
        free_hits = sum(1 for b in hits if ref[b] == 0)
        if max(needed, 0) + free_hits > self.num_free:
            return False
        for block in hits:
            if ref[block] == 0:
                del self._lru[block]
            ref[block] += 1
        if hits:
            table.blocks.extend(hits)
            table.num_registered = len(hits)
        for _ in range(needed):
            table.blocks.append(self._take_free_block())
        return True

    def register(self, table: BlockTable, hashes: Sequence[BlockHash], num_computed: int) -> None:
        """Index the full blocks among the first ``num_computed`` tokens of ``table``."""
        full = min(num_computed // self.block_size, len(hashes), len(table.blocks))
        if not self.enable_caching:
            table.num_registered = max(table.num_registered, full)
            return
        index, hash_of = self._index, self._hash_of
        for i in range(table.num_registered, full):
            block_hash = hashes[i]
            if block_hash not in index:  # a duplicate computed concurrently stays unindexed
                block = table.blocks[i]
                index[block_hash] = block
                hash_of[block] = block_hash
        table.num_registered = max(table.num_registered, full)

    def release(self, table: BlockTable) -> None:
        """Unpin ``table``'s blocks; tail blocks join the LRU free list first."""
        ref, lru = self._ref, self._lru
        for block in reversed(table.blocks):
            ref[block] -= 1
            if ref[block] == 0:
                lru[block] = None
        table.blocks.clear()
        table.num_registered = 0

    def reset(self) -> int:
        """Forget the hashes of all free blocks (vLLM's reset_prefix_cache); returns how many."""
        dropped = 0
        for block in self._lru:
            block_hash = self._hash_of.pop(block, None)
            if block_hash is not None:
                del self._index[block_hash]
                dropped += 1
        return dropped

    def _take_free_block(self) -> int:
        if self._next_fresh < self.num_blocks:
            block = self._next_fresh
            self._next_fresh += 1
        else:
            block, _ = self._lru.popitem(last=False)
            block_hash = self._hash_of.pop(block, None)
            if block_hash is not None:
                del self._index[block_hash]
        self._ref[block] = 1
        return block
