"""ASGI middleware of the HTTP server (pure ASGI: they never buffer a streamed response).

* ``ApiKeyMiddleware``: ``Authorization: Bearer <key>`` on protected paths, compared in
  constant time (``hmac.compare_digest``); 401 otherwise.
* ``BodyLimitMiddleware``: a request body over ``max_bytes`` gets 413, whether announced
  by Content-Length (refused before reading) or sent chunked (refused once it passes the
  limit); a body not received in full within ``timeout_s`` gets 408.
"""

from __future__ import annotations

import asyncio
import hmac
import time

from starlette.exceptions import HTTPException

from .errors import APIError, error_response


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str, open_paths: frozenset[str] = frozenset()):
        self.app = app
        self._key = api_key.encode()
        self._open = open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self._open:
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
            response = error_response(APIError(401, "a valid API key is required (Authorization: Bearer <key>)",
                                               type_="invalid_request_error", code="invalid_api_key"))
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class _BodyError(HTTPException):
    """Raised from ``receive``: an HTTPException, so FastAPI's body parsing passes it on
    to the app's handler (``errors.install``) instead of turning it into a 400."""

    def __init__(self, error: APIError):
        super().__init__(error.status, error.message)
        self.api_error = error


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared < 0 or declared > self.max_bytes:
                    return await error_response(self._too_large() if declared > 0 else
                                                APIError(400, "invalid Content-Length"))(scope, receive, send)
        received, body_done = 0, False
        deadline = time.monotonic() + self.timeout_s
        started = False

        async def limited_receive():
            nonlocal received, body_done
            if body_done:  # after the body: http.disconnect, whenever it comes (no deadline)
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                raise _BodyError(APIError(408, f"the request body was not received within {self.timeout_s:g} s",
                                          code="request_timeout")) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyError(self._too_large())
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyError as err:  # raised outside the app's handlers
            if started:
                raise
            await error_response(err.api_error)(scope, receive, send)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_bytes} bytes", code="request_too_large")
