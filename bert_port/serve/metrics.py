"""The server's Prometheus metrics, in a registry of its own (two apps in one process, as the
tests and Ray replicas make, do not collide): requests by route and status, inputs, tokens,
batch sizes, and queue and inference time as histograms."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKENS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "bert_port_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.inputs = Counter("bert_port_inputs", "Inputs (texts, pairs, id sequences) computed", registry=r)
        self.tokens = Counter("bert_port_tokens", "Tokens computed", registry=r)
        self.dropped = Counter(
            "bert_port_dropped_inputs", "Queued inputs dropped: client gone or timed out", registry=r
        )
        self.batch_size = Histogram("bert_port_batch_size", "Inputs per forward", buckets=_SIZES, registry=r)
        self.batch_tokens = Histogram("bert_port_batch_tokens", "Tokens per forward", buckets=_TOKENS, registry=r)
        self.queue_seconds = Histogram(
            "bert_port_queue_seconds", "Time a request waited for its first forward", buckets=_SECONDS, registry=r
        )
        self.inference_seconds = Histogram(
            "bert_port_inference_seconds", "Time of one forward", buckets=_SECONDS, registry=r
        )
        self.in_flight = Gauge("bert_port_requests_in_flight", "Requests admitted and not yet answered", registry=r)

    def observe_batch(self, items, queue_seconds: list[float], inference_seconds: float) -> None:
        self.inputs.inc(len(items))
        self.tokens.inc(sum(it.tokens for it in items))
        self.batch_size.observe(len(items))
        self.batch_tokens.observe(sum(it.tokens for it in items))
        for seconds in queue_seconds:
            self.queue_seconds.observe(seconds)
        self.inference_seconds.observe(inference_seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)
