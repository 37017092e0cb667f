"""The OpenAI API's routes over an OpenAIIngress (ingress.py), as one FastAPI app.

Built per replica, after the ingress is constructed: Ray Serve's proxy calls it, and so does
the replica's own HTTP server when it listens directly (http_server.py).
Every answer is OpenAI-shaped, also from the middleware (the API key, the body limit) and
for routes that do not exist (404) or methods a route does not take (405).
No `from __future__ import annotations`: FastAPI must see the real Request type.
"""
import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from flagserve.engine.core.loop import EngineDeadError
from flagserve.entrypoints.openai.auth import ApiKeyMiddleware
from flagserve.entrypoints.openai.errors import OpenAIError, engine_dead_message
from flagserve.entrypoints.openai.size_limits import SizeLimitMiddleware

log = logging.getLogger(__name__)
ROUTES = (("GET", "/health", "health"), ("GET", "/v1/models", "models"),
          ("GET", "/v1/models/{model:path}", "model"),
          ("GET", "/metrics", "metrics"), ("POST", "/v1/completions", "completions"),
          ("POST", "/v1/chat/completions", "chat_completions"),
          # vLLM's tokenizer routes, at the root as vLLM serves them
          ("POST", "/tokenize", "tokenize"), ("POST", "/detokenize", "detokenize"),
          ("GET", "/tokenizer_info", "tokenizer_info"),
          ("GET", "/version", "version"))  # -> OpenAIIngress methods
# Routes that run the engine: a client that leaves before a whole answer cancels the handler,
# and the engine aborts its request (vLLM's with_cancellation). A stream's own end (its body
# closed on the disconnect) does the same after the handler has returned.
ENGINE_ROUTES = frozenset({"completions", "chat_completions"})


def build_api(ingress: Any) -> FastAPI:
    """`ingress`: its methods named in ROUTES, its api_key, limits (ApiLimits) and docs."""
    docs = ingress.docs
    app = FastAPI(title="FlagServe", docs_url="/docs" if docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if docs else None)
    _add_error_handlers(app)
    for method, path, name in ROUTES:
        app.add_api_route(path, _endpoint(getattr(ingress, name), name in ENGINE_ROUTES),
                          methods=[method], name=name)
    limits = ingress.limits
    app.add_middleware(SizeLimitMiddleware, max_body_bytes=limits.max_body_bytes,
                       max_header_bytes=limits.max_header_bytes)
    app.add_middleware(ApiKeyMiddleware, api_key=ingress.api_key)
    app.add_middleware(OriginFormMiddleware)  # added last: runs first
    return app


class OriginFormMiddleware:
    """A request target in absolute form (`GET http://host/health`, which RFC 9112 has
    servers accept) as its path: h11 hands the whole URL on, and the key check and routing
    compare paths."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(("http://", "https://")):
            path = "/" + scope["path"].split("://", 1)[1].partition("/")[2]
            raw = scope.get("raw_path") or b""
            raw = b"/" + raw.split(b"://", 1)[1].partition(b"/")[2] if b"://" in raw else raw
            scope = {**scope, "path": path, "raw_path": raw}
        await self.app(scope, receive, send)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, err: OpenAIError) -> Response:
        return err.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> Response:
        message = {404: f"no route {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}
        return OpenAIError(err.status_code, message.get(err.status_code, str(err.detail))).response(
            err.headers)  # 405's Allow

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, _: ClientDisconnect) -> Response:
        # while its body was read (it stalled past http_server.BODY_IDLE_S, or went away):
        # nobody reads an answer, and it is no server error to log with a traceback
        log.info("client left during %s %s", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, err: EngineDeadError) -> Response:
        return OpenAIError(503, engine_dead_message(err)).response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, err: Exception) -> Response:
        log.exception("request failed")
        return OpenAIError(500, f"internal error: {err!r}").response()


def _endpoint(handler: Callable[[Request], Awaitable[Response]], cancellable: bool) -> Callable:
    async def endpoint(request: Request) -> Response:
        if not cancellable:
            return await handler(request)
        await request.body()  # all of it first: the watch below takes every later message
        return await unless_client_leaves(request.receive, handler(request))
    return endpoint


async def unless_client_leaves(receive: Callable[[], Awaitable[dict]],
                               work: Awaitable[Response]) -> Response:
    """`work`'s response, or, when the client disconnects first, `work` cancelled (its cleanup
    awaited) and a 499 that nobody reads."""
    handler = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_client_left(receive))
    try:
        await asyncio.wait({handler, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this endpoint is cancelled itself (Ray Serve's proxy on a disconnect)
        watch.cancel()
        if not handler.done():
            handler.cancel()
            await asyncio.wait({handler})
    if handler.cancelled():
        return Response(status_code=499)  # nginx's "client closed request"
    return handler.result()


async def _client_left(receive: Callable[[], Awaitable[dict]]) -> None:
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - a receive that cannot tell: the handler's end decides
        await asyncio.Event().wait()
