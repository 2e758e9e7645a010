"""The OpenAI completions and chat-completions protocol: parse a request body into a ParsedRequest,
and shape responses and stream chunks, with the models of the response bodies. Pure Python: no
tokenizer, no Ray.

The request models and their checks are in deployments/openai_models.py; a refused body is an
APIError naming the parameter.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from contracts.priority import Priority
from contracts.sampling import SamplingParams, SamplingParamsError, choice_seed
from deployments.errors import invalid
from deployments.openai_models import (CHAT_ROLES, MAX_PROMPTS_PER_REQUEST, ChatCompletionRequest, CompletionRequest,
                                       validate)

__all__ = ["CHAT_ROLES", "MAX_PROMPTS_PER_REQUEST", "AssistantMessage", "ChatChoice", "ChatChunkChoice",
           "ChatCompletion", "ChatCompletionChunk", "ChatDelta", "ChatLogprobs", "CompletionLogprobs",
           "TokenLogprob", "TopLogprob", "chat_logprobs", "completion_logprobs", "TokenizeResponse", "DetokenizeResponse", "Completion", "CompletionChoice", "CompletionChunk",
           "CompletionChunkChoice", "ErrorDetail", "ErrorResponse", "FinishReason", "Health", "ModelCard",
           "ModelList", "ParsedRequest", "PromptTokensDetails", "StopReason", "Usage", "choice",
           "completion_response", "parse_chat", "parse_completion", "stream_chunk", "usage", "usage_chunk"]


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
    # Completions: the prompt goes before each choice's text (and its logprobs before the choice's).
    echo: bool = False
    # Choices per prompt: choice j of prompt p has index p * n + j.
    n: int = 1
    include_usage: bool = False
    priority: Priority = Priority.INTERACTIVE
    user: str | None = None
    request_id: str = ""
    created: int = 0

    @property
    def logprobs(self) -> int | None:
        """The alternatives asked for each token; None: no logprobs."""
        return self.sampling.get("logprobs")

    def sampling_params(self, max_tokens: int, choice: int = 0) -> SamplingParams:
        """The parameters of one choice: its own seed stream when the request is seeded."""
        sampling = self.sampling
        if choice and sampling.get("seed") is not None:
            sampling = {**sampling, "seed": choice_seed(sampling["seed"], choice)}
        try:
            return SamplingParams(max_tokens=max_tokens, **sampling)
        except SamplingParamsError as exc:
            raise invalid(exc.param, str(exc)) from None


def parse_completion(body: Any, served_model: str) -> ParsedRequest:
    request = validate(CompletionRequest, body, served_model)
    parsed = _parsed(request, "completion", served_model, "cmpl-")
    parsed.prompts = request.prompt
    parsed.max_tokens = 16 if request.max_tokens is None else request.max_tokens  # the OpenAI completions default
    parsed.echo = bool(request.echo)
    if len(parsed.prompts) * parsed.n > MAX_PROMPTS_PER_REQUEST:
        raise invalid("n", f"{len(parsed.prompts)} prompts times n = {parsed.n} choices is more than the "
                           f"{MAX_PROMPTS_PER_REQUEST} a request may hold")
    return parsed


def parse_chat(body: Any, served_model: str) -> ParsedRequest:
    request = validate(ChatCompletionRequest, body, served_model)
    parsed = _parsed(request, "chat", served_model, "chatcmpl-")
    parsed.messages = request.messages
    parsed.max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None \
        else request.max_tokens
    parsed.add_generation_prompt = request.add_generation_prompt
    return parsed


def _parsed(request: CompletionRequest | ChatCompletionRequest, kind: str, served_model: str,
            id_prefix: str) -> ParsedRequest:
    include_usage = request.stream_options is not None and request.stream_options.include_usage
    return ParsedRequest(kind=kind, model=served_model, sampling=request.sampling(), stream=bool(request.stream),
                         include_usage=include_usage, priority=request.priority, user=request.user,
                         request_id=id_prefix + uuid.uuid4().hex, created=int(time.time()), n=request.n or 1)


# ---- responses ------------------------------------------------------------------------------------
# The models describe the bodies (GET /openapi.json); the builders below write them as plain dicts:
# a stream sends one chunk per token, and a dict costs 0.6 us where a model and its dump cost 11 us.

FinishReason = Literal["stop", "length", "abort"]
# The stop token id or stop string that ended the choice (finish_reason "stop").
StopReason = int | str | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null for an echoed prompt's first token.")
    top_logprobs: list[dict[str, float] | None] = Field(description="The likeliest tokens at each position, with "
                                                                    "the one there.")
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = Field(description="With the request's logprobs only.")
    finish_reason: FinishReason
    stop_reason: StopReason


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = Field(description="With the request's logprobs: true only.")
    finish_reason: FinishReason
    stop_reason: StopReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = Field(description="Of this chunk's tokens, with the request's logprobs.")
    finish_reason: FinishReason | None
    stop_reason: StopReason = Field(None, description="Only on a choice's last chunk.")


class CompletionChunk(BaseModel):
    """One `data:` event of a completions stream."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = Field(None, description="With stream_options.include_usage only: null on every "
                                                  "chunk but the last, which has no choices.")


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(None, description="Only on a choice's first chunk.")
    content: str | None = Field(None, description="Absent on a last chunk without new text.")


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = Field(description="Of this chunk's tokens, with the request's logprobs.")
    finish_reason: FinishReason | None
    stop_reason: StopReason = Field(None, description="Only on a choice's last chunk.")


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a chat-completions stream."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="With stream_options.include_usage only: null on every "
                                                  "chunk but the last, which has no choices.")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = Field(description="With return_token_strs only.")


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int = Field(description="Context length in tokens, prompt and output together.")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = Field(description="The refused parameter's path, such as messages[0].content.")
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    model_config = ConfigDict(extra="allow")

    status: Literal["ok", "unavailable"]




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
           stop_reason: int | str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    if parsed.kind == "chat":
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason, "stop_reason": stop_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def stream_chunk(parsed: ParsedRequest, index: int, text: str, finish_reason: str | None = None,
                 stop_reason: int | str | None = None, role: bool = False,
                 logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    if parsed.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {}
        if text and not role:
            delta["content"] = text
        item: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs,
                                "finish_reason": finish_reason}
    else:
        item = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
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


