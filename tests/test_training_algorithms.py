"""The algorithm registry: every algorithm is one record the loop, the config, the run directory and the docs read; an
algorithm registered from outside the package trains in the loop with nothing else edited."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import make_st_model
from test_training_trainer import DATA

from grace_training.algorithms.base import LOOP_FILES, Algorithm
from grace_training.algorithms.registry import ALGORITHMS, algorithm_list, register_algorithm, unregister_algorithm
from grace_training.config.train_config import RESUME_CHANGES, ConfigError, TrainConfig
from grace_training.run.run_dir import OutputDirError, claim_output_dir, inspect_output_dir, run_files
from grace_training.steps import TrainingStep
from grace_training.trainer import Trainer

DOCS = Path(__file__).resolve().parents[1] / "docs" / "training.md"


class PooledInfoNCEStep(TrainingStep):
    """InfoNCE over the batch's queries and positives, each embedded from its prompt alone with gradient through the
    engine ``encode`` uses."""

    def loss(self, batch, step, scores):
        def pooled(texts: list[str], task: str) -> torch.Tensor:
            features = self.encoder.tokenize(texts, task=task)
            embedded, _ = self.encoder.engine.embed_prompts(
                features["input_ids"], features["attention_mask"], features["instruction_lengths"]
            )
            return F.normalize(embedded, dim=-1)

        queries, positives = pooled([t.query for t in batch], "query"), pooled([t.positive for t in batch], "document")
        loss = F.cross_entropy(queries @ positives.T / 0.05, torch.arange(len(batch)))
        return loss, {"loss/infonce": loss.item()}


POOLED = Algorithm(
    name="pooled_infonce",
    method="grace",
    summary="a test's algorithm: InfoNCE on prompt-pooled embeddings",
    step=PooledInfoNCEStep,
    label="pooled InfoNCE",
    run_files=(*LOOP_FILES, "pooled.txt"),
)


@pytest.fixture
def pooled_algorithm():
    register_algorithm(POOLED)
    try:
        yield POOLED
    finally:
        unregister_algorithm(POOLED.name)


def test_an_algorithm_registered_from_a_test_trains_one_step_of_the_loop(tmp_path, pooled_algorithm):
    model = make_st_model()
    before = {name: value.detach().clone() for name, value in model[0].model.named_parameters()}
    config = TrainConfig(
        algorithm="pooled_infonce", batch_size=4, max_input_tokens=160, max_rationale_tokens=4, learning_rate=1e-3,
        max_steps=1, save_steps=0, output_dir=str(tmp_path / "run"), report_to=["jsonl"],
    )
    trainer = Trainer(config, model=model, train_data=DATA)
    assert isinstance(trainer.algorithm, PooledInfoNCEStep) and trainer.encoder.method == "grace"
    metrics = trainer.training_step(trainer.batch_for_step(0), 0)
    assert math.isfinite(metrics["loss"]) and metrics["loss"] == metrics["loss/infonce"] > 0
    assert {"grad_norm", "lr", "epoch", "time/step_s", "time/step_cpu_s"} <= metrics.keys()
    moved = [name for name, value in model[0].model.named_parameters() if not torch.equal(value, before[name])]
    assert moved, "one optimiser step changes the weights"
    assert trainer.last_example is None


def test_a_registered_algorithms_run_files_are_what_an_overwrite_replaces(tmp_path, pooled_algorithm):
    out = tmp_path / "shared"
    out.mkdir()
    (out / "pooled.txt").write_text("a run's file\n")
    (out / "notes.txt").write_text("the user's\n")
    with pytest.raises(OutputDirError, match="pooled.txt"):
        inspect_output_dir(out, algorithm="pooled_infonce")
    claim_output_dir(out, algorithm="pooled_infonce", overwrite=True)
    assert not (out / "pooled.txt").exists() and (out / "notes.txt").exists()
    assert "pooled_infonce" in algorithm_list() and run_files("pooled_infonce") == POOLED.run_files


def test_a_name_is_registered_once(pooled_algorithm):
    with pytest.raises(ValueError, match="already registered"):
        register_algorithm(Algorithm(name="pooled_infonce", method="grace", summary="another", step=None))


def test_every_algorithm_trains_a_method_and_owns_keys_of_the_config():
    methods = {"grpo": "grace", "icr": "gircse", "grc": "grc", "infonce": "grace"}
    assert {name: ALGORITHMS[name].method for name in methods} == methods
    for name, method in methods.items():
        assert TrainConfig(algorithm=name).method == method
    owned = [key for record in ALGORITHMS.values() for key in record.config_keys]
    assert len(owned) == len(set(owned)), "a key is one algorithm's at most"
    assert set(owned) <= RESUME_CHANGES.keys()
    for record in ALGORITHMS.values():
        assert set(record.refused_keys) <= RESUME_CHANGES.keys()
        assert not set(record.refused_keys) & set(record.config_keys)


def test_an_algorithm_refuses_the_keys_its_record_refuses_and_ignores_no_others():
    with pytest.raises(ConfigError, match="would be ignored: kl_coef"):
        TrainConfig(algorithm="grc", kl_coef=0.1)
    TrainConfig(algorithm="grpo", kl_coef=0.1, icr_temperature=0.05)  # GRPO refuses none of the others' keys
    with pytest.raises(ConfigError, match="needs algorithm: icr"):
        TrainConfig(algorithm="grpo", prompt_format="instruct")


def test_the_docs_list_of_algorithms_is_the_registrys():
    docs = DOCS.read_text(encoding="utf-8")
    start, end = "<!-- algorithms: generated by grace_training.algorithms.registry.algorithm_list -->\n", "<!-- /algorithms -->"
    assert docs[docs.index(start) + len(start) : docs.index(end)] == algorithm_list() + "\n"


def test_the_names_of_earlier_releases_still_import():
    from grace_training.config import GRPOConfig
    from grace_training.config.train_config import GRPOConfig as config_alias
    from grace_training.trainer import GRPOTrainer

    assert GRPOConfig is config_alias is TrainConfig and GRPOTrainer is Trainer
