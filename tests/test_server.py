"""grace-st serve: OpenAI's embeddings API through real clients (the ``openai`` package, LangChain's
``OpenAIEmbeddings``, plain HTTP), bit for bit ``model.encode``; bad input, overload, clients that
leave and shutdown, each answered without disturbing other requests. Loopback only, tiny models."""

import base64
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from conftest import make_model, make_tokenizer

from grace_st import from_causal_lm, native_step
from grace_st.serve.scheduler import QueueFull, Scheduler
from grace_st.serve.server import Limits, create_app, create_server

needs_compiler = pytest.mark.skipif(native_step.library() is None, reason="no C compiler to build the native step")
KEY = "test-key"
TEXTS = ["cats", "A man is playing a guitar on stage.", "Stock markets fell after the rate decision.", ""]
BUDGETS = {"default": 5, "query": 3, "document": 0}


def tiny(**settings):
    tokenizer = make_tokenizer()
    settings.setdefault("max_rationale_tokens", BUDGETS)
    return from_causal_lm(model=make_model(tokenizer, hidden_size=64), tokenizer=tokenizer, device="cpu", **settings)


class Running:
    """``grace-st serve``'s uvicorn server on a free loopback port, in a thread."""

    def __init__(self, app, **options):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.server = create_server(app, host="127.0.0.1", port=self.port, log_level="warning", **options)
        self.thread = threading.Thread(target=self.server.run)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def post(self, body, key=KEY, **kwargs):
        kwargs.setdefault("timeout", 60)  # httpx's 5 s is short for 32 clients on a loaded 2-core machine
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if isinstance(body, (bytes, str)):
            return httpx.post(f"{self.url}/v1/embeddings", content=body, headers=headers, **kwargs)
        return httpx.post(f"{self.url}/v1/embeddings", json=body, headers=headers, **kwargs)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(60)


@pytest.fixture(scope="module")
def model():
    return tiny()


@pytest.fixture(scope="module")
def server(model):
    running = Running(
        create_app(
            model, model_name="tiny", api_key=KEY, limits=Limits(max_texts=8, max_chars=200, max_body_bytes=4096)
        )
    )
    yield running
    running.stop()


def expected(model, texts, kind):
    if kind == "query":
        return model.encode_query(texts)
    if kind == "document":
        return model.encode_document(texts)
    return model.encode(texts)


@needs_compiler
@pytest.mark.parametrize("kind", ["default", "query", "document"])
@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_the_openai_client_gets_encode_s_embeddings_bit_for_bit(server, model, kind, encoding):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    extra = {} if kind == "default" else {"input_type": kind}
    response = client.embeddings.create(input=TEXTS, model="tiny", encoding_format=encoding, extra_body=extra)
    # asked for explicitly, base64 comes back as the string (the client decodes it only when it chose base64)
    got = np.array(
        [
            np.frombuffer(base64.b64decode(item.embedding), "<f4") if encoding == "base64" else item.embedding
            for item in response.data
        ],
        dtype=np.float32,
    )
    assert [item.index for item in response.data] == list(range(len(TEXTS)))
    assert np.array_equal(got, expected(model, TEXTS, kind))
    assert response.model == "tiny" and 0 < response.usage.prompt_tokens <= response.usage.total_tokens
    one = client.embeddings.create(input=TEXTS[1], model="tiny", extra_body=extra)  # a string, not a list
    assert np.array_equal(np.array(one.data[0].embedding, dtype=np.float32), expected(model, TEXTS[1:2], kind)[0])


@needs_compiler
def test_langchain_s_openai_embeddings_get_encode_s_embeddings(server, model):
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: send text, not tiktoken ids (tiktoken's tables are a download)
    embeddings = OpenAIEmbeddings(
        model="tiny", base_url=f"{server.url}/v1", api_key=KEY, check_embedding_ctx_length=False, max_retries=0
    )
    assert np.array_equal(np.array(embeddings.embed_documents(TEXTS), dtype=np.float32), model.encode(TEXTS))
    assert np.array_equal(np.array(embeddings.embed_query(TEXTS[2]), dtype=np.float32), model.encode(TEXTS[2:3])[0])


def test_dimensions_rationales_models_health_and_metrics(server, model):
    response = server.post({"model": "tiny", "input": TEXTS[:2], "dimensions": 8, "return_rationale": True})
    assert response.status_code == 200
    full = model.encode(TEXTS[:2], output_value=None)
    for item, text_out in zip(response.json()["data"], full):
        assert np.array_equal(np.array(item["embedding"], dtype=np.float32), text_out["sentence_embedding"][:8].numpy())
        ids = text_out["rationale_token_ids"][0]
        assert item["rationale"] == model[0].decode_rationales(ids[None])[0]
    assert (
        httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]
        == "tiny"
    )
    assert httpx.get(f"{server.url}/health").status_code == 200  # no key needed
    metrics = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert 'grace_st_requests_total{route="/v1/embeddings",status="200"}' in metrics
    assert "grace_st_rows_per_step_bucket" in metrics and "grace_st_queued_texts" in metrics


