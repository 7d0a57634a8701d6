"""Every error a client can cause, mapped to an OpenAI-style JSON body in one place:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

4xx for what the client can fix (400 bad field, 401 key, 404 model, 408/413 body, 429 queue
full); 503 (with Retry-After) while shutting down or when the engine has failed; 500 only
for Kiln's own bugs.
"""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import EngineOverloadedError, EngineUnavailableError
from ..errors import InvalidRequestError, KilnError, PromptTooLongError

class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


class ErrorResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: error messages may quote the client's
    own text, which can hold lone surrogates that have no UTF-8 form."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(err: APIError, retry_after_s: int = 1) -> ErrorResponse:
    headers = {"Retry-After": str(retry_after_s)} if err.status in (429, 503) else None
    if err.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return ErrorResponse(error_body(err.message, err.type, err.param, err.code), status_code=err.status,
                         headers=headers)


def to_api_error(err: Exception) -> APIError:
    if isinstance(err, APIError):
        return err
    if isinstance(err, InvalidRequestError):
        return APIError(400, str(err), param=err.field)
    if isinstance(err, PromptTooLongError):
        return APIError(400, str(err), param="prompt", code="context_length_exceeded")
    if isinstance(err, EngineOverloadedError):
        return APIError(429, str(err), type_="rate_limit_exceeded", code="queue_full")
    if isinstance(err, EngineUnavailableError):
        return APIError(503, str(err), type_="service_unavailable", code="unavailable")
    if isinstance(err, KilnError):
        return APIError(500, str(err), type_="server_error")
    return APIError(500, "internal server error", type_="server_error")


def _field(loc) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


def install(app, retry_after_s: int = 1) -> None:
    def error_response_(err: APIError) -> ErrorResponse:
        return error_response(err, retry_after_s)

    @app.exception_handler(APIError)
    async def _api(request: Request, err: APIError):
        return error_response_(err)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {"loc": ("body",), "msg": "invalid request"}
        field = _field(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            return error_response_(APIError(400, "the request body is not valid JSON"))
        return error_response_(APIError(400, f"{field}: {first.get('msg')}", param=field))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException):
        api = getattr(err, "api_error", None)  # the body limit's errors keep their code
        return error_response_(api or APIError(err.status_code, str(err.detail)))

    @app.exception_handler(KilnError)
    async def _kiln(request: Request, err: KilnError):
        return error_response_(to_api_error(err))

    @app.exception_handler(Exception)
    async def _bug(request: Request, err: Exception):
        return error_response_(to_api_error(err))
