"""[loop] Errors with the right status, in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``)
or, on the Anthropic Messages API's paths, in Anthropic's (``{"type": "error", "error": {"type", "message"}}``),
or on Ollama's (``/api/``), in Ollama's (``{"error": "message"}``)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)
requests_log = logging.getLogger("vlmserve.requests")  # one line per request, served or not
FASTAPI_PARSE_FAILURE = "There was an error parsing the body"  # what FastAPI says when json.loads recurses too deep


class APIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers  # e.g. Retry-After (429, 503 while a model loads), WWW-Authenticate (401)
        self.logged = False

    def body(self, anthropic: bool = False, ollama: bool = False) -> dict[str, Any]:
        if ollama:
            return {"error": self.message}
        if anthropic:
            kind = ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, path: str = "") -> JSONResponse:
        """The error as the API at ``path`` shapes it."""
        return JSONResponse(self.body(anthropic_path(path), ollama_path(path)), status_code=self.status,
                            headers=self.headers)


# Anthropic's error types by status (its SDKs pick their exception by status; the type says the same)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_path(path: str) -> bool:
    """Whether ``path`` is the Anthropic Messages API's (its errors take Anthropic's shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def ollama_path(path: str) -> bool:
    """Whether ``path`` is Ollama's API's (its errors are ``{"error": "message"}``, as its clients read them)."""
    return path.startswith("/api/")


def first_line(exc: BaseException) -> str:
    """An exception in one line, for a log or an error message: its first line, else its type."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def retry_after(seconds: int | None) -> dict[str, str] | None:
    return {"Retry-After": str(seconds)} if seconds is not None else None


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def validation_error(exc: RequestValidationError) -> APIError:
    """Pydantic's first complaint, said precisely: which field and why."""
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request body"}
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx")
        reason = str(ctx.get("error", first.get("msg")) if isinstance(ctx, dict) else first.get("msg"))
        if "recursion limit" in reason:  # pydantic's parser stops near 200 levels
            return bad_request(f"request body nests too deep to parse ({reason})", None, "json_too_deep")
        return bad_request(f"request body is not valid JSON: {reason}", None, "invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = str(first.get("msg")).removeprefix("Value error, ")
    message = f"{param}: {msg}" if param else msg
    return bad_request(message, param, "invalid_value")


def install_error_handlers(app: FastAPI, metrics: Any = None) -> None:
    """Every error becomes the API's shape (OpenAI's, or Anthropic's or Ollama's on theirs); each is counted (``metrics.rejected``) and logged once."""

    def answer(request: Request, error: APIError) -> JSONResponse:
        if metrics is not None:
            metrics.rejected(error.status, error.code)
        if not error.logged:
            log_rejection(request.method, request.url.path, error)
        return error.response(request.url.path)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == FASTAPI_PARSE_FAILURE:  # json.loads raised, not a syntax error
            return answer(request, bad_request("request body could not be parsed as JSON: it nests too deep", None,
                                               "json_too_deep"))
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return answer(request, APIError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return answer(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))


def log_rejection(method: str, path: str, error: APIError) -> None:
    requests_log.info("rejected %s %s status=%d code=%s: %s", method, path, error.status, error.code or "-",
                      error.message[:200])
