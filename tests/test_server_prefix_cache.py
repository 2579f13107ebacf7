"""Multi-turn chats through the server: each turn runs only its new tokens (cache_n, cached_tokens), answers as a
cold server does, a conversation goes back to its slot, a shared system prompt is copied from another slot, and
cache_prompt: false turns reuse off. Also --spec-type ngram serving."""
from __future__ import annotations

import threading

import httpx
import pytest

from flashdraft.demo import DEMO_DIR
from flashdraft.server.cli import build_parser, settings_from_args
from test_server_hardening import AUTH, LiveServer

TURNS = ["Write a function that parses a CSV line.", "Now add type hints.", "Add a docstring.",
         "Write a test for it.", "Make it handle quoted fields."]
SYSTEM = {"role": "system", "content": "You are a careful Python programmer. Answer with code only."}


@pytest.fixture(scope="module")
def demo_server():
    srv = LiveServer(DEMO_DIR / "target", DEMO_DIR / "drafter", ctx_size=2048, n_predict=24, n_slots=2)
    yield srv
    srv.stop()


def chat(server, messages, **extra) -> dict:
    body = {"messages": messages, "max_tokens": 24, "temperature": 0, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_five_turns_run_only_their_new_tokens_and_answer_as_a_cold_server(demo_server):
    messages = [SYSTEM]
    previous_total = 0
    for turn, text in enumerate(TURNS):
        messages.append({"role": "user", "content": text})
        warm = chat(demo_server, messages, cache_prompt=True)
        cold = chat(demo_server, messages, cache_prompt=False)
        t, usage = warm["timings"], warm["usage"]
        assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"], turn
        assert cold["timings"]["cache_n"] == 0 and cold["timings"]["prompt_n"] == usage["prompt_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == t["cache_n"]
        assert t["prompt_n"] + t["cache_n"] == usage["prompt_tokens"]
        if turn:
            # the earlier turns come from the cache: all of the last prompt at least (its reply re-tokenized by
            # the template may differ from the generated ids only within that reply)
            assert previous_total <= t["cache_n"] < usage["prompt_tokens"], (turn, t)
        previous_total = usage["prompt_tokens"]
        messages.append({"role": "assistant", "content": warm["choices"][0]["message"]["content"]})


def test_a_shared_system_prompt_is_copied_from_a_busy_slot(demo_server):
    system = {"role": "system", "content": "You write small, well tested Python modules for a data team. " * 8}
    first = [system, {"role": "user", "content": "Write a function that merges two sorted lists."}]
    second = [system, {"role": "user", "content": "Write a class for a bounded queue."}]
    started, done = threading.Event(), {}

    def long_stream():
        body = {"messages": first, "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", demo_server.url + "/v1/chat/completions", json=body, headers=AUTH,
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and not started.is_set():
                    started.set()
        done["ok"] = True

    thread = threading.Thread(target=long_stream)
    thread.start()
    assert started.wait(60)
    slot_busy = [s for s in httpx.get(demo_server.url + "/slots", headers=AUTH).json() if s["is_processing"]]
    assert len(slot_busy) == 1
    reply = chat(demo_server, second)
    thread.join(120)
    assert done.get("ok")
    system_tokens = len(demo_server.state.engine.encode_prompt(messages=[system])) - 4  # the generation prompt's
    assert reply["timings"]["cache_n"] >= system_tokens > 0
    cold = chat(demo_server, second, cache_prompt=False)
    assert reply["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]


def test_cache_prompt_must_be_a_boolean(demo_server):
    r = httpx.post(demo_server.url + "/v1/chat/completions", headers=AUTH, timeout=30,
                   json={"messages": [{"role": "user", "content": "hi"}], "cache_prompt": "yes"})
    assert r.status_code == 400 and "cache_prompt" in r.json()["error"]["message"]


def test_ngram_serving(tmp_path):
    args = build_parser().parse_args(["--spec-type", "ngram"])
    settings = settings_from_args(args)
    assert settings.ngram and settings.drafting and settings.drafter is None
    with pytest.raises(Exception, match="drop -md"):
        settings_from_args(build_parser().parse_args(["--spec-type", "ngram", "-md", str(tmp_path)]))
    both = settings_from_args(build_parser().parse_args(["--spec-type", "dflash+ngram"]))  # the demo pair
    assert both.ngram and both.drafting and both.drafter is not None
    srv = LiveServer(DEMO_DIR / "target", None, ctx_size=1024, n_predict=60, ngram=True, drafting=True)
    try:
        messages = [{"role": "user", "content": "Write a Python class Stack with push, pop and peek."}]
        reply = chat(srv, messages, max_tokens=80, ignore_eos=True)
        assert reply["timings"]["draft_n"] > 0 and reply["timings"]["draft_n_accepted"] > 0
        props = httpx.get(srv.url + "/props", headers=AUTH).json()
        assert props is not None
    finally:
        srv.stop()
    plain = LiveServer(DEMO_DIR / "target", None, ctx_size=1024, n_predict=60, drafting=False)
    try:
        expected = chat(plain, messages, max_tokens=80, ignore_eos=True)["choices"][0]["message"]["content"]
    finally:
        plain.stop()
    assert reply["choices"][0]["message"]["content"] == expected
