"""The OpenAI protocol layer: what a client sends is parsed or refused with the right status,
param and code, and what it gets back has OpenAI's shape."""

import pytest

from contracts.priority import Priority
from contracts.sampling import SamplingParams, StructuredOutput
from deployments import openai_protocol as oai
from deployments.errors import APIError

SERVED = "tiny-llama"
USER = [{"role": "user", "content": "hi"}]
PARSERS = {"completion": (oai.parse_completion, {"prompt": "hi"}), "chat": (oai.parse_chat, {"messages": USER})}


def _refusal(parse, body) -> APIError:
    with pytest.raises(APIError) as info:
        parse(body, SERVED)
    return info.value


# ---- happy paths ----------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt, prompts", [
    ("hello", ["hello"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
    (["p"] * oai.MAX_PROMPTS_PER_REQUEST, ["p"] * oai.MAX_PROMPTS_PER_REQUEST),
])
def test_completion_prompt_forms(prompt, prompts):
    parsed = oai.parse_completion({"prompt": prompt}, SERVED)
    assert parsed.kind == "completion" and parsed.prompts == prompts
    assert parsed.max_tokens == 16  # the OpenAI completions default
    assert parsed.model == SERVED and parsed.request_id.startswith("cmpl-")
    assert (parsed.stream, parsed.include_usage, parsed.priority, parsed.user) == (
        False, False, Priority.INTERACTIVE, None)
    assert parsed.sampling == {}


