"""The host prompt cache (--cache-ram): a slot's prefix saved before another prompt overwrites it comes back for a
prompt that shares it, with the output of a cold run; the byte budget evicts least recently used entries; the
server uses it with one slot and two conversations, and -cram 0 turns it off."""
from __future__ import annotations

import random

import httpx
import pytest
import torch

from flashdraft.config import SamplingParams
from flashdraft.demo import DEMO_DIR
from flashdraft.engine.generator import Engine
from flashdraft.engine.speculative import shared_prefix
from flashdraft.server.cli import build_parser, settings_from_args
from flashdraft.server.scheduler import PromptCache
from test_gemma4_tiny import build_gemma4_target
from test_prefill_chunks import _NoMetrics
from test_server_hardening import AUTH, LiveServer

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def run(engine, prompt, sequence, reuse=True, draft=None):
    *_, result = engine.stream(prompt, GREEDY, draft=draft, sequence=sequence, reuse_prefix=reuse)
    return result


@pytest.fixture(scope="module")
def demo():
    return Engine.load(DEMO_DIR / "target", DEMO_DIR / "drafter", device="cpu", context_size=1024)


def ask(engine, text):
    return engine.encode_prompt(messages=[{"role": "user", "content": text}])


def test_an_evicted_conversation_comes_back_from_host_memory(demo):
    cache = PromptCache(demo.decoder, None)
    slot = demo.new_sequence()
    a = ask(demo, "Write a function that parses a CSV line.")
    first = run(demo, a, slot, draft=demo.max_draft)
    assert cache.save(slot) and len(cache.entries) == 1 and cache.bytes > 0
    run(demo, ask(demo, "Write a class for a bounded queue."), slot, draft=demo.max_draft)  # overwrites the slot
    follow = a + first.tokens + demo.tokenizer.encode(" Now add type hints.", add_special_tokens=False)
    have = demo.decoder.reusable_rows(slot, follow)
    restored = cache.restore(slot, follow, have)
    assert restored == len(a) + len(first.tokens) - 1 > have
    warm = run(demo, follow, slot, draft=demo.max_draft)
    cold = run(demo, follow, demo.new_sequence(), reuse=False, draft=demo.max_draft)
    assert warm.stats.cache_n == restored and warm.tokens == cold.tokens
    assert warm.stats.draft_n_accepted == cold.stats.draft_n_accepted  # the drafter's context came back too
    assert cache.restore(slot, follow, restored) == 0  # nothing better than what the slot holds now


def test_the_budget_evicts_the_least_recently_used(demo):
    slot = demo.new_sequence()
    prompts = [ask(demo, f"Write a function number {i} that sorts a list of records by a key.") for i in range(3)]
    run(demo, prompts[0], slot, draft=0)
    one = demo.decoder.snapshot(slot)
    size = one.target_cache.nbytes() + one.draft_cache.nbytes()
    cache = PromptCache(demo.decoder, int(2.5 * size))
    kept = []
    for p in prompts:
        run(demo, p, slot, draft=0)
        kept.append(list(slot.tokens))
        assert cache.save(slot)
    assert len(cache.entries) == 2 and cache.bytes <= cache.max_bytes
    held = [e.tokens for e in cache.entries.values()]
    assert all(kept[0][:len(h)] != h for h in held) and any(kept[2][:len(h)] == h for h in held)  # oldest out
    assert not cache.save(slot)  # already held: not kept twice
    assert PromptCache(demo.decoder, 10).save(slot) is False  # larger than the whole budget


def test_a_longer_run_of_a_conversation_replaces_its_entry(demo):
    slot, cache = demo.new_sequence(), PromptCache(demo.decoder, None)
    a = ask(demo, "Write a function that reverses the words of a sentence.")
    run(demo, a, slot, draft=0)
    assert cache.save(slot)
    run(demo, list(slot.tokens) + [5, 6, 7], slot, draft=0)
    assert cache.save(slot) and len(cache.entries) == 1
    assert len(next(iter(cache.entries.values())).tokens) == len(slot.tokens)


