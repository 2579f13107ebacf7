"""The warm-up at load (llama-server's, --no-warmup to skip it): a short generation per slot that makes what the
loop makes on first use, and leaves nothing behind that a request could see."""
import logging
import threading

import pytest

from flashdraft.config import SamplingParams
from flashdraft.engine.generator import Engine
from flashdraft.server.cli import build_parser, settings_from_args
from test_lossless import InlineGraphs, _prompts


def test_warm_up_makes_the_graphs_and_leaves_the_sequence_as_new(qwen3_dir, drafter_dir):
    """Through the graphed paths (the CPU stand-in): the warm-up captures plain and drafting steps, greedy and
    with the given sampling settings, and afterwards the sequence holds nothing, so requests get what a cold
    engine gives them, greedy and sampled, with prefix reuse on."""
    warm = Engine.load(qwen3_dir, drafter_dir, device="cpu", context_size=256)
    warm.decoder.graphs = InlineGraphs()
    sampled = SamplingParams(temperature=0.7, top_k=20, top_p=0.95, min_p=0.0)
    seq = warm.new_sequence()
    assert warm.warm_up(seq, [sampled]) > 0
    keys = warm.decoder.graphs.graphs
    assert seq.tokens == [] and warm.decoder.reusable_rows(seq, list(range(40))) == 0
    # ("step", kv_len, draft_kv_len, cache, n, T, oracle, sampling, project)
    steps = [k for k in keys if k[0] == "step"]
    assert {k[4] for k in steps} >= {0, warm.max_draft}  # plain and full-block steps
    assert {k[-2] for k in steps} == {None, (0.7, 20, 0.95, 0.0)}  # greedy and the sampling settings' graphs
    # plain steps that leave their context rows waiting, and those that project a block's worth first
    assert {k[-1] for k in steps if k[4] == 0} == {False, True}
    cold = Engine.load(qwen3_dir, drafter_dir, device="cpu", context_size=256)
    vocab = cold.decoder.target.config.vocab_size
    reused = []
    for prompt in _prompts(vocab, 2, seed=3):
        for params in (SamplingParams(max_tokens=20, ignore_eos=True),
                       SamplingParams(max_tokens=20, temperature=0.7, top_k=20, top_p=0.95, seed=4, ignore_eos=True)):
            got = [e for e in warm.stream(prompt, params, sequence=seq, reuse_prefix=True)][-1]
            assert got.tokens == cold.generate(prompt, params, 0).tokens
            reused.append(got.stats.cache_n)
    assert reused[0] == 0 and reused[1] > 0  # nothing of the warm-up is reused; a request's own prompt is


def test_warm_up_without_a_sequence_warms_the_one_generate_uses(qwen3_dir, drafter_dir):
    """warm_up() warms the engine's own sequence, the one generate() runs in when given none: graphs are per
    sequence, and warming a new one left generate's first passes to capture (or run eagerly) what the warm-up made."""
    engine = Engine.load(qwen3_dir, drafter_dir, device="cpu", context_size=256)
    engine.decoder.graphs = InlineGraphs()

    def sequences():  # the caches the graphs were made for
        return {part for key in engine.decoder.graphs.graphs for part in key
                if isinstance(part, tuple) and part[:1] == ("tied",)}

    assert engine.warm_up() > 0
    warmed = sequences()
    assert warmed
    engine.generate(list(range(3, 40)), SamplingParams(max_tokens=8, ignore_eos=True), 0)
    assert sequences() == warmed


