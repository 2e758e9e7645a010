"""A fuzzer of the HTTP API: random and mutated bodies, bad encodings, huge values, odd requests.

    python -m loadtest.faults.fuzz_http [--cases 5000] [--seed 0] [--schemathesis]

The script deploys the iterserve application (2 replicas) on a local Ray, or loads `--url`. Every
case must get a non-5xx answer, an error must be `{"error": {message, type, param, code}}`, and
no request may hang; afterwards the service must be healthy and answer a greedy request with the
same text as before the fuzzing. With `--schemathesis` it also runs schemathesis (pip install
schemathesis) against GET /openapi.json. The last line is one JSON object: cases, statuses,
server_errors, hung, bad_error_bodies, healthy_after, same_answer_after, and schemathesis' result.

The cases come from `cases(seed)`, a pure generator, so a failure is replayed by its seed and
index; tests/integration/test_faults.py runs a few hundred of them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

APP = "iterserve"
# A case that gets no answer within this long counts as hung.
CASE_TIMEOUT_S = 30.0
# schemathesis is stopped after this long (its report so far is kept).
SCHEMATHESIS_TIMEOUT_S = 1200.0
# The fuzzed deployment's context: schema-valid requests may ask for all of it (a chat request
# without max_tokens generates to the end of the context), so a short one keeps each case short.
FUZZ_MAX_MODEL_LEN = 256

_FIELDS = ("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
           "seed", "stop", "stop_token_ids", "ignore_eos", "n", "stream", "stream_options", "priority", "user",
           "logprobs", "echo", "best_of", "suffix", "logit_bias", "presence_penalty", "frequency_penalty",
           "response_format", "tools", "add_generation_prompt", "unknown_field")


def _evil_values(rng: random.Random) -> list[Any]:
    return [None, True, False, 0, -1, 1, 2, 17, 2**31, 2**63 - 1, 2**63, 2**64, -2**63, 10**100, 1e308, -1e308, 1e-300,
            1.5, -0.0, 0.5, "", "x", "interactive", "batch", "x" * rng.choice((1000, 100_000)), "\ud800", "a\udfffb",
            "😀" * 500, "\x00\x01", [], [1], [0, 1, 2], [-1], [2**40], [[]], [None], [[1, 2], [3]], ["a", "b"], [""],
            ["s"] * 40, list(range(300)), {}, {"a": 1}, {"type": "text"}, {"include_usage": "yes"},
            _deep(rng.choice((50, 500)))]


def _deep(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@dataclass(slots=True)
class Case:
    index: int
    method: str
    path: str
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    kind: str = ""


def _valid_completion(rng: random.Random) -> dict[str, Any]:
    prompt: Any = rng.choice(("fuzz", "a b c", [5, 6, 7], ["one", "two"], [[5, 6], [7]]))
    return {"prompt": prompt, "max_tokens": rng.randint(1, 6), "temperature": rng.choice((0, 0.7, 1.0))}


def _valid_chat(rng: random.Random) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": rng.choice(("hi", "what is a KV cache?"))}],
            "max_tokens": rng.randint(1, 6)}


def _mutate(body: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    body = dict(body)
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(_FIELDS)
        if rng.random() < 0.15:
            body.pop(name, None)
        else:
            body[name] = rng.choice(_evil_values(rng))
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool) \
            and 6 < body["max_tokens"] < 10_000:
        body["max_tokens"] = 6  # a valid long generation is not a fuzz finding, only slow
    return body


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 4 else 4)
    if kind == 0:
        return rng.choice(_evil_values(rng)[:30])
    if kind == 1:
        return rng.random() * 10 ** rng.randint(-5, 30)
    if kind == 2:  # any code points, lone surrogates included
        return "".join(chr(rng.randint(1, 0x10FFFF)) for _ in range(rng.randint(0, 20)))
    if kind == 3:
        return rng.randint(-2**70, 2**70)
    if kind in (4, 5):
        return {rng.choice(_FIELDS): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 6))}
    return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 6))]


_RAW_BODIES = (b"", b"null", b"[]", b"{", b'{"prompt": "x"', b"prompt=x&max_tokens=2", b"\xff\xfe\x00\x00",
               b'{"prompt": "\xff\xfe"}', '{"prompt": "x"}'.encode("utf-16"), b"1e999999", b"1" * 5000,
               b"[" * 100_000, b'{"prompt": "x", "max_tokens": NaN}', b'{"prompt": "x", "max_tokens": Infinity}',
               b'{"prompt": "x", "prompt": 5}', b'{"prompt": "\\ud800"}', b'{"messages": [{"role": "user", '
               b'"content": "\\udfff"}]}', b"\x00" * 100, b'{"prompt": "' + b"\xe2\x82" + b'"}')
_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/openapi.json",
          "/v1/completions/", "/v1//completions", "/v1/completions?x=" + "%" * 50, "/" + "a" * 8000, "/v1/%00",
          "/../../etc/passwd", "/v1/embeddings")


def cases(seed: int, count: int) -> Iterator[Case]:
    """`count` cases, the same for the same seed."""
    rng = random.Random(seed)
    for index in range(count):
        roll = rng.random()
        path = rng.choice(("/v1/completions", "/v1/chat/completions"))
        headers = {"content-type": "application/json"}
        if roll < 0.45:
            base = _valid_completion(rng) if path == "/v1/completions" else _valid_chat(rng)
            body = json.dumps(_mutate(base, rng), ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
            yield Case(index, "POST", path, body, headers, "mutated")
        elif roll < 0.65:
            body = json.dumps(_random_json(rng)).encode("utf-8", "surrogatepass")
            yield Case(index, "POST", path, body, headers, "random_json")
        elif roll < 0.8:
            yield Case(index, "POST", path, rng.choice(_RAW_BODIES), headers, "raw_bytes")
        elif roll < 0.9:
            odd = rng.choice(({"content-type": "text/plain"}, {"content-type": "application/json; charset=latin-1"},
                              {"authorization": "Bearer " + "x" * 5000}, {"content-encoding": "gzip"},
                              {"x-request-timeout-seconds": "-1"}, {}))
            body = json.dumps(_valid_completion(rng)).encode() if path == "/v1/completions" \
                else json.dumps(_valid_chat(rng)).encode()
            yield Case(index, "POST", path, body, {**headers, **odd}, "odd_headers")
        else:
            method = rng.choice(("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"))
            yield Case(index, method, rng.choice(_PATHS), b"{}" if method in ("POST", "PUT") else None, {}, "odd_route")


@dataclass(slots=True)
class FuzzReport:
    cases: int = 0
    statuses: Counter = field(default_factory=Counter)
    server_errors: list[dict[str, Any]] = field(default_factory=list)
    hung: list[dict[str, Any]] = field(default_factory=list)
    bad_error_bodies: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"cases": self.cases, "statuses": dict(sorted(self.statuses.items())),
                "server_errors": len(self.server_errors), "hung": len(self.hung),
                "bad_error_bodies": len(self.bad_error_bodies),
                "examples": (self.server_errors + self.hung + self.bad_error_bodies)[:5]}


async def run_fuzz(base: str, all_cases: list[Case], concurrency: int = 16, api_key: str | None = None) -> FuzzReport:
    report = FuzzReport()
    limit = asyncio.Semaphore(concurrency)
    auth = {"authorization": f"Bearer {api_key}"} if api_key else {}

    async with httpx.AsyncClient(base_url=base, timeout=CASE_TIMEOUT_S) as client:
        async def one(case: Case) -> None:
            async with limit:
                try:
                    response = await client.request(case.method, case.path, content=case.body,
                                                    headers={**auth, **case.headers})
                except httpx.TimeoutException:
                    report.hung.append(_describe(case, None))
                    return
                except httpx.HTTPError as exc:  # the server closed on us: as bad as a 5xx
                    report.server_errors.append({**_describe(case, None), "transport": str(exc)})
                    return
            report.cases += 1
            report.statuses[response.status_code] += 1
            if response.status_code >= 500:
                report.server_errors.append({**_describe(case, response.status_code), "body": response.text[:300]})
            elif response.status_code >= 400 and case.method != "HEAD" and not _is_error_body(response):
                report.bad_error_bodies.append({**_describe(case, response.status_code), "body": response.text[:300]})

        await asyncio.gather(*(one(case) for case in all_cases))
    return report


def _describe(case: Case, status: int | None) -> dict[str, Any]:
    return {"index": case.index, "kind": case.kind, "method": case.method, "path": case.path[:80], "status": status,
            "body": (case.body or b"")[:200].decode(errors="replace")}


def _is_error_body(response: httpx.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and isinstance(error.get("message"), str) and {"type", "param", "code"} <= set(error)


def run_schemathesis(base: str, max_examples: int) -> dict[str, Any]:
    """schemathesis' CLI against /openapi.json; its exit status and the tail of its report."""
    exe = shutil.which("schemathesis") or shutil.which("st")
    if exe is None:
        return {"ran": False, "why": "schemathesis is not installed (pip install schemathesis)"}
    cmd = [exe, "run", f"{base}/openapi.json", "--checks", "not_a_server_error", "--max-examples", str(max_examples),
           "--request-timeout", str(CASE_TIMEOUT_S), "--workers", "2", "--no-color"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=SCHEMATHESIS_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return {"ran": True, "timed_out_s": SCHEMATHESIS_TIMEOUT_S, "command": " ".join(cmd[1:]),
                "tail": out.strip().splitlines()[-12:]}
    return {"ran": True, "exit_code": done.returncode, "command": " ".join(cmd[1:]),
            "tail": (done.stdout + done.stderr).strip().splitlines()[-12:]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--schemathesis", action="store_true", help="also run schemathesis against /openapi.json")
    p.add_argument("--schemathesis-examples", type=int, default=100)
    p.add_argument("--url", default=None, help="fuzz a running server instead of deploying one (loopback only)")
    p.add_argument("--model", default="tiny", help="the model of the deployment it fuzzes (default: the tiny one)")
    return p.parse_args(argv)


def deploy(model: str | None) -> None:
    from ray import serve

    from deployments.app import build_app

    engine_args = {"num_threads": 1, "max_model_len": FUZZ_MAX_MODEL_LEN}
    serve.run(build_app({"model": model, "num_replicas": 2, "engine_args": engine_args,
                         "request_body_timeout_s": 5.0}),
              name=APP, route_prefix="/")


def probe(base: str) -> tuple[int, str | None]:
    health = httpx.get(f"{base}/health", timeout=30).status_code
    answer = httpx.post(f"{base}/v1/completions", timeout=60,
                        json={"prompt": "after the fuzz", "max_tokens": 8, "temperature": 0})
    return health, answer.json()["choices"][0]["text"] if answer.status_code == 200 else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started_s = time.monotonic()
    own = args.url is None
    if own:
        from loadtest.local_serve import start_local_serve, stop_local_serve

        base = start_local_serve()
        deploy(args.model)
    else:
        base = args.url.rstrip("/")
    try:
        _, before = probe(base)
        report = asyncio.run(run_fuzz(base, list(cases(args.seed, args.cases)), args.concurrency))
        schemathesis = run_schemathesis(base, args.schemathesis_examples) if args.schemathesis else None
        health, after = probe(base)
    finally:
        if own:
            stop_local_serve()
    summary = {**report.to_dict(), "healthy_after": health == 200, "same_answer_after": before is not None
               and before == after, "schemathesis": schemathesis, "seed": args.seed,
               "wall_s": round(time.monotonic() - started_s)}
    print(json.dumps(summary), flush=True)
    ok = not report.server_errors and not report.hung and not report.bad_error_bodies and health == 200
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
