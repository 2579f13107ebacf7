"""`flashdraft serve` end to end: a real server process on a loopback port over the tiny checkpoints.

One server (2 slots, --metrics, an API key, and llama.cpp backend flags that must only be warned about) serves
the whole module; the last test stops it with SIGTERM and checks the exit is clean.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import httpx
import openai
import pytest
import torch

from flashdraft.config import SamplingParams
from flashdraft.server.cli import main as serve_main
from flashdraft.server.scheduler import Slot

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
START_TIMEOUT = 240  # seconds; loading torch on a busy 2-core machine can take a while
MESSAGES = [{"role": "user", "content": "def add(a, b):"}]
PROMPT = "for i in range(10):"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], log_path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log_file = open(log_path, "w")
        cmd = [sys.executable, "-m", "flashdraft.cli", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.health_seen: list[tuple[int, dict]] = []
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited early:\n{self.log()}"
            try:
                r = httpx.get(self.url + "/health", timeout=5)
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            self.health_seen.append((r.status_code, r.json()))
            if r.status_code == 200:
                return
            time.sleep(0.1)
        self.stop()
        pytest.fail(f"server not ready after {START_TIMEOUT} s:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(qwen3_dir, drafter_dir, tmp_path_factory):
    srv = ServerProcess(["-m", str(qwen3_dir), "-md", str(drafter_dir), "-c", "256", "-np", "2", "-t", "1",
                         "--metrics", "--api-key", KEY, "--alias", "tiny-qwen3", "--jinja",
                         "-ngl", "99", "--flash-attn", "on", "--no-mmap", "-b", "512", "--spec-type", "dflash",
                         "--no-spec-dm-adaptive"],  # every step drafts: draft counters move on every request
                        tmp_path_factory.mktemp("server") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def greedy(engine, max_tokens: int, messages=None, prompt=None, **kw) -> str:
    """The engine's own greedy text (one torch thread: the server process competes for the same cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ids = engine.encode_prompt(prompt=prompt, messages=messages)
        return engine.generate(ids, SamplingParams(max_tokens=max_tokens, **kw)).text
    finally:
        torch.set_num_threads(threads)


def post(server, path: str, body, headers=AUTH, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json", **headers},
                      timeout=120, **kw)


def sse_events(response: httpx.Response) -> list:
    return [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]


def metric(server, name: str, labels: str = "") -> float:
    text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name}{labels} not in /metrics:\n{text}")


TIMING_KEYS = {"prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n", "predicted_ms",
               "predicted_per_token_ms", "predicted_per_second", "draft_n", "draft_n_accepted"}


def check_timings(timings: dict, prompt_n: int, predicted_n: int) -> None:
    assert TIMING_KEYS <= set(timings), timings
    # the prompt: run now (prompt_n) or found in the slot's cache (cache_n), as llama-server counts them
    assert timings["prompt_n"] + timings["cache_n"] == prompt_n and timings["prompt_n"] >= 1
    assert timings["predicted_n"] == predicted_n
    assert timings["predicted_per_second"] > 0 and timings["draft_n"] > 0
    assert 0 <= timings["draft_n_accepted"] <= timings["draft_n"]


def test_health_answers_503_while_loading_then_ok(server):
    assert (503, {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}) in server.health_seen
    assert server.health_seen[-1] == (200, {"status": "ok"})


def test_backend_only_flags_are_named_once_in_a_warning(server):
    warnings = [line for line in server.log().splitlines() if "have no effect here" in line]
    assert len(warnings) == 1
    for shown in ("-ngl 99", "--flash-attn on", "--no-mmap", "-b 512"):
        assert shown in warnings[0]


