"""OpenAI-style errors: one exception type carrying an HTTP status, and the JSON body OpenAI clients expect.

Every error the server answers with has the shape
`{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`.
Client mistakes are 4xx; only the server's own failures (the engine thread died) are 5xx.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error answered to the client with `status` and OpenAI's error JSON."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or default_error_type(status)
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def default_error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 413:
        return "request_too_large"
    if status == 429 or status == 503:
        return "service_unavailable_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param, code=code)


def param_of(message: str, fields: set[str]) -> str | None:
    """The request field a validation message names first (our messages start with the field name)."""
    first = message.split(" ", 1)[0].split(".", 1)[0].split("[", 1)[0]
    return first if first in fields else None
