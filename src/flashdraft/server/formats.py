"""Response bodies: OpenAI chat/completions (whole and as stream chunks) and llama.cpp's native /completion, and
the output splitting a chat choice's text goes through before it is sent: thinking into `reasoning_content`,
tool calls into `tool_calls`; streamed, each piece is released as soon as it cannot be part of a marker.
Log-probabilities come in each route's own shape, a streamed chunk carrying those of its tokens.

Tool calling (the request's tools checked, rendered into the prompt, calls parsed out of the output): the tools
reach the model through its own chat template (apply_chat_template(tools=...)); the format of the
calls it writes back is read off the template's text: Qwen3/Hermes `<tool_call>{json}</tool_call>`, Llama 3.x
JSON `{"name", "parameters"}` (after an optional `<|python_tag|>`), Gemma 4 `<|tool_call>call:name{...}<tool_call|>`.
A template that does not use tools, or teaches another format, gets them in a system message
(GENERIC_INSTRUCTIONS), asking for the Hermes format. Only calls to the request's own tools are calls.
tool_choice "required" and a named function are enforced, not asked for: the prompt is pre-filled up to the
call's arguments (or, for "required" in a JSON format, up to the call object) and the output is constrained by a
JSON schema, so the model can only write a valid call. That is how a tool's strict: true is honoured; with
tool_choice auto nothing constrains the calls, so strict: true is refused there.
"""
from __future__ import annotations

import json
import re
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flashdraft import __version__
from flashdraft.config import Constraint

if TYPE_CHECKING:
    from flashdraft.engine.generator import GenerationResult, TokenLogprob
    from flashdraft.server.requests import GenerationRequest

HERMES, LLAMA3, GEMMA4 = "hermes", "llama3", "gemma4"
MAX_TOOLS = 128
NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
GEMMA_QUOTE = '<|"|>'

GENERIC_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


