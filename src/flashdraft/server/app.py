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
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.staticfiles import StaticFiles

from flashdraft import __version__
from flashdraft.server import formats
from flashdraft.server.errors import APIError, error_body
from flashdraft.server.jobs import DELTA, ENDED, ERROR, RESULT, Job
from flashdraft.server.metrics import ServerMetrics
from flashdraft.server.requests import GenerationRequest, parse_chat, parse_completion, parse_native
from flashdraft.server.settings import ServerSettings

log = logging.getLogger("flashdraft.server")
STATIC_DIR = Path(__file__).parent / "static"
PUBLIC_PATHS = {"/health", "/v1/health", "/models", "/v1/models"}  # llama-server asks no API key for these
QUIET_PATHS = {"/health", "/v1/health", "/metrics"}                 # polled often: not logged when they succeed


class ServerState:
    """The engine and scheduler once loaded; what the routes read."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.engine = None
        self.scheduler = None
        self.load_error: Exception | None = None
        self.created = int(time.time())
        self.metrics = ServerMetrics(lambda: (self.scheduler.busy, self.scheduler.deferred) if self.scheduler else (0, 0))

    def load(self, on_failure: Callable[[], None]) -> None:
        """Load the model and start the worker (run in a background thread)."""
        try:
            import torch

            from flashdraft.engine.generator import Engine
            from flashdraft.server.scheduler import Scheduler

            s = self.settings
            if s.threads:
                torch.set_num_threads(s.threads)
            started = time.perf_counter()
            engine = Engine.load(s.model, s.drafter, device=s.device, context_size=s.ctx_size)
            if not (s.drafting and engine.has_drafter):
                fixed_draft = 0
            else:
                fixed_draft = None if s.adaptive_draft else engine.max_draft  # capped per request by n_max
            scheduler = Scheduler(engine, s.n_slots, fixed_draft, self.metrics)
            scheduler.start()
            self.engine, self.scheduler = engine, scheduler
            self.metrics.expose_positions(engine.max_draft if self.drafting else 0)
            log.info("model %s loaded in %.1f s: context %d, %d slot(s), %s", engine.name,
                     time.perf_counter() - started, engine.context_size, s.n_slots,
                     f"DFlash drafting up to {self.max_draft} tokens" if self.drafting else "plain decoding")
        except Exception as e:  # any load failure ends the server with its message
            self.load_error = e
            log.error("cannot load the model: %s", e)
            on_failure()

    @property
    def drafting(self) -> bool:
        return bool(self.settings.drafting and self.engine is not None and self.engine.has_drafter)

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

    def authorize(self, request: Request) -> None:
        keys = self.settings.api_keys
        if not keys or request.url.path in PUBLIC_PATHS:
            return
        header = request.headers.get("authorization", "")
        given = header[7:].strip() if header.lower().startswith("bearer ") else request.headers.get("x-api-key")
        if given is None:
            raise APIError(401, "Missing API key: send 'Authorization: Bearer <key>'")
        if given not in keys:
            raise APIError(401, "Invalid API Key")


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


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object; 413 past `limit` bytes (checked before and while reading), 400 if not JSON."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {int(declared)} bytes is over the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


async def _watch_disconnect(receive, job: Job) -> None:
    """Cancel the job when the client goes away (the body has been read, so the next message is the disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


class EventStream(Response):
    """Server-sent events relayed from a job; a disconnect (or a failed send) cancels the job at once."""

    media_type = "text/event-stream"

    def __init__(self, job: Job, chunks: AsyncIterator[bytes]):
        # No Response.__init__: it would declare a Content-Length for an empty body.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job
        self.chunks = chunks

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.create_task(_watch_disconnect(receive, self.job))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.chunks:
                if self.job.cancelled.is_set():
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away mid-send
            pass
        finally:
            watcher.cancel()
            self.job.cancel()  # a no-op once the job has finished
            await self.chunks.aclose()


def _failure(kind: str, payload) -> APIError:
    if kind == ERROR:
        return APIError(500, f"generation failed: {type(payload).__name__}: {payload}")
    if payload == "cancelled":  # nginx's 499: nobody reads it, but the log line says what happened
        return APIError(499, "the client closed the request", error_type="cancelled")
    return APIError(503, "the server is shutting down")


async def _events(job: Job):
    """(kind, payload) pairs until the job's last one."""
    while True:
        kind, payload = await job.events.get()
        yield kind, payload
        if kind != DELTA:
            return


async def _result(job: Job, request: Request):
    """Wait for a whole result; a client that disconnects meanwhile cancels the job."""
    watcher = asyncio.create_task(_watch_disconnect(request.receive, job))
    try:
        async for kind, payload in _events(job):
            if kind == RESULT:
                return payload
            if kind != DELTA:
                raise _failure(kind, payload)
    finally:
        watcher.cancel()
        job.cancel()


def create_app(state: ServerState) -> FastAPI:
    settings = state.settings
    app = FastAPI(title="flashdraft", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(AccessLog)
    # Browser clients on other origins, as llama-server allows.
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        if not (e.status == 503 and request.url.path in QUIET_PATHS):  # polled while loading
            log.warning("%s %s %d: %s", request.method, request.url.path, e.status, e.message)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"method {request.method} not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        log.warning("%s %s %d: %s", request.method, request.url.path, e.status_code, message)
        return JSONResponse(error_body(e.status_code, message), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception):
        log.exception("%s %s 500", request.method, request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"), status_code=500)

    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        state.require_ready()
        return {"status": "ok"}

    async def generation(request: Request, parse, chat: bool | None):
        """chat: True/False for the OpenAI routes, None for llama.cpp's native /completion."""
        state.authorize(request)
        state.require_ready()
        body = await read_json(request, settings.max_body_bytes)
        gen: GenerationRequest = await asyncio.to_thread(parse, body, state.engine, settings)
        job = Job(gen, asyncio.get_running_loop())
        state.scheduler.submit(job)
        n_max = state.request_n_max(gen.n_max)
        if chat is None:
            if gen.stream:
                return EventStream(job, _native_stream(job, n_max))
            result = await _result(job, request)
            return formats.native_whole(gen, result, job.slot_id, n_max)
        fmt = formats.OpenAIFormatter(gen, chat)
        if gen.stream:
            return EventStream(job, _openai_stream(job, fmt))
        return fmt.whole(await _result(job, request))

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        return await generation(request, parse_chat, True)

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request):
        return await generation(request, parse_completion, False)

    @app.post("/completion")
    async def native_completion(request: Request):
        return await generation(request, parse_native, None)

    @app.get("/v1/models")
    @app.get("/models")
    async def models():
        state.require_ready()
        e = state.engine
        meta = {"n_ctx": e.context_size, "drafter": settings.drafter if state.drafting else None,
                "max_draft": state.max_draft}
        return {"object": "list", "data": [{"id": settings.alias, "object": "model", "created": state.created,
                                            "owned_by": "flashdraft", "meta": meta}]}

    @app.get("/props")
    async def props(request: Request):
        state.authorize(request)
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
            "model_alias": settings.alias,
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

    @app.get("/slots")
    async def slots(request: Request):
        state.authorize(request)
        state.require_ready()
        return state.scheduler.slots_state()

    @app.get("/metrics")
    async def metrics(request: Request):
        if not settings.metrics:
            raise APIError(501, "This server does not support metrics endpoint. Start it with `--metrics`")
        state.authorize(request)
        state.require_ready()
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    if settings.webui:
        @app.get("/")
        async def index():
            return FileResponse(STATIC_DIR / "index.html")

        app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    return app


async def _openai_stream(job: Job, fmt: formats.OpenAIFormatter):
    first = fmt.first_chunk()
    if first is not None:
        yield formats.sse(first)
    async for kind, payload in _events(job):
        if kind == DELTA:
            if payload.text:
                yield formats.sse(fmt.text_chunk(payload.text))
        elif kind == RESULT:
            for chunk in fmt.final_chunks(payload):
                yield formats.sse(chunk)
        else:
            yield formats.sse(_failure(kind, payload).body())
    yield formats.sse("[DONE]")


async def _native_stream(job: Job, n_max: int):
    r = job.request
    predicted = 0
    async for kind, payload in _events(job):
        if kind == DELTA:
            predicted += len(payload.token_ids)
            tokens = payload.token_ids if r.return_tokens else []
            yield formats.sse(formats.native_chunk(payload.text, job.slot_id, tokens, predicted, len(r.prompt_ids)))
        elif kind == RESULT:
            final = formats.native_whole(r, payload, job.slot_id, n_max)
            yield formats.sse({**final, "content": "", "tokens": []})
        else:
            yield formats.sse(_failure(kind, payload).body())


def start_loading(state: ServerState, on_failure: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=state.load, args=(on_failure,), name="flashdraft-loader", daemon=True)
    thread.start()
    return thread
