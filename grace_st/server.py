"""``grace-st serve``: an OpenAI-compatible embedding server (FastAPI on uvicorn).

``POST /v1/embeddings`` takes OpenAI's embeddings request (``input``: a string or a list of
strings; ``model``; ``encoding_format``: ``float`` or ``base64``; ``dimensions``) and answers in its
shape (``data`` with ``index`` and ``embedding``, ``model``, ``usage``), so the ``openai`` client and
LangChain's ``OpenAIEmbeddings`` work against it unchanged. Two extensions a generative embedder
needs: ``input_type`` (``query``, ``document`` or another prompt type of the model: its instruction
and rationale budget, as ``encode_query`` / ``encode_document`` / ``encode(prompt_name=...)``), and
``return_rationale`` (each item then carries the rationale it was embedded with). ``dimensions``
keeps the first N values, as sentence-transformers' ``truncate_dim`` does (no re-normalisation).
``usage.prompt_tokens`` counts the prompts the model read (template and instruction included);
``usage.total_tokens`` adds the rationale tokens it wrote.

Also ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus' text format: requests by
route and status, texts, texts queued, rows fed a decoding step or a prompt pass, request latency). With an API key
(``--api-key`` or ``GRACE_ST_API_KEY``) every route but ``/health`` wants ``Authorization: Bearer``.

Every request's texts go to one :class:`~grace_st.scheduler.Scheduler`, the only thread that
drives the model: texts of all requests decode together and each request is answered when its own
texts are done, each embedding bit for bit ``model.encode``'s.

Refused, in OpenAI's error-object shape, and the server goes on: malformed JSON, invalid UTF-8 or
lone surrogates, wrong types, an empty list, token arrays (400); an unknown model (404); a body,
a text count or a text over the limits (413); a full queue (429, ``Retry-After``); a server
shutting down (503). A client that disconnects has its rows dropped from the decode.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import os
import time

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .prompts import text_problem
from .scheduler import QueueFull, Scheduler, ShuttingDown

API_KEY_ENV = "GRACE_ST_API_KEY"


class RequestError(Exception):
    """A request refused: its HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class Limits:
    """What one request may ask: texts, characters a text, bytes a body."""

    def __init__(self, max_texts: int = 2048, max_chars: int = 32_768, max_body_bytes: int = 32 * 1024 * 1024):
        self.max_texts, self.max_chars, self.max_body_bytes = max_texts, max_chars, max_body_bytes


def parse_request(body: bytes, *, model_name: str, prompt_types: set[str], dimension: int, limits: Limits) -> dict:
    """The embeddings request in ``body``, checked: every problem is a :class:`RequestError` naming it."""
    try:
        payload = json.loads(body)
    except UnicodeDecodeError as error:
        raise RequestError(400, f"the body is not valid UTF-8 (byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise RequestError(400, f"the body is not valid JSON: {error}") from None
    if not isinstance(payload, dict):
        raise RequestError(400, f"the body must be a JSON object, not {type(payload).__name__}")
    model = payload.get("model")
    if not isinstance(model, str):
        raise RequestError(400, "'model' is required: a string naming the model", param="model")
    if model != model_name:
        raise RequestError(
            404,
            f"the model '{model}' does not exist; this server has '{model_name}'",
            param="model",
            code="model_not_found",
        )
    texts = payload.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list):
        raise RequestError(400, "'input' must be a string or a list of strings", param="input")
    if not texts:
        raise RequestError(400, "'input' is an empty list: send at least one text", param="input")
    if len(texts) > limits.max_texts:
        raise RequestError(
            413,
            f"'input' has {len(texts)} texts; at most {limits.max_texts} a request",
            param="input",
            code="too_many_inputs",
        )
    for index, text in enumerate(texts):
        if isinstance(text, (int, list)) and not isinstance(text, bool):
            raise RequestError(
                400, f"input[{index}] is a token array: this server embeds text, send strings", param="input"
            )
        problem = text_problem(text)
        if problem is not None:
            raise RequestError(400, f"input[{index}] {problem}", param="input")
        if len(text) > limits.max_chars:
            raise RequestError(
                413,
                f"input[{index}] has {len(text)} characters; at most {limits.max_chars} a text",
                param="input",
                code="input_too_long",
            )
    encoding = payload.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise RequestError(
            400, f"'encoding_format' must be 'float' or 'base64', not {encoding!r}", param="encoding_format"
        )
    dimensions = payload.get("dimensions")
    if dimensions is not None and (
        not isinstance(dimensions, int) or isinstance(dimensions, bool) or not 1 <= dimensions <= dimension
    ):
        raise RequestError(
            400, f"'dimensions' must be an integer from 1 to {dimension}, not {dimensions!r}", param="dimensions"
        )
    prompt_type = payload.get("input_type") or "default"
    if not isinstance(prompt_type, str) or prompt_type not in prompt_types:
        raise RequestError(
            400, f"'input_type' must be one of {sorted(prompt_types)}, not {prompt_type!r}", param="input_type"
        )
    return_rationale = payload.get("return_rationale", False)
    if not isinstance(return_rationale, bool):
        raise RequestError(400, "'return_rationale' must be true or false", param="return_rationale")
    return {
        "texts": texts,
        "encoding": encoding,
        "dimensions": dimensions,
        "prompt_type": prompt_type,
        "return_rationale": return_rationale,
    }


