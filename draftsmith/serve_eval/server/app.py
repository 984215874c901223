"""FastAPI app factory for the OpenAI-compatible server.

`create_app(engine, ServerConfig(...))` wires: the engine loop (started and stopped by the
app's lifespan), the OpenAI endpoints, /v1/models, /health, /metrics, /openapi.json,
OpenAI-style error bodies for every refusal (400/401/404/405/413/429/503; a 500 only for a bug
or a failed engine step), a request-body limit, and an optional API key checked in constant
time on /v1/*.
"""
from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from draftsmith.serve_eval.server import protocol as P
from draftsmith.serve_eval.server.drift import DriftSettings
from draftsmith.serve_eval.server.engine_loop import EngineLoop, LoopConfig
from draftsmith.serve_eval.server.metrics import ServerMetrics, read_engine_stats
from draftsmith.serve_eval.server.openai_serving import OpenAIServing
from draftsmith.serve_eval.server.openapi import build_openapi, route_docs
from draftsmith.serve_eval.server.prom import CONTENT_TYPE

log = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/openapi.json")


@dataclass
class ServerConfig:
    model_name: str | None = None          # id clients send as `model`; default: model dir name
    api_key: str | None = None             # set -> /v1/* needs `Authorization: Bearer <key>`
    max_model_len: int | None = None       # default: the checkpoint's max_position_embeddings
    max_waiting_requests: int = 128        # bounded waiting queue; past it -> 429 + Retry-After
    retry_after_s: int = 1
    shutdown_grace_s: float = 5.0          # in-flight requests get this long, then are aborted
    max_request_body_bytes: int = 4 * 1024 * 1024   # larger bodies get a 413 before they are read
    drift: DriftSettings | None = None     # watch per-domain acceptance against an eval report


def _model_dir(engine: Any) -> Path | None:
    model = getattr(getattr(engine, "config", None), "model", None)
    return Path(model) if model else None


def _checkpoint_max_len(model_dir: Path | None) -> int | None:
    if model_dir is None or not (model_dir / "config.json").is_file():
        return None
    config = json.loads((model_dir / "config.json").read_text())
    value = config.get("max_position_embeddings")
    return int(value) if value else None


