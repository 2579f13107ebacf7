"""`flashdraft bench --url`: the server-mode client against stub OpenAI-style servers on loopback ports."""
import json
import socket
import threading
import time
from contextlib import contextmanager

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from flashdraft.bench.cli import main
from flashdraft.bench.runner import WARMUP_TOKENS

# Each stub DFlash step proposes 7 tokens and 3 are accepted, so with -n 9: 2 steps, 6 accepted, 14 proposed.
N, ACCEPTED, PROPOSED = 9, 6, 14


CACHED = 4  # prompt tokens the stub says its prompt cache served


def stub_app(drafts=True, ignores_n_max=False, timings=True, fail=False):
    """A server that answers like llama-server: text, usage and timings (streamed: the text in two chunks after a
    role chunk, the timings in the last); DFlash is 4x as fast as the baseline."""
    app = FastAPI()
    app.state.requests = []

    async def complete(request: Request, chat: bool):
        body = await request.json()
        app.state.requests.append((request.url.path, body))
        if fail:
            return JSONResponse({"error": {"message": "max_tokens too large for this stub"}}, status_code=400)
        n = body["max_tokens"]
        drafting = drafts and (ignores_n_max or body.get("speculative.n_max", 16) > 0)
        text = "reply to: " + (body["messages"][-1]["content"] if chat else body["prompt"])
        t = {"prompt_n": 12, "prompt_ms": 3.0, "predicted_n": n, "predicted_ms": (25.0 if drafting else 100.0) * n,
             "cache_n": CACHED}
        if drafting:
            t.update(draft_n=PROPOSED * n // N, draft_n_accepted=ACCEPTED * n // N)
        if body.get("stream"):
            def piece(text, last=False):
                choice = {"delta": {"content": text}} if chat else {"text": text}
                chunk = {"choices": [{"index": 0, "finish_reason": "length" if last else None, **choice}]}
                return chunk | ({"timings": t} if last and timings else {})

            chunks = ([{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}] if chat else [])
            chunks += [piece(text[:5]), piece(text[5:]), piece("", last=True)]
            lines = [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
            return StreamingResponse(iter(lines), media_type="text/event-stream")
        choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        reply = {"choices": [{"index": 0, "finish_reason": "length", **choice}],
                 "usage": {"prompt_tokens": 12, "completion_tokens": n}}
        return reply | ({"timings": t} if timings else {})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    return app


@contextmanager
def serving(app):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "stub server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(5)
        sock.close()


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"name": "raw", "prompt": "def f():"}) + "\n"
                    + json.dumps({"name": "talk", "turns": ["Hello", "More"]}) + "\n")
    return str(path)


