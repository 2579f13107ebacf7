import copy
import threading
import weakref

import torch

from flashdraft.config import ModelConfig
from flashdraft.quant.kv_formats import bytes_per_token, cache_format, new_rows


class KVCache:
    """Preallocated keys and values, one [kv_heads, capacity, row] pair per layer: views of one keys and one values
    tensor [layers, kv_heads, capacity, row], so that a prefix's rows of many layers are one strided view, copied in
    one piece (snapshot, copy_prefix: a copy per run of layers instead of one per layer and tensor, each of which
    cost the host tens of microseconds on a request's path: docs/performance.md).

    The cache holds no length of its own: the owner of a sequence knows how many rows are valid, and
    attention masks by position. Rolling back to any earlier length is therefore just a smaller
    length on the owner's side: O(1), nothing copied or cleared.

    k_type / v_type are KV cache types (flashdraft.quant.kv_formats: f32, f16, bf16, q8_0, q5_1, q5_0, q4_1,
    q4_0); None keeps the compute dtype. A row is head_dim values of that dtype or a packed uint8 row of blocks,
    which attention quantizes on write and dequantizes on read.
    """

    def __init__(self, cfg: ModelConfig, capacity: int, device: torch.device, dtype: torch.dtype,
                 k_type: str | None = None, v_type: str | None = None):
        self.capacity = capacity
        self.k_format, self.v_format = cache_format(k_type, dtype), cache_format(v_type, dtype)
        heads, hd, layers = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
        self.layer_shapes = [(heads, hd)] * layers
        keys = new_rows(self.k_format, layers * heads, capacity, hd, device).unflatten(0, (layers, heads))
        values = new_rows(self.v_format, layers * heads, capacity, hd, device).unflatten(0, (layers, heads))
        self.runs = [(0, keys, values)]  # (first layer, its keys and values and those of the layers after it)
        self.k, self.v = list(keys.unbind(0)), list(values.unbind(0))

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """The rows that hold these positions: the positions themselves."""
        return positions

    def record(self, positions: torch.Tensor) -> None:
        """Note that rows(positions) now hold these positions (nothing to note: rows are positions)."""

    def kv_len(self, rows: int) -> int:
        """How many rows a pass that needs positions [0, rows) reads."""
        return rows

    def reusable(self, rows: int) -> int:
        """How many of the first `rows` positions a new sequence that shares them can keep: all of them, since
        rows are stored at their absolute positions and nothing past the owner's length overwrites them."""
        return rows

    def filler_rows(self, end: int) -> int:
        """The most filler rows (a prefill pass padded to a bucket) a pass may write at positions end, end + 1, ...:
        the rows left (a WindowKVCache's: before its ring comes round). Like a rejected guess's row they lie past the
        owner's length, hidden by position, and a real row replaces each before any query reads it."""
        return self.capacity - end

    def copy_prefix(self, source: "KVCache", rows: int) -> None:
        """Take positions [0, rows) from another sequence's cache (one that shares those tokens and cache types)."""
        check_same_types(self, source)
        for dst, src in self._runs_from(source):
            copy_rows(dst.flatten(0, 1), src.flatten(0, 1), rows)

    def snapshot(self, rows: int, device: "torch.device | str | HostArena" = "cpu") -> "KVCache":
        """A copy of positions [0, rows) on `device` (or in a HostArena's host memory), holding only those rows:
        the host prompt cache keeps evicted prefixes so, and copy_prefix takes one as its source to bring them
        back."""
        return self._copied(lambda t: t[:, :, :rows], rows, device)

    def _copied(self, part, rows: int, device) -> "KVCache":
        """A copy of this cache holding part(t) of each run's keys and values t (`rows` positions of each layer),
        in runs of as many layers as copy_all_to stages at once (at least one)."""
        snap = copy.copy(self)
        snap.capacity = rows
        (_, keys, values), = self.runs
        per = max(1, STAGING_BYTES // max(1, part(keys[:1]).nbytes + part(values[:1]).nbytes))
        firsts = range(0, len(self.k), per)
        copies = copy_all_to([part(t[a:a + per]) for a in firsts for t in (keys, values)], device)
        snap.runs = [(a, copies[2 * i], copies[2 * i + 1]) for i, a in enumerate(firsts)]
        snap.k = [layer for _, k, _ in snap.runs for layer in k.unbind(0)]
        snap.v = [layer for _, _, v in snap.runs for layer in v.unbind(0)]
        return snap

    def _runs_from(self, source: "KVCache"):
        """(destination, source) pairs of stacked layers, keys and values, covering source's runs (this cache
        holds one run: a live cache)."""
        (_, keys, values), = self.runs
        for first, k, v in source.runs:
            yield keys[first:first + k.shape[0]], k
            yield values[first:first + v.shape[0]], v

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def bytes_per_token(self) -> int:
        """Cache bytes each position of context takes (all layers, keys and values)."""
        return bytes_per_token(self.layer_shapes, self.k_format, self.v_format)


class WindowKVCache(KVCache):
    """A drafter's context cache that keeps only the last `window` positions (--spec-dflash-cross-ctx): a ring of
    window + block rows, row = position % ring, so its memory and a draft pass's reads stay constant however long
    the context grows. The block's own rows follow the last window context positions in the ring, so a pass
    overwrites only positions older than the window. `ring_pos` records the position each row holds (-1: none)
    and attention masks by it: rows at or past the block's end are stale (a shorter sequence's, after prefix reuse)
    and hidden. Keys carry RoPE of their absolute positions, so where a row sits in the ring does not matter.

    A new sequence sharing a prefix keeps all its rows (KVCache.reusable), whatever the ring still holds of the
    window before them: a row holding a position from the prefix's end on (the old sequence's) stays hidden while
    passes end before that position, and the new sequence writes each position into that row before it gets there
    (row = position % ring), so a pass sees only the shared prefix's rows and the new sequence's own. Where a later
    position overwrote some of the window (a prompt that leaves the conversation more than a block before its end,
    as a template that drops the last answer's reasoning does), the drafter sees fewer context rows for a while and
    may guess worse; the target keeps its rows, so the prompt is not run again, and the output is the target's."""

    def __init__(self, cfg: ModelConfig, window: int, block: int, device: torch.device, dtype: torch.dtype,
                 k_type: str | None = None, v_type: str | None = None):
        super().__init__(cfg, window + block, device, dtype, k_type, v_type)
        self.window = window
        self.ring_pos = torch.full((self.capacity,), -1, dtype=torch.long, device=device)

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        return positions % self.capacity

    def record(self, positions: torch.Tensor) -> None:
        self.ring_pos.index_copy_(0, self.rows(positions), positions)

    def key_positions(self, kv_len: int) -> torch.Tensor:
        """[kv_len] the position each of the first kv_len rows holds (-1: none)."""
        return self.ring_pos[:kv_len]

    def visible(self, kv_len: int, last: torch.Tensor) -> torch.Tensor:
        """[1, kv_len] the rows a pass ending at position `last` may read: those holding a position up to it."""
        held = self.key_positions(kv_len)
        return ((held >= 0) & (held <= last))[None, :]

    def kv_len(self, rows: int) -> int:
        return min(rows, self.capacity)

    def copy_prefix(self, source: "WindowKVCache", rows: int) -> None:
        """Take the ring of another sequence's cache that shares positions [0, rows): rows it holds at or past
        `rows` are stale here, and hidden until overwritten (see the class docstring)."""
        check_same_types(self, source)
        for dst, src in self._runs_from(source):
            dst.copy_(src, non_blocking=True)
        self.ring_pos.copy_(source.ring_pos)

    def snapshot(self, rows: int, device: "torch.device | str | HostArena" = "cpu") -> "WindowKVCache":
        """The whole ring and the positions it holds, on `device` (copy_prefix takes it as a source)."""
        snap = self._copied(lambda t: t, self.capacity, device)
        snap.ring_pos = self.ring_pos.to(device_of(device), copy=True)  # waited for: reusable() reads it on the host
        return snap


class ArenaFull(MemoryError):
    """A HostArena's free bytes do not hold a snapshot's tensors."""


class HostArena:
    """Host memory made once for the prompt cache's snapshots (--cache-ram), pinned when the caches are on a GPU;
    each snapshot's tensors are views cut from it, and their bytes come back when the views are freed (the prompt
    cache drops an entry). Why: pinning host memory is a driver call that takes time by the byte (12-34 ms for a
    short prompt's prefix on the H200, seconds for a long one: docs/performance.md); made at load, it is off the
    requests' path. Copies into it are queued on the stream like every other cache copy, so bytes taken again
    after a view is freed are written only after what was queued before (a copy back from it)."""

    def __init__(self, nbytes: int, pin_memory: bool):
        self.nbytes = nbytes
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory)
        self._free = [(0, nbytes)]  # (start, end) ranges, ascending, none touching another
        self._lock = threading.Lock()
        # ranges of freed views, given back by the next take: a finalizer may run in any thread, also inside take
        # (a garbage collection), so it takes no lock and touches nothing but this list
        self._freed: list[tuple[int, int]] = []

    def take(self, like: list[torch.Tensor], groups: list[list[int]] | None = None) -> list[torch.Tensor]:
        """Uninitialised views shaped as `like`'s tensors, all or none (ArenaFull). groups: lists of indices into
        `like` whose views lie one after another (at offsets rounded up to 64 bytes) in one free range, so that one
        copy fills them (copy_all_to); by default each view anywhere it fits. Each view gives its own bytes back."""
        groups = groups if groups is not None else [[i] for i in range(len(like))]
        views, cuts = [None] * len(like), []
        with self._lock:
            self._give_back_freed()
            for group in groups:
                sizes = [_aligned(like[i].numel() * like[i].element_size()) for i in group]
                size = sum(sizes)
                start = next((a for a, b in self._free if b - a >= size), None) if size else 0
                if start is None:  # none of the views is returned: their bytes go back now
                    for a, n in cuts:
                        self._give_back(a, n)
                    raise ArenaFull(f"{size} bytes wanted, {self._free_total()} free in pieces")
                self._cut(start, size)
                cuts.append((start, size))
                for i, n in zip(group, sizes):
                    t = like[i]
                    views[i] = (self.buffer[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape),
                                (start, n))
                    start += n
        for view, (start, size) in views:
            weakref.finalize(view, self._freed.append, (start, size))
        return [view for view, _ in views]

    def fits(self, tensors: list[torch.Tensor]) -> bool:
        """Whether views like these could be taken from the whole arena, empty."""
        return sum(_aligned(t.numel() * t.element_size()) for t in tensors) <= self.nbytes

    def free_bytes(self) -> int:
        with self._lock:
            self._give_back_freed()
            return self._free_total()

    def _free_total(self) -> int:
        return sum(b - a for a, b in self._free)

    def _cut(self, start: int, size: int) -> None:
        if size == 0:
            return
        i = next(i for i, (a, _) in enumerate(self._free) if a == start)
        a, b = self._free[i]
        self._free[i:i + 1] = [(a + size, b)] if a + size < b else []

    def _give_back_freed(self) -> None:
        while self._freed:
            self._give_back(*self._freed.pop())

    def _give_back(self, start: int, size: int) -> None:
        """Return [start, start + size) to the free ranges, merged with the ranges it touches."""
        if size == 0:  # an empty view took nothing
            return
        end = start + size
        i = next((i for i, (a, _) in enumerate(self._free) if a > start), len(self._free))
        if i < len(self._free) and self._free[i][0] == end:
            end = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == start:
            start = self._free.pop(i - 1)[0]
            i -= 1
        self._free.insert(i, (start, end))


