"""A run owns its output directory, and --resume does not silently change what it trains:
the run marker, refusal of directories the run does not own,
rotation and cleanup limited to the run's own checkpoints, system and package paths refused,
older runs adopted on --resume, and the resumed config compared with the checkpoint's."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import site
from pathlib import Path

import pytest
import torch
from conftest import CORPUS, make_st_model
from test_training_reliability import DATA, small_config

import grace_training
from grace_training.algorithms.grpo.step import GRPOStep
from grace_training.cli import main
from grace_training.config.train_config import ALGORITHMS, RESUME_CHANGES, ConfigError, TrainConfig, check_environment
from grace_training.run.checkpoint import (
    CheckpointError,
    RunFamily,
    checkpoint_name,
    list_checkpoints,
    read_run_id,
    write_checkpoint,
)
from grace_training.run.run_dir import (
    INFONCE,
    MARKER,
    ConfigChangeError,
    OutputDirError,
    claim_output_dir,
    read_marker,
    run_files,
)
from grace_training.trainer import Trainer


def train(output_dir: Path, resume=False, **overrides) -> Trainer:
    """A tiny run (checkpoints every step, none rotated unless asked); the trainer after it."""
    flags = {key: overrides.pop(key) for key in ("overwrite_output_dir", "allow_config_change") if key in overrides}
    trainer = Trainer(small_config(output_dir, **overrides), model=make_st_model(), train_data=DATA, **flags)
    trainer.train(resume=resume)
    return trainer


def listing(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a directory): a snapshot to compare."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def steps(root: Path) -> list[int]:
    return [step for step, _ in list_checkpoints(root)]


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory) -> Path:
    """A finished two-step run (checkpoints at 1 and 2), copied by each test that uses it."""
    run = tmp_path_factory.mktemp("run_dir") / "run"
    train(run)
    return run


def copy_of(run: Path, tmp_path: Path, name: str = "run") -> Path:
    target = tmp_path / name
    shutil.copytree(run, target)
    return target


def as_older_run(run: Path) -> Path:
    """The same run as the code before run markers left it: no marker, no run.json."""
    (run / MARKER).unlink()
    for file in run.glob("*/trainer_state/run.json"):
        file.unlink()
    return run


# -- 3. the run's marker ---------------------------------------------------------------------------


def test_a_run_writes_its_marker_and_marks_its_checkpoints(earlier_run):
    marker = json.loads((earlier_run / MARKER).read_text())
    assert marker["trainer"] == "grace-train" and marker["algorithm"] == "grpo" and len(marker["run_id"]) == 12
    for _, path in list_checkpoints(earlier_run):
        assert read_run_id(path) == marker["run_id"]
    assert (earlier_run / "config.yaml").is_file()  # the trainer writes the run's config, not only the CLI


def test_a_non_empty_directory_that_is_not_a_run_is_refused(tmp_path):
    out = tmp_path / "mine"
    (out / "notes").mkdir(parents=True)
    (out / "notes.txt").write_text("my notes")
    before = listing(out)
    with pytest.raises(OutputDirError, match="not empty and is not a grace-train run") as raised:
        train(out)
    assert str(out) in str(raised.value) and "notes.txt" in str(raised.value)
    assert "--overwrite-output-dir" in str(raised.value)
    assert listing(out) == before  # nothing written


@pytest.mark.parametrize("older", [False, True], ids=["marker", "before markers"])
def test_a_fresh_start_in_an_earlier_run_is_refused_and_overwrites_nothing(earlier_run, tmp_path, older):
    run = copy_of(earlier_run, tmp_path)
    if older:
        as_older_run(run)
    before = listing(run)
    with pytest.raises(OutputDirError, match="holds an earlier grace-train run") as raised:
        train(run, learning_rate=0.5)
    assert "--resume continues it" in str(raised.value) and "steps 1, 2" in str(raised.value)
    assert listing(run) == before  # config.yaml, checkpoints and metrics as they were


def test_overwrite_output_dir_deletes_the_earlier_run_and_nothing_else(earlier_run, tmp_path):
    run = copy_of(earlier_run, tmp_path)
    (run / "notes.txt").write_text("mine")
    (run / "corrupt-checkpoint-00000007").mkdir()
    old_id = read_marker(run)["run_id"]
    train(run, overwrite_output_dir=True, max_steps=1)
    assert steps(run) == [1]  # the earlier run's checkpoint 2 is gone, not mixed in
    marker = read_marker(run)
    assert marker["run_id"] != old_id and read_run_id(run / "checkpoint-00000001") == marker["run_id"]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    assert (run / "notes.txt").read_text() == "mine" and (run / "corrupt-checkpoint-00000007").is_dir()


def foreign_checkpoint(root: Path, step: int, source: Path) -> Path:
    """A complete checkpoint another run wrote (its own run id), at ``step``."""
    target = root / f"checkpoint-{step:08d}"
    shutil.copytree(source, target)
    (target / "trainer_state" / "run.json").write_text(json.dumps({"run_id": "another-run"}))
    state = json.loads((target / "trainer_state" / "state.json").read_text())
    (target / "trainer_state" / "state.json").write_text(json.dumps({**state, "step": step}))
    return target


def test_overwrite_into_a_foreign_directory_rotates_and_cleans_only_its_own(earlier_run, tmp_path):
    """The issue's case: a higher-numbered checkpoint and temporary look-alikes in the directory."""
    out = tmp_path / "shared"
    out.mkdir()
    foreign = foreign_checkpoint(out, 99, earlier_run / "checkpoint-00000002")
    (out / ".tmp-checkpoint-notes").mkdir()
    (out / ".tmp-checkpoint-notes" / "keep.txt").write_text("mine")
    before = listing(foreign)
    train(out, overwrite_output_dir=True, save_total_limit=1)
    assert steps(out) == [2, 99]  # keep-last-1 kept this run's newest, and never counted the other run's
    assert listing(foreign) == before
    assert (out / ".tmp-checkpoint-notes" / "keep.txt").read_text() == "mine"


