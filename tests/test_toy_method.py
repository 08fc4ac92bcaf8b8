"""A method declared in this file alone, through its record: the mean of the prompt's states plus a learned bias
vector, the bias saved beside the weights. Registered for this module only, it encodes, saves and loads, is served,
trains one step of the loop (with an algorithm registered here too), and is refused where its record says so, with no
other file knowing it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_model, make_tokenizer
from torch import nn

import grace_st
from grace_st import from_causal_lm
from grace_st.methods.base import LearnedState, Method
from grace_st.methods.grace import RationaleEngine
from grace_st.methods.registry import METHODS, register, unregister
from grace_st.runtime.batch import Rationales, RolloutRequest, Thoughts, left_pad
from grace_st.setting import WHAT, Setting, is_number

BIAS_FILE = "toy_bias.safetensors"
TEXTS = ["cats", "A man is playing a guitar on stage.", "Stock markets fell after the rate decision."]


class Bias(nn.Module):
    """The toy's learned state: one vector added to every embedding."""

    def __init__(self, hidden_size: int, value: float = 0.0) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.full((hidden_size,), float(value)))

    def save(self, folder) -> None:
        from safetensors.torch import save_file

        save_file({"bias": self.bias.detach().float().cpu().contiguous()}, str(Path(folder) / BIAS_FILE))

    @classmethod
    def load(cls, folder) -> Bias | None:
        from safetensors.torch import load_file

        path = Path(folder) / BIAS_FILE
        if not path.is_file():
            return None
        tensors = load_file(str(path))
        state = cls(tensors["bias"].shape[0])
        state.load_state_dict(tensors)
        return state


class BiasEngine(RationaleEngine):
    """Writes nothing; embeds each prompt as the mean of its states after L_sys, plus the bias."""

    ragged = False
    embeds_decoding_states = False

    def __init__(self, model, tokenizer, *, bias: Bias, **shared) -> None:
        super().__init__(model, tokenizer, **shared)
        self.bias = bias

    def generate(self, request: RolloutRequest, batch_size=None, bucket_ratio=None) -> Thoughts:
        rows = len(request.prompt_ids)
        return Thoughts(Rationales([[] for _ in range(rows)], [-1] * rows, [False] * rows))

    @torch.no_grad()
    def embed(self, request: RolloutRequest, thoughts: Thoughts, batch_size=None) -> torch.Tensor:
        device = next(self.model.parameters()).device
        input_ids, attention_mask = left_pad(request.prompt_ids, self.pad_token_id)
        spans = torch.tensor(request.instruction_lengths, device=device)
        pooled, _ = self.embed_prompts(input_ids.to(device), attention_mask.to(device), spans)
        return pooled.float() + self.bias.bias.to(device)


def _rules(values) -> list[str]:
    if values.get("method") == "toy" and values.get("do_sample", False):
        return ["method 'toy' samples nothing: set do_sample=False"]
    return []


TOY = Method(
    "toy",
    BiasEngine,
    "pools the prompt and adds a learned bias (a test's method)",
    settings={
        "toy_bias_init": Setting(0.0, "method 'toy': a fresh bias's value", "a finite number", is_number, **WHAT),
    },
    engine_options=lambda settings, state: {"bias": state},
    rules=_rules,
    default_budget=0,
    state=LearnedState(
        "toy_bias",
        BIAS_FILE,
        load=Bias.load,
        save=lambda state, folder: state.save(folder),
        prepare=lambda model, state, settings: state
        if state is not None
        else Bias(model.config.get_text_config().hidden_size, settings["toy_bias_init"]),
    ),
    vllm=False,
    vllm_refusal="adds a bias to the prompt's states",
    trained_by="toy",
)


@pytest.fixture(scope="module", autouse=True)
def toy():
    register(TOY)
    yield TOY
    unregister("toy")


def toy_model(**settings):
    tokenizer = make_tokenizer()
    model = from_causal_lm(model=make_model(tokenizer), tokenizer=tokenizer, device="cpu", method="toy", **settings)
    with torch.no_grad():
        model[0].toy_bias.bias.copy_(torch.linspace(-1.0, 1.0, model[0].toy_bias.bias.shape[0]))
    return model


def pooled(encoder, texts, task=None) -> torch.Tensor:
    """The encoder's sentence embedding before any normalising module."""
    with torch.no_grad():
        return encoder(encoder.preprocess(texts, task=task), task=task)["sentence_embedding"]


def test_the_toy_is_one_more_row_of_the_table_and_its_setting_joins_the_settings():
    from grace_st.settings import DEFAULTS, SETTINGS, default_budget

    assert METHODS["toy"] is TOY and TOY.trained_by == "toy"
    assert "toy_bias_init" in SETTINGS and DEFAULTS["toy_bias_init"] == 0.0
    assert "'toy' pools the prompt" in SETTINGS["method"].help and "toy" in SETTINGS["method"].choices
    assert default_budget("toy") == 0
    model = toy_model(toy_bias_init=0.5)
    assert model[0].toy_bias_init == 0.5 and "toy_bias_init" in model[0].get_config_dict()
    assert model[0].max_rationale_tokens == 0  # the record's budget


