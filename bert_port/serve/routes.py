"""TEI's routes (`/embed`, `/embed_all`, `/predict`, `/rerank`, `/tokenize`, `/decode`, `/`,
`/health`, `/info`, `/metrics`) and OpenAI's (`/v1/embeddings`, `/v1/models`), with their
request and response bodies. Each parses and validates, then awaits `ServerState.compute`."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response

from .schemas import (
    DecodeRequest,
    EmbedAllRequest,
    EmbedRequest,
    OpenAIEmbeddingRequest,
    PredictRequest,
    RerankRequest,
    TokenizeRequest,
)
from .state import ServeError, ServerState
from .tasks import ClassifierTask, EmbeddingTask, InputError, one_label


def _json(content: Any, status: int = 200) -> Response:
    # json.dumps straight to bytes: FastAPI's jsonable_encoder walks every float of every vector.
    return Response(
        json.dumps(content, separators=(",", ":")).encode(), status_code=status, media_type="application/json"
    )


def _texts(inputs: str | list, limit: int) -> list:
    texts = [inputs] if isinstance(inputs, str) else list(inputs)
    if not texts:
        raise ServeError(422, "Validation", "inputs is empty; send at least one text")
    if len(texts) > limit:
        raise ServeError(
            413,
            "Validation",
            f"the request has {len(texts)} inputs, over the server's --max-client-batch-size of {limit}; "
            "split it into smaller requests",
        )
    return texts


def _task(state: ServerState, *kinds: str):
    task = state.task
    if task is None:
        raise ServeError(
            503, "Unhealthy", state.load_error or "the model is loading; retry when GET /health answers 200"
        )
    if task.kind not in kinds:
        raise ServeError(
            400, "Validation", f"this server's model is for the {task.kind!r} task, which this route does not serve"
        )
    return task


def _prepared(prepare, *args):
    """The task's items, with a bad input as TEI answers it: 413 over the limit, 422 otherwise."""
    try:
        return prepare(*args)
    except InputError:
        raise
    except ValueError as exc:
        raise ServeError(422, "Validation", str(exc)) from None


def _truncate(state: ServerState, asked: bool | None) -> bool:
    return state.settings.auto_truncate if asked is None else asked


async def embed_vectors(request: Request, state: ServerState, body: EmbedRequest) -> tuple[list, int]:
    task: EmbeddingTask = _task(state, "embed")
    texts = _texts(body.inputs, state.settings.max_client_batch_size)
    width = task.encoder.get_sentence_embedding_dimension()
    if body.dimensions is not None and body.dimensions > width:
        raise ServeError(422, "Validation", f"dimensions {body.dimensions} is more than the model's {width}")
    direction = body.truncation_direction.lower()
    items = _prepared(task.prepare, texts, "embed", _truncate(state, body.truncate), direction, body.prompt_name)
    rows = await state.compute(request, items)
    return [task.respond(r, body.dimensions, body.normalize) for r in rows], sum(it.tokens for it in items)


def _predict_inputs(inputs) -> tuple[list[tuple[str, str | None]], bool]:
    """TEI's PredictInput: a text, a pair [a, b], or a batch of [a] and [a, b] items."""
    if isinstance(inputs, str):
        return [(inputs, None)], True
    if inputs and all(isinstance(x, str) for x in inputs):
        if len(inputs) > 2:
            raise ServeError(
                422, "Validation", "inputs is a text, a pair [text, text], or a list of [text] or [text, text]"
            )
        return [(inputs[0], inputs[1] if len(inputs) == 2 else None)], True
    batch = []
    for x in inputs:
        if not isinstance(x, list) or not 1 <= len(x) <= 2:
            raise ServeError(422, "Validation", "each item of a batch is [text] or [text, text]")
        batch.append((x[0], x[1] if len(x) == 2 else None))
    return batch, False


