"""Context shift (--context-shift, --keep): a generation longer than the context goes on by dropping the older
half of the tokens after the kept ones; greedy DFlash equals plain decoding through the shifts; the result is
what a fresh prefill of the kept tokens continues with; without it, or with a grammar, the context still ends
the generation with "length"."""
import random

import pytest

from flashdraft.config import Constraint, SamplingParams
from flashdraft.demo import DEMO_DIR
from flashdraft.engine.generator import Engine, _shifted
from flashdraft.server.cli import build_parser, settings_from_args


def last(events):
    *_, result = events
    return result


@pytest.fixture(scope="module")
def small(qwen3_dir, drafter_dir):
    return Engine.load(qwen3_dir, drafter_dir, device="cpu", context_size=64)


def test_shifted_keeps_the_first_tokens_and_the_newer_half():
    tokens = list(range(20))
    assert _shifted(tokens, 4) == [0, 1, 2, 3] + list(range(12, 20))
    assert _shifted(tokens, 0) == list(range(10, 20))
    assert _shifted(tokens, 19) is None  # nothing left to drop


@pytest.mark.parametrize("keep", [0, 5, -1])
def test_generation_goes_past_the_context_and_dflash_equals_plain(small, keep):
    rng = random.Random(keep)
    prompt = [rng.randrange(3, small.decoder.target.config.vocab_size) for _ in range(20)]
    params = SamplingParams(max_tokens=150, ignore_eos=True)
    plain = last(small.stream(prompt, params, draft=0, context_shift=True, n_keep=keep))
    dflash = last(small.stream(prompt, params, draft=small.max_draft, context_shift=True, n_keep=keep))
    assert len(plain.tokens) == 150 and plain.finish_reason == "length"
    assert plain.stats.context_shifts >= 2 and dflash.stats.context_shifts == plain.stats.context_shifts
    assert dflash.tokens == plain.tokens
    assert dflash.stats.draft_n > 0


def test_after_a_shift_the_output_continues_the_kept_tokens(small):
    """The tokens after the first shift are what a cold prefill of the kept tokens generates."""
    prompt = list(range(10, 30))
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    shifted = last(small.stream(prompt, params, draft=0, context_shift=True, n_keep=4))
    assert shifted.stats.context_shifts == 1
    full = prompt + shifted.tokens[:64 - len(prompt)]  # the context when it was full
    kept = _shifted(full, 4)
    rest = len(shifted.tokens) - (64 - len(prompt))
    cold = last(small.stream(kept, SamplingParams(max_tokens=rest, ignore_eos=True), draft=0,
                             sequence=small.new_sequence()))
    assert shifted.tokens[64 - len(prompt):] == cold.tokens


def test_without_shift_or_with_a_grammar_the_context_ends_it(small):
    prompt = list(range(10, 30))
    params = SamplingParams(max_tokens=150, ignore_eos=True)
    result = last(small.stream(prompt, params, draft=0))
    assert result.finish_reason == "length" and len(prompt) + len(result.tokens) == 64
    demo = Engine.load(DEMO_DIR / "target", DEMO_DIR / "drafter", device="cpu", context_size=48)
    ids = demo.encode_prompt("def f(x):\n")
    constrained = last(demo.stream(ids, SamplingParams(max_tokens=200, constraint=Constraint("regex", "a{300}")),
                                   draft=0, context_shift=True))
    assert constrained.finish_reason == "length" and constrained.stats.context_shifts == 0


def test_serve_flags():
    args = build_parser().parse_args(["--context-shift", "--keep", "32"])
    s = settings_from_args(args)
    assert s.context_shift and s.keep == 32 and not getattr(args, "no_effect", [])
    assert not settings_from_args(build_parser().parse_args(["--no-context-shift"])).context_shift
    assert not settings_from_args(build_parser().parse_args([])).context_shift  # off by default, as llama-server
    with pytest.raises(ValueError, match="--keep must be -1"):
        settings_from_args(build_parser().parse_args(["--keep", "-3"]))


def test_server_goes_past_the_context_with_context_shift(qwen3_dir, drafter_dir):
    import httpx

    from test_server_hardening import AUTH, LiveServer
    body = {"prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "return_tokens": True}
    off = LiveServer(qwen3_dir, drafter_dir)
    try:
        r = httpx.post(off.url + "/completion", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 400 and "max_tokens" in r.text and "--context-shift" in r.text
    finally:
        off.stop()
    on = LiveServer(qwen3_dir, drafter_dir, context_shift=True, keep=2)
    try:
        r = httpx.post(on.url + "/completion", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["tokens"]) == 100
        r = httpx.post(on.url + "/completion", json={**body, "n_keep": -2}, headers=AUTH, timeout=60)
        assert r.status_code == 400 and "n_keep" in r.text
    finally:
        on.stop()
