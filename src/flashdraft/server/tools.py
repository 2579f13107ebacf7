"""Tool calling: the request's tools checked, rendered into the prompt, and calls parsed out of the output.

The tools reach the model through its own chat template (apply_chat_template(tools=...)); the format of the
calls it writes back is read off the template's text: Qwen3/Hermes `<tool_call>{json}</tool_call>`, Llama 3.x
JSON `{"name", "parameters"}` (after an optional `<|python_tag|>`), Gemma 4 `<|tool_call>call:name{...}<tool_call|>`.
A template that does not use tools gets them in a system message (GENERIC_INSTRUCTIONS), asking for the Hermes
format. tool_choice "required" and a named function are enforced, not asked for: the prompt is pre-filled up
to the call's arguments (or, for "required" in a JSON format, up to the call object) and the output is
constrained by a JSON schema, so the model can only write a valid call.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from flashdraft.config import Constraint

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

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The output's content and its tool calls (the pre-filled start of a forced call counts as written)."""
        if self.forced is not None:
            return "", [ToolCall(self.forced, _json_text(text))] if text.strip() else []
        content, calls = parse_calls(self.prefill + text, self.format)
        return content, calls if self.parallel else calls[:1]


def template_format(template: str) -> str | None:
    """The call format a chat template's text teaches, or None when the template does not use tools."""
    if "tools" not in template:
        return None
    if "<|tool_call>" in template:
        return GEMMA4
    if "<tool_call>" in template:
        return HERMES
    return LLAMA3 if ("<|python_tag|>" in template or "ipython" in template or '"parameters"' in template) \
        else HERMES


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


def plan_tools(body: dict, template: str, prompt_opens_thought: bool = False) -> ToolPlan | None:
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
        return plan
    if prompt_opens_thought:
        raise ToolError("tool_choice", f"{choice!r} cannot be enforced while the prompt opens the model's "
                                       "thinking: turn reasoning off (chat_template_kwargs.enable_thinking: false)")
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
    """Messages for a template that does not use tools: the tools in the system message (GENERIC_INSTRUCTIONS),
    past calls written into their assistant messages in the format asked for."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    instructions = GENERIC_INSTRUCTIONS.format(tools=listing)
    out = []
    for m in messages:
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


def _json_text(value) -> str:
    """Arguments as OpenAI's JSON text: objects re-serialized, text that is not JSON passed on as it is."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, ensure_ascii=False)


def _call_from_json(obj) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], _json_text(arguments))


HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
GEMMA_CALL = re.compile(r"<\|tool_call>call:([A-Za-z0-9_.:-]+)(\{.*?\})?\s*(?:<tool_call\|>|$)", re.S)


def parse_calls(text: str, fmt: str) -> tuple[str, list[ToolCall]]:
    """(content, tool calls) of an output; a block that does not parse stays in the content."""
    if fmt == LLAMA3:
        return _parse_llama3(text)
    pattern = GEMMA_CALL if fmt == GEMMA4 else HERMES_CALL
    calls, kept, last = [], [], 0
    for match in pattern.finditer(text):
        if fmt == GEMMA4:
            arguments = gemma_arguments(match.group(2) or "{}")
            call = None if arguments is None else ToolCall(match.group(1), json.dumps(arguments, ensure_ascii=False))
        else:
            try:
                call = _call_from_json(json.loads(match.group(1)))
            except ValueError:
                call = None
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last:match.start()])
        last = match.end()
    kept.append(text[last:])
    return ("".join(kept) if calls else text), calls


def _parse_llama3(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = _call_from_json(obj)
        if call is None:
            return text, []
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return "", calls


def gemma_arguments(text: str):
    """Gemma 4's argument syntax as a Python value: JSON-like, bare keys, strings quoted with <|"|>; None if it
    does not parse."""
    try:
        value, end = _gemma_value(text, 0)
    except (ValueError, IndexError):
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
    if text[at] == "{":
        out, at = {}, _skip(text, at + 1)
        while text[at] != "}":
            colon = text.index(":", at)
            key = text[at:colon].strip().strip('"')
            out[key], at = _gemma_value(text, colon + 1)
            at = _skip(text, at)
            if text[at] == ",":
                at = _skip(text, at + 1)
            elif text[at] != "}":
                raise ValueError("expected , or }")
        return out, at + 1
    if text[at] == "[":
        items, at = [], _skip(text, at + 1)
        while text[at] != "]":
            item, at = _gemma_value(text, at)
            items.append(item)
            at = _skip(text, at)
            if text[at] == ",":
                at = _skip(text, at + 1)
            elif text[at] != "]":
                raise ValueError("expected , or ]")
        return items, at + 1
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
        if not calls:
            rest = self.text[self.released:] if self.plan.forced is None else ""
            return rest, []
        released = self.text[:self.released]
        return content[len(released):] if content.startswith(released) else "", calls
