"""Logit processing in the DFlash loop (logit_bias, repeat/presence/frequency penalties, grammar constraints) and
logprobs: DFlash gives plain decoding's tokens (greedy, and sampled under a seed) and logprobs.

The checks that would fail if a verify block's rows were processed as plain decoding's last row only: the rows
test (each row of a block equals that row processed alone after its prefix was committed), and the runs with an
oracle drafter that proposes plain decoding's processed output, so that long runs of guesses are accepted
against processed rows (an unprocessed row there samples the unprocessed token and the output changes)."""
import dataclasses
import json
import math
import random
import re
import sys

import jsonschema
import pytest
import torch
import transformers

from flashdraft.config import Constraint, SamplingParams
from flashdraft.demo import demo_paths
from flashdraft.engine.generator import Engine
from flashdraft.engine.grammar import GrammarCompiler, GrammarMatcher, unpack_bitmask
from flashdraft.engine.logit_processor import LogitProcessor
from flashdraft.bench.oracle import PlantedOracle
from test_lossless import InlineGraphs
from tiny_models import build_drafter

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["function", "class", "module"]},
        "lines": {"type": "integer", "minimum": 1, "maximum": 999},
        "args": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "returns": {"type": "object", "properties": {"type": {"enum": ["int", "str", "None"]},
                                                     "nullable": {"type": "boolean"}},
                    "required": ["type", "nullable"]},
    },
    "required": ["name", "kind", "lines", "args", "returns"],
}
GBNF = r'''root ::= "def " name "(" params "):" ws "return " name
name ::= [a-z_] [a-z0-9_]{0,10}
params ::= (name (", " name){0,2})?
ws ::= "\n" " "{4}'''
PENALTIES = dict(repeat_penalty=1.3, repeat_last_n=8, presence_penalty=0.7, frequency_penalty=0.4)


def _prompts(vocab, count, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(3, 20))] for _ in range(count)]


def _with_oracle(engine, prompt, reference, params, pattern=lambda s: s % 7):
    """A DFlash run whose guesses are plain decoding's output (reference) with a planted mismatch per step."""
    vocab = engine.decoder.target.config.vocab_size
    planted = engine.new_sequence(oracle=PlantedOracle(prompt + reference, pattern, vocab, "cpu"))
    return engine.generate(prompt, params, draft=engine.max_draft, sequence=planted)


def _check_lossless(engine, prompt, params, draft=None):
    """Plain decoding, DFlash with the engine's drafter and with an oracle: the same tokens; returns plain's."""
    base = engine.generate(prompt, params, draft=0)
    own = engine.generate(prompt, params, draft=engine.max_draft if draft is None else draft)
    assert own.tokens == base.tokens
    assert own.stats.draft_n > 0
    oracle = _with_oracle(engine, prompt, base.tokens, params)
    assert oracle.tokens == base.tokens
    assert oracle.stats.draft_n_accepted > len(base.tokens) // 3  # long runs accepted against processed rows
    return base


@pytest.fixture(scope="module")
def demo():
    return Engine.load(*demo_paths(), device="cpu", context_size=512)


@pytest.fixture(scope="module")
def demo_prompt(demo):
    return demo.tokenizer.encode('def parse_config(path):\n    """Read the settings file at path."""\n')


# --- the processor on its own ---

def test_penalties_hand_computed():
    """bias, then llama.cpp's repeat penalty over the last repeat_last_n tokens of prompt and output, then OpenAI's
    presence and frequency penalties over the output; row 1 is after one guess (token 2 leaves the window)."""
    params = SamplingParams(logit_bias={0: 0.5, 5: -1.0}, repeat_penalty=2.0, repeat_last_n=4,
                            presence_penalty=0.5, frequency_penalty=0.25)
    proc = LogitProcessor(params, prompt=[0, 1, 2], vocab_size=6, device="cpu")
    proc.commit([2, 3, 4, 4])  # context 0 1 2 | 2 3 4 4: window {2, 3, 4}; output counts 2:1 3:1 4:2
    row = torch.tensor([1.0, -1.0, 2.0, 0.5, -0.5, 3.0])
    out = proc.process(torch.stack([row, row]), guesses=[5])
    # row 0: bias -> [1.5, -1, 2, .5, -.5, 2]; repeat -> [1.5, -1, 1, .25, -1, 2];
    #        output: 2: -(.25 + .5), 3: -(.25 + .5), 4: -(.5 + .5)
    assert out[0].tolist() == pytest.approx([1.5, -1.0, 0.25, -0.5, -2.0, 2.0])
    # row 1 (after 5): window 3 4 4 5 -> {3, 4, 5}; output counts 2:1 3:1 4:2 5:1
    assert out[1].tolist() == pytest.approx([1.5, -1.0, 1.25, -0.5, -2.0, 0.25])


