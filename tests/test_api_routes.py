"""The routes issue #22 adds: /tokenize, /detokenize, /apply-template, the 501s, Anthropic's /v1/messages and
OpenAI's /v1/responses (text, thinking and tools, whole and streamed; the openai client's responses API)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_api_tools import ANSWER, ASK, CALL, WEATHER, plant, tools_server  # noqa: F401 (a fixture)
from test_server_hardening import AUTH, KEY, post


def sse(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) pairs of an event stream with `event:` lines."""
    out = []
    for block in response.text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines:
            out.append((lines.get("event", ""), json.loads(lines["data"])))
    return out


def test_tokenize_detokenize_round_trip(tools_server):  # noqa: F811
    tok = tools_server.state.engine.tokenizer
    text = "def add(a, b): héllo"
    ids = post(tools_server, "/tokenize", {"content": text}).json()["tokens"]
    assert ids == tok.encode(text, add_special_tokens=False)
    pieces = post(tools_server, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    assert b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces) == \
        text.encode()
    assert post(tools_server, "/detokenize", {"tokens": ids}).json() == {"content": text}
    for path, body, words in (("/tokenize", {"content": 5}, "'content' must be a string"),
                              ("/tokenize", {"content": "x", "with_pieces": "yes"}, "'with_pieces'"),
                              ("/detokenize", {"tokens": [10**6]}, "outside the vocabulary"),
                              ("/detokenize", {"tokens": "abc"}, "'tokens' must be a list")):
        r = post(tools_server, path, body)
        assert r.status_code == 400 and words in r.json()["error"]["message"]


def test_apply_template_is_the_chat_prompt(tools_server):  # noqa: F811
    body = {"messages": ASK, "tools": [WEATHER]}
    prompt = post(tools_server, "/apply-template", body).json()["prompt"]
    assert "get_weather" in prompt and prompt.endswith("<|im_start|>assistant\n") and "Weather in Paris?" in prompt
    assert post(tools_server, "/apply-template", {"messages": []}).status_code == 400


@pytest.mark.parametrize("path", ["/v1/embeddings", "/embeddings", "/infill"])
def test_unimplemented_routes_answer_501_behind_the_key(tools_server, path):  # noqa: F811
    assert httpx.post(tools_server.url + path, json={"input": "x"}).status_code == 401
    r = post(tools_server, path, {"input": "x"})
    assert r.status_code == 501 and "not supported" in r.json()["error"]["message"]