def test_chat_messages_are_normalized_to_string_content():
    messages = [{"role": "system", "content": "be brief", "name": "sys"},
                {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
                {"role": "assistant", "content": None},
                {"role": "developer", "content": ""},
                {"role": "user", "content": []}]
    parsed = oai.parse_chat({"messages": messages}, SERVED)
    assert parsed.messages == [{"role": "system", "content": "be brief", "name": "sys"},
                               {"role": "user", "content": "one\ntwo"},
                               {"role": "assistant", "content": ""},
                               {"role": "developer", "content": ""},
                               {"role": "user", "content": ""}]
    assert parsed.kind == "chat" and parsed.request_id.startswith("chatcmpl-") and parsed.prompts == []
    assert parsed.max_tokens is None and parsed.add_generation_prompt is True


@pytest.mark.parametrize("fields, max_tokens", [
    ({}, None), ({"max_tokens": 7}, 7), ({"max_completion_tokens": 9}, 9),
    ({"max_tokens": 8, "max_completion_tokens": 8}, 8), ({"max_tokens": None, "max_completion_tokens": 5}, 5),
])
def test_chat_max_tokens_and_its_alias(fields, max_tokens):
    assert oai.parse_chat({"messages": USER, **fields}, SERVED).max_tokens == max_tokens


def test_completion_max_tokens_and_add_generation_prompt():
    assert oai.parse_completion({"prompt": "x", "max_tokens": 3}, SERVED).max_tokens == 3
    assert oai.parse_completion({"prompt": "x", "max_tokens": None}, SERVED).max_tokens == 16
    assert oai.parse_chat({"messages": USER, "add_generation_prompt": False}, SERVED).add_generation_prompt is False


@pytest.mark.parametrize("kind", PARSERS)
@pytest.mark.parametrize("fields, attr, value", [
    ({"model": SERVED}, "model", SERVED),
    ({"model": None}, "model", SERVED),
    ({"priority": "batch"}, "priority", Priority.BATCH),
    ({"priority": "BATCH"}, "priority", Priority.BATCH),
    ({"priority": 1}, "priority", Priority.BATCH),
    ({"priority": "interactive"}, "priority", Priority.INTERACTIVE),
    ({"user": "alice"}, "user", "alice"),
    ({"stream": True}, "stream", True),
    ({"stream": None}, "stream", False),
    ({"stream": True, "stream_options": {"include_usage": True}}, "include_usage", True),
    ({"stream": True, "stream_options": {}}, "include_usage", False),
    ({"stream": False, "stream_options": None}, "include_usage", False),
    ({"stop": "END"}, "sampling", {"stop": ["END"]}),
    ({"stop": ["a", "b"]}, "sampling", {"stop": ["a", "b"]}),
    ({"n": 1, "surprise_field": {"x": 1}}, "sampling", {}),
    ({"temperature": None, "top_p": None, "seed": None, "stop": None}, "sampling", {}),
    ({"temperature": 0.5, "top_p": 0.9, "top_k": 40, "seed": 7, "ignore_eos": True, "stop_token_ids": [2, 3]},
     "sampling", {"temperature": 0.5, "top_p": 0.9, "top_k": 40, "seed": 7, "ignore_eos": True,
                  "stop_token_ids": [2, 3]}),
])
def test_common_fields(kind, fields, attr, value):
    parse, base = PARSERS[kind]
    assert getattr(parse({**base, **fields}, SERVED), attr) == value


def test_sampling_params_are_built_with_the_given_max_tokens():
    parsed = oai.parse_chat({"messages": USER, "temperature": 0, "top_p": 0.5, "top_k": -1, "seed": 3,
                             "stop": "\n", "stop_token_ids": [9], "ignore_eos": True}, SERVED)
    params = parsed.sampling_params(100)
    assert params == SamplingParams(max_tokens=100, temperature=0, top_p=0.5, top_k=0, seed=3, stop=["\n"],
                                    stop_token_ids=[9], ignore_eos=True)
    assert params.greedy
    assert oai.parse_completion({"prompt": "x"}, SERVED).sampling_params(5) == SamplingParams(max_tokens=5)
    with pytest.raises(APIError) as info:
        parsed.sampling_params(0)
    assert (info.value.status, info.value.param) == (400, "max_tokens")


# ---- refusals -------------------------------------------------------------------------------------

UNSUPPORTED = [("best_of", 2), ("suffix", "x"),
               ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
               ("functions", [{"name": "f"}]), ("tool_choice", "auto")]
DEFAULTS = [("logprobs", None), ("echo", False), ("best_of", 1), ("suffix", ""), ("logit_bias", {}), ("logit_bias", None),
            ("presence_penalty", 0), ("presence_penalty", 0.0), ("frequency_penalty", 0), ("repetition_penalty", 1),
            ("min_tokens", 0), ("tools", []), ("functions", []), ("tool_choice", "none"), ("tool_choice", None),
            ("response_format", {"type": "text"}), ("response_format", None), ("logprobs", False)]
CHAT_DEFAULTS = [("top_logprobs", 0), ("top_logprobs", None)]
# Sampling fields both endpoints take: (fields, what SamplingParams gets).
SAMPLING_FIELDS = [
    ({"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.1},
     {"presence_penalty": 0.5, "frequency_penalty": -1.0, "repetition_penalty": 1.1}),
    ({"logit_bias": {"1": 5, "17": -100.0}}, {"logit_bias": {1: 5.0, 17: -100.0}}),
    ({"min_tokens": 2.0}, {"min_tokens": 2}),
]
BAD_SAMPLING = [  # refused by both endpoints
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": 3}, "repetition_penalty"),
    ({"logit_bias": []}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"), ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"1": "5"}}, "logit_bias"), ({"logit_bias": {"1": True}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 1.5}, "min_tokens"), ({"min_tokens": True}, "min_tokens"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, "response_format.json_schema.schema"),
    ({"guided_json": "{bad"}, "guided_json"), ({"guided_json": 5}, "guided_json"), ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"), ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
]
STRUCTURED = [  # (fields, the StructuredOutput both endpoints build)
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object", param="response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"},
                                                                 "strict": True}}},
     StructuredOutput("json", '{"type": "object"}', "response_format.json_schema.schema")),
    ({"guided_json": '{"type": "integer"}'}, StructuredOutput("json", '{"type": "integer"}', "guided_json")),
    ({"guided_regex": "[a-z]+"}, StructuredOutput("regex", "[a-z]+", "guided_regex")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutput("choice", '["yes", "no"]', "guided_choice")),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutput("grammar", 'root ::= "a"', "guided_grammar")),
    ({"structured_outputs": {"choice": ["x"]}}, StructuredOutput("choice", '["x"]', "structured_outputs.choice")),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object", param="structured_outputs.json_object")),
]

