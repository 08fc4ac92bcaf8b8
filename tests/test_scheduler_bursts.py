"""Bursts of more texts than the scheduler has slots: every answer is ``encode``'s embedding, bit for bit.

Texts with a budget of 0 (queries and documents at the shipped budgets) get a prompt pass only, as many rows a
pass as there are slots; the rest wait for the next pass. They must never be admitted into a decoding slot, where
they would be fed one token and pool it. Mixed with thinking texts, at several slot counts, one text a request
(as 64 clients send them) and several, through the scheduler and through HTTP."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import CORPUS
from test_server import Running, needs_compiler, tiny

from grace_st.serve.scheduler import Scheduler
from grace_st.serve.server import create_app

BUDGETS = {"default": 4, "query": 0, "document": 0}  # queries and documents one prompt pass, plain texts think
TEXTS = [f"{i}: {CORPUS[i % 7]}"[: 12 + 3 * (i % 11)] for i in range(48)]  # distinct, of many lengths
KINDS = ["query", "document", "default"]


@pytest.fixture(scope="module")
def model():
    return tiny(max_rationale_tokens=BUDGETS)


def expected(model, texts, kind):
    encode = {"query": model.encode_query, "document": model.encode_document, "default": model.encode}[kind]
    return encode(texts)


@needs_compiler
@pytest.mark.parametrize("slots", [1, 4, 8])
@pytest.mark.parametrize("mix", ["query", "document", "mixed"])
def test_a_burst_of_single_text_requests_past_the_slots_gets_encode_s_embeddings(model, slots, mix):
    kinds = [KINDS[i % 3] if mix == "mixed" else mix for i in range(len(TEXTS))]
    scheduler = Scheduler(model, max_slots=slots)
    futures = [scheduler.submit([text], kind) for text, kind in zip(TEXTS, kinds)]  # all queued before it runs
    scheduler.start()
    try:
        answers = [future.result(120).embeddings[0] for future in futures]
    finally:
        scheduler.stop(30)
    wrong = [
        i for i, (text, kind, got) in enumerate(zip(TEXTS, kinds, answers))
        if not np.array_equal(got, expected(model, [text], kind)[0])
    ]
    assert not wrong, f"rows {wrong} differ from encode"


@needs_compiler
def test_a_burst_of_multi_text_requests_past_the_slots_gets_encode_s_embeddings(model):
    scheduler = Scheduler(model, max_slots=4)
    requests = [(TEXTS[i : i + 5], KINDS[i % 3]) for i in range(0, len(TEXTS), 5)]
    futures = [scheduler.submit(texts, kind) for texts, kind in requests]
    scheduler.start()
    try:
        for (texts, kind), future in zip(requests, futures):
            assert np.array_equal(future.result(120).embeddings, expected(model, texts, kind)), kind
    finally:
        scheduler.stop(30)


@needs_compiler
def test_64_concurrent_clients_with_mixed_prompt_types_get_encode_s_embeddings(model):
    running = Running(create_app(model, model_name="tiny", max_slots=8))
    clients = [(TEXTS[i % len(TEXTS)], KINDS[i % 3]) for i in range(64)]

    def ask(client):
        text, kind = client
        body = {"model": "tiny", "input": text}
        if kind != "default":
            body["input_type"] = kind
        response = running.post(body, key=None, timeout=120)
        assert response.status_code == 200, response.text
        return np.array(response.json()["data"][0]["embedding"], dtype=np.float32)

    try:
        with ThreadPoolExecutor(64) as pool:
            answers = list(pool.map(ask, clients))
    finally:
        running.stop()
    wrong = [
        i for i, ((text, kind), got) in enumerate(zip(clients, answers))
        if not np.array_equal(got, expected(model, [text], kind)[0])
    ]
    assert not wrong, f"clients {wrong} got an embedding other than encode's"
