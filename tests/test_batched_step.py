"""Steps of several sequences as one batched step (issue #23, the CPU's eager path): the target's pass over several
sequences' rows, the decoder's deferred launches and flush, and streams that yield their launched steps."""
import threading

import pytest
import torch

from flashdraft.config import SamplingParams
from flashdraft.engine.generator import StepLaunched
from flashdraft.bench.oracle import PlantedOracle
from flashdraft.engine import speculative
from flashdraft.engine.cuda_graphs import GraphCache
from test_lossless import InlineGraphs

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
PROMPTS = [[1, 5, 9, 33, 7], [2, 8, 4, 4, 4, 4, 11, 12, 13], [3, 3, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]]


def test_target_pass_over_segments_matches_each_sequence_alone(engine):
    """Three sequences' rows in one pass (other lengths, positions and caches): each row's logits and taps are
    its own sequence's pass alone, and each cache gets the keys and values that pass writes."""
    target, dec = engine.decoder.target, engine.decoder
    g = torch.Generator().manual_seed(0)
    alone_caches, batch_caches = [target.new_cache(64) for _ in range(3)], [target.new_cache(64) for _ in range(3)]
    segments, outputs, tokens, positions = [], [], [], []
    for i, (start, rows) in enumerate([(0, 5), (3, 8), (10, 1)]):
        for cache in (alone_caches[i], batch_caches[i]):  # the same earlier rows in both caches
            for layer_k, layer_v in zip(cache.k, cache.v):
                layer_k.copy_(torch.randn(layer_k.shape, generator=torch.Generator().manual_seed(i)))
                layer_v.copy_(torch.randn(layer_v.shape, generator=torch.Generator().manual_seed(i + 10)))
        t = torch.randint(0, target.config.vocab_size, (rows,), generator=g)
        p = torch.arange(start, start + rows)
        outputs.append(target(t, p, alone_caches[i], start + rows, dec.tap_ids))
        segments.append((rows, batch_caches[i], start + rows))
        tokens.append(t)
        positions.append(p)
    logits, taps = target.forward_segments(torch.cat(tokens), torch.cat(positions), segments, dec.tap_ids)
    at = 0
    for (rows, _, _), (ref_logits, ref_taps) in zip(segments, outputs):
        torch.testing.assert_close(logits[at:at + rows], ref_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(taps[at:at + rows], ref_taps, rtol=1e-5, atol=1e-5)
        assert torch.equal(logits[at:at + rows].argmax(-1), ref_logits.argmax(-1))
        at += rows
    for alone, batched in zip(alone_caches, batch_caches):
        for a, b in zip(alone.k + alone.v, batched.k + batched.v):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 24], ids=["full", "ring"])
