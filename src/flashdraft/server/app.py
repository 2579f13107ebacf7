"""The HTTP surface: OpenAI routes, llama-server's native routes, /health, /props, /slots, /metrics, the web page.

Handlers never touch the model: they check the request, hand a Job to the scheduler's worker thread and relay
its events, so /health and /metrics answer at once however busy the slots are. The model loads in a
background thread; until it is ready every model route answers 503 "Loading model", as llama-server does.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.staticfiles import StaticFiles

from flashdraft import __version__
from flashdraft.demo import demo_name
from flashdraft.server import anthropic, formats, schemas, tokens
from flashdraft.server.errors import APIError, error_body
from flashdraft.server.requests import (DELTA, ENDED, ERROR, MAX_DEPTH, PROGRESS, RESULT, GenerationRequest, Job,
                                       check_json, parse_chat, parse_completion, parse_native)
from flashdraft.server import responses as responses_api
from flashdraft.server.responses import ResponseBuilder
from flashdraft.server.settings import ServerSettings
from flashdraft.server.templates import TemplateSandbox

log = logging.getLogger("flashdraft.server")
STATIC_DIR = Path(__file__).parent / "static"
PUBLIC_PATHS = {"/health", "/v1/health", "/"}   # and the page's files under /static/: no API key needed
QUIET_PATHS = {"/health", "/v1/health", "/metrics"}  # polled often: not logged when they succeed


METRIC_PREFIX = "llamacpp:"  # llama-server's names
OWN_PREFIX = "flashdraft:"  # what llama-server has no name for


class ServerMetrics:
    """/metrics: Prometheus metrics in llama-server's names (llamacpp:*), plus the speculative-decoding counters it
    shares with vLLM (spec_decode_num_*_total, accepted tokens per draft position)."""

    def __init__(self, scheduler_probe=lambda: (0, 0)):
        """scheduler_probe() -> (busy slots, queued requests), read at scrape time."""
        disable_created_metrics()  # llama-server has no *_created series
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._rounds = 0
        self._busy_sum = 0
        self._max_tokens_seen = 0
        self._batched_tokens_seen = 0
        self._captures_seen: dict[str, int] = {}
        self._totals = {"prompt_n": 0.0, "prompt_s": 0.0, "predicted_n": 0.0, "predicted_s": 0.0}
        r = self.registry

        def counter(name, doc, labels=(), prefix=METRIC_PREFIX):
            return Counter(prefix + name, doc, labels, registry=r)

        def gauge(name, doc, fn):
            g = Gauge(METRIC_PREFIX + name, doc, registry=r)
            g.set_function(fn)
            return g

        self.prompt_tokens = counter("prompt_tokens", "Number of prompt tokens processed.")
        self.prompt_seconds = counter("prompt_seconds", "Prompt process time.")
        self.tokens_predicted = counter("tokens_predicted", "Number of generation tokens processed.")
        self.tokens_predicted_seconds = counter("tokens_predicted_seconds", "Predict process time.")
        self.n_decode = counter("n_decode", "Engine calls made for requests (each a prefill or one or more decoding steps).")
        self.drafts = counter("spec_decode_num_drafts", "Decoding steps that verified a draft.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by position in the draft (0 = first).", ["position"])
        self.batched_steps = counter("batched_steps", "Batched steps: one target pass over the rows of every slot "
                                     "whose step waited for it.", prefix=OWN_PREFIX)
        self.batched_step_slots = counter("batched_step_slots", "Slots stepped by batched steps (their sum).",
                                          prefix=OWN_PREFIX)
        self.batched_step_tokens = counter("batched_step_tokens", "Tokens committed by batched steps.",
                                           prefix=OWN_PREFIX)
        self.graph_captures = counter("graph_captures", "CUDA graphs captured, by kind (a step, a batched step, a "
                                      "prompt pass): each a shape first run, or run again after its graph was evicted; "
                                      "steady growth means the server keeps meeting new shapes.", ["kind"],
                                      prefix=OWN_PREFIX)
        self.probe = scheduler_probe
        gauge("prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
              lambda: _ratio(self._totals["prompt_n"], self._totals["prompt_s"]))
        gauge("predicted_tokens_seconds", "Average generation throughput in tokens/s.",
              lambda: _ratio(self._totals["predicted_n"], self._totals["predicted_s"]))
        gauge("requests_processing", "Number of requests processing.", lambda: self.probe()[0])
        gauge("requests_deferred", "Number of requests deferred.", lambda: self.probe()[1])
        gauge("n_tokens_max", "Largest observed n_tokens (prompt + generated).", lambda: self._max_tokens_seen)
        gauge("n_busy_slots_per_decode", "Average number of busy slots per decoding round.",
              lambda: _ratio(self._busy_sum, self._rounds))

    def expose_positions(self, max_draft: int) -> None:
        """Export every draft position from the start (at 0), as llama-server and vLLM do."""
        for position in range(max_draft):
            self.accepted_per_pos.labels(position=str(position))

    def on_round(self, busy: int) -> None:
        with self._lock:
            self._rounds += 1
            self._busy_sum += busy

    def on_step(self) -> None:
        self.n_decode.inc()

    def on_batch(self, steps: int) -> None:
        """A flush ran (or queued on the device) `steps` slots' steps as a batched step."""
        if steps:
            self.batched_steps.inc()
            self.batched_step_slots.inc(steps)

    def on_batched_tokens(self, total: int) -> None:
        """The decoder's count of tokens committed by batched steps so far (after each round: a queued step's
        tokens count once its slot collected it)."""
        self.batched_step_tokens.inc(max(0, total - self._batched_tokens_seen))
        self._batched_tokens_seen = max(total, self._batched_tokens_seen)

    def on_graph_captures(self, captured: dict[str, int]) -> None:
        """The decoder's graph cache's captures so far, by kind (after each round)."""
        for kind, total in captured.items():
            seen = self._captures_seen.get(kind, 0)
            if total > seen:
                self.graph_captures.labels(kind=kind).inc(total - seen)
                self._captures_seen[kind] = total

    def on_result(self, result) -> None:
        s = result.stats
        self.prompt_tokens.inc(s.prompt_n)
        self.prompt_seconds.inc(s.prompt_ms / 1000)
        self.tokens_predicted.inc(s.predicted_n)
        self.tokens_predicted_seconds.inc(s.predicted_ms / 1000)
        self.drafts.inc(s.steps - s.draft_lengths.get(0, 0))
        self.draft_tokens.inc(s.draft_n)
        self.accepted_tokens.inc(s.draft_n_accepted)
        for position, count in enumerate(s.accepted_per_position):
            self.accepted_per_pos.labels(position=str(position)).inc(count)
        with self._lock:
            self._max_tokens_seen = max(self._max_tokens_seen, s.prompt_tokens + s.predicted_n)
            for key, value in (("prompt_n", s.prompt_n), ("prompt_s", s.prompt_ms / 1000),
                               ("predicted_n", s.predicted_n), ("predicted_s", s.predicted_ms / 1000)):
                self._totals[key] += value

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


