"""The server's OpenAPI document, built from the same pydantic models that validate requests.

The OpenAI routes read their raw body themselves (`protocol.parse_request`: strict, with
OpenAI-style 400s naming the field), so FastAPI cannot see their body types; `route_docs`
declares them, and `build_openapi` adds the request models' schemas to the components.
Clients and fuzzers then get the exact contract the handlers enforce.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from draftsmith.serve_eval.server import protocol as P

_REF = "#/components/schemas/{model}"
_REQUEST_MODELS: tuple[type[BaseModel], ...] = (P.CompletionRequest, P.ChatCompletionRequest)


def _error(description: str) -> dict[str, Any]:
    return {"model": P.ErrorResponse, "description": description}


COMMON_ERRORS: dict[int | str, dict[str, Any]] = {
    400: _error("invalid request; `param` names the field"),
    401: _error("missing or wrong API key (when the server has one)"),
    404: _error("unknown model"),
    413: _error("request body over the server's limit"),
    429: _error("the waiting queue is full; see Retry-After"),
    500: _error("the engine failed this request (the server keeps serving)"),
    503: _error("shutting down, or the engine loop stopped"),
}


def route_docs(request_model: type[BaseModel], response_model: type[BaseModel]) -> dict[str, Any]:
    """Decorator kwargs documenting an OpenAI route's JSON body, its response and its refusals."""
    body_schema = {"$ref": _REF.format(model=request_model.__name__)}
    return {
        "openapi_extra": {"requestBody": {"required": True, "content": {
            "application/json": {"schema": body_schema}}}},
        "responses": {200: {"model": response_model,
                            "description": "the completion, or with stream=true an SSE stream of chunks",
                            "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                      **COMMON_ERRORS},
    }


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """app.openapi replacement: FastAPI's document plus the request models' component schemas."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                         description="OpenAI-compatible completions over draftsmith's engine")
    _, defs = models_json_schema([(model, "validation") for model in _REQUEST_MODELS], ref_template=_REF)
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    app.openapi_schema = schema
    return schema
