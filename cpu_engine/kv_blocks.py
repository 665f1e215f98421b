"""Paged KV cache bookkeeping: which fixed-size block of KV memory holds what, and who is using it.

Pure bookkeeping with no tensors in it (the runner owns the memory, the scheduler owns the block tables),
so tests drive it directly. A sequence's KV cache is a table of blocks of `block_size` tokens each. Blocks
are shared between sequences by reference count, and a full block is remembered under a BlockKey naming
its contents (its tokens and, through the key of the block before it, every token before them), the way
vLLM's automatic prefix caching does it: a new prompt that starts like an earlier one finds that prompt's
blocks with `match_prefix` and skips reading those tokens again. A block nobody uses keeps its contents
(and its key) until its memory is needed for something else, so a system prompt shared by many requests
stays cached between them as long as the cache is not full.

Only full blocks are ever shared: a block still being written is private to its sequence, so nothing
here ever needs copy-on-write.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from hashlib import blake2b

__all__ = ["BlockKey", "BlockPool", "NoFreeBlocks", "block_key", "block_keys"]

BlockKey = bytes  # a 16-byte digest naming a full block's contents and everything before them (block_key)


class NoFreeBlocks(RuntimeError):
    """allocate() asked for more blocks than are free."""


def block_key(parent: BlockKey | None, tokens: Sequence[int]) -> BlockKey:
    """The key of a full block holding `tokens` after the block keyed `parent` (None: a first block):
    blake2b(parent || token ids as int64, 128 bits), vLLM's digest chain. Chaining on the parent makes a
    key stand for the whole prefix up to the end of its block, since K/V at a position depend on every
    token before it; keys are hashed and compared in O(1) however long the chain. Two different contents
    share a block only if their 128-bit digests collide, which nothing running here will ever see."""
    return blake2b((parent or b"") + array("q", tokens).tobytes(), digest_size=16).digest()


def block_keys(tokens: Sequence[int], block_size: int, parent: BlockKey | None = None) -> list[BlockKey]:
    """Keys of every FULL block of `tokens` (len(tokens) // block_size keys), chained from `parent`.

    The partial block at the end has no key: it is still being written, and only full blocks are shared.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, not {block_size}")
    if not isinstance(tokens, (list, tuple)):  # a tensor or array: plain ints for the digest
        tokens = [int(token) for token in tokens]
    keys: list[BlockKey] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_key(parent, tokens[start:start + block_size])
        keys.append(parent)
    return keys


class BlockPool:
    """Fixed-size blocks of KV-cache memory: ids 0..num_blocks-1.

    Each block has a reference count (the number of running sequences whose block table holds it). A block
    with refcount 0 is 'free'; a free block may still be 'cached' (registered under a BlockKey) and then can
    be handed back by match_prefix until it is evicted. Free blocks are kept in one eviction order:
    allocate() takes free blocks that hold no cached content first, then cached ones least-recently-released
    first (evicting them: their key is forgotten). The order is two OrderedDicts (uncached, then cached),
    so allocating, matching and releasing cost O(1) per block.

    With `enable_reuse` off nothing is ever cached: match_prefix finds nothing and register does nothing,
    and the pool is a plain free list (what a model whose K/V cannot be shared needs, or a user who asks
    for it).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_reuse: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, not {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, not {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_reuse = enable_reuse
        self._refcounts: list[int] = [0] * num_blocks
        self._keys: list[BlockKey | None] = [None] * num_blocks  # the key each block holds
        self._cached: dict[BlockKey, int] = {}  # key -> the block holding it (used or free)
        # Free blocks, in the order allocate() takes them: every uncached one, then the cached ones
        # least recently released first.
        self._free_uncached: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        """Blocks with refcount 0, including cached ones (allocate may evict them)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks currently registered under a key, used or free."""
        return len(self._cached)

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return self._refcounts[block]

    def allocate(self, count: int) -> list[int]:
        """`count` blocks, each with refcount 1 and no key.

        Raises NoFreeBlocks (and changes nothing) if count > num_free: the caller waits or preempts, and a
        half-done allocation would only have to be undone. Cached free blocks are evicted only when no
        uncached free block is left, least recently released first, so the prefixes most likely to be asked
        for again (those used last) stay longest.
        """
        if count < 0:
            raise ValueError(f"cannot allocate {count} blocks")
        if count > self.num_free:
            raise NoFreeBlocks(f"{count} blocks asked for, {self.num_free} free of {self.num_blocks}")
        blocks: list[int] = []
        uncached, cached, refcounts = self._free_uncached, self._free_cached, self._refcounts
        for _ in range(count):
            if uncached:
                block = uncached.popitem(last=False)[0]
            else:
                block = cached.popitem(last=False)[0]
                key = self._keys[block]
                assert key is not None
                del self._cached[key]
                self._keys[block] = None
            refcounts[block] = 1
            blocks.append(block)
        return blocks

    def match_prefix(self, keys: Sequence[BlockKey]) -> list[int]:
        """The blocks cached under the longest leading run of `keys` (stops at the first key not cached).

        Each returned block gets one more reference (a free one leaves the eviction order), so the caller
        owns them like allocated ones and gives them back with release. [] when reuse is off.
        """
        if not self.enable_reuse:
            return []
        cached, refcounts, free_cached = self._cached, self._refcounts, self._free_cached
        blocks: list[int] = []
        for key in keys:
            block = cached.get(key)
            if block is None:
                break
            if refcounts[block] == 0:
                del free_cached[block]
            refcounts[block] += 1
            blocks.append(block)
        return blocks

    def register(self, block: int, key: BlockKey) -> None:
        """Record that `block` (refcount >= 1, full, no key yet) now holds `key`'s contents, so later
        prompts can share it.

        If a block already holds `key` (two prompts with the same prefix read it at the same time), nothing
        changes: the first copy stays the shared one and this block stays private, freed uncached at the
        end. No-op when reuse is off.
        """
        self._check_id(block)
        if self._refcounts[block] < 1:
            raise ValueError(f"block {block} is free: only a block in use can be registered")
        if not self.enable_reuse or key in self._cached:
            return
        if self._keys[block] is not None:
            raise ValueError(f"block {block} already holds other contents ({self._keys[block]!r})")
        self._keys[block] = key
        self._cached[key] = block

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 become free.

        Pass a sequence's block table in order: blocks are released in REVERSE order, so a sequence's tail
        blocks are evicted before its prefix blocks (the prefix is the part other prompts share, the tail
        is that one request's own). A block whose refcount would go below 0 raises ValueError and nothing
        is changed: such a release is a bookkeeping bug, and failing before touching anything keeps the
        pool consistent for the error handling above.
        """
        refcounts = self._refcounts
        drops: dict[int, int] = {}
        for block in blocks:
            drops[block] = drops.get(block, 0) + 1
        for block, drop in drops.items():
            self._check_id(block)
            if refcounts[block] < drop:
                raise ValueError(f"block {block} released {drop} time(s) with refcount {refcounts[block]}")
        keys, free_uncached, free_cached = self._keys, self._free_uncached, self._free_cached
        for block in reversed(blocks):
            refcounts[block] -= 1
            if refcounts[block] == 0:
                if keys[block] is None:
                    free_uncached[block] = None
                else:
                    free_cached[block] = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached key of FREE blocks; returns how many. Used blocks keep theirs: their
        sequences are still reading them, and they are forgotten or kept when those sequences end."""
        forgotten = 0
        while self._free_cached:
            block = self._free_cached.popitem(last=False)[0]
            key = self._keys[block]
            assert key is not None
            del self._cached[key]
            self._keys[block] = None
            self._free_uncached[block] = None
            forgotten += 1
        return forgotten

    def check(self) -> None:
        """Assert the invariants (for tests): refcounts >= 0; free set == {b: refcount 0}; each cached key
        maps to a block whose stored key is that key; no block in two places; num_free + num_used ==
        num_blocks. Raises AssertionError even under python -O."""
        refcounts, keys = self._refcounts, self._keys
        _require(len(refcounts) == len(keys) == self.num_blocks, "per-block lists have the wrong length")
        negative = [b for b, count in enumerate(refcounts) if count < 0]
        _require(not negative, f"negative refcounts: {negative}")
        _require(not (self._free_uncached.keys() & self._free_cached.keys()),
                 f"blocks both cached and uncached free: {self._free_uncached.keys() & self._free_cached.keys()}")
        free = set(self._free_uncached) | set(self._free_cached)
        zero = {b for b, count in enumerate(refcounts) if count == 0}
        _require(free == zero, f"free set {sorted(free)} != refcount-0 blocks {sorted(zero)}")
        for block in self._free_uncached:
            _require(keys[block] is None, f"uncached free block {block} holds a key")
        for block in self._free_cached:
            _require(keys[block] is not None, f"cached free block {block} holds no key")
        for key, block in self._cached.items():
            _require(0 <= block < self.num_blocks, f"key maps to a block out of range: {block}")
            _require(keys[block] == key, f"block {block} does not hold the key it is cached under")
        holding = sum(key is not None for key in keys)
        _require(holding == len(self._cached), f"{holding} blocks hold keys, {len(self._cached)} are cached")
        _require(self.enable_reuse or not self._cached, "keys cached with reuse off")
        _require(self.num_free + self.num_used == self.num_blocks, "free + used != num_blocks")

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"no block {block} (the pool has {self.num_blocks})")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
