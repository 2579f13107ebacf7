"""Anthropic's Messages API (POST /v1/messages) over the chat pipeline.

A request becomes an OpenAI chat body (system, text blocks, tool_use / tool_result blocks as tool calls and tool
messages, tools with input_schema, tool_choice auto/any/tool/none, stop_sequences), parsed as any chat; the
result comes back as Anthropic content blocks (thinking, text, tool_use) and, streamed, as its event sequence
(message_start, content_block_start/delta/stop, message_delta, message_stop).
"""
from __future__ import annotations

import json
import uuid

from flashdraft.server.errors import APIError
from flashdraft.server.formats import ChatSplitter, chat_message
from flashdraft.server.requests import GenerationRequest
from flashdraft.server.tools import json_object

# Fields refused unless absent (or neutral): what they ask for is not done here.
REFUSED = {"mcp_servers": (), "container": (), "service_tier": ("auto", "standard_only")}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def _bad(field: str, message: str) -> APIError:
    return APIError(400, f"'{field}' {message}", param=field)


def _text(content, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "must be a string or a list of content blocks")
    parts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise _bad(f"{where}[{j}]", "must be a text block: only text (and tool) blocks are supported")
        parts.append(block["text"])
    return "".join(parts)


def _message(i: int, m) -> list[dict]:
    """One Anthropic message as OpenAI chat messages (tool results become tool messages)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise _bad(f"{where}.role", "must be user or assistant")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content", "must be a string or a list of content blocks")
    text, calls, results, thinking = [], [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and m["role"] == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise _bad(at, "must have a name and an input object")
            calls.append({"id": str(block.get("id") or ""), "type": "function",
                          "function": {"name": block["name"], "arguments": block.get("input", {})}})
        elif kind == "tool_result" and m["role"] == "user":
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id") or ""),
                            "content": _text(block.get("content", ""), f"{at}.content")})
        elif kind == "thinking" and m["role"] == "assistant":
            if not isinstance(block.get("thinking"), str):
                raise _bad(f"{at}.thinking", "must be a string")
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking" and m["role"] == "assistant":
            continue  # encrypted by another server: nothing a template can show
        else:
            raise _bad(at, f"is a block of type {str(kind)[:40]!r}: only text, tool_use (assistant), tool_result "
                           "(user) and thinking (assistant) blocks are supported")
    out = list(results)
    if text or calls or not results:
        message = {"role": m["role"], "content": "".join(text)}
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["reasoning_content"] = "".join(thinking)
        out.append(message)
    return out


def _tool_choice(choice):
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise _bad("tool_choice", "must be {'type': 'auto' | 'any' | 'tool' | 'none'}")
    if choice["type"] == "tool":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice.name", "is required with type 'tool'")
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("disable_parallel_tool_use") not in (None, False):
        raise _bad("tool_choice.disable_parallel_tool_use", "is not supported")
    return {"auto": "auto", "any": "required", "none": "none"}[choice["type"]]


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or tool.get("type") not in (None,
                                                                                                            "custom"):
            raise _bad(f"tools[{i}]", "must be a custom tool with a name and an input_schema: server tools are not "
                                      "supported")
        function = {"name": tool["name"], "parameters": tool.get("input_schema", {"type": "object"})}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_body(body: dict) -> dict:
    """The OpenAI chat body a Messages request stands for."""
    for key, neutral in REFUSED.items():
        if body.get(key) not in (None, *neutral) and body.get(key) != []:
            raise _bad(key, "is not supported by this server")
    thinking = body.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict) or thinking.get("type") not in ("enabled",
                                                                                                "disabled")):
        raise _bad("thinking", "must be {'type': 'enabled' | 'disabled'}")
    if body.get("max_tokens") is None:
        raise _bad("max_tokens", "is required")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list")
    chat = [m for i, m in enumerate(messages) for m in _message(i, m)]
    if body.get("system") is not None:
        chat.insert(0, {"role": "system", "content": _text(body["system"], "system")})
    out = {"messages": chat, "max_tokens": body["max_tokens"]}
    for key in ("temperature", "top_p", "top_k", "stream", "model"):
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("stop_sequences") is not None:
        out["stop"] = body["stop_sequences"]
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    if thinking is not None:
        out["chat_template_kwargs"] = {"enable_thinking": thinking["type"] == "enabled"}
    return out


def _usage(result, output_tokens: int | None = None) -> dict:
    s = result.stats
    return {"input_tokens": s.prompt_n, "output_tokens": s.predicted_n if output_tokens is None else output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def _stop(result, calls) -> tuple[str, str | None]:
    """stop_reason and stop_sequence; max_tokens whenever the output was cut, even after whole calls."""
    if calls and result.finish_reason != "length":
        return "tool_use", None
    if result.stop_type == "word":
        return "stop_sequence", result.stopping_word
    return STOP_REASONS.get(result.finish_reason, "end_turn"), None


def _tool_use(call) -> dict:
    """A tool_use block. The parsers make only calls whose arguments are a JSON object; anything else would be an
    empty input, never an error after the work is done."""
    return {"type": "tool_use", "id": f"toolu_{call.id[5:]}", "name": call.name,
            "input": json_object(call.arguments) or {}}


def _envelope(request: GenerationRequest, message_id: str) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": request.model, "content": []}


def whole(request: GenerationRequest, result) -> dict:
    message = chat_message(request, result.text)
    content = []
    if message.reasoning:
        content.append({"type": "thinking", "thinking": message.reasoning, "signature": ""})
    text = message.content.strip() if message.tool_calls else message.content
    if text or not message.tool_calls:
        content.append({"type": "text", "text": text})
    content += [_tool_use(c) for c in message.tool_calls]
    reason, sequence = _stop(result, message.tool_calls)
    return {**_envelope(request, f"msg_{uuid.uuid4().hex[:24]}"), "content": content, "stop_reason": reason,
            "stop_sequence": sequence, "usage": _usage(result)}


def event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, allow_nan=False)}\n\n".encode()


class AnthropicStream:
    """A job's events as Anthropic's stream: a block opens when text of another kind (thinking, text) starts,
    tool_use blocks come whole at the end."""

    def __init__(self, request: GenerationRequest):
        self.request = request
        self.splitter = ChatSplitter(request)
        self.block: str | None = None  # the open block's type
        self.index = -1

    def start(self) -> list[bytes]:
        message = {**_envelope(self.request, f"msg_{uuid.uuid4().hex[:24]}"), "stop_reason": None,
                   "stop_sequence": None, "usage": {"input_tokens": len(self.request.prompt_ids), "output_tokens": 0}}
        return [event("message_start", {"type": "message_start", "message": message}),
                event("ping", {"type": "ping"})]

    def _close(self) -> list[bytes]:
        if self.block is None:
            return []
        self.block = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _open(self, kind: str) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.block = kind
        start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
            {"type": "text", "text": ""}
        return out + [event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                    "content_block": start})]

    def _write(self, kind: str, text: str) -> list[bytes]:
        if not text:
            return []
        out = self._open(kind) if self.block != kind else []
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
            {"type": "text_delta", "text": text}
        out.append(event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}))
        return out

    def delta(self, text: str) -> list[bytes]:
        reasoning, content = self.splitter.feed(text)
        return self._write("thinking", reasoning) + self._write("text", content)

    def finish(self, result) -> list[bytes]:
        reasoning, content, calls = self.splitter.finish()
        out = self._write("thinking", reasoning) + self._write("text", content.rstrip() if calls else content)
        if self.index < 0 and not calls:
            out += self._open("text")  # an empty answer still has its (empty) text block
        out += self._close()
        for call in calls:
            self.index += 1
            use = _tool_use(call)
            out.append(event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                     "content_block": {**use, "input": {}}}))
            out.append(event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(use["input"], ensure_ascii=False)}}))
            out.append(event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        reason, sequence = _stop(result, calls)
        out.append(event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                                                                              "stop_sequence": sequence},
                                           "usage": _usage(result)}))
        out.append(event("message_stop", {"type": "message_stop"}))
        return out


def error_event(e: APIError) -> bytes:
    return event("error", {"type": "error", "error": {"type": e.error_type, "message": e.message}})
