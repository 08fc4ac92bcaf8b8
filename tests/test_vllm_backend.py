"""The vLLM backend: HF pooling over given rationales, the generator's contract (on a stand-in
for vLLM), the install hint, and on a GPU with vLLM, equality with the HF backend."""

import dataclasses
import importlib.util
import sys
import types

import numpy as np
import pytest
import torch
from conftest import PROMPT_TEXTS, make_model, make_prompts, make_tokenizer, model_view, one_pass_rollouts

from grace_st.runtime.batch import Rationales
from grace_st.runtime.generation import RolloutSettings, generate_rollouts
from grace_st.runtime.second_pass import two_pass_reference
from grace_st.runtime.vllm_backend import INSTALL_HINT, VLLMRationaleGenerator, pooled_embeddings

TEXTS = PROMPT_TEXTS


# -- pooled_embeddings: the re-encode step of two_pass_reference ------------------------------------


@pytest.mark.parametrize(
    ("template_name", "max_new_tokens", "hidden_layer"), [("chatml", 0, -1), ("chatml", 12, -1), ("llama3", 6, 1)]
)
def test_pooled_embeddings_equal_two_pass_reference(template_name, max_new_tokens, hidden_layer):
    tokenizer, model, rows, spans = make_prompts(template_name)
    view = model_view(model, tokenizer, hidden_layer=hidden_layer)
    reference, rationales = two_pass_reference(view, rows, spans, max_new_tokens=max_new_tokens)
    pooled = pooled_embeddings(view, rows, spans, rationales)
    assert pooled.dtype == torch.float32 and pooled.shape == reference.shape
    torch.testing.assert_close(pooled, reference, atol=1e-6, rtol=1e-5)
    # batched by length, in another order internally: the same vectors, in the caller's order
    batched = pooled_embeddings(view, rows, torch.tensor(spans), rationales, batch_size=3)
    torch.testing.assert_close(batched, reference, atol=1e-5, rtol=1e-4)


def test_pooled_embeddings_with_uneven_rationales_and_an_extra_eos():
    # rationales cut at different lengths, as an EOS would leave them
    tokenizer, model, rows, spans = make_prompts()
    free = one_pass_rollouts(model, tokenizer, rows, spans, 10)
    stop = [t for t in free.rationale_ids[0].tolist()][3]
    view = model_view(model, tokenizer, [tokenizer.eos_token_id, stop])
    reference, rationales = two_pass_reference(view, rows, spans, max_new_tokens=10)
    assert len({len(r) for r in rationales}) > 1
    torch.testing.assert_close(pooled_embeddings(view, rows, spans, rationales), reference, atol=1e-6, rtol=1e-5)


def test_pooled_embeddings_checks_its_inputs():
    tokenizer, model, rows, spans = make_prompts()
    with pytest.raises(ValueError, match="3 rationales"):
        pooled_embeddings(model_view(model, tokenizer), rows, spans, [[]] * 3)
    with pytest.raises(ValueError, match="outside its prompt"):
        pooled_embeddings(model_view(model, tokenizer), rows[:1], [len(rows[0]) + 1], [[]])
    assert pooled_embeddings(model_view(model, tokenizer), [], [], []).shape == (0, model.config.hidden_size)


# -- the generator's contract, on a stand-in for vllm ------------------------------------------------


class _Completion:
    def __init__(self, token_ids, finish_reason):
        self.token_ids, self.finish_reason = tuple(token_ids), finish_reason


class _FakeLLM:
    """vLLM's LLM as far as the generator uses it: greedy decoding with the HF model, the stop
    token kept in token_ids, finish_reason "stop" or "length" (vllm/v1/core/sched/utils.py)."""

    model = None  # set by the test

    def __init__(self, model, **kwargs):
        self.kwargs = {"model": model, **kwargs}
        self.calls = []

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append((prompts, sampling_params))
        outputs = []
        for prompt, params in zip(prompts, sampling_params):
            ids = list(prompt["prompt_token_ids"])
            generated, reason = [], "length"
            with torch.no_grad():
                while len(generated) < params.max_tokens:
                    logits = self.model(input_ids=torch.tensor([ids + generated])).logits[0, -1]
                    token = int(logits.argmax())
                    generated.append(token)
                    if token in params.stop_token_ids:
                        reason = "stop"
                        break
            outputs.append(types.SimpleNamespace(outputs=[_Completion(generated, reason)]))
        return outputs


class _FakeSamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = _FakeLLM, _FakeSamplingParams
    monkeypatch.setitem(sys.modules, "vllm", module)
    return module


