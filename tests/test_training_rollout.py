"""Eq. 4 rollouts: counts, seeding, and the rule that the rewarded embedding is the encode embedding."""

from __future__ import annotations

import types

import pytest
import torch
from conftest import CORPUS, make_st_model

from grace_training.algorithms.grpo.rollout import (
    RolloutRequest,
    asymmetric_rollouts,
    embed_rollouts,
    hf_generate,
    tokenize_prompts,
)
from grace_training.algorithms.grpo.vllm_backend import VLLMRolloutEngine, vllm_available
from grace_training.data.examples import Triplet

TRIPLETS = [
    Triplet(CORPUS[0], CORPUS[1], (CORPUS[2], CORPUS[3])),
    Triplet(CORPUS[4], CORPUS[5], (CORPUS[6],)),
]


def rollouts(model, step=0, **overrides):
    settings = {
        "num_rollouts": 3,
        "num_negatives": 2,
        "step": step,
        "seed": 7,
        "max_new_tokens": 6,
        "temperature_query": 0.5,
        "temperature_negative": 0.5,
        "temperature_positive": 1.0,
    }
    settings.update(overrides)
    return asymmetric_rollouts(model[0], TRIPLETS, **settings)


@pytest.fixture(scope="module")
def model():
    return make_st_model(max_rationale_tokens=6)


def test_asymmetric_rollout_counts(model):
    r = rollouts(model)
    assert len(r.queries) == 2 and len(r.negatives) == 3 and len(r.positives) == 6
    assert r.negative_owner == [0, 0, 1]
    query, positives, negatives, mask, truncated = r.grouped(2)
    assert positives.shape == (2, 3, 32) and negatives.shape == (2, 2, 32) and truncated.shape == (2, 3)
    assert mask.tolist() == [[True, True], [True, False]]
    torch.testing.assert_close(query.norm(dim=-1), torch.ones(2))
    # the K copies of a positive share one prompt, templated as a document
    assert r.positives.prompt_ids[0] == r.positives.prompt_ids[2]
    assert r.positives.temperature == 1.0 and r.queries.temperature == 0.5


def test_a_step_makes_one_generation_call_with_each_roles_temperature(model):
    from grace_training.algorithms.grpo.rollout import hf_generate

    calls = []

    def spy(request):
        calls.append(request.temperatures)
        return hf_generate(model[0], request)

    r = rollouts(model, step=2, generate=spy)
    assert calls == [[0.5] * 2 + [0.5] * 3 + [1.0] * 6]  # queries, negatives, positives (K = 3)
    plain = rollouts(model, step=2)
    assert r.positives.rationale_ids == plain.positives.rationale_ids
    assert r.queries.rationale_ids == plain.queries.rationale_ids


def test_rollouts_are_seeded_by_step(model):
    first, again, later = rollouts(model, step=3), rollouts(model, step=3), rollouts(model, step=4)
    assert first.positives.rationale_ids == again.positives.rationale_ids
    assert torch.equal(first.positives.embeddings, again.positives.embeddings)
    assert first.positives.rationale_ids != later.positives.rationale_ids
    # the K rollouts of one positive differ from each other
    assert len({tuple(r) for r in first.positives.rationale_ids[:3]}) > 1


def test_rollout_embedding_is_encode_embedding(model, monkeypatch):
    """The embedding a rollout is rewarded for is the one `encode` returns (greedy, same prompt), and both
    come from the same calls: the encoder's RationaleEngine's generate, then its embed."""
    from grace_st.methods import RationaleEngine

    calls = []
    for name in ("generate", "embed"):
        original = getattr(RationaleEngine, name)

        def recorded(self, *args, _name=name, _original=original, **kwargs):
            calls.append((_name, self.model is model[0].model))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(RationaleEngine, name, recorded)
    texts = [t.query for t in TRIPLETS]
    r = rollouts(model, temperature_query=0.0, query_task=None)
    from_training, calls[:] = list(calls), []
    encoded = model.encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(r.queries.embeddings, encoded.cpu(), atol=1e-5, rtol=1e-5)
    assert from_training and calls and set(from_training) == set(calls) == {("generate", True), ("embed", True)}


def test_two_pass_embeddings_match_generation_states(model):
    """embed_rollouts (the vLLM backend's embedding path) pools the states the generating pass had."""
    encoder = model[0]
    prompts, spans = tokenize_prompts(encoder, [CORPUS[0], CORPUS[2]], "document")
    rationales, _, embeddings, _ = hf_generate(
        encoder, RolloutRequest(prompts, spans, temperatures=1.0, top_p=1.0, max_new_tokens=6, seeds=[1, 2])
    )
    again = embed_rollouts(encoder, prompts, spans, rationales)
    torch.testing.assert_close(again, embeddings, atol=1e-5, rtol=1e-5)


