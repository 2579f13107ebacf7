"""OpenAI's Responses API (POST /v1/responses) over the chat pipeline.

input (a string, or message / function_call / function_call_output items) and instructions become a chat;
max_output_tokens, tools (flat function definitions), tool_choice and text.format map to their chat fields. The
result is a response object whose output holds reasoning, message and function_call items; streamed, it is the
API's event sequence (response.created ... response.completed). Nothing is stored: previous_response_id and
store: true are refused.
"""
from __future__ import annotations

import json
import time
import uuid

from flashdraft.server.errors import APIError, bad_field
from flashdraft.server.formats import ChatSplitter, chat_message
from flashdraft.server.requests import GenerationRequest, joined_text, parse_as_chat, refuse_fields

# Fields refused unless absent (or neutral): nothing is stored, there are no reasoning settings, no log
# probabilities in output items, no cap on the calls, no truncation of the input.
REFUSED = {"previous_response_id": (), "store": (False,), "background": (False,), "conversation": (),
           "prompt": (), "include": (), "reasoning": (), "top_logprobs": (0,), "max_tool_calls": (),
           "truncation": ("disabled",)}
TEXT_PARTS = ("input_text", "output_text", "text")
MAX_METADATA = 16


def _messages(items) -> list[tuple[dict, str]]:
    """The input as chat messages, each with the item it came from."""
    if isinstance(items, str):
        return [({"role": "user", "content": items}, "input")]
    if not isinstance(items, list) or not items:
        raise bad_field("input", "must be a string or a non-empty list of items")
    out: list[tuple[dict, str]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "assistant", "system", "developer"):
            content = joined_text(item.get("content", ""), f"{where}.content", TEXT_PARTS)
            out.append(({"role": item["role"], "content": content}, where))
        elif kind == "function_call" and isinstance(item.get("name"), str):
            call = {"id": str(item.get("call_id") or ""), "type": "function", "item": where,
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            last = out[-1][0] if out else None
            if last is not None and last["role"] == "assistant" and not last["content"]:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append(({"role": "assistant", "content": "", "tool_calls": [call]}, where))
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(({"role": "tool", "tool_call_id": str(item.get("call_id") or ""),
                         "content": output if isinstance(output, str) else json.dumps(output)}, where))
        elif kind == "reasoning":
            continue  # a past turn's thinking: templates drop it from the history
        else:
            raise bad_field(where, "must be a message (user, assistant, system, developer), function_call, "
                                   "function_call_output or reasoning item")
    return out


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise bad_field("tools", "must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise bad_field(f"tools[{i}]", "must be a function tool ({'type': 'function', 'name': ..., 'parameters': "
                                      "...}): built-in tools are not supported")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice):
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_field("tool_choice", "must be none, auto, required or {'type': 'function', 'name': ...}")


def _format(text) -> dict | None:
    """text.format as a chat response_format (text.verbosity: only its default, medium)."""
    if not isinstance(text, dict):
        raise bad_field("text", "must be an object")
    if text.get("verbosity") not in (None, "medium"):
        raise bad_field("text.verbosity", f"is not supported by this server (got {str(text['verbosity'])[:40]!r}): "
                                          "answers are as long as the model writes them")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_field("text.format", "must be an object")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return {"type": fmt.get("type")}


def _metadata(value) -> dict:
    """metadata: up to 16 string values under keys of at most 64 characters, echoed back (nothing is stored)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in value.items()):
        raise bad_field("metadata", f"must be an object of at most {MAX_METADATA} strings (keys up to 64 characters, "
                                    "values up to 512)")
    return value


def chat_body(body: dict) -> tuple[dict, dict[str, str]]:
    """The OpenAI chat body a Responses request stands for, and the chat's field names mapped to the request's
    (for the chat parser's errors)."""
    refuse_fields(body, REFUSED, "by this server")
    _metadata(body.get("metadata"))
    if "input" not in body:
        raise bad_field("input", "is required")
    messages = _messages(body["input"])
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise bad_field("instructions", "must be a string")
        messages.insert(0, ({"role": "system", "content": body["instructions"]}, "instructions"))
    names = {f"messages[{j}]": source for j, (_, source) in enumerate(messages)}
    for j, (message, _) in enumerate(messages):  # a call's own item, when calls were merged into one message
        names.update({f"messages[{j}].tool_calls[{k}].function": call.pop("item")
                      for k, call in enumerate(message.get("tool_calls", []))})
    names.update({"messages": "input", "max_tokens": "max_output_tokens",
                  "response_format.json_schema.schema": "text.format.schema",
                  "response_format.json_schema": "text.format", "response_format": "text.format"})
    out = {"messages": [m for m, _ in messages]}
    for key in ("temperature", "top_p", "stream", "model", "parallel_tool_calls"):
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
        names.update({f"tools[{i}].function": f"tools[{i}]" for i in range(len(out["tools"]))})
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("text") is not None:
        response_format = _format(body["text"])
        if response_format is not None:
            out["response_format"] = response_format
    return out, names


def parse(body: dict, *args) -> GenerationRequest:
    """POST /v1/responses, parsed as the chat it stands for (args: parse_chat's after the body)."""
    return parse_as_chat(chat_body, body, *args)


def _items(message) -> list[dict]:
    items = []
    if message.reasoning:
        items.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex[:24]}", "summary": [],
                      "content": [{"type": "reasoning_text", "text": message.reasoning}]})
    text = message.content.strip() if message.tool_calls else message.content
    if text or not message.tool_calls:
        items.append(_message_item(text))
    items += [_call_item(c) for c in message.tool_calls]
    return items


