"""The prefix cache against hand-computed cases (block size 16 unless said otherwise)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_sim.config import make_config
from vllm_sim.prefix_cache import BlockTable, PrefixCache, hash_blocks, hash_seed
from vllm_sim.scheduler import Scheduler, new_sequence

BS = 16
SEED = hash_seed("m", None)


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def hashes(tokens: list[int], seed: bytes = SEED) -> list[bytes]:
    return hash_blocks(tokens, block_size=BS, seed=seed)


def compute(cache: PrefixCache, tokens: list[int], seed: bytes = SEED) -> BlockTable:
    """Admit ``tokens`` like the scheduler does, compute them all, keep them pinned."""
    table = BlockTable()
    hs = hashes(tokens, seed)
    hits = cache.lookup(hs, len(tokens))
    assert cache.allocate(table, len(tokens), hits)
    cache.register(table, hs, len(tokens))
    return table


def hit_tokens(cache: PrefixCache, tokens: list[int], seed: bytes = SEED) -> int:
    return len(cache.lookup(hashes(tokens, seed), len(tokens))) * BS


def test_only_full_blocks_are_hashed_and_chained() -> None:
    assert len(hashes(toks(47))) == 2
    assert len(hashes(toks(48))) == 3
    # Same second block after a different first block -> different hash (chained).
    a = hashes(toks(32))
    b = hashes([999] + toks(31, 1))
    assert a[1] != b[1]
    # Extending a chain equals hashing the whole sequence.
    tail = hash_blocks(toks(48), block_size=BS, seed=SEED, start_block=2, parent=a[1])
    assert tail == hashes(toks(48))[2:]


@pytest.mark.parametrize(
    ("cached_len", "query_len", "expected"),
    [
        (40, 40, 32),  # 2 full blocks cached, 8 tokens computed
        (40, 100, 32),  # longer query: only what is cached
        (32, 32, 16),  # identical 32 tokens: cap (32-1)//16 = 1 block
        (32, 33, 32),  # one more token: both blocks usable
        (17, 17, 16),  # cap (17-1)//16 = 1
        (16, 16, 0),  # cap (16-1)//16 = 0: at least one token is computed
        (15, 40, 0),  # nothing full was cached
    ],
)
def test_hit_length_and_n_minus_one_cap(cached_len: int, query_len: int, expected: int) -> None:
    cache = PrefixCache(num_blocks=64, block_size=BS)
    cache.release(compute(cache, toks(cached_len)))
    assert hit_tokens(cache, toks(query_len)) == expected


def test_hit_stops_at_first_divergent_block() -> None:
    cache = PrefixCache(num_blocks=64, block_size=BS)
    cache.release(compute(cache, toks(64)))
    diverged = toks(64)
    diverged[20] = -1 % 2**32  # inside block 1
    assert hit_tokens(cache, diverged) == 16
    diverged[3] = 7777  # inside block 0
    assert hit_tokens(cache, diverged) == 0


def test_salt_and_model_isolate_caches() -> None:
    cache = PrefixCache(num_blocks=64, block_size=BS)
    salted = hash_seed("m", "tenant-a")
    cache.release(compute(cache, toks(64), seed=salted))
    assert hit_tokens(cache, toks(64), seed=salted) == 48
    assert hit_tokens(cache, toks(64), seed=hash_seed("m", "tenant-b")) == 0
    assert hit_tokens(cache, toks(64), seed=SEED) == 0  # no salt
    assert hit_tokens(cache, toks(64), seed=hash_seed("lora-x", "tenant-a")) == 0


def test_release_order_evicts_tail_blocks_first() -> None:
    cache = PrefixCache(num_blocks=4, block_size=BS)
    a = compute(cache, toks(32))
    b = compute(cache, toks(32, 1000))
    a0, a1 = a.blocks
    b0, b1 = b.blocks
    cache.release(a)
    cache.release(b)
    assert cache.free_order() == [a1, a0, b1, b0]
    # The pool is full of cached-free blocks; a new 16-token block evicts A's tail block.
    c = BlockTable()
    assert cache.allocate(c, 16)
    assert c.blocks == [a1]
    assert hit_tokens(cache, toks(33)) == 16  # A keeps its head block
    assert hit_tokens(cache, toks(33, 1000)) == 32  # B untouched
    assert cache.num_cached_blocks == 3


def test_free_blocks_keep_hash_until_reused_and_hits_are_repinned() -> None:
    cache = PrefixCache(num_blocks=8, block_size=BS)
    first = compute(cache, toks(33))
    head0, head1, tail = first.blocks
    cache.release(first)
    assert cache.free_order() == [tail, head1, head0]
    assert cache.usage == 0.0  # cached but unpinned blocks are not "used"
    assert cache.num_cached_blocks == 2
    again = compute(cache, toks(33))
    assert again.blocks[:2] == [head0, head1]  # hits are taken off the free list...
    assert again.blocks[2] not in (head0, head1, tail)  # ...and never-used blocks go first
    assert cache.usage == pytest.approx(3 / 8)
    assert cache.free_order() == [tail]
    new_tail = again.blocks[2]
    cache.release(again)
    assert cache.free_order() == [tail, new_tail, head1, head0]  # re-queued at the LRU tail


def test_running_blocks_are_pinned_and_allocation_is_all_or_nothing() -> None:
    cache = PrefixCache(num_blocks=4, block_size=BS)
    running = compute(cache, toks(32))  # pinned: 2 blocks
    done = compute(cache, toks(32, 500))
    done_blocks = set(done.blocks)
    cache.release(done)
    table = BlockTable()
    assert not cache.allocate(table, 48)  # needs 3, only 2 evictable
    assert table.blocks == [] and cache.num_free == 2
    assert hit_tokens(cache, toks(33, 500)) == 32  # the failed attempt evicted nothing
    assert cache.allocate(table, 32)
    assert set(table.blocks) == done_blocks
    assert not set(table.blocks) & set(running.blocks)
    assert hit_tokens(cache, toks(33)) == 32  # the running sequence's blocks survived
    assert cache.usage == 1.0


def test_shared_blocks_are_freed_only_by_their_last_holder() -> None:
    cache = PrefixCache(num_blocks=8, block_size=BS)
    one = compute(cache, toks(40))
    two = compute(cache, toks(40))
    assert one.blocks[:2] == two.blocks[:2] and one.blocks[2] != two.blocks[2]
    one_tail = one.blocks[2]
    cache.release(one)
    assert cache.free_order() == [one_tail]  # the shared blocks stay pinned by ``two``
    assert cache.num_free == 8 - 3
    cache.release(two)
    assert cache.num_free == 8


def test_disabled_caching_never_hits() -> None:
    cache = PrefixCache(num_blocks=16, block_size=BS, enable_caching=False)
    cache.release(compute(cache, toks(64)))
    assert hit_tokens(cache, toks(64)) == 0


def test_reset_forgets_free_blocks_only() -> None:
    cache = PrefixCache(num_blocks=16, block_size=BS)
    pinned = compute(cache, toks(33))
    cache.release(compute(cache, toks(33, 100)))
    assert cache.reset() == 2
    assert hit_tokens(cache, toks(33, 100)) == 0
    assert hit_tokens(cache, toks(33)) == 32
    cache.release(pinned)


def _run_to_completion(scheduler: Scheduler, now: float = 0.0) -> None:
    while scheduler.has_work:
        plan = scheduler.schedule(now)
        now += 0.01
        scheduler.complete(plan, now)


def test_blocks_filled_during_decode_are_cached_for_follow_ups() -> None:
    config = make_config(block_size=BS, num_gpu_blocks=64)
    scheduler = Scheduler(config)
    prompt, output = toks(20), toks(20, 5000)
    tokens = prompt + output
    seq = new_sequence(
        request_id="a",
        prompt=prompt,
        output=output,
        finish_reason="length",
        arrival_time=0.0,
        hashes=hashes(tokens),
    )
    scheduler.add(seq)
    _run_to_completion(scheduler)
    # 20 prompt + 19 fed-back outputs have KV (the last sampled token never does):
    # floor(39 / 16) = 2 full blocks, the second of which was filled while decoding.
    follow_up = tokens + toks(10, 9000)
    assert hit_tokens(scheduler.cache, follow_up) == 32
    assert hit_tokens(scheduler.cache, prompt + output[:11] + [1, 2, 3]) == 16


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 70)), min_size=1, max_size=30))
def test_pool_invariants_under_random_traffic(ops: list[tuple[int, int]]) -> None:
    """Free + pinned == pool size, hits respect the cap, and the index maps to its blocks."""
    cache = PrefixCache(num_blocks=12, block_size=BS)
    held: list[BlockTable] = []
    for prefix, length in ops:
        tokens = toks(length, prefix * 16)  # prefixes overlap by whole blocks
        hs = hashes(tokens)
        hits = cache.lookup(hs, length)
        assert len(hits) * BS <= max(0, (length - 1) // BS * BS)
        table = BlockTable()
        if cache.allocate(table, length, hits):
            cache.register(table, hs, length)
            held.append(table)
        elif held:
            cache.release(held.pop(0))
        pinned = len({b for t in held for b in t.blocks})
        assert cache.num_free == 12 - pinned
    for table in held:
        cache.release(table)
    assert cache.num_free == 12 and cache.usage == 0.0
