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
route and status, texts, texts queued, rows fed a decoding step or a prompt pass, request latency, the instruction
prefix cache's bytes, entries, hits and misses; ``/health`` reports the cache too). With an API key
(``--api-key`` or ``GRACE_ST_API_KEY``; an empty one is refused at startup) every route but ``/health`` wants
``Authorization: Bearer``.

Every request's texts go to one :class:`~grace_st.serve.scheduler.Scheduler`, the only thread that
drives the model: texts of all requests decode together and each request is answered when its own
texts are done, each embedding bit for bit ``model.encode``'s.

Refused, in OpenAI's error-object shape, and the server goes on: malformed JSON, a body not in UTF-8,
nesting deeper or integer literals longer than Python reads, lone surrogates, wrong types, an empty list,
token arrays (400); an unknown model (404); a body, a text count or a text over the limits (413); a full
queue (429, ``Retry-After``); a server shutting down, and a request still unanswered when the shutdown grace
ends (503). A client that disconnects has its rows dropped from the decode and is counted as 499.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import os
import reprlib
import time

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from grace_st.prompts import text_problem
from grace_st.runtime.prefix_cache import PREFIX_STORE
from grace_st.serve.scheduler import QueueFull, Scheduler, ShuttingDown

API_KEY_ENV = "GRACE_ST_API_KEY"
CLIENT_CLOSED = 499  # nginx's "client closed request": the client left before its answer; not the server's failure

# A client's value quoted in an error message: a few levels, a few dozen characters (a body may hold 32 MiB of one)
_quoted = reprlib.Repr()
_quoted.maxlevel, _quoted.maxstring, _quoted.maxlong, _quoted.maxother = 2, 60, 40, 60
_quoted.maxlist = _quoted.maxdict = 4


def api_key_from(given: str | None) -> str | None:
    """The API key the server requires: ``given`` (``--api-key``), else ``$GRACE_ST_API_KEY``, else none.

    A key no client could send is a configuration error (ValueError), not a way to run without one: an empty
    ``GRACE_ST_API_KEY`` would otherwise mean "no key" and an empty ``--api-key`` "no one gets in". Header values
    are ASCII with the spaces around them stripped, so a key must be printable ASCII with none at either end.
    """
    if given is not None:
        return _checked_api_key(given, "--api-key")
    given = os.environ.get(API_KEY_ENV)
    return None if given is None else _checked_api_key(given, API_KEY_ENV)


def _checked_api_key(key: str, source: str) -> str:
    if not key.strip():
        raise ValueError(f"the API key ({source}) is empty: give a key, or unset {API_KEY_ENV} to serve without one")
    if not (key.isascii() and key.isprintable()) or key != key.strip():
        raise ValueError(
            f"the API key ({source}) must be printable ASCII with no spaces at either end: a client sends it in an "
            "HTTP header, which carries nothing else"
        )
    return key


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
    payload = _json_object(body)
    # checked in this order, so a request with several problems is always refused for the same one
    _check_model(payload, model_name)
    return {
        "texts": _input_texts(payload, limits),
        "encoding": _encoding_format(payload),
        "dimensions": _dimensions(payload, dimension),
        "prompt_type": _input_type(payload, prompt_types),
        "return_rationale": _return_rationale(payload),
    }