@pytest.mark.parametrize("extra_eos", [False, True])
def test_generator_stops_and_truncates_like_the_hf_backend(fake_vllm, extra_eos):
    tokenizer, model, rows, spans = make_prompts()
    _FakeLLM.model = model
    eos = [tokenizer.eos_token_id]
    if extra_eos:  # declare a token of row 0's free rationale an EOS: row 0 stops, others may not
        free = one_pass_rollouts(model, tokenizer, rows, spans, 10, eos=eos)
        eos = [*eos, free.rationale_ids[0, 3].item()]
    hf = one_pass_rollouts(model, tokenizer, rows, spans, 10, eos=eos)
    generator = VLLMRationaleGenerator("/some/grace-model", dtype="float32", gpu_memory_utilization=0.3, seed=7)
    assert generator.llm.kwargs == {
        "model": "/some/grace-model",
        "dtype": "float32",
        "gpu_memory_utilization": 0.3,
        "seed": 7,
    }
    generated = generator.generate(rows, max_new_tokens=10, eos_token_ids=eos)
    rationales, stops, truncated = generated
    assert rationales == [[t for t in row if t >= 0] for row in hf.rationale_ids.tolist()]
    # one rationale contract: the HF rollout's is the same value, of the same type
    assert generated == hf.rationales() and type(generated) is type(hf.rationales()) is Rationales
    assert truncated == hf.truncated.tolist()
    assert stops == hf.stop_ids.tolist()  # which EOS ended each rationale, -1 where none did
    assert extra_eos == (not all(truncated))
    ((prompts, params),) = generator.llm.calls
    assert [p["prompt_token_ids"] for p in prompts] == rows
    assert all(p.temperature == 0.0 and p.seed is None and p.ignore_eos and not p.detokenize for p in params)
    assert all(p.stop_token_ids == sorted(set(eos)) and p.max_tokens == 10 for p in params)


def test_generator_passes_sampling_settings_and_edge_cases(fake_vllm):
    _, model, rows, _ = make_prompts()
    _FakeLLM.model = model
    generator = VLLMRationaleGenerator("/m")
    generator.generate(
        rows, max_new_tokens=2, eos_token_ids=[5, 2, 5], do_sample=True, temperature=0.7, top_p=0.9, seeds=[1, 2, 3, 4]
    )
    ((_, params),) = generator.llm.calls
    assert [p.seed for p in params] == [1, 2, 3, 4]
    assert all(p.temperature == 0.7 and p.top_p == 0.9 and p.stop_token_ids == [2, 5] for p in params)
    assert generator.generate(rows, max_new_tokens=0, eos_token_ids=[2]) == ([[]] * 4, [-1] * 4, [False] * 4)
    assert generator.generate([], max_new_tokens=4, eos_token_ids=[2]) == ([], [], [])
    assert len(generator.llm.calls) == 1  # neither edge case reached vLLM
    # a temperature a row: 0 is greedy (no seed, no top-p) within the same call
    generator.generate(
        rows, max_new_tokens=2, eos_token_ids=[2], do_sample=True, temperature=[0.5, 0.0, 1.0, 0.0], top_p=0.8, seeds=[1, 2, 3, 4]
    )
    params = generator.llm.calls[-1][1]
    assert [(p.temperature, p.top_p, p.seed) for p in params] == [(0.5, 0.8, 1), (0.0, 1.0, None), (1.0, 0.8, 3), (0.0, 1.0, None)]
    with pytest.raises(ValueError, match="2 temperatures for 4 prompts"):
        generator.generate(rows, max_new_tokens=2, eos_token_ids=[2], do_sample=True, temperature=[0.5, 1.0])
    with pytest.raises(ValueError, match="3 seeds for 4 prompts"):
        generator.generate(rows, max_new_tokens=2, eos_token_ids=[2], do_sample=True, seeds=[1, 2, 3])
    with pytest.raises(ValueError, match="eos_token_ids is empty"):
        generator.generate(rows, max_new_tokens=2, eos_token_ids=[])


def test_generator_without_vllm_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail even where it is installed
    with pytest.raises(ImportError) as info:
        VLLMRationaleGenerator("/some/grace-model")
    assert INSTALL_HINT in str(info.value) and INSTALL_HINT == 'pip install "grace-st[vllm]"'


# -- on a GPU with vLLM: the HF backend's rationales and embeddings ------------------------------------


def _vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