def copy_rows(dst: torch.Tensor, src: torch.Tensor, rows: int) -> None:
    """dst[:, :rows] = src[:, :rows], queued on the stream (from pinned host memory too: not waited for). A strided
    source in host memory goes to the GPU whole first: torch would gather its rows on the host at once, before a
    snapshot's transfer queued earlier (copy_all_to) had written them."""
    if dst.is_cuda and not src.is_cuda and not src[:, :rows].is_contiguous():
        src = src.to(dst.device, non_blocking=True)
    dst[:, :rows].copy_(src[:, :rows], non_blocking=True)


def device_of(to: "torch.device | str | HostArena") -> "torch.device | str":
    """Where a copy to `to` lies: the host for a HostArena."""
    return "cpu" if isinstance(to, HostArena) else to


PINNED_BLOCK = 256 << 20  # bytes of host memory pinned per allocation at most (copy_all_to)
STAGING_BYTES = 64 << 20  # device bytes gathered for one copy to the host at most (copy_all_to)


def copy_all_to(tensors: list[torch.Tensor], device: "torch.device | str | HostArena") -> list[torch.Tensor]:
    """Copies of `tensors` on `device`, or in a HostArena (ArenaFull when it cannot hold them). From a GPU to the host
    they go to pinned memory (the arena's, or blocks of at most PINNED_BLOCK bytes, the tensors laid one after
    another), queued on the current stream and not waited for: the host goes on at once, work queued after it (a new
    prompt overwriting those rows) runs after it, and so does a copy back (copy_prefix). Each run of tensors is
    first gathered on the GPU into one staging buffer of at most STAGING_BYTES (a tensor larger than that alone),
    then copied to the host in one transfer: a cache's rows of a prefix are strided views, and a strided copy to the
    host is a contiguous copy on the GPU, a transfer and an event each, which for a Qwen3-8B cache's 72 tensors
    cost the host milliseconds of a request's first token (docs/performance.md). A copy to pageable memory waited
    for every byte: 4.4 s for the 4.4 GB of a 30K-token prefix of Qwen3-8B on the H200. Few blocks, not one per
    layer: each pinned allocation is a driver call; bounded blocks, not one: torch's host allocator rounds a block
    up to a power of two, and pinning takes time by the byte. Read such a copy on the host only after
    synchronizing."""
    to_host = bool(tensors) and (isinstance(device, HostArena)
                                 or (tensors[0].is_cuda and torch.device(device).type == "cpu"))
    if not to_host:
        return [t.to(device, copy=True) for t in tensors]
    nbytes = [t.numel() * t.element_size() for t in tensors]
    groups = pinned_blocks(nbytes, PINNED_BLOCK)
    copies = device.take(tensors, groups) if isinstance(device, HostArena) else [None] * len(tensors)
    for group in groups:
        if not any(nbytes[i] for i in group):
            continue
        starts = _offsets([nbytes[i] for i in group])
        if isinstance(device, HostArena):  # the group's range of the arena, as take laid it out
            first = copies[group[0]]  # (its offset from its view: an empty view's data_ptr is 0)
            offset = first.storage_offset() * first.element_size()
            block = device.buffer[offset:offset + starts[-1] + nbytes[group[-1]]]
        else:
            block = torch.empty(starts[-1] + _aligned(nbytes[group[-1]]), dtype=torch.uint8, pin_memory=True)
            for i, start in zip(group, starts):
                copies[i] = block[start:start + nbytes[i]].view(tensors[i].dtype).view(tensors[i].shape)
        for run in pinned_blocks([nbytes[i] for i in group], STAGING_BYTES):  # positions in the group
            first, last = starts[run[0]], starts[run[-1]] + nbytes[group[run[-1]]]
            _copy_run([tensors[group[j]] for j in run], [copies[group[j]] for j in run], block[first:last])
    return copies


