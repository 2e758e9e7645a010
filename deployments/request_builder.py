"""RequestBuilder: a parsed OpenAI body -> the GenerateRequests the ingress sends, one per prompt.

The ingress tokenizes once (chat templates through the tokenizer's `apply_chat_template`), sets
max_tokens (the rest of the context when the body leaves it out) and computes block hashes with
the engine's own function. It checks only what it must before sending: what only it can see (a
text too long to fit before it is tokenized, the chat template's verdict), and, for every prompt
before any is sent, the refusals of the engine's door (model_worker/sched/request_checks.py), by
calling the door's own functions, so that a request of several prompts is refused whole and each
refusal has one message wherever it is raised.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from contracts.sampling import GrammarError, StructuredOutput
from contracts.serving import GenerateRequest, ModelInfo
from deployments import openai_protocol as oai
from deployments.errors import invalid, rejected
from deployments.openai_models import TokenizeChatRequest, TokenizeCompletionRequest
from model_worker.sched.hashing import hash_prompt_blocks
from model_worker.sched.request_checks import RequestRejected, check_context_length, check_not_empty, check_token_ids

# Prompts of up to this many characters in all are tokenized on the event loop (about a
# millisecond); longer ones in the tokenizer thread, so that no other request waits on them.
INLINE_TOKENIZE_CHARS = 4096
# Characters per token assumed when the tokenizer cannot list its vocabulary.
DEFAULT_MAX_CHARS_PER_TOKEN = 64


class RequestBuilder:
    def __init__(self, tokenizer: Any, info: ModelInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info
        # No token covers more characters than the vocabulary's longest entry, so a prompt longer
        # than max_model_len of them cannot fit the context: it is refused before tokenizing (a
        # 10 MB prompt took 14 s to tokenize and then was refused anyway).
        self.max_prompt_chars = info.max_model_len * _max_chars_per_token(tokenizer)
        # One thread: a fast tokenizer is not safe to call from two threads at once.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="iterserve-tokenize")
        # Structured output's compiler (model_worker.runner.grammar), built at the first grammar.
        self._grammar_compiler: Any = None

    async def build(self, parsed: oai.ParsedRequest) -> list[GenerateRequest]:
        """Every prompt's request, or an APIError before any is sent; tokenized off the event loop
        unless the text is short. A grammar (structured output) is compiled off the event loop
        first, so that one the grammar library refuses is a 400 and reaches no engine."""
        num_chars = self._check_sizes(parsed)
        loop = asyncio.get_running_loop()
        structured = parsed.sampling.get("structured")
        if structured is not None:
            await loop.run_in_executor(self._tokenize_pool, self._check_grammar, structured)
        if num_chars <= INLINE_TOKENIZE_CHARS:
            return self._generate_requests(parsed)
        return await loop.run_in_executor(self._tokenize_pool, self._generate_requests, parsed)

    def _check_grammar(self, spec: StructuredOutput) -> None:
        """A JSON schema must be one (jsonschema's meta-schema check), and every spec must compile
        (the compiled grammar stays in the compiler's cache)."""
        if spec.kind == "json":
            import jsonschema

            schema = json.loads(spec.value)
            try:
                jsonschema.validators.validator_for(schema).check_schema(schema)
            except jsonschema.SchemaError as exc:
                raise invalid(spec.param, f"{spec.param} is not a valid JSON schema: {exc.message}") from None
        try:
            if self._grammar_compiler is None:
                if self.info.vocab_size is None:
                    return  # the engine compiles it (and refuses it there)
                from model_worker.runner.grammar import GrammarCompiler

                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.info.vocab_size)
            self._grammar_compiler.compile(spec)
        except GrammarError as exc:
            param = spec.param if exc.param == "structured_output" else exc.param
            raise invalid(param, str(exc)) from None

    async def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> list[int]:
        """A /tokenize body's token ids: the prompt as a completions request would send it, or the
        messages as a chat request would (the chat template applied); off the event loop unless
        short, and refused as a prompt would be when it cannot fit the context."""
        chat = isinstance(request, TokenizeChatRequest)
        num_chars = (sum(len(m["content"]) + len(m.get("name", "")) for m in request.messages) if chat
                     else len(request.prompt))
        self._check_text_size(num_chars, "messages" if chat else "prompt")
        if num_chars <= INLINE_TOKENIZE_CHARS:
            return self._tokenize(request)
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, self._tokenize, request)

    def _tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> list[int]:
        if isinstance(request, TokenizeCompletionRequest):
            return list(self.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens))
        text = self._chat_template(request.messages, request.add_generation_prompt, request.continue_final_message)
        return list(self.tokenizer.encode(text, add_special_tokens=request.add_special_tokens))

    def _check_text_size(self, num_chars: int, param: str) -> None:
        limit = self.max_prompt_chars
        if num_chars > limit:
            raise invalid(param, f"this model's maximum context length is {self.info.max_model_len} tokens, and a "
                                 f"text of {num_chars} characters is longer than that many tokens of this tokenizer "
                                 f"can be (at most {limit} characters)", "context_length_exceeded")

    def _check_sizes(self, parsed: oai.ParsedRequest) -> int:
        """Characters of text to tokenize; a prompt that cannot fit the context is refused here."""
        limit = self.max_prompt_chars
        if parsed.kind == "chat":
            num_chars = sum(len(m["content"]) + len(m.get("name", "")) for m in parsed.messages)
            sizes = [num_chars]
        else:
            sizes = [len(p) for p in parsed.prompts if isinstance(p, str)]
            num_chars = sum(sizes)
        too_long = next((n for n in sizes if n > limit), None)
        if too_long is not None:
            self._check_text_size(too_long, "messages" if parsed.kind == "chat" else "prompt")
        return num_chars

    def _generate_requests(self, parsed: oai.ParsedRequest) -> list[GenerateRequest]:
        """Token ids, max_tokens and block hashes for every prompt; raises before any is sent."""
        try:
            bias = parsed.sampling.get("logit_bias")
            if bias:
                check_token_ids(list(bias), self.info.vocab_size, "logit_bias")
            if parsed.kind == "chat":
                prompts, param = [self._chat_token_ids(parsed)], "messages"
            else:
                prompts, param = [self._encode(p) for p in parsed.prompts], "prompt"
            return [request for index, token_ids in enumerate(prompts)
                    for request in self._requests(parsed, index, token_ids, param)]
        except RequestRejected as exc:
            raise rejected(exc) from None

    def _requests(self, parsed: oai.ParsedRequest, index: int, token_ids: list[int],
                  param: str) -> list[GenerateRequest]:
        """The n choices of one prompt, indices index * n + j, each with its own seed stream. They
        share one prefill on their replica: the prompt's full blocks are in the prefix cache from
        the step they are allocated in, so the choices after the first hit them (the router sends
        the n to one replica: its own dispatch of the first counts as that replica's prefix)."""
        max_tokens = check_context_length(len(token_ids), parsed.max_tokens, self.info.max_model_len, param)
        # Hashed once, here, with the request's cache key: the router scores replicas by these,
        # and the replica's cache uses them as sent (RequestChecker.check_block_hashes).
        block_hashes = hash_prompt_blocks(token_ids, self.info.block_size, None)
        return [GenerateRequest(prompt_token_ids=token_ids, params=parsed.sampling_params(max_tokens, choice),
                                priority=parsed.priority, request_id=f"{parsed.request_id}-{index * parsed.n + choice}",
                                block_hashes=list(block_hashes))
                for choice in range(parsed.n)]

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            token_ids = list(self.tokenizer.encode(prompt))
        else:
            token_ids = prompt
            check_token_ids(token_ids, self.info.vocab_size, "prompt")
        check_not_empty(len(token_ids), "prompt", "the tokenized prompt")
        return token_ids

    def _chat_token_ids(self, parsed: oai.ParsedRequest) -> list[int]:
        text = self._chat_template(parsed.messages, parsed.add_generation_prompt)
        # The template writes the special tokens (BOS included) itself.
        token_ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        check_not_empty(len(token_ids), "messages", "the conversation, with the chat template applied,")
        return token_ids


    def _chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                       continue_final_message: bool = False) -> str:
        options = {"continue_final_message": True} if continue_final_message else {}
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **options)
        except Exception as exc:  # a template may refuse a conversation (roles out of order, ...)
            raise invalid("messages", f"the chat template refused these messages: {exc}") from None


def _max_chars_per_token(tokenizer: Any) -> int:
    """The longest vocabulary entry in characters (byte-level BPE writes one character per byte, so
    this bounds the text one token decodes to)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    try:
        vocab = get_vocab() if get_vocab is not None else None
    except Exception:  # a tokenizer that cannot list its vocabulary
        vocab = None
    if not vocab:
        return DEFAULT_MAX_CHARS_PER_TOKEN
    return max(1, max(len(token) for token in vocab))