class ToolError(ValueError):
    """A tools / tool_choice problem; field names the request field at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")

    def openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass
class ToolPlan:
    """What a request's tools do to its prompt and output."""

    tools: list[dict]               # what the template gets (OpenAI's {"type": "function", "function": {...}})
    format: str                     # how calls are written: HERMES, LLAMA3 or GEMMA4
    native: bool                    # the template renders tools itself (else GENERIC_INSTRUCTIONS)
    prefill: str = ""               # written after the generation prompt (a forced call's start)
    forced: str | None = None       # the function a forced call is to (named tool_choice)
    constraint: Constraint | None = None  # a forced call's JSON schema
    parallel: bool = True

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The output's content and its tool calls. The pre-filled start of a call counts as written: a forced
        call whose arguments do not parse (cut by max_tokens) is no call, and its text, pre-fill included, is
        the content."""
        if self.forced is not None:
            arguments = json_object(text)
            if arguments is None:
                return self.prefill + text, []
            return "", [ToolCall(self.forced, json.dumps(arguments, ensure_ascii=False))]
        content, calls = parse_calls(self.prefill + text, self.format, self.names)
        return content, calls if self.parallel else calls[:1]


def template_format(template: str) -> str | None:
    """The call format a chat template's text teaches, when it is one of the three parsed here; None for a
    template that does not use tools or teaches another syntax (Mistral's [TOOL_CALLS], DeepSeek's, Command-R's):
    those get the tools in a system message, in the Hermes format."""
    if "tools" not in template:
        return None
    if "<|tool_call>" in template:
        return GEMMA4
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3
    return None


def _check_tools(tools, field_name: str) -> list[dict]:
    """OpenAI's tools (or legacy functions, wrapped) checked; each a {"type": "function", "function": {...}}."""
    if not isinstance(tools, list):
        raise ToolError(field_name, "must be a list")
    if len(tools) > MAX_TOOLS:
        raise ToolError(field_name, f"has {len(tools)} tools, at most {MAX_TOOLS} are allowed")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"{field_name}[{i}]"
        if field_name == "functions":
            tool = {"type": "function", "function": tool}
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolError(where, "must be {'type': 'function', 'function': {...}}: only function tools are "
                                   "supported")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolError(where, "needs function.name")
        name = function["name"]
        if not NAME.match(name):
            raise ToolError(where, f"has a function name {name[:80]!r} that is not 1-64 letters, digits, _ . : -")
        if name in names:
            raise ToolError(where, f"names the function {name!r} twice")
        names.add(name)
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolError(where, "has function.parameters that is not a JSON schema object")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise ToolError(where, "has function.description that is not a string")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise ToolError(f"{where}{'.function' if field_name == 'tools' else ''}.strict", "must be true or false")
        out.append({"type": "function", "function": {**function, "parameters": parameters}})
    return out


def _choice(body: dict, names: list[str]) -> str:
    """tool_choice (or legacy function_call) as "none", "auto", "required" or a function's name."""
    key = "tool_choice" if body.get("tool_choice") is not None else "function_call"
    choice = body.get(key)
    if choice is None:
        return "auto" if names else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required") or (key == "function_call" and choice == "required"):
            raise ToolError(key, f"must be none, auto, required or a function, got {choice[:80]!r}")
        name = choice
    elif isinstance(choice, dict):
        function = choice.get("function") if key == "tool_choice" else choice
        if (key == "tool_choice" and choice.get("type") != "function") or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise ToolError(key, "must name a function: {'type': 'function', 'function': {'name': ...}}")
        name = function["name"]
        if name not in names:
            raise ToolError(key, f"names the function {name[:80]!r}, which is not among the tools")
    else:
        raise ToolError(key, "must be a string or an object")
    if name in ("auto", "required") and not names:
        raise ToolError(key, f"is {name!r} but no tools are given")
    return name


def plan_tools(body: dict, template: str) -> ToolPlan | None:
    """The request's tools and tool_choice as a ToolPlan, or None when no tools are in play. Raises ToolError."""
    if body.get("tools") is not None and body.get("functions") is not None:
        raise ToolError("functions", "cannot be sent with tools: send tools only")
    if body.get("tool_choice") is not None and body.get("function_call") is not None:
        raise ToolError("function_call", "cannot be sent with tool_choice: send tool_choice only")
    key = "tools" if body.get("tools") is not None else "functions"
    tools = _check_tools(body.get(key) or [], key)
    choice = _choice(body, [t["function"]["name"] for t in tools])
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", "must be true or false")
    if choice == "none" or not tools:
        return None
    fmt = template_format(template)
    plan = ToolPlan(tools, fmt or HERMES, native=fmt is not None, parallel=parallel)
    if choice == "auto":
        strict = next((i for i, t in enumerate(tools) if t["function"].get("strict")), None)
        if strict is not None:
            raise ToolError(f"{key}[{strict}]{'.function' if key == 'tools' else ''}.strict", "is true, but a call's arguments follow the "
                                                                "schema only when the call is forced: send "
                                                                "tool_choice 'required' or this function, or strict: "
                                                                "false")
        return plan
    if choice == "required":
        if len(tools) == 1:
            choice = tools[0]["function"]["name"]
        elif plan.format == GEMMA4:
            raise ToolError("tool_choice", "'required' with several tools cannot be enforced in Gemma 4's call "
                                           "format: name the function")
        else:
            calls = [{"type": "object", "additionalProperties": False, "required": ["name", args],
                      "properties": {"name": {"const": t["function"]["name"]}, args: t["function"]["parameters"]}}
                     for t in tools for args in (("parameters",) if plan.format == LLAMA3 else ("arguments",))]
            plan.prefill = "<tool_call>\n" if plan.format == HERMES else ""
            plan.constraint = Constraint("json_schema", json.dumps({"anyOf": calls}))
            plan.parallel = False
            return plan
    function = next(t["function"] for t in tools if t["function"]["name"] == choice)
    plan.forced = choice
    plan.prefill = {HERMES: f'<tool_call>\n{{"name": {json.dumps(choice)}, "arguments": ',
                    LLAMA3: f'{{"name": {json.dumps(choice)}, "parameters": ',
                    GEMMA4: f"<|tool_call>call:{choice}"}[plan.format]
    plan.constraint = Constraint("json_schema", json.dumps(function["parameters"]))
    return plan


def generic_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Messages for a template that does not render tools, in the Hermes format GENERIC_INSTRUCTIONS teaches: the
    tools in the system message, past calls written into their assistant messages, tool results as a user turn
    of <tool_response> blocks (consecutive results, and a user message after them, in one turn: templates without
    tools know no `tool` role, and some need the roles to alternate)."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    instructions = GENERIC_INSTRUCTIONS.format(tools=listing)
    out: list[dict] = []
    results = False  # the last message out is a user turn of tool results
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if results:
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{block}"}
            else:
                out.append({"role": "user", "content": block})
            results = True
            continue
        if m["role"] == "user" and results:  # roles still alternate
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{m['content']}"}
            results = False
            continue
        results = False
        calls = m.get("tool_calls")
        if calls:
            written = "".join(f"\n<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']}, ensure_ascii=False)}\n</tool_call>"  # noqa: E501
                              for c in calls)
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = (m.get("content") or "") + written
        out.append(m)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{instructions}"}
    else:
        out.insert(0, {"role": "system", "content": instructions})
    return out


# --- parsing the output ---------------------------------------------------------------------------------------
#
# The parsers scan with str.find and parse each call within its own span (its start marker to its end marker, or
# to the end of the text), so an output of any shape parses in time linear in its length; a value nested deeper
# than Python's recursion limit is a call that does not parse, not an error.

PARSE_ERRORS = (ValueError, IndexError, RecursionError)
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
GEMMA_OPEN, GEMMA_CLOSE = "<|tool_call>call:", "<tool_call|>"
GEMMA_NAME = re.compile(r"[A-Za-z0-9_.:-]+")


def json_object(text: str) -> dict | None:
    """text as a JSON object, or None (not JSON, not an object, nested too deep)."""
    try:
        value = json.loads(text)
    except PARSE_ERRORS:
        return None
    return value if isinstance(value, dict) else None


def _arguments(value) -> str | None:
    """A call's arguments as OpenAI's JSON text of an object (an object, or JSON text of one); None otherwise."""
    if isinstance(value, str):
        value = json_object(value)
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _call_from_json(obj, names, keys: tuple[str, ...]) -> ToolCall | None:
    """A call object {"name", one of keys: arguments} naming a declared tool, as a ToolCall; None otherwise."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    key = next((k for k in keys if k in obj), None)
    arguments = _arguments(obj[key]) if key is not None else "{}"
    return None if arguments is None else ToolCall(obj["name"], arguments)


def parse_calls(text: str, fmt: str, names) -> tuple[str, list[ToolCall]]:
    """(content, tool calls) of an output. Only calls to the declared tools (names) count; a block that does not
    parse stays in the content."""
    if fmt == LLAMA3:
        return _parse_llama3(text, names)
    opener, closer = (GEMMA_OPEN, GEMMA_CLOSE) if fmt == GEMMA4 else (HERMES_OPEN, HERMES_CLOSE)
    calls, kept, last, at = [], [], 0, 0
    while (start := text.find(opener, at)) >= 0:
        body = start + len(opener)
        end = text.find(closer, body)
        body_end, at = (end, end + len(closer)) if end >= 0 else (len(text), len(text))
        span = text[body:body_end]
        call = _gemma_call(span, names) if fmt == GEMMA4 else _call_from_json(json_object(span), names,
                                                                               ("arguments", "parameters"))
        if call is not None:
            calls.append(call)
            kept.append(text[last:start])
            last = at
    kept.append(text[last:])
    return ("".join(kept) if calls else text), calls


def _gemma_call(span: str, names) -> ToolCall | None:
    """`name{arguments}` (the arguments optional) of a Gemma 4 call."""
    match = GEMMA_NAME.match(span)
    if match is None or match.group() not in names:
        return None
    rest = span[match.end():].strip()
    arguments = gemma_arguments(rest) if rest else {}
    return None if arguments is None else ToolCall(match.group(), json.dumps(arguments, ensure_ascii=False))


def _parse_llama3(text: str, names) -> tuple[str, list[ToolCall]]:
    """Llama 3's calls: the whole output one or more {"name", "parameters"} objects (`;` between them), after an
    optional <|python_tag|>; anything else is content."""
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except PARSE_ERRORS:
            return text, []
        call = _call_from_json(obj, names, ("parameters", "arguments")) if isinstance(obj, dict) and (
            "parameters" in obj or "arguments" in obj) else None
        if call is None:
            return text, []
        calls.append(call)
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return "", calls


def gemma_arguments(text: str):
    """Gemma 4's argument syntax as a Python value: JSON-like, bare keys, strings quoted with <|"|>; None if it
    does not parse."""
    try:
        value, end = _gemma_value(text, 0)
    except PARSE_ERRORS:
        return None
    return value if text[end:].strip() == "" and isinstance(value, dict) else None


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def _gemma_value(text: str, at: int):
    at = _skip(text, at)
    if text.startswith(GEMMA_QUOTE, at):
        end = text.index(GEMMA_QUOTE, at + len(GEMMA_QUOTE))
        return text[at + len(GEMMA_QUOTE):end], end + len(GEMMA_QUOTE)
    if text[at] in "{[":
        return _gemma_container(text, at)
    if text[at] == '"':
        return json.JSONDecoder().raw_decode(text, at)
    end = at
    while end < len(text) and text[end] not in ",}]":
        end += 1
    word = text[at:end].strip()
    if not word:
        raise ValueError("empty value")
    try:
        return json.loads(word), end
    except ValueError:
        return word, end


def _gemma_container(text: str, at: int):
    """An object {key: value, ...} (bare or quoted keys) or a list [value, ...] starting at text[at]."""
    is_object = text[at] == "{"
    close = "}" if is_object else "]"
    out: dict | list = {} if is_object else []
    at = _skip(text, at + 1)
    while text[at] != close:
        if is_object:
            colon = text.index(":", at)
            key = text[at:colon].strip().strip('"')
            out[key], at = _gemma_value(text, colon + 1)
        else:
            item, at = _gemma_value(text, at)
            out.append(item)
        at = _skip(text, at)
        if text[at] == ",":
            at = _skip(text, at + 1)
        elif text[at] != close:
            raise ValueError(f"expected , or {close}")
    return out, at + 1


class ToolStream:
    """Streamed content with tool calls held back: text before a call's start marker is released as it comes
    (less any tail that may be the start of a marker), everything from the marker on is kept and parsed at the
    end. Llama 3's calls have no marker: an output that starts with `{` or `<|python_tag|>` is kept whole."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.markers = {HERMES: ("<tool_call>",), GEMMA4: ("<|tool_call>",),
                        LLAMA3: ("<|python_tag|>", "{")}[plan.format]
        self.text = ""
        self.released = 0
        self.holding = plan.forced is not None or plan.prefill != ""

    def feed(self, text: str) -> str:
        self.text += text
        if self.holding:
            return ""
        if self.plan.format == LLAMA3:
            head = self.text.lstrip()
            if head and any(head.startswith(m) or m.startswith(head) for m in self.markers):
                if any(head.startswith(m) for m in self.markers):
                    self.holding = True
                return ""
            self.holding = False
            out = self.text[self.released:]
            self.released = len(self.text)
            return out
        found = [i for i in (self.text.find(m, self.released) for m in self.markers) if i >= 0]
        if found:
            end = min(found)
            self.holding = True
        else:
            end = len(self.text)
            marker = self.markers[0]
            for k in range(min(len(marker) - 1, len(self.text) - self.released), 0, -1):
                if self.text.endswith(marker[:k]):
                    end = len(self.text) - k
                    break
        out = self.text[self.released:end]
        self.released = end
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content not yet released, and the calls."""
        content, calls = self.plan.parse(self.text)
        released = self.text[:self.released]
        return (content[len(released):] if content.startswith(released) else ""), calls


FINGERPRINT = f"flashdraft-{__version__}"

# Thinking text out of the answer: llama-server's --reasoning-format. Models that think write their reasoning
# between markers before the answer: Qwen3 `<think>...</think>`, Gemma 4 `<|channel>thought\n...<channel|>`. With
# the deepseek (or auto) format, that text goes to the message's `reasoning_content` (streamed as
# `delta.reasoning_content`) and out of `content`; with none it stays in the content. The markers are read off the
# chat template's text; a generation prompt that already opens the thought (a template that pre-fills `<think>`)
# starts the output inside it.

REASONING_FORMATS = ("none", "deepseek", "auto")  # --reasoning-format
MARKERS = {"<think>": ("<think>", "</think>"), "<|channel>": ("<|channel>thought", "<channel|>")}


@dataclass(frozen=True)
class Reasoning:
    open: str
    close: str
    starts_inside: bool  # the prompt ends inside an opened thought


def reasoning_for(template: str, prompt: str, fmt: str) -> Reasoning | None:
    """How to split this request's output, or None to leave it whole (format none, or a template that does not
    think)."""
    if fmt == "none":
        return None
    for key, (open_, close) in MARKERS.items():
        if key in template:
            tail = prompt.rstrip()
            return Reasoning(open_, close, tail.endswith(open_))
    return None


def _partial_tail(text: str, marker: str) -> int:
    """Length of the longest end of text that is a proper start of marker (held back: it may become one)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningSplitter:
    """Splits streamed text into (reasoning, content) pieces; finish() releases what was held back.

    The thought comes without the whitespace around it (Qwen3 writes `<think>` and its newline as separate
    tokens): whitespace at its start is dropped, whitespace inside it is held until more thought follows, so the
    pieces join to exactly what split_reasoning gives for the whole text, however the text is cut."""

    def __init__(self, reasoning: Reasoning):
        self.r = reasoning
        self.state = "inside" if reasoning.starts_inside else "before"
        self.buffer = ""
        self.thought_started = False  # a thought's first non-blank character was released
        self.strip_content = False  # content right after the thought starts without the blank lines between

    def _thought(self, text: str) -> str:
        """What of text (a run of the thought) can be released now: none of its leading whitespace."""
        if not self.thought_started:
            text = text.lstrip()
            self.thought_started = bool(text)
        return text

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning, content = "", ""
        while True:
            if self.state == "before":
                head = self.buffer.lstrip()
                if head.startswith(self.r.open):
                    self.buffer = head[len(self.r.open):]
                    self.state = "inside"
                    continue
                if not head or self.r.open.startswith(head):
                    return reasoning, content
                self.state = "after"
                continue
            if self.state == "inside":
                end = self.buffer.find(self.r.close)
                if end >= 0:
                    reasoning += self._thought(self.buffer[:end].rstrip())
                    self.buffer = self.buffer[end + len(self.r.close):]
                    self.state, self.strip_content = "after", True
                    continue
                ready = self.buffer[:len(self.buffer) - _partial_tail(self.buffer, self.r.close)].rstrip()
                reasoning += self._thought(ready)
                self.buffer = self.buffer[len(ready):]
                return reasoning, content
            if self.strip_content:
                self.buffer = self.buffer.lstrip()
                if not self.buffer:
                    return reasoning, content
                self.strip_content = False
            content += self.buffer
            self.buffer = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        if self.state == "inside":
            return self._thought(rest.rstrip()), ""
        return "", rest.lstrip() if self.strip_content else rest


