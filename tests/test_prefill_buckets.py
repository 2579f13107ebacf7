"""Prefill passes padded to buckets (SpeculativeDecoder's pad_prefill, config.prefill_buckets): the tokens, drafts
and reused rows of unpadded passes, with and without a drafter, across prefix reuse and the host prompt cache; no
padding where it would pass the cache's capacity or a Gemma 4 ring's overhang; a warm-up that runs each bucket."""
import random

import pytest
import torch

from flashdraft.config import PREFILL_CHUNK, SamplingParams, prefill_buckets
from flashdraft.demo import DEMO_DIR
from flashdraft.engine.cuda_graphs import bucket
from flashdraft.engine.generator import Engine
from flashdraft.server.scheduler import PromptCache
from flashdraft.engine.speculative import PREFILL_GRAPH_ROWS
from flashdraft.models.gemma4.model import RING_OVERHANG
from test_gemma4_tiny import build_gemma4_target, build_gemma_drafter
from test_lossless import InlineGraphs
from test_prefill_chunks import run

GEMMA_WINDOW = 8  # the tiny Gemma 4's sliding window: its rings hold GEMMA_WINDOW + RING_OVERHANG rows


def pass_sizes(engine) -> list[int]:
    """The row count of each target pass the engine runs from now on (a list that fills as it runs)."""
    sizes = []
    engine.decoder.target.register_forward_pre_hook(lambda _, args: sizes.append(len(args[0])))
    return sizes


def demo_pair(drafter: bool, pad: bool, chunk: int = PREFILL_CHUNK) -> Engine:
    return Engine.load(DEMO_DIR / "target", DEMO_DIR / "drafter" if drafter else None, device="cpu",
                       context_size=1024, prefill_chunk=chunk, pad_prefill=pad)


@pytest.fixture(scope="module")
def prompts():
    engine = Engine.load(DEMO_DIR / "target", None, device="cpu")
    ask = lambda text: engine.encode_prompt(messages=[{"role": "user", "content": text}])  # noqa: E731
    follow_up = engine.tokenizer.encode("\nNow add type hints to both.\n", add_special_tokens=False)
    return ask("Write a function that parses a CSV line, then one that writes it back, with tests for quoted "
               "fields, empty fields and a trailing newline."), ask("Write a class for a bounded queue."), follow_up


def test_the_buckets_and_where_they_are_on():
    assert prefill_buckets(2048) == (16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048)
    assert prefill_buckets(300) == (16, 32, 64, 128, 256, 300)  # the pass size itself is the last
    assert prefill_buckets(8) == (8,)
    assert demo_pair(False, None).decoder.prefill_buckets == ()  # off on the CPU unless asked for
    assert demo_pair(False, True, chunk=300).decoder.prefill_buckets == prefill_buckets(300)


