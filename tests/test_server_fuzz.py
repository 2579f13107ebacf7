"""Fuzzing every route of /openapi.json: at least 1,000 generated requests against a live server on the tiny
checkpoints, and not one 5xx, connection error or non-JSON stream event.

Bodies come from the published request schemas: fields of their declared types and ranges, half the time one
of them set to a bad value (wrong type, huge or non-finite number, lone surrogate), and one body in six not a
JSON object at all (bytes, deep nesting, any JSON); headers with and without the API key; now and then a
method the route does not take. Derandomized, so a run is repeatable; generation is kept to a few tokens on a
64-token context, so the whole run takes seconds.
"""
from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_server_hardening import AUTH, LiveServer

from flashdraft.server.schemas import NOT_IMPLEMENTED

EXAMPLES = 1100
BUDGET_FIELDS = {"max_tokens", "max_completion_tokens", "n_predict"}  # kept small: generation is the slow part
STATIC_FILES = ["chat.js", "chat.css", "index.html", "nothing.js", "..%2fapp.py"]


@pytest.fixture(scope="module")
def fuzzed(qwen3_dir, drafter_dir):
    srv = LiveServer(qwen3_dir, drafter_dir, n_slots=2)
    yield srv
    srv.stop()


# Text with JSON's and the templates' special characters, non-ASCII and a NUL; bad text ends in a lone surrogate.
good_text = st.text(st.sampled_from(list("ab1 {}%\"\\\n\x00\u00e9\u4e2d\U0001f600")), min_size=1, max_size=8)
bad_text = st.tuples(good_text, st.sampled_from(["\ud800", "\udbff", "\udfff"])).map("".join)
huge = st.sampled_from([2**63, -(2**63) - 1, 10**30, 1e308, -1e308, 5e-324, float("inf"), float("nan")])
scalar = st.none() | st.booleans() | st.integers() | st.floats() | huge | good_text | bad_text
anything = scalar | st.lists(scalar, max_size=3) | st.dictionaries(good_text | bad_text, scalar, max_size=3)
# Values set on purpose, a third of them text and numbers that did harm (issue #17). Drawn through sampled_from:
# `|` flattens alternatives, so bad_text would be one of ten.
bad = st.sampled_from([bad_text, huge, anything]).flatmap(lambda strategy: strategy)


def from_schema(schema: dict, defs: dict, depth: int = 0) -> st.SearchStrategy:
    """Values of an OpenAPI (JSON) schema's type and range, roughly: enough to get past a field's checks."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].split("/")[-1]], defs, depth)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs, depth) for s in schema["anyOf"]])
    if "const" in schema or "enum" in schema:
        return st.sampled_from(schema.get("enum", [schema.get("const")]))
    kind = schema.get("type")
    if kind == "integer":
        low = schema.get("minimum", schema.get("exclusiveMinimum", -5))
        return st.integers(low, schema.get("maximum", low + 500))
    if kind == "number":
        return st.floats(schema.get("minimum", schema.get("exclusiveMinimum", 0.0)), schema.get("maximum", 3.0),
                         exclude_min="exclusiveMinimum" in schema)
    if kind == "string":
        return good_text
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        items = from_schema(schema.get("items", {}), defs, depth + 1)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 3), 3))
    if kind == "object" and "properties" in schema and depth < 4:
        return fields(schema, defs, depth + 1)
    return anything


def fields(schema: dict, defs: dict, depth: int = 0) -> st.SearchStrategy:
    """A valid-looking object (its required properties, mostly, and a few others, of their declared types and
    ranges), half the time with one property then set to a bad value: a bad value is mostly tried on an
    otherwise good request, so it gets past the other checks to wherever it could do harm."""
    valid = {name: st.integers(-2, 4) if name in BUDGET_FIELDS else from_schema(prop, defs, depth)
             for name, prop in schema["properties"].items()}
    names = sorted(valid)
    required = [name for name in schema.get("required", []) if name in valid]

    @st.composite
    def one(draw):
        body = {name: draw(valid[name]) for name in required if draw(st.integers(0, 9))}
        for name in draw(st.lists(st.sampled_from(names), max_size=3, unique=True)):
            body[name] = draw(valid[name])
        if draw(st.booleans()):
            body[draw(st.sampled_from(names))] = draw(bad)
        return body

    return one()


def raw_bodies() -> st.SearchStrategy:
    deep = st.integers(1, 3000).map(lambda n: b'{"prompt": ' + b"[" * n + b"]" * n + b"}")
    return st.binary(max_size=40) | deep | anything.map(lambda v: json.dumps(v).encode())


def requests(spec: dict) -> st.SearchStrategy:
    """(route, method, path, body, headers); each operation's body strategy is built once."""
    defs = spec["components"]["schemas"]
    operations = []
    for route, ops in spec["paths"].items():
        for method, op in ops.items():
            body = st.none()
            if "requestBody" in op:
                schema = defs[op["requestBody"]["content"]["application/json"]["schema"]["$ref"].split("/")[-1]]
                objects = fields(schema, defs).map(lambda v: json.dumps(v).encode())
                body = st.sampled_from([objects] * 5 + [raw_bodies()]).flatmap(lambda strategy: strategy)
            operations.append((route, method.upper(), body))
    headers = st.sampled_from([AUTH, AUTH, AUTH, AUTH, {}, {"Authorization": "Bearer wrong"},
                               {"X-Api-Key": AUTH["Authorization"][7:]}])
    other_method = st.sampled_from(["PUT", "DELETE", "PATCH", "GET", "POST"])  # maybe not allowed on the route

    @st.composite
    def one(draw):
        route, method, body = draw(st.sampled_from(operations))
        path = route.replace("{file}", draw(st.sampled_from(STATIC_FILES))) if "{file}" in route else route
        if draw(st.integers(0, 30)) == 0:
            method = draw(other_method)
        return route, method, path, draw(body), draw(headers)

    return one()


def check_stream(response: httpx.Response) -> None:
    """Every event JSON (never NaN or Infinity) or [DONE]."""
    def refuse(name):
        raise AssertionError(f"non-JSON number {name} in a stream")

    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            json.loads(line[6:], parse_constant=refuse)


def test_fuzz_every_route_without_a_5xx(fuzzed, caplog):
    spec = httpx.get(fuzzed.url + "/openapi.json", headers=AUTH).json()
    sent, statuses = Counter(), Counter()
    with httpx.Client(base_url=fuzzed.url, timeout=30) as client:
        @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(request=requests(spec))
        def one_request(request):
            route, method, path, body, headers = request
            response = client.request(method, path, content=body, headers={"Content-Type": "application/json",
                                                                          **headers})
            sent[route] += 1
            statuses[response.status_code] += 1
            if route in NOT_IMPLEMENTED and response.status_code == 501:
                assert "not supported" in response.json()["error"]["message"]
            else:
                assert response.status_code < 500, (method, path, body[:300] if body else None, response.text[:300])
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                check_stream(response)

        one_request()
    assert sum(sent.values()) >= 1000
    assert set(sent) == set(spec["paths"]), "a route was never tried"
    assert statuses[200] >= 100 and statuses[400] >= 100, statuses  # both sides of the checks were reached
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" or r.exc_info]
    assert not errors, errors[:5]