def split_reasoning(text: str, reasoning: Reasoning) -> tuple[str, str]:
    """(reasoning, content) of a whole output."""
    splitter = ReasoningSplitter(reasoning)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return r1 + r2, c1 + c2


def sse(payload: dict | str) -> bytes:
    """One server-sent event; never a non-JSON number (a NaN or infinity raises instead of sending `Infinity`)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, allow_nan=False)
    return f"data: {data}\n\n".encode()


def speculative(result: GenerationResult) -> dict:
    """Per-request speculative-decoding summary in vLLM's names; mean_acceptance_length (tau) counts the bonus
    token: tokens committed per decoding step."""
    s = result.stats
    return {"mean_acceptance_length": s.tau, "draft_acceptance_rate": s.acceptance_rate, "num_spec_steps": s.steps,
            "num_draft_tokens": s.draft_n, "num_accepted_draft_tokens": s.draft_n_accepted,
            "accepted_per_position": list(s.accepted_per_position),
            "draft_lengths": {str(k): v for k, v in sorted(s.draft_lengths.items())}}


def usage(results: list[GenerationResult]) -> dict:
    """Token counts: the prompt once (its tokens found in the cache among them), the completions of every choice."""
    first = results[0].stats
    prompt = first.prompt_tokens
    completion = sum(r.stats.predicted_n for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": first.cache_n}}


def _logprob(value: float) -> float:
    """A logprob JSON can carry: a banned token's -inf as OpenAI's floor."""
    return max(float(value), -9999.0)


# --- log-probabilities, per route's shape --------------------------------------------------------------------


def _token_entries(tokenizer, entries: list[TokenLogprob], with_id: bool) -> list[dict]:
    """Each token's {token, logprob, bytes} (and id) with its top_logprobs alike: OpenAI chat's and llama-server's
    shape."""
    def one(token_id: int, logprob: float) -> dict:
        raw = tokenizer.token_bytes(token_id)
        entry = {"token": raw.decode("utf-8", errors="replace"), "logprob": _logprob(logprob), "bytes": list(raw)}
        return {"id": token_id, **entry} if with_id else entry

    return [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]


def chat_logprobs(tokenizer, entries: list[TokenLogprob]) -> list[dict]:
    """OpenAI chat's logprobs.content items."""
    return _token_entries(tokenizer, entries, with_id=False)


