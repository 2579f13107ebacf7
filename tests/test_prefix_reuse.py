"""Prefix reuse: a prompt that shares a prefix with what a sequence's caches hold (a chat's earlier turns) runs only
the rest, and generates what a cold sequence generates; the drafter's context is reused with the target's."""
import random

import pytest

from flashdraft.config import SamplingParams
from flashdraft.demo import DEMO_DIR
from flashdraft.engine.generator import Engine
from flashdraft.engine.speculative import shared_prefix
from test_gemma4_tiny import build_gemma4_target

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


def run(engine, prompt, sequence, reuse=True, draft=None, params=GREEDY):
    """The generation's result (Engine.generate with prefix reuse)."""
    *_, result = engine.stream(prompt, params, draft=draft, sequence=sequence, reuse_prefix=reuse)
    return result


@pytest.fixture(scope="module")
def demo():
    return Engine.load(DEMO_DIR / "target", DEMO_DIR / "drafter", device="cpu")


def conversation(engine):
    return engine.encode_prompt(messages=[{"role": "user", "content": "Write a function that parses a CSV line."}])


def test_a_chat_turn_runs_only_its_new_tokens_and_matches_a_cold_run(demo):
    warm = demo.new_sequence()
    turn1 = conversation(demo)
    r1 = run(demo, turn1, warm, draft=demo.max_draft)
    assert r1.stats.cache_n == 0 and r1.stats.prompt_n == len(turn1)
    held = list(warm.tokens)  # turn 1 and its output, and the guesses its last step committed past max_tokens
    turn2 = turn1 + r1.tokens + demo.tokenizer.encode("\nNow add type hints.\n", add_special_tokens=False)
    r2 = run(demo, turn2, warm, draft=demo.max_draft)
    cold = run(demo, turn2, demo.new_sequence(), reuse=False, draft=demo.max_draft)
    assert r2.tokens == cold.tokens
    # every committed token the new prompt shares was run into the caches but the sequence's last (the last one
    # never is): all of turn 1 and its output, the output's last token too where the last step committed past it
    assert r2.stats.cache_n == min(shared_prefix(held, turn2), len(held) - 1) >= len(turn1) + len(r1.tokens) - 1
    assert r2.stats.prompt_n == len(turn2) - r2.stats.cache_n and r2.stats.timings()["cache_n"] == r2.stats.cache_n
    # the drafter's context was reused too: its guesses, and so what was accepted, are a cold run's
    assert (r2.stats.draft_n, r2.stats.draft_n_accepted) == (cold.stats.draft_n, cold.stats.draft_n_accepted)
    assert r2.stats.draft_n_accepted > 0


def test_a_prompt_that_diverges_mid_prefix_reuses_up_to_the_divergence(demo):
    seq = demo.new_sequence()
    base = conversation(demo)
    run(demo, base, seq, draft=demo.max_draft)
    cut = len(base) - 5
    branch = base[:cut] + demo.tokenizer.encode("a JSON line instead", add_special_tokens=False)
    assert branch[cut] != base[cut]
    warm = run(demo, branch, seq, draft=demo.max_draft)
    cold = run(demo, branch, demo.new_sequence(), reuse=False, draft=demo.max_draft)
    assert warm.stats.cache_n == cut and warm.tokens == cold.tokens
    again = run(demo, branch, seq, draft=0)  # the same prompt again: all but its last token
    assert again.stats.cache_n == len(branch) - 1 and again.tokens == cold.tokens


def test_reuse_off_runs_the_whole_prompt(demo):
    seq = demo.new_sequence()
    prompt = conversation(demo)
    run(demo, prompt, seq)
    assert run(demo, prompt, seq, reuse=False).stats.cache_n == 0


def test_sampled_generation_reuses_and_matches(demo):
    params = SamplingParams(max_tokens=30, temperature=0.8, top_k=40, seed=11, ignore_eos=True)
    seq = demo.new_sequence()
    prompt = conversation(demo)
    first = run(demo, prompt, seq, params=params)
    follow = prompt + first.tokens + demo.tokenizer.encode("\nAgain.\n", add_special_tokens=False)
    warm = run(demo, follow, seq, params=params)
    cold = run(demo, follow, demo.new_sequence(), reuse=False, params=params)
    assert warm.stats.cache_n > len(prompt) and warm.tokens == cold.tokens


