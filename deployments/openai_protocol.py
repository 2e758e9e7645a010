"""The OpenAI completions and chat-completions protocol: parse and check a request body, and shape
responses and stream chunks. Pure Python: no tokenizer, no Ray.

Parsing never trusts the JSON: every field is checked for type and range, and each failure is an
APIError naming the parameter. Parameters we do not implement are accepted at their default values
(so clients that always send `logprobs: null` or `presence_penalty: 0` work) and refused otherwise.
Unknown fields are ignored, as OpenAI and vLLM do.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from contracts.checks import is_int
from contracts.priority import Priority
from contracts.sampling import SamplingParams, SamplingParamsError
from deployments.errors import APIError, invalid

# A completions request may batch prompts; more than this in one body is refused.
MAX_PROMPTS_PER_REQUEST = 256
# JSON may carry "\ud800" escapes, which decode to lone surrogates: not Unicode text, and no
# tokenizer can encode them (they failed with a 500).
_SURROGATE = re.compile("[\ud800-\udfff]")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# Accepted only at these values: (parameter, predicate that says "this is the default").
_UNSUPPORTED_UNLESS_DEFAULT: tuple[tuple[str, Any], ...] = (
    ("logprobs", lambda v: v in (None, False, 0)),
    ("top_logprobs", lambda v: v in (None, 0)),
    ("echo", lambda v: v in (None, False)),
    ("best_of", lambda v: v in (None, 1)),
    ("suffix", lambda v: v in (None, "")),
    ("logit_bias", lambda v: v in (None, {})),
    ("presence_penalty", lambda v: v in (None, 0)),
    ("frequency_penalty", lambda v: v in (None, 0)),
    ("repetition_penalty", lambda v: v in (None, 1)),
    ("min_tokens", lambda v: v in (None, 0)),
    ("tools", lambda v: v in (None, [])),
    ("functions", lambda v: v in (None, [])),
    ("tool_choice", lambda v: v in (None, "none")),
    ("response_format", lambda v: v is None or v == {"type": "text"}),
)


@dataclass(slots=True)
class ParsedRequest:
    kind: str  # "completion" or "chat"
    model: str
    # Completions: one entry per prompt, each a string or token ids. Chat: unused.
    prompts: list[str | list[int]] = field(default_factory=list)
    # Chat: messages with string content, ready for the tokenizer's chat template.
    messages: list[dict[str, Any]] = field(default_factory=list)
    add_generation_prompt: bool = True
    # max_tokens as asked; None means "the rest of the context" (chat) or 16 (completions).
    max_tokens: int | None = None
    # Everything but max_tokens, which depends on the prompt length when it is None.
    sampling: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    priority: str = "interactive"
    user: str | None = None
    request_id: str = ""
    created: int = 0

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(max_tokens=max_tokens, **self.sampling)
        except SamplingParamsError as exc:
            raise invalid(exc.param, str(exc)) from None


def parse_completion(body: Any, served_model: str) -> ParsedRequest:
    body = _object(body)
    parsed = _common(body, "completion", served_model, "cmpl-")
    if "prompt" not in body:
        raise invalid("prompt", "prompt is required")
    parsed.prompts = _prompts(body["prompt"])
    parsed.max_tokens = _optional_int(body, "max_tokens")
    if parsed.max_tokens is None:
        parsed.max_tokens = 16  # the OpenAI completions default
    return parsed


def parse_chat(body: Any, served_model: str) -> ParsedRequest:
    body = _object(body)
    parsed = _common(body, "chat", served_model, "chatcmpl-")
    parsed.messages = _messages(body.get("messages"))
    max_tokens = _optional_int(body, "max_tokens")
    max_completion_tokens = _optional_int(body, "max_completion_tokens")
    if max_tokens is not None and max_completion_tokens is not None and max_tokens != max_completion_tokens:
        raise invalid("max_completion_tokens", "max_tokens and max_completion_tokens disagree; send one")
    parsed.max_tokens = max_completion_tokens if max_completion_tokens is not None else max_tokens
    add_generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(add_generation_prompt, bool):
        raise invalid("add_generation_prompt", "add_generation_prompt must be a boolean")
    parsed.add_generation_prompt = add_generation_prompt
    return parsed


def _common(body: dict[str, Any], kind: str, served_model: str, id_prefix: str) -> ParsedRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", "model must be a string")
    if model is not None and model != served_model:
        raise APIError(f"the model {model!r} does not exist; this server serves {served_model!r}", 404,
                       "invalid_request_error", "model", "model_not_found")
    for name, is_default in _UNSUPPORTED_UNLESS_DEFAULT:
        if name in body and not _safe(is_default, body[name]):
            raise invalid(name, f"{name} is not supported by this server; omit it or send its default")
    n = _integral(body.get("n"))
    if n is not None and (not is_int(n) or n != 1):
        raise invalid("n", f"n must be 1 (one choice per prompt); got {n!r}")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid("stream", "stream must be a boolean")
    include_usage = _stream_options(body.get("stream_options"), stream)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("user", "user must be a string")
    try:
        priority = Priority.parse(body.get("priority") or "interactive").label
    except ValueError as exc:
        raise invalid("priority", str(exc)) from None
    return ParsedRequest(kind=kind, model=served_model, sampling=_sampling(body), stream=stream,
                         include_usage=include_usage, priority=priority, user=user,
                         request_id=id_prefix + uuid.uuid4().hex, created=int(time.time()))


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The SamplingParams fields the body sets; SamplingParams itself checks their values."""
    sampling: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "seed", "ignore_eos"):
        if body.get(name) is not None:
            sampling[name] = _integral(body[name]) if name in ("top_k", "seed") else body[name]
    stop = body.get("stop")
    if stop is not None:
        sampling["stop"] = [stop] if isinstance(stop, str) else stop
        if isinstance(sampling["stop"], list):
            for s in sampling["stop"]:
                if isinstance(s, str):
                    _text(s, "stop")
    if body.get("stop_token_ids") is not None:
        ids = body["stop_token_ids"]
        sampling["stop_token_ids"] = [_integral(t) for t in ids] if isinstance(ids, list) else ids
    try:  # check now, with a placeholder max_tokens, so a bad value fails before any tokenizing
        SamplingParams(max_tokens=1, **sampling)
    except SamplingParamsError as exc:
        raise invalid(exc.param, str(exc)) from None
    return sampling


