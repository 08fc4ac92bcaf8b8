"""Background Hub pushes against a stand-in for huggingface_hub.HfApi (the Hub is unreachable here)."""

from __future__ import annotations

import json
import threading
import time

from conftest import CORPUS, make_st_model
from grace_training.config import GRPOConfig
from grace_training.data import Triplet
from grace_training.hub import HubPusher
from grace_training.trainer import GRPOTrainer


class StandInHfApi:
    """Records calls with HfApi's keywords; the first ``failures`` uploads raise; ``gate`` can hold uploads."""

    def __init__(self, failures: int = 0, gate: threading.Event | None = None) -> None:
        self.failures = failures
        self.gate = gate
        self.repos, self.branches, self.uploads = [], [], []

    def create_repo(self, repo_id, *, private=None, exist_ok=False, repo_type=None, **kwargs):
        self.repos.append((repo_id, private, exist_ok))

    def create_branch(self, repo_id, *, branch, exist_ok=False, repo_type=None, **kwargs):
        self.branches.append(branch)

    def upload_folder(
        self, *, repo_id, folder_path, revision=None, commit_message=None, ignore_patterns=None, **kwargs
    ):
        if self.gate is not None:
            self.gate.wait(10)
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError("Hub unreachable")
        self.uploads.append((revision, folder_path, tuple(ignore_patterns or ())))


def checkpoint(tmp_path, step):
    path = tmp_path / f"checkpoint-{step:08d}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"weights")
    return path


def test_each_checkpoint_gets_a_branch_and_main_follows_the_latest(tmp_path):
    api = StandInHfApi(failures=2)
    pusher = HubPusher("me/grace", tmp_path, api=api, sleep=lambda s: None)
    for step in (10, 20):
        pusher.submit(checkpoint(tmp_path, step), step)
    assert pusher.close(timeout=10)
    assert api.repos == [("me/grace", True, True)]
    assert api.branches[-2:] == ["step-00000010", "step-00000020"]
    pushed = [(rev, path.rsplit("-", 1)[-1]) for rev, path, _ in api.uploads]
    assert pushed == [
        ("step-00000010", "00000010"),
        ("main", "00000010"),
        ("step-00000020", "00000020"),
        ("main", "00000020"),
    ]
    assert pusher.failures == 2 and pusher.pushed == [10, 20]
    assert all("trainer_state/*" in patterns for _, _, patterns in api.uploads)
    assert json.loads((tmp_path / "hub_queue.json").read_text())["pending"] == []


def test_submit_never_blocks_training(tmp_path):
    gate = threading.Event()
    pusher = HubPusher("me/grace", tmp_path, api=StandInHfApi(gate=gate), sleep=lambda s: None)
    start = time.perf_counter()
    for step in (1, 2, 3):
        pusher.submit(checkpoint(tmp_path, step), step)
    assert time.perf_counter() - start < 0.5
    assert len(pusher.pending_paths()) == 3
    gate.set()
    assert pusher.close(timeout=10) and pusher.pushed == [1, 2, 3]


def test_pending_pushes_resume_after_a_restart(tmp_path):
    down = StandInHfApi(failures=10**6)
    first = HubPusher("me/grace", tmp_path, api=down, sleep=lambda s: time.sleep(0.01))
    first.submit(checkpoint(tmp_path, 5), 5)
    assert not first.close(timeout=0.2)  # still failing: the journal keeps it
    assert [item["step"] for item in json.loads((tmp_path / "hub_queue.json").read_text())["pending"]] == [5]

    up = StandInHfApi()
    second = HubPusher("me/grace", tmp_path, api=up, sleep=lambda s: None)
    assert second.close(timeout=10)
    assert [rev for rev, _, _ in up.uploads] == ["step-00000005", "main"]


def test_trainer_pushes_every_checkpoint(tmp_path):
    api = StandInHfApi(failures=1)
    data = [Triplet(CORPUS[i], CORPUS[i + 1], (CORPUS[i + 2],)) for i in range(4)]
    cfg = GRPOConfig(
        num_rollouts=2,
        batch_size=2,
        max_prompt_tokens=160,
        max_response_tokens=3,
        max_steps=2,
        save_steps=1,
        save_total_limit=1,
        output_dir=str(tmp_path / "run"),
        report_to=["jsonl"],
        push_to_hub=True,
        hub_model_id="me/grace-tiny",
        hub_retry_backoff_s=0.01,
    )
    trainer = GRPOTrainer(cfg, model=make_st_model(), train_data=data, hub_api=api)
    trainer.train()
    revisions = [rev for rev, _, _ in api.uploads]
    assert "step-00000001" in revisions and "step-00000002" in revisions and revisions[-1] == "main"
    card = (tmp_path / "run" / "checkpoint-00000002" / "README.md").read_text()
    assert "me/grace-tiny" in card