COMMON_ERRORS = [  # (fields, status, param, code), refused by both endpoints
    ({"model": "gpt-4"}, 404, "model", "model_not_found"),
    ({"model": ""}, 404, "model", "model_not_found"),
    ({"model": 5}, 400, "model", None),
    ({"n": 33}, 400, "n", None), ({"n": "1"}, 400, "n", None), ({"n": True}, 400, "n", None),
    ({"n": 0}, 400, "n", None), ({"n": 1.5}, 400, "n", None),
    ({"stream": "yes"}, 400, "stream", None), ({"stream": 1}, 400, "stream", None),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ({"stream": False, "stream_options": {}}, 400, "stream_options", None),
    ({"stream": True, "stream_options": []}, 400, "stream_options", None),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, 400, "stream_options", None),
    ({"temperature": "hot"}, 400, "temperature", None), ({"temperature": -1}, 400, "temperature", None),
    ({"temperature": float("nan")}, 400, "temperature", None),
    ({"temperature": float("inf")}, 400, "temperature", None), ({"temperature": 101}, 400, "temperature", None),
    ({"top_p": 0}, 400, "top_p", None), ({"top_p": 1.5}, 400, "top_p", None),
    ({"top_k": -2}, 400, "top_k", None), ({"top_k": 1.5}, 400, "top_k", None),
    ({"seed": -1}, 400, "seed", None), ({"seed": 2**63}, 400, "seed", None), ({"seed": "7"}, 400, "seed", None),
    ({"stop": [""]}, 400, "stop", None), ({"stop": ""}, 400, "stop", None), ({"stop": 5}, 400, "stop", None),
    ({"stop": ["a", 5]}, 400, "stop", None),
    ({"stop_token_ids": [-1]}, 400, "stop_token_ids", None), ({"stop_token_ids": 2}, 400, "stop_token_ids", None),
    ({"ignore_eos": "yes"}, 400, "ignore_eos", None),
    ({"max_tokens": 0}, 400, "max_tokens", None), ({"max_tokens": 1.5}, 400, "max_tokens", None),
    ({"max_tokens": True}, 400, "max_tokens", None), ({"max_tokens": "10"}, 400, "max_tokens", None),
    ({"max_tokens": -5}, 400, "max_tokens", None),
    ({"user": 5}, 400, "user", None),
    ({"priority": "urgent"}, 400, "priority", None), ({"priority": 2}, 400, "priority", None),
    ({"priority": True}, 400, "priority", None),
    *[({name: value}, 400, name, None) for name, value in UNSUPPORTED],
    *[(fields, 400, name, None) for fields, name in BAD_SAMPLING],
]

COMPLETION_ERRORS = [  # (body, param, code)
    ({}, "prompt", None), ({"prompt": None}, "prompt", None), ({"prompt": 5}, "prompt", None),
    ({"prompt": []}, "prompt", None), ({"prompt": [[]]}, "prompt", None), ({"prompt": [[1], []]}, "prompt", None),
    ({"prompt": ""}, "prompt", "empty_prompt"), ({"prompt": ["a", ""]}, "prompt", "empty_prompt"),
    ({"prompt": ["a", [1]]}, "prompt", None), ({"prompt": [1, "a"]}, "prompt", None),
    ({"prompt": [1, True]}, "prompt", None), ({"prompt": [[1], [False]]}, "prompt", None),
    ({"prompt": [1, 2.5]}, "prompt", None),
    ({"prompt": "x", "logprobs": True}, "logprobs", None), ({"prompt": "x", "logprobs": 21}, "logprobs", None),
    ({"prompt": "x", "logprobs": -1}, "logprobs", None), ({"prompt": "x", "logprobs": "2"}, "logprobs", None),
    ({"prompt": "x", "echo": "yes"}, "echo", None), ({"prompt": "x", "echo": 1}, "echo", None),
    ({"prompt": ["a"] * (oai.MAX_PROMPTS_PER_REQUEST + 1)}, "prompt", None),
    ({"prompt": [[1]] * (oai.MAX_PROMPTS_PER_REQUEST + 1)}, "prompt", None),
]

CHAT_ERRORS = [  # (body, param, code)
    ({}, "messages", None), ({"messages": None}, "messages", None), ({"messages": []}, "messages", None),
    ({"messages": "hi"}, "messages", None), ({"messages": {"role": "user", "content": "hi"}}, "messages", None),
    ({"messages": ["hi"]}, "messages[0]", None),
    ({"messages": [*USER, None]}, "messages[1]", None),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", None),
    ({"messages": [{"content": "x"}]}, "messages[0].role", None),
    ({"messages": [*USER, {"role": "user", "content": 5}]}, "messages[1].content", None),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", None),
    ({"messages": [{"role": "user"}]}, "messages[0].content", None),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}]}, "messages[0].content", None),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content", None),
    ({"messages": [{"role": "user", "content": ["plain"]}]}, "messages[0].content", None),
    ({"messages": USER, "add_generation_prompt": "yes"}, "add_generation_prompt", None),
    ({"messages": USER, "add_generation_prompt": None}, "add_generation_prompt", None),
    ({"messages": USER, "max_tokens": 8, "max_completion_tokens": 9}, "max_completion_tokens", None),
    ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens", None),
    ({"messages": USER, "max_completion_tokens": "9"}, "max_completion_tokens", None),
    ({"messages": USER, "echo": True}, "echo", None),
    ({"messages": USER, "logprobs": 5}, "logprobs", None), ({"messages": USER, "logprobs": "true"}, "logprobs", None),
    ({"messages": USER, "top_logprobs": 3}, "top_logprobs", None),
    ({"messages": USER, "logprobs": False, "top_logprobs": 3}, "top_logprobs", None),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    ({"messages": USER, "logprobs": True, "top_logprobs": -1}, "top_logprobs", None),
]