def test_drafter_context_and_blocks_over_segments_match_each_sequence_alone(engine, window):
    """The drafter's context projection and block pass for three sequences at once write and give what each
    sequence's own calls do, over full caches and over rings of a 24-token window (context past the ring's
    length, a block wrapping round)."""
    drafter, target = engine.decoder.drafter, engine.decoder.target
    B, width = drafter.block_size, len(drafter.config.target_layer_ids) * target.config.hidden_size
    g = torch.Generator().manual_seed(5)
    caches = {way: [drafter.new_cache(128, window=window) for _ in range(3)] for way in ("alone", "batched")}
    starts, contexts = [40, 9, 27], []
    for start in starts:
        taps = torch.randn(start, width, generator=g)
        contexts.append((taps, torch.arange(start)))
    for (taps, positions), cache in zip(contexts, caches["alone"]):
        drafter.add_context(taps, positions, cache)
    drafter.add_context_segments([(taps, positions, cache) for (taps, positions), cache
                                  in zip(contexts, caches["batched"])])
    blocks = [torch.randn(B, target.config.hidden_size, generator=g) for _ in starts]
    alone = [drafter(block, torch.arange(start, start + B), cache, cache.kv_len(start + B))
             for block, start, cache in zip(blocks, starts, caches["alone"])]
    batched = drafter.forward_segments(torch.cat(blocks), torch.cat([torch.arange(s, s + B) for s in starts]),
                                       [(cache, cache.kv_len(start + B), None)
                                        for cache, start in zip(caches["batched"], starts)])
    torch.testing.assert_close(batched, torch.cat(alone), rtol=1e-5, atol=1e-5)
    for a, b in zip(caches["alone"], caches["batched"]):
        for x, y in zip(a.k + a.v, b.k + b.v):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def _alone(engine, prompt, params, draft, oracle=None):
    """The tokens after the prompt's first one that steps of `draft` guesses commit, one sequence alone."""
    dec = engine.decoder
    seq = dec.new_sequence(oracle)
    dec.prefill(seq, prompt, params, 0)
    for _ in range(8):
        dec.collect(seq, dec.launch(seq, draft))
    return seq.tokens[len(prompt):]


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
@pytest.mark.parametrize("draft", [0, 7], ids=["plain", "dflash"])
def test_deferred_steps_of_four_sequences_give_each_its_tokens_alone(engine, draft, graphed, monkeypatch):
    """Four sequences' steps launched deferred and run by one flush, eight rounds: each sequence commits the
    tokens it commits stepping alone (greedy); with a planted oracle, several tokens a step. Graphed (InlineGraphs
    standing in for CUDA graphs): each batched step replays the graph of its composition, its passes reading the
    caches up to the furthest sequence's bucket, the context rows projected a block at a time."""
    dec = engine.decoder
    assert dec.batches
    if graphed:
        monkeypatch.setattr(dec, "graphs", InlineGraphs())
    long = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    references = [p + engine.generate(p, long, 0).tokens for p in PROMPTS]

    def oracles(planted: bool):  # five guesses accepted a step; each run its own (an oracle counts its steps)
        vocab = engine.decoder.target.config.vocab_size
        return [PlantedOracle(r, lambda step: 5, vocab, "cpu") if planted else None for r in references]

    for planted in (False, True):
        alone = [_alone(engine, p, GREEDY, draft, o) for p, o in zip(PROMPTS, oracles(planted))]
        seqs = [dec.new_sequence(o) for o in oracles(planted)]
        for seq, p in zip(seqs, PROMPTS):
            dec.prefill(seq, p, GREEDY, 0)
        for _ in range(8):
            launched = [dec.launch(seq, draft, defer=True) for seq in seqs]
            assert all(step.deferred for step in launched)
            dec.flush()
            for seq, step in zip(seqs, launched):
                assert not step.deferred
                dec.collect(seq, step)
        assert [seq.tokens[len(p):] for seq, p in zip(seqs, PROMPTS)] == alone
        if planted and draft:
            assert all(len(a) == 1 + 8 * 6 for a in alone)  # five guesses and the target's token a step
    if graphed:
        assert "batch" in dec.graphs.keys


def test_a_requests_last_step_drafts_the_policys_length(engine, monkeypatch):
    """A request's last steps draft the policy's length, not the tokens the request has left (those past max_tokens
    are cut from the output): their graphs are the ones its earlier steps replayed, not a new shape at every
    request's end; the tokens are plain decoding's, and the timings count only the guesses the output holds."""
    dec = engine.decoder
    monkeypatch.setattr(dec, "graphs", InlineGraphs())
    plain = engine.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), 0).tokens
    vocab = dec.target.config.vocab_size
    sequences = []  # kept: a sequence's graphs go with it
    for max_tokens in (2, 5, 11, 20):
        for planted in (False, True):  # the drafter's guesses (mostly wrong), every guess right
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            oracle = PlantedOracle(PROMPTS[1] + plain, lambda step: 7, vocab, "cpu") if planted else None
            sequences.append(engine.new_sequence(oracle=oracle))
            out = engine.generate(PROMPTS[1], params, 7, sequence=sequences[-1])
            assert out.tokens == plain[:max_tokens]
            # the timings count what the output holds: the first token, then each step's accepted guesses and its
            # own token
            assert out.stats.predicted_n == max_tokens == 1 + out.stats.steps + out.stats.draft_n_accepted
            assert out.stats.draft_n_accepted <= out.stats.draft_n
            # (two tokens: the first, then the step's own token, no guess needed)
            assert (out.stats.draft_n_accepted > 0) == (planted and max_tokens > 2)
    ours = {dec.graphs.lifetime_key(seq.target_cache) for seq in sequences}
    assert {key[4] for key in dec.graphs.graphs if key[0] == "step" and key[3] in ours} == {7}  # each step's n