BAD = [
    (b"{not json", 400, "not valid JSON"),
    (b'{"model": "tiny", "input": "caf\xe9"}', 400, "not valid UTF-8"),
    (b'{"model": "tiny", "input": ["ok", "\\ud800"]}', 400, "input[1] is not valid Unicode"),
    (b"[1, 2]", 400, "must be a JSON object"),
    ({"input": "x"}, 400, "'model' is required"),
    ({"model": "gpt-4", "input": "x"}, 404, "does not exist"),
    ({"model": "tiny", "input": 5}, 400, "a string or a list"),
    ({"model": "tiny", "input": []}, 400, "empty list"),
    ({"model": "tiny", "input": ["ok", None]}, 400, "input[1] is NoneType"),
    ({"model": "tiny", "input": [1, 2, 3]}, 400, "token array"),
    ({"model": "tiny", "input": [[1, 2]]}, 400, "token array"),
    ({"model": "tiny", "input": ["x"] * 9}, 413, "at most 8"),
    ({"model": "tiny", "input": "x" * 201}, 413, "at most 200"),
    ({"model": "tiny", "input": ["y" * 150] * 40}, 413, "body"),
    ({"model": "tiny", "input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"model": "tiny", "input": "x", "dimensions": 0}, 400, "dimensions"),
    ({"model": "tiny", "input": "x", "dimensions": 65}, 400, "dimensions"),
    ({"model": "tiny", "input": "x", "dimensions": True}, 400, "dimensions"),
    ({"model": "tiny", "input": "x", "input_type": "passage"}, 400, "input_type"),
    ({"model": "tiny", "input": "x", "return_rationale": "yes"}, 400, "return_rationale"),
    # JSON in another encoding than UTF-8, which json.loads would detect and read from bytes
    (json.dumps({"model": "tiny", "input": "x"}).encode("utf-16"), 400, "not UTF-8 (it reads as UTF-16)"),
    (json.dumps({"model": "tiny", "input": "x"}).encode("utf-16-le"), 400, "not UTF-8 (it reads as UTF-16-LE)"),
    (json.dumps({"model": "tiny", "input": "x"}).encode("utf-32"), 400, "not UTF-8 (it reads as UTF-32)"),
    # falsy values are not the default: a client that sends them meant something else
    ({"model": "tiny", "input": "x", "encoding_format": ""}, 400, "'encoding_format' must be"),
    ({"model": "tiny", "input": "x", "encoding_format": False}, 400, "'encoding_format' must be"),
    ({"model": "tiny", "input": "x", "input_type": ""}, 400, "'input_type' must be"),
    ({"model": "tiny", "input": "x", "input_type": []}, 400, "'input_type' must be"),
    ({"model": "tiny", "input": "x", "input_type": 0}, 400, "'input_type' must be"),
    ({"model": "tiny", "input": "x", "input_type": {"a": [[[[["deep"]]]]]}}, 400, "'input_type' must be"),
    ({"model": "tiny", "input": ["ok", {"text": "x"}]}, 400, "input[1] is dict, not str"),
]


@pytest.mark.parametrize("body,status,words", BAD)
def test_bad_requests_get_a_4xx_in_openai_s_shape_and_the_server_goes_on(server, model, body, status, words):
    response = server.post(body)
    assert response.status_code == status
    error = response.json()["error"]
    assert words in error["message"] and error["type"]
    good = server.post({"model": "tiny", "input": TEXTS[1]})
    assert np.array_equal(np.array(good.json()["data"][0]["embedding"], dtype=np.float32), model.encode(TEXTS[1:2])[0])


def test_a_refusal_names_the_field_and_quotes_at_most_a_little_of_the_value(server):
    for field, value in [("encoding_format", ""), ("input_type", 0), ("model", "m" * 3000)]:
        error = server.post({"model": "tiny", "input": "x", field: value}).json()["error"]
        assert error["param"] == field and len(error["message"]) < 300


def test_null_is_a_field_left_out(server, model):
    body = {"model": "tiny", "input": TEXTS[1], "encoding_format": None, "input_type": None, "dimensions": None}
    response = server.post({**body, "return_rationale": None})
    assert response.status_code == 200
    assert np.array_equal(
        np.array(response.json()["data"][0]["embedding"], dtype=np.float32), model.encode(TEXTS[1:2])[0]
    )


@pytest.fixture(scope="module")
def roomy(model):
    """A server with the default limits: a body of 32 MiB, room for what a parser cannot take."""
    running = Running(create_app(model, model_name="tiny"))
    yield running
    running.stop()


@pytest.mark.parametrize(
    "body,words",
    [
        (b'{"model": "tiny", "input": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deeply"),
        (
            b'{"model": "tiny", "input": "x", "dimensions": ' + b"9" * 5000 + b"}",
            "integer literal with too many digits",
        ),
        (b'{"model": "tiny", "input": ["x", ' + b"[" * 900 + b"]" * 900 + b"]}", "input[1] is a token array"),
    ],
)
def test_json_that_python_cannot_read_is_a_400_not_a_500(roomy, model, body, words):
    response = roomy.post(body, key=None)
    assert response.status_code == 400 and words in response.json()["error"]["message"]
    good = roomy.post({"model": "tiny", "input": TEXTS[1]}, key=None)
    assert np.array_equal(np.array(good.json()["data"][0]["embedding"], dtype=np.float32), model.encode(TEXTS[1:2])[0])
    assert 'status="500"' not in httpx.get(f"{roomy.url}/metrics").text


def test_a_client_that_leaves_while_sending_its_body_is_counted_as_499_not_500(roomy):
    def counted(status):
        metrics = httpx.get(f"{roomy.url}/metrics").text
        line = f'grace_st_requests_total{{route="/v1/embeddings",status="{status}"}}'
        return next((float(row.split()[-1]) for row in metrics.splitlines() if row.startswith(line)), 0.0)

    before = counted("499")
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", roomy.port)) as client:  # a slow client that gives up
            client.sendall(
                b"POST /v1/embeddings HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"model": "tiny", "input": "'
            )
            time.sleep(0.1)
    deadline = time.monotonic() + 10
    while counted("499") < before + 3:
        assert time.monotonic() < deadline, "the clients that left were not counted as 499"
        time.sleep(0.05)
    assert counted("500") == 0


def test_every_route_but_health_wants_the_key(server):
    assert server.post({"model": "tiny", "input": "x"}, key=None).status_code == 401
    assert server.post({"model": "tiny", "input": "x"}, key="wrong").json()["error"]["code"] == "invalid_api_key"
    for route in ("/v1/models", "/metrics"):
        assert httpx.get(f"{server.url}{route}").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200


@needs_compiler
def test_concurrent_clients_mixing_good_and_bad_requests_all_get_their_own_answers(server, model):
    """32 clients, 192 requests of every prompt type and some bad ones at once: each good answer is
    encode's, each bad one a 4xx, no 5xx."""
    references = {kind: expected(model, TEXTS, kind) for kind in ("default", "query", "document")}

    def client(number):
        kind = ("default", "query", "document")[number % 3]
        if number % 5 == 4:
            response = server.post({"model": "tiny", "input": [1, 2]})
            return response.status_code == 400
        picks = [(number + k) % len(TEXTS) for k in range(1 + number % 3)]
        response = server.post({"model": "tiny", "input": [TEXTS[i] for i in picks], "input_type": kind})
        got = np.array([item["embedding"] for item in response.json()["data"]], dtype=np.float32)
        return response.status_code == 200 and np.array_equal(got, references[kind][picks])

    with ThreadPoolExecutor(32) as pool:
        assert all(pool.map(client, range(192)))
    assert 'status="5' not in httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text


def test_a_full_queue_answers_429_with_retry_after(model):
    from fastapi.testclient import TestClient

    app = create_app(model, model_name="tiny", max_queued_texts=3)
    client = TestClient(app)  # no lifespan: the scheduler is not started, so what is queued stays queued
    app.state.scheduler.submit(["a", "b"])
    response = client.post("/v1/embeddings", json={"model": "tiny", "input": ["c", "d"]})
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "queue_full"
    too_many = client.post("/v1/embeddings", json={"model": "tiny", "input": ["c"] * 4})
    assert too_many.status_code == 413  # more than the queue ever holds: retrying would not help
    assert client.get("/health").status_code == 503  # no scheduler thread: nothing would answer


def test_the_queue_holds_so_many_characters(model):
    from fastapi.testclient import TestClient

    app = create_app(model, model_name="tiny", max_queued_chars=100)
    client = TestClient(app)  # no lifespan: what is queued stays queued
    app.state.scheduler.submit(["a" * 60])
    busy = client.post("/v1/embeddings", json={"model": "tiny", "input": ["b" * 30, "c" * 20]})
    assert busy.status_code == 429 and busy.json()["error"]["code"] == "queue_full" and "characters" in busy.text
    assert client.post("/v1/embeddings", json={"model": "tiny", "input": "d" * 101}).status_code == 413
    assert app.state.scheduler.queued_chars == 60


@needs_compiler
def test_a_request_cancelled_while_it_is_prepared_is_dropped_before_the_rest_of_it_is_tokenised(model):
    """A request of many long texts: its client leaves while the first are tokenised; the rest never are."""
    encoder, tokenised, steps = model[0], [], []
    preprocess = encoder.preprocess
    scheduler = Scheduler(model, on_step=lambda rows, **kind: steps.append(rows))
    gone = scheduler.submit([f"text {i} " + "word " * 2000 for i in range(400)], "document")

    def leaving(texts, **kwargs):
        tokenised.append(len(texts))
        gone.cancel()
        return preprocess(texts, **kwargs)

    encoder.preprocess = leaving
    try:
        scheduler.start()
        deadline = time.monotonic() + 30
        while scheduler.queued_texts and time.monotonic() < deadline:
            time.sleep(0.01)
        assert scheduler.queued_texts == 0 and sum(tokenised) <= 32 and sum(steps) <= 32
        encoder.preprocess = preprocess
        assert np.array_equal(scheduler.submit(["cats"]).result(60).embeddings, model.encode(["cats"]))
    finally:
        encoder.preprocess = preprocess
        scheduler.stop(10)


@needs_compiler
@pytest.mark.parametrize("kind", ["document", "default"])
def test_a_small_request_is_not_queued_behind_a_large_one(model, kind):
    """Rows are fed a request at a time in turn: a one-text request sent after 300 texts is answered first,
    and both are encode's embeddings."""
    big_texts = [f"a longer text, number {i}, of several words" for i in range(300)]
    scheduler = Scheduler(model, max_slots=8)
    big = scheduler.submit(big_texts, kind)
    small = scheduler.submit(["cats"], kind)
    big_done_first = []
    small.add_done_callback(lambda _: big_done_first.append(big.done()))
    scheduler.start()
    try:
        assert np.array_equal(small.result(60).embeddings, expected(model, ["cats"], kind))
        assert np.array_equal(big.result(120).embeddings, expected(model, big_texts, kind))
        assert big_done_first == [False]
    finally:
        scheduler.stop(10)


@needs_compiler
def test_a_row_s_states_are_let_go_when_it_ends_not_when_its_request_does(model, monkeypatch):
    """What a queued request holds is bounded: a finished row is pooled at once, so its per-token states
    (prompt and rationale) do not pile up until the request's last row ends."""
    import gc
    import weakref

    from grace_st.runtime.generation import RolloutStream

    ended, alive_after = [], []
    step = RolloutStream.step

    def watched(stream):
        rows = step(stream)
        gc.collect()
        alive_after.append(sum(ref() is not None for ref in ended))
        ended.extend(weakref.ref(row.prompt_states) for row in rows)
        return rows

    monkeypatch.setattr(RolloutStream, "step", watched)
    scheduler = Scheduler(model, max_slots=4).start()
    try:
        texts = [f"text number {i} with a few more words" for i in range(64)]
        assert np.array_equal(scheduler.submit(texts).result(120).embeddings, model.encode(texts))
    finally:
        scheduler.stop(10)
    assert len(ended) == 64 and max(alive_after) <= 8  # a step's rows at most, never the request's


def test_the_scheduler_refuses_past_its_bound_and_drops_a_cancelled_request_s_rows(model):
    scheduler = Scheduler(model, max_queued_texts=6)
    gone = scheduler.submit(["long text " * 20] * 4)
    with pytest.raises(QueueFull):
        scheduler.submit(["x"] * 3)
    with pytest.raises(ValueError, match="no texts"):  # nothing would ever answer it
        scheduler.submit([])
    assert gone.cancel()  # its client left before it was decoded
    kept = scheduler.submit(["cats"])
    scheduler.start()
    assert np.array_equal(kept.result(timeout=60).embeddings, model.encode(["cats"]))
    deadline = time.monotonic() + 10
    while scheduler.queued_texts and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.queued_texts == 0
    scheduler.stop(10)


def test_a_client_that_disconnects_has_its_rows_dropped(monkeypatch):
    from grace_st.runtime.generation import RolloutStream

    steps = []
    decode = RolloutStream._decode

    def slow_decode(stream):  # 10 ms a step: 200 steps outlast the client's patience
        steps.append(1)
        time.sleep(0.01)
        return decode(stream)

    monkeypatch.setattr(RolloutStream, "_decode", slow_decode)
    slow = tiny(max_rationale_tokens=200)
    running = Running(create_app(slow, model_name="tiny"))
    try:
        with pytest.raises(httpx.TimeoutException):
            running.post({"model": "tiny", "input": [f"text number {i}" for i in range(8)]}, key=None, timeout=0.3)
        scheduler = running.server.config.app.state.scheduler
        deadline = time.monotonic() + 1
        while scheduler.queued_texts and time.monotonic() < deadline:
            time.sleep(0.01)
        assert scheduler.queued_texts == 0 and len(steps) < 150  # dropped, not decoded to the end
        monkeypatch.setattr(RolloutStream, "_decode", decode)
        after = running.post({"model": "tiny", "input": "cats"}, key=None, timeout=60)
        assert np.array_equal(
            np.array(after.json()["data"][0]["embedding"], dtype=np.float32), slow.encode(["cats"])[0]
        )
    finally:
        running.stop()


def test_shutdown_finishes_the_requests_in_flight(model):
    app = create_app(model, model_name="tiny")
    count_step = app.state.scheduler.on_step
    app.state.scheduler.on_step = lambda *args, **kwargs: (time.sleep(0.05), count_step(*args, **kwargs))
    running = Running(app)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(running.post, {"model": "tiny", "input": TEXTS * 2}, None, timeout=60)
        deadline = time.monotonic() + 30
        while app.state.scheduler.queued_texts == 0:  # stop only once the request is in flight
            assert time.monotonic() < deadline and not pending.done(), "the request never reached the scheduler"
            time.sleep(0.005)
        running.stop()
        response = pending.result()
    assert response.status_code == 200 and len(response.json()["data"]) == 2 * len(TEXTS)


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_a_request_unanswered_when_the_shutdown_grace_ends_gets_a_503_and_no_traceback(monkeypatch):
    from grace_st.runtime.generation import RolloutStream

    decode = RolloutStream._decode
    monkeypatch.setattr(RolloutStream, "_decode", lambda stream: (time.sleep(0.02), decode(stream))[1])
    slow = tiny(max_rationale_tokens=2000)  # 40 s of decoding: far past the grace
    app = create_app(slow, model_name="tiny")
    running = Running(app, shutdown_grace=0.5)
    records = Records()
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "grace_st"):
        logging.getLogger(name).addHandler(records)
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(running.post, {"model": "tiny", "input": TEXTS[:2]}, None, timeout=60)
            deadline = time.monotonic() + 30
            while app.state.scheduler.queued_texts == 0:
                assert time.monotonic() < deadline and not pending.done(), "the request never reached the scheduler"
                time.sleep(0.005)
            stopping = time.monotonic()
            running.stop()
            response = pending.result()
        assert time.monotonic() - stopping < 10  # the grace and a step, not the whole decode
        assert response.status_code == 503 and response.headers["retry-after"] == "5"
        assert (
            response.json()["error"]["code"] == "shutting_down" and "shut down" in response.json()["error"]["message"]
        )
        assert app.state.scheduler.queued_texts == 0 and not app.state.scheduler.alive  # its rows dropped, then done
        assert not [r for r in records.records if r.levelno >= logging.ERROR or r.exc_info], [
            r.getMessage() for r in records.records
        ]
    finally:
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "grace_st"):
            logging.getLogger(name).removeHandler(records)


def test_a_request_that_arrives_during_the_shutdown_grace_gets_a_503():
    from fastapi.testclient import TestClient

    app = create_app(tiny(), model_name="tiny")
    with TestClient(app) as client:
        client.portal.call(app.state.service.begin_shutdown, 30)
        response = client.post("/v1/embeddings", json={"model": "tiny", "input": "cats"})
    assert response.status_code == 503 and response.json()["error"]["code"] == "shutting_down"


@pytest.mark.parametrize("method", ["gircse", "grc"])
def test_a_model_that_does_not_stream_is_served_by_whole_batches(method):
    """GIRCSE's soft tokens all run K steps; GRC embeds with its latents, not the decoding states a stream pools:
    each request runs through encode, still one thread: encode's embeddings bit for bit."""
    model = tiny(method=method, max_rationale_tokens=3)
    scheduler = Scheduler(model).start()
    try:
        futures = [scheduler.submit(TEXTS[:2], return_rationale=True), scheduler.submit(TEXTS[2:], "query")]
        first = futures[0].result(60)
        assert np.array_equal(first.embeddings, model.encode(TEXTS[:2]))
        assert np.array_equal(futures[1].result(60).embeddings, model.encode_query(TEXTS[2:]))
        full = model.encode(TEXTS[:2], output_value=None)
        assert first.rationales == [model[0].decode_rationales(out["rationale_token_ids"][:1])[0] for out in full]
        assert first.prompt_tokens == sum(len(ids) for ids in model[0].prompt_token_ids(TEXTS[:2])[0])
    finally:
        scheduler.stop(10)


def test_a_request_served_through_encode_is_dropped_between_its_batches_once_cancelled():
    model = tiny(method="gircse", max_rationale_tokens=3)
    encoded = []
    scheduler = Scheduler(model)
    gone = scheduler.submit([f"text number {i}" for i in range(200)])

    def first_batch_cancels(_module, args):
        encoded.append(len(args[0]["input_ids"]))
        gone.cancel()  # the client leaves while its first batch runs

    handle = model[0].register_forward_pre_hook(first_batch_cancels)
    scheduler.start()
    try:
        deadline = time.monotonic() + 30
        while scheduler.queued_texts and time.monotonic() < deadline:
            time.sleep(0.01)
        assert scheduler.queued_texts == 0 and sum(encoded) <= 64  # two of encode's batches of 32 at most
        handle.remove()
        assert np.array_equal(scheduler.submit(["cats"]).result(60).embeddings, model.encode(["cats"]))
    finally:
        handle.remove()
        scheduler.stop(10)


@pytest.mark.parametrize(
    "given,environment,words",
    [
        ("", None, "(--api-key) is empty"),
        (None, "", "(GRACE_ST_API_KEY) is empty"),
        (None, "   ", "(GRACE_ST_API_KEY) is empty"),
        (" key", None, "no spaces at either end"),
        ("clé", None, "printable ASCII"),
    ],
)
def test_an_api_key_no_client_could_send_is_a_startup_error(monkeypatch, capsys, given, environment, words):
    from grace_st import cli
    from grace_st.serve.server import api_key_from

    if environment is None:
        monkeypatch.delenv("GRACE_ST_API_KEY", raising=False)
    else:
        monkeypatch.setenv("GRACE_ST_API_KEY", environment)
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        api_key_from(given)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded: the key was not checked first")

    monkeypatch.setattr(cli, "_load_model", no_model)
    argv = ["serve"] + ([] if given is None else ["--api-key", given])
    assert cli.main(argv) == 2
    assert words in capsys.readouterr().err
    if given is not None:
        with pytest.raises(ValueError, match="API key"):
            create_app(tiny(), model_name="tiny", api_key=given)


def test_an_api_key_is_the_option_s_else_the_environment_s_else_none(monkeypatch):
    from grace_st.serve.server import api_key_from

    monkeypatch.setenv("GRACE_ST_API_KEY", "from-environment")
    assert api_key_from("from-option") == "from-option" and api_key_from(None) == "from-environment"
    monkeypatch.delenv("GRACE_ST_API_KEY")
    assert api_key_from(None) is None


def test_the_cli_serves_on_loopback(tmp_path):
    tiny().save(str(tmp_path / "model"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "grace_st.cli",
            "serve",
            str(tmp_path / "model"),
            "--port",
            str(port),
            "--model-name",
            "tiny",
            "--log-level",
            "warning",
            "--shutdown-grace",
            "5",
        ],
        env={**os.environ, "GRACE_ST_API_KEY": KEY},
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health")
                break
            except httpx.ConnectError:
                assert process.poll() is None and time.monotonic() < deadline, "grace-st serve did not start"
                time.sleep(0.2)
        assert health.json()["model"] == "tiny"
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401  # the key from the environment
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/embeddings",
            json={"model": "tiny", "input": "cats"},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
        )
        assert len(response.json()["data"][0]["embedding"]) == 64
    finally:
        process.terminate()
        # uvicorn shuts down gracefully on SIGTERM, then re-raises it: the exit says which signal ended it
        assert process.wait(60) in (0, -15)


def test_base64_is_little_endian_float32(server, model):
    response = server.post({"model": "tiny", "input": TEXTS[0], "encoding_format": "base64"})
    raw = base64.b64decode(response.json()["data"][0]["embedding"])
    assert np.array_equal(np.frombuffer(raw, dtype="<f4"), model.encode(TEXTS[:1])[0])
    assert json.loads(response.content)["object"] == "list"


@pytest.mark.slow
def test_the_shipped_default_is_served_bit_for_bit():
    from openai import OpenAI
    from sentence_transformers import SentenceTransformer

    import grace_st

    default = SentenceTransformer(grace_st.default_model_path(), device="cpu", trust_remote_code=True)
    running = Running(create_app(default, model_name="grace-st-default"))
    try:
        client = OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        for kind in ("default", "query", "document"):
            extra = {} if kind == "default" else {"input_type": kind}
            got = client.embeddings.create(input=TEXTS[:3], model="grace-st-default", extra_body=extra)
            vectors = np.array([item.embedding for item in got.data], dtype=np.float32)
            assert np.array_equal(vectors, expected(default, TEXTS[:3], kind)), kind
    finally:
        running.stop()


@needs_compiler
def test_the_rationale_cache_is_shared_with_encode(tmp_path):
    """Texts the cache holds are answered from it; texts the server embeds are stored for encode (and the
    server) to reuse; either way the vector is encode's."""
    from grace_st.cache import RationaleCache

    cached = tiny()
    cached[0].set_rationale_cache(tmp_path / "rationales.sqlite")
    first = cached.encode(TEXTS[:2])  # stored by encode
    scheduler = Scheduler(cached).start()
    try:
        served = scheduler.submit(TEXTS, return_rationale=True).result(60)
    finally:
        scheduler.stop(10)
    assert np.array_equal(served.embeddings[:2], first)
    assert np.array_equal(served.embeddings, cached.encode(TEXTS))
    with RationaleCache(tmp_path / "rationales.sqlite") as cache:  # the server's misses were stored
        assert len(cache) == len(TEXTS)


@needs_compiler
def test_int8_weights_are_served_as_encode_embeds_them_bit_for_bit():
    """int8 layers round differently for few rows (the kernel) and many (a matmul): a burst served through the
    stream would mix its rows into wide steps. Each request is encode's own call instead, so every answer is
    the in-process int8 encode's, bit for bit."""
    from grace_st.runtime.cpu.quantization import quantize_weights

    model = tiny(max_rationale_tokens={"default": 6, "query": 4, "document": 0})
    quantize_weights(model[0].model, "int8")
    kinds = ("default", "query", "document")
    requests = [([TEXTS[(n + k) % len(TEXTS)] for k in range(1 + n % 3)], kinds[n % 3]) for n in range(24)]
    scheduler = Scheduler(model)
    futures = [scheduler.submit(texts, kind) for texts, kind in requests]  # a burst: all wait together
    scheduler.start()
    try:
        for (texts, kind), future in zip(requests, futures):
            assert np.array_equal(future.result(120).embeddings, expected(model, texts, kind)), (texts, kind)
    finally:
        scheduler.stop(10)
