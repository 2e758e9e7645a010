"""Calling iterserve from another Ray Serve application through a DeploymentHandle.

With iterserve running as the application "iterserve" (`make run`, or `serve run` of
deployments/serve_config.yaml), start this one next to it:

    serve run deployments.handle_example:app route_prefix=null

and call it from Python (a Ray driver on the same cluster):

    from ray import serve
    h = serve.get_app_handle("handle_example")
    h.complete.remote("The scheduler").result()
    for piece in h.options(stream=True).stream_answer.remote("What is the capital of France?"):
        print(piece, end="")

The handle methods take the same bodies as the HTTP API (as dicts) and return the same response
and chunk dicts; errors raise deployments.errors.APIError with the HTTP status in `.status`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from ray import serve

from deployments.errors import APIError


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Assistant:
    def __init__(self, iterserve_app: str = "iterserve") -> None:
        self.llm = serve.get_app_handle(iterserve_app)

    async def complete(self, prompt: str, max_tokens: int = 16) -> str:
        """Unary: one completion, the text only."""
        response = await self.llm.completions.remote({"prompt": prompt, "max_tokens": max_tokens,
                                                      "temperature": 0})
        return response["choices"][0]["text"]

    async def stream_answer(self, question: str, max_tokens: int = 32) -> AsyncIterator[str]:
        """Streaming: chat deltas as they are generated (call with handle.options(stream=True))."""
        body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                "priority": "batch"}
        async for chunk in self.llm.options(stream=True).chat_completions_stream.remote(body):
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    yield choice["delta"]["content"]

    async def status_of(self, body: dict) -> int:
        """The HTTP status a body would get: 200, or the APIError's status."""
        try:
            await self.llm.completions.remote(body)
        except APIError as exc:
            return exc.status
        return 200


app = Assistant.bind()
