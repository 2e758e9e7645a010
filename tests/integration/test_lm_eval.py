"""lm-evaluation-harness against our server, as users run it: its `local-completions` model over
HTTP (token ids, echo, logprobs 1) on a log-likelihood task and a generate-until task whose data
this test writes (no hub), each finishing with a score; and the log-likelihood task again through
transformers (`hf`) on the same checkpoint, whose per-choice log-likelihoods ours must match
within 1e-3 in float32.

The server is the ingress's OpenAIFrontend over one LLMServer (its engine in its own process),
served by uvicorn on 127.0.0.1 in a thread of this process: no Ray.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time

import pytest

pytestmark = pytest.mark.integration

lm_eval = pytest.importorskip("lm_eval")

MODEL = "smollm2"
CHOICES = [  # (question, choices, index of the answer)
    ("The capital of France is", [" Paris", " Berlin", " Madrid"], 0),
    ("Water freezes at zero degrees", [" Celsius", " Kelvin"], 0),
    ("The opposite of hot is", [" cold", " loud", " green"], 0),
    ("Two plus two equals", [" four", " seven"], 0),
    ("The sun rises in the", [" east", " west"], 0),
    ("A baby cat is called a", [" kitten", " puppy", " calf"], 0),
]
QUESTIONS = [("Q: What is the capital of Italy?\nA:", "Rome"), ("Q: What colour is the sky?\nA:", "blue"),
             ("Q: How many legs does a spider have?\nA:", "eight")]


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    _write_task(root, "iterserve_choices", [{"question": q, "choices": c, "answer": a} for q, c, a in CHOICES], """
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
""")
    _write_task(root, "iterserve_questions", [{"question": q, "answer": a} for q, a in QUESTIONS], """
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: " {{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
""")
    return root


def _write_task(root, name: str, docs: list[dict], body: str) -> None:
    """A task YAML over a local JSON-lines file of `docs` (no hub), with `body` after its data lines."""
    data = root / f"{name}.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (root / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n"
                                       f"  data_files: {{test: {data}}}\ntest_split: test" + body)


@pytest.fixture(scope="module")
def server_url(smollm2_dir):
    import uvicorn
    from transformers import AutoTokenizer

    from deployments.frontend import OpenAIFrontend
    from deployments.llm_server import LLMServer
    from deployments.local_backend import LocalBackend

    llm = LLMServer(smollm2_dir, {"dtype": "float32", "num_threads": 2}, served_model_name=MODEL)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    frontend = OpenAIFrontend(LocalBackend(llm), lambda: tokenizer)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(frontend.asgi_app(), log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        llm.shutdown()


def evaluate(model: str, model_args: str, tasks_dir, tasks: list[str]) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return simple_evaluate(model=model, model_args=model_args, tasks=tasks, log_samples=True,
                           task_manager=TaskManager(include_path=str(tasks_dir)), batch_size=1,
                           random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def loglikelihoods(results: dict) -> list[list[float]]:
    """Per document, the log-likelihood of each choice, in the task's order."""
    samples = sorted(results["samples"]["iterserve_choices"], key=lambda s: s["doc_id"])
    return [[float(resp[0]) for resp in sample["filtered_resps"]] for sample in samples]


def test_lm_eval_scores_our_server_and_matches_transformers(server_url, smollm2_dir, tasks_dir):
    ours = evaluate("local-completions", f"model={MODEL},base_url={server_url}/v1/completions,"
                                         f"tokenizer_backend=huggingface,tokenizer={smollm2_dir},num_concurrent=1,"
                                         "max_retries=1,timeout=120",
                    tasks_dir, ["iterserve_choices", "iterserve_questions"])
    accuracy = ours["results"]["iterserve_choices"]["acc,none"]
    exact = ours["results"]["iterserve_questions"]["exact_match,none"]
    assert 0.5 <= accuracy <= 1.0 and 0.0 <= exact <= 1.0, ours["results"]
    generations = [s["filtered_resps"][0] for s in ours["samples"]["iterserve_questions"]]
    assert all(isinstance(g, str) for g in generations) and any(g.strip() for g in generations), generations

    reference = evaluate("hf", f"pretrained={smollm2_dir},dtype=float32,device=cpu", tasks_dir, ["iterserve_choices"])
    ours_ll, reference_ll = loglikelihoods(ours), loglikelihoods(reference)
    assert [len(row) for row in ours_ll] == [len(choices) for _, choices, _ in CHOICES]
    for mine, theirs in zip(ours_ll, reference_ll):
        assert mine == pytest.approx(theirs, abs=1e-3)
    assert reference["results"]["iterserve_choices"]["acc,none"] == accuracy
