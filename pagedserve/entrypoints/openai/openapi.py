"""The server's OpenAPI document (``/openapi.json``) and the error responses its routes
declare."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import TypeAdapter

from pagedserve.entrypoints.openai.protocol import ErrorResponse

# Every API error has OpenAI's body (declaring 4XX/5XX also drops FastAPI's default 422,
# which this server never sends: validation errors are 400s).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorResponse, "description": "Bad request, unknown model or route, "
                                                   "missing API key (OpenAI's error body)"},
    "5XX": {"model": ErrorResponse, "description": "Shutting down (OpenAI's error body)"},
}
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _int_bounds(schema: Any, found: dict[float, int]) -> None:
    """Collect the bounds of integer schemas in ``schema`` as ``float(bound) -> bound``."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            for key in _BOUNDS:
                if isinstance(schema.get(key), int):
                    found[float(schema[key])] = schema[key]
        for value in schema.values():
            _int_bounds(value, found)
    elif isinstance(schema, list):
        for value in schema:
            _int_bounds(value, found)


def _restore_int_bounds(schema: Any, exact: dict[float, int]) -> None:
    """Put back the exact integer bounds that FastAPI's OpenAPI model turned into floats
    (its ``maximum`` is a float field: 2**64 - 1 became 1.8446744073709552e+19)."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            for key in _BOUNDS:
                if isinstance(schema.get(key), float):
                    schema[key] = exact.get(schema[key], schema[key])
        for value in schema.values():
            _restore_int_bounds(value, exact)
    elif isinstance(schema, list):
        for value in schema:
            _restore_int_bounds(value, exact)


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """``/openapi.json``: FastAPI's document, built from the request models that validate,
    with integer bounds exact as those models state them (``seed`` up to 2**64 - 1)."""
    if app.openapi_schema is None:
        spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
        exact: dict[float, int] = {}
        for route in app.routes:
            body = getattr(route, "body_field", None)
            if body is not None:
                _int_bounds(TypeAdapter(body.field_info.annotation).json_schema(), exact)
        _restore_int_bounds(spec, exact)
        app.openapi_schema = spec
    return app.openapi_schema
