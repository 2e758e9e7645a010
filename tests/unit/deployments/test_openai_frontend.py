"""The HTTP API end to end in one process: Starlette routes -> OpenAIService -> LLMServer -> a real
engine over the fake KV runner. Outputs are checked token for token against a solo reference."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deployments import frontend as frontend_module
from deployments.frontend import OpenAIFrontend
from deployments.llm_server import LLMServer
from deployments.local_backend import LocalBackend
from model_worker import AsyncLLMEngine, EngineConfig, LLMEngine
from tests.unit.fakes import ChatByteTokenizer, FakeKVRunner, reference_tokens, stats_once_aborted

VOCAB = 259  # byte ids 3..258: every sampled token decodes to one byte
TOKENIZER = ChatByteTokenizer()
MODEL = "fake-model"


def reference_text(prompt_ids: list[int], max_tokens: int) -> str:
    # The engine drops a partial UTF-8 character left at the very end of an output.
    return TOKENIZER.decode(reference_tokens(prompt_ids, max_tokens, VOCAB)).rstrip("\ufffd")


@pytest.fixture
def make_server():
    """LLMServers over real engines; at teardown every request is gone and every block is free."""
    servers: list[LLMServer] = []

    def build(num_kv_blocks: int = 256, max_model_len: int = 512, step_delay_s: float = 0.0,
              runner: FakeKVRunner | None = None, **admission) -> LLMServer:
        runner = runner or FakeKVRunner(num_kv_blocks, 4, max_model_len, VOCAB, step_delay_s=step_delay_s)
        engine = LLMEngine(EngineConfig(block_size=4), model_runner=runner, tokenizer=TOKENIZER)
        server = LLMServer(engine=AsyncLLMEngine(engine=engine), served_model_name=MODEL, admission=admission)
        servers.append(server)
        return server

    yield build
    for server in servers:
        server.shutdown()
        scheduler = server.engine.engine.scheduler
        if server.engine._error is None:
            assert not scheduler.requests, "request left behind"
            assert scheduler.kv.num_free_blocks == scheduler.config.num_kv_blocks, "a KV block was not returned"


def client_for(server: LLMServer, **frontend_kwargs) -> tuple[OpenAIFrontend, httpx.AsyncClient]:
    frontend = OpenAIFrontend(LocalBackend(server), lambda: TOKENIZER, **frontend_kwargs)
    transport = httpx.ASGITransport(app=frontend.asgi_app())
    return frontend, httpx.AsyncClient(transport=transport, base_url="http://test")


def sse_events(text: str) -> list:
    lines = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-1:]
    return [json.loads(line) for line in lines[:-1]]


def run(coro):
    return asyncio.run(coro)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the one sample `name` with exactly these labels, as Prometheus reads /metrics."""
    values = [s.value for family in text_string_to_metric_families(text) for s in family.samples
              if s.name == name and s.labels == labels]
    assert len(values) == 1, (name, labels, values)
    return values[0]