@pytest.mark.parametrize("last_n", [3, -1])
def test_rows_are_processed_as_if_their_guesses_were_committed(last_n):
    """Each row of a block equals that row processed alone once its prefix of guesses is committed."""
    vocab, g = 11, torch.Generator().manual_seed(last_n)
    params = SamplingParams(logit_bias={1: 2.0, 7: -3.0}, repeat_penalty=1.5, repeat_last_n=last_n,
                            presence_penalty=0.3, frequency_penalty=0.6)
    prompt, output, guesses = [1, 2, 3, 2], [4, 2, 2], [2, 5, 2, 2, 9]
    rows = torch.randn(len(guesses) + 1, vocab, generator=g) * 2
    block = LogitProcessor(params, prompt, vocab, "cpu")
    block.commit(output)
    out = block.process(rows, guesses)
    for i in range(len(guesses) + 1):
        alone = LogitProcessor(params, prompt, vocab, "cpu")
        alone.commit(output + guesses[:i])
        assert torch.allclose(out[i], alone.process(rows[i:i + 1], [])[0]), i
    assert not torch.allclose(out[1:], block.process(rows[1:], [])[:1].expand(len(guesses), -1))


def test_grammar_masks_follow_the_guesses_and_stop_at_a_forbidden_one(demo):
    compiled = demo.compile_constraint(Constraint("json_schema", json.dumps(SCHEMA)))
    vocab = demo.decoder.target.config.vocab_size
    enc = demo.tokenizer.encode
    guesses = enc('{"name": "x", "kind', add_special_tokens=False)
    matcher = GrammarMatcher(compiled, vocab, 32)
    masks = unpack_bitmask(matcher.masks(guesses), vocab, "cpu")
    assert masks.shape[0] == len(guesses) + 1
    for i in range(len(guesses) + 1):
        alone = GrammarMatcher(compiled, vocab, 32)
        alone.commit(guesses[:i])
        assert torch.equal(masks[i], unpack_bitmask(alone.masks([]), vocab, "cpu")[0])
    assert all(masks[i, t] for i, t in enumerate(guesses))
    # a guess the grammar forbids ends the masks: the rows after it cannot be reached
    bad = guesses[:3] + enc("}}", add_special_tokens=False) + guesses[3:]
    assert matcher.masks(bad).shape[0] == 4
    assert torch.equal(unpack_bitmask(matcher.masks([]), vocab, "cpu"), masks[:1])  # the matcher did not move
    # special tokens never pass as their literal text; once the JSON is complete only an end token may follow
    assert not masks[:, sorted(set(demo.tokenizer.hf.all_special_ids) - demo.eos_ids)].any()
    done = GrammarMatcher(demo.compile_constraint(Constraint("json_object")), vocab, 2)
    done.commit(enc('{"a": 1}', add_special_tokens=False))
    assert unpack_bitmask(done.masks([]), vocab, "cpu")[0].nonzero().flatten().tolist() == sorted(demo.eos_ids)