def test_chat_greedy_matches_engine_stream_and_not(server, client, engine):
    expected = greedy(engine, 12, messages=MESSAGES)
    prompt_n = len(engine.encode_prompt(messages=MESSAGES))
    whole = client.chat.completions.create(model="any-label", messages=MESSAGES, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == expected
    assert whole.model == "any-label" and whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage.prompt_tokens == prompt_n and whole.usage.total_tokens == prompt_n + whole.usage.completion_tokens
    check_timings(whole.model_extra["timings"], prompt_n, whole.usage.completion_tokens)

    chunks = list(client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    check_timings(last.model_extra["timings"], prompt_n, last.usage.completion_tokens)


def test_completions_greedy_matches_engine_stream_and_not(server, client, engine):
    expected = greedy(engine, 10, prompt=PROMPT)
    whole = client.completions.create(model="m", prompt=PROMPT, max_tokens=10, temperature=0)
    assert whole.choices[0].text == expected
    check_timings(whole.model_extra["timings"], len(engine.encode_prompt(PROMPT)), whole.usage.completion_tokens)
    chunks = list(client.completions.create(model="m", prompt=PROMPT, max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert "timings" in chunks[-1].model_extra  # without include_usage the finish chunk is last and carries them


def test_native_completion(server, engine):
    ids = engine.encode_prompt(PROMPT)
    expected = greedy(engine, 10, prompt=PROMPT)
    r = post(server, "/completion", {"prompt": PROMPT, "n_predict": 10, "temperature": 0, "return_tokens": True})
    body = r.json()
    assert r.status_code == 200, body
    assert body["content"] == expected and body["stop"] is True and body["stop_type"] == "limit"
    assert body["tokens_evaluated"] == len(ids) and body["tokens_predicted"] == len(body["tokens"]) == 10
    check_timings(body["timings"], len(ids), 10)
    stop = expected[3:5]
    r = post(server, "/completion", {"prompt": PROMPT, "n_predict": 10, "temperature": 0, "stop": [stop]})
    body = r.json()
    assert body["stop_type"] == "word" and body["stopping_word"] == stop
    assert body["content"] == expected[:expected.index(stop)]
    events = [json.loads(e) for e in sse_events(post(server, "/completion", {"prompt": PROMPT, "n_predict": 10,
                                                                            "temperature": 0, "stream": True}))]
    assert "".join(e["content"] for e in events) == expected
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["timings"]["predicted_n"] == 10


def test_sampling_is_per_request_and_seeded(server, client):
    kw = dict(model="m", prompt=PROMPT, max_tokens=8, temperature=1.5, top_p=0.95, seed=7,
              extra_body={"top_k": 50, "min_p": 0.01})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text
    r = post(server, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 1.5, "seed": 7})
    settings = r.json()["generation_settings"]
    assert settings["seed"] == 7 and settings["temperature"] == 1.5


def test_models_props_slots(server):
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401  # public in llama-server, not here
    models = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny-qwen3"]
    assert models["data"][0]["meta"] == {"n_ctx": 256, "speculative": True, "max_draft": 7}  # no file paths
    props = httpx.get(server.url + "/props", headers=AUTH, timeout=10).json()
    assert props["total_slots"] == 2
    assert props["default_generation_settings"]["params"]["speculative.n_max"] == 7
    assert props["speculative"]["type"] == "dflash" and len(props["speculative"]["slots"]) == 2
    assert "<|im_start|>" in props["chat_template"]
    slots = httpx.get(server.url + "/slots", headers=AUTH, timeout=10).json()
    assert [s["id"] for s in slots] == [0, 1]


def test_metrics_count_prompts_and_drafts(server, client):
    before = metric(server, "llamacpp:tokens_predicted_total")
    drafts_before = metric(server, "llamacpp:spec_decode_num_draft_tokens_total")
    client.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0)
    assert metric(server, "llamacpp:tokens_predicted_total") == before + 6
    assert metric(server, "llamacpp:spec_decode_num_draft_tokens_total") > drafts_before
    accepted = metric(server, "llamacpp:spec_decode_num_accepted_tokens_total")
    per_position = [metric(server, "llamacpp:spec_decode_num_accepted_tokens_per_pos_total", f'{{position="{p}"}}')
                    for p in range(7)]
    assert sum(per_position) == accepted
    for name in ("llamacpp:prompt_tokens_total", "llamacpp:prompt_seconds_total", "llamacpp:n_decode_total",
                 "llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:predicted_tokens_seconds",
                 "llamacpp:spec_decode_num_drafts_total", "llamacpp:n_busy_slots_per_decode"):
        metric(server, name)


BAD_REQUESTS = [
    # (path, body, headers, status, words the message must contain)
    ("/v1/chat/completions", b'{"messages": [', AUTH, 400, "not valid JSON"),
    ("/v1/chat/completions", {"messages": "hello"}, AUTH, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, AUTH, 400, "content"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": "ten"}, AUTH, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": "hot"}, AUTH, 400, "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream": "yes"}, AUTH, 400, "stream"),
    ("/v1/chat/completions", {"model": "m"}, AUTH, 400, "messages"),
    ("/v1/completions", {"model": "m"}, AUTH, 400, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": -5}, AUTH, 400, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 10**12}, AUTH, 400, "context size"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 3}, AUTH, 400, "top_p"),
    ("/v1/completions", {"prompt": "word " * 400}, AUTH, 400, "context size"),
    ("/completion", {"prompt": [1, 2, 10**9]}, AUTH, 400, "vocabulary"),
    ("/v1/completions", {"prompt": PROMPT, "speculative.n_max": -1}, AUTH, 400, "speculative.n_max"),
    ("/v1/completions", {"prompt": PROMPT}, {"Authorization": "Bearer wrong"}, 401, "Invalid API Key"),
    ("/v1/completions", {"prompt": PROMPT}, {}, 401, "Missing API key"),
    ("/v1/nothing-here", {"prompt": PROMPT}, AUTH, 404, "no such endpoint"),
]


@pytest.mark.parametrize("path,body,headers,status,words", BAD_REQUESTS)
def test_bad_input_gets_openai_error_and_one_log_line(server, path, body, headers, status, words):
    lines_before = server.log().count(f" {status}: ")
    r = post(server, path, body, headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["code"] == status and error["type"]
    time.sleep(0.05)
    assert server.log().count(f" {status}: ") == lines_before + 1


def test_body_over_the_limit_gets_413_and_server_keeps_serving(server, client):
    big = json.dumps({"prompt": "x" * (9 * 1024 * 1024)})
    r = post(server, "/v1/completions", big)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert client.completions.create(model="m", prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3


def stream_lines(server, body: dict, arrivals: list, results: dict, key: str, health_seconds: list,
                 first_chunk: threading.Event | None = None) -> None:
    """One streamed completion; stream "a" also times /health at its chunks 2, 4 and 6, mid-generation.
    first_chunk: set once the first chunk has come."""
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        text = []
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append((time.monotonic(), key))
                if first_chunk is not None:
                    first_chunk.set()
                chunk = json.loads(line[6:])
                text += [c["text"] for c in chunk["choices"]]
                if key == "a" and len(text) in (2, 4, 6):
                    t0 = time.monotonic()
                    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
                    health_seconds.append(time.monotonic() - t0)
        results[key] = "".join(text)


def run_staggered(threads: list[threading.Thread], gap: float) -> None:
    """Start the threads gap seconds apart (clients joining while others run), then wait for all."""
    for t in threads:
        t.start()
        time.sleep(gap)
    for t in threads:
        t.join(120)


def idle_slots(url: str) -> list[dict]:
    """/slots once no slot is processing (or after 5 s)."""
    deadline = time.monotonic() + 5
    while True:
        slots = httpx.get(url + "/slots", headers=AUTH, timeout=10).json()
        if not any(s["is_processing"] for s in slots) or time.monotonic() > deadline:
            return slots
        time.sleep(0.05)


def test_concurrent_clients_share_slots_fairly(server, engine):
    """Three streams on two slots: all finish with the engine's greedy text, the first two interleave, and
    /health answers at once while they run."""
    prompts = {"a": PROMPT, "b": "The quick brown fox", "c": "class Stack:"}
    # b and c join once a is generating, and a runs to nearly the slot's 256-token context: b started 50 ms after
    # a's request once came after a's last token on a loaded 2-core machine
    tokens = {"a": 240, "b": 160, "c": 160}
    expected = {k: greedy(engine, tokens[k], prompt=p, ignore_eos=True) for k, p in prompts.items()}
    arrivals, results, health_seconds = [], {}, []
    a_generating = threading.Event()
    threads = {k: threading.Thread(target=stream_lines, args=(
        server, {"max_tokens": tokens[k], "stream": True, "ignore_eos": True, "prompt": p}, arrivals, results, k,
        health_seconds, a_generating if k == "a" else None)) for k, p in prompts.items()}
    batched = {name: metric(server, "flashdraft:batched_step" + name + "_total") for name in ("s", "_slots", "_tokens")}
    threads["a"].start()
    assert a_generating.wait(60), "stream a sent no chunk"
    run_staggered([threads["b"], threads["c"]], 0.05)
    threads["a"].join(120)
    assert results == expected
    # the slots' steps ran as batched steps (the CPU's), two slots at a time while two streams ran
    steps, slots, step_tokens = (metric(server, "flashdraft:batched_step" + name + "_total") - batched[name]
                                 for name in ("s", "_slots", "_tokens"))
    assert steps > 0 and steps < slots <= 2 * steps and step_tokens >= slots
    # /slots: each slot's last request's steps and drafts (tau: tokens a step), its steps batched
    for slot in idle_slots(server.url):
        assert slot["batched_steps"] is True and slot["n_steps"] > 0
        assert 0 <= slot["draft_n_accepted"] <= slot["draft_n"] <= 7 * slot["n_steps"]
        assert slot["tau"] == pytest.approx((slot["n_steps"] + slot["draft_n_accepted"]) / slot["n_steps"])
        assert 1 <= slot["tau"] and slot["n_steps"] <= slot["n_decoded"] <= slot["n_steps"] * slot["tau"] + 1
    order = [k for _, k in sorted(arrivals)]
    assert order.index("b") < len(order) - 1 - order[::-1].index("a"), "slot b waited for a to finish"
    assert len(health_seconds) == 3 and sorted(health_seconds)[1] < 1.0, health_seconds


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_stops_generation(server, stream):
    body = {"prompt": PROMPT, "max_tokens": 200, "stream": stream, "ignore_eos": True}
    if stream:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: {")
                if seen == 3:
                    break
    else:
        # The client sends the request, waits until its slot is generating, and hangs up. Plain decoding (one
        # token a step) keeps 200 tokens from finishing first; a client timeout raced the generation instead.
        host, port = server.url.split("//")[1].split(":")
        payload = json.dumps({**body, "speculative.n_max": 0}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Authorization: {AUTH['Authorization']}\r\nContent-Length: {len(payload)}\r\n\r\n")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(head.encode() + payload)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if any(s["is_processing"] for s in httpx.get(server.url + "/slots", headers=AUTH, timeout=10).json()):
                    break
                time.sleep(0.005)
    slots = idle_slots(server.url)
    assert not any(s["is_processing"] for s in slots), "the slot kept generating after the client left"
    assert max(s["n_decoded"] for s in slots) < 200
    steps = metric(server, "llamacpp:n_decode_total")
    time.sleep(0.5)
    assert metric(server, "llamacpp:n_decode_total") == steps


@pytest.mark.parametrize("pair", ["tiny", "demo"])
def test_many_streams_join_and_leave_each_as_it_would_alone(request, tmp_path, pair):
    """Six streams on four slots (issue #23's case), on the tiny pair and the demo pair: clients join while others
    run, one hangs up after three chunks, and every stream that finishes gives its prompt's text alone (greedy,
    DFlash on); then the slots are free and a new request is served as alone."""
    if pair == "tiny":
        target, drafter = request.getfixturevalue("qwen3_dir"), request.getfixturevalue("drafter_dir")
        engine = request.getfixturevalue("engine")
    else:
        from flashdraft.demo import demo_paths
        from flashdraft.engine.generator import Engine

        target, drafter = demo_paths()
        engine = Engine.load(target, drafter, device="cpu", context_size=256)
    srv = ServerProcess(["-m", str(target), "-md", str(drafter), "-c", "256", "-np", "4", "-t", "1",
                         "--api-key", KEY, "--spec-type", "dflash"], tmp_path / "server.log")
    try:
        prompts = {"a": PROMPT, "b": "The quick brown fox", "c": "class Stack:", "d": "def add(a, b):",
                   "e": "import os", "f": "x = [1, 2, 3]"}
        tokens = 96
        expected = {k: greedy(engine, tokens, prompt=p, ignore_eos=True) for k, p in prompts.items() if k != "c"}
        results: dict[str, str] = {}

        def run(key: str) -> None:
            body = {"prompt": prompts[key], "max_tokens": tokens, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
                text = []
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        text += [c["text"] for c in json.loads(line[6:])["choices"]]
                        if key == "c" and len(text) == 3:
                            return  # hangs up mid-stream
            results[key] = "".join(text)

        run_staggered([threading.Thread(target=run, args=(k,)) for k in prompts], 0.03)
        assert results == expected
        slots = idle_slots(srv.url)
        assert len(slots) == 4 and not any(s["is_processing"] for s in slots)
        assert sum(s["requests"] for s in slots) == len(prompts)
        run("a")
        assert results["a"] == expected["a"]
    finally:
        srv.stop()

def test_slot_state_shows_a_policy_state_when_it_has_one():
    class Policy:
        def state(self):
            return {"mode": "active", "length": 3}

    fresh = types.SimpleNamespace(steps=0, drafted=0, accepted=0)  # a sequence's step counts before any step
    state = Slot(0, fresh, Policy()).state(256, batched=False)
    assert state["draft_policy"] == {"mode": "active", "length": 3}
    assert (state["n_steps"], state["tau"], state["batched_steps"]) == (0, None, False)
    assert "draft_policy" not in Slot(1, fresh, 7).state(256, batched=True)


def test_unknown_and_bad_flags_are_errors_naming_them(capsys, tmp_path):
    assert serve_main(["--definitely-not-a-flag"]) == 2
    assert "--definitely-not-a-flag" in capsys.readouterr().err
    assert serve_main(["-m", str(tmp_path / "missing")]) == 1
    assert "missing" in capsys.readouterr().err
    assert serve_main(["--spec-type", "eagle3"]) == 2
    assert "eagle3" in capsys.readouterr().err
    assert serve_main(["-np", "0", "-m", str(tmp_path)]) == 1
    assert "-np" in capsys.readouterr().err


def test_sigterm_shuts_down_cleanly_mid_stream(server):
    """Last: stops the module's server while a long stream is open; the stream ends and the exit code is 0."""
    body = {"prompt": PROMPT, "max_tokens": 240, "stream": True, "ignore_eos": True}
    ended = threading.Event()

    def consume():
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
                for _ in r.iter_lines():
                    pass
        except httpx.HTTPError:
            pass
        ended.set()

    threading.Thread(target=consume, daemon=True).start()
    time.sleep(0.5)
    started = time.monotonic()
    assert server.stop() == 0, server.log()
    assert time.monotonic() - started < 15
    assert ended.wait(10)
    assert "server stopped" in server.log()
