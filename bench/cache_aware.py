"""A comparator for the simulation: the cache-aware policy of SGLang's model gateway.

sgl-router (SGLang model gateway) routes with ``cache_aware`` by default. Its approach,
as its documentation describes it, re-stated here (no code of it is used):

* It keeps an approximate radix tree of the request texts it has sent to each worker
  (one tree, each node tagged with the workers it was sent to and when), and each
  worker's in-flight requests (sent and not yet finished).
* The fleet is *imbalanced* when ``max - min > balance_abs_threshold`` **and**
  ``max > balance_rel_threshold x min`` over the workers' in-flight counts. Then the least
  loaded worker takes the request.
* Otherwise the worker holding the longest prefix of the text takes it if that prefix is
  more than ``cache_threshold`` of the text; if not, the worker whose tree is smallest
  (it has seen the least text: the emptiest cache).
* Either way the text is inserted in the chosen worker's tree. Every
  ``eviction_interval_s`` the least recently used leaves of a worker whose tree holds more
  than ``max_tree_size`` characters are evicted until it fits.

:data:`DEFAULTS` are its documented defaults (``--cache-threshold 0.3
--balance-abs-threshold 64 --balance-rel-threshold 1.5 --eviction-interval 120
--max-tree-size 67108864``). Two simplifications, both in its favour or neutral: the tree
is kept in chunks of :data:`CHUNK_CHARS` characters (a match is counted in whole chunks,
so it may undercount by less than a chunk), and the worker chosen among several holding
the same longest prefix is the one that saw it most recently.

It lives in ``bench`` only: it is what the product is measured against, not part of it.
Cost: O(text / CHUNK_CHARS) dict look-ups per request; eviction walks the whole tree.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import orjson

CHUNK_CHARS = 16
"""Characters per tree edge (4 tokens of the simulator's tokenizer)."""


@dataclass(frozen=True, slots=True)
class CacheAwareSettings:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 120.0
    max_tree_size: int = 2**26
    """Characters of text a worker's tree may hold before eviction."""


DEFAULTS = CacheAwareSettings()


class _Node:
    __slots__ = ("children", "tenants", "parent", "edge", "depth")

    def __init__(self, parent: _Node | None, edge: str) -> None:
        self.children: dict[str, _Node] = {}
        self.tenants: dict[str, float] = {}
        """Worker -> last time a request through this node was sent to it."""
        self.parent = parent
        self.edge = edge
        self.depth: int = parent.depth + 1 if parent is not None else 0


def _chunks(text: str) -> Iterator[str]:
    return (text[i : i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS))


class ApproximateTree:
    """Request texts per worker, sharing one trie of fixed-size chunks.

    A worker on a node is on all its ancestors (texts are inserted whole from their start),
    and its time there is at most theirs, which eviction relies on."""

    def __init__(self) -> None:
        self.root = _Node(None, "")
        self.sizes: dict[str, int] = {}
        """Characters held per worker."""

    def match(self, text: str) -> tuple[int, str | None]:
        """``(characters matched, worker)`` of the longest prefix of ``text`` any worker
        holds; the worker that saw it last wins a tie (None: nobody holds any of it)."""
        node, matched = self.root, 0
        for chunk in _chunks(text):
            child = node.children.get(chunk)
            if child is None:
                break
            node, matched = child, matched + len(chunk)
        if not node.tenants:
            return 0, None
        return matched, max(node.tenants.items(), key=lambda kv: kv[1])[0]

    def insert(self, text: str, worker: str, now: float) -> None:
        node = self.root
        size = self.sizes.get(worker, 0)
        for chunk in _chunks(text):
            child = node.children.get(chunk)
            if child is None:
                child = node.children[chunk] = _Node(node, chunk)
            if worker not in child.tenants:
                size += len(chunk)
            child.tenants[worker] = now
            node = child
        self.sizes[worker] = size

    def smallest(self, workers: Sequence[str]) -> str:
        """The worker holding the least text (the first of equals)."""
        return min(workers, key=lambda w: self.sizes.get(w, 0))

    def evict(self, max_size: int) -> None:
        """Drop each worker's least recently used leaves until it holds ``max_size``."""
        over = {w for w, size in self.sizes.items() if size > max_size}
        if not over:
            return
        held: list[tuple[float, int, str, _Node]] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            held += [(t, -node.depth, w, node) for w, t in node.tenants.items() if w in over]
        held.sort(key=lambda h: h[:2])  # oldest first; deeper first among equals
        for _, _, worker, node in held:
            if self.sizes[worker] <= max_size:
                continue
            self.remove(node, worker)

    def remove(self, node: _Node, worker: str) -> None:
        del node.tenants[worker]
        self.sizes[worker] -= len(node.edge)
        while node.parent is not None and not node.tenants and not node.children:
            del node.parent.children[node.edge]
            node = node.parent

    def forget(self, worker: str) -> None:
        """A worker left the fleet: drop everything it held."""
        nodes, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if worker in node.tenants:
                nodes.append(node)
        for node in sorted(nodes, key=lambda n: -n.depth):
            self.remove(node, worker)
        self.sizes.pop(worker, None)


def imbalanced(loads: Sequence[int], settings: CacheAwareSettings) -> bool:
    """Both thresholds crossed by the busiest and the idlest worker."""
    low, high = min(loads), max(loads)
    return (
        high - low > settings.balance_abs_threshold and high > settings.balance_rel_threshold * low
    )


class CacheAwareRouter:
    """One router's state; :meth:`pick` routes a request and records it."""

    def __init__(self, settings: CacheAwareSettings = DEFAULTS) -> None:
        self.settings = settings
        self.tree = ApproximateTree()
        self._next_eviction = settings.eviction_interval_s

    def pick(self, text: str, loads: Mapping[str, int], now: float) -> str:
        """The worker (a key of ``loads``, its in-flight requests) that takes ``text``."""
        s = self.settings
        if now >= self._next_eviction:
            self.tree.evict(s.max_tree_size)
            self._next_eviction = now + s.eviction_interval_s
        workers = list(loads)
        if imbalanced(list(loads.values()), s):
            chosen = min(workers, key=lambda w: loads[w])
        else:
            matched, holder = self.tree.match(text)
            if holder is not None and holder in loads and matched > s.cache_threshold * len(text):
                chosen = holder
            else:
                chosen = self.tree.smallest(workers)
        self.tree.insert(text, chosen, now)
        return chosen


def routing_text(body: bytes) -> str:
    """The text the router matches: a completion's prompt, or the chat messages' contents
    joined by newlines (what the model reads, without the JSON around it)."""
    request = orjson.loads(body)
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in request.get("messages", ()))