def test_grammar_draft_takes_the_first_allowed_candidate_or_a_forced_token(demo, capfd):
    """Each slot's guess is its first candidate that the grammar allows after the guesses before it (checked
    against the masks), else the token the grammar forces there; a slot with neither ends the guesses; the matcher
    does not move."""
    compiled = demo.compile_constraint(Constraint("json_schema", json.dumps(SCHEMA)))
    vocab = demo.decoder.target.config.vocab_size
    enc = demo.tokenizer.encode
    text = enc('{"name": "x", "kind": "class", "li', add_special_tokens=False)
    bad = min(set(demo.tokenizer.hf.all_special_ids) - demo.eos_ids)  # a special token: never allowed
    matcher = GrammarMatcher(compiled, vocab, 32)
    start = unpack_bitmask(matcher.masks([]), vocab, "cpu").clone()
    # the right token second or third behind forbidden ones, and the forced opening '{' behind only forbidden ones
    candidates = [[bad, vocab + 5, bad]] + [[bad, t] if i % 2 else [bad, vocab + 5, t] for i, t in enumerate(text[1:])]
    guesses = matcher.draft(candidates)
    allowed = unpack_bitmask(matcher.masks(guesses), vocab, "cpu")
    assert start[0].sum() == 1  # '{' is forced at the start of a JSON object
    assert guesses[0] == int(start[0].nonzero())
    for i, (slot, pick) in enumerate(zip(candidates, guesses)):
        expected = next((t for t in slot if t < vocab and allowed[i, t]), None)
        assert pick == (expected if expected is not None else int(allowed[i].nonzero()))
    assert guesses[1:] == text[1:len(guesses)]
    # a slot with no allowed candidate where several tokens are allowed ends the guesses
    assert matcher.draft([[t] for t in text[:5]] + [[bad]] + [[t] for t in text[5:]]) == text[:5]
    assert torch.equal(unpack_bitmask(matcher.masks([]), vocab, "cpu"), start)
    assert "special token" not in capfd.readouterr().err  # never offered to xgrammar, which warns of each


# --- bias and penalties in the loop (tiny model, random drafter) ---

def test_a_banned_token_is_never_emitted_and_dflash_agrees(engine):
    vocab = engine.decoder.target.config.vocab_size
    for prompt in _prompts(vocab, 3, seed=1):
        free = engine.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True), draft=0)
        banned = free.tokens[2]
        params = SamplingParams(max_tokens=40, ignore_eos=True, logit_bias={banned: -100.0})
        base = _check_lossless(engine, prompt, params)
        assert banned not in base.tokens and base.tokens != free.tokens
        assert base.tokens[:2] == free.tokens[:2]


def test_a_favoured_token_is_emitted(engine):
    prompt = _prompts(engine.decoder.target.config.vocab_size, 1, seed=2)[0]
    base = _check_lossless(engine, prompt, SamplingParams(max_tokens=20, ignore_eos=True, logit_bias={9: 100.0}))
    assert base.tokens == [9] * 20


@pytest.mark.parametrize("penalties", [
    dict(repeat_penalty=1.6, repeat_last_n=6),
    dict(repeat_penalty=1.4, repeat_last_n=-1),
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.9),
    PENALTIES,
])
def test_penalties_greedy_dflash_equals_plain(engine, penalties):
    vocab = engine.decoder.target.config.vocab_size
    changed = False
    for prompt in _prompts(vocab, 3, seed=4):
        params = SamplingParams(max_tokens=48, ignore_eos=True, **penalties)
        base = _check_lossless(engine, prompt, params)
        changed |= base.tokens != engine.generate(prompt, SamplingParams(max_tokens=48, ignore_eos=True),
                                                  draft=0).tokens
    assert changed  # the penalties took effect


def test_processed_sampling_dflash_equals_plain(engine):
    vocab = engine.decoder.target.config.vocab_size
    for i, prompt in enumerate(_prompts(vocab, 4, seed=6)):
        params = SamplingParams(temperature=0.9, top_k=40, seed=100 + i, max_tokens=40, ignore_eos=True,
                                logit_bias={5: 3.0, 6: -100.0}, **PENALTIES)
        base = _check_lossless(engine, prompt, params)
        assert 6 not in base.tokens


def test_graphed_steps_process_like_the_eager_loop(tmp_path, qwen3_dir):
    """With graphs (replayed inline on the CPU), processing requests take the step-by-step path, whose outputs
    are read before any other graph runs: the eager loop's tokens."""
    drafter = build_drafter(tmp_path / "d", qwen3_dir, block_size=8, seed=3)
    eager = Engine.load(qwen3_dir, drafter, device="cpu", context_size=256)
    graphed = Engine.load(qwen3_dir, drafter, device="cpu", context_size=256)
    graphed.decoder.graphs = InlineGraphs()
    greedy = SamplingParams(max_tokens=30, ignore_eos=True, logit_bias={7: -100.0}, **PENALTIES)
    constrained = SamplingParams(max_tokens=30, constraint=Constraint("regex", "[a-z ]{8,40}"))
    for params in (greedy, constrained, SamplingParams(max_tokens=30, ignore_eos=True, logprobs=2)):
        assert not graphed.decoder.pipelines(params) and graphed.decoder.pipelines(SamplingParams())
        for prompt in _prompts(eager.decoder.target.config.vocab_size, 2, seed=8):
            base = eager.generate(prompt, params, draft=0)
            for draft in (0, 7):
                out = graphed.generate(prompt, params, draft=draft)
                assert out.tokens == base.tokens
                if params.logprobs is not None:
                    assert [lp.logprob for lp in out.logprobs] == pytest.approx([lp.logprob for lp in base.logprobs],
                                                                                abs=1e-5)
            assert _with_oracle(graphed, prompt, base.tokens, params).tokens == base.tokens
    assert "step" not in graphed.decoder.graphs.keys and "target" in graphed.decoder.graphs.keys


