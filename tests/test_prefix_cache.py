"""The instruction prefix cache (grace_st.runtime.prefix_cache): an embedding with it equals the embedding
without it, for every method, weight type, batch size and budget and through the server; it is used across
calls, invalidated when the instruction or the weights change, and bounded in bytes.

The bound: the same bits wherever the native step computes the prompt (float32, the shipped default) and wherever
a batch of several rows is fed (the batch already ran its shared prefix once, on one row; the cache keeps that
row's result). A single float32 row on PyTorch's kernels and GIRCSE's prompt pass (PyTorch's kernels; K = 0)
are cut into prefix and rest, other matrix shapes: float32 rounding, held here at 1e-6."""

import numpy as np
import pytest
import torch
from conftest import make_model, make_tokenizer

from grace_st import from_causal_lm
from grace_st.runtime.cpu import native_step
from grace_st.runtime.cpu.quantization import quantize_weights
from grace_st.runtime.decoding import DecodeOptions
from grace_st.runtime.prefix_cache import PREFIX_STORE, PrefixStore

BOUND = 1e-6
TEXTS = [f"text {i}: " + "a fairly ordinary sentence " * (i % 5) + "about cats" * (i % 2) for i in range(64)]
needs_compiler = pytest.mark.skipif(native_step.library() is None, reason="no C compiler to build the native step")


def build(method: str = "grace", weights: str = "float32", budget: int = 3, instruction: str | None = None):
    tokenizer = make_tokenizer()
    model = make_model(tokenizer, hidden_size=64)
    if weights == "bfloat16":
        model = model.to(torch.bfloat16)
    elif weights == "int8":
        quantize_weights(model, "int8")
    extra = {} if instruction is None else {"instructions": {"default": instruction}}
    return from_causal_lm(
        model=model, tokenizer=tokenizer, device="cpu", method=method, **extra,
        max_rationale_tokens={"default": budget, "query": 0, "document": 0},
    )


def encodings(model, options: DecodeOptions) -> dict:
    """Every way in: ``encode`` (the budget), ``encode_query`` (budget 0), at batch 1 and 64."""
    model[0].decode_options = options
    out = {}
    for batch, texts in ((1, TEXTS[:4]), (64, TEXTS)):
        out["encode", batch] = model.encode(texts, batch_size=batch, convert_to_tensor=True).float()
        out["query", batch] = model.encode_query(texts, batch_size=batch, convert_to_tensor=True).float()
    return out


def test_the_cache_is_on_by_default_and_plain_turns_it_off():
    assert DecodeOptions().prefix_cache and not DecodeOptions.plain().prefix_cache


@needs_compiler
@pytest.mark.parametrize("method", ["grace", "gircse", "grc"])
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "pytorch"])
def test_an_embedding_with_the_cache_equals_the_embedding_without(method, weights, native):
    if weights != "float32" and not native:
        pytest.skip("the native step takes float32 weights only: the other weights run PyTorch's pass either way")
    model = build(method, weights)
    PREFIX_STORE.clear()
    off = encodings(model, DecodeOptions(prefix_cache=False, native_step=native))
    before = PREFIX_STORE.stats()
    on = encodings(model, DecodeOptions(native_step=native))
    on_again = encodings(model, DecodeOptions(native_step=native))  # every prefix now from the store
    # GIRCSE keeps its whole prompt pass on bfloat16 and int8 weights (a single row and a batch alike: PyTorch's)
    assert PREFIX_STORE.stats()["hits"] > before["hits"] or (method == "gircse" and weights != "float32")
    # bit for bit wherever a row's prompt is not cut into other shapes on PyTorch's float32 kernels
    exact = weights != "float32" or (native and method != "gircse")
    for key in off:
        for got in (on[key], on_again[key]):
            assert got.shape == off[key].shape
            if exact:
                assert torch.equal(got, off[key]), key
            else:
                assert (got - off[key]).abs().max() <= BOUND, key
        assert torch.equal(on[key], on_again[key]), key  # deterministic: a hit gives a miss's bits


@needs_compiler
def test_a_single_query_takes_its_prefix_from_the_store_and_keeps_the_bits_of_its_batch():
    model = build()
    PREFIX_STORE.clear()
    before = PREFIX_STORE.stats()
    alone = [model.encode_query([text], convert_to_tensor=True) for text in TEXTS[:3]]
    stats = PREFIX_STORE.stats()
    assert stats["entries"] == 1  # one prefix, computed once
    assert stats["misses"] - before["misses"] == 1 and stats["hits"] - before["hits"] == 2
    batch = model.encode_query(TEXTS[:3], convert_to_tensor=True)
    assert all(torch.equal(row[0], batch[i]) for i, row in enumerate(alone))


@needs_compiler
def test_another_instruction_is_another_prefix():
    first, second = build(instruction="Summarize the text."), build(instruction="Classify the topic of the text.")
    second[0].model = first[0].model  # the same weights: only the instruction differs
    PREFIX_STORE.clear()
    a = first.encode(TEXTS[:2], batch_size=1, convert_to_tensor=True)
    b = second.encode(TEXTS[:2], batch_size=1, convert_to_tensor=True)
    assert PREFIX_STORE.stats()["entries"] == 2
    second[0].decode_options = DecodeOptions(prefix_cache=False)
    assert torch.equal(b, second.encode(TEXTS[:2], batch_size=1, convert_to_tensor=True))
    assert not torch.equal(a, b)


