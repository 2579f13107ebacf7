"""DFlash output equals the target's alone: greedy token ids, and sampled tokens under the same seed."""
import gc
import random

from collections import Counter

import pytest
import torch
import transformers

from flashdraft.config import SamplingParams
from flashdraft.engine.cuda_graphs import GraphCache
from flashdraft.engine.generator import Engine
from flashdraft.bench.oracle import PlantedOracle
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
        oracle = PlantedOracle(prompt + base.tokens, pattern, engine.decoder.target.config.vocab_size, "cpu")
        out = engine.generate(prompt, params, draft=engine.max_draft, sequence=engine.new_sequence(oracle=oracle))
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
    oracle = PlantedOracle(prompt + base.tokens, lambda s: 99, engine.decoder.target.config.vocab_size, "cpu")
    out = engine.generate(prompt, params, draft=engine.max_draft, sequence=engine.new_sequence(oracle=oracle))
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


class EveryOtherStep:
    """A draft policy: plain steps and drafts of `length` in turn."""

    def __init__(self, length: int):
        self.length, self.steps = length, 0

    def next_length(self, cap: int) -> int:
        self.steps += 1
        return min(cap, self.length) if self.steps % 2 == 0 else 0

    def record(self, drafted: int, accepted: int, seconds: float) -> None:
        pass


class PlainThenDraft:
    """A draft policy: `plain` plain steps, then drafts of `length`."""

    def __init__(self, plain: int, length: int):
        self.plain, self.length, self.steps = plain, length, 0

    def next_length(self, cap: int) -> int:
        self.steps += 1
        return min(cap, self.length) if self.steps > self.plain else 0

    def record(self, drafted: int, accepted: int, seconds: float) -> None:
        pass


def logging_oracle(log: list):
    """An oracle that changes nothing: it appends each drafted step's (start, guesses) to `log`, the drafter's own
    guesses. It reads them on the host, so only the eager loop and InlineGraphs can run it, not a CUDA graph."""
    return lambda start, guesses: log.append((int(start), guesses.tolist())) or guesses


def without_warm_up_repeats(log: list) -> list:
    """A logging oracle's entries through InlineGraphs, less the one that each graph's capture warm-up adds (the
    same step logged twice in a row; real steps never repeat their start)."""
    return [entry for i, entry in enumerate(log) if i == 0 or entry != log[i - 1]]


class InlineGraphs(GraphCache):
    """A stand-in for engine.cuda_graphs.GraphCache that calls each pass directly (no CUDA here) but keeps the
    graph cache's contract: a first run of each key preceded by a warm-up run whose in-place state updates
    (`mutable`) are undone, inputs copied into per-key static buffers, the same output tensors returned
    (overwritten) at every replay of a key, and every earlier output garbage once any graph replays (the graphs
    share one memory pool, so a replay may write over another graph's outputs), so the graphed code paths of
    the loop run on the CPU and a loop that keeps an output too long fails. Keys and `lifetime_key` are
    GraphCache's own."""

    def __init__(self):
        self.graphs, self._tied, self.keys, self.captured = {}, {}, [], Counter()

    def run(self, key, fn, mutable=(), constants=None, **inputs):
        self.keys.append(key[0])
        with torch.inference_mode():
            for _, outs in self.graphs.values():
                for o in (outs if isinstance(outs, tuple) else (outs,)) if outs is not None else ():
                    if o is not None:
                        o.fill_(float("nan") if o.is_floating_point() else -(2 ** 40))
        if key not in self.graphs:
            # the capture's warm-up: fn runs once more on the inputs, and the state it updates in place is put back
            saved = [t.clone() for t in mutable]
            fixed = constants() if constants is not None else {}
            with torch.inference_mode():
                fn(**{k: v.clone() for k, v in inputs.items()}, **fixed)
            for t, before in zip(mutable, saved):
                t.copy_(before)
            self.graphs[key] = ({**{k: v.clone() for k, v in inputs.items()}, **fixed}, None)
            self.captured[key[0]] += 1
        static, outs = self.graphs[key]
        for k, v in inputs.items():
            static[k].copy_(v)
        fresh = fn(**static)
        if outs is None:
            outs = fresh
        else:
            for o, f in zip(outs if isinstance(outs, tuple) else (outs,), fresh if isinstance(fresh, tuple) else (fresh,)):
                if o is not None:
                    o.copy_(f)
        self.graphs[key] = (static, outs)
        return outs


