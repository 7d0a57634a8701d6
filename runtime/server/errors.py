"""Every error a client can cause, mapped to an OpenAI-style JSON body in one place:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}
"""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import EngineOverloadedError
from ..errors import InvalidRequestError, KilnError, PromptTooLongError


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def to_api_error(err: Exception) -> APIError:
    if isinstance(err, APIError):
        return err
    if isinstance(err, InvalidRequestError):
        return APIError(400, str(err), param=err.field)
    if isinstance(err, PromptTooLongError):
        return APIError(400, str(err), param="prompt", code="context_length_exceeded")
    if isinstance(err, EngineOverloadedError):
        return APIError(429, str(err), type_="rate_limit_exceeded", code="queue_full")
    if isinstance(err, KilnError):
        return APIError(500, str(err), type_="server_error")
    return APIError(500, "internal server error", type_="server_error")


def _field(loc) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


def install(app) -> None:
    @app.exception_handler(APIError)
    async def _api(request: Request, err: APIError):
        return JSONResponse(error_body(err.message, err.type, err.param, err.code), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {"loc": ("body",), "msg": "invalid request"}
        field = _field(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body("the request body is not valid JSON", "invalid_request_error"), 400)
        return JSONResponse(error_body(f"{field}: {first.get('msg')}", "invalid_request_error", field), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException):
        return JSONResponse(error_body(str(err.detail), "invalid_request_error"), status_code=err.status_code)

    @app.exception_handler(KilnError)
    async def _kiln(request: Request, err: KilnError):
        api = to_api_error(err)
        return JSONResponse(error_body(api.message, api.type, api.param, api.code), status_code=api.status)