def bench(capsys, argv):
    code = main(argv + ["--json", "-n", str(N)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_one_server_with_per_request_baseline(capsys, prompts):
    app = stub_app()
    with serving(app) as url:
        report = bench(capsys, ["--url", url + "/v1/", "--prompts", prompts, "--reps", "2", "--temp", "0.5",
                                "--seed", "11"])
    rows = report["prompts"]
    assert [r["name"] for r in rows] == ["raw", "talk-1", "talk-2"]
    for row in rows:
        assert row["speedup"] == pytest.approx(4.0)
        assert row["baseline_tok_s"] == pytest.approx(10.0) and row["dflash_tok_s"] == pytest.approx(40.0)
        assert row["tau"] == pytest.approx((ACCEPTED + 2) / 2)
        assert row["acceptance_rate"] == pytest.approx(ACCEPTED / PROPOSED)
        assert row["draft_lengths"] is None and row["identical"] is None  # sampling
        assert row["baseline_gen_s"] == pytest.approx(0.9) and row["dflash_gen_s"] == pytest.approx(0.225)
        assert row["cache_n"] == CACHED and row["prompt_tokens"] == 12 + CACHED
        assert 0 < row["dflash_ttft_ms"] < 10_000 and 0 < row["baseline_ttft_ms"] < 10_000  # measured here
    assert report["summary"]["speedup"] == pytest.approx(4.0) and report["summary"]["prompts"] == 3
    assert report["config"]["mode"] == "server" and report["config"]["url"] == url

    requests = app.state.requests
    assert len(requests) == 2 + 3 * 2 * 2  # warm-up both ways, then 3 cases x 2 reps x 2 ways
    baseline = [b for _, b in requests if b.get("speculative.n_max") == 0]
    dflash = [b for _, b in requests if "speculative.n_max" not in b]
    assert len(baseline) == len(dflash) == 7
    assert all(b["temperature"] == 0.5 and b["seed"] == 11 and b["stream"] is True for b in baseline + dflash)
    assert requests[0][1]["max_tokens"] == min(WARMUP_TOKENS, N)  # the warm-up is short
    assert {path for path, b in requests if "prompt" in b} == {"/v1/completions"}
    # The second turn carries the first turn and the (baseline's) reply as the assistant turn.
    second = [b["messages"] for path, b in requests if path == "/v1/chat/completions" and len(b["messages"]) > 1]
    assert second and all(m == [{"role": "user", "content": "Hello"},
                                {"role": "assistant", "content": "reply to: Hello"},
                                {"role": "user", "content": "More"}] for m in second)


def test_separate_baseline_server(capsys, prompts):
    fast, plain = stub_app(), stub_app(drafts=False)
    with serving(fast) as url, serving(plain) as baseline_url:
        report = bench(capsys, ["--url", url, "--baseline-url", baseline_url, "--prompts", prompts,
                                "--draft-n", "5", "--reps", "1"])
    assert report["summary"]["speedup"] == pytest.approx(4.0)
    assert report["summary"]["identical"] is True  # greedy: the stub's texts agree
    assert all("speculative.n_max" not in b for _, b in plain.state.requests)
    assert all(b["speculative.n_max"] == 5 for _, b in fast.state.requests)
    assert len(plain.state.requests) == len(fast.state.requests) == 1 + 3


@pytest.mark.parametrize("app, message", [
    (stub_app(timings=False), "has no 'timings' object"),
    (stub_app(fail=True), "answered HTTP 400: max_tokens too large for this stub"),
    (stub_app(ignores_n_max=True), "ignores \"speculative.n_max\": 0"),
])
def test_server_errors_are_clean(capsys, app, message):
    with serving(app) as url:
        assert main(["--url", url, "-n", "4"]) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("flashdraft bench: error: ") and message in last


def test_unreachable_server(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    assert main(["--url", f"http://127.0.0.1:{port}", "-n", "4"]) == 1
    assert f"cannot reach http://127.0.0.1:{port}/v1/chat/completions" in capsys.readouterr().err


def test_concurrent_streams(capsys, prompts):
    app = stub_app()
    with serving(app) as url:
        code = main(["--url", url, "--prompts", prompts, "--concurrency", "3", "--reps", "2", "-n", str(N), "--json"])
        out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    c = report["concurrency"]
    assert c["streams"] == 3 and report["config"]["concurrency"] == 3
    for way, rate in (("baseline", 10.0), ("dflash", 40.0)):
        w = c[way]
        assert w["requests"] == 3 * 2 * 2 and w["tokens"] == w["requests"] * N  # 3 streams x 2 reps x 2 prompts
        assert w["per_stream_tok_s"] == pytest.approx(rate)  # each request's own rate, as the server says
        assert w["total_tok_s"] == pytest.approx(w["tokens"] / w["wall_s"]) and w["ttft_ms"] > 0
    assert c["dflash"]["draft_n_accepted"] == 12 * ACCEPTED and c["speedup"] > 0
    # tokens a step over the way's requests: each commits N tokens in N - 1 - ACCEPTED steps after the prefill's
    assert c["dflash"]["tau"] == pytest.approx((N - 1) / (N - 1 - ACCEPTED)) and c["baseline"]["tau"] == 1.0
    assert len(app.state.requests) == 2 + 2 * 12  # the warm-up, then both ways
    assert "per stream" in err and "tau" in err and "DFlash / baseline" in err  # the table went to stderr


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "4"], "--concurrency needs --url"),
    (["--concurrency", "0"], "--concurrency must be >= 1"),
])
def test_concurrency_errors(capsys, argv, message):
    assert main(argv) == 1
    assert message in capsys.readouterr().err