def test_interleaved_pipelined_sequences(tmp_path, qwen3_dir):
    """Three sequences' pipelined generations advanced in turn, one event each, as the server's worker does: each
    gets the tokens it gets alone (their queued steps' results land in buffers of their own)."""
    drafter = build_drafter(tmp_path / "d", qwen3_dir, block_size=8, seed=3)
    engine = Engine.load(qwen3_dir, drafter, device="cpu", context_size=256)
    engine.decoder.graphs = InlineGraphs()
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts, drafts = _prompts(engine.decoder.target.config.vocab_size, 3, seed=5), (0, 7, 3)
    alone = [engine.generate(p, params, draft=d).tokens for p, d in zip(prompts, drafts)]
    streams = [engine.stream(p, params, draft=d, sequence=engine.new_sequence()) for p, d in zip(prompts, drafts)]
    results = [None] * 3
    while any(r is None for r in results):
        for i, stream in enumerate(streams):
            if results[i] is None:
                event = next(stream)
                if hasattr(event, "finish_reason"):
                    results[i] = event.tokens
    assert results == alone


def test_graphed_plain_steps_project_the_context_once_a_block(tmp_path, qwen3_dir):
    """With a drafter loaded, captured plain steps leave their context rows waiting and project them (a fixed
    shape: a block's rows) once every B steps instead of every step; a draft after a plain stretch longer than a
    block guesses what the eager loop's drafter guesses, so its context is complete."""
    drafter = build_drafter(tmp_path / "d", qwen3_dir, block_size=8, seed=3)
    eager = Engine.load(qwen3_dir, drafter, device="cpu", context_size=256)
    graphed = Engine.load(qwen3_dir, drafter, device="cpu", context_size=256)
    graphed.decoder.graphs = InlineGraphs()
    projections = []
    add_context = graphed.decoder.drafter.add_context
    graphed.decoder.drafter.add_context = lambda taps, *a: projections.append(taps.shape[0]) or add_context(taps, *a)
    greedy = SamplingParams(max_tokens=41, ignore_eos=True)
    prompt = _prompts(eager.decoder.target.config.vocab_size, 1, seed=13)[0]
    base = eager.generate(prompt, greedy, draft=0).tokens
    assert graphed.generate(prompt, greedy, draft=0).tokens == base
    # the prefill's, then one a block (40 plain steps: 5), plus the capture warm-up's run of each of the two plain
    # step graphs that project (the first of each KV bucket); every one of a block's rows
    assert len(projections) <= 1 + 40 // 8 + 2 and projections[1:] == [8] * (len(projections) - 1)
    seen = {"graphed": [], "eager": []}
    for name, engine in (("graphed", graphed), ("eager", eager)):
        seq = engine.new_sequence(oracle=logging_oracle(seen[name]))
        for plain in (3, 8, 13, 21):
            assert engine.generate(prompt, greedy, draft=PlainThenDraft(plain, 7), sequence=seq).tokens == base
    assert without_warm_up_repeats(seen["graphed"]) == seen["eager"] and len(seen["eager"]) > 8
    # the next turn of a chat finds the whole conversation in the caches, the drafter's context too, though rows
    # were still waiting and (graphed) a step had been queued past the end of the turn (its EOS)
    seen = {"graphed": [], "eager": []}
    for name, engine in (("graphed", graphed), ("eager", eager)):
        seq, eos_ids = engine.new_sequence(oracle=logging_oracle(seen[name])), engine.eos_ids
        engine.eos_ids = {base[24]}
        try:
            engine.generate(prompt, SamplingParams(max_tokens=41), draft=PlainThenDraft(12, 7), sequence=seq)
        finally:
            engine.eos_ids = eos_ids
        assert seq.tokens[-1] == base[24] and (seq.in_flight > 0) == (name == "graphed")
        seen[name].clear()  # the next turn's guesses only
        follow = seq.tokens + [7, 8, 9]
        *_, result = engine.stream(follow, greedy, draft=7, sequence=seq, reuse_prefix=True)
        assert result.stats.cache_n == len(follow) - 4
        assert result.tokens == eager.generate(follow, greedy, draft=0).tokens
    assert without_warm_up_repeats(seen["graphed"]) == seen["eager"]


