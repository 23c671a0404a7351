"""Errors in OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``:
``APIError``, the 400s for request bodies that FastAPI/pydantic reject and for the engine's
``ValueError``s, the statuses of failed engine requests, and the app's exception handlers."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.engine.request_stream import (
    EngineClosedError,
    EngineStepError,
    RequestAbortedError,
)
from pagedserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from pagedserve.entrypoints.openai.protocol_chat import MESSAGE_ROLES

logger = logging.getLogger("pagedserve.server")

_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                404: "invalid_request_error", 405: "invalid_request_error",
                409: "invalid_request_error",
                413: "invalid_request_error", 422: "invalid_request_error",
                500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error answered with OpenAI's error body.

    Args:
        status: HTTP status (400 bad input, 401 bad key, 404 unknown model or route,
            409 a LoRA adapter in use cannot be unloaded, 500 server bug, 503 shutting
            down).
        message: human-readable explanation.
        param: the request field at fault, if any.
        code: OpenAI's machine-readable code (``model_not_found``, ``invalid_api_key``).
    """

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type or _ERROR_TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}``."""
        info = ErrorInfo(message=self.message, type=self.err_type, param=self.param,
                         code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


_FIELD = re.compile(r"^([a-z_]+)\b")


def bad_request(err: Exception, known: set[str] | None = None) -> APIError:
    """A 400 for a ``ValueError`` from the engine or ``SamplingParams``; ``param`` is the
    field its message starts with, when that is a request field."""
    message = str(err)
    match = _FIELD.match(message)
    param = match.group(1) if match and (known is None or match.group(1) in known) else None
    return APIError(400, message, param=param)


def engine_error(err: Exception) -> APIError:
    """The API error for a failed request: shutdown 503, engine step failure or a bug 500."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, (RequestAbortedError, EngineClosedError)):
        return APIError(503, str(err))
    if isinstance(err, EngineStepError):
        return APIError(500, str(err))
    return APIError(500, f"internal error: {err!r}")


# -- request bodies FastAPI/pydantic rejected ------------------------------------------


def _loc_to_param(loc: tuple) -> str | None:
    """``("body", "messages", 0, "user", "content")`` -> ``"messages[0].content"``."""
    parts = [p for p in loc if p != "body"]
    # Drop the names of union members (pydantic adds e.g. "str", "list[int]") and the role
    # tag pydantic puts after a message's index (messages are a union chosen by role).
    out = ""
    for i, p in enumerate(parts):
        if isinstance(p, int):
            out += f"[{p}]"
        elif not _is_union_member(p, parts[i - 1] if i else None):
            out += f".{p}" if out else p
    return out or None


def _is_union_member(part: str, before: str | int | None) -> bool:
    if "[" in part or part in ("str", "int", "float", "bool") or part[:1].isupper():
        return True
    return part in MESSAGE_ROLES and isinstance(before, int)


def _error_param(err: dict) -> str | None:
    """The request field an error is about; for a bad or missing union tag (a message's
    ``role``), the tag field itself."""
    param = _loc_to_param(tuple(err.get("loc", ())))
    if err.get("type") in ("union_tag_invalid", "union_tag_not_found"):
        tag = str(err.get("ctx", {}).get("discriminator", "")).strip("'")
        param = f"{param}.{tag}" if param else tag
    return param


def _shown(value: object, limit: int = 80) -> str:
    """A rejected value as the error message quotes it: objects by type, long values cut
    (a message must not echo megabytes)."""
    if isinstance(value, (dict, list)):
        return type(value).__name__
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _json_syntax_error(err: dict, doc: object) -> APIError:
    """The 400 for a body that is not JSON: the parser's message with the line and column
    (1-based, as ``json.JSONDecodeError`` counts them) where it stopped. FastAPI's error
    gives the character offset (the last item of ``loc``) and ``doc``, the body's text."""
    detail = err.get("ctx", {}).get("error", err.get("msg", ""))
    loc = err.get("loc", ())
    pos = loc[-1] if loc else None
    if isinstance(doc, str) and isinstance(pos, int):
        line = doc.count("\n", 0, pos) + 1
        column = pos - doc.rfind("\n", 0, pos)
        detail = f"{detail}: line {line} column {column} (char {pos})"
    return APIError(400, f"We could not parse the JSON body of your request: {detail}")


def _content_type_error(content_type: str | None) -> APIError:
    """The 400 for a body FastAPI did not parse because its ``Content-Type`` is not JSON's
    (curl's ``-d`` sends ``application/x-www-form-urlencoded``). Such a body is refused
    even when it is JSON: a browser may send a form cross-site without a CORS preflight
    (CVE-2021-32677)."""
    got = "no Content-Type header" if content_type is None else _shown(content_type)
    return APIError(400, f"The Content-Type header must be 'application/json'; got {got}")


def validation_error(exc: RequestValidationError, content_type: str | None) -> APIError:
    """The 400 for a request body FastAPI/pydantic rejected (content type, JSON syntax,
    types, ranges); ``content_type``: the request's ``Content-Type`` header, if any."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return _json_syntax_error(first, exc.body)
    if isinstance(first.get("input"), bytes):  # FastAPI parses JSON content types only
        return _content_type_error(content_type)
    if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
        return APIError(400, "the request body is missing; send a JSON object")
    messages = []
    for err in errors[:5]:
        param = _error_param(err)
        value = err.get("input")
        shown = _shown(value)
        where = f"'{param}'" if param else "the request body"
        messages.append(f"Invalid value for {where}: {err.get('msg')} (got {shown})")
    if len(errors) > 5:
        messages.append(f"... and {len(errors) - 5} more")
    return APIError(400, "; ".join(messages), param=_error_param(first))


def install_error_handlers(app: FastAPI) -> None:
    """Map every error to OpenAI's error body (never FastAPI's default ``detail``)."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc, request.headers.get("content-type")).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return APIError(404, "Not found: unknown route").response()
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def crash(_: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error", exc_info=exc)
        return APIError(500, f"internal server error: {exc!r}").response()