def _json_object(body: bytes) -> dict:
    """The body as a JSON object. JSON over a network is UTF-8 (RFC 8259; a leading byte-order mark is let
    through): UTF-16 and UTF-32, which ``json.loads`` would take from bytes, are refused, as are invalid
    UTF-8, invalid JSON, nesting deeper than the parser's recursion goes, integer literals longer than Python
    converts (``sys.get_int_max_str_digits``), and JSON values other than an object."""
    encoding = json.detect_encoding(body)
    if encoding not in ("utf-8", "utf-8-sig"):
        raise RequestError(400, f"the body is not UTF-8 (it reads as {encoding.upper()}): send JSON in UTF-8")
    try:
        payload = json.loads(body.decode(encoding))
    except UnicodeDecodeError as error:
        raise RequestError(400, f"the body is not valid UTF-8 (byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise RequestError(400, f"the body is not valid JSON: {error}") from None
    except RecursionError:
        raise RequestError(400, "the body cannot be read: arrays or objects nested too deeply") from None
    except ValueError:  # the int-conversion limit; JSONDecodeError is a ValueError too, caught above
        raise RequestError(400, "the body cannot be read: an integer literal with too many digits") from None
    if not isinstance(payload, dict):
        raise RequestError(400, f"the body must be a JSON object, not {type(payload).__name__}")
    return payload


def _check_model(payload: dict, model_name: str) -> None:
    """``model`` must be given and name this server's model (404 otherwise, as OpenAI answers)."""
    model = payload.get("model")
    if not isinstance(model, str):
        raise RequestError(400, "'model' is required: a string naming the model", param="model")
    if model != model_name:
        raise RequestError(
            404,
            f"the model {_quoted.repr(model)} does not exist; this server has '{model_name}'",
            param="model",
            code="model_not_found",
        )


def _input_texts(payload: dict, limits: Limits) -> list[str]:
    """``input`` as a list of texts: a string or a non-empty list of strings, within the count and length limits."""
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
        _check_text(index, text, limits)
    return texts


def _check_text(index: int, text, limits: Limits) -> None:
    """One text of ``input``: a valid string (not a token array) of at most ``limits.max_chars`` characters."""
    if isinstance(text, (int, list)) and not isinstance(text, bool):
        raise RequestError(
            400, f"input[{index}] is a token array: this server embeds text, send strings", param="input"
        )
    if not isinstance(text, str):
        raise RequestError(
            400, f"input[{index}] is {type(text).__name__}, not str: {_quoted.repr(text)}", param="input"
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


def _given(payload: dict, field: str, default):
    """``payload[field]``, or ``default`` where it is left out or null; any other value (``""``, ``false``,
    ``0``, ``[]``) is the caller's to check, never taken for the default."""
    value = payload.get(field)
    return default if value is None else value


def _encoding_format(payload: dict) -> str:
    """``encoding_format``: ``float`` (the default) or ``base64``."""
    encoding = _given(payload, "encoding_format", "float")
    if not isinstance(encoding, str) or encoding not in ("float", "base64"):
        raise RequestError(
            400,
            f"'encoding_format' must be 'float' or 'base64', not {_quoted.repr(encoding)}",
            param="encoding_format",
        )
    return encoding


def _dimensions(payload: dict, dimension: int) -> int | None:
    """``dimensions``: None (every value), or how many leading values to keep, from 1 to the model's dimension."""
    dimensions = payload.get("dimensions")
    if dimensions is not None and (
        not isinstance(dimensions, int) or isinstance(dimensions, bool) or not 1 <= dimensions <= dimension
    ):
        raise RequestError(
            400,
            f"'dimensions' must be an integer from 1 to {dimension}, not {_quoted.repr(dimensions)}",
            param="dimensions",
        )
    return dimensions


def _input_type(payload: dict, prompt_types: set[str]) -> str:
    """``input_type``: one of the model's prompt types, ``default`` when not given."""
    prompt_type = _given(payload, "input_type", "default")
    if not isinstance(prompt_type, str) or prompt_type not in prompt_types:
        raise RequestError(
            400,
            f"'input_type' must be one of {sorted(prompt_types)}, not {_quoted.repr(prompt_type)}",
            param="input_type",
        )
    return prompt_type


def _return_rationale(payload: dict) -> bool:
    """``return_rationale``: a boolean, false when not given."""
    return_rationale = _given(payload, "return_rationale", False)
    if not isinstance(return_rationale, bool):
        raise RequestError(400, "'return_rationale' must be true or false", param="return_rationale")
    return return_rationale


def _embedding_item(index: int, vector: np.ndarray, encoding: str, rationale: str | None) -> dict:
    # float32 to JSON: each value as the double it widens to, whose shortest repr reads back to the same float32
    value = base64.b64encode(vector.astype("<f4").tobytes()).decode() if encoding == "base64" else vector.tolist()
    item = {"object": "embedding", "index": index, "embedding": value}
    if rationale is not None:
        item["rationale"] = rationale
    return item


def _error_response(error: RequestError) -> JSONResponse:
    """A refusal in OpenAI's error-object shape, with its status and headers."""
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _route_label(path: str) -> str:
    """The ``route`` label a request is counted under."""
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    # any other path one label: a label a path would make the metric grow with every URL a scanner tries
    return path if path in ("/v1/embeddings", "/v1/models", "/health", "/metrics") else "other"


async def _read_body(request: Request, limits: Limits) -> bytes:
    """The request's body, refused (413) as soon as it is known to be over ``limits.max_body_bytes``."""
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


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _answer(request: Request, future):
    """The scheduler's answer, or None when the client left first. Either way out (the client gone, or this
    task cancelled at shutdown), the future is cancelled, so the scheduler drops the rows."""
    waiter = asyncio.wrap_future(future)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        future.cancel()
        raise
    finally:
        watcher.cancel()
    if waiter in done:
        return waiter.result()
    future.cancel()
    waiter.cancel()
    return None


class _Metrics:
    """The server's Prometheus series, in a registry of the app's own."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter(
            "grace_st_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self.texts = Counter("grace_st_texts", "texts embedded", registry=self.registry)
        buckets = (1, 2, 4, 8, 16, 32, 64, 128)
        self.rows_per_step = Histogram(
            "grace_st_rows_per_step",
            "rows fed a decoding step (all requests together)",
            buckets=buckets,
            registry=self.registry,
        )
        self.rows_per_prompt_pass = Histogram(
            "grace_st_rows_per_prompt_pass",
            "rows of a prompt pass for texts that do not think (budget 0; all requests)",
            buckets=buckets,
            registry=self.registry,
        )
        self.latency = Histogram(
            "grace_st_request_seconds",
            "time to answer an embeddings request",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )

    def on_step(self, rows: int, prompt_pass: bool = False) -> None:
        """The scheduler's report of each decoding step or prompt pass."""
        (self.rows_per_prompt_pass if prompt_pass else self.rows_per_step).observe(rows)

    def watch_queue(self, scheduler: Scheduler) -> None:
        """A gauge of ``scheduler``'s texts, read when the metrics are scraped."""
        from prometheus_client import Gauge

        Gauge("grace_st_queued_texts", "texts waiting or decoding", registry=self.registry).set_function(
            lambda: scheduler.queued_texts
        )
        for name, what in (("bytes", "bytes held"), ("entries", "prefixes held"), ("hits", "lookups that found"),
                           ("misses", "lookups that computed")):
            gauge = Gauge(f"grace_st_prefix_cache_{name}", f"instruction prefix cache: {what}", registry=self.registry)
            gauge.set_function(lambda name=name: PREFIX_STORE.stats()[name])

    def exposition(self) -> Response:
        """Every series in Prometheus' text format."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class _EmbeddingService:
    """What the routes of :func:`create_app` do: one model, its scheduler and metrics, the API key and limits."""

    def __init__(
        self,
        model,
        *,
        model_name: str,
        api_key: str | None,
        limits: Limits,
        max_queued_texts: int,
        max_queued_chars: int,
        max_slots: int,
        prompt_pass_tokens: int,
    ):
        self.model_name, self.api_key = model_name, api_key
        self.limits, self.max_queued_texts, self.max_queued_chars = limits, max_queued_texts, max_queued_chars
        self.metrics = _Metrics()
        self.scheduler = Scheduler(
            model,
            max_slots=max_slots,
            max_queued_texts=max_queued_texts,
            max_queued_chars=max_queued_chars,
            prompt_pass_tokens=prompt_pass_tokens,
            on_step=self.metrics.on_step,
        )
        self.shutting_down = False
        self._in_flight: set[asyncio.Future] = set()  # one a request running: done when the shutdown grace ends
        self.metrics.watch_queue(self.scheduler)
        encoder = model[0]
        self.prompt_types = set(encoder.instructions) | set(model.prompts) | {"default"}
        # sentence-transformers 6 renamed it
        dimension = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        self.dimension = dimension()
        self.created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        """The scheduler runs while the app does."""
        self.scheduler.start()
        yield
        await asyncio.to_thread(self.scheduler.stop)  # what was submitted is finished first

    def begin_shutdown(self, grace: float) -> None:
        """The server stops taking connections: from now a new embeddings request is refused (503), and the
        requests in flight have ``grace`` seconds to finish; then each is answered 503 and its rows dropped."""
        self.shutting_down = True
        asyncio.get_running_loop().call_later(grace, self._end_grace)

    def _end_grace(self) -> None:
        for grace_over in self._in_flight:
            if not grace_over.done():
                grace_over.set_result(None)

    async def count_and_authorise(self, request: Request, call_next):
        """Count every request by route and status; with an API key, refuse (401) one without it."""
        route = _route_label(request.url.path)
        if self.api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                self.metrics.requests.labels(route, "401").inc()
                return _error_response(
                    RequestError(401, "a valid API key is required (Authorization: Bearer KEY)", code="invalid_api_key")
                )
        response = await call_next(request)
        self.metrics.requests.labels(route, str(response.status_code)).inc()
        return response

    async def embeddings(self, request: Request) -> Response:
        """``POST /v1/embeddings``: the answer, or a refusal in OpenAI's error shape; 499 when the client left
        first; 503 when the shutdown grace ends before the answer."""
        if self.shutting_down:
            return _error_response(_shutting_down("the server is shutting down"))
        work = asyncio.ensure_future(self._embeddings(request))
        grace_over = asyncio.get_running_loop().create_future()
        self._in_flight.add(grace_over)
        try:
            await asyncio.wait({work, grace_over}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            raise
        finally:
            self._in_flight.discard(grace_over)
        if work.done():
            return work.result()
        work.cancel()  # its scheduler future is cancelled with it (_answer): its rows are dropped
        with contextlib.suppress(asyncio.CancelledError):
            await work
        return _error_response(_shutting_down("the server shut down before this request was answered"))

    async def _embeddings(self, request: Request) -> Response:
        start = time.perf_counter()
        try:
            asked = parse_request(
                await _read_body(request, self.limits),
                model_name=self.model_name,
                prompt_types=self.prompt_types,
                dimension=self.dimension,
                limits=self.limits,
            )
            future = self._submit(asked)
            try:
                result = await _answer(request, future)
            except ValueError as error:  # the model refused the input: the request's fault
                raise RequestError(400, str(error), param="input") from None
        except RequestError as error:
            return _error_response(error)
        except ClientDisconnect:  # it left while sending its body: nothing to answer, and not a server error
            return Response(status_code=CLIENT_CLOSED)
        except Exception as error:  # noqa: BLE001 (this request fails, the others go on)
            return _error_response(RequestError(500, f"{type(error).__name__}: {error}", kind="server_error"))
        if result is None:
            return Response(status_code=CLIENT_CLOSED)  # nobody reads it
        return self._embeddings_response(asked, result, start)

    def _submit(self, asked: dict):
        """The request's texts handed to the scheduler; a full queue or a shutdown is the request's refusal."""
        # more than the queue ever holds would wait forever: 413, not a matter of retrying
        if len(asked["texts"]) > self.max_queued_texts:
            raise RequestError(
                413,
                f"'input' has {len(asked['texts'])} texts; the server holds {self.max_queued_texts} at once",
                param="input",
                code="too_many_inputs",
            )
        chars = sum(map(len, asked["texts"]))
        if chars > self.max_queued_chars:
            raise RequestError(
                413,
                f"'input' has {chars} characters; the server holds {self.max_queued_chars} at once",
                param="input",
                code="input_too_long",
            )
        try:
            return self.scheduler.submit(asked["texts"], asked["prompt_type"], asked["return_rationale"])
        except QueueFull as error:
            raise RequestError(
                429,
                f"the server is busy: {error}; retry shortly",
                kind="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        except ShuttingDown as error:
            raise _shutting_down(str(error)) from None

    def _embeddings_response(self, asked: dict, result, start: float) -> JSONResponse:
        """The scheduler's result in OpenAI's shape, counted and timed from ``start``."""
        vectors = result.embeddings
        if asked["dimensions"] is not None:
            vectors = vectors[:, : asked["dimensions"]]
        rationales = result.rationales or [None] * len(vectors)
        self.metrics.texts.inc(len(vectors))
        self.metrics.latency.observe(time.perf_counter() - start)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    _embedding_item(i, v, asked["encoding"], r) for i, (v, r) in enumerate(zip(vectors, rationales))
                ],
                "model": self.model_name,
                "usage": {
                    "prompt_tokens": result.prompt_tokens,
                    "total_tokens": result.prompt_tokens + result.rationale_tokens,
                },
            }
        )

    def model_card(self) -> dict:
        """The model as ``/v1/models`` lists it."""
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "grace-st"}

    def one_model(self, name: str):
        """``GET /v1/models/{name}``: this server's model, or 404."""
        if name != self.model_name:
            return _error_response(RequestError(404, f"the model '{name}' does not exist", code="model_not_found"))
        return self.model_card()

    def health(self):
        """``GET /health``: 503 once the scheduler is dead, since nothing would answer an embeddings request."""
        if not self.scheduler.alive:
            return JSONResponse({"status": "unavailable", "model": self.model_name}, status_code=503)
        return {"status": "ok", "model": self.model_name, "prefix_cache": PREFIX_STORE.stats()}


def _shutting_down(message: str) -> RequestError:
    return RequestError(503, message, kind="server_error", code="shutting_down", headers={"Retry-After": "5"})


def create_app(
    model,
    *,
    model_name: str,
    api_key: str | None = None,
    limits: Limits | None = None,
    max_queued_texts: int = 1024,
    max_queued_chars: int = 8 * 1024 * 1024,
    max_slots: int = 32,
    prompt_pass_tokens: int = 2048,
):
    """The FastAPI app serving ``model`` (a GRACE SentenceTransformer) as ``model_name``; its scheduler
    starts and stops with the app's lifespan. ``api_key``: None for none; a key no client could send
    (empty, see :func:`api_key_from`) is a ValueError."""
    if api_key is not None:
        _checked_api_key(api_key, "api_key")
    service = _EmbeddingService(
        model,
        model_name=model_name,
        api_key=api_key,
        limits=limits or Limits(),
        max_queued_texts=max_queued_texts,
        max_queued_chars=max_queued_chars,
        max_slots=max_slots,
        prompt_pass_tokens=prompt_pass_tokens,
    )
    app = FastAPI(title="grace-st", lifespan=service.lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def count_and_authorise(request: Request, call_next):
        return await service.count_and_authorise(request, call_next)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        return await service.embeddings(request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [service.model_card()]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str):
        return service.one_model(name)

    @app.get("/health")
    async def health():
        return service.health()

    @app.get("/metrics")
    async def metrics():
        return service.metrics.exposition()

    app.state.scheduler, app.state.service = service.scheduler, service
    return app


def create_server(
    app, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", shutdown_grace: float = 60
):
    """uvicorn's server for ``app`` (from :func:`create_app`). On SIGINT or SIGTERM it stops taking
    connections; the requests in flight get ``shutdown_grace`` seconds, then each still unanswered gets a
    503 in OpenAI's shape (never uvicorn's plain-text 500 and a traceback), and the process exits."""
    import uvicorn

    service = app.state.service

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            service.begin_shutdown(shutdown_grace)
            await super().shutdown(sockets)

    # uvicorn's own cancelling of what is left is the backstop only: by then every request has been answered
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_grace + 10
    )
    return Server(config)


def serve(
    model,
    *,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    limits: Limits | None = None,
    max_queued_texts: int = 1024,
    max_queued_chars: int = 8 * 1024 * 1024,
    max_slots: int = 32,
    prompt_pass_tokens: int = 2048,
    shutdown_grace: float = 60,
    log_level: str = "info",
) -> None:
    """Serve ``model`` until interrupted; on SIGINT/SIGTERM the requests in flight get ``shutdown_grace``
    seconds to finish (:func:`create_server`). ``api_key``: as :func:`api_key_from` reads it."""
    app = create_app(
        model,
        model_name=model_name,
        api_key=api_key_from(api_key),
        limits=limits,
        max_queued_texts=max_queued_texts,
        max_queued_chars=max_queued_chars,
        max_slots=max_slots,
        prompt_pass_tokens=prompt_pass_tokens,
    )
    create_server(app, host=host, port=port, log_level=log_level, shutdown_grace=shutdown_grace).run()