@pytest.mark.parametrize("chunk", [PREFILL_CHUNK, 20])
@pytest.mark.parametrize("drafter", [True, False])
def test_padded_passes_give_the_tokens_and_drafts_of_unpadded_ones(prompts, drafter, chunk):
    prompt = prompts[0]
    padded, unpadded = demo_pair(drafter, True, chunk), demo_pair(drafter, False, chunk)
    sizes = pass_sizes(padded)
    draft = padded.max_draft if drafter else 0
    ours, reference = run(padded, prompt, draft=draft), run(unpadded, prompt, draft=draft)
    P = len(prompt)
    expected = [chunk] * (P // chunk) + [next(b for b in prefill_buckets(chunk) if b >= P % chunk)]
    assert P % chunk not in prefill_buckets(chunk) and sizes[:len(expected)] == expected
    assert ours.tokens == reference.tokens and ours.stats.prompt_n == P
    # the drafter's context is the prompt's alone: the same guesses, and as many accepted
    assert (ours.stats.draft_n, ours.stats.draft_n_accepted) == (reference.stats.draft_n,
                                                                reference.stats.draft_n_accepted)
    assert ours.stats.draft_n_accepted > 0 or not drafter
    # the first token's distribution is the prompt's last row's, not a filler row's
    first = [engine.generate(prompt, SamplingParams(max_tokens=1, logprobs=8), 0).logprobs[0].top
             for engine in (padded, unpadded)]
    assert [token for token, _ in first[0]] == [token for token, _ in first[1]]
    assert [value for _, value in first[0]] == pytest.approx([value for _, value in first[1]], abs=1e-4)


def test_the_caches_hold_the_prompt_as_unpadded_passes_leave_it(prompts):
    """After a padded prefill (max_tokens 1: nothing runs after it), the target's rows of the prompt and the
    drafter's whole ring (--spec-dflash-cross-ctx 4: 4 + a block of 16 rows, which the taps of the 20 filler rows
    padding 44 tokens to 64 would take over) are what unpadded passes leave."""
    prompt = prompts[0]
    seqs = []
    for pad in (True, False):
        engine = Engine.load(DEMO_DIR / "target", DEMO_DIR / "drafter", device="cpu", context_size=1024,
                             draft_window=4, pad_prefill=pad)
        sizes = pass_sizes(engine)
        seqs.append(engine.new_sequence())
        engine.generate(prompt, SamplingParams(max_tokens=1), 0, sequence=seqs[-1])
        assert sizes == [64 if pad else 44]
    padded, unpadded = seqs
    assert torch.equal(padded.draft_cache.ring_pos, unpadded.draft_cache.ring_pos)
    for ours, reference in zip(padded.draft_cache.k + padded.draft_cache.v,
                               unpadded.draft_cache.k + unpadded.draft_cache.v):
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
    for ours, reference in zip(padded.target_cache.k + padded.target_cache.v,
                               unpadded.target_cache.k + unpadded.target_cache.v):
        torch.testing.assert_close(ours[:, :len(prompt)], reference[:, :len(prompt)], rtol=1e-4, atol=1e-4)


def test_reused_prefixes_hold_only_real_rows(prompts):
    """A prompt whose first token came from a padded pass (max_tokens 1: the filler's rows are the last the caches
    got) is kept in the host prompt cache, then a longer prompt reuses it in the same sequence and, from the prompt
    cache, in another: the rows reused, the tokens and the drafts are those of unpadded passes, and the longer
    prompt's new tokens run as a padded pass too."""
    first, other, follow_up = prompts
    outcomes = []
    for pad in (True, False):
        engine = demo_pair(True, pad)
        sizes, draft, cache = pass_sizes(engine), engine.max_draft, PromptCache(engine.decoder, None)
        slot = engine.new_sequence()
        *_, opening = engine.stream(first, SamplingParams(max_tokens=1), draft=draft, sequence=slot,
                                    reuse_prefix=True)
        assert cache.save(slot)
        longer = first + opening.tokens + follow_up
        sizes.clear()
        again = run(engine, longer, slot, reuse=True, draft=draft)
        new = len(longer) - len(first)
        bucket = next(b for b in prefill_buckets(PREFILL_CHUNK) if b >= new)
        assert new != bucket and sizes[0] == (bucket if pad else new)
        run(engine, other, slot, reuse=True, draft=draft)  # overwrites the slot
        elsewhere = engine.new_sequence()
        restored = cache.restore(elsewhere, longer, 0)
        back = run(engine, longer, elsewhere, reuse=True, draft=draft)
        outcomes.append((again.stats.cache_n, again.tokens, again.stats.draft_n_accepted, restored, back.tokens,
                         back.stats.cache_n, back.stats.draft_n_accepted))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == outcomes[0][3] == len(first) and outcomes[0][4] == outcomes[0][1]


@pytest.mark.parametrize("drafter", [True, False])
def test_no_padding_past_the_capacity(qwen3_dir, drafter_dir, drafter):
    """Context 40 with a block of 8: 48 rows. A 30-token prompt pads to 32; a 36-token one would need 64 rows and
    runs as it is; both give the tokens of unpadded passes up to the full context."""
    load = lambda pad: Engine.load(qwen3_dir, drafter_dir if drafter else None, device="cpu",  # noqa: E731
                                   context_size=40, pad_prefill=pad)
    padded, unpadded = load(True), load(False)
    assert padded.decoder.capacity == 40 + (8 if drafter else 1)
    sizes = pass_sizes(padded)
    rng = random.Random(4)
    draft = padded.max_draft if drafter else 0
    for length, first_pass in ((30, 32), (36, 36)):
        prompt = [rng.randrange(3, padded.decoder.target.config.vocab_size) for _ in range(length)]
        sizes.clear()
        ours, reference = run(padded, prompt, draft=draft), run(unpadded, prompt, draft=draft)
        assert sizes[0] == first_pass
        assert ours.tokens == reference.tokens and len(ours.tokens) == 40 - length
        assert (ours.stats.draft_n, ours.stats.draft_n_accepted) == (reference.stats.draft_n,
                                                                    reference.stats.draft_n_accepted)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """Tiny Gemma 4 targets and drafters by the target's sliding window, built on first use."""
    built = {}

    def folders(window: int):
        if window not in built:
            target = build_gemma4_target(tmp_path_factory.mktemp("g"), window=window)[0]
            built[window] = target, build_gemma_drafter(tmp_path_factory.mktemp("gd"), target)
        return built[window]

    return folders


def gemma4_engine(gemma4, window: int, drafter: bool, pad: bool) -> Engine:
    target, draft_model = gemma4(window)
    return Engine.load(target, draft_model if drafter else None, device="cpu", context_size=400, prefill_chunk=256,
                       pad_prefill=pad)


# Prompts and the one pass each runs. Window 8, prompts past its ring (8 + RING_OVERHANG = 72 rows): padded up to
# the next bucket where the filler fits in the ring's overhang (a 192-token pass pads to 256 with exactly
# RING_OVERHANG rows), as they are where it would not (191 and 150 would need 65 and 106). Window 200 (a ring of
# 264 rows): filler past the overhang where the ring has not come round by the bucket's end (180 pads by 76).
RING_PROMPTS = {8: [(100, 128), (150, 150), (191, 191), (192, 256)], 200: [(129, 256), (180, 256)]}


@pytest.mark.parametrize("drafter", [False, True])
@pytest.mark.parametrize("window", sorted(RING_PROMPTS))
def test_gemma4_rings_take_filler_only_where_they_lose_nothing(gemma4, window, drafter):
    """RING_PROMPTS' passes, each giving the tokens and drafts of an unpadded pass."""
    padded, unpadded = gemma4_engine(gemma4, window, drafter, True), gemma4_engine(gemma4, window, drafter, False)
    assert padded.new_sequence().target_cache.ring == window + RING_OVERHANG
    sizes = pass_sizes(padded)
    rng = random.Random(5)
    draft = padded.max_draft if drafter else 0
    for length, first_pass in RING_PROMPTS[window]:
        prompt = [rng.randrange(3, padded.decoder.target.config.vocab_size) for _ in range(length)]
        sizes.clear()
        ours, reference = run(padded, prompt, draft=draft), run(unpadded, prompt, draft=draft)
        assert sizes[0] == first_pass
        assert ours.tokens == reference.tokens
        assert (ours.stats.draft_n, ours.stats.draft_n_accepted) == (reference.stats.draft_n,
                                                                    reference.stats.draft_n_accepted)


def test_gemma4_follow_ups_pad_into_a_ring_that_has_come_round(gemma4):
    """A conversation past the ring: each turn's new tokens run as one short padded pass (the rings written in
    place), their filler taking the ring slots of positions before the window; the turns reuse what unpadded turns
    reuse and give their tokens."""
    outcomes = []
    for pad in (True, False):
        engine = gemma4_engine(gemma4, GEMMA_WINDOW, False, pad)
        sizes = pass_sizes(engine)
        rng = random.Random(6)
        slot, text, turns = engine.new_sequence(), [], []
        for new in (90, 11, 21, 40):
            text = text + [rng.randrange(3, engine.decoder.target.config.vocab_size) for _ in range(new)]
            sizes.clear()
            result = run(engine, text, slot, reuse=True, draft=0)
            turns.append((result.stats.cache_n, result.tokens, sizes[0]))
            text = text + result.tokens
        outcomes.append(turns)
    assert [turn[:2] for turn in outcomes[0]] == [turn[:2] for turn in outcomes[1]]
    assert [turn[2] for turn in outcomes[0]] == [128, 16, 32, 64]  # the first prompt, then each turn's new tokens + 1
    assert outcomes[0][1][0] > GEMMA_WINDOW + RING_OVERHANG


def test_the_warm_up_runs_each_bucket_the_context_holds(qwen3_dir, drafter_dir):
    """Context 300, passes of up to 512: the buckets up to 256 each run once, and a first request's prompt pass is
    one of them; without buckets, on the CPU, there is nothing to warm up."""
    engine = Engine.load(qwen3_dir, drafter_dir, device="cpu", context_size=300, prefill_chunk=512, pad_prefill=True)
    sizes = pass_sizes(engine)
    seq = engine.new_sequence()
    assert engine.warm_up(seq) > 0
    assert sorted(sizes) == [16, 32, 64, 128, 256]
    assert seq.tokens == [] and engine.decoder.reusable_rows(seq, list(range(3, 40))) == 0
    sizes.clear()
    engine.warm_up(engine.new_sequence())  # another slot: the lengths are met (no graphs here to make per slot)
    assert sizes == []
    sizes.clear()
    prompt = [random.Random(7).randrange(3, engine.decoder.target.config.vocab_size) for _ in range(100)]
    run(engine, prompt, seq, draft=0)
    assert sizes[0] == 128
    assert Engine.load(qwen3_dir, drafter_dir, device="cpu", context_size=300).warm_up() is None


def test_short_padded_passes_replay_graphs_the_warm_up_captured(prompts):
    """With CUDA graphs (here the CPU stand-in), the warm-up captures one prefill graph per bucket of at most
    PREFILL_GRAPH_ROWS rows; a request's padded pass replays one and gives the tokens and drafts of eager unpadded
    passes; a pass no graph was captured for (a follow-up reading more rows than any) runs eagerly: a request never
    captures one."""
    engine, reference = demo_pair(True, True), demo_pair(True, False)
    graphs = engine.decoder.graphs = InlineGraphs()
    seq = engine.new_sequence()
    engine.warm_up(seq)
    captured = sorted(key[2:] for key in graphs.graphs if key[0] == "prefill")
    assert captured == [(rows, bucket(rows, engine.decoder.capacity)) for rows in prefill_buckets(PREFILL_CHUNK)
                        if rows <= PREFILL_GRAPH_ROWS]
    draft = engine.max_draft
    first, follow_up = prompts[0], prompts[0] + [7] * 300  # the follow-up's new rows: a pass of 512 reading 768
    for prompt in (first, follow_up):
        graphs.keys.clear()
        ours, theirs = run(engine, prompt, seq, reuse=True, draft=draft), run(reference, prompt, draft=draft)
        assert ours.tokens == theirs.tokens
        assert (ours.stats.draft_n, ours.stats.draft_n_accepted) == (theirs.stats.draft_n,
                                                                    theirs.stats.draft_n_accepted)
        assert graphs.keys.count("prefill") == (1 if prompt is first else 0)
    assert sorted(key[2:] for key in graphs.graphs if key[0] == "prefill") == captured


def test_a_prefill_that_cannot_be_captured_runs_eagerly(prompts):
    """A model whose prefill pass fails to capture (a host sync in it) warns once at the warm-up and prefills
    eagerly from then on, with the tokens of unpadded passes."""

    class FailingPrefillCapture(InlineGraphs):
        def run(self, key, fn, mutable=(), **inputs):
            if key[0] == "prefill" and key not in self.graphs:
                raise RuntimeError("operation not permitted when stream is capturing")
            return super().run(key, fn, mutable, **inputs)

    engine, reference = demo_pair(True, True), demo_pair(True, False)
    graphs = engine.decoder.graphs = FailingPrefillCapture()
    seq = engine.new_sequence()
    with pytest.warns(RuntimeWarning, match="could not be captured") as caught:
        engine.warm_up(seq)
    assert len([w for w in caught if "could not be captured" in str(w.message)]) == 1
    graphs.keys.clear()
    ours, theirs = run(engine, prompts[0], seq, draft=0), run(reference, prompts[0], draft=0)
    assert ours.tokens == theirs.tokens and "prefill" not in graphs.keys