def test_the_server_warms_up_each_slot_where_there_is_something_to_make(qwen3_dir, drafter_dir, caplog):
    """--warmup is the default, --no-warmup turns it off; the scheduler warms every slot's sequence (graphs are
    per sequence) with the server's default sampling, in its worker thread (the thread that serves: CUDA's
    per-thread handles are made there) before that takes jobs; a CPU engine, with no graphs or compiled layers,
    skips it."""
    pytest.importorskip("fastapi")
    from flashdraft.server.scheduler import Scheduler
    from test_server_hardening import LiveServer

    assert settings_from_args(build_parser().parse_args([])).warmup is True
    assert settings_from_args(build_parser().parse_args(["--no-warmup"])).warmup is False
    engine = Engine.load(qwen3_dir, drafter_dir, device="cpu", context_size=256)
    scheduler = Scheduler(engine, 1, None, metrics=None)
    assert scheduler.start([]) is None  # no graphs, no compiled layers
    scheduler.stop()
    scheduler.join(10)
    engine.decoder.graphs = InlineGraphs()
    warmed_in, warm_up = [], engine.warm_up

    def recording_warm_up(*args):
        warmed_in.append(threading.current_thread())
        return warm_up(*args)

    engine.warm_up = recording_warm_up
    scheduler = Scheduler(engine, 2, None, metrics=None)
    try:
        assert scheduler.start([SamplingParams(temperature=0.8)]) > 0
        assert len(warmed_in) == 2 and set(warmed_in) == {scheduler._thread} and scheduler._thread.is_alive()
    finally:
        scheduler.stop()
        scheduler.join(10)
    tied = {key[3] for key in engine.decoder.graphs.graphs if key[0] == "step"}
    assert tied == {engine.decoder.graphs.lifetime_key(slot.sequence.target_cache) for slot in scheduler.slots}
    assert all(slot.sequence.tokens == [] and slot.requests == 0 for slot in scheduler.slots)
    with caplog.at_level(logging.INFO, logger="flashdraft.server"):
        srv = LiveServer(qwen3_dir, drafter_dir)
    try:
        assert srv.state.engine.decoder.graphs is None and not srv.state.engine.decoder.compiled
        assert not any("warmed up" in r.getMessage() for r in caplog.records)
    finally:
        srv.stop()


def test_a_failed_warm_up_fails_the_start_and_ends_the_worker(qwen3_dir):
    """An error in the worker's warm-up reaches the thread that loads the model (the server then ends with its
    message, as for any load failure) and no worker is left behind."""
    pytest.importorskip("fastapi")
    from flashdraft.server.scheduler import Scheduler

    engine = Engine.load(qwen3_dir, None, device="cpu", context_size=64)

    def failing_warm_up(*args):
        raise RuntimeError("out of memory in the warm-up")

    engine.warm_up = failing_warm_up
    scheduler = Scheduler(engine, 1, 0, metrics=None)
    with pytest.raises(RuntimeError, match="out of memory in the warm-up"):
        scheduler.start([])
    scheduler._thread.join(10)
    assert not scheduler._thread.is_alive()


def test_warm_up_fits_a_small_context(qwen3_dir, drafter_dir):
    """-c 8: the made-up prompt and the steps stay inside the context (a load must not fail on its warm-up)."""
    engine = Engine.load(qwen3_dir, drafter_dir, device="cpu", context_size=8)
    engine.decoder.graphs = InlineGraphs()
    assert engine.warm_up(engine.new_sequence()) > 0


def test_a_compiling_engine_warms_up_passes_over_a_prefix(qwen3_dir, drafter_dir, monkeypatch):
    """Where layers are compiled (CUDA), the warm-up also runs prefill passes that start past position 0, of two
    lengths past the fused path's rows (a compiled layer traces more keys than queries on first use), once per
    engine; the sequence is left as new and the output is a cold engine's."""
    engine = Engine.load(qwen3_dir, drafter_dir, device="cpu", context_size=256, pad_prefill=True)
    decoder = engine.decoder
    monkeypatch.setattr(decoder, "compiles", True)  # as on CUDA (compiling itself is the GPU run's to check)
    passes = []
    run_pass = decoder._prefill_pass
    monkeypatch.setattr(decoder, "_prefill_pass", lambda seq, tokens, begin, capture=False: (
        passes.append((begin, len(tokens))), run_pass(seq, tokens, begin, capture))[1])
    seq = engine.new_sequence()
    engine.warm_up(seq)
    over_a_prefix = [(begin, n) for begin, n in passes if begin > 0]
    first, second = [size for size in decoder.prefill_buckets if size > decoder.plan.max_rows][:2]
    assert over_a_prefix == [(first, first), (2 * first, second)]  # no graphs here: two sizes past the fused rows
    assert seq.tokens == [] and decoder.reusable_rows(seq, list(range(40))) == 0
    passes.clear()
    engine.warm_up(engine.new_sequence())
    assert all(begin == 0 for begin, _ in passes)  # once per engine
    prompt = _prompts(decoder.target.config.vocab_size, 1, seed=5)[0]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    cold = Engine.load(qwen3_dir, drafter_dir, device="cpu", context_size=256, pad_prefill=True)
    assert engine.generate(prompt, params, 0, sequence=seq).tokens == cold.generate(prompt, params, 0).tokens