def test_prompts_come_from_the_encoder_preprocess(model):
    encoder = model[0]
    prompts, spans = tokenize_prompts(encoder, [CORPUS[0]], "query")
    features = encoder.preprocess([CORPUS[0]], task="query")
    assert prompts[0] == features["input_ids"][0][features["attention_mask"][0].bool()].tolist()
    assert spans == features["instruction_lengths"].tolist()


# -- vLLM backend ---------------------------------------------------------------------------------


def _stand_in_vllm(monkeypatch, outputs):
    """A stand-in for vLLM's LLM: records the requests and the loaded weights."""
    import grace_st.runtime.vllm_backend as backend

    monkeypatch.setattr(backend, "_sampling_params_class", lambda: types.SimpleNamespace)
    loaded, requests = {}, []
    engine_model = types.SimpleNamespace(load_weights=lambda weights: loaded.update(dict(weights)))
    runner = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=engine_model))
    llm = types.SimpleNamespace(
        llm_engine=types.SimpleNamespace(model_executor=types.SimpleNamespace(driver_worker=runner)),
        generate=lambda prompts, sampling_params, use_tqdm: requests.append(sampling_params) or outputs,
        reset_prefix_cache=lambda: loaded.setdefault("reset", True),
        requests=requests,
    )
    return llm, loaded


def test_vllm_engine_contract_with_a_stand_in(model, monkeypatch):
    encoder = model[0]
    eos = encoder.eos_token_ids[0]
    completion = lambda ids, reason: types.SimpleNamespace(
        outputs=[types.SimpleNamespace(token_ids=ids, finish_reason=reason)]
    )
    llm, loaded = _stand_in_vllm(monkeypatch, [completion([40, 41, eos], "stop"), completion([42, 43, 44], "length")])
    engine = VLLMRolloutEngine(encoder, llm=llm)
    prompts, spans = tokenize_prompts(encoder, [CORPUS[0], CORPUS[1]], "document")
    rationales, stops, embeddings, truncated = engine.generate(
        RolloutRequest(prompts, spans, temperatures=[0.7, 0.0], top_p=0.9, max_new_tokens=3, seeds=[1, 2])
    )
    assert rationales == [[40, 41], [42, 43, 44]] and stops == [eos, -1] and truncated.tolist() == [False, True]
    # one request, a temperature a row: the greedy row gets no seed and no top-p
    ((sampled, greedy),) = llm.requests
    assert (sampled.temperature, sampled.top_p, sampled.seed) == (0.7, 0.9, 1)
    assert (greedy.temperature, greedy.top_p, greedy.seed) == (0.0, 1.0, None)
    assert sampled.stop_token_ids == sorted(set(encoder.eos_token_ids)) and sampled.ignore_eos
    torch.testing.assert_close(embeddings, embed_rollouts(encoder, prompts, spans, rationales))
    engine.sync_from(encoder.model)
    assert set(encoder.model.state_dict()) <= set(loaded) and loaded["reset"]


@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (GPU-only optional extra)")
def test_vllm_engine_generates_on_gpu(tmp_path, model):  # pragma: no cover - needs vLLM and a GPU
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a GPU")
    model.save(str(tmp_path))
    engine = VLLMRolloutEngine(model[0], str(tmp_path), gpu_memory_utilization=0.2)
    prompts, spans = tokenize_prompts(model[0], [CORPUS[0]], "document")
    rationales, _, embeddings, _ = engine.generate(
        RolloutRequest(prompts, spans, temperatures=0.0, top_p=1.0, max_new_tokens=4, seeds=[0])
    )
    assert len(rationales) == 1 and embeddings.shape == (1, 32)
    engine.sync_from(model[0].model)


# -- budgets by prompt type: each side trained as encode embeds it ------------------------------

SHIPPED_BUDGETS = {"default": 6, "query": 6, "document": 0}


