"""No silent wrong result, no data-loss window: crash-safe checkpoint replacement and metrics,
resume fallback past corrupt checkpoints, typed config validation and a fuzz of bad configs."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import re
import shutil
import threading
import time
import types
import typing
from pathlib import Path

import pytest
import torch
from conftest import CORPUS, make_st_model

from grace_training.cli import main
from grace_training.config.train_config import RULES, ConfigError, TrainConfig, config_table
from grace_training.data.examples import Triplet
from grace_training.run import checkpoint as checkpoint_module
from grace_training.run.checkpoint import (
    CheckpointError,
    list_checkpoints,
    read_trainer_state,
    remove_incomplete,
    write_checkpoint,
)
from grace_training.run.metrics import MetricsLogger
from grace_training.run.run_dir import config_changes
from grace_training.trainer import Trainer

DATA = [Triplet(CORPUS[i], CORPUS[i + 1], (CORPUS[i + 2],), "toy") for i in range(8)]


def small_config(output_dir: Path, **overrides) -> TrainConfig:
    settings = {
        "num_rollouts": 2,
        "batch_size": 2,
        "max_input_tokens": 160,
        "max_rationale_tokens": 3,
        "learning_rate": 1e-3,
        "max_steps": 2,
        "save_steps": 1,
        "save_total_limit": None,
        "output_dir": str(output_dir),
        "report_to": ["jsonl"],
    }
    return TrainConfig(**{**settings, **overrides})


# -- 5. re-saving a step never leaves recovery without a complete copy ------------------------------


def save(root: Path, step: int, marker: str) -> Path:
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return write_checkpoint(
        root,
        step,
        write_model=lambda path: (path / "marker.txt").write_text(marker),
        trainer_state={"step": step, "marker": marker},
        optimizer=optimizer,
        scheduler=scheduler,
    )


def fail_nth_replace(monkeypatch, n: int) -> None:
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append((src, dst))
        if len(calls) == n:
            raise OSError(f"killed before rename {n}")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("crash_at", [1, 2, 3])
def test_a_crash_while_replacing_a_checkpoint_keeps_a_complete_copy(tmp_path, monkeypatch, crash_at):
    save(tmp_path, 3, "old")
    with monkeypatch.context() as patch:
        fail_nth_replace(patch, crash_at)
        with pytest.raises(OSError, match="killed"):
            save(tmp_path, 3, "new")
    remove_incomplete(tmp_path)  # the next start's recovery

    assert [step for step, _ in list_checkpoints(tmp_path)] == [3]
    final = tmp_path / "checkpoint-00000003"
    marker = (final / "marker.txt").read_text()
    assert read_trainer_state(final)["marker"] == marker
    assert marker == ("old" if crash_at <= 2 else "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-00000003"]


def test_a_crash_while_deleting_the_old_copy_is_cleaned_up(tmp_path, monkeypatch):
    save(tmp_path, 3, "old")
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint_module.shutil, "rmtree", lambda *a, **k: None)  # dies before deleting anything
        save(tmp_path, 3, "new")
    remove_incomplete(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-00000003"]
    assert (tmp_path / "checkpoint-00000003" / "marker.txt").read_text() == "new"


def test_a_replacement_without_a_crash_leaves_only_the_new_copy(tmp_path):
    save(tmp_path, 3, "old")
    save(tmp_path, 3, "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-00000003"]
    assert read_trainer_state(tmp_path / "checkpoint-00000003")["marker"] == "new"


def test_a_kill_during_rotation_leaves_no_half_deleted_checkpoint_and_the_next_start_finishes_it(
    tmp_path, monkeypatch
):
    """Rotation renames a checkpoint it drops to .deleting-checkpoint-* before deleting a file of it:
    a kill part way leaves that name, which the next start removes, and every checkpoint that was
    reported saved (kept, or another run's) stays as it was."""
    from grace_training.run.checkpoint import RunFamily, rotate_checkpoints

    mine = RunFamily("mine")
    for step in (1, 2, 3):
        parameter = torch.nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.SGD([parameter], lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        write_checkpoint(
            tmp_path, step, write_model=lambda path, step=step: (path / "marker.txt").write_text(str(step)),
            trainer_state={"step": step}, optimizer=optimizer, scheduler=scheduler, family=mine,
        )
    foreign = tmp_path / ".deleting-checkpoint-00000009"
    (foreign / "trainer_state").mkdir(parents=True)
    (foreign / "trainer_state" / "run.json").write_text(json.dumps({"run_id": "another run"}))
    with monkeypatch.context() as patch:
        real, calls = checkpoint_module.remove_path, []

        def killed(path):
            calls.append(path)
            if len(calls) == 2:
                raise OSError("killed mid-deletion")
            return real(path)

        patch.setattr(checkpoint_module, "remove_path", killed)
        with pytest.raises(OSError, match="killed"):
            rotate_checkpoints(tmp_path, keep=1, family=mine)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "checkpoint-00000001" not in names and ".deleting-checkpoint-00000001" in names
    assert [step for step, _ in list_checkpoints(tmp_path, mine)] == [2, 3]  # none half-deleted under its name

    removed = remove_incomplete(tmp_path, mine)  # the next start
    assert [p.name for p in removed] == [".deleting-checkpoint-00000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".deleting-checkpoint-00000009", "checkpoint-00000002", "checkpoint-00000003"
    ]
    assert (tmp_path / "checkpoint-00000002" / "marker.txt").read_text() == "2"
    assert [p.name for p in rotate_checkpoints(tmp_path, keep=1, family=mine)] == ["checkpoint-00000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".deleting-checkpoint-00000009", "checkpoint-00000003"]


class ThreadProcess:
    """One of two training processes, played by a thread: the barrier is shared, and ``save_state``
    writes this process's own file as accelerate's does (each process its random state), process 1
    late, as a loaded machine makes it."""

    num_processes = 2

    def __init__(self, index: int, barrier: threading.Barrier):
        self.index, self.barrier = index, barrier
        self.is_main_process = index == 0

    def wait_for_everyone(self) -> None:
        self.barrier.wait(timeout=60)

    def save_state(self, output_dir: str) -> None:
        if self.index:
            time.sleep(0.5)
        os.makedirs(output_dir, exist_ok=True)
        (Path(output_dir) / f"random_states_{self.index}.pkl").write_bytes(b"state")


def test_a_checkpoint_of_two_processes_holds_both_states_however_late_one_writes(tmp_path):
    """The main process renames the staging directory only once every process has written its part
    into it: a late process's state is in the checkpoint, never in a staging directory re-made
    after the rename, and no process writes into a path that is gone."""
    barrier, errors = threading.Barrier(2), []

    def process(index: int) -> None:
        try:
            write_checkpoint(
                tmp_path, 1, write_model=lambda path: (path / "marker.txt").write_text("model"),
                trainer_state={"step": 1}, accelerator=ThreadProcess(index, barrier),
            )
        except Exception as error:  # noqa: BLE001 - reported below, with the other process's outcome
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=process, args=(index,)) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-00000001"]
    state = tmp_path / "checkpoint-00000001" / "trainer_state" / "accelerate"
    assert sorted(p.name for p in state.iterdir()) == ["random_states_0.pkl", "random_states_1.pkl"]


# -- 6. the resume rewrite of metrics.jsonl is atomic ----------------------------------------------


class KilledMidWrite:
    """A file handle whose write stores half the text, then dies."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def write(self, text: str) -> int:
        self.handle.write(text[: len(text) // 2])
        self.handle.flush()
        raise OSError("killed mid-write")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.handle.close()

    def __getattr__(self, name):
        return getattr(self.handle, name)


def lines_of(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_a_kill_while_metrics_are_rewritten_on_resume_loses_no_line(tmp_path, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"
    original = [json.dumps({"step": step, "loss": 0.1 * step}) for step in (1, 2, 3, 4)]
    metrics.write_text("".join(f"{line}\n" for line in original), encoding="utf-8")
    real_open = io.open

    def open_and_die_writing(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        return KilledMidWrite(handle) if "w" in mode and Path(file).parent == tmp_path else handle

    with monkeypatch.context() as patch:
        patch.setattr(io, "open", open_and_die_writing)  # pathlib's write_text opens through io.open
        patch.setattr("builtins.open", open_and_die_writing)
        with pytest.raises(OSError, match="killed mid-write"):
            MetricsLogger(tmp_path, ["jsonl"], resume_step=2)
    assert lines_of(metrics) == original
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]

    MetricsLogger(tmp_path, ["jsonl"], resume_step=2)
    assert lines_of(metrics) == original[:2]


def test_a_line_torn_by_the_crash_is_dropped_on_resume(tmp_path, caplog):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo', encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        MetricsLogger(tmp_path, ["jsonl"], resume_step=2)
    assert lines_of(metrics) == ['{"step": 1}', '{"step": 2}']
    assert "unreadable" in caplog.text


# -- 7. --resume falls back past corrupt checkpoints -----------------------------------------------


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A two-step run with checkpoints at steps 1 and 2, copied by each test that spoils it."""
    run = tmp_path_factory.mktemp("reliability") / "run"
    Trainer(small_config(run), model=make_st_model(), train_data=DATA).train()
    assert [step for step, _ in list_checkpoints(run)] == [1, 2]
    return run


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


CORRUPTIONS = {
    "state.json truncated": ("trainer_state/state.json", truncate),
    "state.json not a state": ("trainer_state/state.json", lambda f: f.write_text("[]")),
    "optimizer.pt missing": ("trainer_state/optimizer.pt", Path.unlink),
    "optimizer.pt garbage": ("trainer_state/optimizer.pt", lambda f: f.write_bytes(b"garbage!" * 64)),
    "safetensors truncated": ("model.safetensors", truncate),
    "safetensors header garbage": ("model.safetensors", lambda f: f.write_bytes(b"\xff" * 64)),
}


def spoiled_copy(trained_run: Path, tmp_path: Path, corruption: str, steps=(2,)) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    relative, spoil = CORRUPTIONS[corruption]
    for step in steps:
        spoil(run / f"checkpoint-{step:08d}" / relative)
    return run


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_resume_falls_back_to_the_newest_loadable_checkpoint(trained_run, tmp_path, caplog, corruption):
    from safetensors.torch import load_file

    run = spoiled_copy(trained_run, tmp_path, corruption)
    trainer = Trainer(small_config(run), model=make_st_model(), train_data=DATA)
    with caplog.at_level(logging.WARNING):
        assert trainer.resume() == 1
    file = CORRUPTIONS[corruption][0].rsplit("/", 1)[-1]
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 1 and "checkpoint-00000002" in skipped[0] and file in skipped[0]
    assert any("took" in r.getMessage() and "checkpoint-00000001" in r.getMessage() for r in caplog.records)
    # the spoiled one leaves rotation's count (else keep-last-k could delete the good ones for it)
    assert [step for step, _ in list_checkpoints(run)] == [1]
    assert (run / "corrupt-checkpoint-00000002").is_dir()
    # whatever a failed load touched, the weights are checkpoint 1's
    saved = load_file(str(run / "checkpoint-00000001" / "model.safetensors"))
    state = trainer.policy.state_dict()
    for key, value in saved.items():
        assert torch.equal(state[key], value), key


def test_a_resumed_run_past_a_corrupt_checkpoint_finishes_with_a_good_one(trained_run, tmp_path):
    run = spoiled_copy(trained_run, tmp_path, "safetensors truncated")
    result = Trainer(small_config(run), model=make_st_model(), train_data=DATA).train(resume=True)
    assert result["step"] == 2
    assert [step for step, _ in list_checkpoints(run)] == [1, 2]
    assert read_trainer_state(run / "checkpoint-00000002")["step"] == 2
    checkpoint_module.check_checkpoint(run / "checkpoint-00000002")


def test_no_loadable_checkpoint_is_an_error_naming_each(trained_run, tmp_path):
    run = spoiled_copy(trained_run, tmp_path, "state.json truncated", steps=(1, 2))
    trainer = Trainer(small_config(run), model=make_st_model(), train_data=DATA)
    with pytest.raises(CheckpointError, match="no loadable checkpoint") as raised:
        trainer.resume()
    message = str(raised.value)
    for step in (1, 2):
        assert str(run / f"checkpoint-0000000{step}" / "trainer_state" / "state.json") in message


def test_an_explicit_checkpoint_is_loaded_or_refused_never_swapped(trained_run, tmp_path):
    run = spoiled_copy(trained_run, tmp_path, "optimizer.pt missing")
    trainer = Trainer(small_config(run), model=make_st_model(), train_data=DATA)
    with pytest.raises(CheckpointError, match="optimizer.pt"):
        trainer.resume(run / "checkpoint-00000002")
    assert [step for step, _ in list_checkpoints(run)] == [1, 2]  # nothing renamed for an explicit choice


def test_a_bad_state_file_error_names_the_path(tmp_path):
    state = tmp_path / "checkpoint-00000001" / "trainer_state" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text('{"step": 1, "conf')
    with pytest.raises(CheckpointError, match=str(state)):
        read_trainer_state(state.parents[1])


def test_the_cli_resume_without_a_loadable_checkpoint_is_one_error_line(trained_run, tmp_path, capsys):
    run = spoiled_copy(trained_run, tmp_path, "optimizer.pt missing", steps=(1, 2))
    model_dir = tmp_path / "model"
    make_st_model().save(str(model_dir))
    data = tmp_path / "train.jsonl"
    rows = [{"query": r.query, "positive": r.positive, "negatives": list(r.negatives)} for r in DATA]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = tmp_path / "config.yaml"
    config.write_text(
        f"model_name_or_path: {model_dir}\ntrain_data: [{{type: triplets, path: {data}}}]\n"
        f"output_dir: {run}\nbatch_size: 2\nnum_rollouts: 2\nmax_steps: 2\nmax_input_tokens: 160\n"
        "max_rationale_tokens: 3\nreport_to: [jsonl]\n"
    )
    assert main(["--config", str(config), "--resume"]) == 1
    err = capsys.readouterr().err
    assert "grace-train: error: --resume: no loadable checkpoint" in err and "optimizer.pt" in err
    assert "Traceback" not in err


# -- 9. typed config validation ---------------------------------------------------------------------


def test_every_config_key_has_its_help_rules_and_resume_kind_once_and_the_docs_table_is_the_code():
    """A key is one field: default, help, range rules, resume kind; the docs' table is generated."""
    for item in dataclasses.fields(TrainConfig):
        assert item.metadata["doc"], item.name
        assert item.metadata["resume"] in ("free", "applied", "fixed"), item.name
        assert RULES[item.name] == item.metadata["rules"]
    docs = (Path(__file__).parents[1] / "docs" / "training.md").read_text(encoding="utf-8")
    start, end = "<!-- config table: python -m grace_training.config.train_config -->\n", "\n<!-- end of config table -->"
    assert docs[docs.index(start) + len(start) : docs.index(end)] == config_table(), (
        "docs/training.md's config table is stale: paste `python -m grace_training.config.train_config` between its markers"
    )


def test_a_model_cards_training_summary_names_lora_settings_only_for_a_lora_run():
    assert {"lora_r", "lora_alpha"} <= TrainConfig(finetune="lora").summary().keys()
    full = TrainConfig(finetune="full").summary()
    assert full["finetune"] == "full" and not any(name.startswith("lora_") for name in full)


def test_the_old_budget_names_are_read_with_a_warning(caplog):
    old = TrainConfig.from_dict({"max_prompt_tokens": 100, "max_response_tokens": {"default": 8, "document": 0}})
    assert old.max_input_tokens == 100 and old.max_rationale_tokens == {"default": 8, "document": 0}
    assert "max_response_tokens is now called max_rationale_tokens" in caplog.text
    with pytest.raises(ConfigError, match="max_prompt_tokens is the old name of max_input_tokens"):
        TrainConfig.from_dict({"max_prompt_tokens": 100, "max_input_tokens": 100})
    # a checkpoint saved under the old names resumes as unchanged
    saved = {{"max_input_tokens": "max_prompt_tokens"}.get(k, k): v for k, v in old.to_dict().items()}
    assert "max_prompt_tokens" in saved and config_changes(saved, old) == []


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"learning_rate": "abc"}, "learning_rate"),
        ({"learning_rate": -1}, "learning_rate"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"seed": 1.5}, "seed"),
        ({"output_dir": None}, "output_dir"),
        ({"save_steps": -1}, "save_steps"),
        ({"logging_steps": 0}, "logging_steps"),
        ({"tau": float("nan")}, "tau"),
        ({"length_penalty_mode": False}, "length_penalty_mode"),
        ({"report_to": "jsonl"}, "report_to"),
        ({"train_data": [{"type": "triplets"}]}, "train_data[0]"),
        ({"train_data": [{"type": "csv", "path": "x"}]}, "train_data[0].type"),
    ],
)
def test_construction_refuses_a_bad_value_naming_key_and_value(values, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[")) as raised:
        TrainConfig(**values)
    assert raised.value.key == key.split("[")[0]
    value = next(iter(values.values()))
    if not isinstance(value, (list, dict)):
        assert json.dumps(value) in str(raised.value) or repr(value) in str(raised.value)


def test_an_int_for_a_float_key_is_stored_as_a_float():
    config = TrainConfig(learning_rate=1, tau=10)
    assert isinstance(config.learning_rate, float) and isinstance(config.tau, float)


def test_yaml_errors_name_the_file_or_the_override(tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text("batch_size: two\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(file))}: batch_size: expected an integer, got \"two\""):
        TrainConfig.from_yaml(file)
    file.write_text("batch_size: 2\n")
    with pytest.raises(ConfigError, match=r"^override learning_rate=abc: learning_rate: expected a number"):
        TrainConfig.from_yaml(file, ["learning_rate=abc"])


def test_bf16_without_a_gpu_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = small_config(tmp_path, bf16=True, model_name_or_path=str(tmp_path / "no-such-model"))
    with pytest.raises(ConfigError, match="bf16"):
        Trainer(config, train_data=DATA)


def test_too_little_data_is_refused_before_the_model_loads(tmp_path):
    config = small_config(tmp_path, batch_size=16, model_name_or_path=str(tmp_path / "no-such-model"))
    with pytest.raises(ConfigError, match="fewer than one batch"):
        Trainer(config, train_data=DATA)


# -- fuzz: grace-train --dry-run on bad configs ------------------------------------------------------


@pytest.fixture(scope="module")
def cli_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    make_st_model().save(str(root / "model"))
    rows = [{"query": CORPUS[i], "positive": CORPUS[i + 1], "negatives": [CORPUS[i + 2]]} for i in range(6)]
    (root / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "a-file").write_text("not a directory")
    (root / "config.yaml").write_text(
        f"model_name_or_path: {root / 'model'}\ndata_dir: {root}\n"
        "train_data:\n  - {type: triplets, path: train.jsonl}\n"
        "num_rollouts: 2\nbatch_size: 2\nmax_input_tokens: 160\nmax_rationale_tokens: 4\n"
        f"output_dir: {root / 'run'}\nreport_to: [jsonl]\n"
    )
    return root


@pytest.fixture
def no_model_loads(monkeypatch):
    """Refused configs must be refused before any tokenizer or model is loaded."""
    import transformers

    import grace_training.trainer as trainer_module

    def loaded(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded for a config that should be refused")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", loaded)
    monkeypatch.setattr(trainer_module, "load_grace_model", loaded)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _hints() -> dict[str, typing.Any]:
    return typing.get_type_hints(TrainConfig)


def _arms(hint) -> set:
    return set(typing.get_args(hint)) if typing.get_origin(hint) in (typing.Union, types.UnionType) else {hint}


def bad_values(key: str, hint) -> list[str]:
    """YAML texts of values the key's type or range refuses."""
    arms = _arms(hint)
    values = ["[1, 2]", "{a: 1}"]
    if type(None) not in arms:
        values.append("null")
    if int in arms or float in arms:
        values += ["abc", "true", "-2" if key == "max_steps" else "-1"]
    if int in arms and float not in arms:
        values.append("2.5")
    if float in arms:
        values += [".nan", ".inf", "-.inf"]
    if bool in arms:
        values += ["1", "abc"]
    if str in arms:
        values += ["''", "123"]
    if str not in arms and not {int, float, bool} & arms:  # list-only keys
        values += ["5", "abc"]
    return values


TYPE_CASES = [([f"{key}={value}"], key) for key, hint in _hints().items() for value in bad_values(key, hint)]
COMBINATION_CASES = [
    (["lerning_rate=1e-5"], "lerning_rate"),
    (["foo=bar"], "foo"),
    (["push_to_hub=true"], "hub_model_id"),
    (["epochs=0"], "epochs"),
    (["temperature_positive=0"], "temperature_positive"),
    (["finetune=lora", "rollout_backend=vllm"], "finetune"),
    (["train_data=[{type: triplets}]"], "train_data"),
    (["train_data=[]"], "train_data"),
    (["batch_size=7"], "batch_size"),
    (["bf16=true"], "bf16"),
    (["output_dir={root}/a-file"], "output_dir"),
    (["novalue"], "novalue"),
    (["learning_rate=[1"], "learning_rate"),
]


@pytest.mark.parametrize(
    ("overrides", "named"), TYPE_CASES + COMBINATION_CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else v
)
def test_dry_run_refuses_bad_overrides_in_one_line(cli_setup, no_model_loads, capsys, overrides, named):
    argv = [
        "--config",
        str(cli_setup / "config.yaml"),
        *(o.replace("{root}", str(cli_setup)) for o in overrides),
        "--dry-run",
    ]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert err.startswith("grace-train: error: ") and err.count("\n") == 1, err
    assert named in err and "Traceback" not in out + err


BAD_FILES = {
    "invalid syntax": (b"learning_rate: [1e-5\n", None),
    "bad indentation": (b"batch_size: 2\n  num_rollouts: 2\n", None),
    "a list, not a mapping": (b"- batch_size\n- 2\n", None),
    "a scalar, not a mapping": (b"42\n", None),
    "not UTF-8": (b"batch_size: \xff\xfe2\n", None),
    "a key twice": (b"learning_rate: 1.0e-5\nlearning_rate: 1.0e-6\n", "learning_rate"),
    "a word for a number": (b"batch_size: two\n", "batch_size"),
    "train_data not a list": (b"train_data: {type: triplets, path: x}\n", "train_data"),
    "a bare off for a string": (b"length_penalty_mode: off\n", "length_penalty_mode"),
    "a number key": (b"1: 2\n", "1"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_dry_run_refuses_bad_yaml_files_naming_the_file(tmp_path, no_model_loads, capsys, case):
    content, key = BAD_FILES[case]
    file = tmp_path / "bad.yaml"
    file.write_bytes(content)
    assert main(["--config", str(file), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("grace-train: error: ") and err.count("\n") == 1, err
    assert str(file) in err and (key is None or key in err) and "Traceback" not in out + err


@pytest.mark.parametrize("path", ["missing.yaml", "."])
def test_dry_run_refuses_a_missing_or_directory_config(tmp_path, no_model_loads, capsys, path):
    assert main(["--config", str(tmp_path / path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("grace-train: error: ") and str(tmp_path) in err and "Traceback" not in err


def test_the_real_run_refuses_what_the_dry_run_refuses_before_loading_a_model(cli_setup, no_model_loads, capsys):
    assert main(["--config", str(cli_setup / "config.yaml"), "batch_size=7", f"output_dir={cli_setup}/r"]) == 2
    err = capsys.readouterr().err
    assert "batch_size" in err and "fewer than one batch" in err and "Traceback" not in err


def test_the_base_config_of_the_fuzz_passes_the_dry_run(cli_setup, capsys):
    assert main(["--config", str(cli_setup / "config.yaml"), "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["instances"] == 6


class _RunsCode:
    """A pickle that would run code when loaded without ``weights_only``."""

    def __reduce__(self):
        return (os.makedirs, (os.environ["GRACE_TEST_PWNED"],))


def test_a_checkpoint_that_would_run_code_is_refused_not_run(trained_run, tmp_path, monkeypatch):
    """Trainer-state files are read with weights_only=True: a handed-over checkpoint cannot execute code."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    marker = tmp_path / "pwned"
    monkeypatch.setenv("GRACE_TEST_PWNED", str(marker))
    torch.save({"state": _RunsCode()}, run / "checkpoint-00000002" / "trainer_state" / "optimizer.pt")
    trainer = Trainer(small_config(run), model=make_st_model(), train_data=DATA)
    assert trainer.resume() == 1  # the spoiled checkpoint is set aside, the older one taken
    assert not marker.exists()
    assert (run / "corrupt-checkpoint-00000002").is_dir()
