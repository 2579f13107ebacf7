"""Reasoning: thinking text into reasoning_content (Qwen3 <think>, Gemma 4's thought channel, a prompt that opens
the thought), streamed as delta.reasoning_content, left in content with --reasoning-format none;
--reasoning-budget; --chat-template NAME|TEMPLATE."""
from __future__ import annotations

import json

import pytest
from test_api_tools import ASK, SETTINGS, WEATHER, fake_engine, plant, tools_server  # noqa: F401 (a fixture)
from test_server_hardening import post
from tiny_models import build_tools_tokenizer

from flashdraft.server.chat_templates import BUILTIN_TEMPLATES
from flashdraft.server.cli import build_parser, main as serve_main, settings_from_args
from flashdraft.server.formats import Reasoning, ReasoningSplitter, reasoning_for, split_reasoning
from flashdraft.server.requests import parse_chat
from flashdraft.server.settings import ServerSettings

QWEN = Reasoning("<think>", "</think>", False)
GEMMA = Reasoning("<|channel>thought", "<channel|>", False)
CASES = [
    (QWEN, "<think>\nFirst, 2 + 2.\n</think>\n\nIt is 4.", "First, 2 + 2.", "It is 4."),
    (Reasoning("<think>", "</think>", True), "The prompt opened it.</think>\n\nAnswer.", "The prompt opened it.",
     "Answer."),
    (GEMMA, "<|channel>thought\nHmm.<channel|>Done.", "Hmm.", "Done."),
    (QWEN, "No thinking here, and a <think> later.", "", "No thinking here, and a <think> later."),
    (QWEN, "<think>\nCut off by max_tokens", "Cut off by max_tokens", ""),
    (QWEN, "<think>\n\n  Two\n\nparagraphs. \n\n</think>\n\nAnswer.", "Two\n\nparagraphs.", "Answer."),
    (Reasoning("<think>", "</think>", True), "\nOpened.\n</think>Answer.", "Opened.", "Answer."),
    (QWEN, "<think>\n\n</think>\n\nNo thought.", "", "No thought."),
    (QWEN, "<think>\nCut inside a blank \n", "Cut inside a blank", ""),
]


@pytest.mark.parametrize("reasoning,text,thought,answer", CASES)
def test_split_whole_and_streamed(reasoning, text, thought, answer):
    assert split_reasoning(text, reasoning) == (thought, answer)
    for size in (1, 2, 3, 7):  # markers and the newlines around them split every way
        splitter = ReasoningSplitter(reasoning)
        pieces = [splitter.feed(text[i:i + size]) for i in range(0, len(text), size)] + [splitter.finish()]
        assert "".join(r for r, _ in pieces) == thought and "".join(c for _, c in pieces) == answer


def test_markers_and_formats_come_from_the_template(tmp_path):
    assert reasoning_for("...<think>...", "<|im_start|>assistant\n", "auto") == QWEN
    assert reasoning_for("...<think>...", "<|im_start|>assistant\n<think>\n", "deepseek").starts_inside
    assert not reasoning_for("<think>", "assistant\n<think>\n\n</think>\n\n", "auto").starts_inside
    assert reasoning_for("<|channel>", "<|turn>model\n", "auto") == GEMMA
    assert reasoning_for("<think>", "x", "none") is None and reasoning_for("chatml", "x", "auto") is None


def settings(tmp_path, *flags) -> ServerSettings:
    (tmp_path / "config.json").write_text("{}")  # the flags are only parsed here; no model is loaded
    return settings_from_args(build_parser().parse_args(["-m", str(tmp_path), *flags]))


def test_reasoning_flags_and_request_field(tmp_path):
    engine = fake_engine(build_tools_tokenizer(tmp_path / "tok", "qwen3"))
    model = tmp_path / "model"
    model.mkdir()
    on = parse_chat({"messages": ASK}, engine, settings(model))
    assert on.reasoning == QWEN and "</think>" not in on.prompt_text
    off = parse_chat({"messages": ASK}, engine, settings(model, "--reasoning-budget", "0"))
    assert off.prompt_text.endswith("<think>\n\n</think>\n\n")  # the template's thinking-off form
    assert parse_chat({"messages": ASK}, engine, settings(model, "--reasoning-format", "none")).reasoning is None
    assert parse_chat({"messages": ASK, "reasoning_format": "none"}, engine, SETTINGS).reasoning is None
    with pytest.raises(Exception, match="'reasoning_format' must be one of none, deepseek, auto"):
        parse_chat({"messages": ASK, "reasoning_format": "raw"}, engine, SETTINGS)


@pytest.mark.parametrize("flags,words", [
    (["--reasoning-budget", "512"], "--reasoning-budget must be -1 (unlimited) or 0"),
    (["--reasoning-budget", "0", "--reasoning", "on"], "contradicts --reasoning on"),
    (["--chat-template", "nonesuch"], "--chat-template 'nonesuch' is not a built-in template"),
])
def test_bad_reasoning_and_template_flags_are_errors_naming_them(tmp_path, capsys, flags, words):
    (tmp_path / "config.json").write_text("{}")
    assert serve_main(["-m", str(tmp_path), *flags]) == 1
    assert words in capsys.readouterr().err
    assert serve_main(["-m", str(tmp_path), "--reasoning-format", "raw"]) == 2


def test_chat_template_by_name_or_text(tmp_path, qwen3_dir):
    engine = fake_engine(qwen3_dir)
    for name in BUILTIN_TEMPLATES:
        prompt = parse_chat({"messages": [{"role": "system", "content": "S."}, *ASK]}, engine,
                            settings(tmp_path, "--chat-template", name)).prompt_text
        assert "Weather in Paris?" in prompt and "S." in prompt
    llama3 = parse_chat({"messages": ASK}, engine, settings(tmp_path, "--chat-template", "llama3")).prompt_text
    assert llama3.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    own = settings(tmp_path, "--chat-template", "{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert parse_chat({"messages": ASK}, engine, own).prompt_text == "[Weather in Paris?]"
    tools = parse_chat({"messages": ASK, "tools": [WEATHER]}, engine, settings(tmp_path, "--chat-template", "gemma"))
    assert not tools.tools.native and "<tools>" in tools.prompt_text  # built-ins take tools in a system message


def test_planted_thinking_goes_to_reasoning_content(tools_server, monkeypatch):  # noqa: F811
    plant(monkeypatch, tools_server.state.engine, lambda prompt: "<think>\nLook it up.\n</think>\n\nSunny.")
    message = post(tools_server, "/v1/chat/completions", {"messages": ASK}).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "Look it up." and message["content"] == "Sunny."
    body = {"messages": ASK, "stream": True}
    events = [json.loads(line[6:]) for line in post(tools_server, "/v1/chat/completions", body).text.splitlines()
              if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Look it up."
    assert "".join(d.get("content") or "" for d in deltas) == "Sunny."
    raw = post(tools_server, "/v1/chat/completions", {"messages": ASK, "reasoning_format": "none"}).json()
    assert raw["choices"][0]["message"]["content"].startswith("<think>")
    plant(monkeypatch, tools_server.state.engine, lambda prompt: "<think>\nCall it.\n</think>\n\n<tool_call>\n"
          '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    both = post(tools_server, "/v1/chat/completions", {"messages": ASK, "tools": [WEATHER]}).json()["choices"][0]
    assert both["message"]["reasoning_content"] == "Call it." and both["message"]["content"] is None
    assert both["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