class ServerState:
    """The engine and scheduler once loaded; what the routes read."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.engine = None
        self.scheduler = None
        self.load_error: Exception | None = None
        self.templates = TemplateSandbox(settings.template_seconds) if settings.allow_request_template else None
        self.created = int(time.time())
        self.metrics = ServerMetrics(lambda: (self.scheduler.busy, self.scheduler.deferred) if self.scheduler else (0, 0))

    def load(self, on_failure: Callable[[], None]) -> None:
        """Load the model and start the worker (run in a background thread)."""
        try:
            import torch

            from flashdraft.config import SamplingParams
            from flashdraft.engine.generator import Engine
            from flashdraft.engine.ngram import NgramSettings
            from flashdraft.models.kv_cache import HostArena
            from flashdraft.server.scheduler import PromptCache, Scheduler

            s = self.settings
            if s.threads:
                torch.set_num_threads(s.threads)
            started = time.perf_counter()
            ngram = None
            if s.ngram and s.drafter:  # beside a drafter, a lookup proposes up to the drafter's block
                ngram = NgramSettings()
            elif s.ngram:  # --spec-draft-n-max sets how far a lookup proposes
                ngram = NgramSettings(max_draft=s.spec_n_max) if s.spec_n_max else NgramSettings()
            engine = Engine.load(s.model, s.drafter, device=s.device, context_size=s.ctx_size, ngram=ngram,
                                 name=demo_name(s.model), slots=s.n_slots, **s.cache_options)
            if not (s.drafting and engine.drafts):
                fixed_draft = 0
            else:
                fixed_draft = None if s.adaptive_draft else engine.max_draft  # capped per request by n_max
            prompt_cache = None
            if s.cache_ram_mib != 0:  # -1: no limit
                budget = None if s.cache_ram_mib < 0 else s.cache_ram_mib << 20
                arena = None
                if budget is not None and engine.decoder.device.type == "cuda":
                    # pinned once here: pinning per saved prefix cost a request 12-34 ms on the H200, seconds for a
                    # long prefix (docs/server.md)
                    pinning = time.perf_counter()
                    arena = HostArena(budget, pin_memory=True)
                    log.info("prompt cache: %.1f GiB of host memory pinned in %.1f s", budget / 2 ** 30,
                             time.perf_counter() - pinning)
                prompt_cache = PromptCache(engine.decoder, budget, arena)
            scheduler = Scheduler(engine, s.n_slots, fixed_draft, self.metrics, prompt_cache, s.context_shift)
            warm_up = None
            if s.warmup:  # the default sampling settings' graphs too, when they sample
                defaults = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p)
                warm_up = [] if defaults.greedy else [defaults]
            seconds = scheduler.start(warm_up)
            if seconds is not None:
                log.info("warmed up %d slot(s) in %.1f s", s.n_slots, seconds)
            if self.templates is not None:
                self.templates.warm()
            self.engine, self.scheduler = engine, scheduler
            self.metrics.expose_positions(engine.max_draft if self.drafting else 0)
            log.info("model %s loaded in %.1f s: context %d, %d slot(s), %s", engine.name,
                     time.perf_counter() - started, engine.context_size, s.n_slots,
                     (f"{'DFlash and n-gram' if s.ngram and s.drafter else 'n-gram' if s.ngram else 'DFlash'} "
                      f"drafting up to {self.max_draft} tokens"
                      if self.drafting else "plain decoding"))
        except Exception as e:  # any load failure ends the server with its message
            self.load_error = e
            log.error("cannot load the model: %s", e)
            on_failure()

    @property
    def drafting(self) -> bool:
        return bool(self.settings.drafting and self.engine is not None and self.engine.drafts)

    @property
    def alias(self) -> str:
        """The model's name in /v1/models and responses: --alias, else the engine's."""
        return self.settings.alias or (self.engine.name if self.engine is not None else "")

    @property
    def max_draft(self) -> int:
        """The default draft cap: --spec-draft-n-max, at most the drafter's block size - 1."""
        if not self.drafting:
            return 0
        n_max = self.settings.spec_n_max
        return self.engine.max_draft if n_max is None else min(n_max, self.engine.max_draft)

    def request_n_max(self, requested: int | None) -> int:
        """The draft cap a request runs with: its speculative.n_max (up to the block size - 1) or the default."""
        if not self.drafting:
            return 0
        return self.max_draft if requested is None else min(requested, self.engine.max_draft)

    def require_ready(self) -> None:
        if self.engine is None:
            raise APIError(503, "Loading model")

    def key_error(self, path: str, headers: dict) -> APIError | None:
        """The 401 for a request without a valid API key, where one is needed (everywhere but /health and the
        web page's files: its script sends the key)."""
        keys = self.settings.api_keys
        if not keys or path in PUBLIC_PATHS or path.startswith("/static/"):
            return None
        header = headers.get("authorization", "")
        given = header[7:].strip() if header.lower().startswith("bearer ") else headers.get("x-api-key")
        if given is None:
            return APIError(401, "Missing API key: send 'Authorization: Bearer <key>'")
        if given not in keys:
            return APIError(401, "Invalid API Key")
        return None

    def close(self) -> None:
        """Stop the worker and the template helpers (does not wait for the worker: see Scheduler.stop)."""
        if self.scheduler is not None:
            self.scheduler.stop()
        if self.templates is not None:
            self.templates.close()


