"""OpenAI's error shape: {"error": {message, type, param, code}}, and the messages of errors
raised elsewhere (another deployment, a dead engine)."""
from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response


class OpenAIError(Exception):
    """Becomes an HTTP error with OpenAI's body: {"error": {message, type, param, code}}."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             405: "MethodNotAllowedError", 413: "RequestTooLargeError",
             415: "UnsupportedMediaTypeError",
             431: "RequestHeaderFieldsTooLargeError",
             500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}

    def response(self, headers: dict[str, str] | None = None) -> Response:
        # ASCII JSON: a message quoting the request can never fail to encode (a lone surrogate).
        return Response(json.dumps(self.body()), self.status, headers, "application/json")


def error_message(err: BaseException) -> str:
    """The user's message of an exception raised in another deployment (RayTaskError wraps it)."""
    cause = getattr(err, "cause", None)
    return str(cause if cause is not None else err).strip().splitlines()[-1]


def request_error(err: BaseException) -> OpenAIError:
    """A 400 for a request the engine or SamplingParams refused; a "SamplingParams.<field> ..."
    message names its field."""
    message = error_message(err)
    head = message.split(" ", 1)[0]
    field = head.removeprefix("SamplingParams.") if head.startswith("SamplingParams.") else None
    return OpenAIError(400, message.removeprefix("SamplingParams."), field)


def engine_dead_message(err: BaseException) -> str:
    return (f"the engine of this replica stopped ({error_message(err)}); Ray Serve is restarting "
            "it: retry in a few seconds")
