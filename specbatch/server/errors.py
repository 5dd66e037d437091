"""OpenAI-style error bodies and the exception handlers that produce them."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specbatch.server.formatting import error_body
from specbatch.server.protocol import describe_validation_errors

logger = logging.getLogger("specbatch")


class APIError(Exception):
    """An error to send as ``{"error": {...}}`` with an HTTP status."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class SafeJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error message may echo client text,
    and a lone surrogate in it cannot be encoded as UTF-8 (it can as a ``\\ud800`` escape)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return SafeJSONResponse(error_body(status, message, param, code), status_code=status)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if errors and errors[0].get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON", None, "json_invalid")
        message, param = describe_validation_errors(errors)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else "request error"
        if exc.status_code == 400 and "parsing the body" in detail:
            detail = "the request body is not valid JSON (or not UTF-8)"
        return error_response(exc.status_code, detail)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # A bug, never the client's input: logged with its traceback, answered in JSON.
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal server error ({type(exc).__name__})")
