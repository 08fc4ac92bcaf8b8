"""A GRPO step's metrics: its rollouts' lengths and truncation, each reward term and its share of the advantage, the
update's losses and the stages' times (:func:`step_metrics`)."""

from __future__ import annotations

import torch

from grace_training.algorithms.grpo.loss import advantage_shares
from grace_training.algorithms.grpo.rewards import reward_parts
from grace_training.run.processes import sum_over_processes


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
