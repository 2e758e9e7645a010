"""OpenAIFrontend: the HTTP routes (Starlette) and the Python handle methods of the ingress.

A plain class over a Backend: `deployments.app.OpenAIIngress` is this class as a Serve ingress,
tests drive it with Starlette's test client. The OpenAIService behind it is built on first use,
once a replica has told us the model's limits; until then every model endpoint answers 503.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from deployments.errors import APIError, internal, invalid, not_ready
from deployments.openapi import openapi_spec
from deployments.backend import Backend
from deployments.openai_service import OpenAIService

# A request body larger than this is refused (413) before it is read whole: 256k tokens of text
# with JSON overhead fit comfortably.
MAX_BODY_BYTES = 16 * 1024 * 1024
# How long the first request waits for a replica to describe its model before a 503.
MODEL_INFO_TIMEOUT_S = 5.0
# A request body must arrive whole within this long, or the request gets 408: a client sending a
# byte at a time must not hold an ingress slot (and a proxy connection) indefinitely. 30 s is
# 16 MiB at 0.5 MB/s.
BODY_TIMEOUT_S = 30.0


class OpenAIFrontend:
    def __init__(self, backend: Backend, load_tokenizer: Callable[[], Any], *, api_key: str | None = None,
                 ingress_id: str = "ingress", model_info_timeout_s: float = MODEL_INFO_TIMEOUT_S,
                 body_timeout_s: float = BODY_TIMEOUT_S) -> None:
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError("api_key must be a non-empty string or None")
        self.backend = backend
        self._load_tokenizer = load_tokenizer
        self._api_key = api_key
        self._ingress_id = ingress_id
        self._model_info_timeout_s = model_info_timeout_s
        self._body_timeout_s = body_timeout_s
        self._service: OpenAIService | None = None
        self._service_lock = asyncio.Lock()
        self._tokenizer: Any = None

    def load_tokenizer_now(self) -> None:
        """Load the tokenizer before serving (the ingress constructor calls this), so that the
        first request does not wait seconds for it."""
        self._tokenizer = self._load_tokenizer()

    async def service(self) -> OpenAIService:
        if self._service is not None:
            return self._service
        async with self._service_lock:
            if self._service is None:
                try:
                    info = await asyncio.wait_for(self.backend.model_info(), self._model_info_timeout_s)
                except (asyncio.TimeoutError, TimeoutError):
                    raise not_ready("no model replica is ready yet; retry shortly") from None
                tokenizer = self._tokenizer
                if tokenizer is None:
                    tokenizer = await asyncio.to_thread(self._load_tokenizer)
                self._service = OpenAIService(self.backend, tokenizer, info, self._ingress_id)
        return self._service

    # ---- Python handle API (serve.get_app_handle(...).method.remote(body)) ---------------------

    async def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        """A /v1/completions body as a dict; returns the response dict or raises APIError."""
        return await self._unary("completion", body)

    async def chat_completions(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._unary("chat", body)

    async def completions_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Yields the same chunk dicts that the HTTP stream sends (use handle.options(stream=True))."""
        async for chunk in self._stream("completion", body):
            yield chunk

    async def chat_completions_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async for chunk in self._stream("chat", body):
            yield chunk

    async def models(self) -> dict[str, Any]:
        return (await self.service()).models()

    async def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """A /tokenize body ({"prompt": ...} or {"messages": [...]}); returns its token ids."""
        return await (await self.service()).tokenize(body)

    async def detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """A /detokenize body ({"tokens": [...]}); returns {"prompt": text}."""
        return (await self.service()).detokenize(body)

    async def _unary(self, kind: str, body: Any) -> dict[str, Any]:
        if isinstance(body, dict) and body.get("stream"):
            raise invalid("stream", "use the *_stream method for streaming over a handle")
        result = await (await self.service()).create(kind, body)
        assert isinstance(result, dict)
        return result

    async def _stream(self, kind: str, body: Any) -> AsyncIterator[dict[str, Any]]:
        if not isinstance(body, dict):
            raise invalid(None, "the request body must be a JSON object")
        events = await (await self.service()).create(kind, {**body, "stream": True})
        assert not isinstance(events, dict)
        try:
            async for chunk in events:
                yield chunk
        finally:
            await events.aclose()

    # ---- HTTP ---------------------------------------------------------------------------------

    def asgi_app(self) -> "DisconnectSafe":
        routes = [
            Route("/v1/completions", self._http_completions, methods=["POST"]),
            Route("/v1/chat/completions", self._http_chat, methods=["POST"]),
            Route("/v1/models", self._http_models, methods=["GET"]),
            Route("/tokenize", self._http_tokenize, methods=["POST"]),
            Route("/detokenize", self._http_detokenize, methods=["POST"]),
            Route("/health", self._http_health, methods=["GET"]),
            Route("/metrics", self._http_metrics, methods=["GET"]),
            Route("/openapi.json", self._http_openapi, methods=["GET"]),
        ]
        return DisconnectSafe(Starlette(routes=routes, exception_handlers={HTTPException: _http_exception}))

    async def _http_completions(self, request: Request) -> Response:
        return await self._http_generate(request, "completion", "/v1/completions")

    async def _http_chat(self, request: Request) -> Response:
        return await self._http_generate(request, "chat", "/v1/chat/completions")

    async def _http_generate(self, request: Request, kind: str, endpoint: str) -> Response:
        async def respond() -> Response:
            body = await _json_body(request, self._body_timeout_s)
            result = await (await self.service()).create(kind, body)
            if isinstance(result, dict):
                return JSONResponse(result)
            return StreamingResponse(_sse(result), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._guarded(request, endpoint, respond)

    async def _http_models(self, request: Request) -> Response:
        async def respond() -> Response:
            return JSONResponse((await self.service()).models())
        return await self._guarded(request, "/v1/models", respond)

    async def _http_tokenize(self, request: Request) -> Response:
        async def respond() -> Response:
            body = await _json_body(request, self._body_timeout_s)
            return JSONResponse(await (await self.service()).tokenize(body))
        return await self._guarded(request, "/tokenize", respond)

    async def _http_detokenize(self, request: Request) -> Response:
        async def respond() -> Response:
            body = await _json_body(request, self._body_timeout_s)
            return JSONResponse((await self.service()).detokenize(body))
        return await self._guarded(request, "/detokenize", respond)

    async def _http_metrics(self, request: Request) -> Response:
        async def respond() -> Response:
            text = await (await self.service()).metrics_text()
            return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")
        return await self._guarded(request, "/metrics", respond)

    async def _http_openapi(self, request: Request) -> Response:
        """The API's OpenAPI description (no auth: it is the same for everyone)."""
        info = self._service.info if self._service is not None else None
        if info is None:
            return JSONResponse(openapi_spec())
        return JSONResponse(openapi_spec(info.served_model_name, info.vocab_size, info.max_model_len))

    async def _http_health(self, request: Request) -> Response:
        """200 only when every replica has its model loaded (no auth: load balancers probe it)."""
        try:
            healthy, detail = await self.backend.health()
        except Exception as exc:
            healthy, detail = False, {"error": f"{type(exc).__name__}: {exc}"}
        return JSONResponse({"status": "ok" if healthy else "unavailable", **detail},
                            status_code=200 if healthy else 503)

    async def _guarded(self, request: Request, endpoint: str, respond: Callable[[], Awaitable[Response]]) -> Response:
        """Auth, then the handler; every failure becomes an OpenAI-style JSON error."""
        try:
            self._authorize(request)
            response = await respond()
        except APIError as exc:
            response = error_response(exc)
        except ClientDisconnect:
            response = Response(status_code=499)
        except Exception as exc:  # a bug must still answer in the API's shape, and never kill the replica
            response = error_response(internal(f"{type(exc).__name__}: {exc}"))
        if self._service is not None:
            self._service.record_response(endpoint, response.status_code)
        return response

    def _authorize(self, request: Request) -> None:
        if self._api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._api_key.encode()):
            raise APIError("invalid or missing API key: send Authorization: Bearer <key>", 401,
                           "authentication_error", None, "invalid_api_key")