@pytest.mark.parametrize("kind", PARSERS)
@pytest.mark.parametrize("body", [[], ["prompt"], "prompt", None, 5])
def test_body_that_is_not_an_object_is_refused(kind, body):
    error = _refusal(PARSERS[kind][0], body)
    assert (error.status, error.param, error.code) == (400, None, None)


@pytest.mark.parametrize("kind", PARSERS)
@pytest.mark.parametrize("fields, status, param, code", COMMON_ERRORS)
def test_common_field_refusals(kind, fields, status, param, code):
    parse, base = PARSERS[kind]
    error = _refusal(parse, {**base, **fields})
    assert (error.status, error.param, error.code, error.type) == (status, param, code, "invalid_request_error")
    assert param in error.message


@pytest.mark.parametrize("body, param, code", COMPLETION_ERRORS)
def test_completion_refusals(body, param, code):
    error = _refusal(oai.parse_completion, body)
    assert (error.status, error.param, error.code) == (400, param, code)


@pytest.mark.parametrize("body, param, code", CHAT_ERRORS)
def test_chat_refusals(body, param, code):
    error = _refusal(oai.parse_chat, body)
    assert (error.status, error.param, error.code) == (400, param, code)


@pytest.mark.parametrize("kind", PARSERS)
def test_parameters_at_their_defaults_change_nothing(kind):
    parse, base = PARSERS[kind]
    defaults = DEFAULTS + (CHAT_DEFAULTS if kind == "chat" else [])
    for name, value in defaults:
        assert parse({**base, name: value}, SERVED).sampling_params(16) == SamplingParams(max_tokens=16), name
    parse({**base, **dict(defaults)}, SERVED)  # all at once, as some clients send them


@pytest.mark.parametrize("kind", PARSERS)
@pytest.mark.parametrize("fields, expected", SAMPLING_FIELDS)
def test_penalties_bias_and_min_tokens_reach_the_sampling_params(kind, fields, expected):
    parse, base = PARSERS[kind]
    assert parse({**base, **fields}, SERVED).sampling_params(16) == SamplingParams(max_tokens=16, **expected)


@pytest.mark.parametrize("kind", PARSERS)
@pytest.mark.parametrize("fields, expected", STRUCTURED)
def test_structured_output_fields_name_one_grammar(kind, fields, expected):
    parse, base = PARSERS[kind]
    assert parse({**base, **fields}, SERVED).sampling_params(16).structured == expected


def test_min_tokens_above_max_tokens_is_refused():
    parsed = oai.parse_completion({"prompt": "x", "min_tokens": 5, "max_tokens": 3}, SERVED)
    with pytest.raises(APIError) as info:
        parsed.sampling_params(3)
    assert (info.value.status, info.value.param) == (400, "min_tokens")


@pytest.mark.parametrize("kind, fields, logprobs", [
    ("completion", {"logprobs": 0}, 0), ("completion", {"logprobs": 5}, 5), ("completion", {"logprobs": 20}, 20),
    ("completion", {"logprobs": False}, None), ("completion", {"top_logprobs": 3}, None),  # not a completions field
    ("chat", {"logprobs": True}, 0), ("chat", {"logprobs": True, "top_logprobs": 4}, 4),
    ("chat", {"logprobs": False}, None), ("chat", {"logprobs": False, "top_logprobs": 0}, None)])
def test_logprobs_as_each_endpoint_asks_for_them(kind, fields, logprobs):
    parse, base = PARSERS[kind]
    parsed = parse({**base, **fields}, SERVED)
    assert parsed.logprobs == logprobs and parsed.sampling_params(16).logprobs == logprobs
    assert parsed.sampling_params(16).prompt_logprobs is None and not parsed.echo


@pytest.mark.parametrize("fields, echo, prompt_logprobs", [
    ({"echo": True}, True, None), ({"echo": True, "logprobs": 1}, True, 1), ({"echo": False, "logprobs": 3}, False, None),
    ({"echo": None}, False, None)])
def test_echo_asks_for_the_prompt_logprobs_only_with_logprobs(fields, echo, prompt_logprobs):
    parsed = oai.parse_completion({"prompt": "x", **fields}, SERVED)
    assert parsed.echo is echo and parsed.sampling_params(16).prompt_logprobs == prompt_logprobs


