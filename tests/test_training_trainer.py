"""The loop end to end on a tiny random Llama (CPU): steps, metrics, checkpoints, resume, crashes."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import CORPUS, make_st_model
from sentence_transformers import SentenceTransformer

import grace_training.trainer as trainer_module
from grace_training.config.train_config import TrainConfig
from grace_training.data.examples import Triplet
from grace_training.run.checkpoint import latest_checkpoint, list_checkpoints, rotate_checkpoints
from grace_training.trainer import Trainer

DATA = [Triplet(CORPUS[i], CORPUS[i + 1], (CORPUS[i + 2],), "toy") for i in range(8)]

STEP_METRICS = [
    "reward/contrastive",
    "reward/consistency",
    "reward/hard_negative",
    "reward/length_penalty",
    "reward/final",
    "advantage/mean",
    "advantage/std",
    "rollout/positive_length_mean",
    "rollout/truncation_rate",
    "loss",
    "grad_norm",
    "throughput/tokens_per_s",
    "time/rollout_s",
    "time/update_s",
    "time/rollout_share",
]


def config(tmp_path, **overrides) -> TrainConfig:
    settings = {
        "num_rollouts": 3,
        "batch_size": 2,
        "num_negatives": 1,
        "max_input_tokens": 160,
        "max_rationale_tokens": 5,
        "learning_rate": 1e-3,
        "max_steps": 2,
        "save_steps": 0,
        "output_dir": str(tmp_path / "run"),
        "report_to": ["jsonl"],
        "rollout_batch_size": 16,
    }
    settings.update(overrides)
    return TrainConfig(**settings)


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model[0].model.state_dict().items()}


def test_end_to_end_steps_write_metrics_and_a_loadable_checkpoint(tmp_path):
    model = make_st_model()
    before = weights(model)
    cfg = config(tmp_path, max_steps=3, save_steps=2, report_to=["jsonl", "tensorboard"])
    result = Trainer(cfg, model=model, train_data=DATA, eval_data=DATA[:4]).train()
    assert result["step"] == 3
    assert any(not torch.equal(before[k], v) for k, v in weights(model).items())

    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "loss" in line]
    assert [line["step"] for line in steps] == [1, 2, 3]
    for key in STEP_METRICS:
        assert all(isinstance(line[key], float) for line in steps), key
    assert all(line["batch/source"] == "toy" for line in steps)  # which source each step's times belong to
    assert any("eval/toy/accuracy" in line for line in lines)
    assert list((tmp_path / "run" / "tensorboard").iterdir())

    checkpoints = list_checkpoints(tmp_path / "run")
    assert [step for step, _ in checkpoints] == [2, 3]
    final = checkpoints[-1][1]
    loaded = SentenceTransformer(str(final), trust_remote_code=True, device="cpu")
    assert loaded.encode(["a text"]).shape == (1, 32)
    assert loaded[0].max_rationale_tokens == 5 and loaded[0].max_input_tokens == 160
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(str(final))
    for key, value in lm.state_dict().items():
        torch.testing.assert_close(value, model[0].model.state_dict()[key])
    card = (final / "README.md").read_text()
    assert "GRPO with contrastive rewards" in card and "num_rollouts" in card and "toy/accuracy" in card
    state = json.loads((final / "trainer_state" / "state.json").read_text())
    assert state["step"] == 3 and state["data_position"] == {"epoch": 0, "batch_in_epoch": 3, "num_instances": 8}


def test_the_dev_slice_is_the_same_whatever_the_runs_seed(tmp_path):
    """eval_max_examples samples with eval_seed, not seed: two runs' curves score the same texts."""

    def slice_of(**overrides):
        trainer = Trainer(
            config(tmp_path, eval_max_examples=3, **overrides), model=make_st_model(), train_data=DATA, eval_data=DATA
        )
        return [row.query for row in trainer.eval_data]

    assert len(slice_of(seed=1)) == 3
    assert slice_of(seed=1) == slice_of(seed=2)
    assert any(slice_of(seed=1, eval_seed=seed) != slice_of(seed=1) for seed in (1, 2, 3))


