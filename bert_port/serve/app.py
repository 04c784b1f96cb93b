"""The HTTP app: TEI's routes and OpenAI's embeddings route over one model (`create_app`).

Routes parse, validate and queue; `Batcher` computes. Every limit has a status code, in TEI's
error body `{"error": ..., "error_type": ...}`: 413 for an input or a client batch over the
limits (and a body over `payload_limit`), 422 for a malformed body, 429 when
`max_concurrent_requests` are in flight, 401 without the API key, 408 for a body that does not
arrive within `body_timeout`, 503 until the model is loaded and warm, 504 past `request_timeout`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from .batching import Batcher
from .metrics import Metrics
from .tasks import InputError, Item

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/docs", "/openapi.json", "/docs/oauth2-redirect"})


@dataclasses.dataclass
class ServeSettings:
    """The server's limits, named as TEI names them where TEI has them."""

    model_name: str = "bert-port"
    api_key: str | None = None
    max_batch_tokens: int = 16384
    max_concurrent_requests: int = 512
    max_client_batch_size: int = 32
    auto_truncate: bool = False
    payload_limit: int = 2_000_000  # bytes of a request body
    body_timeout: float = 30.0  # seconds for a request body to arrive whole
    request_timeout: float = 120.0  # seconds from queueing to the answer


class ServeError(Exception):
    """An error answered in TEI's body with `status`."""

    def __init__(self, status: int, error_type: str, message: str):
        super().__init__(message)
        self.status, self.error_type, self.message = status, error_type, message


def error_response(status: int, error_type: str, message: str) -> JSONResponse:
    return JSONResponse({"error": message, "error_type": error_type}, status_code=status)


class ServerState:
    """The loaded task (None while loading), its batcher, the metrics and the admission count."""

    def __init__(self, settings: ServeSettings, load: Callable[[], Any], on_failure: Callable[[str], None] | None):
        self.settings = settings
        self.load = load
        self.on_failure = on_failure
        self.metrics = Metrics()
        self.task: Any = None
        self.batcher: Batcher | None = None
        self.load_error: str | None = None
        self.in_flight = 0

    def start(self) -> None:
        """Load the model, start the inference loop, run one batch to warm it; then ready."""
        try:
            task = self.load()
            batcher = Batcher(task.run, self.settings.max_batch_tokens, self.metrics.observe_batch)
            warm = (
                task.prepare(["warm up"], "embed", True)
                if task.kind == "embed"
                else task.prepare([("warm up", None)], True)
            )
            task.run(warm[0].op, warm)
            batcher.start()
            self.task, self.batcher = task, batcher
            log.info("model loaded and warm: serving %s", self.settings.model_name)
        except Exception as exc:  # /health says why; the process log has the traceback
            self.load_error = f"the model failed to load: {exc}"
            log.debug("the model failed to load", exc_info=True)
            if self.on_failure is not None:
                self.on_failure(self.load_error)

    async def compute(self, request: Request, items: list[Item]) -> list[Any]:
        """`items` through the batcher: refused when not ready (503) or full (429); dropped when
        the client goes away or the request times out (504)."""
        if self.batcher is None:
            why = self.load_error or "the model is loading; retry when GET /health answers 200"
            raise ServeError(503, "Unhealthy", why)
        if self.in_flight >= self.settings.max_concurrent_requests:
            raise ServeError(
                429,
                "Overloaded",
                f"the server has {self.settings.max_concurrent_requests} requests in flight, its limit "
                "(--max-concurrent-requests); retry later",
            )
        self.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            return await self._await(request, await self.batcher.submit(items))
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()

    async def _await(self, request: Request, work) -> list[Any]:
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait(
                {work.future, gone}, timeout=self.settings.request_timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            gone.cancel()
        if work.future in done:
            try:
                return work.future.result()
            except Exception as exc:  # noqa: BLE001
                raise ServeError(500, "Backend", f"inference failed: {type(exc).__name__}: {exc}") from None
        work.dropped = True
        self.metrics.dropped.inc(max(work.left, 0))
        if gone in done:
            raise ClientGone
        raise ServeError(504, "Timeout", f"no answer within {self.settings.request_timeout:g} s (--request-timeout)")


class ClientGone(Exception):
    """The client closed the connection before its answer: nothing is sent."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
    from . import routes

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
