"""LangChain and LlamaIndex load a GRACE model directory and keep its query/document instructions.

Requires sentence-transformers 6.x (the prompt hook) and the langchain / llamaindex extras.
"""

import numpy as np
import pytest
import sentence_transformers
from conftest import make_st_model

if int(sentence_transformers.__version__.split(".")[0]) < 6:
    pytest.skip("the retriever integrations rely on sentence-transformers 6.x", allow_module_level=True)
langchain_huggingface = pytest.importorskip("langchain_huggingface")
llama_hf = pytest.importorskip("llama_index.embeddings.huggingface")

import grace_st

DOCUMENTS = [
    "The guitarist played a long solo on an acoustic guitar at the concert.",
    "The central bank raised interest rates by half a percentage point.",
    "Proteins fold into three-dimensional shapes that determine their function.",
    "Heavy snowfall closed the mountain pass for three days.",
]
QUERY = "Which musician played an instrument at the concert?"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny") / "model")
    make_st_model(max_rationale_tokens=3).save(path)
    return path


def _langchain(path, **kwargs):
    return langchain_huggingface.HuggingFaceEmbeddings(
        model_name=path,
        model_kwargs={"trust_remote_code": True, "device": "cpu"},
        query_encode_kwargs={"prompt_name": "query"},
        encode_kwargs={"prompt_name": "document"},
        **kwargs,
    )


def test_langchain_query_and_document_instructions(tiny_dir):
    embeddings = _langchain(tiny_dir)
    model = embeddings._client
    np.testing.assert_allclose(embeddings.embed_query(QUERY), model.encode_query(QUERY), atol=1e-6)
    np.testing.assert_allclose(embeddings.embed_documents(DOCUMENTS[:2]), model.encode_document(DOCUMENTS[:2]), atol=1e-6)
    assert not np.allclose(model.encode_query(QUERY), model.encode_document(QUERY))


def test_llamaindex_keeps_grace_instructions_despite_its_prompt_override(tiny_dir):
    embedding = llama_hf.HuggingFaceEmbedding(model_name=tiny_dir, trust_remote_code=True, device="cpu")
    model = embedding._model
    np.testing.assert_allclose(embedding.get_query_embedding(QUERY), model.encode_query(QUERY), atol=1e-6)
    np.testing.assert_allclose(embedding.get_text_embedding(DOCUMENTS[0]), model.encode_document(DOCUMENTS[0]), atol=1e-6)


def test_llamaindex_query_instruction_given_by_the_user_is_used(tiny_dir):
    embedding = llama_hf.HuggingFaceEmbedding(
        model_name=tiny_dir, trust_remote_code=True, device="cpu", query_instruction="Find the musician."
    )
    model = embedding._model
    expected = model.encode(QUERY, prompt="Find the musician.")
    np.testing.assert_allclose(embedding.get_query_embedding(QUERY), expected, atol=1e-6)
    assert not np.allclose(expected, model.encode_query(QUERY))


@pytest.fixture(scope="module")
def default_dir():
    return grace_st.default_model_path()


@pytest.mark.slow
def test_langchain_retriever_finds_the_right_document(default_dir):
    from langchain_core.vectorstores import InMemoryVectorStore

    embeddings = _langchain(default_dir)
    embeddings._client[0].max_rationale_tokens = 16
    store = InMemoryVectorStore.from_texts(DOCUMENTS, embedding=embeddings)
    (hit,) = store.as_retriever(search_kwargs={"k": 1}).invoke(QUERY)
    assert hit.page_content == DOCUMENTS[0]


@pytest.mark.slow
def test_llamaindex_retriever_finds_the_right_document(default_dir):
    from llama_index.core import VectorStoreIndex
    from llama_index.core.schema import TextNode

    embedding = llama_hf.HuggingFaceEmbedding(model_name=default_dir, trust_remote_code=True, device="cpu")
    embedding._model[0].max_rationale_tokens = 16
    # Nodes are built directly: LlamaIndex's default splitter fetches a tokenizer file from the network.
    index = VectorStoreIndex([TextNode(text=text) for text in DOCUMENTS], embed_model=embedding)
    (hit,) = index.as_retriever(similarity_top_k=1).retrieve(QUERY)
    assert hit.node.get_content() == DOCUMENTS[0]