def test_anthropic_messages_whole_and_streamed(tools_server, monkeypatch):  # noqa: F811
    plant(monkeypatch, tools_server.state.engine, lambda prompt: "<think>\nHmm.\n</think>\n\n" + ANSWER)
    body = {"model": "claude-any", "max_tokens": 50, "system": "Be brief.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}]}
    r = post(tools_server, "/v1/messages", body, headers={"x-api-key": KEY})
    message = r.json()
    assert message["type"] == "message" and message["model"] == "claude-any" and message["stop_reason"] == "end_turn"
    assert message["content"] == [{"type": "thinking", "thinking": "Hmm.", "signature": ""},
                                  {"type": "text", "text": ANSWER}]
    assert message["usage"]["output_tokens"] > 0
    events = sse(post(tools_server, "/v1/messages", {**body, "stream": True}))
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    text = "".join(d["delta"].get("text", "") for n, d in events if n == "content_block_delta")
    thought = "".join(d["delta"].get("thinking", "") for n, d in events if n == "content_block_delta")
    assert text == ANSWER and thought == "Hmm."
    starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert starts == ["thinking", "text"] and names.count("content_block_stop") == 2


def test_anthropic_tools_round_trip(tools_server, monkeypatch):  # noqa: F811
    prompts = []

    def answer_for(prompt):
        prompts.append(prompt)
        return ANSWER if "<tool_response>" in prompt else CALL

    plant(monkeypatch, tools_server.state.engine, answer_for)
    tool = {"name": "get_weather", "description": "Current weather", "input_schema": WEATHER["function"]["parameters"]}
    body = {"max_tokens": 50, "tools": [tool], "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    first = post(tools_server, "/v1/messages", body).json()
    assert first["stop_reason"] == "tool_use"
    (use,) = [b for b in first["content"] if b["type"] == "tool_use"]
    assert use["name"] == "get_weather" and use["input"] == {"city": "Paris"} and use["id"].startswith("toolu_")
    follow = {**body, "messages": body["messages"] + [
        {"role": "assistant", "content": first["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "21 C"}]}]}
    final = post(tools_server, "/v1/messages", follow).json()
    assert final["content"] == [{"type": "text", "text": ANSWER}] and "21 C" in prompts[-1]
    events = sse(post(tools_server, "/v1/messages", {**body, "stream": True}))
    partial = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"
               and d["delta"]["type"] == "input_json_delta"]
    assert [json.loads(p) for p in partial] == [{"city": "Paris"}]
    assert [d for n, d in events if n == "message_delta"][0]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize("body,words", [
    ({"messages": [{"role": "user", "content": "x"}]}, "'max_tokens' is required"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "'messages[0].content[0]' is a block of type 'image'"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305",
                                                                                  "name": "web_search"}]},
     "'tools[0]' must be a custom tool"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "mcp_servers": [{"url": "x"}]},
     "'mcp_servers' is not supported"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": 5}]}]}, "'messages[1].content[0].thinking' must be a string"),
])
def test_anthropic_bad_requests_name_the_field(tools_server, body, words):  # noqa: F811
    r = post(tools_server, "/v1/messages", body)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_responses_api_with_the_openai_client(tools_server, monkeypatch):  # noqa: F811
    plant(monkeypatch, tools_server.state.engine,
          lambda prompt: ANSWER if "<tool_response>" in prompt else "<think>\nCheck.\n</think>\n\n" + CALL)
    client = openai.OpenAI(base_url=tools_server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    tool = {"type": "function", "name": "get_weather", "description": "Current weather",
            "parameters": WEATHER["function"]["parameters"]}
    first = client.responses.create(model="m", input="Weather in Paris?", instructions="Be brief.", tools=[tool])
    kinds = [item.type for item in first.output]
    assert kinds == ["reasoning", "function_call"] and first.status == "completed"
    call = first.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    second = client.responses.create(model="m", tools=[tool], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}])
    assert second.output_text == ANSWER and second.usage.output_tokens > 0
    with client.responses.stream(model="m", input="Weather in Paris?", tools=[tool]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [i.type for i in final.output] == ["reasoning", "function_call"]
    assert any(e.type == "response.function_call_arguments.done" for e in events)
    plant(monkeypatch, tools_server.state.engine, lambda prompt: ANSWER)
    with client.responses.stream(model="m", input="Hi") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert text == ANSWER and stream.get_final_response().output_text == ANSWER


@pytest.mark.parametrize("body,words", [
    ({"input": "x", "previous_response_id": "resp_1"}, "'previous_response_id' is not supported"),
    ({"input": "x", "store": True}, "'store' is not supported"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "'input[0]' must be"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "'tools[0]' must be a function tool"),
    ({}, "'input' is required"),
])
def test_responses_bad_requests_name_the_field(tools_server, body, words):  # noqa: F811
    r = post(tools_server, "/v1/responses", body)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_responses_and_messages_generate_for_real(tools_server):  # noqa: F811
    """No planting: the tiny model's own greedy text through both routes."""
    r = post(tools_server, "/v1/responses", {"input": "def add(a, b):", "max_output_tokens": 4, "temperature": 0},
             headers=AUTH).json()
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    m = post(tools_server, "/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "def"}],
                                            "temperature": 0}).json()
    assert m["stop_reason"] in ("max_tokens", "end_turn") and m["usage"]["output_tokens"] <= 4


USER = [{"role": "user", "content": "x"}]
FUNCTION = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}


