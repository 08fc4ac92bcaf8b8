"""int8 weight-only linear layers chosen at load (grace_st.runtime.cpu.quantization)."""

import numpy as np
import pytest
import torch
from conftest import make_st_model

from grace_st.runtime.cpu.quantization import Int8WeightOnlyLinear, quantization_scheme, quantize_weights

TEXTS = ["The cat sat on the mat.", "Proteins fold into shapes that decide what they do in the cell."]


def _load(path, **model_kwargs):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu", trust_remote_code=True, model_kwargs=model_kwargs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_st_model(max_rationale_tokens=6).save(str(path))
    return path


def test_an_int8_layer_is_the_float_layer_to_within_its_rounding():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    quantized = Int8WeightOnlyLinear(linear)
    assert quantized.qweight.dtype == torch.int8 and quantized.scale.shape == (48,)
    # each row is scaled to its own largest weight: that weight comes back as ±127 steps
    assert int(quantized.qweight.abs().amax(1).min()) == 127
    inputs = torch.randn(3, 5, 64)
    with torch.no_grad():
        expected, got = linear(inputs), quantized(inputs)
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert float((got - expected).norm() / expected.norm()) < 0.02


def test_an_encoder_loaded_int8_embeds_near_float32_and_the_same_each_time(saved):
    full, int8 = _load(saved), _load(saved, weight_quantization="int8")
    assert quantization_scheme(int8[0].model) == "int8" and quantization_scheme(full[0].model) is None
    assert not any(type(m) is torch.nn.Linear for m in int8[0].model.modules())
    first, again = int8.encode(TEXTS), int8.encode(TEXTS)
    np.testing.assert_array_equal(first, again)
    # the prompt alone (G = 0): the only difference is the weights' rounding, not another rationale
    for model in (full, int8):
        model[0].max_rationale_tokens = 0
    a, b = full.encode(TEXTS, normalize_embeddings=True), int8.encode(TEXTS, normalize_embeddings=True)
    assert np.all(np.sum(a * b, axis=1) > 0.99)
    # another form of the weights is another model for the rationale cache and mteb
    assert int8[0].weights_key() != full[0].weights_key()


def test_an_int8_model_refuses_to_be_saved_or_trained(saved, tmp_path):
    model = _load(saved, weight_quantization="int8")
    with pytest.raises(ValueError, match="weight_quantization"):
        model.save(str(tmp_path / "copy"))
    layer = next(m for m in model[0].model.modules() if isinstance(m, Int8WeightOnlyLinear))
    with pytest.raises(RuntimeError, match="inference only"):
        layer(torch.randn(2, layer.in_features, requires_grad=True))


def test_an_unknown_scheme_and_an_unmerged_adapter_are_refused(saved):
    with pytest.raises(ValueError, match="int4.*expected one of int8"):
        _load(saved, weight_quantization="int4")
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(make_st_model()[0].model, LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="adapter merged"):
        quantize_weights(model, "int8")


@pytest.mark.parametrize("bfloat16_matmul", [True, False], ids=["bfloat16-cpu", "avx2-cpu"])
def test_many_rows_take_the_expanded_weight_and_agree_with_the_kernel(monkeypatch, bfloat16_matmul):
    from grace_st.runtime.cpu import quantization

    torch.manual_seed(1)
    layer = Int8WeightOnlyLinear(torch.nn.Linear(64, 40, bias=False))
    layer.bfloat16_matmul = bfloat16_matmul  # what a CPU with (or without) bfloat16 kernels sets at load
    inputs = torch.randn(quantization.KERNEL_MAX_ROWS + 4, 64)
    with torch.no_grad():
        expanded = layer(inputs)
        monkeypatch.setattr(quantization, "KERNEL_MAX_ROWS", 10**6)
        kernel = layer(inputs)
    # the same bfloat16 inputs, scales and rounding: at most one bfloat16 step apart, from the order of the sums
    torch.testing.assert_close(expanded, kernel, rtol=8e-3, atol=1e-2)


def test_langchain_and_llamaindex_pass_the_load_option_through(saved):
    langchain = pytest.importorskip("langchain_huggingface")
    llamaindex = pytest.importorskip("llama_index.embeddings.huggingface")
    chain = langchain.HuggingFaceEmbeddings(
        model_name=str(saved),
        model_kwargs={"trust_remote_code": True, "device": "cpu", "model_kwargs": {"weight_quantization": "int8"}},
    )
    index = llamaindex.HuggingFaceEmbedding(
        model_name=str(saved), trust_remote_code=True, device="cpu", model_kwargs={"weight_quantization": "int8"}
    )
    for model in (chain._client, index._model):
        assert quantization_scheme(model[0].model) == "int8"
    for vector in (chain.embed_query("The cat sat."), index.get_query_embedding("The cat sat.")):
        assert len(vector) == 32 and np.all(np.isfinite(vector))
