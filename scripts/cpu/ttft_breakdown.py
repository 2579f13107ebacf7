"""Where a first token's time goes through the server: a tiny random Qwen3-shaped model (the tests' builder) served
in a thread of this process on the CPU, and 60 streamed /completion requests of 100 new token ids each (one token,
cache_prompt off; the first 10 not counted), timestamped at each hand-over by wrappers around the server's
functions: the handler's start, the body decoded, the job submitted, the worker taking it, a slot starting it (after
saving the slot's previous prefix to the prompt cache), the engine's first event, its post to the event loop, its
SSE line, and the client's first line. Medians from the client's send, in ms (issue #24). The client shares this
process's interpreter with the server, so absolute figures run high; the differences are the point.

    PYTHONPATH=src:tests python scripts/cpu/ttft_breakdown.py
"""
from __future__ import annotations

import http.client
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import flashdraft.engine.generator as generator
import flashdraft.server.app as app
import flashdraft.server.formats as formats
import flashdraft.server.requests as requests
import flashdraft.server.scheduler as scheduler
from flashdraft.server.app import ServerState
from flashdraft.server.cli import serve_in_thread
from flashdraft.server.settings import ServerSettings
from tiny_models import build_target

MARKS: dict[str, float] = {}
ORDER = ["handler", "decoded", "submitted", "taken", "slot", "first_event", "posted", "sse", "client"]


def mark(name: str) -> None:
    MARKS.setdefault(name, time.perf_counter())


def instrument() -> None:
    read_json, submit, assign = app.read_json, scheduler.Scheduler.submit, scheduler.Scheduler._assign
    start, post, sse, stream = scheduler.Scheduler._start, requests.Job.post, formats.sse, generator.Engine.stream

    async def timed_read_json(request, limit):
        mark("handler")
        body = await read_json(request, limit)
        mark("decoded")
        return body

    def timed_stream(self, *args, **kwargs):
        for event in stream(self, *args, **kwargs):
            mark("first_event")
            yield event

    app.read_json = timed_read_json
    scheduler.Scheduler.submit = lambda self, job: (mark("submitted"), submit(self, job))[1]
    scheduler.Scheduler._assign = lambda self: (self.pending and mark("taken"), assign(self))[1]
    scheduler.Scheduler._start = lambda self, *a, **k: (mark("slot"), start(self, *a, **k))[1]
    requests.Job.post = lambda self, kind, payload, choice=0: (kind == "delta" and mark("posted"),
                                                            post(self, kind, payload, choice))[1]
    formats.sse = lambda payload: (mark("sse"), sse(payload))[1]
    generator.Engine.stream = timed_stream


def main() -> int:
    folder = build_target(Path(tempfile.mkdtemp()) / "t", family="qwen3", seed=1)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    instrument()
    state = ServerState(ServerSettings(model=str(folder), drafter=None, alias=None, ctx_size=512, api_keys=[],
                                       device="cpu"))
    state.load(on_failure=lambda: None)
    server, base = serve_in_thread(state)
    port = int(base.rsplit(":", 1)[1])
    rng = random.Random(1)
    rows = []
    for i in range(60):
        body = json.dumps({"prompt": [rng.randrange(10, vocab) for _ in range(100)], "n_predict": 1, "stream": True,
                           "temperature": 0, "cache_prompt": False})
        MARKS.clear()
        conn = http.client.HTTPConnection("127.0.0.1", port)
        sent = time.perf_counter()
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        conn.getresponse().fp.readline()
        mark("client")
        time.sleep(0.02)  # the request ends (one token) before the next starts
        conn.close()
        if i >= 10:
            rows.append({k: 1000 * (t - sent) for k, t in MARKS.items()})
    print("median ms from the client's send:")
    print("  " + "  ".join(f"{k} {statistics.median(r[k] for r in rows if k in r):.2f}" for k in ORDER))
    server.handle_exit(15, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
