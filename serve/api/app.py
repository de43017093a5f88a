"""The HTTP application: OpenAI and KServe routes, `/metrics`, health, behind the optional bearer API key."""
from __future__ import annotations

import functools
import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from dsflash.serve.api import kserve_http, openai
from dsflash.serve.api.core import Frontend
from dsflash.serve.api.httputil import kserve_error, openai_error
from dsflash.serve.api.security import PUBLIC_PATHS, APIError, bearer_ok


class AuthMiddleware:
    """ASGI middleware: every path except the health probes needs `Authorization: Bearer <key>` when a key is set."""

    def __init__(self, app, api_key: str | None, metrics):
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.api_key is None or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        if bearer_ok(auth, self.api_key):
            return await self.app(scope, receive, send)
        self.metrics.record_error(401)
        err = APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")
        response = openai_error(err) if scope["path"].startswith("/v1") else kserve_error(err)
        await response(scope, receive, send)


def build_app(fe: Frontend, api_key: str | None = None) -> Starlette:
    def bind(handler, **kw):
        @functools.wraps(handler)
        async def endpoint(request: Request) -> Response:
            return await handler(fe, request, **kw)
        return endpoint

    async def health(request: Request) -> Response:
        return Response(status_code=200 if fe.engine.ready else 503)

    async def version(request: Request) -> Response:
        from dsflash.serve.cli import package_version
        return JSONResponse({"version": package_version()})

    async def metrics(request: Request) -> Response:
        try:
            stats = fe.engine.stats()
        except Exception:  # noqa: BLE001 - metrics must answer even while the engine is failing
            stats = None
        return PlainTextResponse(fe.metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def not_found(request: Request, exc) -> Response:
        err = APIError(404, f"no route {request.method} {request.url.path}")
        return openai_error(err) if request.url.path.startswith("/v1") else kserve_error(err)

    async def method_not_allowed(request: Request, exc) -> Response:
        body = {"error": f"method {request.method} not allowed on {request.url.path}"}
        return Response(json.dumps(body), status_code=405, media_type="application/json")

    kv = kserve_http
    routes = [
        Route("/health", health), Route("/version", version), Route("/metrics", metrics),
        Route("/v1/models", bind(openai.list_models)),
        Route("/v1/completions", bind(openai.completions), methods=["POST"]),
        Route("/v1/chat/completions", bind(openai.chat_completions), methods=["POST"]),
        Route("/v2", bind(kv.server_metadata)),
        Route("/v2/health/live", bind(kv.live)), Route("/v2/health/ready", bind(kv.ready)),
    ]
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        routes += [
            Route(prefix, bind(kv.model_metadata)),
            Route(prefix + "/ready", bind(kv.model_ready)),
            Route(prefix + "/config", bind(kv.model_config)),
            Route(prefix + "/infer", bind(kv.infer), methods=["POST"]),
            Route(prefix + "/generate", bind(kv.generate), methods=["POST"]),
            Route(prefix + "/generate_stream", bind(kv.generate, stream=True), methods=["POST"]),
        ]
    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: method_not_allowed})
    app.add_middleware(AuthMiddleware, api_key=api_key, metrics=fe.metrics)
    return app
