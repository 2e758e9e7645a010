"""The OpenAPI 3.1 description of the HTTP API, served at GET /openapi.json. Pure data.

Written by hand from what deployments/openai_protocol.py accepts, so that clients and API fuzzers
(schemathesis) know the exact types and ranges; loadtest/fuzz_http.py checks that the server
keeps to it (no 5xx, every error in the documented shape).
"""

from __future__ import annotations

from typing import Any

from contracts.sampling import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from deployments.openai_protocol import CHAT_ROLES, MAX_PROMPTS_PER_REQUEST

_STOP = {"oneOf": [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS},
                   {"type": "array", "maxItems": MAX_STOP_STRINGS,
                    "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS}},
                   {"type": "null"}]}
_SAMPLING: dict[str, Any] = {
    "model": {"type": ["string", "null"], "description": "Must be the served model's name if given."},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 100},
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": ["integer", "null"], "minimum": -1},
    "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**63 - 1},
    "stop": _STOP,
    "stop_token_ids": {"type": ["array", "null"], "maxItems": MAX_STOP_TOKEN_IDS,
                       "items": {"type": "integer", "minimum": 0}},
    "ignore_eos": {"type": ["boolean", "null"]},
    "n": {"type": ["integer", "null"], "enum": [1, None]},
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}},
    "priority": {"type": ["string", "null"], "enum": ["interactive", "batch", None]},
    "user": {"type": ["string", "null"]},
}
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_ERRORS = {str(status): {"description": text, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
           for status, text in ((400, "A malformed body or a bad parameter (`param` names it)."),
                                (401, "Missing or wrong API key."), (404, "Unknown model or path."),
                                (408, "The request body did not arrive in time."),
                                (413, "The request body is larger than 16 MiB."),
                                (429, "Overloaded: retry after Retry-After seconds."),
                                (500, "The model failed on this request (code generation_failed)."),
                                (503, "No replica can serve it now: retry after Retry-After seconds."))}
_GENERATION_OK = {"description": "The completion, or with stream: true an SSE stream of chunks ending with "
                                 "`data: [DONE]`.",
                  "content": {"application/json": {"schema": {"type": "object"}},
                              # Events are JSON objects, then the literal [DONE]: no one schema.
                              "text/event-stream": {"schema": {}}}}


def openapi_spec(served_model_name: str | None = None, vocab_size: int | None = None,
                 max_model_len: int | None = None) -> dict[str, Any]:
    """The description. What the replicas told the ingress narrows it: `model` may only be the
    served model's name, token ids stay in the vocabulary, max_tokens within the context."""
    sampling = dict(_SAMPLING)
    if served_model_name is not None:
        sampling["model"] = {"type": ["string", "null"], "enum": [served_model_name, None]}
    token_id: dict[str, Any] = {"type": "integer", "minimum": 0}
    if vocab_size is not None:
        token_id["maximum"] = vocab_size - 1
    if max_model_len is not None:
        sampling["max_tokens"] = {"type": ["integer", "null"], "minimum": 1, "maximum": max_model_len - 1}
    token_ids = {"type": "array", "items": token_id, "minItems": 1}
    completion = {"type": "object", "required": ["prompt"], "properties": {
        "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                             {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
                              "maxItems": MAX_PROMPTS_PER_REQUEST},
                             token_ids,
                             {"type": "array", "items": token_ids, "minItems": 1, "maxItems": MAX_PROMPTS_PER_REQUEST}]},
        **sampling}}
    text_parts = {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}}
    # Only an assistant turn may come without content (null or absent).
    message = {"oneOf": [
        {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"type": "string", "enum": [r for r in CHAT_ROLES if r != "assistant"]},
            "content": {"oneOf": [{"type": "string"}, text_parts]}, "name": {"type": "string"}}},
        {"type": "object", "required": ["role"], "properties": {
            "role": {"type": "string", "enum": ["assistant"]},
            "content": {"oneOf": [{"type": "string"}, {"type": "null"}, text_parts]}, "name": {"type": "string"}}}]}
    chat = {"type": "object", "required": ["messages"], "properties": {
        "messages": {"type": "array", "items": message, "minItems": 1},
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
        "add_generation_prompt": {"type": "boolean"},
        **sampling}}

    def generation(schema: str, summary: str) -> dict[str, Any]:
        return {"post": {"summary": summary, "security": [{"bearer": []}, {}],
                         "requestBody": {"required": True, "content": {"application/json": {
                             "schema": {"$ref": f"#/components/schemas/{schema}"}}}},
                         "responses": {"200": _GENERATION_OK, **_ERRORS}}}

    def simple(summary: str, content_type: str = "application/json") -> dict[str, Any]:
        return {"get": {"summary": summary, "responses": {
            "200": {"description": "OK", "content": {content_type: {"schema": {"type": ["object", "string"]}}}},
            **{k: v for k, v in _ERRORS.items() if k in ("401", "503")}}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "iterserve", "version": "0.1.0",
                 "description": "OpenAI-compatible completions and chat completions (README: HTTP API)."},
        "paths": {
            "/v1/completions": generation("CompletionRequest", "Complete one or many prompts."),
            "/v1/chat/completions": generation("ChatCompletionRequest", "Answer a conversation."),
            "/v1/models": simple("The served model."),
            "/health": simple("200 when every replica is ready, 503 otherwise (no API key)."),
            "/metrics": simple("Prometheus metrics of every replica.", "text/plain"),
        },
        "components": {"schemas": {"CompletionRequest": completion, "ChatCompletionRequest": chat, "Error": _ERROR},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
