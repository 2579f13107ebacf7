"""Issue #22's request fields: what each parser hands the engine (SamplingParams, choices, echo), the 400 naming
each bad or unimplemented field, the logprobs shapes of each route, and n choices end to end."""
from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel
from test_server_hardening import AUTH, MESSAGES, LiveServer, post

from flashdraft.config import Constraint, SamplingParams
from flashdraft.engine.generator import GenerationResult, GenerationStats, TokenLogprob
from flashdraft.server import formats
from flashdraft.server.errors import APIError
from flashdraft.server.requests import parse_chat, parse_completion, parse_native
from flashdraft.server.settings import ServerSettings

SETTINGS = ServerSettings(model="m", drafter=None, alias=None)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(engine, **fields):
    return parse_chat({"messages": MESSAGES, "max_tokens": 4, **fields}, engine, SETTINGS)


def completion(engine, **fields):
    return parse_completion({"prompt": "def", "max_tokens": 4, **fields}, engine, SETTINGS)


def native(engine, **fields):
    return parse_native({"prompt": "def", "n_predict": 4, **fields}, engine, SETTINGS)


def refused(parse, engine, words: str, **fields) -> APIError:
    with pytest.raises(APIError) as e:
        parse(engine, **fields)
    assert e.value.status == 400 and words in e.value.message, e.value.message
    return e.value


def test_logit_bias_in_openai_and_llama_cpp_forms(engine):
    assert chat(engine, logit_bias={"5": 3, "7": -100}).params.logit_bias == {5: 3.0, 7: -100.0}
    assert completion(engine, logit_bias=[[9, False], [11, 1.5]]).params.logit_bias == {9: -100.0, 11: 1.5}
    ids = engine.tokenizer.encode("def", add_special_tokens=False)
    assert native(engine, logit_bias=[["def", -2]]).params.logit_bias == {i: -2.0 for i in ids}
    refused(chat, engine, "'logit_bias.5' must be in [-100, 100]", logit_bias={"5": 101})
    refused(chat, engine, "outside the vocabulary", logit_bias={"100000": 1})
    refused(chat, engine, "keyed by a token id", logit_bias={"def": 1})
    refused(chat, engine, "'logit_bias.²' must be keyed by a token id", logit_bias={"²": 1})  # "²".isdigit()
    refused(chat, engine, "keyed by a token id", logit_bias={"-٣": 1})
    refused(completion, engine, "'logit_bias'", logit_bias="x")


def test_penalties_reach_the_engine(engine):
    p = native(engine, repeat_penalty=1.3, repeat_last_n=-1, presence_penalty=0.5, frequency_penalty=-1).params
    assert (p.repeat_penalty, p.repeat_last_n, p.presence_penalty, p.frequency_penalty) == (1.3, -1, 0.5, -1.0)
    assert chat(engine).params.repeat_penalty == 1.0 and chat(engine).params.repeat_last_n == 64
    refused(chat, engine, "presence_penalty must be in [-2, 2]", presence_penalty=3)
    refused(completion, engine, "repeat_penalty must be > 0", repeat_penalty=0)
    refused(native, engine, "repeat_last_n must be >= -1", repeat_last_n=-2)


