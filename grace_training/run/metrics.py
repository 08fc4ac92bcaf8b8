"""Per-step metrics (:func:`step_metrics`), written to ``<output_dir>/metrics.jsonl`` and TensorBoard
(``<output_dir>/tensorboard``) by :class:`MetricsLogger`."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

from grace_training.algorithms.grpo.loss import advantage_shares
from grace_training.algorithms.grpo.rewards import reward_parts
from grace_training.run.processes import sum_over_processes

logger = logging.getLogger(__name__)


class MetricsLogger:
    """Appends one JSON object a step; on resume, drops lines the crashed run wrote past the checkpoint."""

    def __init__(
        self, output_dir: str | Path, report_to: list[str], *, enabled: bool = True, resume_step: int | None = None
    ) -> None:
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.writer = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.is_file():
            self._truncate_to(resume_step)
        self.jsonl = "jsonl" in report_to
        if "tensorboard" in report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(log_dir=str(Path(output_dir) / "tensorboard"))
            except ImportError:
                logger.warning("tensorboard is not installed: metrics go to metrics.jsonl only")

    def _truncate_to(self, resume_step: int) -> None:
        """Keep the lines up to the checkpoint's step. The file is replaced, never rewritten in
        place: a kill at any moment leaves the old file or the new one, never an empty one."""
        lines = self.path.read_text(encoding="utf-8").splitlines()
        steps = [_step(line) for line in lines]
        torn = sum(step is None and bool(line.strip()) for line, step in zip(lines, steps))
        if torn:  # a line cut short by the kill that made this a resume
            logger.warning("%s: dropped %d unreadable line(s)", self.path, torn)
        kept = "".join(f"{line}\n" for line, step in zip(lines, steps) if step is not None and step <= resume_step)
        _replace_text(self.path, kept)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        if self.jsonl:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def rollout_metrics(rollouts, accelerator) -> dict[str, float]:
    """Lengths, truncation and generated tokens of a step's rollouts (queries, negatives, positives).
    Processes can hold different numbers of negatives, so the negatives' mean length and the overall
    truncation rate are ratios of sums over all processes; the rest is this process's."""
    positives, negatives = rollouts.positives, rollouts.negatives
    everything = [rollouts.queries, negatives, positives]
    # a stop token is generated too, though not counted in a rollout's length
    generated = float(sum(r.lengths.sum() for r in everything)) + sum(
        int((torch.tensor(r.stop_ids) >= 0).sum()) for r in everything if len(r)
    )
    rows = sum(len(r) for r in everything)
    negative_tokens = float(negatives.lengths.sum()) if len(negatives) else 0.0
    truncated = sum(int(r.truncated.sum()) for r in everything)
    rows_all, truncated_all, negative_count, negative_tokens = sum_over_processes(
        accelerator, rows, truncated, len(negatives), negative_tokens
    )
    return {
        "rollout/positive_length_mean": positives.lengths.mean().item(),
        "rollout/positive_length_max": positives.lengths.max().item(),
        "rollout/query_length_mean": rollouts.queries.lengths.mean().item(),
        "rollout/negative_length_mean": negative_tokens / max(negative_count, 1.0),
        "rollout/prompt_length_mean": positives.prompt_lengths.mean().item(),
        "rollout/truncation_rate": positives.truncated.float().mean().item(),
        "rollout/truncation_rate_all": truncated_all / max(rows_all, 1.0),
        "rollout/count": float(rows),
        "throughput/generated_tokens": generated,
    }


def reward_metrics(rewards, advantages, truncated, config) -> dict[str, float]:
    """The mean of each reward term (Eqs. 5–9), the spread of R_final within a group, each term's
    share of the advantage, and the advantages' (Eq. 10) spread."""
    metrics: dict[str, float] = {f"reward/{name}": value.float().mean().item() for name, value in rewards.items()}
    metrics["reward/final_std_in_group"] = rewards["final"].std(dim=1, unbiased=False).mean().item()
    weights = ("lambda_consistency", "lambda_hard_negative", "tau", "length_penalty_mode")
    parts = reward_parts(rewards, truncated, **{name: getattr(config, name) for name in weights})
    metrics.update({f"advantage_share/{name}": value for name, value in advantage_shares(parts).items()})
    metrics.update(
        {
            "advantage/mean": advantages.mean().item(),
            "advantage/std": advantages.std(unbiased=False).item(),
            "advantage/abs_mean": advantages.abs().mean().item(),
            "advantage/min": advantages.min().item(),
            "advantage/max": advantages.max().item(),
        }
    )
    return metrics


def step_metrics(
    rollouts, rewards, advantages, truncated, update, timings, *, config, epoch: float, accelerator
) -> dict[str, float]:
    """A GRPO step's metrics. ``rewards``, ``advantages`` and ``truncated`` (the positives', (B, K))
    are the global batch's; the rollout and throughput numbers are this process's, which
    :func:`grace_training.run.processes.reduce_metrics` combines. ``update`` is what
    ``GRPOStep.update`` returned, ``timings`` the stages' seconds."""
    metrics = {**reward_metrics(rewards, advantages, truncated, config), **rollout_metrics(rollouts, accelerator)}
    generated = metrics["throughput/generated_tokens"]
    metrics.update(
        {
            "loss": update["loss"],
            "loss/policy": update["policy_loss"],
            "loss/contrastive": update["contrastive_loss"],
            "grad_norm": update["grad_norm"],
            "clip_fraction": update["clip_fraction"],
            "kl": update["kl"],
            "text_kl": update["text_kl"],
            "lr": update["lr"],
            "epoch": epoch,
            "time/rollout_s": timings["rollout"],
            "time/reward_s": timings["reward"],
            "time/update_s": timings["update"],
            **{f"time/update_{part}_s": value for part, value in update.get("seconds", {}).items()},
            "time/step_s": timings["step"],
            "time/step_cpu_s": timings["cpu"],
            "time/weight_sync_s": update["weight_sync_s"],  # into the vLLM engine (0 with hf)
            "time/rollout_share": timings["rollout"] / max(timings["step"], 1e-9),
            "throughput/generated_tokens_per_s": generated / max(timings["rollout"], 1e-9),
            "throughput/tokens_per_s": (generated + update["update_tokens"]) / max(timings["step"], 1e-9),
        }
    )
    return metrics


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return value


def _step(line: str) -> int | None:
    """The line's step; None for a line that is not a JSON record (a write cut short)."""
    try:
        return int(json.loads(line).get("step", 0))
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
        return None


def _replace_text(path: Path, text: str) -> None:
    """Write a sibling temporary file, flush it to disk, then rename it over ``path`` (atomic)."""
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def cpu_hours(steps: list[dict]) -> dict[int, float]:
    """CPU hours spent by the end of each step (``time/step_cpu_s``, the processes' CPU time; runs
    that predate it have none). Evaluations are not counted: they are the same for every recipe."""
    if not steps or "time/step_cpu_s" not in steps[0]:
        return {}
    total, hours = 0.0, {0: 0.0}
    for row in steps:
        total += row["time/step_cpu_s"]
        hours[row["step"]] = total / 3600
    return hours
