"""The OpenAPI 3.1 description of the HTTP API, served at GET /openapi.json.

Its schemas are generated from the pydantic models of the bodies: the request models make the
checks (deployments/openai_models.py), so the description cannot drift from them, and the
response models (deployments/openai_protocol.py) are tested against what the server sends. What
the replicas told the ingress narrows it: `model` may only be the served model's name, token ids
stay in the vocabulary, max_tokens within the context. Clients and API fuzzers (schemathesis,
through loadtest/faults/fuzz_http.py) read it for the exact types and ranges.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from deployments import openai_protocol as oai
from deployments.openai_models import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeChatRequest,
                                       TokenizeCompletionRequest)

_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest, ChatCompletionRequest, oai.Completion, oai.ChatCompletion, oai.CompletionChunk,
    oai.ChatCompletionChunk, oai.ModelList, oai.ErrorResponse, oai.Health, TokenizeCompletionRequest,
    TokenizeChatRequest, DetokenizeRequest, oai.TokenizeResponse, oai.DetokenizeResponse)
_ERRORS = {
    400: "A malformed body or a bad parameter (`param` names it).",
    401: "Missing or wrong API key (when the server has one).",
    404: "Unknown model (code model_not_found).",
    408: "The request body did not arrive in time.",
    413: "The request body is larger than 16 MiB.",
    429: "Overloaded: retry after Retry-After seconds.",
    500: "The model or the server failed on this request.",
    503: "No replica can serve it now: retry after Retry-After seconds.",
}
# Optional: the server asks for an API key only when it was given one.
_BEARER: list[dict[str, list[str]]] = [{"bearer": []}, {}]


def openapi_spec(served_model_name: str | None = None, vocab_size: int | None = None,
                 max_model_len: int | None = None) -> dict[str, Any]:
    """The description, narrowed to the served model when its name, vocabulary size and context
    length are known."""
    schemas = copy.deepcopy(_generated_schemas())
    _narrow(schemas, served_model_name, vocab_size, max_model_len)
    return {
        "openapi": "3.1.0",
        "info": {"title": "iterserve", "version": "0.1.0",
                 "description": "OpenAI-compatible completions and chat completions (README: HTTP API)."},
        "paths": {
            "/v1/completions": _generation("createCompletion", "Complete one or many prompts.",
                                           "CompletionRequest", "Completion", "CompletionChunk"),
            "/v1/chat/completions": _generation("createChatCompletion", "Answer a conversation.",
                                                "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk"),
            "/tokenize": _post("tokenize", "A prompt, or messages with the chat template, as token ids.",
                               {"oneOf": [{"$ref": _ref("TokenizeCompletionRequest")},
                                          {"$ref": _ref("TokenizeChatRequest")}]}, "TokenizeResponse"),
            "/detokenize": _post("detokenize", "Token ids as text.", {"$ref": _ref("DetokenizeRequest")},
                                 "DetokenizeResponse"),
            "/v1/models": _get("listModels", "The served model.", _json("ModelList"), _BEARER, 401, 500, 503),
            "/metrics": _get("metrics", "Prometheus metrics of every replica.",
                             {"text/plain": {"schema": {"type": "string"}}}, _BEARER, 401, 500, 503),
            "/health": {"get": {
                "operationId": "health", "summary": "Whether every replica has its model loaded (no API key).",
                "responses": {"200": {"description": "Ready.", "content": _json("Health")},
                              "503": {"description": "Not ready.", "content": _json("Health")}}}},
            "/openapi.json": _get("openapi", "This description (no API key).",
                                  {"application/json": {"schema": {"type": "object"}}}, []),
        },
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


@functools.cache
def _generated_schemas() -> dict[str, Any]:
    """The models' schemas, generated once: it takes 25 ms, and anyone may ask (no API key)."""
    _, generated = models_json_schema([(model, "validation") for model in _MODELS], ref_template=_ref("{model}"))
    return generated["$defs"]


def _narrow(schemas: dict[str, Any], served_model_name: str | None, vocab_size: int | None,
            max_model_len: int | None) -> None:
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        properties = schemas[request]["properties"]
        if served_model_name is not None:
            properties["model"] = {"enum": [served_model_name, None], "default": None,
                                   "description": "The served model's name, if given."}
        if max_model_len is not None:  # at least one prompt token
            for name in ("max_tokens", "max_completion_tokens"):
                for schema in _integers(properties.get(name, {})):
                    schema["maximum"] = max_model_len - 1
    # The parser takes any int; the service refuses one outside the vocabulary (invalid_token_id).
    for token_id in [*_integers(schemas["CompletionRequest"]["properties"]["prompt"]),
                     *_integers(schemas["DetokenizeRequest"]["properties"]["tokens"])]:
        token_id["minimum"] = 0
        if vocab_size is not None:
            token_id["maximum"] = vocab_size - 1


def _integers(schema: Any) -> Iterator[dict[str, Any]]:
    """Every integer schema inside `schema`."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            yield schema
        for value in schema.values():
            yield from _integers(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from _integers(value)


def _generation(operation_id: str, summary: str, request: str, response: str, chunk: str) -> dict[str, Any]:
    ok = {"description": f"The {response}; with stream: true an SSE stream instead.",
          "content": {**_json(response), "text/event-stream": {"schema": {
              "type": "string", "description": f"`data: <{chunk}>` events (an ErrorResponse if the generation fails "
                                               "after the 200), then `data: [DONE]`."}}}}
    return {"post": {"operationId": operation_id, "summary": summary, "security": _BEARER,
                     "requestBody": {"required": True, "content": _json(request)},
                     "responses": {"200": ok, **_errors(*_ERRORS)}}}


def _post(operation_id: str, summary: str, request: dict[str, Any], response: str) -> dict[str, Any]:
    return {"post": {"operationId": operation_id, "summary": summary, "security": _BEARER,
                     "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
                     "responses": {"200": {"description": "OK.", "content": _json(response)},
                                   **_errors(400, 401, 404, 408, 413, 500, 503)}}}


def _get(operation_id: str, summary: str, content: dict[str, Any], security: list[dict[str, list[str]]],
         *statuses: int) -> dict[str, Any]:
    return {"get": {"operationId": operation_id, "summary": summary, "security": security,
                    "responses": {"200": {"description": "OK.", "content": content}, **_errors(*statuses)}}}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(status): {"description": _ERRORS[status], "content": _json("ErrorResponse")} for status in statuses}


def _json(schema: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": _ref(schema)}}}


def _ref(schema: str) -> str:
    return f"#/components/schemas/{schema}"
