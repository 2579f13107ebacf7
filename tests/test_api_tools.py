"""Tool calling: tools rendered by each family's template (or injected in a system message), calls parsed out of
planted outputs (whole and streamed), tool_choice enforced by pre-fill and a schema, and the openai client's
round trip (call, tool result, answer) against a live server whose engine output is planted."""
from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
from test_server_hardening import KEY, LiveServer, post
from tiny_models import QWEN3_TOOLS_TEMPLATE, build_drafter, build_target, build_tools_tokenizer

from flashdraft.engine.generator import Delta, GenerationResult, GenerationStats
from flashdraft.loading.tokenizer import Tokenizer
from flashdraft.server.errors import APIError
from flashdraft.server.formats import (GEMMA4, GENERIC_INSTRUCTIONS, HERMES, LLAMA3, ToolPlan, ToolStream,
                                       gemma_arguments, parse_calls, template_format)
from flashdraft.server.requests import parse_chat
from flashdraft.server.settings import ServerSettings
from flashdraft.server.chat_templates import BUILTIN_TEMPLATES

SETTINGS = ServerSettings(model="m", drafter=None, alias=None)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = ASK + [{"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "21 C and sunny"}]
FORMATS = {"qwen3": HERMES, "llama3": LLAMA3, "gemma4": GEMMA4}
NAMES = {"get_weather", "get_time"}


def fake_engine(folder: Path):
    """What the chat parser reads of an engine, over a tokenizer alone (every constraint compiles)."""
    return SimpleNamespace(tokenizer=Tokenizer(folder), context_size=4096, check_prompt=lambda ids: None,
                           compile_constraint=lambda constraint: None, name="fake")


@pytest.fixture(scope="module", params=list(FORMATS))
def family_engine(request, tmp_path_factory):
    return request.param, fake_engine(build_tools_tokenizer(tmp_path_factory.mktemp(request.param), request.param))


def test_tools_and_history_reach_each_familys_template(family_engine):
    family, engine = family_engine
    assert template_format(engine.tokenizer.chat_template) == FORMATS[family]
    r = parse_chat({"messages": HISTORY, "tools": [WEATHER]}, engine, SETTINGS)
    assert "get_weather" in r.prompt_text and "Current weather in a city" in r.prompt_text[:r.prompt_text.index(
        "Weather in Paris?")]
    assert "21 C and sunny" in r.prompt_text and '"city": "Paris"' in r.prompt_text
    assert r.tools.format == FORMATS[family] and r.tools.native
    plain = parse_chat({"messages": ASK, "tools": [WEATHER], "tool_choice": "none"}, engine, SETTINGS)
    assert "get_weather" not in plain.prompt_text and plain.tools is None


def test_a_template_without_tools_gets_them_in_a_system_message(qwen3_dir):
    engine = fake_engine(qwen3_dir)  # its chat template is ChatML without tools
    r = parse_chat({"messages": [{"role": "system", "content": "Be brief."}, *HISTORY], "tools": [WEATHER],
                    "max_tokens": 2}, engine, SETTINGS)
    assert r.tools.format == HERMES and not r.tools.native
    system = r.prompt_text[:r.prompt_text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and json.dumps(WEATHER) in system
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in r.prompt_text
    assert GENERIC_INSTRUCTIONS.split("{tools}")[1].strip()[:40] in r.prompt_text


RESULTS = HISTORY + [{"role": "tool", "tool_call_id": "call_1", "content": "Humidity 40%"},
                     {"role": "user", "content": "And tomorrow?"}]


@pytest.mark.parametrize("name,turn", [
    ("gemma", "<start_of_turn>user\n<tool_response>\n21 C and sunny\n</tool_response>\n<tool_response>\nHumidity "
              "40%\n</tool_response>\n\nAnd tomorrow?<end_of_turn>"),
    ("mistral-v7", "[INST]<tool_response>\n21 C and sunny\n</tool_response>\n<tool_response>\nHumidity 40%\n"
                   "</tool_response>\n\nAnd tomorrow?[/INST]"),
    ("llama3", "<|start_header_id|>user<|end_header_id|>\n\n<tool_response>\n21 C and sunny\n</tool_response>\n"
               "<tool_response>\nHumidity 40%\n</tool_response>\n\nAnd tomorrow?<|eot_id|>")])
def test_tool_results_are_a_user_turn_for_templates_without_tools(tmp_path, qwen3_dir, name, turn):
    """A template without tools knows no `tool` role: results come back as the Hermes instructions teach, in one
    user turn, so the roles still alternate."""
    (tmp_path / "config.json").write_text("{}")
    settings = ServerSettings(model=str(tmp_path), drafter=None, alias=None, chat_template=BUILTIN_TEMPLATES[name])
    prompt = parse_chat({"messages": RESULTS, "tools": [WEATHER]}, fake_engine(qwen3_dir), settings).prompt_text
    assert turn in prompt and "tool<" not in prompt and "tool\n" not in prompt
    assert prompt.count("21 C and sunny") == 1 and "[/INST]21 C" not in prompt


MISTRAL_TOOLS = ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}{% for m in messages %}"
                 "{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}{% else %}[{{ m.role }}]{{ m.content }}"
                 "{% endif %}{% endfor %}")


def test_a_template_teaching_another_call_format_gets_the_generic_prompt(tmp_path, qwen3_dir):
    assert template_format(MISTRAL_TOOLS) is None
    assert template_format('{% if tools %}{"name": ..., "parameters": ...}{% endif %}') is None
    (tmp_path / "config.json").write_text("{}")
    settings = ServerSettings(model=str(tmp_path), drafter=None, alias=None, chat_template=MISTRAL_TOOLS)
    r = parse_chat({"messages": HISTORY, "tools": [WEATHER]}, fake_engine(qwen3_dir), settings)
    assert not r.tools.native and r.tools.format == HERMES
    assert "[AVAILABLE_TOOLS]" not in r.prompt_text and "<tools>" in r.prompt_text
    assert "[TOOL_CALLS]" not in r.prompt_text and '<tool_call>\n{"name": "get_weather"' in r.prompt_text


PLANTED = [
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me check.\n\n"),
    (LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", '
             '"parameters": {}}', ""),
    (GEMMA4, '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_call>call:get_time{}<tool_call|>',
     ""),
]


@pytest.mark.parametrize("fmt,text,content", PLANTED, ids=[p[0] for p in PLANTED])
def test_planted_calls_parse_whole_and_streamed(fmt, text, content):
    calls = parse_calls(text, fmt, NAMES)[1]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_time", {})]
    assert parse_calls(text, fmt, NAMES)[0] == content
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    stream = ToolStream(ToolPlan([WEATHER, TIME], fmt, native=True))
    released = "".join(stream.feed(ch) for ch in text)  # one character at a time: markers split every way
    rest, streamed = stream.finish()
    assert released + rest == content
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]


