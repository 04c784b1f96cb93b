"""The serving bench's baseline: `SentenceTransformer` behind the minimal FastAPI app a user
writes by hand, one request at a time.

`POST /v1/embeddings` takes OpenAI's body and encodes its texts under a lock (no batching
across requests, no queue but the event loop's), and `GET /health` answers once the model is
loaded. Run as `python -m bert_port.bench.st_server MODEL_DIR --port P --threads N`; uvicorn
serves it on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import threading

from fastapi import FastAPI, Request, Response  # module level: FastAPI resolves the route's annotations here


def build_app(model_dir: str, threads: int):
    """The app over `SentenceTransformer(model_dir)` on the CPU with `threads` torch threads."""
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    model = SentenceTransformer(model_dir, device="cpu")
    model.encode(["warm up"])  # the first call allocates; /health answers after it
    lock = threading.Lock()
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        payload = await request.json()
        texts = payload["input"]
        texts = [texts] if isinstance(texts, str) else texts
        vectors = await _encode(lock, model, texts)
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
        out = {"object": "list", "data": data, "model": payload.get("model", ""), "usage": {}}
        return Response(json.dumps(out), media_type="application/json")

    return app


async def _encode(lock: threading.Lock, model, texts: list[str]) -> list[list[float]]:
    """Encode in a worker thread (the event loop keeps answering /health), one request at a time."""
    from starlette.concurrency import run_in_threadpool

    def work() -> list[list[float]]:
        with lock:
            return model.encode(texts, batch_size=32, convert_to_numpy=True).tolist()

    return await run_in_threadpool(work)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bert_port.bench.st_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", help="a sentence-transformers folder")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, required=True, help="port to listen on")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args(argv)
    import uvicorn

    uvicorn.run(build_app(args.model_dir, args.threads), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
