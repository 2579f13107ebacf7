"""Anthropic's Messages API (POST /v1/messages) over the chat pipeline.

A request becomes an OpenAI chat body (system, text blocks, tool_use / tool_result blocks as tool calls and tool
messages, tools with input_schema, tool_choice auto/any/tool/none, stop_sequences), parsed as any chat; the
result comes back as Anthropic content blocks (thinking, text, tool_use) and, streamed, as its event sequence
(message_start, content_block_start/delta/stop, message_delta, message_stop).
"""
from __future__ import annotations

import json
import uuid

from flashdraft.server.errors import APIError, bad_field
from flashdraft.server.formats import ChatSplitter, chat_message, json_object
from flashdraft.server.requests import GenerationRequest, joined_text, parse_as_chat, refuse_fields

# Fields refused unless absent (or neutral): what they ask for is not done here.
REFUSED = {"mcp_servers": (), "container": (), "service_tier": ("auto", "standard_only")}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def _message(i: int, m) -> list[tuple[dict, str]]:
    """One Anthropic message as OpenAI chat messages (tool results become tool messages), each with the field
    it came from."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise bad_field(f"{where}.role", "must be user or assistant")
    content = m.get("content")
    if isinstance(content, str):
        return [({"role": m["role"], "content": content}, where)]
    if not isinstance(content, list):
        raise bad_field(f"{where}.content", "must be a string or a list of content blocks")
    text, calls, results, thinking = [], [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and m["role"] == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise bad_field(at, "must have a name and an input object")
            calls.append({"id": str(block.get("id") or ""), "type": "function",
                          "function": {"name": block["name"], "arguments": block.get("input", {})}})
        elif kind == "tool_result" and m["role"] == "user":
            results.append(({"role": "tool", "tool_call_id": str(block.get("tool_use_id") or ""),
                             "content": joined_text(block.get("content", ""), f"{at}.content", ("text",))}, at))
        elif kind == "thinking" and m["role"] == "assistant":
            if not isinstance(block.get("thinking"), str):
                raise bad_field(f"{at}.thinking", "must be a string")
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking" and m["role"] == "assistant":
            continue  # encrypted by another server: nothing a template can show
        else:
            raise bad_field(at, f"is a block of type {str(kind)[:40]!r}: only text, tool_use (assistant), tool_result "
                           "(user) and thinking (assistant) blocks are supported")
    out = list(results)
    if text or calls or not results:
        message = {"role": m["role"], "content": "".join(text)}
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["reasoning_content"] = "".join(thinking)
        out.append((message, where))
    return out


def _tool_choice(choice):
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise bad_field("tool_choice", "must be {'type': 'auto' | 'any' | 'tool' | 'none'}")
    if choice["type"] == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad_field("tool_choice.name", "is required with type 'tool'")
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("disable_parallel_tool_use") not in (None, False):
        raise bad_field("tool_choice.disable_parallel_tool_use", "is not supported")
    return {"auto": "auto", "any": "required", "none": "none"}[choice["type"]]


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise bad_field("tools", "must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or tool.get("type") not in (None,
                                                                                                            "custom"):
            raise bad_field(f"tools[{i}]", "must be a custom tool with a name and an input_schema: server tools are not "
                                      "supported")
        function = {"name": tool["name"], "parameters": tool.get("input_schema", {"type": "object"})}
        for key in ("description", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def _thinking(body: dict) -> bool | None:
    """thinking's type as enable_thinking (None: not sent). Its budget_tokens cannot be enforced here (only
    max_tokens bounds the thought), so a budget below max_tokens is refused."""
    thinking = body.get("thinking")
    if thinking is None:
        return None
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled"):
        raise bad_field("thinking", "must be {'type': 'enabled' | 'disabled'}")
    budget = thinking.get("budget_tokens")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int):
            raise bad_field("thinking.budget_tokens", "must be an integer")
        if isinstance(body["max_tokens"], int) and budget < body["max_tokens"]:
            raise bad_field("thinking.budget_tokens", f"is {budget}, below max_tokens ({body['max_tokens']}): a "
                                                      "thinking budget cannot be enforced by this server, only "
                                                      "max_tokens bounds the thought; leave it out or send one of "
                                                      "at least max_tokens")
    return thinking["type"] == "enabled"


def chat_body(body: dict) -> tuple[dict, dict[str, str]]:
    """The OpenAI chat body a Messages request stands for, and the chat's field names mapped to the request's
    (for the chat parser's errors)."""
    refuse_fields(body, REFUSED, "by this server")
    if body.get("max_tokens") is None:
        raise bad_field("max_tokens", "is required")
    thinking = _thinking(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_field("messages", "must be a non-empty list")
    chat = [pair for i, m in enumerate(messages) for pair in _message(i, m)]
    if body.get("system") is not None:
        chat.insert(0, ({"role": "system", "content": joined_text(body["system"], "system", ("text",))}, "system"))
    names = {f"messages[{j}]": source for j, (_, source) in enumerate(chat)}
    names.update({"stop": "stop_sequences", "chat_template_kwargs.enable_thinking": "thinking"})
    out = {"messages": [m for m, _ in chat], "max_tokens": body["max_tokens"]}
    for key in ("temperature", "top_p", "top_k", "stream", "model"):
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("stop_sequences") is not None:
        out["stop"] = body["stop_sequences"]
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
        for i in range(len(out["tools"])):
            names.update({f"tools[{i}].function.parameters": f"tools[{i}].input_schema",
                          f"tools[{i}].function": f"tools[{i}]"})
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    if thinking is not None:
        out["chat_template_kwargs"] = {"enable_thinking": thinking}
    return out, names


def parse(body: dict, *args) -> GenerationRequest:
    """POST /v1/messages, parsed as the chat it stands for (args: parse_chat's after the body)."""
    return parse_as_chat(chat_body, body, *args)


def _usage(result, output_tokens: int | None = None) -> dict:
    s = result.stats
    return {"input_tokens": s.prompt_n, "output_tokens": s.predicted_n if output_tokens is None else output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": s.cache_n}


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


    def error(self, e: APIError) -> bytes:
        return event("error", {"type": "error", "error": {"type": e.error_type, "message": e.message}})
