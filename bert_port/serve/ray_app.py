"""The same app as a Ray Serve deployment: N replicas behind Ray's HTTP proxy, each a whole
`bert-port-serve` app (routes, limits, batching loop) over its own copy of the model.

    from bert_port.serve.ray_app import deployment
    from ray import serve
    serve.run(deployment("path/to/model", replicas=2), route_prefix="/")

Each replica builds its app in its own process (the model, the batching thread and the metrics
cannot be pickled from the driver) and hands Ray's requests to it as ASGI calls. Ray's usage
statistics are turned off before Ray starts from here.
"""

from __future__ import annotations

import os

from ..extras import require
from .app import create_app
from .state import ServeSettings
from .tasks import load_task


def _ray_serve():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    require("ray", "the Ray Serve deployment (pip install 'bert-port[ray-serve]')")
    from ray import serve

    return serve


def deployment(
    model: str,
    *,
    replicas: int = 2,
    threads: int = 1,
    task: str | None = None,
    quantization: str | None = None,
    settings: ServeSettings | None = None,
):
    """A bound Ray Serve application of `replicas` replicas serving `model`, each with `threads`
    CPU threads (and as many CPUs reserved in Ray)."""
    serve = _ray_serve()
    from starlette.responses import Response

    settings = settings or ServeSettings(model_name=os.path.basename(os.path.normpath(str(model))))

    @serve.deployment(num_replicas=replicas, ray_actor_options={"num_cpus": threads})
    class BertPortServe:
        def __init__(self):
            def load():
                return load_task(str(model), task, threads=threads, quantization=quantization, dtype=None)

            self.app = create_app(settings, load)
            self.app.state.serve.start()  # Ray calls no ASGI lifespan here: load and warm now
            self.replica = os.getpid()

        async def __call__(self, request):
            """Run the request through the app; collect its response."""
            sent = {"status": 500, "headers": [], "body": []}

            async def send(message):
                if message["type"] == "http.response.start":
                    sent["status"], sent["headers"] = message["status"], message.get("headers", [])
                elif message["type"] == "http.response.body":
                    sent["body"].append(message.get("body", b""))

            await self.app(request.scope, request.receive, send)
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in sent["headers"]}
            headers["x-bert-port-replica"] = str(self.replica)
            headers.pop("content-length", None)
            return Response(b"".join(sent["body"]), status_code=sent["status"], headers=headers)

    return BertPortServe.bind()
