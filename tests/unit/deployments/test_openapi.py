"""GET /openapi.json: a valid OpenAPI 3.1 document of every route, generated from the models that
check the requests, so that a body it accepts the server accepts, and every answer has the shape
it documents."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import jsonschema
import pytest
from openapi_spec_validator import validate as validate_openapi

from contracts.sampling import SamplingParams, SamplingParamsError
from deployments import openai_protocol as oai
from deployments.errors import APIError
from deployments.frontend import OpenAIFrontend
from deployments.llm_server import LLMServer
from deployments.local_backend import LocalBackend
from deployments.openapi import openapi_spec
from loadtest.faults.fuzz_http import cases
from model_worker import AsyncLLMEngine, EngineConfig, LLMEngine
from tests.unit.fakes import ChatByteTokenizer, FakeKVRunner

VOCAB = 259
MAX_MODEL_LEN = 512
MODEL = "m"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def frontend():
    tokenizer = ChatByteTokenizer()
    runner = FakeKVRunner(256, 4, MAX_MODEL_LEN, VOCAB)
    engine = LLMEngine(EngineConfig(block_size=4), model_runner=runner, tokenizer=tokenizer)
    server = LLMServer(engine=AsyncLLMEngine(engine=engine), served_model_name=MODEL)
    yield OpenAIFrontend(LocalBackend(server), lambda: tokenizer)
    server.shutdown()


def run(coro):
    return asyncio.run(coro)


def client_of(frontend: OpenAIFrontend) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=frontend.asgi_app()), base_url="http://t")


def validator(spec: dict[str, Any], schema: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{schema}",
                                            "components": spec["components"]})


NARROWED = openapi_spec(MODEL, VOCAB, MAX_MODEL_LEN)
REQUESTS = {"completion": (validator(NARROWED, "CompletionRequest"), oai.parse_completion),
            "chat": (validator(NARROWED, "ChatCompletionRequest"), oai.parse_chat)}


def test_the_served_document_is_openapi_and_describes_every_route(frontend):
    async def main():
        async with client_of(frontend) as client:
            before = (await client.get("/openapi.json")).json()  # no replica has described the model yet
            assert (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})).status_code == 200
            after = (await client.get("/openapi.json")).json()
        return before, after

    before, after = run(main())
    routes = {(route.path, method.lower()) for route in frontend.asgi_app().app.routes
              for method in route.methods if method != "HEAD"}
    for spec in (before, after):
        validate_openapi(spec)
        assert spec["openapi"].startswith("3.1")
        assert {(path, method) for path, item in spec["paths"].items() for method in item} == routes
    assert before["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["anyOf"][0] == {"type": "string"}
    assert after == NARROWED


def test_the_document_is_narrowed_to_the_served_model():
    completion = NARROWED["components"]["schemas"]["CompletionRequest"]["properties"]
    assert completion["model"]["enum"] == [MODEL, None]
    token_ids = completion["prompt"]["anyOf"][2]["items"]
    assert (token_ids["minimum"], token_ids["maximum"]) == (0, VOCAB - 1)
    chat = NARROWED["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["max_completion_tokens"]["anyOf"][0]["maximum"] == MAX_MODEL_LEN - 1


def _parser_verdict(kind: str, body: Any) -> str | None:
    """None if the parser accepts the body, else the refused parameter."""
    try:
        REQUESTS[kind][1](body, MODEL)
    except APIError as exc:
        return exc.param or "body"
    return None


@pytest.mark.parametrize("kind, body", [
    ("completion", {"prompt": "hi"}),
    ("completion", {"prompt": [[1, 2], [3.0]], "max_tokens": 16.0, "n": 1, "model": MODEL, "priority": "batch"}),
    ("completion", {"prompt": ["a", "b"], "stop": ["\n", "END"], "stop_token_ids": [2], "seed": 2**63 - 1,
                    "temperature": 0, "top_p": 1, "top_k": -1, "ignore_eos": True, "user": "u", "logprobs": None,
                    "presence_penalty": 0, "response_format": {"type": "text"}, "surprise": {"x": 1}}),
    ("completion", {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}),
    ("chat", {"messages": [{"role": "system", "content": "be brief", "name": "s"},
                           {"role": "user", "content": [{"type": "text", "text": "one"}]},
                           {"role": "assistant", "content": None}, {"role": "assistant"}],
              "max_tokens": 8, "max_completion_tokens": 8, "add_generation_prompt": False}),
])
def test_a_body_the_schema_accepts_the_parser_accepts(kind, body):
    assert REQUESTS[kind][0].is_valid(body)
    assert _parser_verdict(kind, body) is None


@pytest.mark.parametrize("kind, body, param", [
    ("completion", {}, "prompt"),
    ("completion", {"prompt": ""}, "prompt"),
    ("completion", {"prompt": ["a"] * 257}, "prompt"),
    ("completion", {"prompt": [1, True]}, "prompt"),
    ("completion", {"prompt": "x", "model": "gpt-4"}, "model"),
    ("completion", {"prompt": "x", "n": 33}, "n"),
    ("completion", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completion", {"prompt": "x", "temperature": 100.5}, "temperature"),
    ("completion", {"prompt": "x", "top_p": 0}, "top_p"),
    ("completion", {"prompt": "x", "seed": 2**63}, "seed"),
    ("completion", {"prompt": "x", "stop": ["s"] * 33}, "stop"),
    ("completion", {"prompt": "x", "stop": "z" * 257}, "stop"),
    ("completion", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("completion", {"prompt": "x", "stream": False, "stream_options": {}}, "stream_options"),
    ("completion", {"prompt": "x", "priority": "urgent"}, "priority"),
    ("completion", {"prompt": "x", "echo": "yes"}, "echo"),
    ("completion", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("completion", {"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias"),
    ("chat", {"messages": USER, "echo": True}, "echo"),
    ("chat", {"messages": USER, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {}, "messages"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"content": "x"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ("chat", {"messages": USER, "add_generation_prompt": None}, "add_generation_prompt"),
])
def test_a_body_the_schema_refuses_the_parser_refuses_for_the_same_field(kind, body, param):
    blamed = [_blamed(error) for error in REQUESTS[kind][0].iter_errors(body)]
    assert blamed
    assert _parser_verdict(kind, body) == param
    assert any(param.startswith(field) for field in blamed), (blamed, param)


def _blamed(error: jsonschema.ValidationError) -> str:
    """The field a schema error is about, spelled as the parser's `param`: messages[0].role."""
    path = list(error.absolute_path)
    if error.validator == "required":
        path += [name for name in error.validator_value if name not in error.instance][:1]
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" if i else p for i, p in enumerate(path))