async def _send_error(send, e: APIError) -> None:
    """An error response written straight to the ASGI channel (from middleware, outside FastAPI's handlers)."""
    body = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if e.status == 500:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequireKey:
    """The API key check, before routing: it covers every route, /openapi.json and unknown paths included."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] != "OPTIONS":
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            error = self.state.key_error(scope["path"], headers)
            if error is not None:
                log.warning("%s %s %d: %s", scope["method"], scope["path"], error.status, error.message)
                return await _send_error(send, error)
        await self.app(scope, receive, send)


class InternalErrors:
    """A failure no handler expected: one log line with its traceback, and a 500 JSON error that closes the
    connection (the request may have left it in any state, and a client reusing it would get a reset). A
    response already started is left to end: its stream writes its own error event."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception as e:
            log.exception("%s %s 500", scope["method"], scope["path"])
            if not started:
                await _send_error(send, APIError(500, f"internal error: {type(e).__name__}"))


class AccessLog:
    """One log line per request: errors are logged (with their message) by the error handlers instead."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()

        async def logged_send(message):
            if message["type"] == "http.response.start":
                status = message["status"]
                if status < 400 and scope["path"] not in QUIET_PATHS:
                    log.info("%s %s %d %.0f ms", scope["method"], scope["path"], status,
                             1000 * (time.perf_counter() - started))
            await send(message)

        await self.app(scope, receive, logged_send)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _decode(raw: bytes) -> dict:
    """The body's JSON object, its every value checked (check_json) before any handler reads it."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:  # json's C decoder recurses per level, so this is far past MAX_DEPTH
        raise APIError(400, f"request body is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, bad UTF-8, NaN/Infinity, an integer of thousands of digits
        raise APIError(400, f"request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}")
    check_json(body)
    return body


INLINE_JSON_BYTES = 16 << 10  # bodies up to this size are decoded on the event loop (read_json says why)


async def read_json(request: Request, limit: int) -> dict:
    """The body as a checked JSON object; 413 past `limit` bytes (checked before and while reading), 400 if not
    JSON or not acceptable. Decoded off the event loop where it is long (a body of millions of values takes a
    while); a short one, most requests, in place: a trip through a worker thread cost about 0.35 ms of a first
    token on a 2-core CPU (docs/performance.md), the decode of 16 KiB a tenth of that."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {int(declared)} bytes is over the limit of {limit} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body is over the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # gone before its body was whole: nothing to answer
        raise _failure(ENDED, "cancelled") from None
    raw = b"".join(chunks)
    return _decode(raw) if len(raw) <= INLINE_JSON_BYTES else await asyncio.to_thread(_decode, raw)


async def _watch_disconnect(receive, on_disconnect: Callable[[], None]) -> None:
    """Call on_disconnect when the client goes away (the body has been read, so the next message is the
    disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


class EventStream(Response):
    """Server-sent events relayed from a job; a disconnect (or a failed send) cancels the job at once. A failure
    while relaying ends the stream with the format's error events (error_chunks) instead of cutting it."""

    media_type = "text/event-stream"

    def __init__(self, job: Job, chunks: AsyncIterator[bytes], error_chunks: Callable[[APIError], list[bytes]]):
        # No Response.__init__: it would declare a Content-Length for an empty body.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job
        self.chunks = chunks
        self.error_chunks = error_chunks

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.create_task(_watch_disconnect(receive, self.job.cancel))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            try:
                async for chunk in self.chunks:
                    if self.job.cancelled.is_set():
                        break
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except OSError:  # a failed send: nothing more can be sent
                raise
            except Exception as e:
                log.exception("%s %s: the stream failed", scope["method"], scope["path"])
                for chunk in self.error_chunks(APIError(500, f"internal error: {type(e).__name__}")):
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away mid-send
            pass
        finally:
            watcher.cancel()
            self.job.cancel()  # a no-op once the job has finished
            await self.chunks.aclose()


def _failure(kind: str, payload) -> APIError:
    if isinstance(payload, APIError):  # the worker's own verdict (a grammar the engine could not compile)
        return payload
    if kind == ERROR:
        return APIError(500, f"generation failed: {type(payload).__name__}: {payload}")
    if payload == "cancelled":  # nginx's 499: nobody reads it, but the log line says what happened
        return APIError(499, "the client closed the request", error_type="cancelled")
    return APIError(503, "the server is shutting down")


async def _events(job: Job, first: tuple | None = None):
    """(kind, payload, choice) triples until the job's last one (the last choice's result, or a failure);
    first: one already taken off the queue."""
    while True:
        event = first if first is not None else await job.events.get()
        first = None
        kind, payload, choice = event
        yield event
        if kind == ERROR or kind == ENDED or (kind == RESULT and choice == job.request.n - 1):
            return


async def _results(job: Job, request: Request) -> list:
    """Wait for every choice's result; a client that disconnects meanwhile cancels the job."""
    watcher = asyncio.create_task(_watch_disconnect(request.receive, job.cancel))
    results = []
    try:
        async for kind, payload, _ in _events(job):
            if kind == RESULT:
                results.append(payload)
            elif kind not in (DELTA, PROGRESS):
                raise _failure(kind, payload)
        return results
    finally:
        watcher.cancel()
        job.cancel()


async def _first_event(job: Job, request: Request) -> tuple | None:
    """For a stream whose generation can be refused when it starts (a grammar the engine cannot compile): its
    first event, taken before the response starts, so a refusal is a 400 and not an error event."""
    if job.request.params.constraint is None:
        return None
    watcher = asyncio.create_task(_watch_disconnect(request.receive, job.cancel))
    try:
        event = await job.events.get()
    finally:
        watcher.cancel()
    if event[0] in (ERROR, ENDED):
        job.cancel()
        raise _failure(event[0], event[1])
    return event


async def _parse(request: Request, parse, state: ServerState) -> tuple[dict, GenerationRequest, threading.Event]:
    """The body, the request checked (in a thread: rendering and tokenizing take a while), and its cancel flag,
    which a disconnect sets from now on: it stops a request template's rendering, then the job."""
    body = await read_json(request, state.settings.max_body_bytes)
    cancelled = threading.Event()
    watcher = asyncio.create_task(_watch_disconnect(request.receive, cancelled.set))
    try:
        gen = await asyncio.to_thread(parse, body, state.engine, state.settings, state.templates, cancelled)
    finally:
        watcher.cancel()
    if cancelled.is_set():
        raise _failure(ENDED, "cancelled")
    return body, gen, cancelled


NOT_IMPLEMENTED = {
    "/v1/embeddings": "embeddings are not supported: this server runs generative models only",
    "/embeddings": "embeddings are not supported: this server runs generative models only",
    "/infill": "infill (fill-in-the-middle) is not supported: send the prefix as a /completion prompt",
}


def create_app(state: ServerState) -> FastAPI:
    settings = state.settings
    app = FastAPI(title="flashdraft", version=__version__, docs_url=None, redoc_url=None, openapi_url="/openapi.json")

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = schemas.openapi(app)
        return app.openapi_schema

    app.openapi = openapi
    app.add_middleware(InternalErrors)
    app.add_middleware(AccessLog)
    app.add_middleware(RequireKey, state=state)
    # Browser clients on other origins, as llama-server allows.
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        if not (e.status == 503 and request.url.path in QUIET_PATHS):  # polled while loading
            log.warning("%s %s %d: %s", request.method, request.url.path, e.status, e.message)
        headers = {"Connection": "close"} if e.status == 500 else None  # see InternalErrors
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"method {request.method} not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        log.warning("%s %s %d: %s", request.method, request.url.path, e.status_code, message)
        return JSONResponse(error_body(e.status_code, message), status_code=e.status_code, headers=e.headers)

    @app.get("/health", summary="Ready or not: 503 while the model loads")
    @app.get("/v1/health", summary="Ready or not: 503 while the model loads")
    async def health():
        state.require_ready()
        return {"status": "ok"}

    async def submit(request: Request, parse) -> tuple[dict, GenerationRequest, Job]:
        state.require_ready()
        body, gen, cancelled = await _parse(request, parse, state)
        job = Job(gen, asyncio.get_running_loop(), cancelled)
        state.scheduler.submit(job)
        return body, gen, job

    async def generation(request: Request, parse, chat: bool | None):
        """chat: True/False for the OpenAI routes, None for llama.cpp's native /completion."""
        _, gen, job = await submit(request, parse)
        n_max = state.request_n_max(gen.n_max)
        tokenizer = state.engine.tokenizer
        if chat is None:
            if gen.stream:
                first = await _first_event(job, request)
                return EventStream(job, _native_stream(job, n_max, tokenizer, first),
                                   lambda e: [formats.sse(e.body())])
            (result,) = await _results(job, request)
            return formats.native_whole(gen, result, job.slot_id, n_max, tokenizer)
        fmt = formats.OpenAIFormatter(gen, chat, tokenizer)
        if gen.stream:
            first = await _first_event(job, request)
            return EventStream(job, _openai_stream(job, fmt, first),
                               lambda e: [formats.sse(e.body()), formats.sse("[DONE]")])
        return fmt.whole(await _results(job, request))

    @app.post("/v1/chat/completions", summary="OpenAI chat completion (stream or not)")
    @app.post("/chat/completions", summary="OpenAI chat completion (stream or not)")
    async def chat_completions(request: Request):
        return await generation(request, parse_chat, True)

    @app.post("/v1/completions", summary="OpenAI completion (stream or not)")
    @app.post("/completions", summary="OpenAI completion (stream or not)")
    async def completions(request: Request):
        return await generation(request, parse_completion, False)

    @app.post("/completion", summary="llama.cpp's native completion (stream or not)")
    async def native_completion(request: Request):
        return await generation(request, parse_native, None)

    @app.post("/v1/messages", summary="Anthropic's Messages API (stream or not)")
    async def messages(request: Request):
        _, gen, job = await submit(request, anthropic.parse)
        if gen.stream:
            first = await _first_event(job, request)
            builder = anthropic.AnthropicStream(gen)
            return EventStream(job, _builder_stream(job, builder, first), lambda e: [builder.error(e)])
        (result,) = await _results(job, request)
        return anthropic.whole(gen, result)

    @app.post("/v1/responses", summary="OpenAI's Responses API (stream or not)")
    async def responses(request: Request):
        body, gen, job = await submit(request, responses_api.parse)
        builder = ResponseBuilder(gen, body)
        if gen.stream:
            first = await _first_event(job, request)
            return EventStream(job, _builder_stream(job, builder, first), lambda e: [builder.error(e)])
        (result,) = await _results(job, request)
        return builder.whole(result)

    async def utility(request: Request, answer):
        state.require_ready()
        body = await read_json(request, settings.max_body_bytes)
        return await asyncio.to_thread(answer, body, state.engine, settings, state.templates)

    @app.post("/tokenize", summary="Text to token ids (and pieces)")
    async def tokenize(request: Request):
        return await utility(request, tokens.tokenize)

    @app.post("/detokenize", summary="Token ids to text")
    async def detokenize(request: Request):
        return await utility(request, tokens.detokenize)

    @app.post("/apply-template", summary="A chat rendered by the chat template, as its prompt text")
    async def apply_template(request: Request):
        return await utility(request, tokens.apply_template)

    def not_implemented(path: str):
        async def answer():
            raise APIError(501, NOT_IMPLEMENTED[path])
        return answer

    for path in NOT_IMPLEMENTED:
        app.post(path, summary="Not implemented: answers 501")(not_implemented(path))

    @app.get("/v1/models", summary="The served model")
    @app.get("/models", summary="The served model")
    async def models():
        state.require_ready()
        e = state.engine
        meta = {"n_ctx": e.context_size, "speculative": state.drafting, "max_draft": state.max_draft}
        return {"object": "list", "data": [{"id": state.alias, "object": "model", "created": state.created,
                                            "owned_by": "flashdraft", "meta": meta}]}

    @app.get("/props", summary="Server settings, llama-server's shape")
    async def props():
        state.require_ready()
        e = state.engine
        params = {"n_predict": settings.n_predict, "temperature": settings.temperature, "top_k": settings.top_k,
                  "top_p": settings.top_p, "min_p": settings.min_p, "seed": -1 if settings.seed is None else settings.seed,
                  "speculative.n_max": state.max_draft, "speculative.n_min": settings.spec_n_min,
                  "speculative.p_min": 0.0}
        slots = state.scheduler.slots_state()
        return {
            "default_generation_settings": {"id": 0, "n_ctx": e.context_size, "speculative": state.drafting,
                                            "is_processing": False, "params": params},
            "total_slots": settings.n_slots,
            "model_path": settings.model,
            "model_alias": state.alias,
            "chat_template": settings.chat_template or e.tokenizer.chat_template or "",
            "chat_template_caps": {},
            "modalities": {"vision": False, "audio": False},
            "build_info": f"flashdraft {__version__}",
            "is_sleeping": False,
            "speculative": {
                "type": "dflash" if state.drafting else "none",
                "draft_model_path": settings.drafter if state.drafting else None,
                "block_size": e.decoder.block_size if state.drafting else None,
                "n_max": state.max_draft,
                "n_min": settings.spec_n_min,
                "slots": [{"id": s["id"], "draft_policy": s.get("draft_policy")} for s in slots],
            },
        }

    @app.get("/slots", summary="Per-slot state")
    async def slots():
        state.require_ready()
        return state.scheduler.slots_state()

    @app.get("/metrics", summary="Prometheus metrics (with --metrics)")
    async def metrics():
        if not settings.metrics:
            raise APIError(501, "This server does not support metrics endpoint. Start it with `--metrics`")
        state.require_ready()
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    if settings.webui:
        @app.get("/", summary="The web chat page", response_class=FileResponse)
        async def index():
            return FileResponse(STATIC_DIR / "index.html")

        app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    return app


def _live_timings(job: Job, predicted: int, delta) -> dict:
    """The timings so far, for timings_per_token: tokens released and the time since decoding started."""
    ms = delta.predicted_ms
    return {"prompt_n": len(job.request.prompt_ids), "predicted_n": predicted, "predicted_ms": ms,
            "predicted_per_second": 1000.0 * predicted / ms if ms > 0 else 0.0}


async def _openai_stream(job: Job, fmt: formats.OpenAIFormatter, first: tuple | None):
    for chunk in fmt.first_chunks():
        yield formats.sse(chunk)
    predicted = 0
    async for kind, payload, choice in _events(job, first):
        if kind == DELTA:
            predicted += len(payload.token_ids)
            for chunk in fmt.delta_chunks(choice, payload.text, payload.logprobs):
                if job.request.timings_per_token:
                    chunk["timings"] = _live_timings(job, predicted, payload)
                yield formats.sse(chunk)
        elif kind == RESULT:
            for chunk in fmt.final_chunks(choice, payload):
                yield formats.sse(chunk)
        elif kind == PROGRESS:
            yield formats.sse(fmt.progress_chunk(payload))
        else:
            yield formats.sse(_failure(kind, payload).body())
    yield formats.sse("[DONE]")


async def _builder_stream(job: Job, builder, first: tuple | None):
    """A stream of another API's events (Anthropic's, the Responses API's): builder turns the job's text, result
    and failure into them (start, delta, finish, error)."""
    for chunk in builder.start():
        yield chunk
    async for kind, payload, _ in _events(job, first):
        if kind == PROGRESS:  # not asked for: these APIs have no such event
            continue
        chunks = (builder.delta(payload.text) if kind == DELTA else builder.finish(payload) if kind == RESULT
                  else [builder.error(_failure(kind, payload))])
        for chunk in chunks:
            yield chunk


async def _native_stream(job: Job, n_max: int, tokenizer, first: tuple | None):
    r = job.request
    predicted = 0
    async for kind, payload, _ in _events(job, first):
        if kind == DELTA:
            predicted += len(payload.token_ids)
            tokens = payload.token_ids if r.return_tokens else []
            probabilities = None
            if r.params.logprobs is not None:
                probabilities = formats.native_probabilities(tokenizer, payload.logprobs or [])
            chunk = formats.native_chunk(payload.text, job.slot_id, tokens, predicted, len(r.prompt_ids),
                                         probabilities)
            if r.timings_per_token:
                chunk["timings"] = _live_timings(job, predicted, payload)
            yield formats.sse(chunk)
        elif kind == PROGRESS:
            chunk = formats.native_chunk("", job.slot_id, [], predicted, len(r.prompt_ids))
            yield formats.sse({**chunk, "prompt_progress": payload.as_dict()})
        elif kind == RESULT:
            final = formats.native_whole(r, payload, job.slot_id, n_max, tokenizer)
            yield formats.sse({**final, "content": "", "tokens": [], "completion_probabilities": []}
                              if r.params.logprobs is not None else {**final, "content": "", "tokens": []})
        else:
            yield formats.sse(_failure(kind, payload).body())


def start_loading(state: ServerState, on_failure: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=state.load, args=(on_failure,), name="flashdraft-loader", daemon=True)
    thread.start()
    return thread
