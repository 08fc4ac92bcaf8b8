"""``grace-train``: --dry-run plans, config errors, a short run with --resume, and the InfoNCE baseline."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CORPUS, make_st_model
from sentence_transformers import SentenceTransformer

from grace_training.cli import main
from grace_training.config.train_config import TrainConfig
from grace_training.data.examples import Triplet


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    make_st_model().save(str(root / "model"))
    lines = [
        json.dumps({"query": CORPUS[i], "positive": CORPUS[i + 1], "negatives": [CORPUS[i + 2]]}) for i in range(6)
    ]
    (root / "train.jsonl").write_text("\n".join([*lines, "{broken"]) + "\n")
    (root / "config.yaml").write_text(
        f"model_name_or_path: {root / 'model'}\n"
        f"data_dir: {root}\n"
        "train_data:\n  - {type: triplets, path: train.jsonl}\n"
        "num_rollouts: 2\nbatch_size: 2\nmax_input_tokens: 160\nmax_rationale_tokens: 4\n"
        "learning_rate: 1e-4\nsave_steps: 1\nreport_to: [jsonl]\n"
    )
    return root


def test_dry_run_prints_the_plan(setup, capsys):
    assert main(["--config", str(setup / "config.yaml"), "--dry-run", "max_steps=5"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["instances"] == 6 and plan["bad_rows"] == 1
    assert plan["steps_per_epoch"] == 3 and plan["total_steps"] == 5
    assert plan["rollouts_per_step"] == 2 * (1 + 2 + 1) and plan["positive_rollouts_per_step"] == 4
    assert plan["max_generated_tokens_per_step"] == 8 * 4 and plan["mean_prompt_tokens"]["document"] > 0


def test_bad_config_and_refused_data_exit_with_2(setup, capsys):
    assert main(["--config", str(setup / "config.yaml"), "--dry-run", "num_rollouts=0"]) == 2
    assert main(["--config", str(setup / "config.yaml"), "--dry-run", "bad_rows=error"]) == 2
    assert "train.jsonl:7" in capsys.readouterr().err


def test_a_misspelled_prompt_type_in_the_budgets_is_a_bad_config(setup, capsys):
    argv = ["--config", str(setup / "config.yaml"), "--dry-run"]
    assert main([*argv, "max_rationale_tokens={qeury: 0, default: 4}"]) == 2
    assert "the prompt type 'qeury' is no type a text is encoded as" in capsys.readouterr().err
    assert main([*argv, "max_rationale_tokens={query: 4, document: 0, default: 4}"]) == 0


@pytest.mark.parametrize("method", ["grpo", "infonce"])
@pytest.mark.parametrize("dry_run", [False, True])
def test_a_model_that_cannot_load_is_one_line_and_exit_1(setup, tmp_path, capsys, method, dry_run):
    """A missing local path is named as one (transformers would call it a malformed Hub id), and a
    directory that is no model is one line too: never a traceback."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    argv = ["--config", str(setup / "config.yaml"), "--algorithm", method, *(["--dry-run"] if dry_run else [])]
    cases = [(tmp_path / "no" / "such" / "model", "no such local directory")]
    if not dry_run:  # the dry run reads only the tokenizer
        cases.append((broken, f"cannot load {broken}"))
    for model, message in cases:
        code = main([*argv, f"model_name_or_path={model}", f"output_dir={tmp_path / 'run'}", "max_steps=1"])
        err = capsys.readouterr().err
        assert code == 1, err
        assert message in err and "Traceback" not in err and "Repo id" not in err
        assert err.strip().splitlines()[-1].startswith("grace-train: error: model_name_or_path:")


def test_train_then_resume(setup, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["--config", str(setup / "config.yaml"), f"output_dir={out}", "max_steps=1"]) == 0
    assert main(["--config", str(setup / "config.yaml"), f"output_dir={out}", "max_steps=2", "--resume"]) == 0
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (out / "config.yaml").is_file() and (out / "checkpoint-00000002" / "modules.json").is_file()


def _record_prompt_types(monkeypatch) -> list:
    """The prompt type of every batch the InfoNCE baseline's encoder preprocesses."""
    from grace_training.algorithms.infonce.train import PromptPoolingEncoder

    tasks = []
    original = PromptPoolingEncoder.preprocess

    def record(self, texts, prompt=None, task=None, **kwargs):
        tasks.append(task)
        return original(self, texts, prompt=prompt, task=task, **kwargs)

    monkeypatch.setattr(PromptPoolingEncoder, "preprocess", record)
    return tasks