def test_completion_matches_the_reference_tokens(make_server):
    async def main():
        _, client = client_for(make_server())
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 7, "temperature": 0, "ignore_eos": True}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["object"] == "text_completion" and data["model"] == MODEL
        assert data["choices"][0]["text"] == reference_text(TOKENIZER.encode("hello"), 7)
        assert data["choices"][0]["finish_reason"] == "length"
        assert data["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
    run(main())


def test_stream_concatenates_to_the_unary_text_with_usage_last(make_server):
    async def main():
        _, client = client_for(make_server())
        body = {"prompt": "abc", "max_tokens": 9, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        assert text == reference_text(TOKENIZER.encode("abc"), 9)
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 9
        assert all(e["usage"] is None for e in events[:-1])
    run(main())


def test_several_prompts_each_get_their_own_choice(make_server):
    prompts = ["one", "second prompt", "3"]

    async def main():
        _, client = client_for(make_server())
        base = {"prompt": prompts, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        unary = (await client.post("/v1/completions", json=base)).json()
        streamed = sse_events((await client.post("/v1/completions", json={**base, "stream": True})).text)
        for index, prompt in enumerate(prompts):
            expected = reference_text(TOKENIZER.encode(prompt), 5)
            assert unary["choices"][index]["index"] == index and unary["choices"][index]["text"] == expected
            assert "".join(e["choices"][0]["text"] for e in streamed if e["choices"][0]["index"] == index) == expected
        assert unary["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
        assert unary["usage"]["completion_tokens"] == 15
    run(main())


def test_chat_applies_the_template_and_streams_the_role_first(make_server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    prompt_ids = TOKENIZER.encode("<system>be brief\n<user>hi\n<assistant>")

    async def main():
        _, client = client_for(make_server())
        body = {"messages": messages, "max_completion_tokens": 6, "temperature": 0, "ignore_eos": True}
        data = (await client.post("/v1/chat/completions", json=body)).json()
        assert data["object"] == "chat.completion"
        assert data["choices"][0]["message"] == {"role": "assistant", "content": reference_text(prompt_ids, 6)}
        assert data["usage"]["prompt_tokens"] == len(prompt_ids)
        events = sse_events((await client.post("/v1/chat/completions", json={**body, "stream": True})).text)
        assert events[0]["object"] == "chat.completion.chunk"
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:]) == reference_text(prompt_ids, 6)
    run(main())


@pytest.mark.parametrize("path,body,status,param,code", [
    ("/v1/completions", {"prompt": "x" * 500, "max_tokens": 100}, 400, "prompt", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 600}]}, 400, "messages",
     "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "model": "other"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": [1, 2, 999]}, 400, "prompt", "invalid_token_id"),
    ("/v1/completions", {"prompt": "x", "n": 33}, 400, "n", None),
    ("/v1/completions", {"prompt": ["x"] * 100, "n": 3}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "x", "priority": "urgent"}, 400, "priority", None),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages", None),
    ("/v1/completions", [1, 2], 400, None, None),
])
def test_invalid_requests_get_openai_errors_and_leave_nothing_behind(make_server, path, body, status, param, code):
    async def main():
        server = make_server()
        _, client = client_for(server)
        r = await client.post(path, json=body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert (error["param"], error["code"]) == (param, code) and error["message"]
        stats = await server.engine.stats()
        assert stats.num_waiting == stats.num_running == 0
        ok = await client.post("/v1/completions", json={"prompt": "still fine", "max_tokens": 2})
        assert ok.status_code == 200  # the server kept serving
    run(main())


@pytest.mark.parametrize("bad_prompt, max_tokens, code", [([3] * 510, 8, "context_length_exceeded"),
                                                         ([3, 4, 999], 8, "invalid_token_id")])
def test_several_prompts_are_refused_whole_with_the_engines_own_message(make_server, bad_prompt, max_tokens, code):
    """The ingress refuses before sending any prompt, through the engine door's own checks: the
    client reads the message a handle caller sending that prompt to the replica reads."""
    from contracts.serving import GenerateRequest
    from deployments.errors import APIError
    from model_worker import SamplingParams

    async def main():
        server = make_server()
        _, client = client_for(server)
        r = await client.post("/v1/completions", json={"prompt": [[5, 6, 7], bad_prompt], "max_tokens": max_tokens})
        stats = await server.engine.stats()
        with pytest.raises(APIError) as at_the_replica:
            await server.generate(GenerateRequest(bad_prompt, SamplingParams(max_tokens=max_tokens)))
        return r, stats, at_the_replica.value

    r, stats, at_the_replica = run(main())
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("prompt", code)
    assert error["message"] == at_the_replica.message and at_the_replica.code == code
    assert stats.prompt_tokens_total == 0, "no prompt was sent"


def test_malformed_http_gets_json_errors(make_server, monkeypatch):
    monkeypatch.setattr(frontend_module, "MAX_BODY_BYTES", 64)

    async def main():
        _, client = client_for(make_server())
        cases = [
            (await client.post("/v1/completions", content=b"{nope"), 400, None),
            (await client.post("/v1/completions", content=b"\xff\xfe"), 400, None),
            (await client.post("/v1/completions", content=b'{"prompt": "' + b"x" * 100 + b'"}'), 413,
             "request_too_large"),
            (await client.get("/v1/completions"), 405, "method_not_allowed"),
            (await client.get("/v2/anything"), 404, "not_found"),
        ]
        for response, status, code in cases:
            assert response.status_code == status, response.text
            assert response.json()["error"]["code"] == code
    run(main())


def test_api_key_guards_every_endpoint_but_health(make_server):
    async def main():
        _, client = client_for(make_server(), api_key="s3cret")
        for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("GET", "/v1/models"), ("GET", "/metrics")]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = await client.request(method, path, json={"prompt": "x"}, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
        assert (await client.get("/health")).status_code == 200
        good = {"Authorization": "Bearer s3cret"}
        assert (await client.get("/v1/models", headers=good)).json()["data"][0]["id"] == MODEL
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=good)
        assert r.status_code == 200
    run(main())