def test_api_error_has_openai_shape():
    error = _refusal(oai.parse_completion, {"prompt": "hi", "model": "gpt-4"})
    assert error.to_dict() == {"error": {
        "message": "the model 'gpt-4' does not exist; this server serves 'tiny-llama'",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
    error = _refusal(oai.parse_completion, {"prompt": ""})
    assert error.to_dict() == {"error": {"message": "prompt must not be empty", "type": "invalid_request_error",
                                         "param": "prompt", "code": "empty_prompt"}}
    assert str(error) == "prompt must not be empty"


# ---- responses ------------------------------------------------------------------------------------


def _parsed(kind, include_usage=False):
    parse, base = PARSERS[kind]
    body = {**base, "stream": True, "stream_options": {"include_usage": include_usage}}
    return parse(body, SERVED)


def test_usage_totals_and_cached_tokens():
    assert oai.usage(12, 5, 8) == {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17,
                                   "prompt_tokens_details": {"cached_tokens": 8}}


def test_completion_response_shapes():
    for kind, obj, item in [
        ("completion", "text_completion",
         {"index": 1, "text": "hey", "logprobs": None, "finish_reason": "stop", "stop_reason": "\n"}),
        ("chat", "chat.completion", {"index": 1, "message": {"role": "assistant", "content": "hey"},
                                     "logprobs": None, "finish_reason": "stop", "stop_reason": "\n"}),
    ]:
        parsed = oai.parse_completion({"prompt": "x"}, SERVED) if kind == "completion" else _parsed("chat")
        choice = oai.choice(parsed, 1, "hey", "stop", "\n")
        assert choice == item
        usage = oai.usage(3, 1, 0)
        assert oai.completion_response(parsed, [choice], usage) == {
            "id": parsed.request_id, "object": obj, "created": parsed.created, "model": SERVED,
            "choices": [item], "usage": usage}
    length = oai.choice(_parsed("completion"), 0, "ab", "length", None)
    assert (length["finish_reason"], length["stop_reason"]) == ("length", None)


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_chunks(include_usage):
    parsed = _parsed("chat", include_usage)
    envelope = {"id": parsed.request_id, "object": "chat.completion.chunk", "created": parsed.created,
                "model": SERVED, **({"usage": None} if include_usage else {})}
    assert oai.stream_chunk(parsed, 0, "", role=True) == {**envelope, "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
    assert oai.stream_chunk(parsed, 2, "Hel") == {**envelope, "choices": [
        {"index": 2, "delta": {"content": "Hel"}, "logprobs": None, "finish_reason": None}]}
    assert oai.stream_chunk(parsed, 0, "", "stop", 2) == {**envelope, "choices": [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop", "stop_reason": 2}]}
    assert oai.stream_chunk(parsed, 0, "lo", "length") == {**envelope, "choices": [
        {"index": 0, "delta": {"content": "lo"}, "logprobs": None, "finish_reason": "length", "stop_reason": None}]}
    usage = oai.usage(4, 2, 0)
    assert oai.usage_chunk(parsed, usage) == {**envelope, "choices": [], "usage": usage}


@pytest.mark.parametrize("include_usage", [False, True])
def test_completion_stream_chunks(include_usage):
    parsed = _parsed("completion", include_usage)
    envelope = {"id": parsed.request_id, "object": "text_completion", "created": parsed.created, "model": SERVED,
                **({"usage": None} if include_usage else {})}
    assert oai.stream_chunk(parsed, 1, "ab") == {**envelope, "choices": [
        {"index": 1, "text": "ab", "logprobs": None, "finish_reason": None}]}
    assert oai.stream_chunk(parsed, 1, "", "stop", "END") == {**envelope, "choices": [
        {"index": 1, "text": "", "logprobs": None, "finish_reason": "stop", "stop_reason": "END"}]}
    usage = oai.usage(4, 2, 1)
    assert oai.usage_chunk(parsed, usage) == {**envelope, "choices": [], "usage": usage}


def test_integral_floats_count_as_integers():
    """JSON has one number type: JSON Schema, OpenAI and vLLM (pydantic) take 16.0 for 16."""
    parsed = oai.parse_completion({"prompt": [5.0, 6], "max_tokens": 3.0, "n": 1.0, "top_k": 4.0, "seed": 7.0,
                                   "stop_token_ids": [9.0]}, "m")
    assert parsed.prompts == [[5, 6]] and parsed.max_tokens == 3
    assert all(type(t) is int for t in parsed.prompts[0])
    params = parsed.sampling_params(3)
    assert (params.top_k, params.seed, params.stop_token_ids) == (4, 7, [9])
    with pytest.raises(APIError):
        oai.parse_completion({"prompt": "x", "max_tokens": 1e300}, "m")