# --- logprobs ---

@pytest.fixture(scope="module")
def hf_model(qwen3_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(str(qwen3_dir), dtype=torch.float32).eval()


@pytest.mark.parametrize("processing", [{}, dict(logit_bias={11: -100.0}, **PENALTIES)])
def test_logprobs_equal_plain_and_an_independent_forward_pass(engine, hf_model, processing):
    vocab = engine.decoder.target.config.vocab_size
    for prompt in _prompts(vocab, 2, seed=9):
        params = SamplingParams(max_tokens=32, ignore_eos=True, logprobs=5, **processing)
        base = _check_lossless(engine, prompt, params)
        out = engine.generate(prompt, params, draft=engine.max_draft)
        assert [lp.token for lp in out.logprobs] == out.tokens == [lp.token for lp in base.logprobs]
        for a, b in zip(out.logprobs, base.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)
        # the raw logits' log-softmax, from transformers' forward pass over prompt + output
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([prompt + out.tokens])).logits[0].float(), -1)
        for i, lp in enumerate(out.logprobs):
            row = ref[len(prompt) - 1 + i]
            assert lp.logprob == pytest.approx(row[lp.token].item(), abs=1e-4)
            assert len(lp.top) == 5
            assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
            assert [t for t, _ in lp.top] == row.topk(5).indices.tolist()
            if not processing:  # greedy: the emitted token is the most likely one
                assert lp.top[0] == (lp.token, pytest.approx(lp.logprob))
    none = engine.generate(prompt, SamplingParams(max_tokens=4, logprobs=0), draft=engine.max_draft)
    assert len(none.logprobs) == len(none.tokens) and all(lp.top == [] for lp in none.logprobs)
    assert engine.generate(prompt, SamplingParams(max_tokens=4), draft=0).logprobs is None


def test_delta_logprobs_follow_the_released_tokens(demo, demo_prompt):
    """Deltas carry one logprob per released token id, tokens cut by a stop string or an EOS carry none."""
    full = demo.generate(demo_prompt, SamplingParams(max_tokens=40, logprobs=1), draft=0)
    stop = full.text[len(full.text) // 2:][:4]
    params = SamplingParams(max_tokens=40, logprobs=1, stop=[stop])
    for draft in (0, demo.max_draft):
        events = list(demo.stream(demo_prompt, params, draft=draft))
        deltas, result = events[:-1], events[-1]
        assert result.stopping_word == stop and len(result.tokens) < len(full.tokens)
        ids = [t for d in deltas for t in d.token_ids]
        assert ids == result.tokens == [lp.token for d in deltas for lp in d.logprobs]
        assert [lp.token for lp in result.logprobs] == result.tokens
        assert [lp.logprob for lp in result.logprobs] == pytest.approx(
            [lp.logprob for lp in full.logprobs[:len(result.tokens)]], abs=1e-4)


# --- grammars (demo pair) ---

def test_json_schema_output_validates_and_dflash_equals_plain(demo, demo_prompt):
    params = SamplingParams(max_tokens=120, constraint=Constraint("json_schema", json.dumps(SCHEMA)))
    base = _check_lossless(demo, demo_prompt, params)
    assert base.finish_reason == "stop" and base.stop_type == "eos"
    jsonschema.validate(json.loads(base.text), SCHEMA)
    with_logprobs = demo.generate(demo_prompt, dataclasses.replace(params, logprobs=1), draft=demo.max_draft)
    assert [lp.token for lp in with_logprobs.logprobs] == with_logprobs.tokens == base.tokens  # none for the EOS
    free = demo.generate(demo_prompt, SamplingParams(max_tokens=20), draft=0)
    assert not free.text.startswith("{")  # the constraint, not the model, made it JSON
    for seed in (1, 2):
        sampled = SamplingParams(temperature=1.0, seed=seed, max_tokens=120,
                                 constraint=Constraint("json_schema", json.dumps(SCHEMA)))
        out = _check_lossless(demo, demo_prompt, sampled, draft=4)
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_gbnf_output_matches_and_dflash_equals_plain(demo, demo_prompt):
    params = SamplingParams(max_tokens=60, constraint=Constraint("gbnf", GBNF))
    base = _check_lossless(demo, demo_prompt, params)
    assert base.finish_reason == "stop"
    assert base.text.startswith("def ") and "):\n    return " in base.text
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=60, constraint=Constraint("gbnf", GBNF))
    assert _check_lossless(demo, demo_prompt, sampled, draft=4).text.startswith("def ")


