"""The Serve application on a real local Ray with the default model, over real HTTP on 127.0.0.1.

One application (two LLMServer replicas, an API key, a small admission limit) serves every test in
this module; the not-ready test adds a second one whose replica can never be placed.
"""

from __future__ import annotations

import asyncio
import os
import time
from types import SimpleNamespace

import httpx
import pytest

from loadtest.local_serve import proxy_url, start_local_serve, stop_local_serve

pytestmark = pytest.mark.integration

KEY = "integration-key"
MODEL = "iterserve-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Per replica: 16 waiting requests for interactive traffic, 2 for batch (batch is shed first).
ADMISSION = {"max_waiting_requests": 16, "batch_shed_fraction": 0.125, "retry_after_s": 2.0}
# The ingress sheds batch by predicted wait (tests/unit/autoscaler/test_admission.py,
# tests/unit/deployments/test_ingress_admission.py): off here, so that the replicas' backstop above
# is what these tests see. With it on, a burst that raises the recent TTFT past 0.5 s sheds the
# batch requests of the next test at the ingress, before any reaches a replica (docs/benchmarks.md,
# 'Autoscaling and admission: step load and overload').
INGRESS_ADMISSION = {"batch_max_wait_s": 1e9}


@pytest.fixture(scope="module")
def app(tiny_model_dir):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    from ray import serve

    from deployments.app import build_app

    base = start_local_serve(num_cpus=2)
    args = {"model": tiny_model_dir, "served_model_name": MODEL, "num_replicas": 2, "api_key": KEY,
            "engine_args": {"num_threads": 1, "max_num_seqs": 32, "dtype": "float32"}, "admission": ADMISSION,
            "ingress_admission": INGRESS_ADMISSION}
    serve.run(build_app(args), name="iterserve", route_prefix="/")
    try:
        yield SimpleNamespace(base=base, serve=serve, build_app=build_app,
                              model_dir=tiny_model_dir)
    finally:
        stop_local_serve()


@pytest.fixture
def client(app):
    with httpx.Client(base_url=app.base, headers=AUTH, timeout=120) as c:
        yield c


def openai_client(app):
    import openai
    return openai.OpenAI(base_url=f"{app.base}/v1", api_key=KEY, max_retries=0, timeout=120)


def metric_samples(text: str, name: str) -> dict[str, float]:
    """{label text: value} of one metric's series."""
    samples = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, _, value = line.rpartition(" ")
            samples[labels[len(name):]] = float(value)
    return samples


def test_openai_client_completions_and_chat_stream_and_not(app):
    oai = openai_client(app)
    greedy = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    unary = oai.completions.create(model=MODEL, prompt="Continuous batching", **greedy)
    assert unary.choices[0].finish_reason == "length" and unary.usage.completion_tokens == 12
    stream = oai.completions.create(model=MODEL, prompt="Continuous batching", stream=True,
                                    stream_options={"include_usage": True}, **greedy)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == unary.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == unary.usage.prompt_tokens

    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is a KV cache?"}]
    chat = oai.chat.completions.create(model=MODEL, messages=messages, **greedy)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 12
    deltas = [c.choices[0].delta for c in oai.chat.completions.create(model=MODEL, messages=messages,
                                                                       stream=True, **greedy)]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == chat.choices[0].message.content
    assert [m.id for m in oai.models.list().data] == [MODEL]


def test_every_error_class_over_http(app, client):
    import openai

    with pytest.raises(openai.NotFoundError) as not_found:
        openai_client(app).completions.create(model="gpt-unknown", prompt="x", max_tokens=1)
    assert not_found.value.code == "model_not_found"
    cases = [
        (client.post("/v1/completions", content=b"{"), 400, None),
        (client.post("/v1/completions", json={"prompt": list(range(3, 2043)), "max_tokens": 100}), 400,
         "context_length_exceeded"),
        (client.post("/v1/completions", json={"prompt": "x", "n": 33}), 400, None),
        (client.post("/v1/chat/completions", json={"messages": "hello"}), 400, None),
        (client.post("/v1/completions", json={"prompt": "x", "model": "nope"}), 404, "model_not_found"),
        (client.get("/v1/nothing"), 404, "not_found"),
    ]
    for response, status, code in cases:
        assert response.status_code == status, response.text
        assert response.json()["error"]["code"] == code and response.json()["error"]["message"]
    # Extreme but valid values are served by the real sampler, not crashed on.
    for extreme in ({"top_k": 10**9}, {"seed": 2**63 - 1}, {"temperature": 100}, {"top_p": 1e-9},
                    {"stop_token_ids": [10**12]}):
        response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, **extreme})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1, extreme