def test_overwrite_refuses_another_runs_checkpoint_at_a_step_it_would_save(earlier_run, tmp_path):
    out = tmp_path / "shared"
    out.mkdir()
    foreign_checkpoint(out, 2, earlier_run / "checkpoint-00000002")
    with pytest.raises(OutputDirError, match="checkpoint-00000002 would be replaced"):
        train(out, overwrite_output_dir=True)


def test_resume_and_rotation_ignore_checkpoints_and_temporaries_of_another_run(earlier_run, tmp_path):
    run = copy_of(earlier_run, tmp_path)
    shutil.rmtree(run / "checkpoint-00000002")
    foreign = foreign_checkpoint(run, 99, run / "checkpoint-00000001")
    stranger = foreign_checkpoint(run, 5, run / "checkpoint-00000001")
    stranger.rename(run / ".tmp-checkpoint-00000005")
    aside = foreign_checkpoint(run, 4, run / "checkpoint-00000001")
    aside.rename(run / ".replaced-checkpoint-00000004")
    before = {path.name: listing(path) for path in (foreign, run / ".tmp-checkpoint-00000005", aside)}
    trainer = train(run, resume=True, max_steps=3, save_total_limit=1)
    assert trainer.step == 3  # resumed from its own step 1, not from the other run's 99
    assert steps(run) == [3, 99]
    for name, content in before.items():
        assert listing(run / name) == content, name
    assert not (run / "checkpoint-00000004").exists()  # another run's replaced copy is not "restored"


def test_a_save_never_replaces_a_checkpoint_of_another_run(tmp_path):
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)

    def save(run_id: str, marker: str) -> Path:
        return write_checkpoint(
            tmp_path, 3, write_model=lambda path: (path / "marker.txt").write_text(marker),
            trainer_state={"step": 3}, optimizer=optimizer, scheduler=scheduler, family=RunFamily(run_id),
        )

    save("first", "old")
    with pytest.raises(CheckpointError, match="not written by this run"):
        save("second", "new")
    assert (tmp_path / "checkpoint-00000003" / "marker.txt").read_text() == "old"
    save("first", "again")  # its own step: replaced as before
    assert (tmp_path / "checkpoint-00000003" / "marker.txt").read_text() == "again"


def test_a_run_from_before_markers_is_adopted_on_resume(earlier_run, tmp_path):
    """The runs being trained while this changed (config.yaml, metrics.jsonl, checkpoints, no marker)
    go on with --resume: the marker is written, naming their checkpoints, which rotate as the run's."""
    run = as_older_run(copy_of(earlier_run, tmp_path))
    leftover = run / ".tmp-checkpoint-00000003"  # what the older code's crash mid-save left
    (leftover / "trainer_state").mkdir(parents=True)
    trainer = train(run, resume=True, max_steps=4, save_total_limit=2)
    assert trainer.step == 4
    marker = read_marker(run)
    assert marker["adopted_checkpoints"] == ["checkpoint-00000001", "checkpoint-00000002"]
    assert steps(run) == [3, 4] and not leftover.exists()
    # the next chunk continues the adopted run
    assert train(run, resume=True, max_steps=5, save_total_limit=2).step == 5
    assert read_marker(run)["run_id"] == marker["run_id"]


