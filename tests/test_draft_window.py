"""--spec-dflash-cross-ctx N: the drafter sees only the last N committed tokens, its context cache a ring of
N + block rows (models.kv_cache.WindowKVCache)."""
import pytest
import torch

from flashdraft.config import SamplingParams
from flashdraft.engine.generator import Engine
from flashdraft.models.kv_cache import KVCache, WindowKVCache
from flashdraft.bench.oracle import PlantedOracle
from test_lossless import InlineGraphs, _prompts, logging_oracle, without_warm_up_repeats
from tiny_models import build_drafter

BLOCK = 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory, qwen3_dir):
    return qwen3_dir, build_drafter(tmp_path_factory.mktemp("window") / "d", qwen3_dir, block_size=BLOCK, seed=3)


def _engine(pair, window, graphed=False):
    target, drafter = pair
    engine = Engine.load(target, drafter, device="cpu", context_size=256, draft_window=window)
    if graphed:
        engine.decoder.graphs = InlineGraphs()
    return engine


def _logging_sequence(engine):
    """A new sequence whose oracle changes nothing and logs the drafter's own guesses at every drafted step (start,
    guesses), and that log."""
    log = []
    return engine.new_sequence(oracle=logging_oracle(log)), log


def _own_guesses(engine, prompt, params, logged=None, reuse_prefix=False):
    """The tokens and the drafter's own guesses at every drafted step (start, guesses) of a generation in `logged`
    (a _logging_sequence, holding a conversation to reuse), or in a new sequence."""
    seq, log = logged if logged is not None else _logging_sequence(engine)
    log.clear()
    result = [e for e in engine.stream(prompt, params, BLOCK - 1, sequence=seq, reuse_prefix=reuse_prefix)][-1]
    return result.tokens, without_warm_up_repeats(log)


@pytest.mark.parametrize("window", [5, 24])
def test_window_drafter_sees_exactly_the_last_n_positions(pair, window):
    """After a prompt longer than the window, the windowed drafter's block outputs equal those of an unlimited
    cache holding only positions [start - N, start) of the same context (rows hidden by a mask)."""
    engine = _engine(pair, window)
    dec = engine.decoder
    prompt = [t for p in _prompts(dec.target.config.vocab_size, 16, seed=2) for t in p][:80]  # past the window
    assert len(prompt) > window + BLOCK
    seq = dec.new_sequence()
    with torch.inference_mode():
        dec.prefill(seq, prompt, SamplingParams(max_tokens=4), 0)  # projects the prompt's context
        start = len(seq.tokens) - 1
        assert isinstance(seq.draft_cache, WindowKVCache) and seq.projected == start == len(prompt)
        block = torch.cat([torch.tensor(seq.tokens[-1:]), dec._mask_tail_tokens()])
        positions = torch.arange(start, start + BLOCK)
        embeds = dec.target.embed(block)
        ring = seq.draft_cache
        got = dec.drafter(embeds, positions, ring, ring.kv_len(start + BLOCK))
        assert ring.capacity == window + BLOCK and ring.kv_len(start + BLOCK) == window + BLOCK

        _, taps = dec.target(torch.tensor(prompt), torch.arange(len(prompt)), dec.target.new_cache(300), len(prompt),
                             dec.tap_ids)
        full = dec.drafter.new_cache(300)
        assert type(full) is KVCache
        dec.drafter.add_context(taps[start - window:], torch.arange(start - window, start), full)
        keys = torch.arange(start + BLOCK)
        mask = (keys >= start - window)[None, :]
        want = dec.drafter(embeds, positions, full, start + BLOCK, mask)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [1, 3, 16, 10_000])
