"""One inference loop per model, fed by a queue, batching by token budget.

Requests put their items on the queue and await a future. The loop, a thread of its own (torch
releases the GIL, so the event loop keeps answering), takes everything waiting, drops the items
of requests whose client has gone, sorts the rest by length and cuts them into batches of at
most `max_batch_tokens` tokens: the items of one request may be split across batches, and items
of many requests may share one. A request's future is set when its last item is done.
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


def cut_batches(units: list[tuple[Work, int]], max_batch_tokens: int) -> list[list[tuple[Work, int]]]:
    """(work, index) units cut into batches: grouped by op and by pair or not (one forward takes
    one kind), sorted by length, each batch at most `max_batch_tokens` tokens (an item longer than
    that goes alone)."""

    def key(unit):
        item = unit[0].items[unit[1]]
        return item.op, item.pair is not None, item.tokens

    batches, current, tokens, kind = [], [], 0, None
    for unit in sorted(units, key=key):
        item = unit[0].items[unit[1]]
        unit_kind = (item.op, item.pair is not None)
        if current and (unit_kind != kind or tokens + item.tokens > max_batch_tokens):
            batches.append(current)
            current, tokens = [], 0
        current.append(unit)
        tokens += item.tokens
        kind = unit_kind
    if current:
        batches.append(current)
    return batches


class Batcher:
    """The queue and the inference thread. `run(op, items) -> results` computes one batch;
    `observe(batch_items, queue_seconds, inference_seconds)` records each batch (metrics)."""

    def __init__(self, run: Callable[[str, list[Item]], list[Any]], max_batch_tokens: int, observe=None):
        self.run = run
        self.max_batch_tokens = max_batch_tokens
        self.observe = observe or (lambda *_: None)
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

    def _take(self) -> list[Work] | None:
        with self._cv:
            while not self._waiting and not self._stopping:
                self._cv.wait()
            if not self._waiting:
                return None
            taken, self._waiting = self._waiting, []
            return taken

    def _loop(self) -> None:
        while (taken := self._take()) is not None:
            units = [(w, i) for w in taken if not w.dropped for i in range(len(w.items))]
            for batch in cut_batches(units, self.max_batch_tokens):
                live = [(w, i) for w, i in batch if not w.dropped]
                if live:
                    self._run_batch(live)

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