def test_the_toy_encodes_the_prompt_mean_plus_its_bias():
    model = toy_model()
    encoder = model[0]
    toy = pooled(encoder, TEXTS)
    query = pooled(encoder, TEXTS, task="query")
    assert not torch.equal(toy, query)  # the query's instruction is another prompt
    encoder.method = "grace"  # the same model, pooling its prompt at budget 0: the toy without the bias
    grace = pooled(encoder, TEXTS)
    torch.testing.assert_close(toy - grace, encoder.toy_bias.bias.expand_as(toy), atol=1e-6, rtol=0)
    encoder.method = "toy"
    assert np.array_equal(model.encode_query(TEXTS), model.encode_query(TEXTS))
    assert np.array_equal(model.encode(TEXTS), model.encode(TEXTS))


def test_the_engine_is_built_once_and_again_when_the_state_changes():
    encoder = toy_model()[0]
    engine = encoder.engine
    assert encoder.engine is engine and engine.bias is encoder.toy_bias
    encoder.toy_bias = Bias(encoder.toy_bias.bias.shape[0], 2.0)
    assert encoder.engine is not engine and encoder.engine.bias is encoder.toy_bias
    encoder.toy_bias = None
    encoder.check_settings()  # a check makes no state
    assert encoder.toy_bias is None
    encoder.prepare_method_state()  # this does: a fresh bias at the setting's value
    assert torch.equal(encoder.toy_bias.bias, torch.zeros_like(encoder.toy_bias.bias))


def test_the_bias_is_saved_beside_the_weights_and_loads_back(tmp_path):
    model = toy_model(toy_bias_init=0.25)
    before = model.encode(TEXTS)
    model.save(str(tmp_path / "m"))
    assert (tmp_path / "m" / BIAS_FILE).is_file()
    loaded = grace_st.load(str(tmp_path / "m"))
    assert loaded[0].method == "toy" and loaded[0].toy_bias_init == 0.25
    assert torch.equal(loaded[0].toy_bias.bias, model[0].toy_bias.bias)
    assert np.array_equal(loaded.encode(TEXTS), before)
    edited = Bias.load(tmp_path / "m")
    with torch.no_grad():
        edited.bias.add_(1.0)
    edited.save(tmp_path / "m")
    with pytest.raises(ValueError, match="weights_revision"):  # the bias is fingerprinted with the weights
        grace_st.load(str(tmp_path / "m"))


def test_the_server_answers_with_encode_s_embeddings():
    from fastapi.testclient import TestClient

    from grace_st.serve.server import create_app

    model = toy_model()
    with TestClient(create_app(model, model_name="toy")) as client:
        response = client.post("/v1/embeddings", json={"input": TEXTS, "model": "toy"})
    assert response.status_code == 200, response.text
    got = np.array([item["embedding"] for item in response.json()["data"]], dtype=np.float32)
    assert np.array_equal(got, model.encode(TEXTS))


def test_the_record_s_refusals(tmp_path):
    model = toy_model()
    with pytest.raises(ValueError, match="vLLM cannot"):
        model[0].use_vllm(tmp_path)
    model[0].do_sample = True
    with pytest.raises(ValueError, match="method 'toy' samples nothing"):
        model[0].check_settings()



def _toy_algorithm():
    import torch.nn.functional as F

    from grace_training.algorithms.base import Algorithm
    from grace_training.steps import TrainingStep

    class Step(TrainingStep):
        def loss(self, batch, step, scores):
            def embedded(texts, task):
                features = self.encoder.tokenize(texts, task=task)
                pooled, _ = self.encoder.engine.embed_prompts(
                    features["input_ids"], features["attention_mask"], features["instruction_lengths"]
                )
                return F.normalize(pooled.float() + self.encoder.toy_bias.bias, dim=-1)

            queries = embedded([t.query for t in batch], "query")
            positives = embedded([t.positive for t in batch], "document")
            loss = F.cross_entropy(queries @ positives.T / 0.05, torch.arange(len(batch)))
            return loss, {"loss/toy": loss.item()}

        @classmethod
        def extra_parameters(cls, encoder):
            return list(encoder.toy_bias.parameters())

    return Algorithm(name="toy", method="toy", summary="a test's algorithm: the toy's InfoNCE", step=Step)


def test_the_toy_trains_one_step_and_its_checkpoint_loads_with_the_trained_bias(tmp_path):
    from test_training_trainer import DATA

    from grace_training.algorithms.registry import register_algorithm, unregister_algorithm
    from grace_training.config import TrainConfig
    from grace_training.trainer import Trainer

    register_algorithm(_toy_algorithm())
    try:
        model = toy_model()
        bias = model[0].toy_bias.bias.detach().clone()
        weights = {name: value.detach().clone() for name, value in model[0].model.named_parameters()}
        config = TrainConfig(
            algorithm="toy", batch_size=4, max_input_tokens=160, learning_rate=1e-2, max_steps=1, save_steps=1,
            output_dir=str(tmp_path / "run"), report_to=["jsonl"],
        )
        result = Trainer(config, model=model, train_data=DATA).train()
    finally:
        unregister_algorithm("toy")
    assert result["metrics"]["loss/toy"] > 0
    assert model[0].method == "toy"
    assert not torch.equal(model[0].toy_bias.bias, bias), "the bias is trained beside the weights"
    assert any(not torch.equal(value, weights[name]) for name, value in model[0].model.named_parameters())
    checkpoint = tmp_path / "run" / "checkpoint-00000001"
    loaded = grace_st.load(str(checkpoint))
    assert loaded[0].method == "toy" and torch.equal(loaded[0].toy_bias.bias, model[0].toy_bias.bias)
    assert np.array_equal(loaded.encode(TEXTS), model.encode(TEXTS))
