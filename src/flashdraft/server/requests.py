"""Request bodies -> a checked GenerationRequest. Every problem becomes a 400 that names the field at fault."""
from __future__ import annotations

import math
from dataclasses import dataclass

from flashdraft.config import ConfigError, SamplingParams
from flashdraft.server.errors import APIError
from flashdraft.server.settings import ServerSettings

MAX_STOP_STRINGS = 16


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


def _bad(field: str, message: str) -> APIError:
    return APIError(400, f"'{field}' {message}", param=field)


def _int(body: dict, key: str, default, minimum: int | None = None):
    value = body.get(key)
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not (math.isfinite(value) and value.is_integer()))):
        raise _bad(key, f"must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise _bad(key, f"must be >= {minimum}, got {value}")
    return value


def _float(body: dict, key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(key, f"must be a number, got {value!r}")
    return float(value)


def _bool(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(key, f"must be true or false, got {value!r}")
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("stop", "must be a string or a list of strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise _bad("stop", f"has {len(stop)} strings, at most {MAX_STOP_STRINGS} are allowed")
    return stop


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
        raise _bad(key, f"must be >= 1, got {value}")
    if value > context_size:
        raise _bad(key, f"is {value}, more than the context size {context_size}")
    return value


def _sampling(body: dict, settings: ServerSettings, max_tokens: int) -> SamplingParams:
    seed = _int(body, "seed", None)
    if seed is not None and seed < 0:
        seed = None  # llama.cpp's -1 (and any negative): a random seed, reported back
    params = SamplingParams(
        temperature=_float(body, "temperature", settings.temperature),
        top_k=_int(body, "top_k", settings.top_k),
        top_p=_float(body, "top_p", settings.top_p),
        min_p=_float(body, "min_p", settings.min_p),
        seed=seed if "seed" in body else settings.seed,
        max_tokens=max_tokens,
        stop=_stop(body),
        ignore_eos=_bool(body, "ignore_eos"),
    )
    try:
        params.validate()
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return params


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
        raise _bad("stream_options", f"must be an object, got {options!r}")
    return stream, _bool(options, "include_usage")


def _model(body: dict, settings: ServerSettings) -> str:
    model = body.get("model")
    if model is None:
        return settings.alias
    if not isinstance(model, str):
        raise _bad("model", f"must be a string, got {model!r}")
    return model


def _check_n(body: dict) -> None:
    if _int(body, "n", 1) != 1:
        raise _bad("n", "must be 1: one choice per request is supported")


def _check_prompt(engine, ids: list[int], field: str) -> None:
    try:
        engine.check_prompt(ids)
    except ValueError as e:
        raise _bad(field, str(e)) from None


def parse_chat(body: dict, engine, settings: ServerSettings) -> GenerationRequest:
    """POST /v1/chat/completions."""
    if "messages" not in body:
        raise _bad("messages", "is required")
    _check_n(body)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "must be an object")
    if settings.reasoning != "auto":  # the server-wide default; a request's own chat_template_kwargs win
        kwargs = {"enable_thinking": settings.reasoning == "on", **kwargs}
    if settings.chat_template:
        kwargs = {**kwargs, "chat_template": settings.chat_template}
    try:
        text = engine.tokenizer.render_chat(body["messages"], **kwargs)
    except (ConfigError, ValueError) as e:
        raise _bad("messages", str(e)) from None
    ids = engine.tokenizer.encode(text, add_special_tokens=False)  # the template writes any BOS itself
    _check_prompt(engine, ids, "messages")
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), settings, engine.context_size, False)
    stream, include_usage = _stream_flags(body)
    n_max, n_min = _speculative(body, settings)
    return GenerationRequest(ids, _sampling(body, settings, max_tokens), n_max, n_min, stream, include_usage,
                             _model(body, settings), text)


def _prompt_ids(body: dict, engine) -> tuple[list[int], str]:
    """A completion prompt: a string, a list of token ids, or a one-element list of either."""
    if "prompt" not in body:
        raise _bad("prompt", "is required")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt", "is empty")
        return engine.encode_prompt(prompt), prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt), engine.tokenizer.decode(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise _bad("prompt", "has several prompts: send one prompt per request")
    raise _bad("prompt", "must be a string or a list of token ids")


def parse_completion(body: dict, engine, settings: ServerSettings) -> GenerationRequest:
    """POST /v1/completions."""
    _check_n(body)
    ids, text = _prompt_ids(body, engine)
    _check_prompt(engine, ids, "prompt")
    max_tokens = _max_tokens(body, ("max_tokens",), settings, engine.context_size, False)
    stream, include_usage = _stream_flags(body)
    n_max, n_min = _speculative(body, settings)
    return GenerationRequest(ids, _sampling(body, settings, max_tokens), n_max, n_min, stream, include_usage,
                             _model(body, settings), text)


def parse_native(body: dict, engine, settings: ServerSettings) -> GenerationRequest:
    """llama.cpp's POST /completion (n_predict, -1 = until the context is full)."""
    ids, text = _prompt_ids(body, engine)
    _check_prompt(engine, ids, "prompt")
    max_tokens = _max_tokens(body, ("n_predict", "max_tokens"), settings, engine.context_size, True)
    n_max, n_min = _speculative(body, settings)
    return GenerationRequest(ids, _sampling(body, settings, max_tokens), n_max, n_min, _bool(body, "stream"),
                             False, _model(body, settings), text, return_tokens=_bool(body, "return_tokens"))