def test_documents_at_budget_zero_roll_out_the_query_side(model):
    """Retrieval with prompt-only documents: the query is rolled out K times, the positive document
    (no rationale) is the anchor, negatives get no rationale; one generate call a budget."""
    from grace_training.algorithms.grpo.rollout import hf_generate

    calls = []

    def spy(request):
        calls.append((request.max_new_tokens, len(request.prompt_ids)))
        return hf_generate(model[0], request)

    r = rollouts(model, max_new_tokens=SHIPPED_BUDGETS, generate=spy)
    assert calls == [(6, 6), (0, 5)]  # K = 3 query rollouts of 2 instances; 2 anchors + 3 negatives
    query_prompts, _ = tokenize_prompts(model[0], [t.query for t in TRIPLETS], "query")
    document_prompts, _ = tokenize_prompts(model[0], [t.positive for t in TRIPLETS], "document")
    assert r.positives.prompt_ids == [p for p in query_prompts for _ in range(3)]
    assert r.queries.prompt_ids == document_prompts
    assert all(ids == [] for ids in r.queries.rationale_ids + r.negatives.rationale_ids)
    assert any(ids for ids in r.positives.rationale_ids)
    # the anchors' embeddings are what encode_document returns under the shipped budgets
    encoder = model[0]
    encoder.max_rationale_tokens = SHIPPED_BUDGETS
    try:
        documents = model.encode_document([t.positive for t in TRIPLETS], convert_to_tensor=True)
    finally:
        encoder.max_rationale_tokens = 6
    torch.testing.assert_close(r.queries.embeddings, documents.cpu(), atol=1e-5, rtol=1e-5)


def test_documents_with_a_budget_and_symmetric_pairs_keep_the_paper_roles(model):
    from grace_training.algorithms.grpo.rollout import instance_roles

    plain = rollouts(model)
    same = rollouts(model, max_new_tokens={"default": 6})
    assert same.positives.rationale_ids == plain.positives.rationale_ids
    assert same.queries.prompt_ids == plain.queries.prompt_ids
    pair = Triplet("a cat sat", "a cat was sitting", ("stocks fell",), symmetric=True)
    assert instance_roles(pair, SHIPPED_BUDGETS, "query", "document") == (
        ("a cat sat", "default"),
        ("a cat was sitting", "default"),
        "default",
    )
    retrieval = Triplet("which cat?", "a cat sat", ())
    assert instance_roles(retrieval, SHIPPED_BUDGETS, "query", "document")[1] == ("which cat?", "query")
    assert instance_roles(retrieval, 6, "query", "document")[1] == ("a cat sat", "document")


def test_a_symmetric_rollout_is_the_default_prompt_encode_embedding(model):
    pairs = [Triplet(t.query, t.positive, t.negatives, symmetric=True) for t in TRIPLETS]
    r = asymmetric_rollouts(
        model[0],
        pairs,
        num_rollouts=2,
        num_negatives=1,
        step=0,
        seed=1,
        max_new_tokens=SHIPPED_BUDGETS,
        temperature_query=0.0,
        temperature_negative=0.0,
        temperature_positive=1.0,
    )
    encoded = model.encode([t.query for t in pairs], convert_to_tensor=True)  # the "default" prompt type
    torch.testing.assert_close(r.queries.embeddings, encoded.cpu(), atol=1e-5, rtol=1e-5)


def test_length_buckets_split_short_from_long_prompts_and_change_nothing(model):
    from grace_st.methods import length_buckets
    from grace_training.algorithms.grpo.rollout import hf_generate

    lengths = [40, 120, 41, 118, 42, 43, 44, 45, 46, 47, 48, 125]
    chunks = length_buckets(lengths, batch_size=64, ratio=1.5, min_rows=8)
    assert [sorted(lengths[i] for i in chunk) for chunk in chunks] == [list(range(40, 49)), [118, 120, 125]]
    assert length_buckets(lengths, batch_size=5, ratio=None) == [[0, 2, 4, 5, 6], [7, 8, 9, 10, 3], [1, 11]]
    short, short_spans = tokenize_prompts(model[0], ["a cat"] * 8, "query")
    long, long_spans = tokenize_prompts(model[0], [" ".join(CORPUS[:6])] * 8, "document")
    request = RolloutRequest(
        short + long, short_spans + long_spans, temperatures=1.0, top_p=1.0, max_new_tokens=6, seeds=list(range(16))
    )
    assert len(length_buckets([len(p) for p in request.prompt_ids], 64, 1.5)) == 2
    split = hf_generate(model[0], request, batch_size=64, bucket_ratio=1.5)
    whole = hf_generate(model[0], request, batch_size=64, bucket_ratio=None)
    assert split.rationale_ids == whole.rationale_ids and split.stop_ids == whole.stop_ids
    torch.testing.assert_close(split.embeddings, whole.embeddings, atol=1e-5, rtol=1e-4)