async def predictions(request: Request, state: ServerState, body: PredictRequest) -> tuple[list, bool]:
    task: ClassifierTask = _task(state, "classify", "tag")
    inputs, single = _predict_inputs(body.inputs)
    _texts(inputs, state.settings.max_client_batch_size)
    if task.kind == "tag" and any(p is not None for _, p in inputs):
        raise ServeError(422, "Validation", "a token classifier tags single texts; send texts, not pairs")
    items = _prepared(task.prepare, inputs, _truncate(state, body.truncate))
    rows = await state.compute(request, items)
    if task.kind == "tag":
        return [row["entities"] for row in rows], single
    out = []
    for logits in rows:
        scores = task.scores(logits, body.raw_scores)
        ranked = sorted(zip(scores, task.names), key=lambda x: -x[0])
        out.append([{"score": s, "label": name} for s, name in ranked])
    return out, single


router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.serve


@router.get("/health")
async def health(request: Request):
    state = _state(request)
    if state.task is None:
        raise ServeError(503, "Unhealthy", state.load_error or "the model is loading")
    return _json({})


@router.get("/info")
async def info(request: Request):
    state = _state(request)
    return _json(_info(state))


@router.get("/metrics")
async def metrics(request: Request):
    return Response(_state(request).metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.post("/embed")
async def embed(request: Request, body: EmbedRequest):
    state = _state(request)
    vectors, _ = await embed_vectors(request, state, body)
    return _json(vectors)


@router.post("/embed_all")
async def embed_all(request: Request, body: EmbedAllRequest):
    state = _state(request)
    task: EmbeddingTask = _task(state, "embed")
    texts = _texts(body.inputs, state.settings.max_client_batch_size)
    args = (
        texts,
        "embed_all",
        _truncate(state, body.truncate),
        body.truncation_direction.lower(),
        body.prompt_name,
    )
    rows = await state.compute(request, _prepared(task.prepare, *args))
    return _json([r.tolist() for r in rows])


@router.post("/predict")
async def predict(request: Request, body: PredictRequest):
    state = _state(request)
    out, single = await predictions(request, state, body)
    return _json(out[0] if single else out)


@router.post("/rerank")
async def rerank(request: Request, body: RerankRequest):
    state = _state(request)
    return _json(await _rerank(request, state, body))


@router.post("/")
async def root(request: Request):
    """TEI's root route: the model's task (`huggingface_hub.InferenceClient(URL)` posts here).
    A classifier answers in the batch form, a list per input, as InferenceClient reads it."""
    state = _state(request)
    kind = _task(state, "embed", "classify", "tag").kind
    payload = await _body(request)
    if kind == "embed":
        vectors, _ = await embed_vectors(request, state, _parsed(EmbedRequest, payload))
        return _json(vectors)
    out, single = await predictions(request, state, _parsed(PredictRequest, payload))
    return _json(out[0] if single and kind == "tag" else out)


@router.post("/tokenize")
async def tokenize(request: Request, body: TokenizeRequest):
    state = _state(request)
    task = _task(state, "embed", "classify", "tag")
    texts = _texts(body.inputs, state.settings.max_client_batch_size)
    return _json([_tokens(task, t, body) for t in texts])


@router.post("/decode")
async def decode(request: Request, body: DecodeRequest):
    state = _state(request)
    task = _task(state, "embed", "classify", "tag")
    sequences = [body.ids] if body.ids and isinstance(body.ids[0], int) else body.ids
    return _json(task.tokenizer.decode_batch(sequences, skip_special_tokens=body.skip_special_tokens))


@router.post("/v1/embeddings")
async def openai_embeddings(request: Request, body: OpenAIEmbeddingRequest):
    state = _state(request)
    return _json(await _openai(request, state, body))


@router.get("/v1/models")
async def models(request: Request):
    state = _state(request)
    entry = {"id": state.settings.model_name, "object": "model", "created": 0, "owned_by": "bert-port"}
    return _json({"object": "list", "data": [entry]})


async def _body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError as exc:
        raise ServeError(422, "Validation", f"the request body is not JSON: {exc}") from None


def _parsed(model, payload):
    from pydantic import ValidationError

    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise ServeError(422, "Validation", f"malformed request body: {where}: {first['msg']}") from None


async def _rerank(request: Request, state: ServerState, body: RerankRequest) -> list[dict]:
    task: ClassifierTask = _task(state, "classify")
    if not one_label(task):
        raise ServeError(
            400, "Validation", f"/rerank needs a model with one label (a reranker); this one has {len(task.names)}"
        )
    _texts(body.texts, state.settings.max_client_batch_size)
    items = _prepared(task.prepare, [(body.query, t) for t in body.texts], _truncate(state, body.truncate))
    rows = await state.compute(request, items)
    scores = [r.tolist()[0] if body.raw_scores else float(r.sigmoid()[0]) for r in rows]
    ranks = sorted(range(len(scores)), key=lambda i: -scores[i])
    return [{"index": i, "score": scores[i]} | ({"text": body.texts[i]} if body.return_text else {}) for i in ranks]


async def _openai(request: Request, state: ServerState, body: OpenAIEmbeddingRequest) -> dict:
    """OpenAI's embeddings response: normalized vectors (as TEI's OpenAI route gives them),
    floats or base64 of little-endian float32."""
    task: EmbeddingTask = _task(state, "embed")
    inp = body.input
    if isinstance(inp, list) and inp and isinstance(inp[0], int):
        inp = [inp]
    if isinstance(inp, list) and inp and isinstance(inp[0], list):
        _texts(inp, state.settings.max_client_batch_size)
        items = _prepared(task.prepare_ids, inp, state.settings.auto_truncate)
        rows = await state.compute(request, items)
        vectors, tokens = [task.respond(r, body.dimensions, True) for r in rows], sum(it.tokens for it in items)
    else:
        vectors, tokens = await embed_vectors(request, state, EmbedRequest(inputs=inp, dimensions=body.dimensions))
    if body.encoding_format == "base64":
        vectors = [base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode() for v in vectors]
    data = [{"object": "embedding", "embedding": v, "index": i} for i, v in enumerate(vectors)]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": state.settings.model_name, "usage": usage}


def _tokens(task, text: str, body: TokenizeRequest) -> list[dict]:
    if body.prompt_name is not None and isinstance(task, EmbeddingTask):
        text = _prepared(task.encoder.resolve_prompt, None, body.prompt_name) + text
    e = task.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    return [
        {
            "id": i,
            "text": tok if s else text[a:b],
            "special": bool(s),
            "start": None if s else a,
            "stop": None if s else b,
        }
        for i, tok, s, (a, b) in zip(e.ids, e.tokens, e.special_tokens_mask, e.offsets)
    ]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bert-port")
    except PackageNotFoundError:
        return "unknown"


def _info(state: ServerState) -> dict:
    s, task = state.settings, state.task
    info = {
        "model_id": s.model_name,
        "model_sha": None,
        "max_concurrent_requests": s.max_concurrent_requests,
        "max_batch_tokens": s.max_batch_tokens,
        "max_batch_requests": None,
        "max_client_batch_size": s.max_client_batch_size,
        "auto_truncate": s.auto_truncate,
        "tokenization_workers": 1,
        "version": _version(),
    }
    if task is None:
        return info
    model = task.encoder.model if isinstance(task, EmbeddingTask) else task.predictor.model
    info["model_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    info["max_input_length"] = task.max_input_length
    if isinstance(task, EmbeddingTask):
        info["model_type"] = {"embedding": {"pooling": "+".join(task.encoder.pooling)}}
    else:
        id2label = dict(enumerate(task.names))
        info["model_type"] = {"classifier": {"id2label": id2label, "label2id": {v: k for k, v in id2label.items()}}}
    return info
