"""The HTTP app: TEI's routes and OpenAI's embeddings route over one model (`create_app`).

Routes parse, validate and queue; `Batcher` computes. Every limit has a status code, in TEI's
error body `{"error": ..., "error_type": ...}`: 413 for an input or a client batch over the
limits (and a body over `payload_limit`), 422 for a malformed body, 429 when
`max_concurrent_requests` are in flight, 401 without the API key, 408 for a body that does not
arrive within `body_timeout`, 503 until the model is loaded and warm, 504 past `request_timeout`.
"""

from __future__ import annotations

import asyncio
import hmac
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from . import routes
from .state import ClientGone, ServeError, ServerState, ServeSettings, error_response
from .tasks import InputError

OPEN_PATHS = frozenset({"/health", "/docs", "/openapi.json", "/docs/oauth2-redirect"})


class Guard:
    """ASGI middleware in front of the routes: the API key, the body's size and deadline, and
    the request counter by route and status."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is None and scope["method"] == "POST":
                body, refusal = await self._read_body(receive)
                if body is None and refusal is None:
                    return  # the client left while sending
                receive = _replay(body, receive)
            if refusal is not None:
                return await refusal(scope, receive, counted_send)
            await self.app(scope, receive, counted_send)
        finally:
            self.state.metrics.requests.labels(scope["path"], str(status["code"])).inc()

    def _refusal(self, scope) -> JSONResponse | None:
        key = self.state.settings.api_key
        if not key or scope["path"] in OPEN_PATHS:
            return None
        given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        token = given[7:] if given[:7].lower() == "bearer " else ""
        if hmac.compare_digest(token.encode(), key.encode()):
            return None
        return error_response(401, "Unauthorized", "missing or wrong API key; send 'Authorization: Bearer <key>'")

    async def _read_body(self, receive) -> tuple[bytes | None, JSONResponse | None]:
        limit, chunks, size = self.state.settings.payload_limit, [], 0
        deadline = time.monotonic() + self.state.settings.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(deadline - time.monotonic(), 0))
            except TimeoutError:
                why = f"the request body did not arrive within {self.state.settings.body_timeout:g} s; send it whole"
                return None, error_response(408, "Timeout", why)
            if message["type"] == "http.disconnect":
                return None, None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                why = f"the request body is over {limit} bytes (--payload-limit); send fewer or shorter inputs"
                return None, error_response(413, "Validation", why)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def create_app(
    settings: ServeSettings, load: Callable[[], Any], on_failure: Callable[[str], None] | None = None
) -> FastAPI:
    """The app serving the task `load()` returns, loaded in a thread at start-up so that
    `/health` answers (503) while the model loads; `on_failure(message)` is called if it fails."""
    state = ServerState(settings, load, on_failure)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = threading.Thread(target=state.start, name="bert-port-load", daemon=True)
        loader.start()
        yield
        loader.join(timeout=1.0)
        if state.batcher is not None:
            state.batcher.stop()

    app = FastAPI(
        title="bert-port-serve", summary="TEI- and OpenAI-compatible routes over bert_port", lifespan=lifespan
    )
    app.state.serve = state
    app.add_middleware(Guard, state=state)

    @app.exception_handler(ServeError)
    async def _serve_error(request: Request, exc: ServeError):
        return error_response(exc.status, exc.error_type, exc.message)

    @app.exception_handler(InputError)
    async def _input_error(request: Request, exc: InputError):
        return error_response(413, "Validation", str(exc))

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone):
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _malformed(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"malformed request body: {where or 'body'}: {first.get('msg', 'invalid')}"
        return error_response(422, "Validation", message + "; see /docs for the request's schema")

    app.include_router(routes.router)
    return app
