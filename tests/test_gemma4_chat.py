"""Gemma 4 chat: BOS written by the template only, the empty thought channel with thinking off, turn-ending stop ids."""
import pytest
import torch
from test_gemma4_tiny import build_gemma4_target

from flashdraft.models.gemma4.config import reasoning_template_kwargs, stop_token_ids
from flashdraft.engine.generator import Engine

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder, _ = build_gemma4_target(tmp_path_factory.mktemp("g4_chat"), layers=3)
    return Engine.load(folder, device="cpu", dtype=torch.float32, context_size=64)


def _ids(engine, text):
    return engine.tokenizer.encode(text, add_special_tokens=False)


def test_chat_prompt_has_one_bos_written_by_the_template(engine):
    ids = engine.encode_prompt(messages=MESSAGES)
    assert ids[0] == 2 and ids.count(2) == 1
    assert ids[1] == 105  # <|turn>system...


def test_thinking_off_ends_with_an_empty_thought_channel(engine):
    off = engine.tokenizer.encode_chat(MESSAGES, **reasoning_template_kwargs(False))
    tail = [105] + _ids(engine, "model\n") + [100] + _ids(engine, "thought\n") + [101]
    assert off[-len(tail):] == tail  # <|turn>model\n<|channel>thought\n<channel|>
    on = engine.tokenizer.encode_chat(MESSAGES, **reasoning_template_kwargs(True))
    assert 98 in on and 100 not in on  # <|think|> in the system turn, no pre-filled channel
    prompt = [105] + _ids(engine, "model\n")
    assert on[-len(prompt):] == prompt


def test_stop_ids_are_eos_end_of_turn_and_tool_response(engine, tmp_path):
    assert stop_token_ids(tmp_path) == []  # no tokenizer files: no ids guessed
    assert {1, 106, 50} <= engine.eos_ids
    assert {1, 106, 50} <= set(engine.decoder.target.config.eos_token_ids)


def test_serve_reasoning_off_maps_to_the_empty_thought_channel(engine, tmp_path):
    """`flashdraft serve --reasoning off` renders chat requests with thinking off; a request can still override."""
    from flashdraft.server.cli import build_parser, settings_from_args
    from flashdraft.server.requests import parse_chat

    (tmp_path / "config.json").write_text("{}")  # the flags are only parsed here; no model is loaded

    def settings(*flags):
        return settings_from_args(build_parser().parse_args(["-m", str(tmp_path), *flags]))

    body = {"messages": MESSAGES, "max_tokens": 4}
    off = parse_chat(body, engine, settings("--reasoning", "off")).prompt_ids
    assert off == engine.tokenizer.encode_chat(MESSAGES, **reasoning_template_kwargs(False))
    on = parse_chat(body, engine, settings("--reasoning", "on")).prompt_ids
    assert on == engine.tokenizer.encode_chat(MESSAGES, **reasoning_template_kwargs(True))
    override = {**body, "chat_template_kwargs": {"enable_thinking": True}}
    assert parse_chat(override, engine, settings("--reasoning", "off")).prompt_ids == on
