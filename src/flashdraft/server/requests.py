"""Request bodies -> a checked GenerationRequest, and the Job that carries it to the worker thread. Every problem
becomes a 400 that names the field at fault.

Everything a request asks for is checked before any work is done for it: the body's shape (check_json: depth,
text that encodes, finite numbers that fit in 64 bits), each field's type and range, and the sizes that bound
the work (a prompt's characters, a chat's messages, a template's length), so that rendering and tokenizing a
request take a bounded time and nothing a client sends reaches a 500.

A Job is what the worker thread tells the request handler, through the handler's event loop. Events are (kind,
payload, choice) triples: ("delta", Delta, i), ("result", GenerationResult, i) for each of the request's n choices
in turn, ("progress", PromptProgress, i) after each prefill pass when the request asked for it (return_progress),
("error", Exception, i) or ("ended", reason, i) when a job ends without its results (cancelled, or the server is
shutting down). This module does not import the engine, so the HTTP side starts (and answers /health) while torch
is still loading.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import math
import reprlib
import threading
from dataclasses import dataclass, replace
from typing import Callable

from flashdraft.config import ConfigError, Constraint, SamplingParams
from flashdraft.server.errors import APIError, bad_field, renamed
from flashdraft.server.formats import (REASONING_FORMATS, Reasoning, ToolError, ToolPlan, generic_messages,
                                      plan_tools, reasoning_for)
from flashdraft.server.settings import ServerSettings
from flashdraft.server.templates import TemplateBusy, TemplateError

MAX_DEPTH = 64                # JSON nesting; chat bodies need about 5, tool schemas in template kwargs a few more
MAX_CHARS_PER_TOKEN = 16      # a prompt's characters, per token of the context (tokenizing costs ~3 us a character)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_MODEL_CHARS = 256         # `model` is echoed in every chunk of a stream
MAX_TEMPLATE_CHARS = 128 * 1024
INT64 = 2**63

MAX_CHOICES = 16              # n: choices are generated one after another on the request's slot
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_LOGIT_BIAS = 1024         # entries of logit_bias
MAX_TOP_LOGPROBS = 20

# Request fields of the OpenAI and llama.cpp APIs that flashdraft does not implement, with the values that ask
# for nothing (clients often send those; an empty list or object does too). Any other value is refused by name.
UNSUPPORTED = {
    "suffix": ("",), "typical_p": (1,), "mirostat": (0,), "dry_multiplier": (0,), "xtc_probability": (0,),
    "lora": (), "image_data": (), "prediction": (), "post_sampling_probs": (False,), "audio": (),
    "modalities": (["text"],),
}
# Fields of the other routes, refused (unless neutral) on a route that does not implement them.
NOT_ON_ROUTE = {
    "chat": {"echo": (False,), "best_of": (1,), "n_probs": (0,), "prompt": ()},
    "completions": {"tools": (), "functions": (), "tool_choice": ("none",), "function_call": ("none",),
                    "top_logprobs": (0,), "n_probs": (0,), "messages": (), "reasoning_format": ()},
    "native": {"tools": (), "functions": (), "tool_choice": ("none",), "function_call": ("none",),
               "logprobs": (False,), "top_logprobs": (0,), "n": (1,), "echo": (False,), "best_of": (1,),
               "messages": (), "reasoning_format": ()},
}


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    n_max: int | None       # this request's draft-length cap (speculative.n_max)
    n_min: int              # drafts shorter than this are skipped (speculative.n_min)
    stream: bool
    include_usage: bool     # stream_options.include_usage
    model: str              # echoed back: with one model served, any label is accepted
    prompt_text: str
    return_tokens: bool = False
    timings_per_token: bool = False  # llama.cpp's: every stream chunk carries the timings so far
    n: int = 1                       # choices, generated one after another (choice i seeded seed + i)
    echo: bool = False               # /v1/completions: the prompt's text before each choice's
    tools: ToolPlan | None = None
    reasoning: Reasoning | None = None
    constraint_field: str = ""       # the field the constraint came from, for its errors
    cache_prompt: bool = True        # llama-server's: reuse the slot's cached prefix of the prompt
    return_progress: bool = False    # llama-server's: a stream reports the prompt's processing (prompt_progress)
    n_keep: int = 0                  # llama-server's: prompt tokens a context shift keeps (-1: all)

    def choice_params(self, index: int) -> SamplingParams:
        """Choice index's sampling: the request's, its seed (when given) moved on by the index."""
        if index == 0 or self.params.seed is None:
            return self.params
        return replace(self.params, seed=(self.params.seed + index) % 2**63)


def _show(value) -> str:
    """A value for an error message, cut short without writing it all out first (it may be megabytes)."""
    return reprlib.repr(value)


# --- the body's shape -----------------------------------------------------------------------------------------


def _encodes(text: str) -> bool:
    """False for text with lone surrogates (JSON's "\\ud800" decodes to one), which cannot be encoded as UTF-8:
    the tokenizer or the response writer would fail on it after the work is done."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _key_name(key: str) -> str:
    if len(key) <= 60 and _encodes(key):
        return key
    return key[:60].encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")


def _path(node) -> str:
    """A field's name from its (parent, key) chain: messages[0].content."""
    parts = []
    while node is not None:
        node, key = node
        parts.append(f"[{key}]" if isinstance(key, int) else f".{_key_name(key)}")
    return "".join(reversed(parts)).lstrip(".") or "body"


def plain_ints(items: list) -> bool:
    """A list of 64-bit integers (token ids): checked at once, without walking each item."""
    return all(type(v) is int for v in items) and (not items or (-INT64 <= min(items) and max(items) < INT64))


def check_json(body, max_depth: int = MAX_DEPTH) -> None:
    """Raise a 400 naming the first value at fault: nesting deeper than max_depth, text that is not valid UTF-8,
    a number that is not finite, an integer that does not fit in 64 bits. Iterative: a deep body cannot make it
    recurse."""
    stack = [(body, None, 0)]
    while stack:
        value, node, depth = stack.pop()
        if depth > max_depth:
            raise bad_field(_path(node), f"is nested deeper than {max_depth} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                if not _encodes(key):
                    raise bad_field(_path((node, key)), "is a key that is not valid UTF-8 text (a lone surrogate)")
                stack.append((item, (node, key), depth + 1))
        elif isinstance(value, list):
            if not plain_ints(value):
                stack.extend((item, (node, i), depth + 1) for i, item in enumerate(value))
        elif isinstance(value, str):
            if not _encodes(value):
                raise bad_field(_path(node), "is not valid UTF-8 text (it has a lone surrogate)")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise bad_field(_path(node), f"must be a finite number, got {value}")
        elif isinstance(value, int) and not isinstance(value, bool) and not -INT64 <= value < INT64:
            raise bad_field(_path(node), "is out of range: integers must fit in 64 bits")


# --- fields ---------------------------------------------------------------------------------------------------


def _int(body: dict, key: str, default, minimum: int | None = None):
    value = body.get(key)
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not (math.isfinite(value) and value.is_integer()))):
        raise bad_field(key, f"must be an integer, got {_show(value)}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise bad_field(key, f"must be >= {minimum}, got {value}")
    return value


def _float(body: dict, key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_field(key, f"must be a number, got {_show(value)}")
    value = float(value)  # check_json has kept integers within 64 bits, so this is finite
    if not math.isfinite(value):
        raise bad_field(key, f"must be a finite number, got {value}")
    return value


def _bool(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_field(key, f"must be true or false, got {_show(value)}")
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_field("stop", "must be a string or a list of strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_field("stop", f"has {len(stop)} strings, at most {MAX_STOP_STRINGS} are allowed")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise bad_field("stop", f"has a string over the limit of {MAX_STOP_CHARS} characters")
    return stop


def _same(value, neutral) -> bool:
    """Equal, with 0 and 0.0 alike but not False and 0, and an object's null members taken as absent
    ({"type": "text", "json_schema": null} is {"type": "text"})."""
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if v is not None}
    number = (int, float)
    if isinstance(value, number) and isinstance(neutral, number) and not isinstance(value, bool):
        return not isinstance(neutral, bool) and value == neutral
    return type(value) is type(neutral) and value == neutral


def refuse_fields(body: dict, fields: dict[str, tuple], reason: str) -> None:
    """A 400 naming the first of fields (each with the values that ask for nothing) that the body sets to
    anything else; an empty list or object asks for nothing too."""
    for key, neutral in fields.items():
        value = body.get(key)
        if value is None or (isinstance(value, (list, dict)) and not value):
            continue
        if not any(_same(value, n) for n in neutral):
            raise bad_field(key, f"is not supported {reason} (got {_show(value)})")


def _unsupported(body: dict, route: str) -> None:
    refuse_fields(body, UNSUPPORTED, "by this server")
    refuse_fields(body, NOT_ON_ROUTE[route], "on this route")


def _max_tokens(body: dict, keys: tuple[str, ...], settings: ServerSettings, context_size: int,
                allow_unlimited: bool) -> int:
    """The token budget: the first of `keys` present, else the --n-predict default; -1 = until the context is full."""
    key = next((k for k in keys if body.get(k) is not None), None)
    if key is None:
        return context_size if settings.n_predict < 0 else min(settings.n_predict, context_size)
    value = _int(body, key, None)
    if value == -1 and allow_unlimited:
        return context_size
    if value < 1:
        raise bad_field(key, f"must be >= 1, got {value}")
    if value > context_size and not settings.context_shift:  # with a context shift, a reply may outgrow it
        raise bad_field(key, f"is {value}, more than the context size {context_size} (no --context-shift)")
    return value


def _vocab_size(engine) -> int:
    return engine.decoder.target.config.vocab_size


def _bias_value(value, where: str) -> float:
    """A bias: a number in [-100, 100] (OpenAI's range), or llama.cpp's false for a ban (OpenAI's -100)."""
    if value is False:
        return -100.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_field(where, f"must be a number in [-100, 100] or false (a ban), got {_show(value)}")
    if not -100 <= value <= 100:
        raise bad_field(where, f"must be in [-100, 100], got {value}")
    return float(value)


def _logit_bias(body: dict, engine) -> dict[int, float]:
    """OpenAI's {"token id": bias} or llama.cpp's [[id or text, bias or false], ...] (text: each of its tokens)."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        pairs = value
    else:
        raise bad_field("logit_bias", "must be an object of token id -> bias, or a list of [token, bias] pairs")
    if len(pairs) > MAX_LOGIT_BIAS:
        raise bad_field("logit_bias", f"has {len(pairs)} entries, at most {MAX_LOGIT_BIAS} are allowed")
    vocab, bias = _vocab_size(engine), {}
    for i, (token, amount) in enumerate(pairs):
        where = f"logit_bias[{i}]" if isinstance(value, list) else f"logit_bias.{_key_name(str(token))}"
        amount = _bias_value(amount, where)
        if isinstance(token, str) and isinstance(value, dict):
            digits = token.strip().lstrip("-")
            if not (digits.isascii() and digits.isdigit()):  # "²".isdigit(), but int("²") fails
                raise bad_field(where, "must be keyed by a token id (an integer as a string)")
            ids = [int(token)]
        elif isinstance(token, str):
            if len(token) > MAX_STOP_CHARS:
                raise bad_field(where, f"has a text over the limit of {MAX_STOP_CHARS} characters")
            ids = engine.tokenizer.encode(token, add_special_tokens=False)
        elif isinstance(token, int) and not isinstance(token, bool):
            ids = [token]
        else:
            raise bad_field(where, f"must name a token by id or text, got {_show(token)}")
        for t in ids:
            if not 0 <= t < vocab:
                raise bad_field(where, f"names token id {t}, outside the vocabulary (size {vocab})")
            bias[t] = amount
    return bias


def _schema(value, field: str) -> Constraint:
    if isinstance(value, bool) or not isinstance(value, dict):
        raise bad_field(field, f"must be a JSON schema object, got {_show(value)}")
    text = json.dumps(value)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise bad_field(field, f"has {len(text)} characters, over the limit of {MAX_GRAMMAR_CHARS}")
    return Constraint("json_schema", text)


def _response_format(value) -> Constraint | None:
    if not isinstance(value, dict):
        raise bad_field("response_format", f"must be an object, got {_show(value)}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":  # llama.cpp also takes a schema here
        if value.get("schema") is None:
            return Constraint("json_object")
        return _schema(value["schema"], "response_format.schema")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if spec is None and value.get("schema") is not None:
            return _schema(value["schema"], "response_format.schema")
        if not isinstance(spec, dict):
            raise bad_field("response_format.json_schema", "must be an object with the schema under 'schema'")
        if spec.get("name") is not None and not isinstance(spec["name"], str):
            raise bad_field("response_format.json_schema.name", "must be a string")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise bad_field("response_format.json_schema.strict", "must be true or false")
        if spec.get("schema") is None:
            return Constraint("json_object")
        return _schema(spec["schema"], "response_format.json_schema.schema")
    raise bad_field("response_format.type", f"must be text, json_object or json_schema, got {_show(kind)}")


def _constraint(body: dict) -> tuple[Constraint | None, str]:
    """The output's grammar, from response_format, llama.cpp's grammar (GBNF) or its json_schema: at most one."""
    given = [k for k in ("response_format", "grammar", "json_schema") if body.get(k) is not None]
    found: list[tuple[Constraint, str]] = []
    for key in given:
        value = body[key]
        if key == "response_format":
            constraint = _response_format(value)
        elif key == "grammar":
            if not isinstance(value, str):
                raise bad_field("grammar", f"must be a GBNF grammar as a string, got {_show(value)}")
            if len(value) > MAX_GRAMMAR_CHARS:
                raise bad_field("grammar", f"has {len(value)} characters, over the limit of {MAX_GRAMMAR_CHARS}")
            constraint = Constraint("gbnf", value) if value.strip() else None
        else:
            constraint = None if value == {} else _schema(value, "json_schema")
        if constraint is not None:
            found.append((constraint, key))
    if len(found) > 1:
        raise bad_field(found[1][1], f"cannot be combined with {found[0][1]}: send one constraint on the output")
    return found[0] if found else (None, "")


def _logprobs(body: dict, route: str) -> int | None:
    """How many alternatives each emitted token's log-probability comes with (None: no logprobs)."""
    if route == "chat":
        on = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", None, minimum=0)
        if top is not None and top > MAX_TOP_LOGPROBS:
            raise bad_field("top_logprobs", f"must be <= {MAX_TOP_LOGPROBS}, got {top}")
        if top and not on:
            raise bad_field("top_logprobs", "needs logprobs: true")
        return (top or 0) if on else None
    key = "logprobs" if route == "completions" else "n_probs"
    if body.get(key) is False:
        return None
    k = _int(body, key, None, minimum=0)
    if k is not None and k > MAX_TOP_LOGPROBS:
        raise bad_field(key, f"must be <= {MAX_TOP_LOGPROBS}, got {k}")
    return None if route == "native" and not k else k


def _sampling(body: dict, settings: ServerSettings, max_tokens: int, engine, route: str
              ) -> tuple[SamplingParams, str]:
    """The request's SamplingParams, and the field its output constraint came from ('' for none)."""
    seed = _int(body, "seed", None)
    if seed is not None and seed < 0:
        seed = None  # llama.cpp's -1 (and any negative): a random seed, reported back
    constraint, constraint_field = _constraint(body)
    params = SamplingParams(
        temperature=_float(body, "temperature", settings.temperature),
        top_k=_int(body, "top_k", settings.top_k),
        top_p=_float(body, "top_p", settings.top_p),
        min_p=_float(body, "min_p", settings.min_p),
        seed=seed if "seed" in body else settings.seed,
        max_tokens=max_tokens,
        stop=_stop(body),
        ignore_eos=_bool(body, "ignore_eos"),
        logit_bias=_logit_bias(body, engine),
        repeat_penalty=_float(body, "repeat_penalty", 1.0),
        repeat_last_n=_int(body, "repeat_last_n", 64),
        presence_penalty=_float(body, "presence_penalty", 0.0),
        frequency_penalty=_float(body, "frequency_penalty", 0.0),
        constraint=constraint,
        logprobs=_logprobs(body, route),
    )
    try:
        params.validate()
    except ValueError as e:  # its messages start with the field's name
        field = str(e).split()[0]
        raise APIError(400, str(e), param=field) from None
    return params, constraint_field


def _compile(engine, params: SamplingParams, field: str) -> None:
    """The output constraint compiled by the engine while the request is parsed, so a grammar it cannot use is a
    400 naming the field it came from before any work is queued (the compiled grammar is cached for the
    generation)."""
    if params.constraint is None:
        return
    try:
        engine.compile_constraint(params.constraint)
    except ValueError as e:
        raise bad_field(field or "grammar", f"cannot be used: {e}") from None


def _slot_fields(body: dict, settings: ServerSettings) -> dict:
    """llama-server's fields of how a request uses its slot, the same on every generation route."""
    return {"cache_prompt": _bool(body, "cache_prompt", True), "return_progress": _bool(body, "return_progress"),
            "n_keep": _int(body, "n_keep", settings.keep, minimum=-1)}


def _speculative(body: dict, settings: ServerSettings) -> tuple[int | None, int]:
    n_max = _int(body, "speculative.n_max", settings.spec_n_max, minimum=0)
    n_min = _int(body, "speculative.n_min", settings.spec_n_min, minimum=0)
    return n_max, n_min


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise bad_field("stream_options", f"must be an object, got {_show(options)}")
    return stream, _bool(options, "include_usage")


def _model(body: dict, settings: ServerSettings, engine) -> str:
    model = body.get("model")
    if model is None:
        return settings.alias or engine.name
    if not isinstance(model, str):
        raise bad_field("model", f"must be a string, got {_show(model)}")
    if len(model) > MAX_MODEL_CHARS:
        raise bad_field("model", f"has {len(model)} characters, over the limit of {MAX_MODEL_CHARS}")
    return model


def _choices(body: dict) -> int:
    n = _int(body, "n", 1, minimum=1)
    if n > MAX_CHOICES:
        raise bad_field("n", f"must be <= {MAX_CHOICES}, got {n}")
    best_of = _int(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise bad_field("best_of", f"must equal n ({n}): choices are not ranked here, got {best_of}")
    return n


def _check_prompt(engine, ids: list[int], field: str) -> None:
    try:
        engine.check_prompt(ids)
    except ValueError as e:
        raise bad_field(field, str(e)) from None


def max_prompt_chars(engine) -> int:
    return MAX_CHARS_PER_TOKEN * engine.context_size


def check_chars(n: int, engine, field: str, what: str) -> None:
    limit = max_prompt_chars(engine)
    if n > limit:
        raise bad_field(field, f"{what} {n} characters, over the limit of {limit} ({MAX_CHARS_PER_TOKEN} per token of "
                          f"the context size {engine.context_size})")


# --- chat -------------------------------------------------------------------------------------------------------


def joined_text(content, where: str, kinds: tuple[str, ...]) -> str:
    """A string, or a list of text parts (of one of kinds) joined: the content of another API's message."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_field(where, "must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            raise bad_field(f"{where}[{j}]", f"must be a text part ({' / '.join(kinds)}): only text is supported")
        parts.append(part["text"])
    return "".join(parts)


def _text_chars(value) -> int:
    """Characters of all the text in a JSON value (check_json has bounded its depth)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(k) + _text_chars(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(_text_chars(v) for v in value)
    return 0


def _messages(body: dict, engine) -> list[dict]:
    """The chat's messages, checked, with their size bounded (each one costs template work, its text tokenizing)."""
    from flashdraft.loading.tokenizer import normalize_messages  # not at the top: it imports torch

    if "messages" not in body:
        raise bad_field("messages", "is required")
    try:
        messages = normalize_messages(body["messages"])
    except ValueError as e:
        raise bad_field("messages", str(e)) from None
    if len(messages) > engine.context_size:
        raise bad_field("messages", f"has {len(messages)} messages, more than the context size {engine.context_size}")
    check_chars(_text_chars(messages), engine, "messages", "have")
    return messages


def _request_template(body: dict, kwargs: dict, settings: ServerSettings) -> tuple[str | None, str]:
    """A chat template sent by the request (top-level, as vLLM takes it, or in chat_template_kwargs, as
    transformers does) and the field it came in; refused unless the server allows them."""
    given = [(f, v) for f, v in (("chat_template", body.get("chat_template")),
                                 ("chat_template_kwargs.chat_template", kwargs.get("chat_template")))
             if v is not None]
    if not given:
        return None, ""
    field, template = given[0]
    if not settings.allow_request_template:
        raise bad_field(field, "is refused: this server renders only its own chat template (start it with "
                          "--allow-request-chat-template to accept templates from requests)")
    if len(given) > 1:
        raise bad_field(field, "is given twice: send it either at the top level or in chat_template_kwargs")
    if not isinstance(template, str) or not template:
        raise bad_field(field, "must be a non-empty string")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise bad_field(field, f"has {len(template)} characters, over the limit of {MAX_TEMPLATE_CHARS}")
    return template, field


def _template_kwargs(body: dict, engine, settings: ServerSettings) -> tuple[dict, str | None, str]:
    """chat_template_kwargs (less any template), and the request's template with the field it came in. A key
    that would replace one of the template's own inputs (messages, add_generation_prompt, a special token, ...)
    is refused."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise bad_field("chat_template_kwargs", f"must be an object, got {_show(kwargs)}")
    template, field = _request_template(body, kwargs, settings)
    reserved = engine.tokenizer.template_input_names()
    for key in kwargs:
        if key in reserved and key != "chat_template":
            raise bad_field(f"chat_template_kwargs.{_key_name(key)}",
                       "would replace the template's own input of that name: it cannot be set here")
    kwargs = {k: v for k, v in kwargs.items() if k != "chat_template"}
    if settings.reasoning_budget == 0:  # llama-server's: no thinking at all
        kwargs = {"enable_thinking": False, **kwargs}
    elif settings.reasoning != "auto":  # the server-wide default; a request's own chat_template_kwargs win
        kwargs = {"enable_thinking": settings.reasoning == "on", **kwargs}
    return kwargs, template, field


def _render(messages: list[dict], kwargs: dict, template: str | None, field: str, engine,
            settings: ServerSettings, templates, cancelled: threading.Event | None) -> str:
    """The prompt text: the server's template (the model's, or --chat-template), else the request's in the
    sandbox."""
    if template is None:
        if settings.chat_template:
            kwargs = {**kwargs, "chat_template": settings.chat_template}
        try:
            return engine.tokenizer.render_chat(messages, **kwargs)
        except (ConfigError, ValueError) as e:
            raise bad_field("messages", str(e)) from None
    variables = {**engine.tokenizer.special_tokens(), **kwargs, "messages": messages, "add_generation_prompt": True}
    try:
        return templates.render(template, variables, max_prompt_chars(engine), cancelled)
    except TemplateBusy as e:
        raise APIError(503, str(e)) from None
    except TemplateError as e:
        raise bad_field(field, f"failed: {e}") from None


def template_text(template: str | None, engine, settings: ServerSettings) -> str:
    """The text of the template a chat is rendered with (its tool and thinking formats are read off it)."""
    return template or settings.chat_template or engine.tokenizer.chat_template or ""


def _reasoning_format(body: dict, settings: ServerSettings) -> str:
    value = body.get("reasoning_format")
    if value is None:
        return settings.reasoning_format
    if value not in REASONING_FORMATS:
        raise bad_field("reasoning_format", f"must be one of {', '.join(REASONING_FORMATS)}, got {_show(value)}")
    return value


@dataclass
class ChatPrompt:
    text: str
    ids: list[int]
    tools: ToolPlan | None
    reasoning: Reasoning | None


def chat_prompt(body: dict, engine, settings: ServerSettings, templates=None,
                cancelled: threading.Event | None = None) -> ChatPrompt:
    """A chat's prompt: messages and tools rendered by the chat template, a forced tool call's start pre-filled;
    and how its output is to be split (tool calls, reasoning)."""
    messages = _messages(body, engine)
    kwargs, template, field = _template_kwargs(body, engine, settings)
    source = template_text(template, engine, settings)
    try:
        plan = plan_tools(body, source)
    except ToolError as e:
        raise bad_field(e.field, str(e)) from None
    if plan is not None and plan.native:
        kwargs = {**kwargs, "tools": plan.tools}
    elif plan is not None:
        messages = generic_messages(messages, plan.tools)
    text = _render(messages, kwargs, template, field, engine, settings, templates, cancelled)
    if not _encodes(text):
        raise bad_field("messages", "rendered by the chat template into text that is not valid UTF-8")
    reasoning = reasoning_for(source, text, _reasoning_format(body, settings))
    if plan is not None and plan.prefill:
        if reasoning is not None and reasoning.starts_inside:
            raise bad_field("tool_choice", "cannot be enforced while the prompt opens the model's thinking: turn "
                                      "reasoning off (chat_template_kwargs.enable_thinking: false)")
        text += plan.prefill
    check_chars(len(text), engine, "messages", "rendered into")
    ids = engine.tokenizer.encode(text, add_special_tokens=False)  # the template writes any BOS itself
    _check_prompt(engine, ids, "messages")
    return ChatPrompt(text, ids, plan, reasoning)


def parse_chat(body: dict, engine, settings: ServerSettings, templates=None,
               cancelled: threading.Event | None = None) -> GenerationRequest:
    """POST /v1/chat/completions. templates: the TemplateSandbox for request templates (when allowed);
    cancelled: set when the client leaves, which stops the rendering of its template."""
    _unsupported(body, "chat")
    n = _choices(body)
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), settings, engine.context_size, False)
    params, constraint_field = _sampling(body, settings, max_tokens, engine, "chat")
    stream, include_usage = _stream_flags(body)
    n_max, n_min = _speculative(body, settings)
    model, per_token = _model(body, settings, engine), _bool(body, "timings_per_token")
    prompt = chat_prompt(body, engine, settings, templates, cancelled)
    if prompt.tools is not None and prompt.tools.constraint is not None:
        if params.constraint is not None:
            raise bad_field(constraint_field, "cannot be combined with a required or named tool_choice (both constrain "
                                         "the output)")
        params, constraint_field = replace(params, constraint=prompt.tools.constraint), "tool_choice"
    _compile(engine, params, constraint_field)
    return GenerationRequest(prompt.ids, params, n_max, n_min, stream, include_usage, model, prompt.text,
                             timings_per_token=per_token, n=n, tools=prompt.tools, reasoning=prompt.reasoning,
                             constraint_field=constraint_field, **_slot_fields(body, settings))


def parse_as_chat(translate, body: dict, *args) -> GenerationRequest:
    """Another API's request (Anthropic's Messages, OpenAI's Responses) parsed as the chat it stands for:
    translate(body) gives the chat body and its field names in the request's words, which the chat parser's
    errors are given in (args: parse_chat's after the body)."""
    chat, names = translate(body)
    try:
        return parse_chat(chat, *args)
    except APIError as e:
        raise renamed(e, names) from None


# --- completions --------------------------------------------------------------------------------------------------


def _prompt_ids(body: dict, engine) -> tuple[list[int], str]:
    """A completion prompt: a string, a list of token ids, or a one-element list of either."""
    if "prompt" not in body:
        raise bad_field("prompt", "is required")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_field("prompt", "is empty")
        check_chars(len(prompt), engine, "prompt", "has")
        ids = engine.encode_prompt(prompt)
        _check_prompt(engine, ids, "prompt")
        return ids, prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        _check_prompt(engine, prompt, "prompt")  # ids outside the vocabulary would fail in the decoder
        return list(prompt), engine.tokenizer.decode(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise bad_field("prompt", "has several prompts: send one prompt per request")
    raise bad_field("prompt", "must be a string or a list of token ids")


def parse_completion(body: dict, engine, settings: ServerSettings, templates=None,
                     cancelled: threading.Event | None = None) -> GenerationRequest:
    """POST /v1/completions (templates and cancelled: as parse_chat's, unused here)."""
    _unsupported(body, "completions")
    n = _choices(body)
    max_tokens = _max_tokens(body, ("max_tokens",), settings, engine.context_size, False)
    params, constraint_field = _sampling(body, settings, max_tokens, engine, "completions")
    echo = _bool(body, "echo")
    if echo and params.logprobs is not None:
        raise bad_field("echo", "cannot be combined with logprobs: the prompt's log-probabilities are not computed")
    stream, include_usage = _stream_flags(body)
    n_max, n_min = _speculative(body, settings)
    model, per_token = _model(body, settings, engine), _bool(body, "timings_per_token")
    ids, text = _prompt_ids(body, engine)
    _compile(engine, params, constraint_field)
    return GenerationRequest(ids, params, n_max, n_min, stream, include_usage, model, text,
                             timings_per_token=per_token, n=n, echo=echo, constraint_field=constraint_field,
                             **_slot_fields(body, settings))


def parse_native(body: dict, engine, settings: ServerSettings, templates=None,
                 cancelled: threading.Event | None = None) -> GenerationRequest:
    """llama.cpp's POST /completion (n_predict, -1 = until the context is full)."""
    _unsupported(body, "native")
    max_tokens = _max_tokens(body, ("n_predict", "max_tokens"), settings, engine.context_size, True)
    params, constraint_field = _sampling(body, settings, max_tokens, engine, "native")
    n_max, n_min = _speculative(body, settings)
    stream, model = _bool(body, "stream"), _model(body, settings, engine)
    return_tokens, per_token = _bool(body, "return_tokens"), _bool(body, "timings_per_token")
    ids, text = _prompt_ids(body, engine)
    _compile(engine, params, constraint_field)
    return GenerationRequest(ids, params, n_max, n_min, stream, False, model, text, return_tokens=return_tokens,
                             timings_per_token=per_token, constraint_field=constraint_field,
                             **_slot_fields(body, settings))


DELTA, RESULT, ERROR, ENDED, PROGRESS = "delta", "result", "error", "ended", "progress"


class Job:
    _ids = itertools.count()

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop,
                 cancelled: threading.Event | None = None):
        """cancelled: the request's cancel flag, when it was made before the job (to stop its parsing too)."""
        self.id = next(Job._ids)
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = cancelled or threading.Event()
        self.slot_id: int | None = None
        self.on_cancel: Callable[[Job], None] | None = None  # set by the scheduler that holds the job

    def cancel(self) -> None:
        """Stop the job: a queued one leaves the queue at once (its handler gets "ended"), a running one stops
        before its next step."""
        if self.cancelled.is_set():
            return
        self.cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel(self)

    def post(self, kind: str, payload, choice: int = 0) -> None:
        """Called from the worker thread."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload, choice))
        except RuntimeError:  # the event loop has closed: nobody is waiting any more
            pass
