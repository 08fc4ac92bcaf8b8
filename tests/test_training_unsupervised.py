"""The shipped unsupervised recipe (``grace_training/configs/unsup_smollm2.yaml``, GRACE's Eqs. 12–13) runs on a
tiny model: its own settings, only the model, the data and the run's length replaced."""

from __future__ import annotations

import math
from pathlib import Path

from conftest import CORPUS
from test_training_quality import saved_base

from grace_training.config.train_config import TrainConfig
from grace_training.data.examples import Triplet
from grace_training.trainer import Trainer

RECIPE = Path(__file__).resolve().parents[1] / "grace_training" / "configs" / "unsup_smollm2.yaml"
TEXTS = list(dict.fromkeys(CORPUS))


def recipe(tmp_path, **overrides) -> TrainConfig:
    settings = {
        "output_dir": str(tmp_path / "run"), "max_steps": 2, "batch_size": 4, "save_steps": 1, "eval_data": [],
        "rollout_batch_size": 16, **overrides,
    }
    return TrainConfig.from_yaml(RECIPE, [f"{key}={value}" for key, value in settings.items()])


def test_the_recipe_is_the_unsupervised_objective_with_the_lm_held():
    config = TrainConfig.from_yaml(RECIPE, [])
    assert config.objective == "unsupervised" and config.num_negatives == 0
    assert config.contrastive_beta > 0 and config.text_kl_coef > 0 and config.finetune == "lora"


def test_two_steps_of_the_recipe_train_and_checkpoint(tmp_path):
    config = recipe(tmp_path, max_rationale_tokens="{default: 3, query: 0, document: 0}")
    data = [Triplet(text, text, (), symmetric=True) for text in TEXTS]  # raw texts, as a `text` source gives them
    result = Trainer(config, model=saved_base(tmp_path), train_data=data).train()
    metrics = result["metrics"]
    assert all(math.isfinite(value) for value in metrics.values())
    assert metrics["text_kl"] > 0  # step 2 has moved away from the reference the LM is held to
    assert (tmp_path / "run" / "checkpoint-00000002" / "modules.json").is_file()


def test_unsupervised_texts_keep_their_source_s_prompt_type(tmp_path):
    from grace_training.data.examples import load_data

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS[:4]) + "\n", encoding="utf-8")
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("score\tsentence1\tsentence2\n4.5\tone cat\ttwo cats\n", encoding="utf-8")
    specs = [{"type": "text", "path": str(corpus)}, {"type": "sts", "path": str(pairs), "symmetric": True},
             {"type": "sts", "path": str(pairs), "name": "asymmetric"}]
    rows, _ = load_data(specs, objective="unsupervised")
    assert {row.query for row in rows} == set(TEXTS[:4]) | {"one cat", "two cats"}
    assert all(row.query == row.positive and not row.negatives for row in rows)
    assert all(row.symmetric for row in rows if row.query in TEXTS[:4])  # raw text: encode's "default" type
    assert all(row.symmetric for row in rows if row.query in ("one cat", "two cats"))  # first source's flag


def test_texts_embedded_without_a_rationale_train_on_the_contrastive_and_text_terms(tmp_path):
    """Queries and documents at budget 0 roll out no completion token at all: the policy term is empty and the
    step still trains β · InfoNCE and the LM-hold term."""
    config = recipe(tmp_path, max_rationale_tokens="{default: 3, query: 0, document: 0}")
    data = [Triplet(text, text, ()) for text in TEXTS]  # not symmetric: anchors as queries, views as documents
    metrics = Trainer(config, model=saved_base(tmp_path), train_data=data).train()["metrics"]
    assert all(math.isfinite(value) for value in metrics.values())
    assert metrics["loss/contrastive"] > 0 and metrics["text_kl"] > 0 and metrics["rollout/positive_length_max"] == 0
