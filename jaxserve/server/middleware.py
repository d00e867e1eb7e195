"""Pure-ASGI middlewares (they keep `http.disconnect` visible to the routes, unlike BaseHTTPMiddleware):
a request-body size limit (413) and bearer-token authentication for the /v1 routes (401).
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxserve.server.errors import error_body


class BodyTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"the request body is larger than the limit of {limit} bytes")
        self.limit = limit


async def send_error(send: Send, status: int, message: str, type: str, code: str | None = None,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(error_body(message, type, None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """Answers 413 for a declared Content-Length over the limit; stops reading an undeclared body past it."""

    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_body_bytes
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await send_error(send, 400, "invalid Content-Length header", "invalid_request_error")
                if declared > limit:
                    return await send_error(send, 413, str(BodyTooLarge(limit)), "request_too_large",
                                            headers=[(b"connection", b"close")])
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited_receive, send)


class APIKeyMiddleware:
    """Every path under /v1 needs `Authorization: Bearer <api_key>`; other paths (health, metrics) stay open."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope.get("method") != "OPTIONS":
            given = dict(scope.get("headers", [])).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = ("missing API key: send 'Authorization: Bearer <key>'" if not given
                           else "incorrect API key provided")
                return await send_error(send, 401, message, "authentication_error", "invalid_api_key",
                                        headers=[(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)