def _vllm_sized_model(tokenizer):
    """conftest's tiny Llama with a head size vLLM's attention kernels take (64, not 8)."""
    from transformers import LlamaForCausalLM

    config = make_model(tokenizer).config
    config.update({"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1})
    config.head_dim = 64
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


@pytest.mark.skipif(not _vllm_available(), reason="needs vllm and a CUDA GPU")
def test_vllm_matches_the_hf_backend_on_gpu(tmp_path, monkeypatch):
    import torch.nn.functional as F

    from grace_st import from_causal_lm

    # the engine in this process: CUDA is about to be initialised here, and a forked engine
    # process could not use it
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    tokenizer = make_tokenizer()
    st = from_causal_lm(model=_vllm_sized_model(tokenizer), tokenizer=tokenizer, device="cpu", max_rationale_tokens=12)
    st.save(str(tmp_path / "grace"))
    generator = VLLMRationaleGenerator(
        str(tmp_path / "grace"),
        dtype="float32",
        gpu_memory_utilization=0.3,
        seed=0,
        enforce_eager=True,
        max_model_len=512,
    )
    st.to("cuda")
    encoder = st[0]
    features = encoder.preprocess(TEXTS)
    prompts = [row[mask.bool()].tolist() for row, mask in zip(features["input_ids"], features["attention_mask"])]
    spans = features["instruction_lengths"].tolist()
    with torch.no_grad():
        hf = encoder({name: value.to("cuda") for name, value in features.items()})
    hf_rationales = [[t for t in row if t >= 0] for row in hf["rationale_token_ids"][:, 0].tolist()]

    # greedy, the encoder's own EOS set: the same rationales, the same embeddings
    rationales, truncated = generator.generate(prompts, max_new_tokens=12, eos_token_ids=encoder.eos_token_ids)
    assert rationales == hf_rationales
    assert truncated == hf["rationale_truncated"][:, 0].tolist()
    pooled = pooled_embeddings(encoder.engine.view, prompts, spans, rationales)
    torch.testing.assert_close(pooled, hf["sentence_embedding"].float(), atol=1e-4, rtol=1e-3)
    encoded = st.encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(F.normalize(pooled, dim=-1), encoded.float(), atol=1e-4, rtol=1e-3)

    # an extra EOS inside row 0's rationale: the stopping path, against generate_rollouts
    eos = [*encoder.eos_token_ids, hf_rationales[0][3]]
    rollouts = generate_rollouts(
        dataclasses.replace(encoder.engine.view, eos_token_ids=tuple(eos)),
        features["input_ids"].cuda(),
        features["attention_mask"].cuda(),
        features["instruction_lengths"].cuda(),
        RolloutSettings(),
        max_new_tokens=12,
    )
    rationales, truncated = generator.generate(prompts, max_new_tokens=12, eos_token_ids=eos)
    assert rationales == [[t for t in row if t >= 0] for row in rollouts.rationale_ids.tolist()]
    assert truncated == rollouts.truncated.tolist() and not truncated[0]

    # seeded sampling is reproducible (vLLM's random stream is not torch's, so not the HF rationales)
    sampled = [
        generator.generate(prompts, max_new_tokens=12, eos_token_ids=eos, do_sample=True, seeds=[1, 2, 3, 4])
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


def test_encoder_on_the_vllm_path_matches_the_hf_path(fake_vllm, tmp_path, monkeypatch):
    """encode through use_vllm (here the stand-in engine) gives the HF backend's rationales and
    embeddings, with and without the rationale cache in front."""
    from conftest import make_st_model
    from sentence_transformers import SentenceTransformer

    from grace_st import explain

    path = str(tmp_path / "model")
    make_st_model(max_rationale_tokens=6).save(path)
    model = SentenceTransformer(path, device="cpu", trust_remote_code=True)
    texts = ["The cat sat on the mat.", "", "Markets fell."]
    hf = explain(model, texts)
    monkeypatch.setattr(fake_vllm.LLM, "model", model[0].model)
    model[0].use_vllm(dtype="float32")
    on_vllm = explain(model, texts)
    model[0].set_rationale_cache(tmp_path / "cache.sqlite")
    cached = explain(model, texts)
    for a, b, c in zip(hf, on_vllm, cached):
        assert a["rationale"] == b["rationale"] == c["rationale"] and a["truncated"] == b["truncated"]
        np.testing.assert_allclose(a["embedding"], b["embedding"], atol=1e-5)
        np.testing.assert_array_equal(b["embedding"], c["embedding"])
    model[0].repetition_penalty = 1.3  # vLLM's penalty would count the text's tokens too: refused, not approximated
    with pytest.raises(ValueError, match="repetition_penalty 1.3 needs the HF rollout"):
        model.encode(["An uncached text."])
    model[0].repetition_penalty = 1.0
    model[0].use_hf()
    np.testing.assert_allclose(model.encode(texts), np.stack([a["embedding"] for a in hf]), atol=1e-6)