@pytest.mark.parametrize("graphed", [False, True])
def test_greedy_dflash_with_a_window_equals_plain_decoding(pair, window, graphed):
    """Any window, smaller than a block or larger than the context, eager or through the graphed paths: the
    target's tokens, and the drafter still drafts (an oracle's planted guesses are all accepted)."""
    engine = _engine(pair, window, graphed)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    seq = engine.decoder.new_sequence()
    assert isinstance(seq.draft_cache, WindowKVCache) == (window < 256)
    if window < 256:
        assert seq.draft_cache.nbytes() < engine.decoder.drafter.new_cache(engine.decoder.capacity).nbytes()
    for prompt in _prompts(engine.decoder.target.config.vocab_size, 2, seed=7):
        base = engine.generate(prompt, params, draft=0).tokens
        tokens, guesses = _own_guesses(engine, prompt, params)
        assert tokens == base and len(guesses) > 3
        vocab = engine.decoder.target.config.vocab_size
        planted = engine.new_sequence(oracle=PlantedOracle(prompt + base, lambda s: BLOCK - 1, vocab, "cpu"))
        out = engine.generate(prompt, params, draft=BLOCK - 1, sequence=planted)
        assert out.tokens == base and out.stats.draft_n_accepted == out.stats.draft_n > 0


def test_the_graphed_paths_draft_what_the_eager_loop_drafts(pair):
    """The ring through the graphed draft pass and the pipelined step (context rows projected inside the graph,
    padding rows on the block's positions) gives the eager loop's guesses at every step, wrapping many times."""
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    eager, graphed = _engine(pair, 6), _engine(pair, 6, graphed=True)
    prompt = _prompts(eager.decoder.target.config.vocab_size, 1, seed=9)[0]
    assert _own_guesses(graphed, prompt, params) == _own_guesses(eager, prompt, params)


def test_prefix_reuse_keeps_the_ring_and_hides_its_stale_rows(pair):
    """A conversation's next turn (the prompt extends the last one) reuses the ring, and drafts exactly what a fresh
    sequence drafts. A prompt that leaves the conversation before the ring's window (its rows overwritten since)
    still reuses the target's rows: the output is a fresh sequence's, and every ring row a draft pass can see holds
    a position of the new sequence with the keys an unlimited drafter cache gives that position."""
    engine = _engine(pair, 6)
    dec = engine.decoder
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    first = _prompts(dec.target.config.vocab_size, 1, seed=4)[0]
    logged = _logging_sequence(engine)
    seq = logged[0]
    out = engine.generate(first, params, draft=BLOCK - 1, sequence=seq).tokens
    follow = first + out + [5, 6, 7]
    fresh = _engine(pair, 6)
    want = _own_guesses(fresh, follow, params)
    got = _own_guesses(engine, follow, params, logged, reuse_prefix=True)
    assert seq.reused > len(first) and got == want
    assert dec.reusable_rows(seq, seq.tokens) == len(seq.tokens) - 1  # all of it, the ring's window included

    early = len(seq.tokens) - 1 - 6 - BLOCK - 2  # its window's rows were overwritten since
    assert not bool((seq.draft_cache.ring_pos == early - 1).any())
    leaves = seq.tokens[:early] + [1, 2, 3]
    assert dec.reusable_rows(seq, leaves) == early
    tokens, _ = _own_guesses(engine, leaves, params, logged, reuse_prefix=True)
    assert seq.reused == early and tokens == _own_guesses(_engine(pair, 6), leaves, params)[0]

    unlimited = _engine(pair, None)
    full = unlimited.decoder.new_sequence()
    unlimited.generate(leaves, params, draft=BLOCK - 1, sequence=full)
    assert full.tokens == seq.tokens
    with torch.inference_mode():  # the committed rows still waiting, projected
        dec._flush_context(seq)
        unlimited.decoder._flush_context(full)
    ring, held = seq.draft_cache, seq.draft_cache.ring_pos
    assert full.projected == seq.projected == len(seq.tokens) - 1
    # what the next draft pass (its block at positions projected .. projected + B - 1) sees, less its own rows
    seen = (ring.visible(ring.capacity, torch.tensor(seq.projected + BLOCK - 1))[0] & (held < seq.projected))
    seen = seen.nonzero().flatten()
    assert len(seen) > 6 // 2
    for layer in range(len(ring.k)):
        assert torch.allclose(ring.k[layer][:, seen], full.draft_cache.k[layer][:, held[seen]], atol=1e-5)
        assert torch.allclose(ring.v[layer][:, seen], full.draft_cache.v[layer][:, held[seen]], atol=1e-5)