def test_gemma4_rings_survive_the_round_trip(tmp_path):
    folder, _ = build_gemma4_target(tmp_path / "g", window=8)
    engine = Engine.load(folder, None, device="cpu", context_size=256)
    rng = random.Random(1)
    vocab = engine.decoder.target.config.vocab_size
    a = [rng.randrange(3, vocab) for _ in range(30)]
    slot, cache = engine.new_sequence(), PromptCache(engine.decoder, None)
    first = run(engine, a, slot, draft=0)
    assert cache.save(slot)
    run(engine, [rng.randrange(3, vocab) for _ in range(20)], slot, draft=0)
    follow = a + first.tokens + [7, 8]
    assert cache.restore(slot, follow, engine.decoder.reusable_rows(slot, follow)) == len(a) + len(first.tokens) - 1
    assert run(engine, follow, slot, draft=0).tokens == run(engine, follow, engine.new_sequence(), False, 0).tokens


def test_a_host_arena_gives_views_all_or_none_and_takes_back_freed_bytes():
    from flashdraft.models.kv_cache import ArenaFull, HostArena

    arena = HostArena(1024, pin_memory=False)
    a, b = arena.take([torch.zeros(16, dtype=torch.float32), torch.zeros(2, 8, dtype=torch.bfloat16)])
    assert a.shape == (16,) and b.shape == (2, 8) and b.dtype == torch.bfloat16
    assert arena.free_bytes() == 1024 - 64 - 64  # each view aligned to 64 bytes
    a.fill_(1.0)
    b.fill_(2.0)
    assert torch.equal(a, torch.ones(16)) and a.data_ptr() + 64 == b.data_ptr()  # distinct bytes
    with pytest.raises(ArenaFull):
        arena.take([torch.zeros(64, dtype=torch.uint8), torch.zeros(2048, dtype=torch.uint8)])
    assert arena.free_bytes() == 1024 - 128  # a failed take gives back what it took
    del a
    assert arena.free_bytes() == 1024 - 64  # freed views' bytes come back
    (c,) = arena.take([torch.zeros(64, dtype=torch.uint8)])
    assert c.data_ptr() == arena.buffer.data_ptr()  # first fit: the freed bytes
    del b, c
    assert arena.free_bytes() == 1024 and arena._free == [(0, 1024)]  # merged back into one range
    (whole,) = arena.take([torch.zeros(1024, dtype=torch.uint8)])
    assert whole.numel() == 1024
    (empty,) = arena.take([torch.zeros(0, 4)])  # nothing left, and nothing wanted
    assert empty.shape == (0, 4)
    with arena._lock:  # a garbage collection inside take frees a view: its finalizer must not wait for the lock
        del whole
    assert arena.free_bytes() == 1024


def test_an_arena_lays_a_group_of_views_one_after_another_and_takes_each_back_alone():
    """take(like, groups): each group's views lie one after another (at 64-byte multiples) in one free range, so that
    one transfer fills them; all or none across the groups; each view still gives its own bytes back."""
    from flashdraft.models.kv_cache import ArenaFull, HostArena

    arena = HostArena(1024, pin_memory=False)
    (gap,) = arena.take([torch.zeros(64, dtype=torch.uint8)])
    (hole,) = arena.take([torch.zeros(64, dtype=torch.uint8)])
    del gap  # a free range of 64 bytes at the start: too small for the group below
    a, b, c = arena.take([torch.zeros(10, dtype=torch.float32), torch.zeros(2, 3, dtype=torch.bfloat16),
                          torch.zeros(50, dtype=torch.uint8)], groups=[[0, 1], [2]])
    base = arena.buffer.data_ptr()
    assert (a.data_ptr() - base, b.data_ptr() - base) == (128, 192)  # one after another, past the 64-byte gap
    assert c.data_ptr() - base == 0  # a group of its own fits the gap (first fit)
    assert arena.free_bytes() == 1024 - 64 - 128 - 64
    with pytest.raises(ArenaFull):  # the first group fits, the second does not
        arena.take([torch.zeros(64, dtype=torch.uint8), torch.zeros(800, dtype=torch.uint8)], groups=[[0], [1]])
    assert arena.free_bytes() == 768  # nothing kept of a failed take
    del a
    assert arena.free_bytes() == 768 + 64  # the group's views come back one by one
    del b, c, hole
    assert arena.free_bytes() == 1024 and arena._free == [(0, 1024)]  # merged back into one range


