"""DFlash output equals the target's alone: greedy token ids, and sampled tokens under the same seed."""
import random

import pytest
import torch
import transformers

from flashdraft.config import SamplingParams
from flashdraft.engine.generator import Engine
from flashdraft.engine.oracle import PlantedOracle
from tiny_models import build_drafter


def _prompts(vocab, count, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(count)]


@pytest.fixture(scope="module")
def hf_model(qwen3_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(str(qwen3_dir), dtype=torch.float32).eval()


@pytest.mark.parametrize("block_size", [2, 3, 5, 8, 16])
def test_greedy_random_drafter_equals_baseline_and_transformers(tmp_path, qwen3_dir, hf_model, block_size):
    drafter = build_drafter(tmp_path / "d", qwen3_dir, block_size=block_size, seed=block_size)
    engine = Engine.load(qwen3_dir, drafter, device="cpu", context_size=256)
    eos = engine.eos_ids
    params = SamplingParams(max_tokens=48)
    for prompt in _prompts(engine.decoder.target.config.vocab_size, 6, seed=block_size):
        base = engine.generate(prompt, params, draft=0)
        dflash = engine.generate(prompt, params, draft=engine.max_draft)
        assert dflash.tokens == base.tokens
        assert engine.generate(prompt, params).tokens == base.tokens  # the default (adaptive) policy
        assert dflash.finish_reason == base.finish_reason
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False,
                                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
        ref = ref[:next((i for i, t in enumerate(ref) if t in eos), len(ref))]
        assert base.tokens == ref
        if base.finish_reason == "length":
            assert dflash.stats.steps < 48  # the loop really ran in blocks, not token by token


@pytest.mark.parametrize("pattern_name,pattern", [
    ("full", lambda s: 99),                      # every guess right: full blocks
    ("none", lambda s: 0),                       # first guess always wrong
    ("cycle", lambda s: s % 9),                  # every acceptance length 0..8
    ("random", lambda s: random.Random(s).randint(0, 15)),
])
def test_long_acceptance_with_oracle_drafter(engine, pattern_name, pattern):
    """A drafter whose guesses are the target's own continuation, with a planted mismatch: long and full blocks."""
    params = SamplingParams(max_tokens=90, ignore_eos=True)
    for prompt in _prompts(engine.decoder.target.config.vocab_size, 3, seed=7):
        base = engine.generate(prompt, params, draft=0)
        engine.decoder.oracle = PlantedOracle(prompt + base.tokens, pattern,
                                              engine.decoder.target.config.vocab_size, "cpu")
        try:
            out = engine.generate(prompt, params, draft=engine.max_draft)
        finally:
            engine.decoder.oracle = None
        assert out.tokens == base.tokens
        per_pos = out.stats.accepted_per_position
        if pattern_name == "full":
            assert out.stats.tau > engine.max_draft  # full blocks: B-1 accepted + 1 per step
            assert per_pos[engine.max_draft - 1] >= out.stats.steps - 2
        if pattern_name == "none":
            assert out.stats.draft_n_accepted == 0
        if pattern_name == "cycle":
            assert len(per_pos) == engine.max_draft  # acceptance reached the last draft position


def test_draft_length_changes_between_steps(engine):
    class Cycling:
        def __init__(self):
            self.i = 0

        def next_length(self, max_useful):
            self.i += 1
            return min(self.i % 9, max_useful)  # 0 (plain decoding) .. 8 (more than B-1: clamped)

        def record(self, drafted, accepted, seconds):
            pass

    params = SamplingParams(max_tokens=60, ignore_eos=True)
    for prompt in _prompts(engine.decoder.target.config.vocab_size, 4, seed=3):
        base = engine.generate(prompt, params, draft=0)
        out = engine.generate(prompt, params, draft=Cycling())
        assert out.tokens == base.tokens
        assert {0, 3, engine.max_draft} <= set(out.stats.draft_lengths)


def test_sampled_dflash_equals_baseline_for_same_seed(engine):
    """Sampling noise is keyed by (seed, position), so the drafter cannot change what is sampled."""
    vocab = engine.decoder.target.config.vocab_size
    for i, prompt in enumerate(_prompts(vocab, 5, seed=11)):
        params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, min_p=0.01, seed=1000 + i, max_tokens=40)
        base = engine.generate(prompt, params, draft=0)
        out = engine.generate(prompt, params, draft=engine.max_draft)
        assert out.tokens == base.tokens
        other = engine.generate(prompt, SamplingParams(temperature=0.9, seed=5000 + i, max_tokens=40), draft=0)
        assert other.tokens != base.tokens or len(base.tokens) < 3


def test_sampled_oracle_full_acceptance(engine):
    """With sampling, an oracle that proposes the seeded continuation is fully accepted and changes nothing."""
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=64, ignore_eos=True)
    prompt = [5, 6, 7, 8]
    base = engine.generate(prompt, params, draft=0)
    engine.decoder.oracle = PlantedOracle(prompt + base.tokens, lambda s: 99, engine.decoder.target.config.vocab_size, "cpu")
    try:
        out = engine.generate(prompt, params, draft=engine.max_draft)
    finally:
        engine.decoder.oracle = None
    assert out.tokens == base.tokens
    assert out.stats.tau > 6


def test_stats_are_consistent(engine):
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    out = engine.generate([1, 2, 3], params, draft=engine.max_draft)
    s = out.stats
    assert s.predicted_n == len(out.tokens) == 50
    # Every step commits accepted + 1 tokens; the prefill commits one more.
    assert s.draft_n_accepted + s.steps + 1 >= s.predicted_n
    assert s.tau == pytest.approx((s.draft_n_accepted + s.steps) / s.steps)
    assert sum(s.accepted_per_position) == s.draft_n_accepted
    assert s.draft_n == sum(n * c for n, c in s.draft_lengths.items())
    t = s.timings()
    assert t["predicted_n"] == 50 and t["prompt_n"] == 3
    assert t["draft_n"] == s.draft_n and t["draft_n_accepted"] == s.draft_n_accepted
    base = engine.generate([1, 2, 3], params, draft=0)
    assert "draft_n" not in base.stats.timings() and base.stats.tau == 1.0