class DisconnectSafe:
    """An ASGI app whose `receive` never raises: a failed receive is the client's disconnect.

    Ray Serve's ASGI bridge raises TaskCancelledError from receive() when the proxy cancels a
    request whose client hung up. Starlette's StreamingResponse listens for the disconnect through
    receive(), so the raw error would escape the app and Serve would log a traceback ("Task
    exception was never retrieved") for each hang-up. As a disconnect message it ends the response
    normally, and closing the stream cancels the request on its replica."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return

        async def receive_or_disconnect() -> dict[str, Any]:
            try:
                return await receive()
            except Exception:  # the bridge to a client that is gone
                return {"type": "http.disconnect"}

        await self.app(scope, receive_or_disconnect, send)


def error_response(exc: APIError) -> JSONResponse:
    headers = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, int(-(-exc.retry_after_s // 1))))
    return JSONResponse(exc.to_dict(), status_code=exc.status, headers=headers)


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else "http_error"
    message = f"{request.method} {request.url.path[:200]}: {exc.detail}"
    response = error_response(APIError(message, exc.status_code, "invalid_request_error", None, kind))
    for name, value in (exc.headers or {}).items():  # Allow, on a 405 (RFC 9110 requires it)
        response.headers[name] = value
    return response


async def _json_body(request: Request, timeout_s: float) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(f"the request body is larger than {MAX_BODY_BYTES} bytes", 413, "invalid_request_error",
                       None, "request_too_large")
    try:
        raw = await asyncio.wait_for(_read_body(request), timeout_s)
    except (asyncio.TimeoutError, TimeoutError):
        raise APIError(f"the request body did not arrive within {timeout_s:g} s", 408, "invalid_request_error",
                       None, "request_timeout") from None
    if len(raw) <= _INLINE_JSON_BYTES:
        return _parse_json(raw)
    return await asyncio.to_thread(_parse_json, raw)  # a large body would stall every other request


# Bodies up to this size are parsed on the event loop (well under a millisecond); larger ones in a
# thread, so that a 16 MiB body (~0.2 s to parse) stalls no other request.
_INLINE_JSON_BYTES = 256 * 1024


async def _read_body(request: Request) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(f"the request body is larger than {MAX_BODY_BYTES} bytes", 413,
                           "invalid_request_error", None, "request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise invalid(None, f"the request body is not valid JSON: {_short(exc)}") from None


def _short(exc: Exception, limit: int = 200) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + "..."


async def _sse(events: Any) -> AsyncIterator[str]:
    """One `data:` line per chunk, then `data: [DONE]`. An error after the 200 went out becomes an
    error event; the client hanging up closes `events`, which cancels the requests."""
    try:
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        except APIError as exc:
            yield f"data: {json.dumps(exc.to_dict())}\n\n"
        except Exception as exc:
            yield f"data: {json.dumps(internal(f'{type(exc).__name__}: {exc}').to_dict())}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await events.aclose()
