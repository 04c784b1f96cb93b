"""`bert-port-serve`: a model behind TEI's and OpenAI's HTTP routes.

    bert-port-serve path/to/model --port 8080
    curl -s localhost:8080/embed -H 'Content-Type: application/json' -d '{"inputs": "a sentence"}'

MODEL is a folder (a sentence-transformers folder, a plain encoder, a fine-tuned output folder
of this project) or a model id in the HF cache; the task follows from it (embeddings, /predict
and /rerank for a sequence classifier, entities for a token classifier) and --task overrides it.
The model is fixed at start: no request names a file or a model. The API key also comes from
the environment variable BERT_PORT_API_KEY. SIGTERM stops accepting requests, finishes those
in flight within --drain-timeout seconds, and exits 0. docs/serving.md has the routes.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from bert_port.cli import add_threads_flag, positive_int

API_KEY_ENV = "BERT_PORT_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bert-port-serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("model", help="checkpoint folder or a model id in the HF cache")
    p.add_argument("--task", choices=("embed", "classify", "tag"), default=None, help="override the checkpoint's task")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    p.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (or set {API_KEY_ENV})")
    p.add_argument(
        "--served-model-name", default=None, help="the name /info and /v1/models give (default: the folder's)"
    )
    p.add_argument("--max-batch-tokens", type=positive_int, default=16384, help="tokens per forward (default 16384)")
    p.add_argument(
        "--max-concurrent-requests", type=positive_int, default=512, help="requests in flight before 429 (default 512)"
    )
    p.add_argument("--max-client-batch-size", type=positive_int, default=32, help="inputs per request (default 32)")
    p.add_argument("--auto-truncate", action="store_true", help="truncate over-long inputs instead of answering 413")
    p.add_argument(
        "--payload-limit", type=positive_int, default=2_000_000, help="bytes of a request body (default 2 MB)"
    )
    p.add_argument("--body-timeout", type=float, default=30.0, help="seconds for a request body to arrive (default 30)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds to answer a request (default 120)")
    p.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds to finish requests at SIGTERM (default 30)"
    )
    add_threads_flag(p)
    p.add_argument("--quantization", choices=("int8",), default=None, help="int8 dense layers (CPU only)")
    p.add_argument("--dtype", choices=("float32", "bf16"), default="float32", help="weights' dtype (default float32)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"), help="log level")
    return p


def _server_class():
    import contextlib
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, stopping on SIGTERM and SIGINT by draining and exiting 0: uvicorn raises
        the signal again after its graceful shutdown, which ends the process with -15."""

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    return Server


def _model_name(model: str) -> str:
    """A folder's name (its parent's where the folder is a generic "model"), or the model id."""
    path = Path(model).expanduser()
    if not path.is_dir():
        return model
    path = path.resolve()
    return path.parent.name if path.name == "model" else path.name


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import uvicorn

        from bert_port.serve.app import create_app
        from bert_port.serve.state import ServeSettings
        from bert_port.serve.tasks import load_task
    except ImportError as exc:
        print(
            f"bert-port-serve needs the serve extra ({exc.name} is missing): pip install 'bert-port[serve]'",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from bert_port.speed import kernels

    # This process's own allocator: activations in mappings of their own, returned when freed,
    # so the resident memory stays flat under a long load (as bert-port-embed sets it).
    kernels.map_large_blocks()
    settings = ServeSettings(
        model_name=args.served_model_name or _model_name(args.model),
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_batch_tokens=args.max_batch_tokens,
        max_concurrent_requests=args.max_concurrent_requests,
        max_client_batch_size=args.max_client_batch_size,
        auto_truncate=args.auto_truncate,
        payload_limit=args.payload_limit,
        request_timeout=args.request_timeout,
        body_timeout=args.body_timeout,
    )
    dtype = "bfloat16" if args.dtype == "bf16" else None

    def load():
        return load_task(args.model, args.task, threads=args.threads, quantization=args.quantization, dtype=dtype)

    failed: list[str] = []

    def stop(message: str) -> None:  # a model that cannot load ends the process: one line, exit 2
        failed.append(message)
        server.should_exit = True

    app = create_app(settings, load, on_failure=stop)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.drain_timeout,
        limit_concurrency=args.max_concurrent_requests * 2 + 16,
        timeout_keep_alive=5,
        access_log=args.log_level == "debug",  # a line per request costs throughput under load
    )
    server = _server_class()(config)
    server.run()
    if failed:
        print(f"bert-port-serve: {failed[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