def _message_item(text: str, status: str = "completed") -> dict:
    """A message item: completed with its text, or in progress (streamed) with no content yet."""
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _call_item(call) -> dict:
    return {"type": "function_call", "id": f"fc_{call.id[5:]}", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": "completed"}


class ResponseBuilder:
    """The response object of one request, and its stream of events."""

    def __init__(self, request: GenerationRequest, body: dict):
        self.request = request
        self.id = f"resp_{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.echo = {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
                     "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
                     "parallel_tool_calls": body.get("parallel_tool_calls", True),
                     "temperature": request.params.temperature, "top_p": request.params.top_p,
                     "text": body.get("text") or {"format": {"type": "text"}}, "metadata": _metadata(body.get("metadata"))}
        self.sequence = 0
        self.splitter = ChatSplitter(request)
        self.text_item: dict | None = None
        self.output: list[dict] = []
        self.reasoning = ""

    def response(self, status: str, output: list[dict], result=None) -> dict:
        body = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.request.model, "output": output, "error": None, "incomplete_details": None,
                "store": False, **self.echo, "usage": None}
        if result is not None:
            s = result.stats
            body["usage"] = {"input_tokens": s.prompt_tokens, "output_tokens": s.predicted_n,
                             "total_tokens": s.prompt_tokens + s.predicted_n, "input_tokens_details": {"cached_tokens": s.cache_n},
                             "output_tokens_details": {"reasoning_tokens": 0}}
            if result.finish_reason == "length":
                body["status"], body["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        return body

    def whole(self, result) -> dict:
        return self.response("completed", _items(chat_message(self.request, result.text)), result)

    def _event(self, kind: str, **data) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n".encode()

    def start(self) -> list[bytes]:
        return [self._event("response.created", response=self.response("in_progress", [])),
                self._event("response.in_progress", response=self.response("in_progress", []))]

    def _add(self, item: dict) -> tuple[int, list[bytes]]:
        """A new output item: its index and its output_item.added event."""
        self.output.append(item)
        index = len(self.output) - 1
        return index, [self._event("response.output_item.added", output_index=index, item=item)]

    def _flush_reasoning(self) -> list[bytes]:
        """The thought as one reasoning item, once it is whole (content starts, or the output ends)."""
        text, self.reasoning = self.reasoning, ""
        if not text:
            return []
        item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex[:24]}", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}
        index, out = self._add(item)
        return out + [self._event("response.output_item.done", output_index=index, item=item)]

    def _open_text(self) -> list[bytes]:
        out = self._flush_reasoning()
        item = _message_item("", "in_progress")
        index, added = self._add(item)
        self.text_item = {"index": index, "id": item["id"], "text": ""}
        return out + added + [self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                          content_index=0, part={"type": "output_text", "text": "",
                                                                 "annotations": []})]

    def _text(self, text: str) -> list[bytes]:
        if not text:
            return []
        out = self._open_text() if self.text_item is None else []
        self.text_item["text"] += text
        return out + [self._event("response.output_text.delta", item_id=self.text_item["id"],
                                  output_index=self.text_item["index"], content_index=0, delta=text, logprobs=[])]

    def delta(self, text: str) -> list[bytes]:
        reasoning, content = self.splitter.feed(text)
        self.reasoning += reasoning
        return self._text(content)

    def finish(self, result) -> list[bytes]:
        reasoning, content, calls = self.splitter.finish()
        self.reasoning += reasoning
        out = self._text(content.rstrip() if calls else content)
        if self.text_item is None and not calls:
            out += self._open_text()  # an empty answer still has its message
        out += self._flush_reasoning()
        if self.text_item is not None:
            index, part = self.text_item["index"], {"type": "output_text", "text": self.text_item["text"],
                                                    "annotations": []}
            at = dict(item_id=self.text_item["id"], output_index=index, content_index=0)
            out.append(self._event("response.output_text.done", **at, text=part["text"], logprobs=[]))
            out.append(self._event("response.content_part.done", **at, part=part))
            self.output[index] = {**self.output[index], "status": "completed", "content": [part]}
            out.append(self._event("response.output_item.done", output_index=index, item=self.output[index]))
        for call in calls:
            item = _call_item(call)
            index, added = self._add({**item, "arguments": "", "status": "in_progress"})
            out += added
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                   delta=item["arguments"]))
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   arguments=item["arguments"]))
            self.output[index] = item
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        response = self.response("completed", self.output, result)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return out + [self._event(kind, response=response)]

    def error(self, e: APIError) -> bytes:
        return self._event("error", code=str(e.status), message=e.message, param=e.param)