def test_text_without_calls_streams_as_it_comes_and_broken_calls_stay_content():
    stream = ToolStream(ToolPlan([WEATHER], HERMES, native=True))
    assert stream.feed("Hello <tool") == "Hello "  # a marker's start is held back...
    assert stream.feed("box> there") == "<toolbox> there"  # ...and released when it is not one
    assert stream.finish() == ("", [])
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    assert parse_calls(broken, HERMES, NAMES) == (broken, [])
    assert parse_calls("The answer is {not json", LLAMA3, NAMES) == ("The answer is {not json", [])
    stream = ToolStream(ToolPlan([WEATHER], LLAMA3, native=True))
    assert stream.feed("Sunny") == "Sunny" and stream.finish() == ("", [])


def test_only_calls_to_declared_tools_count():
    person = '{"name": "Alice", "age": 30}'
    assert parse_calls(person, LLAMA3, NAMES) == (person, [])  # a JSON answer, not a call
    assert parse_calls('{"name": "get_time"}', LLAMA3, NAMES)[1] == []  # Llama 3 calls carry their parameters
    assert [c.name for c in parse_calls('{"name": "get_time", "parameters": {}}', LLAMA3, NAMES)[1]] == ["get_time"]
    assert parse_calls('{"name": "Alice", "parameters": {}}', LLAMA3, NAMES)[1] == []
    undeclared = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    assert parse_calls(undeclared, HERMES, NAMES) == (undeclared, [])
    gemma = "<|tool_call>call:rm_rf{}<tool_call|>"
    assert parse_calls(gemma, GEMMA4, NAMES) == (gemma, [])
    not_json = '<tool_call>\n{"name": "get_time", "arguments": "now, please"}\n</tool_call>'
    assert parse_calls(not_json, HERMES, NAMES) == (not_json, [])  # arguments must be a JSON object
    text = '<tool_call>\n{"name": "get_time", "arguments": "{}"}\n</tool_call>'
    assert [c.arguments for c in parse_calls(text, HERMES, NAMES)[1]] == ["{}"]  # or JSON text of one


