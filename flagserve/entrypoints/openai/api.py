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

from flagserve.engine.core.loop import EngineDeadError
from flagserve.entrypoints.openai.auth import ApiKeyMiddleware
from flagserve.entrypoints.openai.errors import OpenAIError, engine_dead_message
from flagserve.entrypoints.openai.size_limits import SizeLimitMiddleware

log = logging.getLogger(__name__)
ROUTES = (("GET", "/health", "health"), ("GET", "/v1/models", "models"),
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
    app.add_middleware(ApiKeyMiddleware, api_key=ingress.api_key)  # added last: runs first
    return app


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