def test_batch_graphs_are_kept_to_a_limit(engine, monkeypatch):
    """More compositions than MAX_BATCH_GRAPHS: the oldest batch graphs go, the others stay (GraphCache.limit)."""
    dec = engine.decoder
    monkeypatch.setattr(dec, "graphs", InlineGraphs())
    monkeypatch.setattr(speculative, "MAX_BATCH_GRAPHS", 2)
    seqs = [dec.new_sequence() for _ in range(2)]
    for seq, p in zip(seqs, PROMPTS):
        dec.prefill(seq, p, GREEDY, 0)
    for drafts in ([0, 0], [7, 0], [0, 7], [7, 7]):
        launched = [dec.launch(seq, n, defer=True) for seq, n in zip(seqs, drafts)]
        dec.flush()
        for seq, step in zip(seqs, launched):
            dec.collect(seq, step)
    batch_keys = [key for key in dec.graphs.graphs if key[0] == "batch"]
    assert len(batch_keys) == 2 and dec.graphs.keys.count("batch") == 4  # four compositions captured, two kept
    # the last two kept: each key holds (cache, n, T, oracle, sampling, project) per step after its two lengths
    assert [(key[3 + 1], key[3 + 6 + 1]) for key in batch_keys] == [(0, 7), (7, 7)]
    graphs = GraphCache.__new__(GraphCache)  # limit() on keys of several kinds
    graphs.graphs = {("step", 1): 1, ("batch", 1): 2, ("batch", 2): 3, ("batch", 3): 4}
    graphs.limit("batch", 1)
    assert list(graphs.graphs) == [("step", 1), ("batch", 3)]


def test_a_withdrawn_step_never_runs_and_collect_flushes_alone(engine):
    dec = engine.decoder
    a, b = dec.new_sequence(), dec.new_sequence()
    for seq, p in ((a, PROMPTS[0]), (b, PROMPTS[1])):
        dec.prefill(seq, p, GREEDY, 0)
    tokens_b, start_b = list(b.tokens), b.state.start.clone()
    step_a, step_b = dec.launch(a, 7, defer=True), dec.launch(b, 7, defer=True)
    dec.withdraw(step_b)
    dec.collect(a, step_a)  # runs what is deferred: a's step alone
    assert not step_a.deferred and step_b.deferred
    assert b.tokens == tokens_b and torch.equal(b.state.start, start_b)
    assert a.tokens[len(PROMPTS[0]):] == _alone(engine, PROMPTS[0], GREEDY, 7)[:len(a.tokens) - len(PROMPTS[0])]


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_streams_yield_their_launched_steps_and_give_the_same_text(engine, graphed, monkeypatch):
    """batch_steps: the stream yields StepLaunched before collecting each step, and its result is the plain
    stream's; two streams advanced in turn with one flush a round give each its own result. A stream keeps one
    deferred step at a time; graphed, a flushed step is queued (its result collected later) and the stream
    launches its next step behind it before collecting it, as pipelined steps do (a step launched finds the one
    before still in flight, except near the end, where the next step waits to draft only what is left); eagerly
    the flush runs each step to the end."""
    params = SamplingParams(temperature=0.0, max_tokens=24)
    if graphed:
        monkeypatch.setattr(engine.decoder, "graphs", InlineGraphs())
        assert engine.decoder.pipelines(params)
    plain = [engine.generate(p, params, 7) for p in PROMPTS[:2]]
    seqs = [engine.new_sequence() for _ in PROMPTS[:2]]
    streams = [engine.stream(p, params, 7, sequence=seq, batch_steps=True) for p, seq in zip(PROMPTS[:2], seqs)]
    results, launched, behind_one_in_flight = [None, None], 0, 0
    while any(r is None for r in results):
        waiting = []
        for i, s in enumerate(streams):
            if results[i] is not None:
                continue
            event = next(s)
            if isinstance(event, StepLaunched):
                assert len(engine.decoder._deferred) == len(waiting) + 1  # this stream's one step
                behind_one_in_flight += seqs[i].in_flight > 0
                waiting.append(i)
            elif hasattr(event, "finish_reason"):
                results[i] = event
        launched += len(waiting)
        assert engine.decoder.flush() == len(waiting)
    assert launched > 0
    if graphed:
        assert behind_one_in_flight > 0
    else:
        assert behind_one_in_flight == 0
    assert [r.tokens for r in results] == [p.tokens for p in plain]
    assert [r.stats.draft_n for r in results] == [p.stats.draft_n for p in plain]