@pytest.mark.parametrize("fmt,head", [(HERMES, "<tool_call>\n"), (GEMMA4, "<|tool_call>call:get_time{a:"),
                                      (LLAMA3, '{"name": "get_time", "parameters": ')])
def test_deeply_nested_output_is_no_call(fmt, head):
    text = head + "[" * 3000
    assert parse_calls(text, fmt, NAMES) == (text, [])
    plan = ToolPlan([WEATHER, TIME], fmt, native=True, prefill="P", forced="get_time")
    assert plan.parse("[" * 3000) == ("P" + "[" * 3000, [])


@pytest.mark.parametrize("fmt,piece", [(GEMMA4, "<|tool_call>call:f{}x"), (GEMMA4, "<|tool_call>call:get_time{a:z"),
                                       (GEMMA4, "<|tool_call>call:get_time{a:z<tool_call|>"),
                                       (HERMES, "<tool_call>" + " " * 50), (HERMES, "<tool_call>{}</tool_call>")])
def test_adversarial_outputs_parse_in_linear_time(fmt, piece):
    text = piece * (200_000 // len(piece) + 1)
    started = time.perf_counter()
    content, calls = parse_calls(text, fmt, NAMES)
    assert time.perf_counter() - started < 0.5 and content == text and calls == []
    stream = ToolStream(ToolPlan([WEATHER, TIME], fmt, native=True))
    started = time.perf_counter()
    released = stream.feed(text)
    assert time.perf_counter() - started < 0.5 and released + stream.finish()[0] == text


def test_gemma_argument_syntax():
    text = '{city:<|"|>Paris, "FR"<|"|>,days:3,metric:true,tags:[<|"|>a<|"|>,2.5],nested:{x:null}}'
    assert gemma_arguments(text) == {"city": 'Paris, "FR"', "days": 3, "metric": True, "tags": ["a", 2.5],
                                     "nested": {"x": None}}
    assert gemma_arguments("{city:") is None and gemma_arguments("[1]") is None


def test_tool_choice_named_and_required_are_enforced_by_prefill_and_schema(family_engine):
    family, engine = family_engine
    body = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": {"type": "function",
                                                                         "function": {"name": "get_weather"}}}
    r = parse_chat(body, engine, SETTINGS)
    assert r.params.constraint.kind == "json_schema" and json.loads(r.params.constraint.source) == \
        WEATHER["function"]["parameters"]
    assert r.prompt_text.endswith(r.tools.prefill) and "get_weather" in r.tools.prefill
    assert [(c.name, c.arguments) for c in r.tools.parse('{"city": "Oslo"}')[1]] == [("get_weather",
                                                                                         '{"city": "Oslo"}')]
    required = {**body, "tool_choice": "required"}
    if family == "gemma4":
        with pytest.raises(APIError, match="'tool_choice' 'required' with several tools"):
            parse_chat(required, engine, SETTINGS)
        return
    r = parse_chat(required, engine, SETTINGS)
    options = json.loads(r.params.constraint.source)["anyOf"]
    assert [o["properties"]["name"]["const"] for o in options] == ["get_weather", "get_time"]
    call = '{"name": "get_time", "%s": {}}' % ("parameters" if family == "llama3" else "arguments")
    assert [c.name for c in r.tools.parse(call)[1]] == ["get_time"]