def _offsets(nbytes: list[int]) -> list[int]:
    """Where tensors of these sizes start when they lie one after another, each at a multiple of 64 bytes
    (HostArena.take's layout of a group)."""
    starts, at = [], 0
    for n in nbytes:
        starts.append(at)
        at += _aligned(n)
    return starts


def _copy_run(sources: list[torch.Tensor], views: list[torch.Tensor], host: torch.Tensor) -> None:
    """Copy sources into their views, which lie one after another (_offsets' layout) in `host`'s bytes: from a GPU,
    gathered into a staging buffer of that layout, then one transfer; otherwise each directly."""
    if not sources[0].is_cuda:
        for view, t in zip(views, sources):
            view.copy_(t)
        return
    staging = torch.empty(host.numel(), dtype=torch.uint8, device=sources[0].device)
    for start, t in zip(_offsets([t.numel() * t.element_size() for t in sources]), sources):
        staging[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
    host.copy_(staging, non_blocking=True)


def pinned_blocks(nbytes: list[int], limit: int = PINNED_BLOCK) -> list[list[int]]:
    """The indices of the tensors (of these sizes) that share each pinned block, in order: a block takes tensors
    while they fit in `limit` bytes (a larger tensor gets a block of its own)."""
    blocks, used = [], 0
    for i, n in enumerate(nbytes):
        if not blocks or used + _aligned(n) > limit:
            blocks.append([])
            used = 0
        blocks[-1].append(i)
        used += _aligned(n)
    return blocks


def _aligned(nbytes: int) -> int:
    """nbytes rounded up to 64: where the next view in a block may start, aligned for any dtype."""
    return -(-nbytes // 64) * 64


def check_same_types(cache, source) -> None:
    """Rows copied between caches must be stored alike (a copy would otherwise cast or fail on the row width)."""
    if (cache.k_format, cache.v_format) != (source.k_format, source.v_format):
        raise ValueError(f"cannot copy a prefix from a {source.k_format.name}/{source.v_format.name} cache into a "
                         f"{cache.k_format.name}/{cache.v_format.name} one")