def test_graphed_paths_equal_the_eager_loop(tmp_path, qwen3_dir):
    """The loop's graphed paths give the eager loop's tokens, greedy and sampled: the pipelined greedy steps (draft,
    verify and acceptance in one graph that advances the device state, the next step queued before the host
    reads this one's result, a step past an EOS dropped), greedy or sampled, and the path with the host between
    the passes (draft graph, verify graph)."""
    drafter = build_drafter(tmp_path / "d", qwen3_dir, block_size=8, seed=3)
    eager = Engine.load(qwen3_dir, drafter, device="cpu", context_size=256)
    graphed = Engine.load(qwen3_dir, drafter, device="cpu", context_size=256)
    graphed.decoder.graphs = InlineGraphs()
    queued_behind = []  # at each collect: did a later step already run on the device?
    collect = graphed.decoder.collect
    graphed.decoder.collect = lambda seq, launched: queued_behind.append(seq.in_flight > launched.drafted + 1) \
        or collect(seq, launched)
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    sampled = SamplingParams(max_tokens=30, temperature=0.9, seed=5, ignore_eos=True)
    for prompt in _prompts(eager.decoder.target.config.vocab_size, 3, seed=11):
        base = eager.generate(prompt, greedy, draft=0).tokens
        assert graphed.generate(prompt, greedy, draft=0).tokens == base
        vocab = eager.decoder.target.config.vocab_size
        out, ref = [engine.generate(prompt, greedy, draft=7, sequence=engine.new_sequence(
            oracle=PlantedOracle(prompt + base, lambda s: s % 5, vocab, "cpu"))) for engine in (graphed, eager)]
        assert out.tokens == base
        assert out.stats.draft_n_accepted == ref.stats.draft_n_accepted > 0  # the same guesses were accepted
        # the random drafter's own guesses, drafting every other step: the same as the eager loop's, so its
        # context (the taps that graphed verify and plain steps hand over) is the same too
        seen = {"graphed": [], "eager": []}
        for name, engine in (("graphed", graphed), ("eager", eager)):
            seq = engine.new_sequence(oracle=logging_oracle(seen[name]))
            assert engine.generate(prompt, greedy, draft=EveryOtherStep(7), sequence=seq).tokens == base
        assert without_warm_up_repeats(seen["graphed"]) == seen["eager"] and len(seen["eager"]) > 3
        assert graphed.generate(prompt, sampled, draft=7).tokens == eager.generate(prompt, sampled, draft=0).tokens
        # a request the host processes between the passes (draft graph, verify graph, host, acceptance)
        biased = SamplingParams(max_tokens=30, temperature=0.9, seed=5, ignore_eos=True, logit_bias={base[3]: 2.0})
        assert graphed.generate(prompt, biased, draft=7).tokens == eager.generate(prompt, biased, draft=0).tokens
        # an EOS in the middle: the step queued behind the one that found it is dropped, and the next request
        # (the same sequence, prefilled again) starts clean
        saved_eos = graphed.eos_ids, eager.eos_ids
        for engine in (graphed, eager):
            engine.eos_ids = {base[len(base) // 2]}
        try:
            stop = SamplingParams(max_tokens=40)
            for draft in (0, 7):
                out, ref = graphed.generate(prompt, stop, draft=draft), eager.generate(prompt, stop, draft=draft)
                assert out.tokens == ref.tokens == base[:base.index(base[len(base) // 2])]
                assert out.finish_reason == ref.finish_reason == "stop"
        finally:
            graphed.eos_ids, eager.eos_ids = saved_eos
    assert {"step", "target", "draft"} <= set(graphed.decoder.graphs.keys)
    # the graphs of a freed oracle go with it (a new object can get its id() back, and must not replay them), even
    # while the cache they were captured for lives on
    graphs = graphed.decoder.graphs.graphs
    oracle = PlantedOracle(prompt + base, lambda s: 1, vocab, "cpu")
    token = graphed.decoder.graphs.lifetime_key(oracle)
    seq = graphed.new_sequence(oracle=oracle)
    graphed.generate(prompt, greedy, draft=7, sequence=seq)
    cache = seq.target_cache
    assert any(token in key and graphed.decoder.graphs.lifetime_key(cache) in key for key in graphs)
    seq = oracle = None
    gc.collect()
    assert graphs and not any(token in key for key in graphs)
    assert any(queued_behind) and not all(queued_behind)  # pipelined while far from the end, not near it