@needs_compiler
@pytest.mark.parametrize("change", ["optimizer step", "load_state_dict", "quantisation"])
def test_changed_weights_drop_the_model_s_prefixes(change):
    model = build()
    lm = model[0].model
    model.encode_query(TEXTS[:2], convert_to_tensor=True)
    if change == "optimizer step":
        with torch.no_grad():
            for parameter in lm.parameters():
                parameter.mul_(1.05)
    elif change == "load_state_dict":
        lm.load_state_dict({k: v * 0.95 for k, v in lm.state_dict().items()})
    else:
        quantize_weights(lm, "int8")
    invalidations = PREFIX_STORE.stats()["invalidations"]
    on = model.encode_query(TEXTS[:2], convert_to_tensor=True)
    assert PREFIX_STORE.stats()["invalidations"] == invalidations + 1
    model[0].decode_options = DecodeOptions(prefix_cache=False)
    assert torch.equal(on, model.encode_query(TEXTS[:2], convert_to_tensor=True))


@needs_compiler
def test_a_lora_swap_drops_the_model_s_prefixes():
    from peft import LoraConfig, get_peft_model

    tokenizer = make_tokenizer()
    lm = get_peft_model(make_model(tokenizer, hidden_size=64), LoraConfig(r=4, target_modules="all-linear"))
    lm.add_adapter("other", LoraConfig(r=4, target_modules="all-linear"))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in lm.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.2)
    model = from_causal_lm(model=lm, tokenizer=tokenizer, device="cpu", merge_adapter=False, max_rationale_tokens=0)
    first = model.encode_query(TEXTS[:2], convert_to_tensor=True)
    lm.set_adapter("other")
    on = model.encode_query(TEXTS[:2], convert_to_tensor=True)
    model[0].decode_options = DecodeOptions(prefix_cache=False)
    assert torch.equal(on, model.encode_query(TEXTS[:2], convert_to_tensor=True)) and not torch.equal(on, first)


def test_the_store_evicts_the_least_recently_used_and_reports_its_size():
    model = torch.nn.Linear(2, 2)
    store = PrefixStore(max_bytes=3 * 1024)
    entry = [(torch.zeros(1, 1, 4, 32), torch.zeros(1, 1, 4, 32))]  # 1 KiB of keys and values
    for name in "abc":
        store.store(model, (name,), (), entry, torch.zeros(0))
    assert store.stats()["bytes"] == 3 * 1024 and store.lookup(model, ("a",), ()) is not None
    store.store(model, ("d",), (), entry, torch.zeros(0))  # "b" is now the least recently used
    stats = store.stats()
    assert stats["entries"] == 3 and stats["bytes"] <= stats["max_bytes"] and stats["evictions"] == 1
    assert store.lookup(model, ("b",), ()) is None and store.lookup(model, ("a",), ()) is not None
    store.resize(1024)
    assert store.stats()["entries"] == 1 and store.stats()["bytes"] == 1024
    store.resize(0)
    assert store.stats()["entries"] == 0
    store.store(model, ("e",), (), entry, torch.zeros(0))  # larger than the whole bound: not kept
    assert store.stats()["entries"] == 0


def test_a_stale_version_is_a_miss_and_a_collected_model_leaves_the_store():
    import gc

    model = torch.nn.Linear(2, 2)
    store = PrefixStore()
    store.store(model, ("a",), (1,), [], torch.zeros(4))
    assert store.lookup(model, ("a",), (2,)) is None and store.stats()["invalidations"] == 1
    store.store(model, ("a",), (2,), [], torch.zeros(4))
    del model
    gc.collect()
    assert store.stats()["entries"] == 0 and store.stats()["bytes"] == 0


@needs_compiler
def test_the_server_answers_with_the_cache_what_it_answers_without_and_reports_it():
    from fastapi.testclient import TestClient

    from grace_st.serve.scheduler import Scheduler
    from grace_st.serve.server import create_app

    model = build(budget=2)
    answers = {}
    for cached in (False, True):
        model[0].decode_options = DecodeOptions(prefix_cache=cached)
        scheduler = Scheduler(model, max_slots=4)
        futures = [scheduler.submit([text], kind) for text in TEXTS[:24] for kind in ("query", "default")]
        scheduler.start()
        try:
            answers[cached] = np.stack([future.result(120).embeddings[0] for future in futures])
        finally:
            scheduler.stop(30)
    assert np.array_equal(answers[True], answers[False])
    with TestClient(create_app(model, model_name="tiny")) as client:
        client.post("/v1/embeddings", json={"model": "tiny", "input": ["cats"]})
        health = client.get("/health").json()["prefix_cache"]
        assert health["bytes"] > 0 and health["entries"] >= 1 and health["max_bytes"] >= health["bytes"]
        assert "grace_st_prefix_cache_bytes" in client.get("/metrics").text


def test_serve_s_prefix_cache_mb_bounds_the_store_and_zero_turns_the_cache_off():
    from grace_st.cli import _size_prefix_cache, build_parser
    from grace_st.runtime.prefix_cache import DEFAULT_MAX_BYTES

    assert build_parser().parse_args(["serve"]).prefix_cache_mb * 2**20 == DEFAULT_MAX_BYTES
    model = build()
    try:
        _size_prefix_cache(model, 2)
        assert PREFIX_STORE.stats()["max_bytes"] == 2 * 2**20 and model[0].decode_options.prefix_cache
        _size_prefix_cache(model, 0)
        assert PREFIX_STORE.stats()["max_bytes"] == 0 and not model[0].decode_options.prefix_cache
    finally:
        PREFIX_STORE.resize(DEFAULT_MAX_BYTES)