@pytest.mark.parametrize(
    "where",
    ["/", "/etc", "/usr/lib/grace", "/proc", "home", "grace_st", "training", "training/runs", "site-packages",
     "repository", "link to /etc"],
)
def test_system_and_package_directories_are_refused(tmp_path, monkeypatch, where):
    import grace_st

    places = {
        "home": Path.home(),
        "grace_st": Path(grace_st.__file__).parent,
        "training": Path(grace_training.__file__).parent,
        "training/runs": Path(grace_training.__file__).parent / "runs",
        "site-packages": Path(site.getsitepackages()[0]) / "some-run",
        "repository": Path(grace_training.__file__).parent.parent,
    }
    if where == "link to /etc":
        (tmp_path / "link").symlink_to("/etc")
        places[where] = tmp_path / "link" / "run"
    config = TrainConfig(output_dir=str(places.get(where, where)))
    with pytest.raises(ConfigError, match="output_dir") as raised:
        check_environment(config)
    assert raised.value.key == "output_dir"


def test_an_ordinary_directory_is_not_refused(tmp_path):
    check_environment(TrainConfig(output_dir=str(tmp_path / "runs" / "x")))
    check_environment(TrainConfig(output_dir="runs/x"))


# -- 4. --resume with a changed config ------------------------------------------------------------


def test_every_config_key_is_classified_for_resume():
    assert set(RESUME_CHANGES) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(RESUME_CHANGES.values()) == {"free", "applied", "fixed"}


def test_a_changed_learning_rate_is_refused_naming_old_and_new(earlier_run, tmp_path):
    run = copy_of(earlier_run, tmp_path)
    before = listing(run)
    with pytest.raises(ConfigChangeError) as raised:
        train(run, resume=True, max_steps=3, learning_rate=0.01, ppo_epochs=2)
    message = str(raised.value)
    assert "learning_rate: 0.001 → 0.01" in message and "ppo_epochs: 1 → 2" in message
    assert "--allow-config-change" in message and "max_steps" not in message  # the run's length is free
    assert listing(run) == before  # nothing renamed, recorded or rewritten


def test_an_allowed_change_is_applied_to_the_optimizer_and_recorded(earlier_run, tmp_path):
    run = copy_of(earlier_run, tmp_path)
    trainer = Trainer(
        small_config(run, max_steps=3, learning_rate=0.01, adam_beta2=0.99, weight_decay=0.1),
        model=make_st_model(), train_data=DATA, allow_config_change=True,
    )
    trainer.resume()
    for group in trainer.optimizer.param_groups:
        assert group["lr"] == 0.01 and group["betas"] == (0.9, 0.99) and group["weight_decay"] == 0.1
    assert trainer.scheduler.get_last_lr() == [0.01] and trainer.scheduler.base_lrs == [0.01]
    trainer.train(resume=True)
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row["lr"]) for row in logged] == [(1, 0.001), (2, 0.001), (3, 0.01)]
    records = [json.loads(line) for line in (run / "config_changes.jsonl").read_text().splitlines()]
    applied = {r["key"]: (r["old"], r["new"]) for r in records if r["kind"] == "applied"}
    assert applied == {"learning_rate": (0.001, 0.01), "adam_beta2": (0.999, 0.99), "weight_decay": (0.0, 0.1)}
    assert all(r["step"] == 2 and r["checkpoint"] == "checkpoint-00000002" for r in records)
    assert TrainConfig.from_yaml(run / "config.yaml").learning_rate == 0.01


def test_free_changes_need_no_flag_and_are_recorded(earlier_run, tmp_path):
    run = copy_of(earlier_run, tmp_path)
    train(run, resume=True, max_steps=3, save_steps=3, logging_steps=1, eval_max_examples=5)
    records = [json.loads(line) for line in (run / "config_changes.jsonl").read_text().splitlines()]
    changed = ("max_steps", "save_steps", "eval_max_examples", "output_dir")  # the copy is another directory
    assert {r["key"]: r["kind"] for r in records} == dict.fromkeys(changed, "free")