# ---- logprobs -------------------------------------------------------------------------------------
# A log probability of minus infinity (a token min_tokens or a bias of -100 ruled out) is not JSON;
# it is sent as this, as vLLM does.
MIN_LOGPROB = -9999.0


def _logprob(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB


def completion_logprobs(token_ids: list[int], entries: list[Any], decode: Callable[[int], str], num_top: int,
                        text_offset: int) -> dict[str, Any]:
    """The completions API's `logprobs` of some tokens: their texts, log probabilities, the
    `num_top` likeliest alternatives of each (with the token itself, as vLLM lists them) and each
    token's character offset in the choice's text, starting at `text_offset`. `entries` are
    TokenLogprobs, one per token id (None for a prompt's first token: null logprob and
    alternatives); `decode` gives one token's text."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text = decode(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        logprob, top_ids, top_values = entry
        token_logprobs.append(_logprob(logprob))
        # Two ids may decode to one text (pieces of UTF-8 characters): the dict keeps the likelier.
        top: dict[str, float] = {}
        for i, v in zip(top_ids[:num_top], top_values):
            top.setdefault(decode(i), _logprob(v))
        top.setdefault(text, _logprob(logprob))
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def chat_logprobs(token_ids: list[int], entries: list[Any], decode: Callable[[int], str],
                  num_top: int) -> dict[str, Any]:
    """The chat API's `logprobs` of some output tokens: {"content": [...]}, each token with its
    log probability, its UTF-8 bytes and its `num_top` likeliest alternatives."""
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = decode(token_id)
        return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode("utf-8", "replace"))}

    content = []
    for token_id, (logprob, top_ids, top_values) in zip(token_ids, entries):
        entry = item(token_id, logprob)
        entry["top_logprobs"] = [item(i, v) for i, v in zip(top_ids[:num_top], top_values)]
        content.append(entry)
    return {"content": content}
