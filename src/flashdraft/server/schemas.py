"""The OpenAPI description of every route, served at /openapi.json (for clients, and for the fuzz test that
drives every route from it).

The handlers parse bodies themselves (requests.py: errors in OpenAI's shape, limits checked before any work),
so the request models here only describe; tests check that they name exactly the fields the parsers read.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

from flashdraft.server.requests import MAX_MODEL_CHARS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TEMPLATE_CHARS


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # other keys (name, reasoning_content, ...) reach the template
    role: str
    content: str | list[TextPart] | None = None


class StreamOptions(BaseModel):
    include_usage: bool | None = None


StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class Sampling(BaseModel):
    """Fields every generation route reads."""

    model_config = ConfigDict(populate_by_name=True)
    model: str | None = Field(None, max_length=MAX_MODEL_CHARS, description="echoed back; any label is accepted")
    temperature: float | None = Field(None, ge=0, description="0 (or below 1e-5) = greedy")
    top_k: int | None = Field(None, ge=0, description="0 = off")
    top_p: float | None = Field(None, gt=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, description="a negative seed = a random one")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool | None = None
    ignore_eos: bool | None = None
    timings_per_token: bool | None = Field(None, description="every stream chunk carries the timings so far")
    speculative_n_max: int | None = Field(None, alias="speculative.n_max", ge=0, description="longest draft")
    speculative_n_min: int | None = Field(None, alias="speculative.n_min", ge=0,
                                          description="shorter drafts are skipped")


class ChatCompletionRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: Literal[1] | None = None
    stream_options: StreamOptions | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra template variables (enable_thinking, ...); `chat_template` only when the server "
                          "runs with --allow-request-chat-template")
    chat_template: str | None = Field(None, max_length=MAX_TEMPLATE_CHARS,
                                      description="only when the server runs with --allow-request-chat-template")


Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(Sampling):
    prompt: Prompt = Field(description="text, token ids, or a one-element list of either")
    max_tokens: int | None = Field(None, ge=1)
    n: Literal[1] | None = None
    stream_options: StreamOptions | None = None


class NativeCompletionRequest(Sampling):
    prompt: Prompt
    n_predict: int | None = Field(None, ge=-1, description="-1 = until the context is full")
    max_tokens: int | None = Field(None, ge=-1)
    return_tokens: bool | None = None


class ErrorDetail(BaseModel):
    code: int
    message: str
    type: str
    param: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class Health(BaseModel):
    status: Literal["ok"]


class Completion(Loose):
    """OpenAI's chat.completion / text_completion (or, streamed, server-sent chunks ending with [DONE]), with
    llama.cpp's `timings` and `speculative_decoding`."""

    id: str
    object: str
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None


class NativeCompletion(Loose):
    content: str
    stop: bool
    timings: dict[str, Any] | None = None


class ModelList(Loose):
    object: Literal["list"]
    data: list[dict[str, Any]]


REQUESTS = {"/v1/chat/completions": ChatCompletionRequest, "/chat/completions": ChatCompletionRequest,
            "/v1/completions": CompletionRequest, "/completions": CompletionRequest,
            "/completion": NativeCompletionRequest}
RESPONSES = {"/v1/chat/completions": Completion, "/chat/completions": Completion, "/v1/completions": Completion,
             "/completions": Completion, "/completion": NativeCompletion, "/health": Health, "/v1/health": Health,
             "/v1/models": ModelList, "/models": ModelList, "/props": Loose}
ERRORS = {"400": "invalid request (the message names the field)", "401": "missing or wrong API key",
          "413": "body over the size limit", "499": "the client closed the request",
          "500": "internal error (the connection is closed)", "501": "not enabled on this server",
          "503": "model loading, or the server shutting down"}


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel]) -> dict:
    return {"application/json": {"schema": _ref(model)}}


def openapi(app) -> dict:
    """FastAPI's description of the routes, with the request and response bodies filled in."""
    spec = get_openapi(title=app.title, version=app.version, routes=app.routes,
                       description="OpenAI- and llama-server-compatible API with DFlash speculative decoding.")
    models = [ChatCompletionRequest, CompletionRequest, NativeCompletionRequest, ErrorResponse, Health, Completion,
              NativeCompletion, ModelList, Loose]
    _, defs = models_json_schema([(m, "validation") for m in models], by_alias=True,
                                 ref_template="#/components/schemas/{model}")
    spec.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
    for path, operations in spec["paths"].items():
        for operation in operations.values():
            if path in REQUESTS:
                operation["requestBody"] = {"required": True, "content": _json(REQUESTS[path])}
            ok = operation["responses"]["200"]
            if path in RESPONSES:
                ok["content"] = _json(RESPONSES[path])
            codes = ERRORS if path in REQUESTS else ("401", "500", "503") + (("501",) if path == "/metrics" else ())
            for code in codes:
                operation["responses"].setdefault(code, {"description": ERRORS[code], "content": _json(ErrorResponse)})
    if any(getattr(route, "path", None) == "/static" for route in app.routes):
        spec["paths"]["/static/{file}"] = {"get": {
            "summary": "The web page's scripts and styles", "operationId": "static",
            "parameters": [{"name": "file", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {"description": "the file"}, "404": {"description": "no such file"}}}}
    return spec
