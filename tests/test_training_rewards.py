"""Reward terms (Eqs. 5–9, 13, 28) and advantages (Eq. 10) against hand-computed numbers.

The toy batch (B = 2 instances, K = 2 positive rollouts, one negative each, H = 2):

    q0 = (1, 0)        d0⁺ = [(1, 0), (0, 1)]            d0⁻ = (0.6, 0.8)
    q1 = (0, 1)        d1⁺ = [(0, 1), (0.6, 0.8)]        d1⁻ = (1, 0)
"""

from __future__ import annotations

import pytest
import torch

from grace_training.algorithms.grpo.loss import group_advantages
from grace_training.algorithms.grpo.rewards import (
    compute_rewards,
    consistency_reward,
    contrastive_reward,
    final_reward,
    hard_negative_reward,
    length_penalty,
    per_rollout_contrastive_reward,
    per_rollout_hard_negative_reward,
    scaled_reward,
    self_alignment_reward,
    total_reward,
)

Q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
P = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.0, 1.0], [0.6, 0.8]]])
N = torch.tensor([[[0.6, 0.8]], [[1.0, 0.0]]])
TRUNCATED = torch.tensor([[False, True], [False, False]])


def close(actual, expected):
    torch.testing.assert_close(actual.float(), torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=0)


def test_contrastive_reward_eq5():
    # sim(q0, d0⁺) = [1, 0], sim(q0, d0⁻) = 0.6; sim(q1, d1⁺) = [1, 0.8], sim(q1, d1⁻) = 0
    close(contrastive_reward(Q, P, N), [[0.4, -0.6], [1.0, 0.8]])


def test_contrastive_reward_is_cosine_and_ignores_padded_negatives():
    padded = torch.cat([N, torch.tensor([[[5.0, 5.0]], [[1.0, 1.0]]])], dim=1)
    mask = torch.tensor([[True, False], [True, False]])
    close(contrastive_reward(3 * Q, 2 * P, 7 * padded, mask), [[0.4, -0.6], [1.0, 0.8]])
    # no negatives: the alignment term alone
    close(contrastive_reward(Q, P, N[:, :0]), [[1.0, 0.0], [1.0, 0.8]])


def test_self_alignment_reward_eq13():
    close(self_alignment_reward(Q, P), [[1.0, 0.0], [1.0, 0.8]])


def test_consistency_reward_eq6():
    # instance 0: sim((1,0),(0,1)) = 0; instance 1: sim((0,1),(0.6,0.8)) = 0.8
    close(consistency_reward(P), [[0.0, 0.0], [0.8, 0.8]])
    three = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]]])
    # k=0: mean(0, 0.6) = 0.3; k=1: mean(0, 0.8) = 0.4; k=2: mean(0.6, 0.8) = 0.7
    close(consistency_reward(three), [[0.3, 0.4, 0.7]])
    close(consistency_reward(P[:, :1]), [[0.0], [0.0]])


def test_hard_negative_reward_eq7():
    # R_hard(0) = -max_l sim(q0, d1⁺(l)) = -max(0, 0.6); R_hard(1) = -max_l sim(q1, d0⁺(l)) = -max(0, 1)
    close(hard_negative_reward(Q, P), [[-0.6, -0.6], [-1.0, -1.0]])
    close(hard_negative_reward(Q[:1], P[:1]), [[0.0, 0.0]])


def test_hard_negative_reward_over_gathered_batch():
    # process 1 holds instance 1 only; the gathered positives are the whole batch
    close(hard_negative_reward(Q[1:], P, own_index=torch.tensor([1])), [[-1.0, -1.0]])