def _error_response(status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                    code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    err = P.ApiError(status, message, param, type=type, code=code, headers=headers)
    return JSONResponse(err.body(), status_code=status, headers=err.headers)


def _body_too_large(limit: int) -> P.ApiError:
    return P.ApiError(413, f"Request body is larger than this server's limit of {limit} bytes",
                      code="request_too_large")


class _Gatekeeper:
    """Pure ASGI middleware (BaseHTTPMiddleware would break streaming disconnect detection):
    API-key check on /v1/*, the request-body limit, and per-route/status request counting."""

    def __init__(self, app: Any, api_key: str | None, metrics: ServerMetrics, max_body_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    def _limited(self, receive: Any) -> Any:
        """receive() that raises a 413 ApiError once the body passes the limit (chunked bodies
        carry no Content-Length, so the bytes are counted as they arrive)."""
        seen = 0

        async def limited_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise _body_too_large(self.max_body_bytes)
            return message
        return limited_receive

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in ROUTES else "other"
        status = {"code": 0}

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if self.expected is not None and path.startswith("/v1"):
                given = dict(scope.get("headers") or []).get(b"authorization", b"")
                # Constant-time compare: response timing must not leak how much of a key matched.
                if not hmac.compare_digest(given, self.expected):
                    self.metrics.requests_rejected.inc(reason="unauthorized")
                    response = _error_response(401, "Incorrect or missing API key; send "
                                               "'Authorization: Bearer <key>'", code="invalid_api_key",
                                               headers={"WWW-Authenticate": "Bearer"})
                    await response(scope, receive, counting_send)
                    return
            declared = dict(scope.get("headers") or []).get(b"content-length", b"")
            if declared.isdigit() and int(declared) > self.max_body_bytes:
                self.metrics.requests_rejected.inc(reason="too_large")
                err = _body_too_large(self.max_body_bytes)
                await JSONResponse(err.body(), status_code=413)(scope, receive, counting_send)
                return
            await self.app(scope, receive if scope.get("method") in ("GET", "HEAD")
                           else self._limited(receive), counting_send)
        finally:
            self.metrics.http_requests.inc(route=route, status=status["code"] or 499)


def create_app(engine: Any, config: ServerConfig | None = None, tokenizer: Any = None) -> FastAPI:
    """The app for one engine. The engine loop starts with the app's lifespan and stops
    (gracefully) with it; `app.state.engine_loop` exposes it (tests inspect the engine
    through `engine_loop.call(fn)`)."""
    config = config or ServerConfig()
    model_dir = _model_dir(engine)
    model_name = config.model_name or (model_dir.name if model_dir else "draftsmith")
    max_model_len = _served_max_len(engine, config, model_dir)
    if tokenizer is None:
        # The front end tokenizes on the event loop while the engine thread detokenizes;
        # separate tokenizer objects keep the two threads off one Rust tokenizer.
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir)) if model_dir else engine.tokenizer

    context = {"target": str(model_dir)} if model_dir else {}
    metrics = ServerMetrics(config.drift.build(context) if config.drift else None)
    loop = EngineLoop(engine, LoopConfig(max_waiting_requests=config.max_waiting_requests,
                                         retry_after_s=config.retry_after_s), metrics)
    figures = read_engine_stats(engine.stats())
    block_size = getattr(getattr(engine, "config", None), "block_size", None)
    kv_capacity = figures.kv_blocks_total * block_size if block_size and figures.kv_blocks_total else None
    serving = OpenAIServing(loop, tokenizer, model_name, max_model_len, metrics, kv_capacity)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        loop.start()
        try:
            yield
        finally:
            # Blocking join: nothing else should run on this event loop during shutdown.
            loop.shutdown(config.shutdown_grace_s)

    app = FastAPI(title="draftsmith", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.openapi = lambda: build_openapi(app)   # type: ignore[method-assign]
    app.state.engine_loop = loop
    app.state.metrics = metrics
    app.state.serving = serving
    _add_error_handlers(app, metrics)
    _add_routes(app, serving, loop, metrics, model_name, max_model_len)
    app.add_middleware(_Gatekeeper, api_key=config.api_key, metrics=metrics,
                       max_body_bytes=config.max_request_body_bytes)
    return app


def _served_max_len(engine: Any, config: ServerConfig, model_dir: Path | None) -> int:
    engine_max_len = getattr(engine, "max_model_len", None) or _checkpoint_max_len(model_dir)
    max_model_len = config.max_model_len or engine_max_len
    if not max_model_len or max_model_len <= 0:
        raise ValueError("max_model_len: not given and the engine/checkpoint does not say it")
    if engine_max_len and max_model_len > engine_max_len:
        raise ValueError(f"max_model_len={max_model_len} exceeds the engine's {engine_max_len}")
    return max_model_len


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every refusal in OpenAI's error shape; a 500 only for a bug (logged with its stack)."""
    @app.exception_handler(P.ApiError)
    async def _api_error(_: Request, exc: P.ApiError) -> JSONResponse:
        if exc.status == 400:
            metrics.requests_rejected.inc(reason="invalid")
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return _error_response(404, f"Unknown route: {request.method} {request.url.path}",
                                   code="not_found")
        if exc.status_code == 405:   # Starlette names the allowed methods in `Allow`
            return _error_response(405, f"Method {request.method} not allowed on {request.url.path}",
                                   code="method_not_allowed", headers=dict(exc.headers or {}))
        return _error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")   # a 500 is always a bug in this server
        return _error_response(500, f"internal server error: {type(exc).__name__}", type="server_error")


def _add_routes(app: FastAPI, serving: OpenAIServing, loop: EngineLoop, metrics: ServerMetrics,
                model_name: str, max_model_len: int) -> None:
    @app.post("/v1/completions", **route_docs(P.CompletionRequest, P.CompletionResponse))
    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    @app.post("/v1/chat/completions", **route_docs(P.ChatCompletionRequest, P.ChatCompletionResponse))
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(request)

    @app.get("/v1/models", response_model=P.ModelList)
    async def models() -> dict:
        card = P.ModelCard(id=model_name, created=P.now_s(), max_model_len=max_model_len)
        return P.ModelList(data=[card]).model_dump()

    @app.get("/health", response_model=P.HealthResponse,
             responses={503: {"model": P.ErrorResponse, "description": "the engine loop stopped"}})
    async def health() -> JSONResponse:
        state = loop.health()
        if not state.alive:
            return _error_response(503, f"engine loop is not running (last error: {state.last_error})",
                                   type="server_error")
        return JSONResponse(P.HealthResponse(engine_restarts=state.restarts,
                                             last_engine_error=state.last_error).model_dump())

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)


def api_key_from_env(explicit: str | None) -> str | None:
    """An explicit key wins; otherwise DRAFTSMITH_API_KEY (keeps keys out of shell history)."""
    return explicit or os.environ.get("DRAFTSMITH_API_KEY") or None