@pytest.mark.parametrize("body,words", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'tool_choice' names"),
    ({"tool_choice": "required"}, "'tool_choice' is 'required' but no tools"),
    ({"tools": [WEATHER, WEATHER]}, "'tools[1]' names the function 'get_weather' twice"),
    ({"tools": [{"type": "retrieval"}]}, "'tools[0]' must be"),
    ({"tools": [WEATHER], "functions": [WEATHER["function"]]}, "'functions' cannot be sent with tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "'response_format' cannot be combined with a required or named tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
     "not valid JSON"),
    ({"tools": [{"type": "function", "function": {**WEATHER["function"], "strict": True}}]},
     "'tools[0].function.strict' is true, but a call's arguments follow the schema only when the call is forced"),
    ({"functions": [{**WEATHER["function"], "strict": "yes"}]}, "'functions[0].strict' must be true or false"),
])
def test_bad_tools_are_400s_naming_the_field(qwen3_dir, body, words):
    with pytest.raises(APIError) as e:
        parse_chat({"messages": ASK, **body}, fake_engine(qwen3_dir), SETTINGS)
    assert e.value.status == 400 and words in e.value.message, e.value.message


def test_strict_tools_are_honoured_when_the_call_is_forced(qwen3_dir):
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = parse_chat({"messages": ASK, "tools": [strict], "tool_choice": choice}, fake_engine(qwen3_dir), SETTINGS)
        assert json.loads(r.params.constraint.source) == WEATHER["function"]["parameters"]


def test_legacy_functions_map_to_tools(qwen3_dir):
    r = parse_chat({"messages": ASK, "functions": [WEATHER["function"]], "function_call": {"name": "get_weather"}},
                   fake_engine(qwen3_dir), SETTINGS)
    assert r.tools.forced == "get_weather" and "get_weather" in r.prompt_text


# --- end to end, with the engine's output planted --------------------------------------------------------------


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory):
    """A tiny Qwen3 pair (a context long enough for the tools' system prompt) with a Qwen3-style tools template;
    its engine's output is planted per test."""
    root = tmp_path_factory.mktemp("qwen3_tools")
    target = build_target(root / "target", max_positions=2048)
    drafter = build_drafter(root / "drafter", target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN3_TOOLS_TEMPLATE}))
    (target / "chat_template.jinja").unlink(missing_ok=True)
    srv = LiveServer(target, drafter, ctx_size=2048)
    yield srv
    srv.stop()


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is 21 C and sunny in Paris."


def plant(monkeypatch, engine, answer_for, cut: bool = False):
    """engine.stream replaced: its output is answer_for(prompt text), in pieces of a few characters; cut: as if
    max_tokens ended it."""
    def stream(prompt_ids, params, *args, **kwargs):
        text = answer_for(engine.tokenizer.decode(prompt_ids))
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        for start in range(0, len(text), 5):
            yield Delta(text[start:start + 5], ids if start == 0 else [])
        reason, stop_type = ("length", "limit") if cut else ("stop", "eos")
        yield GenerationResult(text, ids, reason, stop_type, "", 1, GenerationStats(prompt_n=len(prompt_ids),
                                                                                    predicted_n=len(ids)))

    monkeypatch.setattr(engine, "stream", stream)