def test_json_object_with_a_penalty(demo):
    """Any JSON object; the presence penalty keeps the demo target from repeating one key to max_tokens."""
    prompt = demo.tokenizer.encode('x = {"a": 1}\ny = {"b": 2}\nz = ')
    params = SamplingParams(max_tokens=60, constraint=Constraint("json_object"), presence_penalty=1.5)
    base = _check_lossless(demo, prompt, params, draft=4)
    assert base.finish_reason == "stop" and isinstance(json.loads(base.text), dict)
    assert base.text != demo.generate(prompt, SamplingParams(max_tokens=60, constraint=Constraint("json_object")),
                                      draft=0).text


def test_regex(demo, demo_prompt):
    pattern = r"(yes|no), because [a-z ]{1,20}\."
    base = _check_lossless(demo, demo_prompt, SamplingParams(max_tokens=60, constraint=Constraint("regex", pattern)),
                           draft=4)
    assert base.finish_reason == "stop" and re.fullmatch(pattern, base.text), base.text


# --- errors ---

@pytest.mark.parametrize("constraint,message", [
    (Constraint("json_schema", '{"type": "objekt"}'), "objekt"),
    (Constraint("json_schema", "{not json"), "json_schema"),
    (Constraint("gbnf", 'root ::= "a" missing'), "missing"),
    (Constraint("gbnf", 'root ::= "a'), "gbnf"),
    (Constraint("regex", "(a"), "regex"),
])
def test_a_grammar_that_does_not_compile_is_a_value_error(demo, constraint, message):
    with pytest.raises(ValueError, match=message) as e:
        demo.check_sampling(SamplingParams(constraint=constraint))
    assert "/project/" not in str(e.value) and ".cc:" not in str(e.value)
    with pytest.raises(ValueError, match=message):
        demo.generate([5, 6], SamplingParams(constraint=constraint))


def test_without_xgrammar_a_constraint_is_a_value_error_naming_it(monkeypatch):
    """A machine without the grammar engine still decodes; a constrained request gets an error that says what is
    missing (the server answers it with a 400), not a crash."""
    from flashdraft.engine import grammar
    engine = Engine.load(*demo_paths(), device="cpu", context_size=512)
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    grammar._xgrammar.cache_clear()
    try:
        with pytest.raises(ValueError, match="needs the xgrammar package"):
            engine.check_sampling(SamplingParams(constraint=Constraint("json_object")))
        assert engine.generate([5, 6], SamplingParams(max_tokens=3), 0).tokens
    finally:
        grammar._xgrammar.cache_clear()


def test_bad_processing_parameters_are_value_errors(engine, demo):
    vocab = engine.decoder.target.config.vocab_size
    with pytest.raises(ValueError, match="logit_bias token id"):
        engine.check_sampling(SamplingParams(logit_bias={vocab: 1.0}))
    with pytest.raises(ValueError, match="finite"):
        SamplingParams(logit_bias={3: math.inf}).validate()
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, constraint=Constraint("json_object")).validate()
    with pytest.raises(ValueError, match="end-of-sequence"):
        GrammarCompiler(demo.tokenizer.hf, demo.decoder.target.config.vocab_size, [])
    assert demo.check_sampling(SamplingParams()) is None
