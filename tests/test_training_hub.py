"""Background Hub pushes against a stand-in for huggingface_hub.HfApi (the Hub is unreachable here)."""

from __future__ import annotations

import json
import logging
import threading
import time
from types import SimpleNamespace

import pytest
from conftest import CORPUS, make_st_model

from grace_training.config.train_config import TrainConfig
from grace_training.data.examples import Triplet
from grace_training.run.checkpoint import list_checkpoints
from grace_training.run.hub import HubPusher, permanent_reason
from grace_training.trainer import Trainer


class StandInHfApi:
    """Records calls with HfApi's keywords; the first ``failures`` uploads raise ``error()`` (a
    ConnectionError by default); ``gate`` can hold uploads."""

    def __init__(self, failures: int = 0, gate: threading.Event | None = None, error=None) -> None:
        self.failures = failures
        self.gate = gate
        self.error = error or (lambda: ConnectionError("Hub unreachable"))
        self.attempts = 0
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
        self.attempts += 1
        if self.failures > 0:
            self.failures -= 1
            raise self.error()
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


def pushing_trainer(tmp_path, api, **extra):
    """A two-step tiny run that checkpoints (keep-last-1) and pushes every step through ``api``."""
    data = [Triplet(CORPUS[i], CORPUS[i + 1], (CORPUS[i + 2],)) for i in range(4)]
    cfg = TrainConfig(
        num_rollouts=2,
        batch_size=2,
        max_input_tokens=160,
        max_rationale_tokens=3,
        max_steps=2,
        save_steps=1,
        save_total_limit=1,
        output_dir=str(tmp_path / "run"),
        report_to=["jsonl"],
        push_to_hub=True,
        hub_model_id="me/grace-tiny",
        hub_retry_backoff_s=0.01,
        **extra,
    )
    return Trainer(cfg, model=make_st_model(), train_data=data, hub_api=api), cfg


def test_trainer_pushes_every_checkpoint(tmp_path):
    api = StandInHfApi(failures=1)
    trainer, cfg = pushing_trainer(tmp_path, api)
    trainer.train()
    revisions = [rev for rev, _, _ in api.uploads]
    assert "step-00000001" in revisions and "step-00000002" in revisions and revisions[-1] == "main"
    card = (tmp_path / "run" / "checkpoint-00000002" / "README.md").read_text()
    assert "me/grace-tiny" in card


# -- permanent errors disable pushes; transient ones are retried ------------------------------------