def test_resume_continues_the_same_trajectory(tmp_path, monkeypatch):
    """4 steps straight == 2 steps, a crash in step 3, and 2 resumed steps (same weights)."""
    straight = make_st_model()
    Trainer(config(tmp_path / "a", max_steps=4), model=straight, train_data=DATA).train()

    interrupted = make_st_model()
    cfg = config(tmp_path / "b", max_steps=4, save_steps=2)
    trainer = Trainer(cfg, model=interrupted, train_data=DATA)
    original_step = Trainer.training_step

    def crash_in_step_three(self, batch, step):
        if step == 2:
            raise KeyboardInterrupt("killed")
        return original_step(self, batch, step)

    monkeypatch.setattr(Trainer, "training_step", crash_in_step_three)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    monkeypatch.setattr(Trainer, "training_step", original_step)
    assert latest_checkpoint(cfg.output_dir).name == "checkpoint-00000002"

    resumed = make_st_model()  # a fresh process: weights come from the checkpoint
    result = Trainer(cfg, model=resumed, train_data=DATA).train(resume=True)
    assert result["step"] == 4
    expected = weights(straight)
    for key, value in weights(resumed).items():
        assert torch.equal(value, expected[key]), key
    logged = [json.loads(line)["step"] for line in (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4]


def test_a_run_in_timed_chunks_equals_a_straight_run(tmp_path):
    """``max_minutes`` (grace-train --max-minutes): each chunk stops at a step boundary with a
    checkpoint, and chunks resumed one after another end with a straight run's weights and log."""
    straight = make_st_model()
    Trainer(
        config(tmp_path / "a", max_steps=3, eval_steps=2), model=straight, train_data=DATA, eval_data=DATA[:2]
    ).train()
    cfg = config(tmp_path / "b", max_steps=3, save_steps=0, eval_steps=2)
    steps, model = [], make_st_model()
    for chunk in range(3):
        trainer = Trainer(cfg, model=model, train_data=DATA, eval_data=DATA[:2])
        steps.append(trainer.train(resume=chunk > 0, max_minutes=0.0)["step"])
        model = make_st_model()  # the next chunk is a fresh process: weights from the checkpoint
        assert latest_checkpoint(cfg.output_dir).name == f"checkpoint-{steps[-1]:08d}"
    assert steps == [1, 2, 3]
    expected = weights(straight)
    chunked = SentenceTransformer(str(latest_checkpoint(cfg.output_dir)), trust_remote_code=True, device="cpu")
    for key, value in weights(chunked).items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)

    def log(run):
        rows = [json.loads(line) for line in (run / "run" / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r.get("reward/final"), r.get("eval/toy/accuracy")) for r in rows]

    assert log(tmp_path / "b") == log(tmp_path / "a")


def test_stop_at_step_takes_a_point_of_the_longer_run_and_resume_goes_on_from_it(tmp_path):
    """``stop_at_step`` (grace-train --stop-at-step): the run stops there with a checkpoint holding the straight
    run's weights at that step (its schedule and data order are max_steps'); a call that asks for the same stop
    again trains nothing, and one without it goes on to max_steps as the straight run did."""
    straight = make_st_model()
    Trainer(config(tmp_path / "a", max_steps=3, save_steps=1), model=straight, train_data=DATA).train()
    cfg = config(tmp_path / "b", max_steps=3, save_steps=0)
    assert Trainer(cfg, model=make_st_model(), train_data=DATA).train(stop_at_step=2)["step"] == 2
    assert latest_checkpoint(cfg.output_dir).name == "checkpoint-00000002"
    at_two = SentenceTransformer(str(latest_checkpoint(cfg.output_dir)), trust_remote_code=True, device="cpu")
    expected = weights(
        SentenceTransformer(str(tmp_path / "a" / "run" / "checkpoint-00000002"), trust_remote_code=True, device="cpu")
    )
    for key, value in weights(at_two).items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)

    assert Trainer(cfg, model=make_st_model(), train_data=DATA).train(resume=True, stop_at_step=2)["step"] == 2
    resumed = make_st_model()
    assert Trainer(cfg, model=resumed, train_data=DATA).train(resume=True)["step"] == 3
    expected = weights(straight)
    for key, value in weights(resumed).items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)


def test_a_crash_while_saving_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    cfg = config(tmp_path, max_steps=2, save_steps=1)
    real_save = trainer_module.save_model_dir
    calls = []

    def save_then_die(st_model, directory, state_dict=None):
        calls.append(directory)
        if len(calls) == 2:
            (directory / "model.safetensors").write_bytes(b"half a file")
            raise OSError("disk full")
        real_save(st_model, directory, state_dict)

    monkeypatch.setattr(trainer_module, "save_model_dir", save_then_die)
    with pytest.raises(OSError, match="disk full"):
        Trainer(cfg, model=make_st_model(), train_data=DATA).train()
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir() if "checkpoint" in p.name) == [
        ".tmp-checkpoint-00000002",
        "checkpoint-00000001",
    ]
    assert latest_checkpoint(run).name == "checkpoint-00000001"

    monkeypatch.setattr(trainer_module, "save_model_dir", real_save)
    Trainer(cfg, model=make_st_model(), train_data=DATA).train(resume=True)
    assert sorted(p.name for p in run.iterdir() if "checkpoint" in p.name) == [
        "checkpoint-00000001",
        "checkpoint-00000002",
    ]
    SentenceTransformer(str(run / "checkpoint-00000002"), trust_remote_code=True, device="cpu")


def test_keep_last_k(tmp_path):
    cfg = config(tmp_path, max_steps=3, save_steps=1, save_total_limit=1)
    Trainer(cfg, model=make_st_model(), train_data=DATA).train()
    assert [s for s, _ in list_checkpoints(cfg.output_dir)] == [3]


