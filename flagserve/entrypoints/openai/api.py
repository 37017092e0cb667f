"""The OpenAI API's routes over an OpenAIIngress (ingress.py), as one FastAPI app.

Built per replica, after the ingress is constructed: Ray Serve's proxy calls it, and so does
the replica's own HTTP server when it listens directly (http_server.py).
No `from __future__ import annotations`: FastAPI must see the real Request type.
"""
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from flagserve.engine.core.loop import EngineDeadError
from flagserve.entrypoints.openai.errors import OpenAIError, engine_dead_message

log = logging.getLogger(__name__)
ROUTES = (("GET", "/health", "health"), ("GET", "/v1/models", "models"),
          ("GET", "/metrics", "metrics"), ("POST", "/v1/completions", "completions"),
          ("POST", "/v1/chat/completions", "chat_completions"))  # -> OpenAIIngress methods


def build_api(ingress: Any) -> FastAPI:
    app = FastAPI(title="FlagServe", docs_url="/docs", redoc_url=None)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, err: OpenAIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, err: EngineDeadError) -> JSONResponse:
        return JSONResponse(OpenAIError(503, engine_dead_message(err)).body(), status_code=503)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, err: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(OpenAIError(500, f"internal error: {err!r}").body(), status_code=500)

    for method, path, name in ROUTES:
        app.add_api_route(path, _endpoint(getattr(ingress, name)), methods=[method], name=name)
    return app


def _endpoint(handler: Callable[[Request], Awaitable[Response]]) -> Callable:
    async def endpoint(request: Request) -> Response:
        return await handler(request)
    return endpoint
