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

from flashdraft.server.requests import (MAX_CHOICES, MAX_GRAMMAR_CHARS, MAX_MODEL_CHARS, MAX_STOP_CHARS,
                                       MAX_STOP_STRINGS, MAX_TEMPLATE_CHARS, MAX_TOP_LOGPROBS)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any] = Field(description="JSON text (OpenAI) or an object")


class ToolCallItem(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # other keys (name, reasoning_content, ...) reach the template
    role: str = Field(description="system, user, assistant, tool, ...")
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallItem] | None = Field(None, description="an assistant's past calls")
    tool_call_id: str | None = Field(None, description="a tool message's call")


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema")


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedTool(BaseModel):
    type: Literal["function"]
    function: dict[str, str] = Field(description="{'name': ...}")


class JSONSchemaFormat(BaseModel):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="llama.cpp's, with json_object")


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
    cache_prompt: bool | None = Field(None, description="reuse the slot's cached prefix of the prompt (default true)")
    return_progress: bool | None = Field(None, description="a stream reports the prompt's processing after each "
                                                           "prefill pass (prompt_progress)")
    n_keep: int | None = Field(None, ge=-1, description="prompt tokens a context shift keeps (-1: all; default "
                                                        "--keep); shifts happen only with --context-shift")
    speculative_n_max: int | None = Field(None, alias="speculative.n_max", ge=0, description="longest draft")
    speculative_n_min: int | None = Field(None, alias="speculative.n_min", ge=0,
                                          description="shorter drafts are skipped")
    logit_bias: dict[str, float | Literal[False]] | list[list[int | str | float | bool]] | None = Field(
        None, description="token id -> bias in [-100, 100] (false bans), or llama.cpp's [[id or text, bias], ...]")
    repeat_penalty: float | None = Field(None, gt=0, description="llama.cpp's; 1 = off")
    repeat_last_n: int | None = Field(None, ge=-1, description="tokens the repeat penalty looks back; -1 = all")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    response_format: ResponseFormat | None = None
    grammar: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS, description="a GBNF grammar (llama.cpp)")
    json_schema: dict[str, Any] | None = Field(None, description="llama.cpp's: output matching this schema")


class ChatCompletionRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, description="choices, generated one after another")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    functions: list[FunctionDefinition] | None = Field(None, description="legacy: tools")
    function_call: Literal["none", "auto"] | dict[str, str] | None = Field(None, description="legacy: tool_choice")
    parallel_tool_calls: bool | None = None
    reasoning_format: Literal["none", "deepseek", "auto"] | None = Field(
        None, description="none: thinking stays in content; else it goes to reasoning_content")
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
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES, description="must equal n")
    echo: bool | None = Field(None, description="the prompt before each choice's text (not with logprobs)")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    stream_options: StreamOptions | None = None


class NativeCompletionRequest(Sampling):
    prompt: Prompt
    n_predict: int | None = Field(None, ge=-1, description="-1 = until the context is full")
    max_tokens: int | None = Field(None, ge=-1)
    return_tokens: bool | None = None
    n_probs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="completion_probabilities")


class AnthropicMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]] = Field(description="text, tool_use (assistant), tool_result (user) and "
                                                            "thinking blocks")


class AnthropicTool(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class MessagesRequest(BaseModel):
    """Anthropic's Messages API."""

    model: str | None = Field(None, max_length=MAX_MODEL_CHARS)
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextPart] | None = None
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = Field(None, description="{'type': 'auto' | 'any' | 'tool' | 'none'}")
    thinking: dict[str, Any] | None = Field(None, description="{'type': 'enabled' | 'disabled'}")


class ResponseTool(BaseModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ResponsesRequest(BaseModel):
    """OpenAI's Responses API (nothing stored)."""

    model: str | None = Field(None, max_length=MAX_MODEL_CHARS)
    input: str | list[dict[str, Any]] = Field(description="text, or message / function_call / "
                                                          "function_call_output items")
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = Field(None, description="{'format': {'type': 'text' | 'json_object' | "
                                                          "'json_schema', ...}}")
    store: Literal[False] | None = None


class TokenizeRequest(BaseModel):
    content: str
    add_special: bool | None = None
    with_pieces: bool | None = None


class DetokenizeRequest(BaseModel):
    tokens: list[int]


class ApplyTemplateRequest(BaseModel):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


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
            "/completion": NativeCompletionRequest, "/v1/messages": MessagesRequest, "/v1/responses": ResponsesRequest,
            "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest, "/apply-template": ApplyTemplateRequest}
RESPONSES = {"/v1/chat/completions": Completion, "/chat/completions": Completion, "/v1/completions": Completion,
             "/completions": Completion, "/completion": NativeCompletion, "/health": Health, "/v1/health": Health,
             "/v1/models": ModelList, "/models": ModelList, "/props": Loose, "/v1/messages": Loose,
             "/v1/responses": Loose, "/tokenize": Loose, "/detokenize": Loose, "/apply-template": Loose}
NOT_IMPLEMENTED = ("/v1/embeddings", "/embeddings", "/infill")
ERRORS = {"400": "invalid request (the message names the field)", "401": "missing or wrong API key",
          "413": "body over the size limit", "499": "the client closed the request",
          "500": "internal error (the connection is closed)", "501": "not enabled or not implemented on this server",
          "503": "model loading, or the server shutting down"}


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel]) -> dict:
    return {"application/json": {"schema": _ref(model)}}


def openapi(app) -> dict:
    """FastAPI's description of the routes, with the request and response bodies filled in."""
    spec = get_openapi(title=app.title, version=app.version, routes=app.routes,
                       description="OpenAI- and llama-server-compatible API with DFlash speculative decoding.")
    models = [*dict.fromkeys(REQUESTS.values()), ErrorResponse, Health, Completion, NativeCompletion, ModelList,
              Loose]
    _, defs = models_json_schema([(m, "validation") for m in models], by_alias=True,
                                 ref_template="#/components/schemas/{model}")
    spec.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
    for path, operations in spec["paths"].items():
        for operation in operations.values():
            if path in REQUESTS:
                operation["requestBody"] = {"required": True, "content": _json(REQUESTS[path])}
            if path in RESPONSES:
                operation["responses"]["200"]["content"] = _json(RESPONSES[path])
            codes = ERRORS if path in REQUESTS else ("401", "500", "503") + (
                ("501",) if path == "/metrics" or path in NOT_IMPLEMENTED else ())
            if path in NOT_IMPLEMENTED:
                operation["responses"].pop("200", None)
            for code in codes:
                operation["responses"].setdefault(code, {"description": ERRORS[code], "content": _json(ErrorResponse)})
    if any(getattr(route, "path", None) == "/static" for route in app.routes):
        spec["paths"]["/static/{file}"] = {"get": {
            "summary": "The web page's scripts and styles", "operationId": "static",
            "parameters": [{"name": "file", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {"description": "the file"}, "404": {"description": "no such file"}}}}
    return spec