def completion_logprobs(tokenizer, entries: list[TokenLogprob], offset: int) -> dict:
    """OpenAI legacy completions' logprobs object; offset: where the first token's text starts in the choice."""
    tokens = [tokenizer.token_text(e.token) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [_logprob(e.logprob) for e in entries],
            "top_logprobs": [{tokenizer.token_text(t): _logprob(lp) for t, lp in e.top} for e in entries],
            "text_offset": offsets}


def native_probabilities(tokenizer, entries: list[TokenLogprob]) -> list[dict]:
    """llama-server's completion_probabilities."""
    return _token_entries(tokenizer, entries, with_id=True)


# --- a chat choice's text split into reasoning, content and tool calls -------------------------------------------


@dataclass
class ChatMessage:
    content: str
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def openai(self) -> dict:
        message = {"role": "assistant", "content": (self.content.strip() or None) if self.tool_calls
                   else self.content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [c.openai() for c in self.tool_calls]
        return message


def chat_message(request: GenerationRequest, text: str) -> ChatMessage:
    reasoning, content = split_reasoning(text, request.reasoning) if request.reasoning else ("", text)
    if request.tools is None:
        return ChatMessage(content, reasoning)
    content, calls = request.tools.parse(content)
    return ChatMessage(content, reasoning, calls)


class ChatSplitter:
    """A streamed chat choice's text as (reasoning, content) pieces, tool calls held back to the end."""

    def __init__(self, request: GenerationRequest):
        self.reasoning = ReasoningSplitter(request.reasoning) if request.reasoning else None
        self.tools = ToolStream(request.tools) if request.tools else None

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        return reasoning, self.tools.feed(content) if self.tools else content

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        if self.tools is None:
            return reasoning, content, []
        content = self.tools.feed(content)
        rest, calls = self.tools.finish()
        return reasoning, content + rest, calls


def finish_reason(result: GenerationResult, calls: list) -> str:
    """"tool_calls" when calls were made, but "length" whenever max_tokens cut the output: the client must know
    the reply is incomplete (a call it cut does not parse and stays in the content)."""
    return "tool_calls" if calls and result.finish_reason != "length" else result.finish_reason


class OpenAIFormatter:
    """Builds the bodies of one /v1/chat/completions or /v1/completions request (n choices)."""

    def __init__(self, request: GenerationRequest, chat: bool, tokenizer):
        self.request = request
        self.chat = chat
        self.tokenizer = tokenizer
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.splitters = [ChatSplitter(request) for _ in range(request.n)] if chat else []
        self.offsets = [len(request.prompt_text) if request.echo else 0] * request.n  # completions' text_offset
        self.pending: list[list] = [[] for _ in range(request.n)]  # logprobs not yet sent, per choice
        self.results: list = []

    @property
    def logprobs(self) -> bool:
        return self.request.params.logprobs is not None

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.request.model,
                "system_fingerprint": FINGERPRINT, "choices": choices}

    def _chat_logprobs(self, entries) -> dict | None:
        return {"content": chat_logprobs(self.tokenizer, entries)} if self.logprobs else None

    def _completion_logprobs(self, index: int, entries) -> dict | None:
        if not self.logprobs:
            return None
        body = completion_logprobs(self.tokenizer, entries, self.offsets[index])
        if body["tokens"]:
            self.offsets[index] = body["text_offset"][-1] + len(body["tokens"][-1])
        return body

    def whole(self, results: list[GenerationResult]) -> dict:
        choices = []
        for i, result in enumerate(results):
            entries = result.logprobs or []
            if self.chat:
                message = chat_message(self.request, result.text)
                choices.append({"index": i, "message": message.openai(), "logprobs": self._chat_logprobs(entries),
                                "finish_reason": finish_reason(result, message.tool_calls)})
            else:
                text = (self.request.prompt_text if self.request.echo else "") + result.text
                choices.append({"index": i, "text": text, "finish_reason": result.finish_reason,
                                "logprobs": self._completion_logprobs(i, entries)})
        body = self._envelope(self.object, choices)
        body["usage"] = usage(results)
        body["timings"] = results[-1].stats.timings()
        body["speculative_decoding"] = speculative(results[-1])
        return body

    def progress_chunk(self, progress) -> dict:
        """A stream chunk with no choices that reports the prompt's processing (llama-server's return_progress)."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["prompt_progress"] = progress.as_dict()
        return body

    def _chunk(self, index: int, delta: dict | str, finish: str | None, entries=None) -> dict:
        if self.chat:
            choice = {"index": index, "delta": delta, "finish_reason": finish,
                      "logprobs": self._chat_logprobs(entries or [])}
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": index, "text": delta, "finish_reason": finish,
                      "logprobs": self._completion_logprobs(index, entries or [])}
            body = self._envelope("text_completion", [choice])
        if self.request.include_usage:
            body["usage"] = None  # OpenAI's convention: usage only on the last chunk
        return body

    def first_chunks(self) -> list[dict]:
        """Chat streams open each choice with the assistant role, as OpenAI's do; echoed completions with the
        prompt."""
        if self.chat:
            return [self._chunk(i, {"role": "assistant", "content": ""}, None) for i in range(self.request.n)]
        if self.request.echo:
            return [self._chunk(i, self.request.prompt_text, None) for i in range(self.request.n)]
        return []

    def _take(self, index: int, entries) -> list:
        taken, self.pending[index] = self.pending[index] + list(entries or []), []
        return taken

    def delta_chunks(self, index: int, text: str, entries) -> list[dict]:
        """The chunks of a Delta of choice `index` (none while its text is held back: its logprobs wait too)."""
        if not self.chat:
            return [self._chunk(index, text, None, self._take(index, entries))] if text or entries else []
        reasoning, content = self.splitters[index].feed(text)
        if not reasoning and not content:
            self.pending[index] += list(entries or [])
            return []
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        return [self._chunk(index, delta, None, self._take(index, entries))]

    def final_chunks(self, index: int, result: GenerationResult) -> list[dict]:
        """Choice `index`'s last chunks: held-back text and tool calls, its finish_reason; after the last choice,
        (with include_usage) the usage chunk. The last chunk carries timings."""
        self.results.append(result)
        chunks, calls = [], []
        if self.chat:
            reasoning, content, calls = self.splitters[index].finish()
            delta = {k: v for k, v in (("reasoning_content", reasoning), ("content", content)) if v}
            if delta:
                chunks.append(self._chunk(index, delta, None, self._take(index, [])))
            for j, call in enumerate(calls):
                chunks.append(self._chunk(index, {"tool_calls": [call.openai(j)]}, None))
            chunks.append(self._chunk(index, {}, finish_reason(result, calls), self._take(index, [])))
        else:
            chunks.append(self._chunk(index, "", result.finish_reason, self._take(index, [])))
        if index + 1 < self.request.n:
            return chunks
        if self.request.include_usage:
            tail = self._envelope(chunks[-1]["object"], [])
            tail["usage"] = usage(self.results)
            chunks.append(tail)
        chunks[-1]["timings"] = result.stats.timings()
        chunks[-1]["speculative_decoding"] = speculative(result)
        return chunks


def native_chunk(text: str, slot_id: int | None, tokens: list[int], predicted: int, evaluated: int,
                 probabilities: list[dict] | None = None) -> dict:
    chunk = {"index": 0, "content": text, "tokens": tokens, "stop": False, "id_slot": slot_id,
             "tokens_predicted": predicted, "tokens_evaluated": evaluated}
    if probabilities is not None:
        chunk["completion_probabilities"] = probabilities
    return chunk


def native_whole(request: GenerationRequest, result: GenerationResult, slot_id: int | None, n_max: int,
                 tokenizer) -> dict:
    """llama.cpp's /completion result object (also the final chunk of its stream, with content '')."""
    s = result.stats
    p = request.params
    body = {
        "index": 0,
        "content": result.text,
        "tokens": list(result.tokens) if request.return_tokens else [],
        "id_slot": slot_id,
        "stop": True,
        "model": request.model,
        "tokens_predicted": s.predicted_n,
        "tokens_evaluated": s.prompt_tokens,
        "generation_settings": {
            "n_predict": p.max_tokens, "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
            "min_p": p.min_p, "seed": result.seed, "stop": list(p.stop), "ignore_eos": p.ignore_eos,
            "repeat_penalty": p.repeat_penalty, "repeat_last_n": p.repeat_last_n,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "n_probs": p.logprobs or 0, "grammar": p.constraint.source if p.constraint else "",
            "speculative.n_max": n_max, "speculative.n_min": request.n_min,
        },
        "prompt": request.prompt_text,
        "has_new_line": "\n" in result.text,
        "truncated": False,
        "stop_type": result.stop_type,
        "stopping_word": result.stopping_word,
        "tokens_cached": s.prompt_tokens + s.predicted_n,
        "timings": s.timings(),
        "speculative_decoding": speculative(result),
    }
    if p.logprobs is not None:
        body["completion_probabilities"] = native_probabilities(tokenizer, result.logprobs or [])
    return body
