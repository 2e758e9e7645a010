"""The OpenAI completions and chat-completions request bodies as pydantic models, with every check
the API makes. GET /openapi.json is generated from them (deployments/openapi.py).

A refused field answers in the API's own words: each field carries its refusal (what the client
is told, given the field's path, such as "messages[2].content") into pydantic's error, and
`validate` raises the first one as an APIError. Fields are declared in the order the API checks
them, and pydantic reports errors in field order, so a body with several bad fields is refused
for the first of them in declaration order (a lone surrogate in `stop` comes after a bad
temperature, top_p, top_k or seed).

The checks: JSON has one number type, so an integral float (16.0) is the int it is, as JSON
Schema, OpenAI and vLLM (pydantic) take it; a bool is never a number. Parameters we do not
implement are accepted at their defaults (clients that always send `logprobs: null` or
`presence_penalty: 0` work) and refused otherwise. Unknown fields are ignored, as OpenAI and vLLM
do. Sampling values are refused with SamplingParams' own messages: it is the engine's contract.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, GetCoreSchemaHandler,
                      GetJsonSchemaHandler, PlainValidator, StringConstraints, ValidationError, ValidationInfo,
                      ValidatorFunctionWrapHandler, WithJsonSchema, WrapValidator, field_validator, model_validator,
                      with_config)
from pydantic_core import CoreSchema, PydanticCustomError, core_schema
from typing_extensions import NotRequired, TypedDict

from contracts.priority import PRIORITIES, Priority
from contracts.sampling import (MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
                                MAX_STOP_TOKEN_IDS, SamplingParams, SamplingParamsError, StructuredOutput)
from deployments.errors import APIError, invalid

# A completions request may batch prompts; more than this in one body is refused.
MAX_PROMPTS_PER_REQUEST = 256
# Choices per prompt (`n`); and prompts times choices may not pass MAX_PROMPTS_PER_REQUEST either.
MAX_CHOICES = 32
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
CHAT_ROLES: tuple[str, ...] = get_args(ChatRole)
# JSON may carry "\ud800" escapes, which decode to lone surrogates: not Unicode text, and no
# tokenizer can encode them (they failed with a 500).
_SURROGATE = re.compile("[\ud800-\udfff]")
_MESSAGES_REFUSAL = "messages must be a non-empty list of {role, content} objects"
# A missing required field is refused with "<name> is required", but for these.
_WHEN_MISSING = {"messages": _MESSAGES_REFUSAL}

# What the client is told about a refused field, given the field's path ("messages[2].content").
Refusal = Callable[[str], APIError]
Request = TypeVar("Request", bound=BaseModel)


def validate(model: type[Request], body: Any, served_model: str | None) -> Request:
    """The body as `model`, or the APIError for its first bad field. `model` is checked against
    `served_model` when that is given."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    try:
        return model.model_validate(body, context={"served_model": served_model})
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
    path = _path(error["loc"])
    if error["type"] == "refused":
        raise error["ctx"]["refusal"](path)
    if error["type"] == "missing":  # only a top-level field can be: the others refuse their own absence
        raise invalid(path, _WHEN_MISSING.get(path, f"{path} is required"))
    raise invalid(path, f"{path}: {error['msg']}")  # a field without a refusal of its own


def _path(loc: tuple[int | str, ...]) -> str:
    """("messages", 2, "content") -> "messages[2].content", as OpenAI's `param` spells it."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else part
    return path


def _refused(refusal: Refusal) -> PydanticCustomError:
    """A refusal as a pydantic error: it rides in the error's context until `validate` knows the
    field's path."""
    return PydanticCustomError("refused", "refused by the API's checks", {"refusal": refusal})


