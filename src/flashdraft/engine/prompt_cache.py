"""Prefixes evicted from the server's slots, kept in host memory (llama-server's --cache-ram).

A slot holds one conversation's caches; when it takes a prompt that shares less with them than they hold, those
rows would be lost. With a prompt cache the slot's reusable prefix is first copied to host memory, and a later
prompt that shares more with a kept prefix than with any slot gets those rows copied back instead of
recomputing them (a user coming back to an earlier conversation, agents taking turns on one slot). Entries are
dropped least recently used first to stay within the byte budget; a prefix that another entry already holds is
not kept twice. Copies go through SpeculativeDecoder.snapshot / copy_prefix, so the rows restored are exactly
the rows saved: output is what a cold prefill gives (greedy), as with prefix reuse within a slot. With a HostArena
(the server's, on a GPU) the copies take their host memory from it, made once at load, instead of pinning new
memory per prefix; entries are dropped as needed to make room in it.
"""
from __future__ import annotations

from collections import OrderedDict

from flashdraft.engine.speculative import Sequence, SpeculativeDecoder, shared_prefix
from flashdraft.models.kv_cache import ArenaFull, HostArena

MIN_ROWS = 16  # shorter prefixes cost more to keep track of than to recompute


def _holds(tokens: list[int], other: list[int]) -> bool:
    """Whether a prefix kept for `tokens` holds every row a sequence of `other` could reuse (all but its last)."""
    return shared_prefix(tokens, other) >= len(other) - 1


def _nbytes(seq: Sequence) -> int:
    return seq.target_cache.nbytes() + (seq.draft_cache.nbytes() if seq.draft_cache is not None else 0)


def _tensors(seq: Sequence) -> list:
    """The key and value tensors of seq's caches."""
    caches = [seq.target_cache] + ([seq.draft_cache] if seq.draft_cache is not None else [])
    return [t for cache in caches for t in cache.k + cache.v]


class PromptCache:
    def __init__(self, decoder: SpeculativeDecoder, max_bytes: int | None, arena: HostArena | None = None):
        """max_bytes: the budget for the kept prefixes' caches (None: no limit); arena: host memory the copies take
        (None: each copy allocates its own)."""
        self.decoder = decoder
        self.max_bytes = max_bytes
        self.arena = arena
        self.entries: OrderedDict[int, Sequence] = OrderedDict()  # least recently used first
        self._next_id = 0
        self.bytes = 0

    def save(self, seq: Sequence) -> bool:
        """Keep seq's reusable prefix (called before the slot's caches are overwritten); True if it was kept."""
        tokens = seq.tokens
        if len(tokens) - 1 < MIN_ROWS or self._touch_holder(tokens):  # too short, or already kept (or more of it)
            return False
        snap = self._snapshot(seq)
        if snap is None or snap.projected < MIN_ROWS:
            return False
        size = _nbytes(snap)
        if self.max_bytes is not None and size > self.max_bytes:
            return False
        for key in [k for k, e in self.entries.items() if _holds(snap.tokens, e.tokens)]:
            self._drop(key)  # the new entry holds it too
        while self.max_bytes is not None and self.bytes + size > self.max_bytes:
            self._drop(next(iter(self.entries)))
        self.entries[self._next_id] = snap
        self._next_id += 1
        self.bytes += size
        return True

    def _touch_holder(self, tokens: list[int]) -> bool:
        """Whether an entry already holds what `tokens` could reuse (it becomes the most recently used)."""
        key = next((key for key, entry in self.entries.items() if _holds(entry.tokens, tokens)), None)
        if key is not None:
            self.entries.move_to_end(key)
        return key is not None

    def _snapshot(self, seq: Sequence) -> Sequence | None:
        """seq's reusable prefix copied to host memory: into the arena, dropping the least recently used entries
        until it fits, or to memory of its own without one. None, dropping nothing, for a prefix that the empty
        arena or the budget could not hold or too short to keep (measured on meta tensors, no bytes, once the
        arena is found full)."""
        if self.arena is None:
            return self.decoder.snapshot(seq)
        worth_room = None  # measured at the first ArenaFull
        while True:
            try:
                return self.decoder.snapshot(seq, self.arena)
            except ArenaFull:
                if worth_room is None:
                    worth_room = self._worth_room(seq)
                if not self.entries or not worth_room:
                    return None
                self._drop(next(iter(self.entries)))

    def _worth_room(self, seq: Sequence) -> bool:
        """Whether seq's prefix is worth dropping kept ones for: long enough to keep, and within the empty arena
        and the budget."""
        shape = self.decoder.snapshot(seq, "meta")
        return shape is not None and shape.projected >= MIN_ROWS and self.arena.fits(_tensors(shape)) and (
            self.max_bytes is None or _nbytes(shape) <= self.max_bytes)

    def restore(self, seq: Sequence, prompt: list[int], have: int) -> int:
        """Copy the kept prefix sharing the most with `prompt` into seq's caches if it holds more than `have`
        reusable rows; returns the rows restored (0 when none was better)."""
        best_key, best_rows = None, have
        for key, entry in self.entries.items():
            rows = self.decoder.reusable_rows(entry, prompt)
            if rows > best_rows:
                best_key, best_rows = key, rows
        if best_key is None:
            return 0
        self.decoder.copy_prefix(seq, self.entries[best_key], best_rows)
        self.entries.move_to_end(best_key)
        return best_rows

    def warm_up(self, seq: Sequence, rows: int = 4 * MIN_ROWS) -> None:
        """Copy `rows` positions of an empty slot's caches (their values unused) to host memory and back once, at
        load, and forget the copies: what a save meets on first use (the staging buffer's device memory, the first
        transfers into the arena) is then met before a request waits on it. On the H200 the second request's first
        token, the first to save a prefix, came 10 ms later than the next ones (docs/performance.md). Nothing is
        copied into an arena too small for the copy (then no prefix fits in it either)."""
        for cache in [seq.target_cache] + ([seq.draft_cache] if seq.draft_cache is not None else []):
            n = min(rows, cache.capacity)
            try:
                snap = cache.snapshot(n, self.arena if self.arena is not None else "cpu")
            except ArenaFull:
                return
            cache.copy_prefix(snap, n)

    def _drop(self, key: int) -> None:
        self.bytes -= _nbytes(self.entries.pop(key))