def test_planted_call_becomes_tool_calls_whole_and_streamed(tools_server, monkeypatch):
    plant(monkeypatch, tools_server.state.engine, lambda prompt: "Checking.\n" + CALL)
    body = {"messages": ASK, "tools": [WEATHER]}
    choice = post(tools_server, "/v1/chat/completions", body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'} and call["type"] == "function"
    events = [json.loads(line[6:]) for line in post(tools_server, "/v1/chat/completions", {**body, "stream": True})
              .text.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking.\n"
    streamed = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [(tc["index"], tc["function"]["name"], tc["function"]["arguments"]) for tc in streamed] == \
        [(0, "get_weather", '{"city": "Paris"}')]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


CUT = '<tool_call>\n{"name": "get_weather", "ci'


def test_a_reply_cut_by_max_tokens_says_length_and_keeps_the_cut_call_as_content(tools_server, monkeypatch):
    plant(monkeypatch, tools_server.state.engine, lambda prompt: CALL + "\n" + CUT, cut=True)
    body = {"messages": ASK, "tools": [WEATHER]}
    choice = post(tools_server, "/v1/chat/completions", body).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == CUT
    assert [c["function"]["arguments"] for c in choice["message"]["tool_calls"]] == ['{"city": "Paris"}']
    events = [json.loads(line[6:]) for line in post(tools_server, "/v1/chat/completions", {**body, "stream": True})
              .text.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content") or "" for d in deltas) == "\n" + CUT
    assert len([tc for d in deltas for tc in d.get("tool_calls", [])]) == 1
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_a_forced_call_cut_by_max_tokens_is_no_call(tools_server, monkeypatch):
    plant(monkeypatch, tools_server.state.engine, lambda prompt: '{"city": "Par', cut=True)
    forced = {"type": "function", "function": {"name": "get_weather"}}
    choice = post(tools_server, "/v1/chat/completions", {"messages": ASK, "tools": [WEATHER],
                                                         "tool_choice": forced}).json()["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    anthropic = {"max_tokens": 50, "tools": [tool], "tool_choice": {"type": "tool", "name": "get_weather"},
                 "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    for stream in (False, True):
        r = post(tools_server, "/v1/messages", {**anthropic, "stream": stream})
        assert r.status_code == 200 and "tool_use" not in r.text and "max_tokens" in r.text, r.text
    r = post(tools_server, "/v1/messages", anthropic).json()
    assert r["stop_reason"] == "max_tokens" and [b["type"] for b in r["content"]] == ["text"]
    plant(monkeypatch, tools_server.state.engine, lambda prompt: CALL + CUT, cut=True)
    r = post(tools_server, "/v1/messages", {**anthropic, "tool_choice": {"type": "auto"}}).json()
    assert r["stop_reason"] == "max_tokens" and [b["type"] for b in r["content"]] == ["text", "tool_use"]
    plant(monkeypatch, tools_server.state.engine, lambda prompt: CALL + CUT, cut=True)
    response = post(tools_server, "/v1/responses", {"input": "Weather?", "tools": [{"type": "function", **{
        "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}}]}).json()
    assert response["status"] == "incomplete" and [i["type"] for i in response["output"]] == ["message",
                                                                                            "function_call"]


def test_arguments_that_are_not_json_never_reach_a_500(tools_server, monkeypatch):
    plant(monkeypatch, tools_server.state.engine,
          lambda prompt: '<tool_call>\n{"name": "get_weather", "arguments": "city=Paris"}\n</tool_call>')
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    body = {"max_tokens": 50, "tools": [tool], "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    for stream in (False, True):
        r = post(tools_server, "/v1/messages", {**body, "stream": stream})
        assert r.status_code == 200 and "tool_use" not in r.text and "city=Paris" in r.text


def test_openai_client_round_trip(tools_server, monkeypatch):
    """The openai client's function-calling sample: a call, the tool's result sent back, the final answer."""
    prompts = []

    def answer_for(prompt):
        prompts.append(prompt)
        return ANSWER if "<tool_response>" in prompt else CALL

    plant(monkeypatch, tools_server.state.engine, answer_for)
    client = openai.OpenAI(base_url=tools_server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    messages = list(ASK)
    first = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls[0].function.name == "get_weather"
    messages.append(message.model_dump(exclude_none=True))
    arguments = json.loads(message.tool_calls[0].function.arguments)
    messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id,
                     "content": f"21 C and sunny in {arguments['city']}"})
    final = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
    assert final.choices[0].message.content == ANSWER and final.choices[0].finish_reason == "stop"
    assert "21 C and sunny in Paris" in prompts[-1] and '"arguments": {"city": "Paris"}' in prompts[-1]
    chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in calls] == ["get_weather"]