def test_overload_sheds_batch_first_with_retry_after(make_server):
    async def main():
        server = make_server(max_waiting_requests=2, batch_shed_fraction=0.5, retry_after_s=2.5)
        _, client = client_for(server)
        from contracts.serving import GenerateRequest
        held = server.generate_stream(GenerateRequest(TOKENIZER.encode("hold")))
        await held.__anext__()  # admitted, and not yet past its first token: one request waiting
        batch = await client.post("/v1/completions", json={"prompt": "x", "priority": "batch"})
        assert batch.status_code == 429 and batch.headers["retry-after"] == "3"
        assert batch.json()["error"]["code"] == "overloaded"
        interactive = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert interactive.status_code == 200
        await held.aclose()
        metrics = (await client.get("/metrics")).text
        assert metric(metrics, "iterserve_requests_shed_total", model_name=MODEL, replica=server.replica_id,
                      priority="batch") == 1
        assert metric(metrics, "iterserve_http_responses_total", ingress="ingress", endpoint="/v1/completions",
                      status="429") == 1
    run(main())


def test_not_ready_answers_503_with_retry_after(make_server):
    class SlowBackend(LocalBackend):
        async def model_info(self):
            await asyncio.sleep(3600)

        async def health(self):
            return False, {"replicas": {"STARTING": 1}, "ready_replicas": 0}

    async def main():
        frontend = OpenAIFrontend(SlowBackend(make_server()), lambda: TOKENIZER, model_info_timeout_s=0.05)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=frontend.asgi_app()),
                                     base_url="http://test") as client:
            r = await client.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 503 and r.headers["retry-after"] == "5"
            assert r.json()["error"]["code"] == "not_ready"
            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["replicas"] == {"STARTING": 1}
    run(main())


def test_leaving_a_stream_aborts_every_request_and_frees_blocks(make_server):
    async def main():
        server = make_server(step_delay_s=0.002)
        frontend, _ = client_for(server)
        body = {"prompt": ["long one", "long two"], "max_tokens": 400, "ignore_eos": True}
        stream = frontend.completions_stream(body)
        seen = [await stream.__anext__() for _ in range(3)]
        assert all(chunk["choices"] for chunk in seen)
        await stream.aclose()
        stats = await stats_once_aborted(server.engine)
        assert stats.requests_finished["abort"] == 2
        assert stats.num_free_kv_blocks == stats.num_total_kv_blocks
    run(main())


def test_a_stream_never_iterated_is_still_cancelled(make_server):
    async def main():
        server = make_server(step_delay_s=0.002)
        service = await OpenAIFrontend(LocalBackend(server), lambda: TOKENIZER).service()
        events = await service.create("completion", {"prompt": "abc", "max_tokens": 400, "stream": True})
        await events.aclose()
        stats = await stats_once_aborted(server.engine)
        assert stats.requests_finished["abort"] == 1 and stats.num_running == 0
    run(main())