def test_rotation_spares_checkpoints_waiting_for_a_push(tmp_path):
    for step in (1, 2, 3):
        state = tmp_path / f"checkpoint-{step:08d}" / "trainer_state"
        state.mkdir(parents=True)
        (state / "state.json").write_text("{}")
    rotate_checkpoints(tmp_path, 1, protected={str(tmp_path / "checkpoint-00000001")})
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 3]


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_gradient_accumulation_matches_one_pass(tmp_path):
    grads = {}
    for parts in (1, 3):
        trainer = Trainer(
            config(tmp_path / str(parts), gradient_accumulation_steps=parts), model=make_st_model(), train_data=DATA
        )
        rollouts = trainer.algorithm.rollout(trainer.batch_for_step(0), 0)
        advantages = torch.tensor([0.3, -0.1, -0.2, 0.5, 0.0, -0.5])

        def capture(*args, parts=parts, trainer=trainer, **kwargs):
            grads[parts] = [p.grad.clone() for p in trainer.policy.parameters()]

        trainer.optimizer.step = capture
        trainer.algorithm.update(rollouts, advantages)
    for one, three in zip(grads[1], grads[3]):
        torch.testing.assert_close(one, three, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize(
    "overrides",
    [
        {"objective": "unsupervised", "num_negatives": 0},
        {"reward_mode": "per_rollout", "ppo_epochs": 2, "kl_coef": 0.05, "lambda_consistency": 0.0},
        {"text_kl_coef": 1.0, "max_steps": 2},  # full fine-tuning: a frozen reference copy
    ],
)
def test_objectives_and_modes_run(tmp_path, overrides):
    cfg = config(tmp_path, **{"max_steps": 1, **overrides})
    data = [Triplet(t.query, t.query, ()) for t in DATA] if overrides.get("objective") == "unsupervised" else DATA
    result = Trainer(cfg, model=make_st_model(), train_data=data).train()
    metrics = result["metrics"]
    assert all(math.isfinite(v) for v in metrics.values())
    if cfg.kl_coef:
        assert metrics["kl"] >= 0 and "clip_fraction" in metrics
    if cfg.text_kl_coef:  # step 1 starts at the reference (KL 0); step 2 has moved away from it
        assert metrics["text_kl"] > 0


def test_too_little_data_and_uneven_batches_are_refused(tmp_path):
    with pytest.raises(ValueError, match="fewer than one batch"):
        Trainer(config(tmp_path, batch_size=16), model=make_st_model(), train_data=DATA)


@pytest.mark.parametrize("lora", [False, True])
def test_save_model_dir_writes_the_gathered_weights_given_not_the_ones_in_memory(tmp_path, lora):
    """FSDP holds shards: the trainer gathers the full state dict and the saved directory must hold
    those weights. Stand-in here: a state dict with every weight changed; the model in memory keeps
    its own, and a later save writes those again."""
    from safetensors.torch import load_file

    from grace_training.run.checkpoint import save_model_dir

    if lora:
        from test_adapter import adapter_model

        st_model, _ = adapter_model(tmp_path)
    else:
        st_model = make_st_model()
    policy = st_model[0].model
    own = {name: tensor.clone() for name, tensor in policy.state_dict().items()}
    gathered = {name: tensor + 0.5 if tensor.is_floating_point() else tensor for name, tensor in own.items()}
    save_model_dir(st_model, tmp_path / "gathered", dict(gathered))  # a copy: transformers empties it
    save_model_dir(st_model, tmp_path / "own")
    for name, tensor in policy.state_dict().items():
        assert torch.equal(tensor, own[name]), name
    texts = ["A man is playing a guitar."]
    loaded = {
        kind: SentenceTransformer(str(tmp_path / kind), trust_remote_code=True, device="cpu")
        for kind in ("gathered", "own")
    }
    assert torch.allclose(
        torch.as_tensor(loaded["own"].encode(texts)), torch.as_tensor(st_model.encode(texts)), atol=1e-5
    )
    assert not torch.allclose(
        torch.as_tensor(loaded["gathered"].encode(texts)), torch.as_tensor(st_model.encode(texts)), atol=1e-3
    )
    if lora:  # only the adapter's weights are written (PEFT drops the adapter's name), the gathered ones
        written = load_file(str(tmp_path / "gathered" / "adapter_model.safetensors"))
        assert written and all("lora_" in name for name in written)
        expected = {name: gathered[name.replace(".weight", ".default.weight")] for name in written}
    else:
        written = load_file(str(tmp_path / "gathered" / "model.safetensors"))
        expected = {name: gathered[name] for name in written if name in gathered}
        assert len(expected) >= len(written) - 1  # all but a tied lm_head
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name


def test_training_rolls_out_the_policy_without_the_start_models_repetition_penalty(tmp_path, caplog):
    """A decoding-time repetition penalty would make rollouts draws from another distribution than the one
    GRPO's ratios are taken against: the trainer turns it off, says so, and saves the model without it."""
    model = make_st_model(repetition_penalty=1.5)
    with caplog.at_level("WARNING", logger="grace_training.trainer"):
        trainer = Trainer(config(tmp_path, max_steps=1), model=model, train_data=DATA)
    assert trainer.encoder.repetition_penalty == 1.0
    assert "repetition_penalty 1.5 is turned off" in caplog.text
