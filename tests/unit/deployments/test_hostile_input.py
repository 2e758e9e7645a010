"""Hostile and careless input over the HTTP API in one process: each is refused with a clear 4xx,
or bounded, and never stalls another request or reaches the engine."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from autoscaler.admission import AdmissionPolicy
from contracts.priority import Priority
from contracts.serving import GenerateRequest, GenerationChunk
from deployments.errors import APIError
from deployments.frontend import OpenAIFrontend
from deployments.ingress_admission import IngressAdmission
from deployments.llm_server import LLMServer
from deployments.local_backend import LocalBackend
from model_worker import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from tests.unit.fakes import ChatByteTokenizer, FakeKVRunner

VOCAB = 259
MAX_MODEL_LEN = 512


class CountingTokenizer(ChatByteTokenizer):
    """Counts encodes; an encode of a long text waits for `release` (a slow tokenizer)."""

    def __init__(self) -> None:
        self.num_encodes = 0
        self.release = threading.Event()
        self.waited = False

    def encode(self, text, add_special_tokens=True):
        self.num_encodes += 1
        if len(text) > 4096:
            self.waited = self.release.wait(10)
        return super().encode(text)


@pytest.fixture
def served():
    tokenizer = CountingTokenizer()
    runner = FakeKVRunner(256, 4, MAX_MODEL_LEN, VOCAB)
    engine = LLMEngine(EngineConfig(block_size=4), model_runner=runner, tokenizer=tokenizer)
    server = LLMServer(engine=AsyncLLMEngine(engine=engine), served_model_name="m")
    frontend = OpenAIFrontend(LocalBackend(server), lambda: tokenizer, body_timeout_s=0.3)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=frontend.asgi_app()), base_url="http://t")
    yield client, tokenizer
    tokenizer.release.set()
    server.shutdown()


def run(coro):
    return asyncio.run(coro)


def error_of(response: httpx.Response) -> dict:
    return response.json()["error"]


@pytest.mark.parametrize("body", [
    b'{"prompt": "ab\\ud800cd", "max_tokens": 2}',
    b'{"prompt": ["fine", "\\udfff"], "max_tokens": 2}',
    b'{"prompt": "x", "stop": ["\\ud83d"], "max_tokens": 2}',
])
def test_lone_surrogates_are_a_400_not_a_500(served, body):
    client, _ = served
    r = run(client.post("/v1/completions", content=body, headers={"content-type": "application/json"}))
    assert r.status_code == 400, r.text
    assert error_of(r)["code"] == "invalid_text" and "surrogate" in error_of(r)["message"]


def test_lone_surrogates_in_chat_are_a_400(served):
    client, _ = served
    body = b'{"messages": [{"role": "user", "content": "hi \\udc00"}], "max_tokens": 2}'
    r = run(client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"}))
    assert r.status_code == 400 and error_of(r)["param"] == "messages[0].content"


def test_a_prompt_too_long_to_fit_is_refused_before_tokenizing(served):
    """A prompt too long to fit is refused by its length alone, before any tokenizing: tokenizing a
    10 MB prompt takes seconds."""
    client, tokenizer = served
    r = run(client.post("/v1/completions", json={"prompt": "x" * (MAX_MODEL_LEN * 64 + 1), "max_tokens": 1}))
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded"
    assert tokenizer.num_encodes == 0


def test_tokenizing_a_long_prompt_never_stalls_other_requests(served):
    """Tokenization runs off the event loop, so no request, GET /v1/models included, waits for one
    long prompt."""
    client, tokenizer = served

    async def main():
        long_one = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "y" * 8000, "max_tokens": 1}))
        await asyncio.sleep(0.05)
        models = await asyncio.wait_for(client.get("/v1/models"), 5)  # answered while the encode waits
        assert not long_one.done()
        tokenizer.release.set()
        return models, await long_one

    models, long_one = run(main())
    assert models.status_code == 200
    assert long_one.status_code == 400 and error_of(long_one)["code"] == "context_length_exceeded"  # 8000 > 512
    assert tokenizer.waited


def test_a_body_that_never_finishes_arriving_gets_408(served):
    client, _ = served

    async def trickle():
        yield b'{"prompt": "slow'
        await asyncio.sleep(5)
        yield b'"}'

    r = run(client.post("/v1/completions", content=trickle(), headers={"content-type": "application/json"}))
    assert r.status_code == 408 and error_of(r)["code"] == "request_timeout"


@pytest.mark.parametrize("extra", [{"stop": ["s"] * 400}, {"stop": "z" * 5000}, {"stop_token_ids": list(range(5000))}])
def test_huge_stop_lists_are_refused(served, extra):
    client, _ = served
    r = run(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **extra}))
    assert r.status_code == 400 and error_of(r)["param"] in ("stop", "stop_token_ids")
    assert len(r.text) < 1000


class NeverFirstToken:
    """A server whose requests are admitted and then wait forever for a first token."""

    def __init__(self) -> None:
        self.closed = 0

    async def generate_stream(self, request: GenerateRequest):
        try:
            yield GenerationChunk(request.request_id)
            await asyncio.Event().wait()
        finally:
            self.closed += 1


@pytest.mark.parametrize("priority,timeout_s", [("interactive", 0.3), ("batch", 0.15)])
def test_a_request_without_a_first_token_in_time_gets_503_and_is_dropped(priority, timeout_s):
    """A request admitted under overload that gets no first token within its queue timeout gets 503
    and is dropped, never left waiting with no response at all."""
    inner = NeverFirstToken()
    import time
    admission = IngressAdmission(AdmissionPolicy(queue_timeout_s=0.3, batch_queue_timeout_s=0.15), time.monotonic)
    backend = LocalBackend(inner, admission)
    request = GenerateRequest([1, 2], SamplingParams(max_tokens=2), priority=priority)

    async def main():
        started = time.monotonic()
        with pytest.raises(APIError) as info:
            await backend.generate(request)
        return info.value, time.monotonic() - started

    error, waited_s = run(main())
    assert error.status == 503 and error.code == "queue_timeout" and error.retry_after_s >= 1
    assert waited_s >= timeout_s * 0.9
    assert inner.closed == 1, "the replica's request was cancelled"
    stats = admission.stats()
    assert stats.num_timed_out[Priority.parse(priority)] == 1 and sum(stats.num_waiting.values()) == 0