@pytest.mark.parametrize("change", [{"finetune": "lora"}, {"model_name_or_path": "another/model"}])
def test_what_the_checkpoint_was_built_from_never_changes(earlier_run, tmp_path, change):
    run = copy_of(earlier_run, tmp_path)
    with pytest.raises(ConfigChangeError, match=f"{next(iter(change))}: .*even with --allow-config-change"):
        train(run, resume=True, allow_config_change=True, **change)
    assert steps(run) == [1, 2] and not (run / "config_changes.jsonl").exists()


def test_a_warm_start_stage_goes_on_with_the_yaml_values_when_asked(tmp_path, monkeypatch):
    """Stage 1 greedy with one rollout, stage 2 the config's K and temperatures (the scale recipe's warm start)."""
    run = tmp_path / "run"
    warm = {"num_rollouts": 1, "temperature_positive": 0.0, "temperature_query": 0.0, "temperature_negative": 0.0}
    train(run, max_steps=1, **warm)
    with pytest.raises(ConfigChangeError, match="num_rollouts: 1 → 2.*temperature_positive: 0.0 → 1.0"):
        train(run, resume=True, max_steps=2)
    rows = []
    rollout = GRPOStep.rollout

    def counted(self, batch, step, **kwargs):
        rollouts = rollout(self, batch, step, **kwargs)
        rows.append(len(rollouts.positives))
        return rollouts

    monkeypatch.setattr(GRPOStep, "rollout", counted)
    train(run, resume=True, max_steps=2, allow_config_change=True)
    assert rows == [2 * 2]  # B = 2 triplets, K = 2 rollouts each: the new K applied
    saved = TrainConfig.from_yaml(run / "config.yaml")
    assert saved.num_rollouts == 2 and saved.temperature_positive == 1.0
    records = [json.loads(line) for line in (run / "config_changes.jsonl").read_text().splitlines()]
    assert {r["key"] for r in records if r["kind"] == "applied"} == set(warm)


# -- the CLI -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("run_dir_cli")
    make_st_model().save(str(root / "model"))
    rows = [{"query": CORPUS[i], "positive": CORPUS[i + 1], "negatives": [CORPUS[i + 2]]} for i in range(6)]
    (root / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "config.yaml").write_text(
        f"model_name_or_path: {root / 'model'}\ndata_dir: {root}\n"
        "train_data:\n  - {type: triplets, path: train.jsonl}\n"
        "num_rollouts: 2\nbatch_size: 2\nmax_input_tokens: 160\nmax_rationale_tokens: 3\n"
        "learning_rate: 1.0e-4\nsave_steps: 1\nreport_to: [jsonl]\n"
    )
    return root


def cli(setup: Path, out: Path, *args: str) -> int:
    return main(["--config", str(setup / "config.yaml"), f"output_dir={out}", *args])


def one_error_line(capsys) -> str:
    """The refusal: one line at the end of stderr (after the model's loading bars, if it loaded)."""
    err = capsys.readouterr().err
    assert err.endswith("\n") and "Traceback" not in err, err
    last = err.splitlines()[-1]
    assert last.startswith("grace-train: error: ") and err.count("grace-train: error: ") == 1, err
    return last