def test_a_window_needs_a_drafter_and_a_positive_size(qwen3_dir, pair):
    with pytest.raises(ValueError, match="cross-ctx"):
        Engine.load(qwen3_dir, None, device="cpu", context_size=64, draft_window=8)
    with pytest.raises(ValueError, match="cross-ctx"):
        _engine(pair, 0)


def test_a_drafter_takes_the_default_window_and_zero_is_all_of_the_context(tmp_path, capsys):
    from flashdraft.cli import main
    from flashdraft.config import DRAFT_WINDOW
    from flashdraft.server.cli import build_parser, settings_from_args

    (tmp_path / "config.json").write_text("{}")  # only the flags are parsed; no model is loaded

    def window(*flags):
        args = build_parser().parse_args(["-m", str(tmp_path), *flags])
        return settings_from_args(args).cache_options["draft_window"]

    assert window("-md", str(tmp_path)) == DRAFT_WINDOW == 1024
    assert window("-md", str(tmp_path), "-cd", "0") is None
    assert window("-md", str(tmp_path), "--spec-dflash-cross-ctx", "64") == 64
    assert window() is None  # no drafter, no window
    assert window("-cd", "0") is None
    with pytest.raises(SystemExit):
        main(["generate", "-p", "x", "--spec-dflash-cross-ctx", "-1"])
    assert "--spec-dflash-cross-ctx" in capsys.readouterr().err


def test_an_evicted_conversation_brings_its_ring_back_from_host_memory(pair):
    """The host prompt cache (--cache-ram) keeps a window cache's whole ring and the positions it holds: a
    conversation that comes back drafts what a fresh sequence drafts."""
    from flashdraft.server.scheduler import PromptCache

    engine = _engine(pair, 6)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    vocab = engine.decoder.target.config.vocab_size
    first, other = _prompts(vocab, 2, seed=12)
    logged, cache = _logging_sequence(engine), PromptCache(engine.decoder, None)
    slot = logged[0]
    out = [e for e in engine.stream(first, params, BLOCK - 1, sequence=slot)][-1].tokens
    assert cache.save(slot)
    [e for e in engine.stream(other + other, params, BLOCK - 1, sequence=slot)]  # overwrites the slot's ring
    follow = first + out + [9, 10]
    restored = cache.restore(slot, follow, engine.decoder.reusable_rows(slot, follow))
    assert restored == len(first) + len(out) - 1
    want = _own_guesses(_engine(pair, 6), follow, params)
    assert _own_guesses(engine, follow, params, logged, reuse_prefix=True) == want and slot.reused == restored


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_a_quantized_draft_cache_in_a_ring(kv_type):
    """-ctkd/-ctvd with a window (the demo pair: its head size takes the block types): quantized rows written at
    ring rows, and greedy DFlash still equals plain decoding while the ring wraps, with drafts accepted."""
    from flashdraft.demo import DEMO_DIR

    engine = Engine.load(DEMO_DIR / "target", DEMO_DIR / "drafter", device="cpu", context_size=512, draft_window=24,
                         draft_cache_type_k=kv_type, draft_cache_type_v=kv_type)
    seq = engine.decoder.new_sequence()
    assert isinstance(seq.draft_cache, WindowKVCache) and seq.draft_cache.k[0].dtype == torch.uint8
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    prompt = engine.encode_prompt(prompt="def fibonacci(n):\n")
    plain = engine.generate(prompt, params, draft=0)
    drafted = engine.generate(prompt, params, draft=engine.max_draft)
    assert drafted.tokens == plain.tokens and drafted.stats.draft_n_accepted > 0
    assert len(prompt) + len(plain.tokens) > 24 + engine.decoder.block_size  # the ring wrapped