def test_total_scaled_and_final_rewards_eqs_8_9_28():
    total = total_reward(contrastive_reward(Q, P, N), consistency_reward(P), hard_negative_reward(Q, P), 0.2, 0.2)
    close(total, [[0.28, -0.72], [0.96, 0.76]])
    scaled = scaled_reward(total, 10.0)
    close(scaled, [[0.028, -0.072], [0.096, 0.076]])
    close(length_penalty(TRUNCATED, 1.0), [[0.0, -1.0], [0.0, 0.0]])
    close(final_reward(scaled, TRUNCATED, 1.0, "add"), [[0.028, -1.072], [0.096, 0.076]])
    close(final_reward(scaled, TRUNCATED, 1.0, "replace"), [[0.028, -1.0], [0.096, 0.076]])


def test_ablations_lambda_zero():
    cl, consist, hard = contrastive_reward(Q, P, N), consistency_reward(P), hard_negative_reward(Q, P)
    close(total_reward(cl, consist, hard, 0.0, 0.2), [[0.28, -0.72], [0.8, 0.6]])  # no consistency
    close(total_reward(cl, consist, hard, 0.2, 0.0), [[0.4, -0.6], [1.16, 0.96]])  # no hard negatives
    close(total_reward(cl, consist, hard, 0.0, 0.0), [[0.4, -0.6], [1.0, 0.8]])


def test_per_rollout_terms():
    # sim(q_i, d⁺(k)) - sim(d⁺(k), d⁻): (1 - 0.6, 0 - 0.8), (1 - 0, 0.8 - 0.6)
    close(per_rollout_contrastive_reward(Q, P, N), [[0.4, -0.8], [1.0, 0.2]])
    # -max over other queries of sim(d⁺(k), q_j): -(0, 1), -(0, 0.6)
    close(per_rollout_hard_negative_reward(P, Q), [[0.0, -1.0], [0.0, -0.6]])


def test_advantage_eq10_mean_centred_without_std():
    rewards = torch.tensor([[0.028, -1.072], [0.096, 0.076]])
    advantages = group_advantages(rewards)
    close(advantages, [[0.55, -0.55], [0.01, -0.01]])  # a std division would make both ±1
    close(advantages.sum(1), [0.0, 0.0])


def test_compute_rewards_bundles_every_term():
    out = compute_rewards(Q, P, N, None, TRUNCATED)
    close(out["contrastive"], [[0.4, -0.6], [1.0, 0.8]])
    close(out["final"], [[0.028, -1.072], [0.096, 0.076]])
    unsupervised = compute_rewards(Q, P, N[:, :0], None, TRUNCATED, objective="unsupervised")
    close(unsupervised["contrastive"], [[1.0, 0.0], [1.0, 0.8]])


@pytest.mark.parametrize("mode, cancels", [("paper", True), ("per_rollout", False)])
def test_negatives_cancel_in_paper_mode_only(mode, cancels):
    """method.md §2's known flaw: in paper mode the negative terms are constant over a group,
    so changing the negatives leaves the advantages unchanged; per-rollout mode does not."""
    other_negatives = torch.tensor([[[0.0, 1.0]], [[0.6, 0.8]]])
    first = group_advantages(compute_rewards(Q, P, N, None, TRUNCATED, mode=mode)["final"])
    second = group_advantages(compute_rewards(Q, P, other_negatives, None, TRUNCATED, mode=mode)["final"])
    assert torch.allclose(first, second, atol=1e-6) is cancels


def test_the_config_names_exactly_the_stages_keyword_arguments():
    """TrainConfig.rollout_settings / reward_settings feed asymmetric_rollouts and compute_rewards:
    every key they give is a keyword of the stage, and every config-owned keyword is given."""
    import inspect

    from grace_training.algorithms.grpo.rollout import asymmetric_rollouts
    from grace_training.config.train_config import TrainConfig

    config = TrainConfig()
    per_call = {"step", "generate", "instance_offset", "all_queries", "all_positives", "own_index"}
    for stage, settings in ((asymmetric_rollouts, config.rollout_settings()), (compute_rewards, config.reward_settings())):
        keywords = {p.name for p in inspect.signature(stage).parameters.values() if p.kind is p.KEYWORD_ONLY}
        assert set(settings) == keywords - per_call
