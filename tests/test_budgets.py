"""Rationale budgets (and counts) by prompt type: queries reason, a corpus is embedded cheaply.

``max_rationale_tokens`` / ``num_rationales`` take an int or a mapping by prompt type; the
type a call resolves to (``encode_query`` / ``encode_document``, mteb, LangChain, LlamaIndex,
the CLI's ``--task``) picks the value, which is saved, checked on load, keyed in the rationale
cache and hashed into the revision mteb files results under.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import make_st_model

from grace_st import explain
from grace_st.cli import main

ASYMMETRIC = {"query": 4, "document": 0, "default": 2}
TEXTS = ["The cat sat on the mat.", "Markets fell after rates rose."]


@pytest.fixture(scope="module")
def model():
    return make_st_model(max_rationale_tokens=dict(ASYMMETRIC))


def budgets(items):
    return [item["rationale_budget"] for item in items]


def test_each_prompt_type_gets_its_budget(model):
    assert budgets(explain(model, TEXTS, task="query")) == [4, 4]
    assert budgets(explain(model, TEXTS, task="document")) == [0, 0]
    assert budgets(explain(model, TEXTS)) == [2, 2]
    assert budgets(explain(model, TEXTS, task="passage")) == [2, 2]  # a type it does not name: default
    assert all(item["rationale"] == "" for item in explain(model, TEXTS, task="document"))


def test_a_budget_by_type_embeds_as_that_int_would(model):
    """The mapping only chooses: each type's vectors equal a model with that int budget."""
    encoder = model[0]
    for kind, encode in (("query", model.encode_query), ("document", model.encode_document), ("default", model.encode)):
        chosen = encode(TEXTS)
        encoder.max_rationale_tokens = ASYMMETRIC[kind]
        try:
            np.testing.assert_array_equal(encode(TEXTS), chosen)
        finally:
            encoder.max_rationale_tokens = dict(ASYMMETRIC)


def test_saved_checked_on_load_and_part_of_the_revision(model, tmp_path):
    from sentence_transformers import SentenceTransformer

    path = tmp_path / "model"
    model.save(str(path))
    assert json.loads((path / "grace_config.json").read_text())["max_rationale_tokens"] == ASYMMETRIC
    loaded = SentenceTransformer(str(path), device="cpu", trust_remote_code=True)
    assert loaded[0].max_rationale_tokens == ASYMMETRIC
    np.testing.assert_array_equal(loaded.encode_query(TEXTS), model.encode_query(TEXTS))

    revision = loaded[0].revision()
    loaded[0].max_rationale_tokens = {**ASYMMETRIC, "document": 1}
    assert loaded[0].revision() != revision

    for bad in ({"query": 4}, {"default": -1}, {"default": 2, "query": "4"}, {"default": 2, "query": 1.5}, [4, 0]):
        config = json.loads((path / "grace_config.json").read_text())
        (path / "grace_config.json").write_text(json.dumps({**config, "max_rationale_tokens": bad}))
        with pytest.raises(ValueError, match="max_rationale_tokens") as raised:
            SentenceTransformer(str(path), device="cpu", trust_remote_code=True)
        assert "grace_config.json" in str(raised.value)


def test_the_rationale_cache_keys_the_budget_each_type_got(model, tmp_path):
    encoder = model[0]
    encoder.set_rationale_cache(tmp_path / "cache.sqlite")
    try:
        query, document = model.encode_query(TEXTS), model.encode_document(TEXTS)
        cache = encoder.rationale_cache.connection()
        assert len(cache) == 4  # the same texts, two budgets: four entries
        np.testing.assert_array_equal(model.encode_query(TEXTS), query)
        np.testing.assert_array_equal(model.encode_document(TEXTS), document)
        assert len(cache) == 4
        assert encoder.generation_settings("document")["max_rationale_tokens"] == 0
        assert encoder.generation_settings("query")["max_rationale_tokens"] == 4
    finally:
        encoder.set_rationale_cache(None)


