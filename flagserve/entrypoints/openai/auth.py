"""The API key check, as ASGI middleware around the whole app.

It runs before routing, so every path but the open ones needs the key: the API routes,
/docs and /openapi.json when they are on, and paths that do not exist (a 404 or 405 would
tell a caller without the key which routes there are). A request without the key is
answered before its body is read.
"""
from __future__ import annotations

import hmac
from typing import Any

from flagserve.entrypoints.openai.errors import OpenAIError

OPEN_PATHS = frozenset({"/health"})  # load balancers and `run` probe it without a key


class ApiKeyMiddleware:
    def __init__(self, app: Any, api_key: str | None):
        self.app = app
        self.expected = api_key.encode() if api_key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (self.expected is not None and scope["type"] == "http"
                and scope["path"] not in OPEN_PATHS and not self._authorized(scope)):
            error = OpenAIError(401, "invalid or missing API key: send `Authorization: Bearer <key>`")
            await error.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: dict) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = given.partition(b" ")
        # the scheme's case is free (RFC 9110), the key's is not
        return scheme.lower() == b"bearer" and hmac.compare_digest(token, self.expected)