def test_an_engine_failure_mid_stream_ends_the_stream_with_an_error_event(make_server):
    class FailingRunner(FakeKVRunner):
        def execute(self, batch):
            if len(self.batches) == 3:
                raise RuntimeError("device lost")
            return super().execute(batch)

    async def main():
        server = make_server(runner=FailingRunner(64, 4, 512, VOCAB))
        _, client = client_for(server)
        r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 50, "stream": True})
        assert r.status_code == 200
        events = sse_events(r.text)
        assert events[-1]["error"]["code"] == "not_ready" and "device lost" in events[-1]["error"]["message"]
        assert (await client.get("/health")).status_code == 503
        after = await client.post("/v1/completions", json={"prompt": "abc"})
        assert after.status_code == 503
    run(main())


def test_metrics_count_what_was_served(make_server):
    async def main():
        server = make_server()
        _, client = client_for(server)
        for _ in range(3):
            await client.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 4, "ignore_eos": True})
        await client.post("/v1/completions", json={"prompt": "abcd", "n": 0})
        text = (await client.get("/metrics")).text
        replica = {"model_name": MODEL, "replica": server.replica_id}
        assert metric(text, "iterserve_time_to_first_token_seconds_count", **replica) == 3
        assert metric(text, "iterserve_inter_token_latency_seconds_count", **replica) == 9
        assert metric(text, "iterserve_generation_tokens_total", **replica) == 12
        assert metric(text, "iterserve_prompt_tokens_total", **replica) == 12
        assert metric(text, "iterserve_request_success_total", **replica, finished_reason="length") == 3
        assert metric(text, "iterserve_replicas", model_name=MODEL, state="RUNNING") == 1
        responses = {"ingress": "ingress", "endpoint": "/v1/completions"}
        assert metric(text, "iterserve_http_responses_total", **responses, status="200") == 3
        assert metric(text, "iterserve_http_responses_total", **responses, status="400") == 1
    run(main())


def test_random_bodies_never_crash_or_hang_the_server(make_server):
    """Seeded fuzz: odd values in random fields get 200, 400 or 404, and the server keeps serving."""
    import random

    odd = [10**9, -1, 0, 2**63 - 1, 2**64, 1e308, float("nan"), "", "x", None, [], {}, [1], True, 0.5, [None],
           {"a": 1}, "\u00e9" * 50, [[1, 2], [3]], [{"role": "user"}]]
    fields = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
              "stream_options", "priority", "stop_token_ids", "ignore_eos", "messages", "model", "user", "logprobs",
              "max_completion_tokens", "top_logprobs", "echo", "logit_bias", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "min_tokens", "response_format", "guided_json", "guided_regex", "guided_choice",
              "guided_grammar", "structured_outputs"]
    rng = random.Random(0)

    async def main():
        server = make_server()
        _, client = client_for(server)
        statuses = set()
        for _ in range(300):
            body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            for name in rng.sample(fields, rng.randint(1, 3)):
                body[name] = rng.choice(odd)
            path = rng.choice(["/v1/completions", "/v1/chat/completions"])
            r = await asyncio.wait_for(client.post(path, content=json.dumps(body).encode()), 30)
            statuses.add(r.status_code)
            if r.status_code != 200:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert statuses <= {200, 400, 404} and {200, 400} <= statuses, statuses
        assert server.engine.is_running
        assert (await client.post("/v1/completions", json={"prompt": "alive", "max_tokens": 2})).status_code == 200
    run(main())


# ---- logprobs, penalties, /tokenize (the fake runner lists the drawn token first, logprob -0.5) -------


