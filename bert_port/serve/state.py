"""The server's state: its settings, the loaded task and its batcher, the admission count,
and TEI's error body (`ServeError`). Routes call `ServerState.compute`."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from ..speed import kernels
from .batching import Batcher
from .metrics import Metrics
from .tasks import Item

log = logging.getLogger(__name__)


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
    # Give the heap's free pages back between batches (glibc): batches of changing shapes leave
    # freed activations in the heap, and the resident memory of a long-running server grows.
    trim_heap: bool = True


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
            tidy = kernels.trim_heap if self.settings.trim_heap else None
            batcher = Batcher(task.run, self.settings.max_batch_tokens, self.metrics.observe_batch, tidy)
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