def test_cli_refuses_a_fresh_start_over_a_run_without_touching_its_config(cli_setup, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli(cli_setup, out, "max_steps=1") == 0
    config_yaml = (out / "config.yaml").read_bytes()
    capsys.readouterr()
    assert cli(cli_setup, out, "max_steps=1", "learning_rate=0.5") == 2
    err = capsys.readouterr().err
    assert err.startswith("grace-train: error: ") and "holds an earlier grace-train run" in err  # before a model loads
    assert (out / "config.yaml").read_bytes() == config_yaml  # the CLI once rewrote it before training
    assert cli(cli_setup, out, "max_steps=1", "learning_rate=0.5", "--overwrite-output-dir") == 0
    assert TrainConfig.from_yaml(out / "config.yaml").learning_rate == 0.5


def test_cli_resume_with_a_changed_config_needs_the_flag(cli_setup, tmp_path, capsys):
    out = tmp_path / "run"
    warm = ["num_rollouts=1", "temperature_positive=0.0", "temperature_query=0.0", "temperature_negative=0.0"]
    assert cli(cli_setup, out, "max_steps=1", *warm) == 0
    capsys.readouterr()
    assert cli(cli_setup, out, "max_steps=2", "--resume") == 2
    err = one_error_line(capsys)
    assert "num_rollouts: 1 → 2" in err and "--allow-config-change" in err
    assert cli(cli_setup, out, "max_steps=2", "--resume", "--allow-config-change") == 0
    assert TrainConfig.from_yaml(out / "config.yaml").num_rollouts == 2
    assert (out / "config_changes.jsonl").is_file()


def test_cli_dry_run_and_infonce_refuse_a_foreign_directory(cli_setup, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert cli(cli_setup, out, "--dry-run") == 2
    assert "notes.txt" in one_error_line(capsys)
    assert cli(cli_setup, out, "--algorithm", "infonce") == 2
    assert "not a grace-train run" in one_error_line(capsys)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_cli_infonce_goes_on_in_chunks_and_refuses_a_resume_with_nothing_to_resume(cli_setup, tmp_path, capsys):
    """The yardstick run as GRPO is: --max-minutes ends a chunk at a checkpoint, --resume goes on from it;
    --resume where no checkpoint is says so in one line (exit 1, as GRPO's), and starts nothing."""
    out = tmp_path / "infonce"
    assert cli(cli_setup, out, "max_steps=2", "--algorithm", "infonce", "--resume") == 1
    assert "no complete InfoNCE checkpoint" in one_error_line(capsys) and not out.exists()
    assert cli(cli_setup, out, "max_steps=2", "save_steps=0", "--algorithm", "infonce", "--max-minutes", "0") == 0
    assert [p.name for p in (out / "trainer").iterdir()] == ["checkpoint-1"]
    assert cli(cli_setup, out, "max_steps=2", "save_steps=0", "--algorithm", "infonce", "--resume") == 0
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2] and (out / "final" / "modules.json").is_file()


@pytest.mark.parametrize("where", ["/", "/etc"])
def test_cli_refuses_a_system_directory_in_one_line(cli_setup, capsys, where):
    assert main(["--config", str(cli_setup / "config.yaml"), f"output_dir={where}", "--dry-run"]) == 2
    assert "output_dir" in one_error_line(capsys)


def as_method_vocabulary(run: Path, old: str) -> None:
    """The run as versions that named the training algorithm ``method`` (``gircse`` for ICR) left it: in the
    marker, in config.yaml and in each checkpoint's saved config."""
    marker = json.loads((run / MARKER).read_text())
    marker["method"] = old
    del marker["algorithm"]
    (run / MARKER).write_text(json.dumps(marker))
    config = (run / "config.yaml").read_text()
    assert "\nalgorithm: " in config
    (run / "config.yaml").write_text(re.sub(r"\nalgorithm: \w+", f"\nmethod: {old}", config))
    for path in run.glob("checkpoint-*/trainer_state/state.json"):
        state = json.loads(path.read_text())
        state["config"]["method"] = old
        del state["config"]["algorithm"]
        path.write_text(json.dumps(state))


@pytest.mark.parametrize(("algorithm", "old"), [("grpo", "grpo"), ("icr", "gircse")])
def test_a_run_written_with_the_method_key_resumes_on_its_trajectory(tmp_path, algorithm, old):
    straight = train(tmp_path / "straight", algorithm=algorithm)
    train(tmp_path / "run", algorithm=algorithm, max_steps=1)
    as_method_vocabulary(tmp_path / "run", old)
    resumed = train(tmp_path / "run", resume=True, algorithm=algorithm)
    assert resumed.step == 2
    done, again = straight.policy.state_dict(), resumed.policy.state_dict()
    assert all(torch.equal(again[name], value) for name, value in done.items())
    with pytest.raises(OutputDirError, match="holds a grace-train"):  # still another algorithm's directory
        train(tmp_path / "run", resume=True, algorithm="icr" if algorithm == "grpo" else "grpo")


def test_the_old_method_key_and_flag_still_name_the_algorithm(tmp_path, caplog, cli_setup):
    with caplog.at_level("WARNING"):
        assert TrainConfig.from_dict({"method": "gircse"}).algorithm == "icr"
        assert TrainConfig.from_dict({"method": "grpo"}).algorithm == "grpo"
    assert "config key method is now called algorithm" in caplog.text
    assert TrainConfig(algorithm="icr").method == "gircse" and TrainConfig().method == "grace"  # how the model thinks
    with pytest.raises(ConfigError, match="the old name of algorithm"):
        TrainConfig.from_dict({"method": "gircse", "algorithm": "icr"})
    out = tmp_path / "run"
    assert cli(cli_setup, out, "--method", "infonce", "--dry-run") == 0
    assert "--method is now called --algorithm" in caplog.text


# -- every algorithm in an existing directory ------------------------------------------------------


def test_every_algorithm_trains_in_the_loop_or_is_the_infonce_yardstick_and_has_its_run_files():
    """Each record names its step class (the infonce yardstick alone trains outside the loop) and its run files."""
    assert set(ALGORITHMS) >= {"grpo", "icr", "grc", INFONCE}
    for algorithm, record in ALGORITHMS.items():
        assert (record.step_class() is None) == (algorithm == INFONCE)
        assert "metrics.jsonl" in run_files(algorithm)
    with pytest.raises(OutputDirError, match="'someday' is not one grace-train trains"):
        run_files("someday")


def train_cli(setup: Path, out: Path, algorithm: str, *flags: str) -> int:
    return cli(setup, out, "max_steps=1", "num_latent_tokens=2", "--algorithm", algorithm, *flags)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_folder_that_is_not_a_run_is_refused_unless_overwrite_for_every_algorithm(
    cli_setup, tmp_path, capsys, algorithm
):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = listing(out)
    for flags in (["--dry-run"], []):
        assert train_cli(cli_setup, out, algorithm, *flags) == 2
        error = one_error_line(capsys)
        assert "not a grace-train run" in error and "notes.txt" in error and "metrics.jsonl" in error
        assert listing(out) == before
    assert train_cli(cli_setup, out, algorithm, "--dry-run", "--overwrite-output-dir") == 0
    assert listing(out) == before
    assert train_cli(cli_setup, out, algorithm, "--overwrite-output-dir") == 0
    assert (out / "notes.txt").read_text() == "mine" and read_marker(out)["algorithm"] == algorithm


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_an_earlier_run_of_every_algorithm_is_refused_or_replaced_whole(cli_setup, tmp_path, capsys, algorithm):
    out = tmp_path / "run"
    assert train_cli(cli_setup, out, algorithm) == 0
    (out / "notes.txt").write_text("mine")
    earlier, before = read_marker(out)["run_id"], listing(out)
    capsys.readouterr()
    for flags in (["--dry-run"], []):
        assert train_cli(cli_setup, out, algorithm, *flags) == 2
        assert "holds an earlier grace-train run" in one_error_line(capsys)
        assert listing(out) == before
    assert train_cli(cli_setup, out, algorithm, "--dry-run", "--overwrite-output-dir") == 0
    assert listing(out) == before
    assert train_cli(cli_setup, out, algorithm, "--overwrite-output-dir") == 0
    assert read_marker(out)["run_id"] != earlier and (out / "notes.txt").read_text() == "mine"
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    if algorithm != INFONCE:
        assert read_run_id(out / checkpoint_name(1)) == read_marker(out)["run_id"]


def marked_run(root: Path, algorithm: str, steps: tuple[int, ...] = (1, 2)) -> Path:
    """A run of ``algorithm`` as it leaves its directory, without training it: its marker, files and checkpoints."""
    family = claim_output_dir(root, algorithm=algorithm)
    for name in run_files(algorithm):
        (root / name).write_text("the run's")
    for step in steps:
        state = root / checkpoint_name(step) / "trainer_state"
        state.mkdir(parents=True)
        (state / "state.json").write_text(json.dumps({"step": step}))
        (state / "run.json").write_text(json.dumps({"run_id": family.run_id}))
    return root


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("obstacle", ["an unknown algorithm's run", "another run's checkpoint"])
def test_overwrite_refuses_before_deleting_anything(tmp_path, algorithm, obstacle):
    """What the earlier run's deletion would be followed by a refusal for is refused first, the run untouched."""
    run = marked_run(tmp_path / "run", algorithm)
    if obstacle == "an unknown algorithm's run":
        marker = json.loads((run / MARKER).read_text())
        (run / MARKER).write_text(json.dumps({**marker, "algorithm": "someday"}))
        match = "'someday' is not one grace-train trains"
    else:
        state = run / checkpoint_name(3) / "trainer_state"
        state.mkdir(parents=True)
        (state / "state.json").write_text(json.dumps({"step": 3}))
        (state / "run.json").write_text(json.dumps({"run_id": "another-run"}))
        match = "checkpoint-00000003, not the earlier run's, would be replaced"
    before = listing(run)
    with pytest.raises(OutputDirError, match=match):
        claim_output_dir(run, algorithm=algorithm, overwrite=True, last_step=3)
    assert listing(run) == before