def _refuse(message: Callable[[str, Any], str], code: str | None = None) -> WrapValidator:
    """Refuse the field with `message(path, value)` when its type or constraints fail. A refusal
    raised inside the field (by a check, or by a nested field's own refusal) goes through as it is.
    A BeforeValidator after it in the field's Annotated runs first, so `value` is what that made
    of the input (16.0 as 16)."""
    def validate_field(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError as exc:
            if exc.errors(include_url=False)[0]["type"] == "refused":
                raise
            raise _refused(lambda path: invalid(path, message(path, value), code)) from None
    return WrapValidator(validate_field)


# ---- checks shared by the fields ------------------------------------------------------------------


def _integral(value: Any) -> Any:
    """An integral float (16.0) as the int it is. Anything else is returned unchanged, for the
    field's type to refuse."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2.0**64:
        return int(value)
    return value


def _integral_items(value: Any) -> Any:
    return [_integral(item) for item in value] if isinstance(value, list) else value


def _text(value: str, field: str = "") -> str:
    """The string, if it is Unicode text (no lone surrogate). `field` extends the path when the
    check is made by the enclosing object."""
    match = _SURROGATE.search(value)
    if match is not None:
        raise _refused(lambda path: invalid(
            path + field, f"{path + field} is not valid Unicode text: a lone surrogate U+{ord(match.group()):04X} at "
                          f"character {match.start()}", "invalid_text"))
    return value


def _short_repr(value: Any, limit: int = 100) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _must_be(what: str) -> WrapValidator:
    return _refuse(lambda path, value: f"{path} must be {what}")


def _as_sampling_params(path: str, value: Any) -> str:
    """SamplingParams' own words for a bad sampling value."""
    try:
        SamplingParams(max_tokens=1, **{path: value})
    except SamplingParamsError as exc:
        return str(exc)
    # Reached only if a field's constraints were stricter than SamplingParams (tests compare them).
    return f"{path} is out of range"


class _DefaultOnly:
    """Field metadata for a parameter this server does not implement: the value must be one of its
    defaults (`Annotated[Any, _DefaultOnly(None, 0)]`)."""

    def __init__(self, *defaults: Any) -> None:
        self.defaults = defaults

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> dict[str, Any]:
        return {"enum": list(self.defaults), "description": "Not supported: only its default."}

    def _check(self, value: Any) -> Any:
        if value not in self.defaults:
            raise _refused(lambda path: invalid(
                path, f"{path} is not supported by this server; omit it or send its default"))
        return value


def _logit_bias(value: dict[str, Any] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias: token ids (as the object's keys, JSON keys being strings) to a bias in
    [-100, 100]. null: none."""
    if value is None:
        return None
    if len(value) > MAX_LOGIT_BIAS:
        raise _refused(lambda path: invalid(path, f"{path} may hold at most {MAX_LOGIT_BIAS} entries; got {len(value)}"))
    bias = {}
    for key, number in value.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 18:
            raise _refused(lambda path: invalid(path, f"{path} keys must be token ids (integers >= 0); "
                                                      f"got {_short_repr(key)}"))
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not -100 <= number <= 100:
            raise _refused(lambda path: invalid(path, f"{path}[{key}] must be a number in [-100, 100]; "
                                                      f"got {_short_repr(number)}"))
        bias[int(key)] = float(number)
    return bias


def _structured(kind: str, value: Any, param: str) -> StructuredOutput:
    """One structured-output field as a StructuredOutput (a schema given as text must parse); an
    APIError naming the field otherwise."""
    if kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise invalid(param, f"{param} is not valid JSON: {exc}") from None
    if kind == "json" and not isinstance(value, dict):
        raise invalid(param, f"{param} must be a JSON schema object")
    if kind == "json_object":
        return StructuredOutput("json_object", param=param)
    text = json.dumps(value) if kind in ("json", "choice") else value
    try:
        return StructuredOutput(kind, text, param=param)
    except SamplingParamsError as exc:
        raise invalid(param, str(exc)) from None


def _priority(value: Any) -> Priority:
    try:
        return Priority.parse(value or "interactive")  # null, "", 0 and false mean the default
    except ValueError as exc:
        message = str(exc)
        raise _refused(lambda path: invalid(path, message)) from None


def _served_model(value: str | None, info: ValidationInfo) -> str | None:
    served = (info.context or {}).get("served_model")
    if value is not None and served is not None and value != served:
        raise _refused(lambda path: APIError(f"the model {value!r} does not exist; this server serves {served!r}",
                                             404, "invalid_request_error", path, "model_not_found"))
    return value


def _stop_text(value: Any) -> Any:
    """Stop strings are checked for Unicode first, before their type and length."""
    for stop in [value] if isinstance(value, str) else value if isinstance(value, list) else []:
        if isinstance(stop, str):
            _text(stop)
    return value


# ---- field types ----------------------------------------------------------------------------------

# Bounds mirror SamplingParams (contracts/sampling.py), which words the refusals.
_StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
_Stop = _StopString | Annotated[list[_StopString], Field(max_length=MAX_STOP_STRINGS, fail_fast=True)]
_StopTokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS, fail_fast=True)]
_MaxTokens = Annotated[Annotated[int, Field(ge=1)] | None,
                       _refuse(lambda path, value: f"{path} must be an integer >= 1; got {_short_repr(value)}"),
                       BeforeValidator(_integral)]

# A prompt: text, texts, token ids, or lists of token ids. Its count, emptiness and text are
# checked after its shape (CompletionRequest.prompt); the schema states them.
_PromptText = Annotated[str, WithJsonSchema({"type": "string", "minLength": 1})]
_TokenIds = Annotated[list[int], Field(min_length=1, fail_fast=True)]
_PromptBatch = Field(min_length=1, fail_fast=True, json_schema_extra={"maxItems": MAX_PROMPTS_PER_REQUEST})
_Prompt = (_PromptText | Annotated[list[_PromptText], _PromptBatch] | _TokenIds
           | Annotated[list[_TokenIds], _PromptBatch])


def _prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """The prompt as one entry per prompt, each a text or token ids."""
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    if len(prompts) > MAX_PROMPTS_PER_REQUEST:
        raise _refused(lambda path: invalid(path, f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request; "
                                                  f"got {len(prompts)}"))
    if any(p == "" for p in prompts):
        raise _refused(lambda path: invalid(path, f"{path} must not be empty", "empty_prompt"))
    for p in prompts:
        if isinstance(p, str):
            _text(p)
    return prompts


def _integral_tokens(prompt: Any) -> Any:
    """Token ids may come as integral floats (5.0), as JSON allows."""
    if isinstance(prompt, list):
        return [_integral_items(p) if isinstance(p, list) else _integral(p) for p in prompt]
    return prompt


# ---- requests -------------------------------------------------------------------------------------


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: Annotated[str, _must_be("a string")] = "schema"
    schema_: Annotated[dict[str, Any], Field(alias="schema"), _must_be("a JSON schema object")]
    description: str | None = None
    strict: Annotated[bool | None, _must_be("a boolean")] = Field(
        None, description="Accepted; the output always follows the schema.")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise _refused(lambda path: invalid(f"{path}.json_schema", f"{path}.json_schema is required when type is "
                                                                       "json_schema"))
        return self


class StructuredOutputs(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    json_: Annotated[dict[str, Any] | str | None, Field(alias="json")] = None
    regex: str | None = None
    choice: Annotated[list[str] | None, Field(min_length=1)] = None
    grammar: str | None = None
    json_object: bool | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = Field(False, description="Send a last chunk with the usage (and null on the others).")


class _GenerationRequest(BaseModel):
    """The fields both endpoints share, in the order they are checked."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={
        "if": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
        "else": {"properties": {"stream_options": {"type": "null"}}}})

    model: Annotated[str | None, AfterValidator(_served_model), _must_be("a string")] = Field(
        None, description="The served model's name, if given.")
    best_of: Annotated[Any, _DefaultOnly(None, 1)] = None
    suffix: Annotated[Any, _DefaultOnly(None, "")] = None
    logit_bias: Annotated[dict[str, Any] | None, AfterValidator(_logit_bias), _refuse(
        lambda path, value: f"{path} must be an object of token ids to numbers in [-100, 100]"),
        WithJsonSchema({"anyOf": [{"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                                   "propertyNames": {"pattern": "^[0-9]{1,18}$"},
                                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
                                  {"type": "null"}]})] = Field(
        None, description="Token ids (as strings) to a bias in [-100, 100] added to their logits.")
    presence_penalty: Annotated[Annotated[float, Field(ge=-2, le=2)] | None, _refuse(_as_sampling_params)] = None
    frequency_penalty: Annotated[Annotated[float, Field(ge=-2, le=2)] | None, _refuse(_as_sampling_params)] = None
    repetition_penalty: Annotated[Annotated[float, Field(gt=0, le=2)] | None, _refuse(_as_sampling_params)] = Field(
        None, description="1: off. Above 1 makes tokens of the prompt and the output less likely (vLLM's).")
    min_tokens: Annotated[Annotated[int, Field(ge=0)] | None, _refuse(
        lambda path, value: f"{path} must be an integer >= 0; got {_short_repr(value)}"), BeforeValidator(_integral)
        ] = Field(None, description="EOS and stop_token_ids cannot end the output before this many tokens.")
    tools: Annotated[Any, _DefaultOnly(None, [])] = None
    functions: Annotated[Any, _DefaultOnly(None, [])] = None
    tool_choice: Annotated[Any, _DefaultOnly(None, "none")] = None
    response_format: Annotated[ResponseFormat | None, _refuse(
        lambda path, value: f"{path} must be {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or "
                            f"{{\"type\": \"json_schema\", \"json_schema\": {{\"name\": ..., \"schema\": {{...}}}}}}")
        ] = Field(None, description="json_object: any JSON object; json_schema: JSON that validates against the schema.")
    structured_outputs: Annotated[StructuredOutputs | None, _refuse(
        lambda path, value: f"{path} must be an object with one of json, regex, choice, grammar, json_object")
        ] = Field(None, description="vLLM's structured outputs: one of json (a schema), regex, choice, grammar "
                                    "(EBNF), json_object.")
    guided_json: Annotated[dict[str, Any] | str | None, _must_be("a JSON schema (an object or its JSON text)")] = None
    guided_regex: Annotated[str | None, _must_be("a regular expression")] = None
    guided_choice: Annotated[list[str] | None, Field(min_length=1), _must_be("a non-empty list of strings")] = None
    guided_grammar: Annotated[str | None, _must_be("an EBNF grammar")] = None
    n: Annotated[Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None,
                 _refuse(lambda path, value: f"{path} must be an integer in [1, {MAX_CHOICES}]; "
                                             f"got {_short_repr(value)}"),
                 BeforeValidator(_integral)] = Field(None, description="Choices per prompt; they share the prompt's "
                                                                       "prefill.")
    stream: Annotated[bool | None, _must_be("a boolean")] = None
    stream_options: Annotated[StreamOptions | None, _refuse(
        lambda path, value: f"{path} must be an object" if not isinstance(value, dict)
        else f"{path}.include_usage must be a boolean")] = None
    user: Annotated[str | None, _must_be("a string")] = None
    priority: Annotated[Priority, PlainValidator(_priority),
                        WithJsonSchema({"enum": [*PRIORITIES, None],
                                        "description": "Batch requests are shed first under overload."})
                        ] = Field(Priority.INTERACTIVE, json_schema_extra={"default": Priority.INTERACTIVE.label})
    temperature: Annotated[Annotated[float, Field(ge=0, le=100)] | None, _refuse(_as_sampling_params)] = None
    top_p: Annotated[Annotated[float, Field(gt=0, le=1)] | None, _refuse(_as_sampling_params)] = None
    top_k: Annotated[Annotated[int, Field(ge=-1)] | None, _refuse(_as_sampling_params),
                     BeforeValidator(_integral)] = Field(None, description="0 or -1: no top-k filter.")
    seed: Annotated[Annotated[int, Field(ge=0, lt=2**63)] | None, _refuse(_as_sampling_params),
                    BeforeValidator(_integral)] = None
    stop: Annotated[_Stop | None, _refuse(_as_sampling_params), BeforeValidator(_stop_text)] = None
    stop_token_ids: Annotated[_StopTokenIds | None, _refuse(_as_sampling_params),
                              BeforeValidator(_integral_items)] = None
    ignore_eos: Annotated[bool | None, _refuse(_as_sampling_params)] = None

    @field_validator("stream_options", mode="before")
    @classmethod
    def _only_when_streaming(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream"):
            raise _refused(lambda path: invalid(path, f"{path} is only allowed when stream is true"))
        return value

    def sampling(self) -> dict[str, Any]:
        """The SamplingParams fields the body sets (max_tokens aside: it depends on the prompt)."""
        sampling = {name: getattr(self, name) for name in (
            "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens")}
        sampling["logprobs"] = self.num_logprobs()
        sampling["structured"] = self.structured()
        if isinstance(sampling["stop"], str):
            sampling["stop"] = [sampling["stop"]]
        return {name: value for name, value in sampling.items() if value is not None}

    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: the alternatives asked for each token (None: no logprobs)."""
        return None

    def structured(self) -> StructuredOutput | None:
        """The grammar the body asks for, from whichever of its fields names one (at most one may: an
        APIError otherwise)."""
        asked: list[StructuredOutput] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(StructuredOutput("json_object", param="response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            asked.append(StructuredOutput("json", json.dumps(fmt.json_schema.schema_),
                                          param="response_format.json_schema.schema"))
        outputs = self.structured_outputs
        if outputs is not None:
            named = [(name, value) for name, value in (("json", outputs.json_), ("regex", outputs.regex),
                                                       ("choice", outputs.choice), ("grammar", outputs.grammar),
                                                       ("json_object", outputs.json_object or None))
                     if value is not None]
            if len(named) != 1:
                raise invalid("structured_outputs", "structured_outputs must name exactly one of json, regex, choice, "
                                                    "grammar, json_object")
            asked.append(_structured(*named[0], f"structured_outputs.{named[0][0]}"))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                asked.append(_structured(kind, value, name))
        if len(asked) > 1:
            raise invalid(asked[1].param.split(".")[0], "only one structured output may be asked for; got "
                                                        f"{', '.join(a.param for a in asked)}")
        return asked[0] if asked else None


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions."""

    logprobs: Annotated[Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None, _refuse(
        lambda path, value: f"{path} must be an integer in [0, {MAX_LOGPROBS}] (the most likely tokens to list "
                            f"beside each sampled one); got {_short_repr(value)}"), BeforeValidator(_integral),
        BeforeValidator(lambda value: None if value is False else value)  # false: none, as chat's false
        ] = Field(None, description="Return each token's log probability and those of this many likely tokens.")
    # After validation: one entry per prompt, each a text or token ids.
    prompt: Annotated[_Prompt, AfterValidator(_prompts), _refuse(
        lambda path, value: f"{path} must be a string, a list of strings, a list of token ids or a list of lists "
                            "of token ids, and not empty"), BeforeValidator(_integral_tokens)]
    max_tokens: _MaxTokens = Field(None, description="16 if not given.")
    echo: Annotated[bool | None, _must_be("a boolean")] = Field(
        None, description="Return the prompt before the completion; with logprobs, the prompt's logprobs too "
                          "(null for its first token).")

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def sampling(self) -> dict[str, Any]:
        sampling = super().sampling()
        if self.echo and self.logprobs is not None:
            sampling["prompt_logprobs"] = self.logprobs
        return sampling


@with_config(ConfigDict(strict=True, extra="ignore"))
class TextPart(TypedDict):
    type: Literal["text"]
    text: str


# A dict, as the chat template takes it: a body may hold 100k messages, and pydantic validates a
# TypedDict 5x faster than a model. _checked_message makes the checks that need the whole message.
@with_config(ConfigDict(strict=True, extra="ignore", json_schema_extra={
    "if": {"properties": {"role": {"const": "assistant"}}},
    "else": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}}))
class ChatMessage(TypedDict):
    """One turn of the conversation."""

    role: ChatRole
    # After validation: the text, parts joined by newlines ("" for an assistant turn without content).
    content: NotRequired[Annotated[str | list[TextPart] | None,
                                   Field(description="Required but for an assistant turn.")]]
    # A name that is not a string is dropped.
    name: NotRequired[Annotated[str | None, BeforeValidator(lambda name: name if isinstance(name, str) else None)]]


def _checked_message(data: Any, handler: ValidatorFunctionWrapHandler) -> ChatMessage:
    """The message, checked in one pass: pydantic's errors become the fields' refusals, then the
    content becomes one text."""
    try:
        message = handler(data)
    except ValidationError as exc:
        raise _message_refusal(exc.errors(include_url=False)[0]["loc"], data) from None
    content = message.get("content")
    if content is None and message["role"] != "assistant":
        raise _message_refusal(("content",), data)
    if isinstance(content, list):
        content = "\n".join(part["text"] for part in content)
    message["content"] = _text(content or "", ".content")
    if message.get("name") is None:
        message.pop("name", None)
    else:
        _text(message["name"], ".name")
    return message


def _message_refusal(loc: tuple[int | str, ...], data: Any) -> PydanticCustomError:
    """The refusal of a bad message (its path is the message's, as "messages[2]"), by the field
    pydantic found bad first."""
    if not loc:
        return _refused(lambda path: invalid(path, f"{path} must be an object"))
    field = f".{loc[0]}"
    value = data.get(loc[0])
    if loc[0] == "role":
        return _refused(lambda path: invalid(path + field, f"{path + field} must be one of {', '.join(CHAT_ROLES)}; "
                                                          f"got {value!r}"))
    if isinstance(value, list):
        return _refused(lambda path: invalid(path + field, f"{path + field} parts must be {{\"type\": \"text\", "
                                                          "\"text\": ...}: this model takes text only"))
    return _refused(lambda path: invalid(path + field, f"{path + field} must be a string or a list of text parts"))


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    logprobs: Annotated[bool | None, _must_be("a boolean")] = Field(
        None, description="Return each output token's log probability (choices[].logprobs.content).")
    top_logprobs: Annotated[Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None, _refuse(
        lambda path, value: f"{path} must be an integer in [0, {MAX_LOGPROBS}]; got {_short_repr(value)}"),
        BeforeValidator(_integral)] = Field(None, description="With logprobs: this many likely tokens per token.")
    messages: Annotated[list[Annotated[ChatMessage, WrapValidator(_checked_message)]],
                        Field(min_length=1, fail_fast=True), _refuse(lambda path, value: _MESSAGES_REFUSAL)]
    echo: Annotated[Any, _DefaultOnly(None, False)] = None
    max_tokens: _MaxTokens = Field(None, description="The rest of the context if not given.")
    max_completion_tokens: _MaxTokens = Field(None, description="The same as max_tokens.")
    add_generation_prompt: Annotated[bool, _must_be("a boolean")] = True

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise _refused(lambda path: invalid(path, f"{path} needs logprobs set to true"))
        return value

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("max_completion_tokens")
    @classmethod
    def _agrees_with_max_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        max_tokens = info.data.get("max_tokens")
        if value is not None and max_tokens is not None and value != max_tokens:
            raise _refused(lambda path: invalid(path, "max_tokens and max_completion_tokens disagree; send one"))
        return value


# ---- /tokenize and /detokenize (vLLM's request shapes) --------------------------------------------


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize with a prompt."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: Annotated[str | None, AfterValidator(_served_model), _must_be("a string")] = None
    prompt: Annotated[str, AfterValidator(_text), _must_be("a string")]
    add_special_tokens: Annotated[bool, _must_be("a boolean")] = Field(
        True, description="Add the tokenizer's special tokens (BOS), as a completions prompt gets them.")
    return_token_strs: Annotated[bool, _must_be("a boolean")] = Field(False, description="Also list each token's text.")


class TokenizeChatRequest(BaseModel):
    """POST /tokenize with messages: the prompt a chat request would send, chat template applied."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: Annotated[str | None, AfterValidator(_served_model), _must_be("a string")] = None
    messages: Annotated[list[Annotated[ChatMessage, WrapValidator(_checked_message)]],
                        Field(min_length=1, fail_fast=True), _refuse(lambda path, value: _MESSAGES_REFUSAL)]
    add_generation_prompt: Annotated[bool, _must_be("a boolean")] = True
    continue_final_message: Annotated[bool, _must_be("a boolean")] = Field(
        False, description="Leave the last (assistant) message open for the model to continue.")
    add_special_tokens: Annotated[bool, _must_be("a boolean")] = Field(
        False, description="The template writes the special tokens itself.")
    return_token_strs: Annotated[bool, _must_be("a boolean")] = False

    @field_validator("continue_final_message")
    @classmethod
    def _one_or_the_other(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt"):
            raise _refused(lambda path: invalid(path, "continue_final_message and add_generation_prompt cannot both "
                                                      "be true"))
        return value


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: Annotated[str | None, AfterValidator(_served_model), _must_be("a string")] = None
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], BeforeValidator(_integral_items),
                      _must_be("a list of token ids (integers >= 0)")]
