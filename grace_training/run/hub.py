"""Push checkpoints to a Hub model repo from a background thread (never blocks training).

Each checkpoint goes to its own branch ``step-<step>``, then to ``main`` when it is the newest
pushed so far (main = latest). The model directory is uploaded, the trainer state is not.

A transient failure (HTTP 5xx or 429, a connection error, a timeout) is retried with
exponential backoff until it succeeds, and the queue is journalled in
``<output_dir>/hub_queue.json``, so a restarted run pushes what the previous one had not. The
trainer keeps queued checkpoints out of keep-last-k rotation (:meth:`HubPusher.pending_paths`).

A permanent failure (HTTP 401, 403 or 404, no token, an invalid repo id: :func:`permanent_reason`)
cannot succeed by waiting, and retrying it would hold every later checkpoint out of rotation
until the disk fills. It disables pushes for the rest of the run, logged as an error: the queued
checkpoints and any submitted later move to the journal's ``rejected`` list, leave
:meth:`~HubPusher.pending_paths` (rotation deletes them as usual), and the next run, with the
token or repo fixed, retries those still on disk.

The Hub is unreachable from the development machines: tests drive this class with a stand-in
for ``huggingface_hub.HfApi`` (same method names and keywords).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

JOURNAL = "hub_queue.json"
PERMANENT_STATUS = {401, 403, 404}  # unauthorised, forbidden, no such repo: waiting changes nothing
PERMANENT_ERRORS = {  # huggingface_hub's names for the same, some raised before any HTTP request
    "RepositoryNotFoundError",
    "GatedRepoError",
    "DisabledRepoError",
    "LocalTokenNotFoundError",
    "HFValidationError",
}


def permanent_reason(error: BaseException) -> str | None:
    """Why retrying ``error`` cannot help ("HTTP 403", "RepositoryNotFoundError"), or None when it
    may (5xx, 429, connection errors, timeouts, anything unknown)."""
    status = getattr(getattr(error, "response", None), "status_code", None)
    if isinstance(status, int):
        return f"HTTP {status}" if status in PERMANENT_STATUS else None
    for cls in type(error).__mro__:
        if cls.__name__ in PERMANENT_ERRORS:
            return cls.__name__
    return None


class HubPusher:
    """Background uploader of checkpoint directories to ``repo_id``.

    Args:
        repo_id: the model repo (created if missing).
        journal_dir: where ``hub_queue.json`` lives (the run's output directory).
        api: an ``HfApi`` or a stand-in; default ``huggingface_hub.HfApi()``.
        initial_backoff, max_backoff: seconds between retries (doubling, capped).
        max_attempts: None retries for ever (the default: a checkpoint is never dropped).
    """

    def __init__(
        self,
        repo_id: str,
        journal_dir: str | Path,
        *,
        api=None,
        private: bool = True,
        initial_backoff: float = 5.0,
        max_backoff: float = 300.0,
        max_attempts: int | None = None,
        ignore_patterns: list[str] | None = None,
        sleep=time.sleep,
    ) -> None:
        if api is None:
            from huggingface_hub import HfApi

            api = HfApi()
        self.api = api
        self.repo_id = repo_id
        self.private = private
        self.journal = Path(journal_dir) / JOURNAL
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff
        self.max_attempts = max_attempts
        self.ignore_patterns = (
            ignore_patterns if ignore_patterns is not None else ["trainer_state/*", "trainer_state/**"]
        )
        self._sleep = sleep
        self._lock = threading.Condition()
        self._queue: list[dict[str, Any]] = []
        self._failed: list[dict[str, Any]] = []
        self._rejected: list[dict[str, Any]] = []  # not pushed because pushes were disabled
        self.disabled: str | None = None  # why, once a permanent error has disabled pushes
        self._main_step = -1
        self._repo_ready = False
        self._closing = False
        self._busy = False
        self.failures = 0
        self.pushed: list[int] = []
        self._load_journal()
        self._thread = threading.Thread(target=self._run, name="grace-hub-push", daemon=True)
        self._thread.start()

    # -- journal --------------------------------------------------------------------------------

    def _load_journal(self) -> None:
        if self.journal.is_file():
            saved = json.loads(self.journal.read_text(encoding="utf-8"))
            # Rejected ones too: the permanent error that stopped them (a token, a repo id) may be fixed now.
            saved_items = [*saved.get("failed", []), *saved.get("rejected", []), *saved.get("pending", [])]
            self._queue = [item for item in saved_items if Path(item["path"]).is_dir()]
            self._main_step = saved.get("main_step", -1)
            if self._queue:
                logger.info("resuming %d pending Hub push(es) for %s", len(self._queue), self.repo_id)

    def _save_journal(self) -> None:
        self.journal.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.journal.with_suffix(".json.tmp")
        temporary.write_text(
            json.dumps(
                {
                    "pending": self._queue,
                    "failed": self._failed,
                    "rejected": self._rejected,
                    "main_step": self._main_step,
                },
                indent=2,
            )
        )
        os.replace(temporary, self.journal)

    # -- public ---------------------------------------------------------------------------------

    def submit(self, checkpoint_dir: str | Path, step: int) -> None:
        """Queue a checkpoint and return at once (journal it only, once pushes are disabled)."""
        with self._lock:
            item = {"path": str(Path(checkpoint_dir).resolve()), "step": int(step)}
            (self._rejected if self.disabled else self._queue).append(item)
            self._save_journal()
            self._lock.notify_all()

    def pending_paths(self) -> set[str]:
        """Checkpoints not on the Hub yet (queued or given up on): keep-last-k must spare them.

        Not those rejected after a permanent error: no push of them can come in this run."""
        with self._lock:
            return {item["path"] for item in [*self._queue, *self._failed]}

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the queue is empty (True) or ``timeout`` passes (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._queue or self._busy:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._lock.wait(remaining if remaining is not None else 1.0)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Wait for pending pushes (up to ``timeout``), then stop; the journal keeps the rest.

        True when every submitted checkpoint was pushed (False too when pushes were disabled)."""
        done = self.wait(timeout)
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._thread.join(timeout=1.0)
        return done and self.disabled is None

    # -- worker ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._lock.wait()
                if self._closing:
                    return
                item = dict(self._queue[0])
                self._busy = True
            outcome = self._push_with_retries(item)
            with self._lock:
                if outcome == "disabled":
                    self._rejected.extend(self._queue)
                    self._queue.clear()
                elif outcome != "closing" and self._queue and self._queue[0]["path"] == item["path"]:
                    self._queue.pop(0)
                    if outcome == "gave_up":  # kept for the next run, which retries it first
                        self._failed.append(item)
                self._busy = False
                self._save_journal()
                self._lock.notify_all()
            if outcome == "closing":
                return

    def _push_with_retries(self, item: dict[str, Any]) -> str:
        """ "pushed", "gave_up" (only with ``max_attempts``), "disabled" (a permanent error) or
        "closing" (left queued for the next run)."""
        delay = self.initial_backoff
        attempt = 0
        while True:
            attempt += 1
            try:
                self._push(item)
                self.pushed.append(item["step"])
                return "pushed"
            except Exception as error:  # noqa: BLE001 - network, rate limits: retried; see permanent_reason
                self.failures += 1
                reason = permanent_reason(error)
                if reason is not None:
                    self._disable(item, reason, error)
                    return "disabled"
                if self.max_attempts is not None and attempt >= self.max_attempts:
                    logger.error(
                        "push of step %s failed %d times: %s; the journal keeps it for the next run",
                        item["step"],
                        attempt,
                        error,
                    )
                    return "gave_up"
                logger.warning(
                    "push of step %s failed (attempt %d): %s; retrying in %.0fs", item["step"], attempt, error, delay
                )
                self._sleep(delay)
                delay = min(delay * 2, self.max_backoff)
                with self._lock:
                    if self._closing:
                        return "closing"

    def _disable(self, item: dict[str, Any], reason: str, error: BaseException) -> None:
        with self._lock:
            self.disabled = f"{reason}: {error}"
            waiting = len(self._queue)
        logger.error(
            "Hub pushes to %s are disabled for the rest of this run: pushing step %s failed with %s (%s), "
            "which retrying cannot fix (check the token's write access and hub_model_id). %d queued "
            "checkpoint(s) are released to keep-last-k rotation; %s lists them as rejected and the next "
            "run retries those still on disk.",
            self.repo_id,
            item["step"],
            reason,
            error,
            waiting,
            self.journal,
        )

    def _push(self, item: dict[str, Any]) -> None:
        step, path = item["step"], item["path"]
        if not self._repo_ready:
            self.api.create_repo(self.repo_id, private=self.private, exist_ok=True, repo_type="model")
            self._repo_ready = True
        branch = f"step-{step:08d}"
        self.api.create_branch(self.repo_id, branch=branch, exist_ok=True, repo_type="model")
        message = f"GRACE checkpoint at step {step}"
        self.api.upload_folder(
            repo_id=self.repo_id,
            folder_path=path,
            revision=branch,
            repo_type="model",
            commit_message=message,
            ignore_patterns=self.ignore_patterns,
        )
        if step > self._main_step:
            self.api.upload_folder(
                repo_id=self.repo_id,
                folder_path=path,
                revision="main",
                repo_type="model",
                commit_message=message,
                ignore_patterns=self.ignore_patterns,
            )
            with self._lock:
                self._main_step = step