def test_a_failed_batched_step_is_each_requests_error_and_the_next_one_runs(engine, monkeypatch):
    """A failure inside the batched pass does not escape flush (the server's worker goes on): each step's collect
    raises it, and the decoder's next steps run."""
    dec = engine.decoder
    seqs = [dec.new_sequence() for _ in range(2)]
    for seq, p in zip(seqs, PROMPTS):
        dec.prefill(seq, p, GREEDY, 0)
    target = dec.target

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory (planted)")

    monkeypatch.setattr(target, "forward_segments", broken)
    launched = [dec.launch(seq, 7, defer=True) for seq in seqs]
    dec.flush()
    for seq, step in zip(seqs, launched):
        assert not step.deferred
        with pytest.raises(RuntimeError, match="planted"):
            dec.collect(seq, step)
    monkeypatch.undo()
    fresh = dec.new_sequence()
    dec.prefill(fresh, PROMPTS[0], GREEDY, 0)
    dec.collect(fresh, dec.launch(fresh, 7, defer=True))
    assert fresh.tokens[len(PROMPTS[0]):] == _alone(engine, PROMPTS[0], GREEDY, 7)[:len(fresh.tokens) - len(PROMPTS[0])]


def test_the_scheduler_prices_drafting_for_the_slots_stepping_together(engine, monkeypatch):
    """Each round, the busy slots' draft policies learn how many streams step together (their batched step's cost
    of drafting): the busy slots' count where steps batch, one where slots step in turn or alone."""
    pytest.importorskip("fastapi")
    from flashdraft.server.scheduler import Scheduler

    scheduler = Scheduler(engine, 3, None, metrics=None)
    scheduler._price_drafts(scheduler.slots[:2])
    assert [slot.policy.streams for slot in scheduler.slots] == [2, 2, 1]
    assert scheduler.slots[0].policy.step_cost() == engine.draft_cost(2)
    monkeypatch.setattr(engine.decoder, "batches", False)  # slots stepping in turn (a GGUF model on the GPU)
    scheduler._price_drafts(scheduler.slots)
    assert [slot.policy.streams for slot in scheduler.slots] == [1, 1, 1]
    monkeypatch.undo()
    alone = Scheduler(engine, 1, None, metrics=None)
    alone._price_drafts(alone.slots)
    assert alone.slots[0].policy.streams == 1
    # policies drafting on their estimates: one length for the round's drafting steps, the batch's (batch_length)
    from flashdraft.engine.generator import batch_length
    from test_adaptive import Steady, serve_requests

    for slot, run in zip(scheduler.slots, (6, 3, 4)):
        serve_requests(slot.policy, 1, 48, Steady(run))
    scheduler._price_drafts(scheduler.slots)
    drafting = [slot.policy for slot in scheduler.slots if slot.policy.mode == "on"]
    assert len(drafting) >= 2 and {p.length for p in drafting} == {batch_length(drafting)} != {None}
    scheduler._price_drafts(scheduler.slots[:1])
    assert scheduler.slots[0].policy.batch_length is None


def test_a_stream_asks_before_each_launch_whether_to_defer(engine, monkeypatch):
    """batch_steps as a function (a server's: more than one slot busy): a stream alone keeps its graphed steps
    pipelined, defers them once others step beside it (a pipelined step still in flight is collected first), and
    gives the plain stream's tokens throughout."""
    dec = engine.decoder
    monkeypatch.setattr(dec, "graphs", InlineGraphs())
    params = SamplingParams(temperature=0.0, max_tokens=40)
    plain = engine.generate(PROMPTS[0], params, 7)
    asked = []

    def others_busy() -> bool:  # alone for the first launches, then beside other streams
        asked.append(len(asked) >= 4)
        return asked[-1]

    events, launched = [], 0
    for event in engine.stream(PROMPTS[0], params, 7, sequence=engine.new_sequence(), batch_steps=others_busy):
        if isinstance(event, StepLaunched):
            launched += 1
            dec.flush()
        events.append(event)
    assert events[-1].tokens == plain.tokens
    assert launched > 0 and len(asked) > launched and asked[:4] == [False] * 4
    assert "step" in dec.graphs.keys and "batch" in dec.graphs.keys