def test_a_prefix_copied_from_another_sequence(demo):
    system = conversation(demo)
    source = demo.new_sequence()
    r = run(demo, system, source, draft=demo.max_draft)
    other = system + demo.tokenizer.encode(" and a header row", add_special_tokens=False)
    rows = demo.decoder.reusable_rows(source, other)
    assert rows == len(system)  # the whole system prompt: source's caches run past it
    dst = demo.new_sequence()
    demo.decoder.copy_prefix(dst, source, rows)
    warm = run(demo, other, dst, draft=demo.max_draft)
    cold = run(demo, other, demo.new_sequence(), reuse=False, draft=demo.max_draft)
    assert warm.stats.cache_n == rows > 0 and warm.tokens == cold.tokens
    assert warm.stats.draft_n_accepted == cold.stats.draft_n_accepted
    assert r.tokens  # the source generated, so its caches held more than the shared prefix


def test_random_turns_on_a_tiny_pair(engine):
    """Tiny random target and drafter: many branch points, plain and DFlash, each equal to a cold run."""
    rng = random.Random(3)
    vocab = engine.decoder.target.config.vocab_size
    seq = engine.new_sequence()
    history = [rng.randrange(vocab) for _ in range(20)]
    for turn in range(6):
        draft = engine.max_draft if turn % 2 else 0
        warm = run(engine, history, seq, draft=draft)
        cold = run(engine, history, engine.new_sequence(), reuse=False, draft=draft)
        assert warm.tokens == cold.tokens, turn
        keep = rng.randrange(len(history) // 2, len(history) + len(warm.tokens))
        history = (history + warm.tokens)[:keep] + [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]


def test_gemma4_ring_keeps_a_prefix_only_while_its_window_is_held(tmp_path):
    folder, _ = build_gemma4_target(tmp_path / "g", window=8)
    engine = Engine.load(folder, None, device="cpu", context_size=256)
    rng = random.Random(0)
    vocab = engine.decoder.target.config.vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(30)]
    seq = engine.new_sequence()
    first = run(engine, prompt, seq, draft=0)
    follow = prompt + first.tokens + [5, 6, 7]
    warm = run(engine, follow, seq, draft=0)
    cold = run(engine, follow, engine.new_sequence(), reuse=False, draft=0)
    assert warm.stats.cache_n == len(prompt) + len(first.tokens) - 1 and warm.tokens == cold.tokens
    # 40 tokens past a 30-token branch point: the sliding ring (8 + overhang rows) no longer holds its window
    seq2 = engine.new_sequence()
    long_run = run(engine, prompt, seq2, draft=0, params=SamplingParams(max_tokens=120, ignore_eos=True))
    assert len(long_run.tokens) == 120
    branch = prompt + [9, 9, 9]
    assert engine.decoder.reusable_rows(seq2, branch) == 0
    assert run(engine, branch, seq2, draft=0).tokens == run(engine, branch, engine.new_sequence(), False, 0).tokens


def test_shared_prefix_finds_the_first_difference_around_its_chunks():
    """shared_prefix compares chunks of tokens, then tokens: the first difference wherever it falls (in a chunk, on
    its edges, none at all) and whichever list is shorter."""
    import random


    rng = random.Random(0)
    a = [rng.randrange(5000) for _ in range(1000)]
    for at in (0, 1, 5, 255, 256, 257, 511, 512, 999):
        b = a[:at] + [a[at] + 1] + a[at + 1:]
        assert shared_prefix(a, b) == shared_prefix(b, a) == at
        assert shared_prefix(a, b, chunk=7) == at
    for cut in (0, 1, 256, 300, 1000):
        assert shared_prefix(a, a[:cut]) == shared_prefix(a[:cut], a) == cut
    assert shared_prefix(a, list(a)) == 1000 and shared_prefix([], a) == 0
