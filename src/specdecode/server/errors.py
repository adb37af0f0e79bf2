"""Every failure answered as OpenAI's error object, {"error": {"message", "type", "param", "code"}}.

A user's mistake is a 4xx naming the parameter at fault. An internal failure is a 500 that
says only that it happened and under which request id: the details (exception, trace) go
to the server's log, never to the client.
"""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode.errors import ContextLengthError, PromptTooLongError, SpecDecodeError
from specdecode.server import schemas
from specdecode.server.metrics import ServerMetrics
from specdecode.server.worker import RequestTimeoutError, ShuttingDownError, WorkerCrashedError

logger = logging.getLogger("specdecode.server")

# the engine's argument names that the API spells differently
API_NAMES = {"max_new_tokens": "max_tokens", "num_speculative_tokens": "speculative.num_speculative_tokens"}
# seconds a client should wait before it retries: a full queue frees a place as soon as a
# request finishes; a server that is stopping or whose engine thread stopped needs longer
RETRY_AFTER_S = {429: 1, 503: 5}


class APIError(Exception):
    """An error answered as OpenAI's error object with this HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def detail(self) -> schemas.ErrorDetail:
        return schemas.ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)


def unauthorized() -> APIError:
    message = "missing or wrong API key: send 'Authorization: Bearer KEY'"
    return APIError(401, message, type="authentication_error", code="invalid_api_key")


def internal_error(error: BaseException, code: str, what: str) -> APIError:
    """A 500 that names a request id; the error itself is logged under that id."""
    request_id = f"req-{uuid.uuid4().hex[:16]}"
    logger.error("%s [%s]: %r", what, request_id, error, exc_info=error)
    return APIError(500, f"{what}; the server log has the details under {request_id}", "server_error", code=code)


def engine_error(error: BaseException, prompt_param: str) -> APIError:
    """The OpenAI-style error for what failed a request in the engine."""
    if isinstance(error, ContextLengthError):  # the prompt alone, or the prompt with max_tokens
        param = prompt_param if isinstance(error, PromptTooLongError) else API_NAMES.get(error.param, error.param)
        return APIError(400, str(error), param=param, code="context_length_exceeded")
    if isinstance(error, SpecDecodeError):
        return APIError(400, str(error), param=API_NAMES.get(error.param, error.param))
    if isinstance(error, RequestTimeoutError):
        return APIError(504, str(error), type="timeout_error", code="request_timeout")
    if isinstance(error, WorkerCrashedError | ShuttingDownError):  # our own words, no internals in them
        return APIError(
            500 if isinstance(error, WorkerCrashedError) else 503, str(error), "server_error", code="engine_failure"
        )
    return internal_error(error, "engine_failure", "the engine failed on this request")


def install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return error_response(error, metrics)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(error.errors()[0]), metrics)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return error_response(APIError(error.status_code, str(error.detail), code=code), metrics)

    @app.exception_handler(Exception)
    async def _internal(_: Request, error: Exception) -> JSONResponse:
        return error_response(internal_error(error, "internal_error", "internal error"), metrics)


def error_response(error: APIError, metrics: ServerMetrics) -> JSONResponse:
    metrics.errors.labels(error.code or error.type).inc()
    return JSONResponse(
        schemas.ErrorResponse(error=error.detail()).model_dump(),
        status_code=error.status,
        headers=retry_after(error.status),
    )


def retry_after(status: int) -> dict[str, str] | None:
    """Retry-After for an overloaded (429) or unavailable (503) server, as RFC 9110 has it."""
    return {"Retry-After": str(RETRY_AFTER_S[status])} if status in RETRY_AFTER_S else None


def _validation_error(first: dict) -> APIError:
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", first["msg"])
        return APIError(400, f"the body is not valid JSON: {reason}", code="json_invalid")
    where = [str(part) for part in first["loc"] if part != "body"]
    if first["type"] == "extra_forbidden":
        message = f"{'.'.join(where)}: this server does not support that field; remove it"
        return APIError(400, message, param=".".join(where), code="unsupported_parameter")
    # param names the top-level field; the message has the full path (union branches included)
    param = where[0] if where else None
    return APIError(422, f"{'.'.join(where) or 'body'}: {first['msg']}", param=param, code="invalid_type")