class _Posts:
    """A stand-in event loop for the scheduler's jobs: every event posted, in order; `done` once `expected` results
    came."""

    def __init__(self, expected: int):
        self.events, self.done, self.expected = [], threading.Event(), expected

    def call_soon_threadsafe(self, put, event):
        self.events.append((put.__self__, event))
        if sum(kind == "result" for _, (kind, *_rest) in self.events) == self.expected:
            self.done.set()


def test_a_servers_slots_step_batched_and_pipelined_under_graphs(engine, monkeypatch):
    """The scheduler's rounds where graphs are on (InlineGraphs): three requests on three slots, their steps run
    batched (one flush a round) and pipelined (a slot's next step launched behind its flushed one before that one
    is collected), each request's tokens those it gets alone."""
    pytest.importorskip("fastapi")
    from flashdraft.server.requests import GenerationRequest, Job
    from flashdraft.server.scheduler import Scheduler
    from test_prefill_chunks import _NoMetrics

    dec = engine.decoder
    monkeypatch.setattr(dec, "graphs", InlineGraphs())
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    alone = [engine.generate(p, params, 7, sequence=engine.new_sequence()).tokens for p in PROMPTS[:3]]
    behind_in_flight, flush = [], dec.flush

    def watched_flush():
        behind_in_flight.append(sum(d.seq.in_flight > 0 for d in dec._deferred))
        return flush()

    monkeypatch.setattr(dec, "flush", watched_flush)

    class Captures(_NoMetrics):  # what /metrics' graph_captures is told after each round
        seen: dict = {}

        def on_graph_captures(self, captured):
            Captures.seen = dict(captured)

    posts = _Posts(3)
    scheduler = Scheduler(engine, 3, 7, Captures())
    scheduler.start()
    try:
        jobs = [Job(GenerationRequest(p, params, None, 0, True, False, "m", "", cache_prompt=False), posts)
                for p in PROMPTS[:3]]
        for job in jobs:
            scheduler.submit(job)
        assert posts.done.wait(120)
    finally:
        scheduler.stop()
        scheduler.join(10)
    for job, expected in zip(jobs, alone):
        tokens = [t for queue, (kind, payload, _) in posts.events if queue is job.events and kind == "delta"
                  for t in payload.token_ids]
        assert tokens == expected
    assert max(behind_in_flight) >= 2  # rounds where several slots' steps went in behind their flushed ones
    assert Captures.seen == dict(dec.graphs.captured) and Captures.seen["batch"] > 0


def test_metrics_count_graph_captures_by_kind():
    prometheus_client = pytest.importorskip("prometheus_client")
    from flashdraft.server.app import ServerMetrics

    metrics = ServerMetrics()
    metrics.on_graph_captures({"batch": 3, "step": 1})
    metrics.on_graph_captures({"batch": 5, "step": 1, "prefill": 2})
    text = prometheus_client.generate_latest(metrics.registry).decode()
    for kind, total in (("batch", 5), ("step", 1), ("prefill", 2)):
        assert f'flashdraft:graph_captures_total{{kind="{kind}"}} {total:.1f}' in text


def test_a_stream_whose_queued_batched_step_failed_raises_without_launching_more(engine, monkeypatch):
    """Graphed, a flushed step is queued and the stream would launch its next one behind it; when the batched
    step failed instead, the stream raises its error at once (nothing more launched for a request that ends)."""
    dec = engine.decoder
    monkeypatch.setattr(dec, "graphs", InlineGraphs())

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory (planted)")

    params = SamplingParams(temperature=0.0, max_tokens=24)
    streams = [engine.stream(p, params, 7, sequence=engine.new_sequence(), batch_steps=True) for p in PROMPTS[:2]]
    for s in streams:
        next(s)  # the prefill's token
        assert isinstance(next(s), StepLaunched)
    monkeypatch.setattr(dec.target, "forward_segments", broken)
    assert dec.flush() == 2
    for s in streams:
        with pytest.raises(RuntimeError, match="planted"):
            next(s)
    assert dec._deferred == []
