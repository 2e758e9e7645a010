"""The OpenAI features the sampler gives, on the real model (SmolLM2-135M-Instruct, float32) through
the `openai` client: logprobs on chat and completions, unary and streamed, checked against
transformers' own log-softmax; penalties, logit_bias and min_tokens; /tokenize and /detokenize.

The server is the ingress's OpenAIFrontend over one LLMServer in this process (its engine in its
own process, as served), reached over ASGI: no Ray, so the module costs one model load.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

pytestmark = pytest.mark.integration

MODEL = "smollm2"
QUESTION = [{"role": "user", "content": "Name three primary colours."}]


@pytest.fixture(scope="module")
def served(smollm2_dir):
    from transformers import AutoTokenizer

    from deployments.frontend import OpenAIFrontend
    from deployments.llm_server import LLMServer
    from deployments.local_backend import LocalBackend

    server = LLMServer(smollm2_dir, {"dtype": "float32", "num_threads": 2, "max_num_seqs": 8},
                       served_model_name=MODEL)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    frontend = OpenAIFrontend(LocalBackend(server), lambda: tokenizer)
    try:
        yield frontend, tokenizer
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def run(served, test):
    """`test(openai_client, http_client)` against the server, on a fresh event loop."""
    import openai

    frontend, _ = served

    async def main():
        transport = httpx.ASGITransport(app=frontend.asgi_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)
            return await test(client, http)
    return asyncio.run(main())


def reference_logprobs(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax over the vocabulary at each output position (float32)."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt_ids + output_ids])).logits[0, len(prompt_ids) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_chat_logprobs_match_transformers_unary_and_streamed(served, hf_model):
    _, tokenizer = served

    async def test(client, http):
        unary = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
                                                     logprobs=True, top_logprobs=3)
        stream = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
                                                      logprobs=True, top_logprobs=3, stream=True)
        streamed = [item async for chunk in stream for choice in chunk.choices if choice.logprobs
                    for item in choice.logprobs.content]
        prompt = (await http.post("/tokenize", json={"messages": QUESTION})).json()["tokens"]
        return unary, streamed, prompt

    unary, streamed, prompt = run(served, test)
    content = unary.choices[0].logprobs.content
    assert len(content) == unary.usage.completion_tokens == 12
    output_ids = tokenizer.convert_tokens_to_ids([tokenizer.convert_ids_to_tokens(
        tokenizer.encode(item.token, add_special_tokens=False))[0] for item in content])
    reference = reference_logprobs(hf_model, prompt, output_ids)
    for position, item in enumerate(content):
        expected = reference[position].topk(3)
        assert [t.token for t in item.top_logprobs] == [tokenizer.decode([i]) for i in expected.indices.tolist()]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(expected.values.tolist(), abs=1e-3)
        assert item.token == item.top_logprobs[0].token and item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
    assert "".join(item.token for item in content) == unary.choices[0].message.content
    assert [s.token for s in streamed] == [c.token for c in content]
    assert [s.logprob for s in streamed] == pytest.approx([c.logprob for c in content])


def test_completion_logprobs_and_offsets(served, hf_model):
    _, tokenizer = served
    prompt = "The capital of France is"

    async def test(client, http):
        unary = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2,
                                                 stream=True)
        tokens = [t async for chunk in stream for choice in chunk.choices if choice.logprobs
                  for t in choice.logprobs.tokens]
        return unary, tokens

    unary, streamed_tokens = run(served, test)
    logprobs = unary.choices[0].logprobs
    assert "".join(logprobs.tokens) == unary.choices[0].text and streamed_tokens == logprobs.tokens
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    prompt_ids = tokenizer.encode(prompt)
    output_ids = tokenizer.encode(unary.choices[0].text, add_special_tokens=False)
    reference = reference_logprobs(hf_model, prompt_ids, output_ids)
    for position, (token_logprob, top) in enumerate(zip(logprobs.token_logprobs, logprobs.top_logprobs)):
        assert token_logprob == pytest.approx(float(reference[position].max()), abs=1e-3)
        assert len(top) == 2 and max(top.values()) == pytest.approx(token_logprob)


def test_penalties_bias_and_min_tokens_steer_the_real_model(served):
    _, tokenizer = served
    chat_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    word = tokenizer.encode(" banana", add_special_tokens=False)[0]

    async def test(client, http):
        question = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]  # "No.", then EOS
        base = {"model": MODEL, "messages": question, "temperature": 0}
        short = await client.chat.completions.create(**base, max_tokens=40)
        held = await client.chat.completions.create(**base, max_tokens=40, extra_body={"min_tokens": 30})
        biased = await client.completions.create(model=MODEL, prompt="I like", max_tokens=4, temperature=0,
                                                 logit_bias={str(word): 100})
        repeat = {"model": MODEL, "prompt": "one one one one one one", "max_tokens": 24, "temperature": 0}
        plain = await client.completions.create(**repeat)
        penalised = await client.completions.create(**repeat, frequency_penalty=2.0, presence_penalty=1.0,
                                                    extra_body={"repetition_penalty": 1.5})
        return short, held, biased, plain, penalised

    short, held, biased, plain, penalised = run(served, test)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 10
    assert held.usage.completion_tokens >= 30  # EOS could not end it before min_tokens
    assert biased.choices[0].text == " banana" * 4
    plain_ids = tokenizer.encode(plain.choices[0].text, add_special_tokens=False)
    penalised_ids = tokenizer.encode(penalised.choices[0].text, add_special_tokens=False)
    assert len(set(penalised_ids)) > len(set(plain_ids)), (plain.choices[0].text, penalised.choices[0].text)
    assert chat_end != word


def test_bad_sampling_fields_are_refused_naming_the_field(served):
    cases = [({"prompt": "x", "logprobs": 21}, "logprobs"), ({"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
             ({"prompt": "x", "logit_bias": {"1": 500}}, "logit_bias"), ({"prompt": "x", "presence_penalty": -3},
                                                                       "presence_penalty"),
             ({"prompt": "x", "min_tokens": 9, "max_tokens": 2}, "min_tokens"),
             ({"messages": QUESTION, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
             ({"messages": QUESTION, "top_logprobs": 2}, "top_logprobs")]

    async def test(client, http):
        answers = []
        for body, _ in cases:
            r = await http.post("/v1/chat/completions" if "messages" in body else "/v1/completions", json=body)
            answers.append((r.status_code, r.json()["error"]["param"], r.json()["error"]["message"]))
        return answers

    for (body, param), (status, refused, message) in zip(cases, run(served, test)):
        assert (status, refused) == (400, param) and param in message, (body, message)


def test_tokenize_and_detokenize_round_trip_with_the_chat_template(served):
    _, tokenizer = served

    async def test(client, http):
        chat = (await http.post("/tokenize", json={"messages": QUESTION, "return_token_strs": True})).json()
        text = (await http.post("/tokenize", json={"prompt": "Hello there"})).json()
        back = (await http.post("/detokenize", json={"tokens": chat["tokens"]})).json()
        return chat, text, back

    chat, text, back = run(served, test)
    rendered = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert chat["count"] == len(chat["tokens"]) and chat["max_model_len"] == 8192
    assert chat["token_strs"] == tokenizer.convert_ids_to_tokens(chat["tokens"])
    assert text["tokens"] == tokenizer.encode("Hello there") and back["prompt"] == rendered


def test_echo_with_logprobs_gives_the_prompts_logprobs_as_transformers_does(served, hf_model):
    """What lm-evaluation-harness sends for a log-likelihood: token ids, echo, logprobs 1, max_tokens 1."""
    _, tokenizer = served
    context = tokenizer.encode("Paris is the capital of")
    continuation = tokenizer.encode(" France", add_special_tokens=False)

    async def test(client, http):
        body = {"model": MODEL, "prompt": context + continuation, "max_tokens": 1, "temperature": 0, "logprobs": 1,
                "echo": True, "seed": 1234}
        return (await http.post("/v1/completions", json=body)).json()

    reply = run(served, test)
    logprobs = reply["choices"][0]["logprobs"]
    prompt = context + continuation
    assert len(logprobs["tokens"]) == len(prompt) + 1 and logprobs["token_logprobs"][0] is None
    reference = reference_logprobs(hf_model, prompt[:1], prompt[1:])
    expected = [float(reference[i, token]) for i, token in enumerate(prompt[1:])]
    assert logprobs["token_logprobs"][1:len(prompt)] == pytest.approx(expected, abs=1e-3)
    for position in range(1, len(prompt)):
        top = logprobs["top_logprobs"][position]
        assert max(top.values()) == pytest.approx(float(reference[position - 1].max()), abs=1e-3)
    assert reply["choices"][0]["text"].startswith(tokenizer.decode(prompt))


def test_n_choices_through_the_openai_client_streamed_and_unary(served):
    async def test(client, http):
        base = {"model": MODEL, "messages": QUESTION, "max_tokens": 10, "temperature": 0.9, "seed": 5, "n": 3}
        unary = await client.chat.completions.create(**base)
        stream = await client.chat.completions.create(**base, stream=True)
        pieces: dict[int, str] = {}
        async for chunk in stream:
            for choice in chunk.choices:
                pieces[choice.index] = pieces.get(choice.index, "") + (choice.delta.content or "")
        completions = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6,
                                                      temperature=0.9, seed=5, n=3)
        return unary, pieces, completions

    unary, pieces, completions = run(served, test)
    texts = {choice.index: choice.message.content for choice in unary.choices}
    assert sorted(texts) == [0, 1, 2] and pieces == texts  # seeded: the stream repeats the unary answer
    assert len(set(texts.values())) > 1 and 3 <= unary.usage.completion_tokens <= 30
    assert [c.index for c in completions.choices] == [0, 1, 2] and len({c.text for c in completions.choices}) > 1


# ---- structured output ---------------------------------------------------------------------------


def test_twenty_json_schemas_validate_unary_and_streamed(served):
    """Each answer parses and validates against its schema, or says why not (finish_reason length)."""
    import json

    import jsonschema

    from loadtest.benchmarks.json_schemas import SCHEMAS, prompt_for

    async def one(client, description, schema, stream):
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt_for(description)}],
                "max_tokens": 160, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
        if not stream:
            reply = await client.chat.completions.create(**body)
            return reply.choices[0].message.content, reply.choices[0].finish_reason
        text, finish = "", None
        async for chunk in await client.chat.completions.create(**body, stream=True):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return text, finish

    async def test(client, http):
        return await asyncio.gather(*(one(client, d, s, stream) for stream in (False, True) for d, s in SCHEMAS))

    answers = run(served, test)
    complete = 0
    for (text, finish), (_, schema) in zip(answers, SCHEMAS * 2):
        if finish == "length":
            continue
        assert finish == "stop", (finish, text)
        jsonschema.validate(json.loads(text), schema)
        complete += 1
    assert complete >= 30, answers  # of 40: the model finishes most objects within 160 tokens
    assert [a for a, _ in answers[:20]] == [a for a, _ in answers[20:]]  # greedy: streamed as unary


def test_json_object_regex_choice_and_grammar(served):
    import json
    import re

    async def test(client, http):
        base = {"model": MODEL, "temperature": 0, "max_tokens": 40}
        question = [{"role": "user", "content": "Return a JSON object with one key, \"ok\", set to true."}]
        obj = await client.chat.completions.create(**{**base, "max_tokens": 200}, messages=question,
                                                   response_format={"type": "json_object"})
        regex = await client.completions.create(**base, prompt="My phone number is",
                                                extra_body={"guided_regex": r" \d{3}-\d{4}"})
        choice = await client.chat.completions.create(**base, messages=QUESTION,
                                                      extra_body={"guided_choice": ["red", "yellow", "blue"]})
        grammar = await client.completions.create(**base, prompt="Answer:", extra_body={
            "structured_outputs": {"grammar": 'root ::= " " ("yes" | "no") "."'}})
        return obj, regex, choice, grammar

    obj, regex, choice, grammar = run(served, test)
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].message.content), dict)
    assert re.fullmatch(r" \d{3}-\d{4}", regex.choices[0].text), regex.choices[0].text
    assert choice.choices[0].message.content in ("red", "yellow", "blue")
    assert grammar.choices[0].text in (" yes.", " no.")


def test_bad_grammars_are_refused_before_any_engine(served):
    async def test(client, http):
        answers = []
        for body, param in [
            ({"prompt": "x", "guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "guided_json"),
            ({"prompt": "x", "guided_regex": "(unclosed"}, "guided_regex"),
            ({"prompt": "x", "guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
            ({"messages": QUESTION, "response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "minProperties": "two"}}}},
             "response_format.json_schema.schema"),
        ]:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = await http.post(path, json=body)
            answers.append((r.status_code, r.json()["error"]["param"], param, r.json()["error"]["message"]))
        return answers

    for status, refused, param, message in run(served, test):
        assert (status, refused) == (400, param), message