def test_completion_logprobs_unary_and_streamed_with_text_offsets(make_server):
    async def main():
        _, client = client_for(make_server())
        body = {"prompt": "abc", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 2}
        unary = (await client.post("/v1/completions", json=body)).json()["choices"][0]
        logprobs = unary["logprobs"]
        token_ids = reference_tokens(TOKENIZER.encode("abc"), 6, VOCAB)
        # Each token's own text: a byte of a longer UTF-8 character alone decodes to U+FFFD.
        assert logprobs["tokens"] == [TOKENIZER.decode([t]) for t in token_ids]
        assert unary["text"] == reference_text(TOKENIZER.encode("abc"), 6)
        assert logprobs["token_logprobs"] == [-0.5] * 6
        assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:i])) for i in range(6)]
        for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"]):
            assert 1 <= len(top) <= 2 and top[token] == -0.5
        events = sse_events((await client.post("/v1/completions", json={**body, "stream": True})).text)
        streamed = [e["choices"][0]["logprobs"] for e in events if e["choices"] and e["choices"][0]["logprobs"]]
        assert [t for lp in streamed for t in lp["tokens"]] == logprobs["tokens"]
        assert [o for lp in streamed for o in lp["text_offset"]] == logprobs["text_offset"]
        plain = (await client.post("/v1/completions", json={**body, "logprobs": None})).json()["choices"][0]
        assert plain["logprobs"] is None and plain["text"] == unary["text"]
    run(main())


def test_chat_logprobs_unary_and_streamed(make_server):
    async def main():
        _, client = client_for(make_server())
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
                "ignore_eos": True, "logprobs": True, "top_logprobs": 3}
        choice = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
        content = choice["logprobs"]["content"]
        assert len(content) == 5 and choice["message"]["content"]
        for c in content:
            assert c["logprob"] == -0.5 and bytes(c["bytes"]).decode() == c["token"]
            assert [t["logprob"] for t in c["top_logprobs"]] == [-0.5, -1.5, -2.5]
            assert c["top_logprobs"][0]["token"] == c["token"]
        events = sse_events((await client.post("/v1/chat/completions", json={**body, "stream": True})).text)
        streamed = [c for e in events for ch in e["choices"] if ch["logprobs"] for c in ch["logprobs"]["content"]]
        assert streamed == content
        without = (await client.post("/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": 0}))
        assert without.json()["choices"][0]["logprobs"] is None
    run(main())


def test_logit_bias_and_min_tokens_reach_the_engine(make_server):
    async def main():
        server = make_server()
        _, client = client_for(server)
        body = {"prompt": "abc", "max_tokens": 4, "min_tokens": 2, "presence_penalty": 0.5,
                "logit_bias": {"7": 1.5}, "repetition_penalty": 1.2}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        params = server.engine.engine.runner.batches[-1].sequences[0].sampling_params
        assert (params.min_tokens, params.presence_penalty, params.logit_bias, params.repetition_penalty) == \
            (2, 0.5, {7: 1.5}, 1.2)
        assert server.engine.engine.runner.batches[-1].sequences[0].history is not None
        r = await client.post("/v1/completions", json={**body, "logit_bias": {str(VOCAB): 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
        assert "outside the vocabulary" in r.json()["error"]["message"]
    run(main())


def test_tokenize_and_detokenize(make_server):
    async def main():
        _, client = client_for(make_server())
        r = await client.post("/tokenize", json={"prompt": "héllo", "return_token_strs": True})
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["tokens"] == TOKENIZER.encode("héllo") and data["count"] == 6 and data["max_model_len"] == 512
        assert "".join(data["token_strs"]).startswith("h")
        chat = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})).json()
        assert chat["tokens"] == TOKENIZER.encode("<user>hi\n<assistant>") and chat["token_strs"] is None
        back = await client.post("/detokenize", json={"tokens": data["tokens"]})
        assert back.status_code == 200 and back.json() == {"prompt": "héllo"}
        for path, bad, param in [("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 5}, "prompt"),
                                 ("/tokenize", {"messages": []}, "messages"),
                                 ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
                                 ("/detokenize", {"tokens": [VOCAB]}, "tokens"),
                                 ("/detokenize", {"tokens": [-1]}, "tokens"), ("/detokenize", {"tokens": "1"}, "tokens"),
                                 ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                                                "continue_final_message": True}, "continue_final_message")]:
            r = await client.post(path, json=bad)
            assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (path, bad, r.text)
    run(main())