ODD_VALUES = [True, False, 0, -1, -2, 1, 0.5, 1.5, 4.0, 100, 100.5, 1e-300, float("nan"), float("inf"), -0.0,
              2**63 - 1, 2**63, 2.0**63, 2**70, 1e300, "x", "", {}, [], [""], ["a"], ["a", 5], ["s"] * 32, ["s"] * 33,
              "z" * 256, "z" * 257, [0], [-1], [1.0], [True], list(range(256)), list(range(257))]


def _as_parsed(name: str, value: Any) -> Any:
    """The value as the parser reads it: JSON's integral floats (4.0) are ints where ints are due."""
    def json_int(v: Any) -> Any:
        return int(v) if isinstance(v, float) and v.is_integer() and abs(v) <= 2.0**64 else v
    if name in ("top_k", "seed"):
        return json_int(value)
    if name == "stop_token_ids" and isinstance(value, list):
        return [json_int(v) for v in value]
    return value


@pytest.mark.parametrize("name", ["temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos"])
def test_sampling_bounds_are_sampling_params_bounds(name):
    """The models' (and so the document's) bounds on a sampling value are SamplingParams', and a
    refusal is in its words."""
    for value in ODD_VALUES:
        try:
            SamplingParams(max_tokens=1, **{name: _as_parsed(name, value)})
            expected = None
        except SamplingParamsError as exc:
            expected = str(exc)
        try:
            oai.parse_completion({"prompt": "x", name: value}, MODEL)
            refused = None
        except APIError as exc:
            refused = exc.message
            assert exc.param == name
        assert refused == expected, value


def _known_gap(kind: str, body: Any) -> bool:
    """What JSON Schema cannot say: that text holds no lone surrogate (it assumes Unicode), that
    max_tokens and max_completion_tokens agree, and that an integral float beyond 2**64 (1e308)
    is not an integer here."""
    text = json.dumps(body, ensure_ascii=False)
    if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
        return True
    if kind == "chat" and None not in (body.get("max_tokens"), body.get("max_completion_tokens")):
        return True
    return any(isinstance(v, float) and v.is_integer() and abs(v) > 2.0**64 for v in _leaves(body))


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _leaves(item)]
    if isinstance(value, list):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


def test_fuzzed_bodies_the_schema_accepts_the_parser_accepts():
    """The fuzzer's own cases (loadtest/faults/fuzz_http.py), valid and mutated: schemathesis trusts the
    document, so a body it calls valid must not be refused."""
    accepted = 0
    for case in cases(seed=0, count=3000):
        if case.method != "POST" or case.path not in ("/v1/completions", "/v1/chat/completions"):
            continue
        try:
            body = json.loads(case.body)
        except (TypeError, ValueError, RecursionError):
            continue
        kind = "chat" if case.path == "/v1/chat/completions" else "completion"
        if REQUESTS[kind][0].is_valid(body) and not _known_gap(kind, body):
            assert _parser_verdict(kind, body) is None, body
            accepted += 1
    assert accepted > 200


def test_every_answer_has_its_documented_shape(frontend):
    """Each response body, stream event and error validates against the document's schema."""
    async def main():
        async with client_of(frontend) as client:
            spec = (await client.get("/openapi.json")).json()
            answers = []
            for path, body, schema in [("/v1/completions", {"prompt": ["ab", "c"], "max_tokens": 3}, "Completion"),
                                       ("/v1/chat/completions", {"messages": USER, "max_tokens": 3}, "ChatCompletion")]:
                answers.append(((await client.post(path, json=body)).json(), schema))
                streamed = await client.post(path, json={**body, "stream": True,
                                                         "stream_options": {"include_usage": True}})
                events = [line[len("data: "):] for line in streamed.text.split("\n\n") if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                answers += [(json.loads(event), schema + "Chunk") for event in events[:-1]]
            answers.append(((await client.get("/v1/models")).json(), "ModelList"))
            answers.append(((await client.get("/health")).json(), "Health"))
            answers.append(((await client.post("/v1/completions", json={"prompt": ""})).json(), "ErrorResponse"))
        return spec, answers

    spec, answers = run(main())
    assert len(answers) > 8
    for answer, schema in answers:
        validator(spec, schema).validate(answer)