def test_infonce_baseline_saves_a_grace_model(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    from grace_training.algorithms.infonce.train import train_infonce

    model = make_st_model()
    before = {k: v.clone() for k, v in model[0].model.state_dict().items()}
    data = [Triplet(CORPUS[i], CORPUS[i + 1], (CORPUS[i + 2],)) for i in range(8)]
    cfg = TrainConfig(
        batch_size=4,
        max_steps=2,
        max_input_tokens=160,
        output_dir=str(tmp_path),
        report_to=["jsonl"],
        infonce_learning_rate=1e-3,
    )
    tasks = _record_prompt_types(monkeypatch)
    path = train_infonce(cfg, model=model, train_data=data)
    assert {"query", "document"} <= set(tasks)  # queries and documents get their own instructions
    changed = [k for k, v in model[0].model.state_dict().items() if not v.equal(before[k])]
    assert changed
    loaded = SentenceTransformer(str(path), trust_remote_code=True, device="cpu")
    assert type(loaded[0]).__name__ == "GenerativeEncoder" and loaded.encode(["x"]).shape == (1, 32)
    assert loaded[0].max_rationale_tokens == 0  # it encodes as it was trained: from the prompt alone
    assert "InfoNCE" in (path / "README.md").read_text()
    # its cost, measured as GRPO's: one line a step with the step's CPU seconds and loss
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert all(line["time/step_cpu_s"] > 0 and "loss" in line for line in lines)


def test_infonce_baseline_stops_and_saves_after_max_minutes(tmp_path):
    """GRPO's --max-minutes for the yardstick: a run at a given cost ends at the first step past it, saved."""
    pytest.importorskip("datasets")
    from grace_training.algorithms.infonce.train import train_infonce

    data = [Triplet(CORPUS[i], CORPUS[i + 1], (CORPUS[i + 2],)) for i in range(8)]
    cfg = TrainConfig(batch_size=2, max_steps=4, max_input_tokens=160, output_dir=str(tmp_path), report_to=["jsonl"])
    path = train_infonce(cfg, model=make_st_model(), train_data=data, max_minutes=0)
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
    assert (path / "modules.json").is_file()  # saved where it stopped


def test_infonce_baseline_stops_at_a_step_and_a_second_call_trains_nothing(tmp_path):
    """--stop-at-step for the yardstick: decisions/D028's warm start is step 455 of a 1000-step run."""
    pytest.importorskip("datasets")
    from grace_training.algorithms.infonce.train import last_trainer_checkpoint, train_infonce

    data = [Triplet(CORPUS[i], CORPUS[i + 1], (CORPUS[i + 2],)) for i in range(8)]
    cfg = TrainConfig(
        batch_size=2, max_steps=4, max_input_tokens=160, output_dir=str(tmp_path), report_to=["jsonl"], save_steps=0
    )

    def steps():
        return [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]

    path = train_infonce(cfg, model=make_st_model(), train_data=data, stop_at_step=2)
    assert steps() == [1, 2] and last_trainer_checkpoint(tmp_path)[1] == 2
    assert (path / "modules.json").is_file()  # the model at step 2
    assert train_infonce(cfg, model=make_st_model(), train_data=data, resume=True, stop_at_step=2) == path
    assert steps() == [1, 2]


def test_infonce_baseline_resumes_where_max_minutes_stopped_it(tmp_path):
    """The yardstick in chunks: a run stopped by --max-minutes and resumed ends with the weights and the
    per-step losses of the same run done in one go (the Trainer restores AdamW, the RNG and the data position)."""
    pytest.importorskip("datasets")
    from grace_training.algorithms.infonce.train import last_trainer_checkpoint, train_infonce
    from grace_training.run.checkpoint import CheckpointError

    data = [Triplet(CORPUS[i], CORPUS[i + 1], (CORPUS[i + 2],)) for i in range(8)]

    def config(out):
        return TrainConfig(batch_size=2, max_steps=3, max_input_tokens=160, output_dir=str(out), report_to=["jsonl"],
                          infonce_learning_rate=1e-3, save_steps=0)

    def losses(out):
        return [(line["step"], line["loss"]) for line in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]

    whole = make_st_model()
    train_infonce(config(tmp_path / "whole"), model=whole, train_data=data)

    with pytest.raises(CheckpointError, match="no complete InfoNCE checkpoint"):
        train_infonce(config(tmp_path / "chunks"), model=make_st_model(), train_data=data, resume=True)
    train_infonce(config(tmp_path / "chunks"), model=make_st_model(), train_data=data, max_minutes=0)
    assert last_trainer_checkpoint(tmp_path / "chunks")[1] == 1  # saved where the chunk stopped
    resumed = make_st_model()
    train_infonce(config(tmp_path / "chunks"), model=resumed, train_data=data, resume=True)

    assert losses(tmp_path / "chunks") == losses(tmp_path / "whole")
    trained = whole[0].model.state_dict()
    for name, value in resumed[0].model.state_dict().items():
        torch.testing.assert_close(value, trained[name], rtol=0, atol=1e-6, msg=name)


def test_infonce_baseline_takes_the_same_mix_and_prompt_types_as_grpo(tmp_path, monkeypatch):
    """The yardstick on the scale recipe's data: a batch a source by weight, symmetric sources under "default"."""
    pytest.importorskip("datasets")
    from grace_training.algorithms.infonce.train import infonce_datasets, train_infonce

    pairs = [Triplet(CORPUS[i], CORPUS[i + 1], (CORPUS[i + 2],), "sts", symmetric=True) for i in range(8)]
    retrieval = [Triplet(CORPUS[i + 1], CORPUS[i], (CORPUS[i + 3],), "beir") for i in range(8)]
    specs = [
        {"type": "pairs", "path": "sts.tsv", "name": "sts", "weight": 3.0},
        {"type": "beir", "path": "beir", "name": "beir", "weight": 1.0},
    ]
    cfg = TrainConfig(
        batch_size=2,
        max_steps=4,
        max_input_tokens=160,
        output_dir=str(tmp_path),
        report_to=["jsonl"],
        infonce_learning_rate=1e-3,
        batch_sampling="by_source",
        train_data=specs,
    )
    datasets, routes = infonce_datasets(pairs + retrieval, cfg, 2)
    assert {name: len(d) for name, d in datasets.items()} == {"sts": 6, "beir": 2}  # 8 triplets, 3 : 1
    assert routes == {
        "sts": dict.fromkeys(("anchor", "positive", "negative"), "default"),
        "beir": {"anchor": "query", "positive": "document", "negative": "document"},
    }
    tasks = _record_prompt_types(monkeypatch)
    train_infonce(cfg, model=make_st_model(), train_data=pairs + retrieval)
    assert set(tasks) == {"default", "query", "document"}


def test_the_baseline_trains_a_graded_source_with_cosent_on_its_scores(tmp_path, monkeypatch):
    """Scored pairs (an sts source) are a dataset of their own, (anchor, positive, score), trained with
    sentence-transformers' CoSENTLoss, as GRPO trains them with its graded term; refused outside by_source."""
    pytest.importorskip("datasets")
    from grace_training.algorithms.infonce.train import infonce_datasets, train_infonce

    graded = [Triplet(CORPUS[i], CORPUS[i + 1], (), "graded", float(i % 5), symmetric=True) for i in range(8)]
    retrieval = [Triplet(CORPUS[i + 1], CORPUS[i], (CORPUS[i + 3],), "beir") for i in range(8)]
    specs = [{"type": "sts", "path": "sts.tsv", "name": "graded"}, {"type": "beir", "path": "beir", "name": "beir"}]
    settings = dict(batch_size=2, max_steps=2, max_input_tokens=160, output_dir=str(tmp_path), report_to=["jsonl"],
                    contrastive_beta=1.0, batch_sampling="by_source", train_data=specs)
    cfg = TrainConfig(**settings)
    datasets, _ = infonce_datasets(graded + retrieval, cfg, 2)
    assert datasets["graded"].column_names == ["anchor", "positive", "score"]
    part = datasets["graded"]
    assert set(zip(part["anchor"], part["positive"], part["score"])) <= {(t.query, t.positive, t.score) for t in graded}
    losses = []
    import sentence_transformers

    original = sentence_transformers.SentenceTransformerTrainer.__init__

    def recorded(self, *args, **kwargs):
        losses.append(kwargs["loss"])
        original(self, *args, **kwargs)

    monkeypatch.setattr(sentence_transformers.SentenceTransformerTrainer, "__init__", recorded)
    train_infonce(cfg, model=make_st_model(), train_data=graded + retrieval)
    assert {name: type(loss).__name__ for name, loss in losses[0].items()} == {
        "graded": "CoSENTLoss", "beir": "MultipleNegativesRankingLoss"
    }
    with pytest.raises(ValueError, match="scored pairs .* by_source"):
        infonce_datasets(graded, TrainConfig(**{**settings, "batch_sampling": "shuffled", "train_data": []}), 2)
