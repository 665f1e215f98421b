"""Errors in the OpenAI shape, `{"error": {"message", "type", "param", "code"}}`, with the right status.

The openai SDKs pick their exception class from the HTTP status and read `error.message`; anything else
(FastAPI's `{"detail": ...}`) surfaces to users as an unparseable error.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body(), ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def service_unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, "server_error", None, "service_unavailable")


def engine_error(message: str) -> OpenAIError:
    return OpenAIError(500, message, "server_error", None, "engine_error")


def invalid_api_key(message: str) -> OpenAIError:
    return OpenAIError(401, message, "invalid_request_error", None, "invalid_api_key",
                       {"WWW-Authenticate": "Bearer"})


def too_many_requests(message: str, retry_after_s: float, type: str = "server_error",
                      code: str = "overloaded") -> OpenAIError:
    """429 with Retry-After (whole seconds, at least 1), which the openai SDKs honour when retrying."""
    return OpenAIError(429, message, type, None, code, {"Retry-After": str(max(1, math.ceil(retry_after_s)))})


def payload_too_large(limit_bytes: int) -> OpenAIError:
    return OpenAIError(413, f"request body is larger than the limit of {limit_bytes} bytes",
                       "invalid_request_error", None, "request_too_large")


def request_timeout(message: str) -> OpenAIError:
    return OpenAIError(504, message, "server_error", None, "timeout")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    if first.get("type") == "missing" and not loc:
        return "request body is required (JSON)", None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return message, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return invalid_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return OpenAIError(exc.status_code, str(exc.detail), type_).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return OpenAIError(500, f"internal error: {type(exc).__name__}", "server_error").response()