def test_api_key_is_required_everywhere_but_health(app):
    with httpx.Client(base_url=app.base, timeout=60) as anonymous:
        assert anonymous.post("/v1/completions", json={"prompt": "x"}).status_code == 401
        wrong = anonymous.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert anonymous.get("/metrics").status_code == 401
        assert anonymous.get("/health").status_code == 200


def test_two_replicas_both_serve(app, client):
    async def burst():
        async with httpx.AsyncClient(base_url=app.base, headers=AUTH, timeout=120) as c:
            bodies = [{"prompt": f"Request {i}: short requests never wait", "max_tokens": 8} for i in range(24)]
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for body in bodies))

    assert all(r.status_code == 200 for r in asyncio.run(burst()))
    metrics = client.get("/metrics").text
    tokens = metric_samples(metrics, "iterserve_generation_tokens_total")
    assert len(tokens) == 2 and all(v > 0 for v in tokens.values()), tokens
    assert metric_samples(metrics, "iterserve_replicas") == {f'{{model_name="{MODEL}",state="RUNNING"}}': 2.0}
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["ready_replicas"] == 2


def test_the_replicas_on_the_ingress_node_stream_over_the_token_channel(app, client):
    """Both replicas share the ingress's node: every chunk after admission comes over the token
    channel (deployments/token_channel.py), and the ingress counts them."""
    def channel_chunks() -> float:
        return sum(metric_samples(client.get("/metrics").text, "iterserve_ingress_token_channel_chunks_total").values())

    before = channel_chunks()
    body = {"prompt": "Stream me", "max_tokens": 6, "stream": True, "ignore_eos": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200 and "[DONE]" in response.read().decode()
    metrics = client.get("/metrics").text
    assert channel_chunks() > before
    assert sum(metric_samples(metrics, "iterserve_ingress_token_channel_refused_total").values()) == 0
    assert sum(metric_samples(metrics, "iterserve_ingress_token_channel_open_attempts").values()) == 0


def test_batch_traffic_is_shed_with_429_under_overload(app):
    """Batch requests past the replica's batch limit get 429 with Retry-After; the admitted ones are
    served. The queue is made, not raced for: an application of one replica with one seat, which a
    stream holds while the batch requests arrive. (A flood of long prompts on the module's two
    32-seat replicas built a queue only when the requests happened to arrive bunched; CI once saw
    24 of 24 served.)"""
    args = {"model": app.model_dir, "served_model_name": MODEL, "num_replicas": 1, "api_key": KEY,
            "engine_args": {"num_threads": 1, "max_num_seqs": 1, "dtype": "float32"}, "admission": ADMISSION,
            "ingress_admission": INGRESS_ADMISSION, "retry": {"max_attempts": 1}}  # no other replica to try
    app.serve.run(app.build_app(args), name="shed", route_prefix="/shed")
    llm = app.serve.get_deployment_handle("LLMServer", "shed")
    batch_limit = int(ADMISSION["max_waiting_requests"] * ADMISSION["batch_shed_fraction"])  # 2
    num_batch = batch_limit + 4

    def waiting_first_token() -> list[int]:
        return [load["num_waiting_first_token"] for load in llm.broadcast("record_autoscaling_stats").results(timeout_s=10)]

    async def flood():
        async with httpx.AsyncClient(base_url=f"{proxy_url()}/shed", headers=AUTH, timeout=120) as c:
            hold = {"prompt": "Hold the seat.", "max_tokens": 1900, "ignore_eos": True, "stream": True}
            async with c.stream("POST", "/v1/completions", json=hold) as holder:
                assert holder.status_code == 200
                lines = holder.aiter_lines()
                while not (await anext(lines)).startswith("data:"):  # the holder runs: the one seat is taken
                    pass
                body = {"prompt": "Summarise the report.", "max_tokens": 2, "priority": "batch"}
                posts = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(num_batch)]
                # The replica admits batch_limit of them to wait for the seat and refuses the rest at
                # once: those come back (in ~0.1 s here) long before the holder ends (~2.5 s).
                deadline = time.monotonic() + 60
                while sum(p.done() for p in posts) < num_batch - batch_limit:
                    assert time.monotonic() < deadline, [p.done() for p in posts]
                    await asyncio.sleep(0.05)
                loads = await asyncio.to_thread(waiting_first_token)
                assert loads == [batch_limit], (loads, "0: the holder ended before the refusals came back")
            # The holder hung up: its seat goes to the waiting batch requests.
            return await asyncio.gather(*posts)

    try:
        responses = asyncio.run(flood())
        statuses = [r.status_code for r in responses]
        assert sorted(statuses) == [200] * batch_limit + [429] * (num_batch - batch_limit), statuses
        shed = [r for r in responses if r.status_code == 429]
        assert all(r.headers["retry-after"] == "2" and r.json()["error"]["code"] == "overloaded" for r in shed)
        assert all(r.json()["usage"]["completion_tokens"] == 2 for r in responses if r.status_code == 200)
        with httpx.Client(base_url=f"{proxy_url()}/shed", headers=AUTH, timeout=30) as c:
            counted = metric_samples(c.get("/metrics").text, "iterserve_requests_shed_total")
        assert sum(v for labels, v in counted.items() if 'priority="batch"' in labels) >= len(shed)
        # Every admitted request left its replica's queue: no ticket outlives its request.
        assert waiting_first_token() == [0]
    finally:
        app.serve.delete("shed")