@pytest.mark.parametrize("path,body,param,words", [
    ("/v1/responses", {"input": "x", "max_output_tokens": 0}, "max_output_tokens",
     "'max_output_tokens' must be >= 1, got 0"),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": [1]}}},
     "text.format.schema", "'text.format.schema' must be a JSON schema object"),
    ("/v1/responses", {"input": "x", "temperature": "hot"}, "temperature", "'temperature' must be a number"),
    ("/v1/responses", {"instructions": "Be brief.", "input": [
        {"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c", "name": "get_weather",
                                           "arguments": "{x"}]}, "input", "input[1].arguments is not valid JSON"),
    ("/v1/responses", {"input": "x", "tools": [{**FUNCTION, "strict": True}]}, "tools[0].strict",
     "'tools[0].strict' is true, but a call's arguments follow the schema only when the call is forced"),
    ("/v1/messages", {"max_tokens": 0, "messages": USER}, "max_tokens", "'max_tokens' must be >= 1"),
    ("/v1/messages", {"max_tokens": 5, "messages": USER, "stop_sequences": ["a"] * 17}, "stop_sequences",
     "'stop_sequences' has 17 strings"),
    ("/v1/messages", {"max_tokens": 5, "messages": USER, "tools": [{"name": "get_weather", "input_schema": 5}]},
     "tools[0]", "'tools[0]' has function.parameters that is not a JSON schema object"),
    ("/v1/messages", {"max_tokens": 5, "messages": USER, "tools": [{"name": "f", "input_schema": {}, "strict": True}]},
     "tools[0].strict", "'tools[0].strict' is true"),
])
def test_errors_name_the_routes_own_fields(tools_server, path, body, param, words):  # noqa: F811
    r = post(tools_server, path, body)
    error = r.json()["error"]
    assert r.status_code == 400 and words in error["message"] and error["param"] == param, r.text


@pytest.mark.parametrize("body,words", [
    ({"top_logprobs": 2}, "'top_logprobs' is not supported"),
    ({"max_tool_calls": 1}, "'max_tool_calls' is not supported"),
    ({"truncation": "auto"}, "'truncation' is not supported"),
    ({"text": {"verbosity": "low"}}, "'text.verbosity' is not supported"),
    ({"metadata": {"k": 5}}, "'metadata' must be an object of at most 16 strings"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "'metadata' must be"),
])
def test_responses_fields_not_implemented_are_refused_by_name(tools_server, body, words):  # noqa: F811
    r = post(tools_server, "/v1/responses", {"input": "x", "max_output_tokens": 2, **body})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_responses_neutral_values_pass_and_metadata_is_echoed(tools_server, monkeypatch):  # noqa: F811
    plant(monkeypatch, tools_server.state.engine, lambda prompt: ANSWER)
    body = {"input": "x", "top_logprobs": 0, "truncation": "disabled", "text": {"verbosity": "medium"},
            "metadata": {"run": "7"}}
    r = post(tools_server, "/v1/responses", body)
    assert r.status_code == 200 and r.json()["metadata"] == {"run": "7"}, r.text
    events = sse(post(tools_server, "/v1/responses", {**body, "stream": True}))
    assert events[-1][1]["response"]["metadata"] == {"run": "7"}


def test_anthropic_thinking_budget_and_strict_tools(tools_server, monkeypatch):  # noqa: F811
    plant(monkeypatch, tools_server.state.engine, lambda prompt: '{"city": "Oslo"}')
    body = {"max_tokens": 2048, "messages": USER}
    r = post(tools_server, "/v1/messages", {**body, "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking.budget_tokens"
    assert "cannot be enforced" in r.json()["error"]["message"]
    r = post(tools_server, "/v1/messages", {**body, "max_tokens": 64,
                                            "thinking": {"type": "enabled", "budget_tokens": 64}})
    assert r.status_code == 200, r.text  # max_tokens bounds the thought to the budget
    strict = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"], "strict": True}
    r = post(tools_server, "/v1/messages", {**body, "tools": [strict], "tool_choice": {"type": "tool",
                                                                                       "name": "get_weather"}})
    assert r.status_code == 200 and r.json()["content"][-1]["input"] == {"city": "Oslo"}, r.text