def _stream_options(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise invalid("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(options, dict):
        raise invalid("stream_options", "stream_options must be an object")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise invalid("stream_options", "stream_options.include_usage must be a boolean")
    return include_usage


def _prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, list):  # token ids may come as integral floats (5.0), as JSON allows
        prompt = [[_integral(t) for t in p] if isinstance(p, list) else _integral(p) for p in prompt]
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, list) and p and all(is_int(t) for t in p) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise invalid("prompt", "prompt must be a string, a list of strings, a list of token ids or a list "
                                "of lists of token ids, and not empty")
    if len(prompts) > MAX_PROMPTS_PER_REQUEST:
        raise invalid("prompt", f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request; got {len(prompts)}")
    if any(p == "" for p in prompts):
        raise invalid("prompt", "prompt must not be empty", "empty_prompt")
    for p in prompts:
        if isinstance(p, str):
            _text(p, "prompt")
    return prompts


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages must be a non-empty list of {role, content} objects")
    normalized = []
    for index, message in enumerate(messages):
        param = f"messages[{index}]"
        if not isinstance(message, dict):
            raise invalid(param, f"{param} must be an object")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"{param}.role", f"{param}.role must be one of {', '.join(CHAT_ROLES)}; got {role!r}")
        content = _text(_content(message.get("content"), role, f"{param}.content"), f"{param}.content")
        entry: dict[str, Any] = {"role": role, "content": content}
        if isinstance(message.get("name"), str):
            entry["name"] = _text(message["name"], f"{param}.name")
        normalized.append(entry)
    return normalized


def _content(content: Any, role: str, param: str) -> str:
    """Text content as one string: a string, or a list of {"type": "text", "text"} parts."""
    if content is None and role == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(param, f"{param} parts must be {{\"type\": \"text\", \"text\": ...}}: this model "
                                     "takes text only")
            texts.append(part["text"])
        return "\n".join(texts)
    raise invalid(param, f"{param} must be a string or a list of text parts")


# ---- responses ------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_response(parsed: ParsedRequest, choices: list[dict[str, Any]],
                        usage_: dict[str, Any]) -> dict[str, Any]:
    obj = "chat.completion" if parsed.kind == "chat" else "text_completion"
    return {"id": parsed.request_id, "object": obj, "created": parsed.created, "model": parsed.model,
            "choices": choices, "usage": usage_}


def choice(parsed: ParsedRequest, index: int, text: str, finish_reason: str | None,
           stop_reason: int | str | None) -> dict[str, Any]:
    if parsed.kind == "chat":
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason, "stop_reason": stop_reason}
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def stream_chunk(parsed: ParsedRequest, index: int, text: str, finish_reason: str | None = None,
                 stop_reason: int | str | None = None, role: bool = False) -> dict[str, Any]:
    if parsed.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {}
        if text and not role:
            delta["content"] = text
        item: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        item = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        item["stop_reason"] = stop_reason
    return _chunk_envelope(parsed, [item])


def usage_chunk(parsed: ParsedRequest, usage_: dict[str, Any]) -> dict[str, Any]:
    chunk = _chunk_envelope(parsed, [])
    chunk["usage"] = usage_
    return chunk


def _chunk_envelope(parsed: ParsedRequest, choices: list[dict[str, Any]]) -> dict[str, Any]:
    obj = "chat.completion.chunk" if parsed.kind == "chat" else "text_completion"
    chunk = {"id": parsed.request_id, "object": obj, "created": parsed.created, "model": parsed.model,
             "choices": choices}
    if parsed.include_usage:
        chunk["usage"] = None  # as OpenAI does: null on every chunk but the last
    return chunk


# ---- helpers --------------------------------------------------------------------------------------


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    return body


def _text(value: str, param: str) -> str:
    """The string, if it is Unicode text (no lone surrogate)."""
    match = _SURROGATE.search(value)
    if match is not None:
        raise invalid(param, f"{param} is not valid Unicode text: a lone surrogate U+{ord(match.group()):04X} at "
                             f"character {match.start()}", "invalid_text")
    return value


def _optional_int(body: dict[str, Any], name: str) -> int | None:
    value = _integral(body.get(name))
    if value is None:
        return None
    if not is_int(value) or value < 1:
        raise invalid(name, f"{name} must be an integer >= 1; got {_short_repr(value)}")
    return value


def _integral(value: Any) -> Any:
    """An integral float (16.0) as the int it is: JSON has one number type, and JSON Schema, OpenAI
    and vLLM (pydantic) take 16.0 where an integer is due. Anything else is returned unchanged, for
    the caller's check to refuse."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2.0**64:
        return int(value)
    return value


def _short_repr(value: Any, limit: int = 100) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _safe(predicate: Any, value: Any) -> bool:
    try:
        return bool(predicate(value))
    except Exception:  # an unhashable or odd value is simply not the default
        return False