def test_client_disconnect_aborts_and_frees_blocks(app, client):
    aborted_before = _aborted(client)
    body = {"prompt": "A long answer follows.", "max_tokens": 1800, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=app.base, headers=AUTH, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert [next(lines) for _ in range(6)]  # tokens are flowing; now hang up
    llm = app.serve.get_deployment_handle("LLMServer", "iterserve")
    deadline = time.monotonic() + 30
    while True:
        stats = llm.broadcast("record_routing_stats").results(timeout_s=10)
        freed = all(s["num_free_kv_blocks"] == s["num_total_kv_blocks"] and s["num_running"] == 0 for s in stats)
        if freed and _aborted(client) > aborted_before:
            break
        assert time.monotonic() < deadline, (stats, _aborted(client), aborted_before)
        time.sleep(0.2)


def _aborted(client: httpx.Client) -> float:
    samples = metric_samples(client.get("/metrics").text, "iterserve_request_success_total")
    return sum(v for labels, v in samples.items() if 'finished_reason="abort"' in labels)


def test_handle_calls_from_a_separate_deployment(app, client):
    from deployments.handle_example import Assistant

    assistant = app.serve.run(Assistant.bind("iterserve"), name="handle_example", route_prefix=None)
    try:
        text = assistant.complete.remote("The scheduler", 10).result(timeout_s=120)
        over_http = client.post("/v1/completions", json={"prompt": "The scheduler", "max_tokens": 10,
                                                          "temperature": 0}).json()
        assert text == over_http["choices"][0]["text"]
        pieces = list(assistant.options(stream=True).stream_answer.remote("What is a KV cache?", 8))
        assert len(pieces) >= 1 and all(isinstance(p, str) for p in pieces)
        assert assistant.status_of.remote({"prompt": "x", "n": 33}).result(timeout_s=60) == 400
        # The iterserve handle straight from this driver, too.
        direct = app.serve.get_app_handle("iterserve")
        reply = direct.completions.remote({"prompt": "The scheduler", "max_tokens": 10, "temperature": 0})
        assert reply.result(timeout_s=120)["choices"][0]["text"] == text
    finally:
        app.serve.delete("handle_example")


def test_not_ready_answers_503_until_a_replica_exists(app):
    # A replica that asks for a resource no node has stays pending, as on a cluster short of GPUs.
    # Serve stops a replica that was never placed only after its graceful-shutdown timeout
    # (drain_timeout_s), so the test keeps that short or deleting the app outlasts serve.delete's 60 s.
    args = {"model": app.model_dir, "served_model_name": MODEL, "engine_args": {"num_threads": 1},
            "llm_server_actor_options": {"num_cpus": 0, "resources": {"iterserve_test_missing": 1}},
            "drain_timeout_s": 5}
    # serve.run would wait for the application to be running, which it never will be.
    app.serve._run(app.build_app(args), name="pending", route_prefix="/pending", _blocking=False)
    try:
        # Serve's proxy routes by prefix; with direct ingress each application has a port of its own.
        with httpx.Client(base_url=f"{proxy_url()}/pending", timeout=60) as c:
            deadline = time.monotonic() + 90
            while (health := c.get("/health")).status_code == 404:  # until the ingress is up
                assert time.monotonic() < deadline
                time.sleep(0.5)
            assert health.status_code == 503 and health.json().get("ready_replicas") == 0, health.text
            r = c.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
            assert int(r.headers["retry-after"]) >= 1
    finally:
        app.serve.delete("pending")


def test_iterserve_bench_against_the_real_server(app, tmp_path):
    """The load generator's SSE client and the bench CLI end to end, on the application above."""
    import json

    from iterserve.cli import main

    out = tmp_path / "bench"
    rc = main(["bench", "--url", app.base, "--api-key", KEY, "--tokenizer", app.model_dir, "--workload", "synthetic",
               "--num-requests", "8", "--rate", "4,inf", "--prompt-len", "fixed:40", "--output-len", "fixed:6",
               "--slo-ttft", "30", "--out", str(out)])
    assert rc == 0
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(lines) == 16 and all(r["status"] == 200 and r["error"] is None for r in lines)
    assert all(r["output_tokens"] == 6 and r["prompt_tokens"] == 40 for r in lines)
    assert all(r["sent_s"] < r["first_token_s"] <= r["finish_s"] for r in lines)
    summaries = json.loads((out / "summary.json").read_text())
    assert [s["rate"] for s in summaries] == [4.0, None] and all(s["goodput"] == 1.0 for s in summaries)
    report = (out / "report.md").read_text()
    assert "![" in report and (out / "latency_cdf.png").read_bytes()[:4] == b"\x89PNG"


def test_logprobs_n_echo_and_structured_output_cross_the_serving_path(app):
    """The new fields over Ray: chunks with logprobs through the token channel and Ray streams,
    prompt logprobs on a finished chunk, n choices routed and merged, a grammar compiled at the
    ingress and applied by a replica."""
    import json

    oai = openai_client(app)
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2, n=2,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1]
    assert all(len(c.logprobs.content) == 5 and len(c.logprobs.content[0].top_logprobs) == 2 for c in chat.choices)
    stream = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                         temperature=0, logprobs=True, stream=True, extra_body={"ignore_eos": True})
    streamed = [item.logprob for chunk in stream for choice in chunk.choices if choice.logprobs
                for item in choice.logprobs.content]
    assert streamed == pytest.approx([item.logprob for item in chat.choices[0].logprobs.content], abs=1e-4)
    echo = oai.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=1, temperature=0, logprobs=1, echo=True)
    assert echo.choices[0].logprobs.token_logprobs[0] is None and len(echo.choices[0].logprobs.tokens) == 4
    structured = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                             max_tokens=60, temperature=0,
                                             extra_body={"guided_choice": ["alpha", "beta"]})
    assert structured.choices[0].message.content in ("alpha", "beta")
    with httpx.Client(base_url=app.base, headers=AUTH, timeout=60) as c:
        bad = c.post("/v1/completions", json={"prompt": "x", "guided_regex": "(unclosed"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex"
        tokens = c.post("/tokenize", json={"prompt": "hello"}).json()
        assert c.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"].endswith("hello")
    json.dumps(chat.model_dump())  # the whole answer is JSON (no -inf slipped through)
