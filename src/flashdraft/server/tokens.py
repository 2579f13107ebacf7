"""llama-server's utility routes: /tokenize, /detokenize and /apply-template, with the generation routes' checks
(sizes bounded, every bad value a 400 naming its field)."""
from __future__ import annotations

from flashdraft.server.errors import bad_field
from flashdraft.server.requests import check_chars, plain_ints, chat_prompt
from flashdraft.server.settings import ServerSettings


def _flag(body: dict, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_field(key, "must be true or false")
    return value


def tokenize(body: dict, engine, settings: ServerSettings, templates=None) -> dict:
    """{content, add_special, with_pieces} -> {tokens}: ids, or {id, piece} with the piece as text (or its bytes
    when it is not whole UTF-8 characters), as llama-server gives them."""
    content = body.get("content")
    if not isinstance(content, str):
        raise bad_field("content", "must be a string")
    check_chars(len(content), engine, "content", "has")
    add_special, with_pieces = _flag(body, "add_special", False), _flag(body, "with_pieces", False)
    ids = engine.tokenizer.encode(content, add_special_tokens=add_special)
    if not with_pieces:
        return {"tokens": ids}
    pieces = []
    for token_id in ids:
        raw = engine.tokenizer.token_bytes(token_id)
        try:
            piece = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        pieces.append({"id": token_id, "piece": piece})
    return {"tokens": pieces}


def detokenize(body: dict, engine, settings: ServerSettings, templates=None) -> dict:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not plain_ints(tokens):
        raise bad_field("tokens", "must be a list of token ids")
    vocab = engine.decoder.target.config.vocab_size
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise bad_field("tokens", f"has id(s) {bad[:5]} outside the vocabulary (size {vocab})")
    if len(tokens) > engine.context_size:
        raise bad_field("tokens", f"has {len(tokens)} ids, more than the context size {engine.context_size}")
    return {"content": engine.tokenizer.decode(tokens)}


def apply_template(body: dict, engine, settings: ServerSettings, templates=None) -> dict:
    """{messages, tools, chat_template_kwargs, ...} -> {prompt}: the text a chat request would be generated from."""
    return {"prompt": chat_prompt(body, engine, settings, templates).text}