def test_echo_puts_the_prompt_and_its_logprobs_first_unary_and_streamed(make_server):
    async def main():
        _, client = client_for(make_server())
        body = {"prompt": "abc", "max_tokens": 2, "temperature": 0, "ignore_eos": True, "echo": True, "logprobs": 1}
        unary = (await client.post("/v1/completions", json=body)).json()
        choice = unary["choices"][0]
        assert choice["text"].startswith("abc") and unary["usage"]["completion_tokens"] == 2
        logprobs = choice["logprobs"]
        assert logprobs["tokens"][:3] == ["a", "b", "c"] and len(logprobs["tokens"]) == 5
        assert logprobs["token_logprobs"][:3] == [None, -0.25, -0.25] and logprobs["top_logprobs"][0] is None
        assert logprobs["top_logprobs"][1] == {"b": -0.25} and logprobs["token_logprobs"][3:] == [-0.5, -0.5]
        assert logprobs["text_offset"][:4] == [0, 1, 2, 3]
        events = sse_events((await client.post("/v1/completions", json={**body, "stream": True})).text)
        streamed = [e["choices"][0] for e in events if e["choices"]]
        assert "".join(c["text"] for c in streamed) == choice["text"]
        assert [t for c in streamed if c["logprobs"] for t in c["logprobs"]["tokens"]] == logprobs["tokens"]
        plain = (await client.post("/v1/completions", json={**body, "logprobs": None})).json()["choices"][0]
        assert plain["text"] == choice["text"] and plain["logprobs"] is None
        ids = (await client.post("/v1/completions", json={**body, "prompt": [100, 101]})).json()["choices"][0]
        assert ids["text"].startswith(TOKENIZER.decode([100, 101])) and ids["logprobs"]["token_logprobs"][0] is None
    run(main())


def test_n_choices_each_indexed_with_its_own_seed_unary_and_streamed(make_server):
    async def main():
        server = make_server()
        _, client = client_for(server)
        body = {"prompt": ["ab", "cd"], "max_tokens": 3, "n": 3, "seed": 11, "ignore_eos": True,
                "stream_options": None}
        unary = (await client.post("/v1/completions", json=body)).json()
        assert [c["index"] for c in unary["choices"]] == list(range(6))
        assert unary["usage"]["completion_tokens"] == 18 and unary["usage"]["prompt_tokens"] == 12
        seeds = {seq.request_id: seq.sampling_params.seed for batch in server.engine.engine.runner.batches
                 for seq in batch.sequences}
        assert len(set(seeds.values())) == 3 and len(seeds) == 6  # choice j of either prompt: the same seed
        assert sorted(seeds.items())[0][1] == 11  # the first choice keeps the request's seed
        events = sse_events((await client.post("/v1/completions", json={**body, "stream": True})).text)
        streamed: dict[int, str] = {}
        for event in events:
            for choice in event["choices"]:
                streamed[choice["index"]] = streamed.get(choice["index"], "") + choice["text"]
        assert streamed == {c["index"]: c["text"] for c in unary["choices"]}
        chat = (await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                 "n": 2, "max_tokens": 2})).json()
        assert [c["index"] for c in chat["choices"]] == [0, 1]
    run(main())


def test_structured_output_with_a_tokenizer_it_cannot_read_is_a_clear_400(make_server):
    """The fake byte tokenizer cannot list its vocabulary: a grammar is refused naming its field,
    not a 500 (the fuzz test found the 500)."""
    async def main():
        _, client = client_for(make_server())
        r = await client.post("/v1/completions", json={"prompt": "x", "guided_regex": "[a-z]+"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"
        assert "not available for this model" in r.json()["error"]["message"]
    run(main())