def test_copies_into_an_arena_hold_the_sources_and_share_a_range_per_group(monkeypatch):
    """copy_all_to into an arena: every copy equals its source (strided views of a cache's rows), and the tensors of
    one pinned block's group lie one after another in one range (so that one transfer from a GPU fills them)."""
    from flashdraft.models import kv_cache
    from flashdraft.models.kv_cache import HostArena, copy_all_to

    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, 40, 8, generator=g).to(torch.bfloat16) for _ in range(6)]
    sources = [t[:, :25] for t in caches]  # a prefix's rows: not contiguous
    monkeypatch.setattr(kv_cache, "PINNED_BLOCK", 3 * 832)  # three of these 800-byte tensors a group
    arena = HostArena(1 << 16, pin_memory=False)
    (gap,) = arena.take([torch.zeros(1000, dtype=torch.uint8)])
    (kept,) = arena.take([torch.zeros(64, dtype=torch.uint8)])
    del gap  # 1024 free bytes at the start: room for one tensor, not for a group of three
    copies = copy_all_to(sources, arena)
    assert all(torch.equal(c, s) and c.is_contiguous() for c, s in zip(copies, sources))
    starts = [c.data_ptr() - arena.buffer.data_ptr() for c in copies]
    assert starts == [1088 + 832 * i for i in range(6)]  # past the gap, one after another