class HTTPStatusError(Exception):
    """Any client's HTTP error: what matters is ``.response.status_code``."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status} from the Hub")
        self.response = SimpleNamespace(status_code=status)


def hub_error(name: str, status: int | None = None):
    from huggingface_hub import errors

    try:  # huggingface_hub 1.x answers with httpx responses, 2.x with httpx2's
        import httpx
    except ImportError:
        import httpx2 as httpx

    cls = getattr(errors, name)
    if status is None:
        return cls(f"{name} raised before any request")
    # a response built here, never sent: the address is a reserved, unresolvable name
    response = httpx.Response(status, request=httpx.Request("POST", "http://hub.invalid/api/repos/create"))
    return cls(f"{status} from the Hub", response=response)


PERMANENT = {
    "401": lambda: HTTPStatusError(401),
    "403": lambda: HTTPStatusError(403),
    "404": lambda: HTTPStatusError(404),
    "RepositoryNotFoundError": lambda: hub_error("RepositoryNotFoundError", 404),
    "HfHubHTTPError 403": lambda: hub_error("HfHubHTTPError", 403),
    "LocalTokenNotFoundError": lambda: hub_error("LocalTokenNotFoundError"),
    "HFValidationError": lambda: hub_error("HFValidationError"),
}
TRANSIENT = {
    "500": lambda: HTTPStatusError(500),
    "503": lambda: HTTPStatusError(503),
    "429": lambda: HTTPStatusError(429),
    "HfHubHTTPError 502": lambda: hub_error("HfHubHTTPError", 502),
    "connection": lambda: ConnectionError("reset by peer"),
    "timeout": lambda: TimeoutError("read timed out"),
}


@pytest.mark.parametrize("name", sorted(PERMANENT))
def test_a_permanent_error_disables_pushes_and_releases_rotation(tmp_path, caplog, name):
    api = StandInHfApi(failures=10**6, error=PERMANENT[name])
    waits = []
    pusher = HubPusher("me/grace", tmp_path, api=api, sleep=waits.append)
    gate = threading.Event()  # both checkpoints queued before the first attempt
    api.gate = gate
    with caplog.at_level(logging.ERROR, logger="grace_training.run.hub"):
        for step in (1, 2):
            pusher.submit(checkpoint(tmp_path, step), step)
        gate.set()
        assert not pusher.close(timeout=10)  # returns at once: nothing is retried
    assert api.attempts == 1 and waits == []
    assert pusher.pending_paths() == set() and pusher.disabled
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    message = record.getMessage()
    assert "me/grace" in message and "disabled" in message and permanent_reason(PERMANENT[name]()) in message
    journal = json.loads((tmp_path / "hub_queue.json").read_text())
    assert journal["pending"] == [] and [item["step"] for item in journal["rejected"]] == [1, 2]


def test_after_a_permanent_error_new_checkpoints_are_not_held_back(tmp_path):
    pusher = HubPusher("me/grace", tmp_path, api=StandInHfApi(failures=1, error=PERMANENT["403"]), sleep=lambda s: None)
    pusher.submit(checkpoint(tmp_path, 1), 1)
    assert pusher.wait(timeout=10) and pusher.disabled
    pusher.submit(checkpoint(tmp_path, 2), 2)
    assert pusher.pending_paths() == set()
    assert not pusher.close(timeout=10) and pusher.pushed == []


def test_the_next_run_retries_what_a_permanent_error_rejected(tmp_path):
    first = HubPusher("me/grace", tmp_path, api=StandInHfApi(failures=1, error=PERMANENT["401"]), sleep=lambda s: None)
    first.submit(checkpoint(tmp_path, 4), 4)
    assert not first.close(timeout=10)
    fixed = StandInHfApi()  # e.g. a token with write access this time
    second = HubPusher("me/grace", tmp_path, api=fixed, sleep=lambda s: None)
    assert second.close(timeout=10) and second.pushed == [4]
    assert json.loads((tmp_path / "hub_queue.json").read_text())["rejected"] == []


@pytest.mark.parametrize("name", sorted(TRANSIENT))
def test_transient_errors_are_retried_with_backoff(tmp_path, name):
    waits = []
    api = StandInHfApi(failures=3, error=TRANSIENT[name])
    pusher = HubPusher("me/grace", tmp_path, api=api, initial_backoff=1.0, sleep=waits.append)
    pusher.submit(checkpoint(tmp_path, 7), 7)
    assert pusher.close(timeout=10) and pusher.pushed == [7] and pusher.disabled is None
    assert waits == [1.0, 2.0, 4.0] and permanent_reason(TRANSIENT[name]()) is None


def test_trainer_rotation_works_after_a_permanent_hub_error(tmp_path, monkeypatch):
    api = StandInHfApi(failures=10**6, error=PERMANENT["403"])
    submit = HubPusher.submit

    def submit_and_settle(self, checkpoint_dir, step):  # rotation then sees the push's outcome, not a race
        submit(self, checkpoint_dir, step)
        self.wait(timeout=5)

    monkeypatch.setattr(HubPusher, "submit", submit_and_settle)
    trainer, cfg = pushing_trainer(tmp_path, api, hub_final_wait_s=2.0)
    trainer.train()
    assert [step for step, _ in list_checkpoints(cfg.output_dir)] == [2]
    assert api.attempts == 1 and api.uploads == []
