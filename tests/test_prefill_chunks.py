"""A prompt in passes of at most -ub/--ubatch-size tokens (engine.speculative.SpeculativeDecoder.prefill): the same
tokens as one pass over the whole prompt, the drafter's context projected alike, with and without prefix reuse, on
full-attention and sliding-window (Gemma 4 ring) targets; the flag in every command that loads a model."""
import json
import random
import threading
import time

import pytest

from flashdraft.config import PREFILL_CHUNK, SamplingParams
from flashdraft.demo import DEMO_DIR
from flashdraft.engine.generator import Engine
from test_gemma4_tiny import build_gemma4_target

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


def run(engine, prompt, sequence=None, reuse=False, draft=None):
    *_, result = engine.stream(prompt, GREEDY, draft=draft, sequence=sequence or engine.new_sequence(),
                               reuse_prefix=reuse)
    return result


@pytest.fixture(scope="module")
def demo_prompt():
    engine = Engine.load(DEMO_DIR / "target", None, device="cpu")
    text = ("Write a function that parses a CSV line, then one that writes it back, with tests for quoted "
            "fields, empty fields and a trailing newline.")
    return engine.encode_prompt(messages=[{"role": "user", "content": text}])


@pytest.fixture(scope="module")
def whole():
    """The demo pair with its prompts in one pass (longer than any prompt here)."""
    return Engine.load(DEMO_DIR / "target", DEMO_DIR / "drafter", device="cpu", prefill_chunk=4096)


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_a_prompt_in_passes_gives_the_tokens_of_one_pass(whole, demo_prompt, chunk):
    assert len(demo_prompt) > 2 * chunk  # every pass size here splits the prompt
    chunked = Engine.load(DEMO_DIR / "target", DEMO_DIR / "drafter", device="cpu", prefill_chunk=chunk)
    passes = []  # the token count of each target pass
    hook = chunked.decoder.target.register_forward_pre_hook(lambda _, args: passes.append(len(args[0])))
    run(chunked, demo_prompt, draft=0)
    hook.remove()
    P = len(demo_prompt)
    assert passes[:-(-P // chunk)] == [chunk] * (P // chunk) + ([P % chunk] if P % chunk else [])
    for draft in (0, chunked.max_draft):
        ours, reference = run(chunked, demo_prompt, draft=draft), run(whole, demo_prompt, draft=draft)
        assert ours.tokens == reference.tokens
        assert ours.stats.prompt_n == len(demo_prompt)
        # the drafter's context came through the passes whole: its guesses, and what was accepted, are the same
        assert (ours.stats.draft_n, ours.stats.draft_n_accepted) == (reference.stats.draft_n,
                                                                    reference.stats.draft_n_accepted)
    assert ours.stats.draft_n_accepted > 0


def test_the_rest_of_a_reused_prompt_runs_in_passes_too(whole, demo_prompt):
    chunked = Engine.load(DEMO_DIR / "target", DEMO_DIR / "drafter", device="cpu", prefill_chunk=5)
    seq = chunked.new_sequence()
    first = run(chunked, demo_prompt, seq, reuse=True, draft=chunked.max_draft)
    follow = demo_prompt + first.tokens + chunked.tokenizer.encode("\nNow add type hints to both.\n",
                                                                   add_special_tokens=False)
    warm = run(chunked, follow, seq, reuse=True, draft=chunked.max_draft)
    # the last turn's tokens are reused (and one more where the cache holds a token past the output, the last
    # step's guess beyond max_tokens, that the new text starts with)
    assert warm.stats.cache_n >= len(demo_prompt) + len(first.tokens) - 1 and warm.stats.prompt_n > 5
    cold = run(whole, follow, draft=whole.max_draft)
    assert warm.tokens == cold.tokens
    assert (warm.stats.draft_n, warm.stats.draft_n_accepted) == (cold.stats.draft_n, cold.stats.draft_n_accepted)


@pytest.mark.parametrize("chunk", [3, 70])  # within the ring's in-place pass limit (64), and past it
def test_gemma4_rings_take_a_prompt_in_passes(tmp_path, chunk):
    folder, _ = build_gemma4_target(tmp_path / "g", window=8)
    rng = random.Random(1)
    one_pass = Engine.load(folder, None, device="cpu", context_size=256, prefill_chunk=256)
    prompt = [rng.randrange(3, one_pass.decoder.target.config.vocab_size) for _ in range(150)]
    chunked = Engine.load(folder, None, device="cpu", context_size=256, prefill_chunk=chunk)
    assert run(chunked, prompt, draft=0).tokens == run(one_pass, prompt, draft=0).tokens


def test_a_pass_size_below_one_is_refused_by_name(capsys):
    from flashdraft.engine.speculative import SpeculativeDecoder

    whole = Engine.load(DEMO_DIR / "target", None, device="cpu")
    assert whole.decoder.prefill_chunk == PREFILL_CHUNK
    with pytest.raises(ValueError, match="-ub/--ubatch-size"):
        SpeculativeDecoder(whole.decoder.target, None, 256, prefill_chunk=0)
    from flashdraft.cli import main as cli_main

    with pytest.raises(SystemExit):
        cli_main(["generate", "-p", "x", "-ub", "0"])
    assert "-ub" in capsys.readouterr().err


def test_every_command_takes_the_pass_size(tmp_path, capsys):
    import argparse

    from flashdraft.bench.cli import main as bench_main
    from flashdraft.cli import add_model_args, cache_args_from_args
    from flashdraft.server.cli import build_parser, settings_from_args

    (tmp_path / "config.json").write_text("{}")  # only the flags are parsed; no model is loaded
    args = build_parser().parse_args(["-m", str(tmp_path), "-ub", "512"])
    assert settings_from_args(args).cache_options["prefill_chunk"] == 512
    assert not getattr(args, "no_effect", [])  # no longer among the flags that do nothing
    generate = argparse.ArgumentParser()
    add_model_args(generate)  # generate's and bench's model flags
    assert cache_args_from_args(generate.parse_args(["--ubatch-size", "64"]), True)["prefill_chunk"] == 64
    assert bench_main(["--url", "http://127.0.0.1:1", "-ub", "64", "--spec-dflash-cross-ctx", "64"]) != 0
    assert "--spec-dflash-cross-ctx, -ub apply to in-process runs" in capsys.readouterr().err
    assert bench_main(["--synthetic", "qwen3-8b", "-ub", "64"]) != 0
    assert "(-ub)" in capsys.readouterr().err


class _Posts:
    """A stand-in event loop for jobs: every event any job posts, in the order posted (the worker thread's)."""

    def __init__(self):
        self.events, self.done = [], threading.Event()

    def call_soon_threadsafe(self, put, event):
        self.events.append((put.__self__, event))
        if sum(kind == "result" for _, (kind, *_rest) in self.events) == 2:
            self.done.set()


class _NoMetrics:
    def on_round(self, active):
        pass

    def on_step(self):
        pass

    def on_batch(self, steps):
        pass

    def on_batched_tokens(self, total):
        pass

    def on_graph_captures(self, captured):
        pass

    def on_result(self, result):
        pass


def test_a_long_prompt_lets_the_other_slots_stream_between_its_passes():
    """Two slots: while one slot's prompt runs pass by pass, the other slot's stream goes on between the passes
    (one step each), instead of waiting for the whole prompt; both give the tokens they give alone."""
    pytest.importorskip("fastapi")
    from flashdraft.server.requests import Job
    from flashdraft.server.requests import GenerationRequest
    from flashdraft.server.scheduler import Scheduler

    engine = Engine.load(DEMO_DIR / "target", None, device="cpu", prefill_chunk=8)
    rng = random.Random(2)
    short, long = [5, 6, 7], [rng.randrange(3, 8000) for _ in range(8 * 6 + 3)]  # 7 passes
    params = SamplingParams(max_tokens=60, ignore_eos=True)

    def request(prompt):
        return GenerationRequest(prompt, params, None, 0, True, False, "m", "", cache_prompt=False)

    posts = _Posts()
    scheduler = Scheduler(engine, 2, 0, _NoMetrics())
    scheduler.start()
    try:
        streaming = Job(request(short), posts)
        scheduler.submit(streaming)
        while not posts.events:  # the first slot is streaming
            time.sleep(0.01)
        long_job = Job(request(long), posts)
        scheduler.submit(long_job)
        assert posts.done.wait(120)
    finally:
        scheduler.stop()
        scheduler.join(10)
    order = [(queue is long_job.events, kind) for queue, (kind, *_rest) in posts.events]
    first_long = order.index((True, "delta"))
    between = [kind for is_long, kind in order[:first_long] if not is_long]
    # the long prompt's 7 passes took 7 rounds: the streaming slot stepped in (at least) the 6 before its last
    assert between.count("delta") >= 6 + 1  # + its own first delta, before the long job came
    for job, prompt in ((streaming, short), (long_job, long)):
        tokens = [t for queue, (kind, payload, _) in posts.events if queue is job.events and kind == "delta"
                  for t in payload.token_ids]
        assert tokens == engine.generate(prompt, params, 0, sequence=engine.new_sequence()).tokens


@pytest.mark.parametrize("drafter", [True, False])
def test_a_prompt_stopped_between_passes_leaves_what_it_ran_reusable(whole, demo_prompt, drafter):
    """Closing the stream between two passes (a client that left) keeps the passes run so far as a prefix that the
    next prompt reuses, with the drafter's context: its tokens are a cold run's."""
    chunked = Engine.load(DEMO_DIR / "target", DEMO_DIR / "drafter" if drafter else None, device="cpu",
                          prefill_chunk=6)
    draft = chunked.max_draft if drafter else 0
    seq = chunked.new_sequence()
    events = chunked.stream(demo_prompt, GREEDY, draft=draft, sequence=seq, reuse_prefix=True,
                            prompt_progress=True)
    progress = [next(events), next(events)]
    assert [(p.processed, p.total) for p in progress] == [(6, len(demo_prompt)), (12, len(demo_prompt))]
    events.close()
    again = run(chunked, demo_prompt, seq, reuse=True, draft=draft)
    assert again.stats.cache_n == 12 and again.stats.prompt_n == len(demo_prompt) - 12
    cold = run(whole, demo_prompt, draft=draft)
    assert again.tokens == cold.tokens
    assert (again.stats.draft_n, again.stats.draft_n_accepted) == (cold.stats.draft_n, cold.stats.draft_n_accepted)


def _stream(url: str, path: str, body: dict, headers: dict) -> list[dict]:
    import httpx

    with httpx.Client(timeout=60) as client:
        response = client.post(url + path, json=body, headers=headers)
    assert response.status_code == 200, response.text
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_return_progress_reports_each_pass_before_the_first_token():
    """llama-server's return_progress: a stream's chunks carry prompt_progress {total, cache, processed, time_ms}
    after each prefill pass, the last at processed == total, before any text; without it, or without stream, none."""
    pytest.importorskip("fastapi")
    import httpx
    from test_server_hardening import AUTH, LiveServer  # it needs fastapi

    srv = LiveServer(DEMO_DIR / "target", DEMO_DIR / "drafter", ctx_size=256, n_predict=3,
                     cache_options={"prefill_chunk": 8})
    try:
        prompt = list(range(100, 130))  # 30 tokens: passes of 8, 8, 8, 6
        native = _stream(srv.url, "/completion", {"prompt": prompt, "stream": True, "return_progress": True,
                                                  "cache_prompt": False}, AUTH)
        progress = [c["prompt_progress"] for c in native if "prompt_progress" in c]
        assert [p["processed"] for p in progress] == [8, 16, 24, 30]
        assert all(p["total"] == 30 and p["cache"] == 0 and p["time_ms"] >= 0 for p in progress)
        first_text = next(i for i, c in enumerate(native) if c.get("content"))
        assert all("prompt_progress" not in c for c in native[first_text:])
        messages = [{"role": "user", "content": "Write a function that parses a CSV line."}]
        chat = _stream(srv.url, "/v1/chat/completions", {"messages": messages, "stream": True,
                                                         "return_progress": True}, AUTH)
        progress = [c for c in chat if "prompt_progress" in c]
        assert progress and all(c["choices"] == [] and c["object"] == "chat.completion.chunk" for c in progress)
        assert progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"]
        # a second turn reuses the first: its progress starts past the cached positions
        again = _stream(srv.url, "/v1/chat/completions", {"messages": messages, "stream": True,
                                                          "return_progress": True}, AUTH)
        cached = [c["prompt_progress"] for c in again if "prompt_progress" in c]
        assert cached[-1]["cache"] == cached[-1]["total"] - 1 and len(cached) == 1
        plain = _stream(srv.url, "/v1/completions", {"prompt": prompt, "stream": True, "cache_prompt": False}, AUTH)
        assert plain and all("prompt_progress" not in c for c in plain)
        whole = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "return_progress": True},
                           headers=AUTH, timeout=60)
        assert whole.status_code == 200 and "prompt_progress" not in whole.json()
    finally:
        srv.stop()