def test_with_an_arena_the_least_recently_used_make_room_and_prefixes_come_back_alike(demo):
    """A prompt cache whose copies take an arena's memory (the server's on a GPU; unpinned here): entries are dropped
    oldest first when the arena is full, a prefix larger than the whole arena is not kept, and what comes back gives
    the output of a cold run."""
    from flashdraft.models.kv_cache import HostArena

    slot = demo.new_sequence()
    prompts = [ask(demo, f"Write a function number {i} that sorts a list of records by a key.") for i in range(3)]
    run(demo, prompts[0], slot, draft=0)
    one = demo.decoder.snapshot(slot)
    size = one.target_cache.nbytes() + one.draft_cache.nbytes()
    del one
    arena = HostArena(int(2.5 * size), pin_memory=False)
    cache = PromptCache(demo.decoder, None, arena)
    firsts = []
    for p in prompts:
        firsts.append(run(demo, p, slot, draft=demo.max_draft).tokens)
        assert cache.save(slot)
    held = [e.tokens for e in cache.entries.values()]
    assert len(held) == 2 and held[0][:len(prompts[1])] == prompts[1]  # the first dropped for room
    taken = [t for e in cache.entries.values() for c in (e.target_cache, e.draft_cache) for t in c.k + c.v]
    assert arena.free_bytes() == arena.nbytes - sum(-(-t.numel() * t.element_size() // 64) * 64 for t in taken)
    follow = prompts[1] + firsts[1] + [5, 6, 7]
    restored = cache.restore(slot, follow, demo.decoder.reusable_rows(slot, follow))
    # the entry's rows the follow-up shares: its prompt and output, and the output's last token where the last step
    # committed past it (a sequence's last token has no row)
    assert restored == min(shared_prefix(held[0], follow), len(held[0]) - 1) >= len(prompts[1]) + len(firsts[1]) - 1
    warm = run(demo, follow, slot, draft=demo.max_draft)
    cold = run(demo, follow, demo.new_sequence(), reuse=False, draft=demo.max_draft)
    assert warm.tokens == cold.tokens and warm.stats.draft_n_accepted == cold.stats.draft_n_accepted
    small = PromptCache(demo.decoder, None, HostArena(int(0.9 * size), pin_memory=False))
    assert small.save(slot) is False and not small.entries  # larger than the whole arena
    short = demo.new_sequence()
    run(demo, prompts[0][:8], short, draft=0)  # a prefix (31 rows) that fits
    small.save(short)
    assert len(small.entries) == 1 and not small.save(slot) and len(small.entries) == 1  # not emptied for nothing


def test_the_warm_up_copies_through_the_arena_and_leaves_the_slot_and_the_cache_as_they_were(demo):
    """PromptCache.warm_up (the server's, at load): one copy of each of a slot's caches into the arena and back;
    afterwards no entry, every byte of the arena free again, the caches' rows as they were, and the slot serves
    as a new one does."""
    from flashdraft.models.kv_cache import HostArena

    slot = demo.new_sequence()
    prompt = ask(demo, "Write a function that merges two sorted lists.")
    run(demo, prompt, slot, draft=demo.max_draft)
    slot.tokens = []  # as Engine.warm_up leaves a slot
    before = [t.clone() for c in (slot.target_cache, slot.draft_cache) for t in c.k + c.v]
    arena = HostArena(1 << 22, pin_memory=False)
    taken = []
    take = arena.take
    arena.take = lambda like, groups=None: taken.append(len(like)) or take(like, groups)
    cache = PromptCache(demo.decoder, None, arena)
    cache.warm_up(slot)
    assert taken == [2, 2]  # both caches' keys and values into the arena, each one run of all the layers
    assert not cache.entries and cache.bytes == 0 and arena.free_bytes() == arena.nbytes
    after = [t for c in (slot.target_cache, slot.draft_cache) for t in c.k + c.v]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert run(demo, prompt, slot, draft=demo.max_draft).tokens == run(demo, prompt, demo.new_sequence(),
                                                                        draft=demo.max_draft).tokens
    tiny = HostArena(4096, pin_memory=False)  # -cram set below one copy's size: the warm-up copies nothing
    PromptCache(demo.decoder, 4096, tiny).warm_up(slot)
    assert tiny.free_bytes() == 4096


def chat(server, messages, **extra) -> dict:
    body = {"messages": messages, "max_tokens": 12, "temperature": 0, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("cache_ram", [8192, 0])
def test_one_slot_two_conversations(cache_ram):
    srv = LiveServer(DEMO_DIR / "target", DEMO_DIR / "drafter", ctx_size=1024, n_predict=12, n_slots=1,
                     cache_ram_mib=cache_ram)
    try:
        a = [{"role": "user", "content": "Write a function that parses a CSV line."}]
        b = [{"role": "user", "content": "Write a class for a bounded queue with a maximum size."}]
        reply = chat(srv, a)["choices"][0]["message"]["content"]
        chat(srv, b)
        a2 = a + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Now add type hints."}]
        warm, cold = chat(srv, a2), chat(srv, a2, cache_prompt=False)
        assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
        first_prompt = len(srv.state.engine.encode_prompt(messages=a))
        if cache_ram:
            assert warm["timings"]["cache_n"] >= first_prompt  # conversation a's turn came back from host memory
        else:
            assert warm["timings"]["cache_n"] < first_prompt  # only what b's prompt shares with it
    finally:
        srv.stop()


def test_cache_ram_flag():
    args = build_parser().parse_args(["-cram", "512"])
    assert settings_from_args(args).cache_ram_mib == 512 and not getattr(args, "no_effect", [])
    assert settings_from_args(build_parser().parse_args([])).cache_ram_mib == 8192  # llama-server's default
    with pytest.raises(ValueError, match="--cache-ram must be -1"):
        settings_from_args(build_parser().parse_args(["--cache-ram", "-2"]))


def test_cache_reuse_is_refused_unless_off():
    assert settings_from_args(build_parser().parse_args(["--cache-reuse", "0"]))  # llama-server's default: off
    with pytest.raises(ValueError, match="--cache-reuse 256: reusing cached chunks by KV shifting is not supported"):
        settings_from_args(build_parser().parse_args(["--cache-reuse", "256"]))


def test_n_tokens_max_counts_the_cached_prompt_tokens():
    """/metrics' n_tokens_max is the context a generation filled: its prompt's tokens from the cache count too."""
    from flashdraft.engine.generator import GenerationResult, GenerationStats
    from flashdraft.server.app import ServerMetrics
    metrics = ServerMetrics()
    stats = GenerationStats(prompt_n=5, cache_n=100, predicted_n=10, steps=9)
    metrics.on_result(GenerationResult(text="", tokens=[], finish_reason="length", stop_type="limit",
                                       stopping_word="", seed=0, stats=stats))
    assert b"llamacpp:n_tokens_max 115.0" in metrics.render()
    assert b"llamacpp:prompt_tokens_total 5.0" in metrics.render()  # the tokens processed, as llama-server's


def test_snapshots_pin_host_memory_in_few_bounded_blocks():
    """Tensors share a pinned block while they fit in its bound (torch rounds a block up to a power of two, and pinning
    costs by the byte), a larger one gets its own, and no tensor is left out or taken twice."""
    from flashdraft.models.kv_cache import pinned_blocks

    assert pinned_blocks([100, 100, 100], limit=256) == [[0, 1], [2]]  # each rounded to 128
    assert pinned_blocks([10, 300, 10, 10], limit=256) == [[0], [1], [2, 3]]
    sizes = [30244 * 8 * 128 * 2] * 72  # a 30K-token Qwen3-8B prefix: 72 tensors of 62 MB, 4.46 GB
    blocks = pinned_blocks(sizes)
    assert sorted(i for block in blocks for i in block) == list(range(72))
    assert len(blocks) == 18 and all(sum(sizes[i] for i in block) <= 256 << 20 for block in blocks)


@pytest.mark.parametrize("window", [None, 8])
def test_a_snapshot_copies_runs_of_layers_and_comes_back_exactly(monkeypatch, window):
    """A cache's layers are views of one keys and one values tensor; a snapshot copies them in runs of as many
    layers as one staging buffer holds (here two), and copy_prefix puts every run back where it came from: the
    rows taken equal, the rows past them untouched. Also a drafter's window cache (its whole ring)."""
    from types import SimpleNamespace

    import flashdraft.models.kv_cache as kv_cache
    from flashdraft.models.kv_cache import KVCache, WindowKVCache

    cfg = SimpleNamespace(num_key_value_heads=2, head_dim=8, num_hidden_layers=5)
    make = (lambda: KVCache(cfg, 32, torch.device("cpu"), torch.float32)) if window is None else (
        lambda: WindowKVCache(cfg, window, 4, torch.device("cpu"), torch.float32))
    cache, back = make(), make()
    for t in cache.k + cache.v:
        t.normal_()
    assert cache.k[3].data_ptr() == cache.runs[0][1][3].data_ptr()  # a layer is a view of the stacked keys
    rows = 10 if window is None else cache.capacity
    monkeypatch.setattr(kv_cache, "STAGING_BYTES", 2 * 2 * (2 * rows * 8 * 4))  # two layers' keys and values
    snap = cache.snapshot(rows)
    assert [(first, k.shape[0]) for first, k, _ in snap.runs] == [(0, 2), (2, 2), (4, 1)]
    assert all(k.shape[2] == rows and v.shape[2] == rows for _, k, v in snap.runs)
    taken = [t[:, :rows].clone() for t in cache.k + cache.v]
    for t in cache.k + cache.v:
        t.add_(1.0)  # the snapshot holds the rows as they were
    back.copy_prefix(snap, rows)
    assert all(torch.equal(a[:, :rows], b) for a, b in zip(back.k + back.v, taken))
    assert all(not t[:, rows:].any() for t in back.k + back.v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host copies need a GPU")
@pytest.mark.parametrize("into_arena", [False, True])
def test_a_gpu_snapshot_goes_to_pinned_memory_without_waiting_and_keeps_the_rows_it_was_taken_with(into_arena):
    """The snapshot (gathered on the GPU, one transfer) is queued, not waited for: the next prompt's writes, queued
    after it, do not reach it, and the copy back gives the rows as they were; in pinned blocks or an arena."""
    from flashdraft.models.kv_cache import HostArena, KVCache

    cfg = Engine.load(DEMO_DIR / "target", None, device="cpu").decoder.target.config
    cache = KVCache(cfg, 256, torch.device("cuda"), torch.bfloat16)
    for t in cache.k + cache.v:
        t.normal_()
    before = [t[:, :200].cpu() for t in cache.k + cache.v]
    snap = cache.snapshot(200, HostArena(cache.nbytes(), pin_memory=True) if into_arena else "cpu")
    for t in cache.k + cache.v:
        t.fill_(7.0)  # the next prompt overwriting the rows
    back = KVCache(cfg, 256, torch.device("cuda"), torch.bfloat16)
    back.copy_prefix(snap, 200)
    part = KVCache(cfg, 256, torch.device("cuda"), torch.bfloat16)
    part.copy_prefix(snap, 150)  # fewer rows than it holds: a strided host source, queued after the snapshot too
    torch.cuda.synchronize()
    assert all(s.is_pinned() for s in snap.k + snap.v)
    assert len({s.untyped_storage().data_ptr() for s in snap.k + snap.v}) == 1  # one block: under 256 MiB
    assert all(torch.equal(s, b) for s, b in zip(snap.k + snap.v, before))
    assert all(torch.equal(t[:, :200].cpu(), b) for t, b in zip(back.k + back.v, before))
    assert all(torch.equal(t[:, :150].cpu(), b[:, :150]) for t, b in zip(part.k + part.v, before))


def _serve_in_turn(scheduler, prompts, params):
    """Submit the prompts one after another to a started scheduler; each job's events, in order."""
    import asyncio

    from flashdraft.server.requests import Job
    from flashdraft.server.requests import GenerationRequest

    loop = asyncio.new_event_loop()
    try:
        events = []
        for prompt in prompts:
            job = Job(GenerationRequest(prompt, params, None, 0, False, False, "m", "", cache_prompt=True), loop)
            scheduler.submit(job)
            got = []
            while not got or got[-1][0] not in ("result", "error", "ended"):
                got.append(loop.run_until_complete(asyncio.wait_for(job.events.get(), 60)))
            events.append(got)
        return events
    finally:
        loop.close()


def test_a_prefix_that_cannot_be_kept_in_host_memory_costs_the_request_nothing(demo, caplog):
    """Host memory short when a slot's prefix is saved: a warning, the prefix is not kept, and the request that
    needed the slot runs and answers as without a prompt cache."""
    from flashdraft.server.scheduler import Scheduler

    class FullHostMemory(PromptCache):
        def save(self, seq):
            raise RuntimeError("out of pinned memory")

    scheduler = Scheduler(demo, 1, 0, _NoMetrics(), FullHostMemory(demo.decoder, None))
    scheduler.start()
    a, b = ask(demo, "Write a function that parses a CSV line."), ask(demo, "Explain what a mutex is.")
    try:
        first, second = _serve_in_turn(scheduler, [a, b], GREEDY)
    finally:
        scheduler.stop()
        scheduler.join(10)
    assert first[-1][0] == second[-1][0] == "result"
    assert second[-1][1].tokens == demo.generate(b, GREEDY, 0).tokens
    assert "could not be kept in host memory" in caplog.text


def test_a_failure_placing_a_job_ends_that_job_and_the_worker_serves_the_next(demo):
    """An error while a job is given its slot (copying a kept prefix in) is that job's error; the slot's caches,
    perhaps half copied, are not reused; the next job is served as by a cold server."""
    from flashdraft.server.scheduler import Scheduler

    class FailingRestore(PromptCache):
        failures = 1

        def restore(self, seq, prompt, have):
            if self.failures:
                self.failures -= 1
                raise RuntimeError("copy failed")
            return super().restore(seq, prompt, have)

    scheduler = Scheduler(demo, 1, 0, _NoMetrics(), FailingRestore(demo.decoder, None))
    scheduler.start()
    a = ask(demo, "Write a function that parses a CSV line.")
    try:
        failed, served = _serve_in_turn(scheduler, [a, a], GREEDY)
    finally:
        scheduler.stop()
        scheduler.join(10)
    assert failed[-1][0] == "error" and "copy failed" in str(failed[-1][1])
    assert served[-1][0] == "result" and served[-1][1].tokens == demo.generate(a, GREEDY, 0).tokens
    assert served[-1][1].stats.cache_n == 0
