"""One inference loop per model, fed by a queue, batching by token budget.

Requests put their items on the queue and await a future. The loop, a thread of its own (torch
releases the GIL, so the event loop keeps answering), takes what arrived before each forward,
drops the requests whose client has gone, sorts the waiting requests by length (the tokens they
have left, shortest first) and cuts the next forward from the front, at most `max_batch_tokens`
tokens: the items of one request may be split across forwards, and items of many requests may
share one. A request's future is set when its last item is done. A short request thus never
waits for more than the forward in progress and the shorter requests before it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .tasks import Item

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Work:
    """One request's items, their results as they come, and the future that gets them all."""

    items: list[Item]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    queued_at: float = dataclasses.field(default_factory=time.perf_counter)
    results: list[Any] = dataclasses.field(default_factory=list)
    left: int = 0
    dropped: bool = False  # the client went away or the request timed out: skip what is left
    started: bool = False  # its first batch has run (its queue time is recorded once)
    next: int = 0  # its first item not yet put in a batch

    def __post_init__(self):
        self.results = [None] * len(self.items)
        self.left = len(self.items)


def _settle(future: asyncio.Future, value: Any = None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _kind(item: Item) -> tuple[str, bool]:
    return item.op, item.pair is not None  # one forward takes one op, and texts or pairs


def next_batch(pending: list[Work], max_batch_tokens: int) -> list[tuple[Work, int]]:
    """The next forward's (work, index) units: requests sorted by the tokens they have left
    (shortest first, then oldest), their next items taken in order up to `max_batch_tokens`
    tokens, all of the first one's kind. A request may be split across forwards and many share
    one; an item longer than the budget goes alone."""
    order = sorted(pending, key=lambda w: (sum(it.tokens for it in w.items[w.next :]), w.queued_at))
    kind = _kind(order[0].items[order[0].next])
    batch, tokens = [], 0
    for w in order:
        i = w.next
        while i < len(w.items) and _kind(w.items[i]) == kind:
            if batch and tokens + w.items[i].tokens > max_batch_tokens:
                return batch
            batch.append((w, i))
            tokens += w.items[i].tokens
            i += 1
    return batch


class Batcher:
    """The queue and the inference thread. `run(op, items) -> results` computes one batch;
    `observe(batch_items, queue_seconds, inference_seconds)` records each batch (metrics);
    `tidy()` runs between forwards, at most once every `TIDY_S` seconds (the server gives the
    heap's free pages back there)."""

    TIDY_S = 2.0

    def __init__(self, run: Callable[[str, list[Item]], list[Any]], max_batch_tokens: int, observe=None, tidy=None):
        self.run = run
        self.max_batch_tokens = max_batch_tokens
        self.observe = observe or (lambda *_: None)
        self.tidy = tidy
        self._tidied = time.monotonic()
        self._waiting: list[Work] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="bert-port-inference", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish what is queued, then end the loop (within `timeout` seconds)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    def queued_items(self) -> int:
        with self._cv:
            return sum(w.left for w in self._waiting if not w.dropped)

    async def submit(self, items: list[Item]) -> Work:
        """Queue `items`; await `work.future` for their results, in order."""
        loop = asyncio.get_running_loop()
        work = Work(items, loop.create_future(), loop)
        if not items:
            _settle(work.future, [])
            return work
        with self._cv:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            self._waiting.append(work)
            self._cv.notify()
        return work

    def _take(self, wait: bool) -> list[Work] | None:
        """What arrived since the last call; with `wait`, block until something does (None once
        stopping with nothing left)."""
        with self._cv:
            while wait and not self._waiting and not self._stopping:
                self._cv.wait()
            if wait and not self._waiting:
                return None
            taken, self._waiting = self._waiting, []
            return taken

    def _loop(self) -> None:
        """Between forwards, take what arrived, so a short request does not wait behind the whole
        queue: each forward is `next_batch` of everything pending."""
        pending: list[Work] = []
        while (taken := self._take(wait=not pending)) is not None:
            pending = [w for w in pending + taken if not w.dropped and w.next < len(w.items)]
            if pending:
                batch = next_batch(pending, self.max_batch_tokens)
                for w, i in batch:
                    w.next = i + 1
                self._run_batch(batch)
            if self.tidy is not None and time.monotonic() - self._tidied > self.TIDY_S:
                self.tidy()
                self._tidied = time.monotonic()

    def _run_batch(self, batch: list[tuple[Work, int]]) -> None:
        items = [w.items[i] for w, i in batch]
        start = time.perf_counter()
        try:
            results = self.run(items[0].op, items)
        except Exception as exc:  # a failed batch fails its requests, not the loop
            log.exception("a batch of %d inputs failed", len(items))
            for w in {w for w, _ in batch}:
                w.loop.call_soon_threadsafe(_settle, w.future, None, exc)
            return
        first = [w for w in {w for w, _ in batch} if not w.started]
        for w in first:
            w.started = True
        self.observe(items, [start - w.queued_at for w in first], time.perf_counter() - start)
        for (w, i), result in zip(batch, results):
            w.results[i] = result
            w.left -= 1
            if w.left == 0:
                w.loop.call_soon_threadsafe(_settle, w.future, w.results)
