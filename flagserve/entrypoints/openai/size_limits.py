"""deploy.limits.max_body_bytes and max_header_bytes, as ASGI middleware: HTTP 413 and 431
in OpenAI's shape (and 415 for a compressed body: Content-Encoding other than identity).

A body that declares its size (Content-Length) is refused before a byte of it is read; a
chunked one as soon as what has arrived passes the limit. Nothing past the limit is held in
memory, and the server closes the connection instead of reading the rest.

Headers are bounded first by the HTTP server (http_server.py: h11 refuses a request line and
headers still incomplete past the limit), but a request whose headers arrive complete in one
read passes that check; it is measured here, as is any request under Ray Serve's proxy.
"""
from __future__ import annotations

from typing import Any

from flagserve.entrypoints.openai.errors import OpenAIError

KEYS = "experiment.runner.deploy.limits"


class SizeLimitMiddleware:
    def __init__(self, app: Any, max_body_bytes: int, max_header_bytes: int):
        self.app, self.max_body, self.max_header = app, max_body_bytes, max_header_bytes

    def _body_too_large(self) -> OpenAIError:
        return OpenAIError(413, f"the request body is larger than {self.max_body} bytes "
                           f"({KEYS}.max_body_bytes)")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._check_head(scope)
        if error is not None:
            await error.response()(scope, receive, send)
            return
        received = 0

        async def limited() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise self._body_too_large()  # out of request.body(): the app's handler
            return message

        await self.app(scope, limited, send)

    def _check_head(self, scope: dict) -> OpenAIError | None:
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        size += sum(len(k) + len(v) + 4 for k, v in scope["headers"])  # "k: v\r\n"
        if size > self.max_header:
            return OpenAIError(431, f"the request line and headers are larger than {self.max_header} "
                               f"bytes ({KEYS}.max_header_bytes)")
        encoding = next((v for k, v in scope["headers"] if k == b"content-encoding"), b"identity")
        if encoding.strip().lower() != b"identity":  # read as plain JSON, it was refused as
            # invalid UTF-8, and a plain body so labelled was served as if the label were absent
            return OpenAIError(415, f"Content-Encoding {encoding.decode(errors='replace')!r} "
                               "is not supported: send the body uncompressed")
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), b"")
        # The HTTP server has checked it is digits; more than 18 of them is past any limit.
        if declared.isdigit() and (len(declared) > 18 or int(declared) > self.max_body):
            return self._body_too_large()
        return None