def _embedding_item(index: int, vector: np.ndarray, encoding: str, rationale: str | None) -> dict:
    # float32 to JSON: each value as the double it widens to, whose shortest repr reads back to the same float32
    value = base64.b64encode(vector.astype("<f4").tobytes()).decode() if encoding == "base64" else vector.tolist()
    item = {"object": "embedding", "index": index, "embedding": value}
    if rationale is not None:
        item["rationale"] = rationale
    return item


def create_app(
    model,
    *,
    model_name: str,
    api_key: str | None = None,
    limits: Limits | None = None,
    max_queued_texts: int = 1024,
    max_slots: int = 32,
):
    """The FastAPI app serving ``model`` (a GRACE SentenceTransformer) as ``model_name``; its scheduler
    starts and stops with the app's lifespan."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    limits = limits or Limits()
    registry = CollectorRegistry()
    requests_total = Counter(
        "grace_st_requests", "HTTP requests by route and status", ["route", "status"], registry=registry
    )
    texts_total = Counter("grace_st_texts", "texts embedded", registry=registry)
    buckets = (1, 2, 4, 8, 16, 32, 64, 128)
    rows_per_step = Histogram(
        "grace_st_rows_per_step", "rows fed a decoding step (all requests together)", buckets=buckets, registry=registry
    )
    rows_per_prompt_pass = Histogram(
        "grace_st_rows_per_prompt_pass",
        "rows of a prompt pass for texts that do not think (budget 0; all requests)",
        buckets=buckets,
        registry=registry,
    )

    def on_step(rows: int, prompt_pass: bool = False) -> None:
        (rows_per_prompt_pass if prompt_pass else rows_per_step).observe(rows)

    latency = Histogram(
        "grace_st_request_seconds",
        "time to answer an embeddings request",
        buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        registry=registry,
    )
    scheduler = Scheduler(model, max_slots=max_slots, max_queued_texts=max_queued_texts, on_step=on_step)
    Gauge("grace_st_queued_texts", "texts waiting or decoding", registry=registry).set_function(
        lambda: scheduler.queued_texts
    )
    encoder = model[0]
    prompt_types = set(encoder.instructions) | set(model.prompts) | {"default"}
    # sentence-transformers 6 renamed it
    dimension = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    dimension = dimension()
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop)  # what was submitted is finished first

    app = FastAPI(title="grace-st", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def error_response(error: RequestError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    def route_label(path: str) -> str:
        if path.startswith("/v1/models/"):
            return "/v1/models/{id}"
        # any other path one label: a label a path would make the metric grow with every URL a scanner tries
        return path if path in ("/v1/embeddings", "/v1/models", "/health", "/metrics") else "other"

    @app.middleware("http")
    async def count_and_authorise(request: Request, call_next):
        route = route_label(request.url.path)
        if api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                requests_total.labels(route, "401").inc()
                return error_response(
                    RequestError(401, "a valid API key is required (Authorization: Bearer KEY)", code="invalid_api_key")
                )
        response = await call_next(request)
        requests_total.labels(route, str(response.status_code)).inc()
        return response

    async def read_body(request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limits.max_body_bytes:
            raise RequestError(413, f"the body has {length} bytes; at most {limits.max_body_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise RequestError(413, f"the body is over {limits.max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def answer(request: Request, future):
        """The scheduler's answer, or None when the client left first (its rows are then dropped)."""
        waiter = asyncio.wrap_future(future)

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if waiter in done:
            return waiter.result()
        future.cancel()
        waiter.cancel()
        return None

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        start = time.perf_counter()
        try:
            asked = parse_request(
                await read_body(request),
                model_name=model_name,
                prompt_types=prompt_types,
                dimension=dimension,
                limits=limits,
            )
            if len(asked["texts"]) > max_queued_texts:  # would wait forever: not a matter of retrying
                raise RequestError(
                    413,
                    f"'input' has {len(asked['texts'])} texts; the server holds {max_queued_texts} at once",
                    param="input",
                    code="too_many_inputs",
                )
            try:
                future = scheduler.submit(asked["texts"], asked["prompt_type"], asked["return_rationale"])
            except QueueFull as error:
                raise RequestError(
                    429,
                    f"the server is busy: {error}; retry shortly",
                    kind="rate_limit_error",
                    code="queue_full",
                    headers={"Retry-After": "1"},
                ) from None
            except ShuttingDown as error:
                raise RequestError(503, str(error), kind="server_error", headers={"Retry-After": "5"}) from None
            try:
                result = await answer(request, future)
            except ValueError as error:  # the model refused the input: the request's fault
                raise RequestError(400, str(error), param="input") from None
        except RequestError as error:
            return error_response(error)
        except Exception as error:  # noqa: BLE001 (this request fails, the others go on)
            return error_response(RequestError(500, f"{type(error).__name__}: {error}", kind="server_error"))
        if result is None:
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
        vectors = result.embeddings
        if asked["dimensions"] is not None:
            vectors = vectors[:, : asked["dimensions"]]
        rationales = result.rationales or [None] * len(vectors)
        texts_total.inc(len(vectors))
        latency.observe(time.perf_counter() - start)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    _embedding_item(i, v, asked["encoding"], r) for i, (v, r) in enumerate(zip(vectors, rationales))
                ],
                "model": model_name,
                "usage": {
                    "prompt_tokens": result.prompt_tokens,
                    "total_tokens": result.prompt_tokens + result.rationale_tokens,
                },
            }
        )

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "grace-st"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str):
        if name != model_name:
            return error_response(RequestError(404, f"the model '{name}' does not exist", code="model_not_found"))
        return model_card()

    @app.get("/health")
    async def health():
        if not scheduler.alive:  # nothing would answer an embeddings request
            return JSONResponse({"status": "unavailable", "model": model_name}, status_code=503)
        return {"status": "ok", "model": model_name}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.state.scheduler = scheduler
    return app


def serve(
    model,
    *,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    limits: Limits | None = None,
    max_queued_texts: int = 1024,
    max_slots: int = 32,
    log_level: str = "info",
) -> None:
    """Serve ``model`` until interrupted; on SIGINT/SIGTERM the requests in flight are finished first."""
    import uvicorn

    api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    app = create_app(
        model,
        model_name=model_name,
        api_key=api_key,
        limits=limits,
        max_queued_texts=max_queued_texts,
        max_slots=max_slots,
    )
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=60)