def test_output_constraints_from_each_field(engine):
    assert chat(engine, response_format={"type": "text"}).params.constraint is None
    assert chat(engine, response_format={"type": "json_object"}).params.constraint == Constraint("json_object")
    wrapped = {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": SCHEMA}}
    r = chat(engine, response_format=wrapped)
    assert r.params.constraint == Constraint("json_schema", json.dumps(SCHEMA)) and r.constraint_field == \
        "response_format"
    assert json.loads(completion(engine, json_schema=SCHEMA).params.constraint.source) == SCHEMA
    assert native(engine, grammar='root ::= "a"').params.constraint == Constraint("gbnf", 'root ::= "a"')
    assert native(engine, grammar="").params.constraint is None
    assert chat(engine, response_format={"type": "json_object", "schema": SCHEMA}).params.constraint.kind == \
        "json_schema"
    refused(chat, engine, "'grammar' cannot be combined with response_format",
            response_format={"type": "json_object"}, grammar='root ::= "a"')
    refused(chat, engine, "'response_format.type'", response_format={"type": "yaml"})
    refused(chat, engine, "'response_format.json_schema.schema' must be a JSON schema object",
            response_format={"type": "json_schema", "json_schema": {"schema": [1]}})
    refused(native, engine, "'grammar' must be a GBNF grammar", grammar=5)


def test_logprobs_fields_of_each_route(engine):
    assert chat(engine).params.logprobs is None
    assert chat(engine, logprobs=True).params.logprobs == 0
    assert chat(engine, logprobs=True, top_logprobs=3).params.logprobs == 3
    refused(chat, engine, "'top_logprobs' needs logprobs: true", top_logprobs=2)
    refused(chat, engine, "'top_logprobs' must be <= 20", logprobs=True, top_logprobs=21)
    assert completion(engine, logprobs=2).params.logprobs == 2
    assert completion(engine, logprobs=False).params.logprobs is None
    assert native(engine, n_probs=0).params.logprobs is None and native(engine, n_probs=4).params.logprobs == 4


def test_n_choices_best_of_and_echo(engine):
    r = chat(engine, n=3, seed=5)
    assert r.n == 3 and [r.choice_params(i).seed for i in range(3)] == [5, 6, 7]
    assert completion(engine, n=2).choice_params(1).seed is None  # no seed: each choice draws its own
    assert completion(engine, n=2, best_of=2).n == 2
    refused(completion, engine, "'best_of' must equal n", n=2, best_of=3)
    refused(chat, engine, "'n' must be >= 1", n=0)
    refused(chat, engine, "'n' must be <= 16", n=17)
    r = completion(engine, echo=True)
    assert r.echo and r.prompt_text == "def"
    refused(completion, engine, "'echo' cannot be combined with logprobs", echo=True, logprobs=1)


def test_fields_of_other_routes_and_unimplemented_ones_are_refused_by_name(engine):
    refused(chat, engine, "'echo' is not supported on this route", echo=True)
    refused(native, engine, "'n' is not supported on this route", n=2)
    refused(completion, engine, "'tool_choice' is not supported on this route", tool_choice="auto")
    refused(completion, engine, "'suffix' is not supported by this server", suffix="x")
    refused(native, engine, "'post_sampling_probs' is not supported", post_sampling_probs=True)
    for field, value in (("mirostat", 2), ("lora", [{"id": 0}]), ("image_data", [{"data": "x"}])):
        refused(native, engine, f"'{field}' is not supported", **{field: value})
    assert chat(engine, echo=False, n_probs=0).n == 1  # neutral values pass


# --- logprobs in each route's shape --------------------------------------------------------------------------


def result_with_logprobs(engine, text: str = "def add") -> GenerationResult:
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    entries = [TokenLogprob(t, -0.5 * (i + 1), [(t, -0.5 * (i + 1)), (3, -7.0)]) for i, t in enumerate(ids)]
    return GenerationResult(text, ids, "length", "limit", "", 1, GenerationStats(prompt_n=3, predicted_n=len(ids)),
                            logprobs=entries)


def test_chat_logprobs_shape(engine):
    request = chat(engine, logprobs=True, top_logprobs=2)
    result = result_with_logprobs(engine)
    body = formats.OpenAIFormatter(request, True, engine.tokenizer).whole([result])
    content = body["choices"][0]["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == "def add"
    assert bytes(b for c in content for b in c["bytes"]) == b"def add"
    assert [c["logprob"] for c in content] == [e.logprob for e in result.logprobs]
    assert content[0]["top_logprobs"][1] == {"token": engine.tokenizer.token_text(3), "logprob": -7.0,
                                             "bytes": list(engine.tokenizer.token_bytes(3))}
    assert formats.OpenAIFormatter(chat(engine), True, engine.tokenizer).whole([result])["choices"][0][
        "logprobs"] is None


def test_completion_and_native_logprobs_shapes(engine):
    result = result_with_logprobs(engine)
    legacy = formats.OpenAIFormatter(completion(engine, logprobs=1), False, engine.tokenizer).whole([result])
    lp = legacy["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == "def add" and lp["token_logprobs"] == [e.logprob for e in result.logprobs]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert lp["top_logprobs"][0][lp["tokens"][0]] == result.logprobs[0].logprob
    probs = formats.native_whole(native(engine, n_probs=2), result, 0, 0, engine.tokenizer)["completion_probabilities"]
    assert [p["id"] for p in probs] == result.tokens and probs[0]["top_logprobs"][1]["id"] == 3
    assert "completion_probabilities" not in formats.native_whole(native(engine), result, 0, 0, engine.tokenizer)


def test_streamed_chunks_carry_their_tokens_logprobs(engine):
    request = chat(engine, logprobs=True, stream=True)
    fmt = formats.OpenAIFormatter(request, True, engine.tokenizer)
    result = result_with_logprobs(engine)
    chunks = fmt.delta_chunks(0, "def", result.logprobs[:1]) + fmt.delta_chunks(0, " add", result.logprobs[1:])
    sent = [c["token"] for chunk in chunks for c in chunk["choices"][0]["logprobs"]["content"]]
    assert "".join(sent) == "def add"
    legacy = formats.OpenAIFormatter(completion(engine, logprobs=0, stream=True), False, engine.tokenizer)
    first = legacy.delta_chunks(0, "def", result.logprobs[:1])[0]["choices"][0]["logprobs"]
    second = legacy.delta_chunks(0, " add", result.logprobs[1:])[0]["choices"][0]["logprobs"]
    assert second["text_offset"][0] == len(first["tokens"][0])  # offsets run on across chunks


def test_token_bytes_of_a_byte_level_tokenizer(engine):
    tok = engine.tokenizer
    ids = tok.encode("héllo wörld", add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == "héllo wörld".encode()


# --- end to end ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(qwen3_dir, drafter_dir):
    srv = LiveServer(qwen3_dir, drafter_dir, ctx_size=128, n_predict=8)
    yield srv
    srv.stop()


def test_n_choices_whole_and_streamed(live):
    body = {"messages": MESSAGES, "max_tokens": 5, "n": 3, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    whole = post(live, "/v1/chat/completions", body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert whole["usage"]["completion_tokens"] == 15
    one = post(live, "/v1/chat/completions", {**body, "n": 1, "seed": 12}).json()
    assert one["choices"][0]["message"]["content"] == whole["choices"][1]["message"]["content"]  # seed + 1
    events = [json.loads(line[6:]) for line in post(live, "/v1/chat/completions", {**body, "stream": True}).text
              .splitlines() if line.startswith("data: {")]
    texts = {}
    for event in events:
        for c in event["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
    assert texts == {i: whole["choices"][i]["message"]["content"] for i in range(3)}
    finished = [c["index"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finished == [0, 1, 2]
    legacy = post(live, "/v1/completions", {"prompt": "def", "max_tokens": 3, "n": 2, "echo": True}).json()
    assert all(c["text"].startswith("def") for c in legacy["choices"]) and len(legacy["choices"]) == 2


def test_grammar_the_engine_cannot_compile_is_a_400_naming_the_field(live, monkeypatch):
    engine = live.state.engine
    original = engine.stream

    def stream(prompt_ids, params, *args, **kwargs):
        if params.constraint is not None:
            raise ValueError("the grammar does not parse")
        yield from original(prompt_ids, params, *args, **kwargs)

    monkeypatch.setattr(engine, "stream", stream)
    for stream_flag in (False, True):
        r = post(live, "/completion", {"prompt": "def", "grammar": 'root ::= "a"', "stream": stream_flag})
        assert r.status_code == 400 and "'grammar' cannot be used: the grammar does not parse" in r.text
        r = post(live, "/v1/chat/completions", {"messages": MESSAGES, "stream": stream_flag,
                                                "response_format": {"type": "json_object"}})
        assert r.status_code == 400 and "'response_format'" in r.json()["error"]["message"]
    assert post(live, "/v1/completions", {"prompt": "def", "max_tokens": 2}).status_code == 200


def test_a_grammar_that_does_not_compile_is_refused_before_the_job_is_queued(engine, monkeypatch):
    """The engine compiles each constraint while the request is parsed: its error is a 400 naming the field the
    constraint came from, before any generation."""
    refused(native, engine, "'grammar' cannot be used:", grammar="root ::= ")
    refused(native, engine, "'grammar' cannot be used:", grammar="root ::= nonesuch")
    refused(chat, engine, "'json_schema' cannot be used:", json_schema={"type": "nonesuch"})
    refused(chat, engine, "'response_format' cannot be used:",
            response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object", "required": 5}}})
    assert native(engine, grammar='root ::= "a"').params.constraint.kind == "gbnf"


def engine_logprobs(engine, ids, k) -> list | None:
    return engine.generate(ids, SamplingParams(max_tokens=6, logprobs=k, ignore_eos=True), draft=0).logprobs


def test_logprobs_end_to_end_equal_plain_decoding(live):
    """Each route's log-probabilities are those of plain decoding, whole and streamed."""
    engine = live.state.engine
    ids = engine.encode_prompt("def")
    expected = engine_logprobs(engine, ids, 2)
    assert len(expected) == 6
    body = {"prompt": "def", "max_tokens": 6, "ignore_eos": True, "logprobs": 2}
    lp = post(live, "/v1/completions", body).json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([e.logprob for e in expected], abs=1e-4)
    streamed = [json.loads(line[6:]) for line in post(live, "/v1/completions", {**body, "stream": True}).text
                .splitlines() if line.startswith("data: {")]
    values = [v for e in streamed for c in e["choices"] if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert values == pytest.approx(lp["token_logprobs"], abs=1e-4)
    chat_body = {"messages": MESSAGES, "max_tokens": 4, "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    content = post(live, "/v1/chat/completions", chat_body).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(c["top_logprobs"]) == 2 for c in content)
    native_body = {"prompt": "def", "n_predict": 6, "n_probs": 2, "ignore_eos": True}
    probs = post(live, "/completion", native_body).json()["completion_probabilities"]
    assert [p["id"] for p in probs] == [e.token for e in expected]


SMALL_SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}}, "required": ["a"],
                "additionalProperties": False}


def test_constraints_end_to_end_equal_plain_decoding(live):
    """A json_schema and a GBNF grammar give output that follows them, through DFlash (the live server drafts
    every step) as in plain decoding."""
    engine = live.state.engine
    ids = engine.encode_prompt(messages=MESSAGES)
    plain = engine.generate(ids, SamplingParams(max_tokens=20, constraint=Constraint(
        "json_schema", json.dumps(SMALL_SCHEMA))), draft=0).text
    assert json.loads(plain)["a"] in (1, 2, 3)
    body = {"messages": MESSAGES, "max_tokens": 20, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SMALL_SCHEMA}}}
    whole = post(live, "/v1/chat/completions", body).json()
    assert whole["choices"][0]["message"]["content"] == plain
    assert whole["speculative_decoding"]["num_draft_tokens"] > 0
    grammar = 'root ::= "yes" | "no"'
    r = post(live, "/completion", {"prompt": "def", "n_predict": 8, "grammar": grammar, "temperature": 0}).json()
    assert r["content"] in ("yes", "no") and r["generation_settings"]["grammar"] == grammar


def test_openai_client_parse_with_a_pydantic_model(live):
    """chat.completions.parse sends the model's strict json_schema; the reply parses into the model."""
    class Answer(BaseModel):
        a: Literal[1, 2, 3]

    client = openai.OpenAI(base_url=live.url + "/v1", api_key=AUTH["Authorization"][7:], max_retries=0, timeout=60)
    reply = client.chat.completions.parse(model="m", messages=MESSAGES, response_format=Answer, max_tokens=20,
                                          temperature=0)
    assert reply.choices[0].message.parsed.a in (1, 2, 3)


def test_new_fields_need_the_key_like_the_rest(live):
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": MESSAGES, "n": 2})
    assert r.status_code == 401 and post(live, "/v1/chat/completions", {"messages": MESSAGES, "n": 2},
                                         headers=AUTH).status_code == 200