def test_num_rationales_by_type():
    sampled = make_st_model(
        max_rationale_tokens={"default": 3, "document": 0},
        num_rationales={"query": 3, "document": 1, "default": 1},
        do_sample=True,
        seed=7,
    )
    assert [len(item["rationales"]) for item in explain(sampled, TEXTS, task="query")] == [3, 3]
    assert [len(item["rationales"]) for item in explain(sampled, TEXTS, task="document")] == [1, 1]
    # averaging needs sampling and a budget, type by type
    for bad in (
        {"num_rationales": {"query": 2, "default": 1}, "do_sample": False},
        {
            "num_rationales": {"document": 2, "default": 1},
            "do_sample": True,
            "max_rationale_tokens": {"document": 0, "default": 3},
        },
    ):
        with pytest.raises(ValueError, match="num_rationales > 1 \\(prompt type"):
            make_st_model(**{"max_rationale_tokens": 3, **bad})


def test_mteb_retrieval_reasons_for_queries_only(model, tmp_path, monkeypatch):
    pytest.importorskip("mteb")
    from test_evaluation import beir_dir, run

    from grace_st.evaluation import retrieval_task

    seen = []
    preprocess = type(model[0]).preprocess

    def spy(self, inputs, prompt=None, task=None, **kwargs):
        features = preprocess(self, inputs, prompt=prompt, task=task, **kwargs)
        seen.append((self.prompt_type(task, prompt), features["rationale_budget"], len(inputs)))
        return features

    monkeypatch.setattr(type(model[0]), "preprocess", spy)
    run(model, retrieval_task(beir_dir(tmp_path)))
    by_type = {}
    for kind, budget, count in seen:
        by_type.setdefault((kind, budget), 0)
        by_type[(kind, budget)] += count
    assert by_type == {("query", 4): 4, ("document", 0): 6}


def test_langchain_and_llamaindex_pick_the_budget(model, tmp_path):
    import sentence_transformers

    if int(sentence_transformers.__version__.split(".")[0]) < 6:
        pytest.skip("the retriever integrations rely on sentence-transformers 6.x")
    path = str(tmp_path / "model")
    model.save(path)
    reference = make_st_model(max_rationale_tokens=dict(ASYMMETRIC))
    reference[0].model.load_state_dict(model[0].model.state_dict())
    query, documents = reference.encode_query(TEXTS[0]), reference.encode_document(TEXTS)

    assert_retrievers_embed_as(path, TEXTS, query, documents, atol=1e-6)


def assert_retrievers_embed_as(path: str, texts: list[str], query, documents, atol: float) -> None:
    """LangChain's and LlamaIndex's embeddings of a saved model equal ``query`` (texts[0] as a query) and
    ``documents`` (texts as documents), each library naming its prompts its own way."""
    langchain_huggingface = pytest.importorskip("langchain_huggingface")
    llama_hf = pytest.importorskip("llama_index.embeddings.huggingface")
    chain = langchain_huggingface.HuggingFaceEmbeddings(
        model_name=path,
        model_kwargs={"trust_remote_code": True, "device": "cpu"},
        query_encode_kwargs={"prompt_name": "query"},
        encode_kwargs={"prompt_name": "document"},
    )
    np.testing.assert_allclose(chain.embed_query(texts[0]), query, atol=atol)
    np.testing.assert_allclose(chain.embed_documents(texts), documents, atol=atol)
    index = llama_hf.HuggingFaceEmbedding(model_name=path, trust_remote_code=True, device="cpu")
    np.testing.assert_allclose(index.get_query_embedding(texts[0]), query, atol=atol)
    np.testing.assert_allclose(index.get_text_embedding(texts[1]), documents[1], atol=atol)


def test_cli_takes_budgets_by_type_and_shows_each_texts(tmp_path, capsys):
    path = str(tmp_path / "model")
    make_st_model(max_rationale_tokens=3).save(path)
    argv = ["encode", *TEXTS, "--model", path, "--max-rationale-tokens", "query=2,document=0"]
    assert main([*argv, "--task", "query", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rationale_budgets"] == [2, 2]
    assert main([*argv, "--task", "document", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rationale_budgets"] == [0, 0]
    assert main(argv) == 0  # untyped texts keep the model's own budget, 3
    assert "rationale (3 tokens max" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*argv[:-1], "query=two"])
    assert "neither an integer nor TYPE=N pairs" in capsys.readouterr().err
