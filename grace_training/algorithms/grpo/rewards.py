"""Contrastive rewards for the positive rollouts (method.md §2, Eqs. 5–9, 13, 28).

Shapes: B instances, K positive rollouts each, M negatives each, H hidden size. Every
embedding is a rollout's h (Eq. 3); similarities are cosine. Each term returns a (B, K)
tensor, one reward per positive rollout, because Eq. 10 normalises within a group of K.

Two reward modes:

- ``paper``: the formulas as written. The query and negative rollouts are sampled once per
  instance, so Σ sim(h_q, h_d⁻) and R_hard are constant across a group and cancel in Eq. 10.
- ``per_rollout``: the negatives act through each rollout: − Σ_m sim(h_d⁺(k), h_dm⁻) and
  − max_{j≠i} sim(h_d⁺(k), h_qj), so they shape the advantage (method.md §2, "known flaw").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def cosine(a: Tensor, b: Tensor) -> Tensor:
    """Cosine similarity along the last dimension, broadcasting the leading ones."""
    return (F.normalize(a.float(), dim=-1) * F.normalize(b.float(), dim=-1)).sum(-1)


def _real_negatives(negatives: Tensor, negative_mask: Tensor | None) -> Tensor:
    """(B, M) True where a negative is real: ``negative_mask``, or all of them when it is None."""
    if negative_mask is None:
        return torch.ones(negatives.shape[:2], dtype=torch.bool, device=negatives.device)
    return negative_mask


def _other_instances(own_index: Tensor | None, batch: int, total: int, device) -> Tensor:
    """(B, B') True where global instance j is not instance i itself."""
    own = torch.arange(batch, device=device) if own_index is None else own_index.to(device)
    return torch.arange(total, device=device)[None, :] != own[:, None]


def contrastive_reward(
    query: Tensor, positives: Tensor, negatives: Tensor, negative_mask: Tensor | None = None
) -> Tensor:
    """R_CL(k) = sim(h_q, h_d⁺(k)) − Σ_m sim(h_q, h_dm⁻)   (Eq. 5).

    query (B, H), positives (B, K, H), negatives (B, M, H), negative_mask (B, M) marks real
    negatives (instances may have fewer than M).
    """
    aligned = cosine(query[:, None, :], positives)  # (B, K)
    if negatives.shape[1] == 0:
        return aligned
    mask = _real_negatives(negatives, negative_mask)
    repelled = torch.where(mask, cosine(query[:, None, :], negatives), 0.0).sum(1)  # (B,)
    return aligned - repelled[:, None]


def self_alignment_reward(anchor: Tensor, positives: Tensor) -> Tensor:
    """R_self(k) = sim(h_anchor, h_x(k)): the unsupervised objective's alignment term (Eq. 13).

    anchor (B, H) is one rollout of x, positives (B, K, H) are K more rollouts of the same x.
    """
    return cosine(anchor[:, None, :], positives)


def consistency_reward(positives: Tensor) -> Tensor:
    """R_consist(k) = mean over j ≠ k of sim(h_d⁺(k), h_d⁺(j))   (Eq. 6). Zero when K = 1."""
    k = positives.shape[1]
    if k < 2:
        return positives.new_zeros(positives.shape[:2], dtype=torch.float32)
    unit = F.normalize(positives.float(), dim=-1)
    sims = unit @ unit.transpose(1, 2)  # (B, K, K)
    return (sims.sum(-1) - sims.diagonal(dim1=1, dim2=2)) / (k - 1)


def hard_negative_reward(query: Tensor, positives: Tensor, own_index: Tensor | None = None) -> Tensor:
    """R_hard = − mean over other instances j ≠ i of max_l sim(h_qi, h_dj⁺(l))   (Eq. 7).

    query (B, H) are this process's queries; positives (B', K, H) are the in-batch positives
    of every process; ``own_index[i]`` is instance i's row in them (default: B' = B, row i).
    The value is the same for the K rollouts of an instance. Zero when B' = 1.
    """
    batch, total, k = query.shape[0], positives.shape[0], positives.shape[1]
    if total < 2:
        return query.new_zeros((batch, k), dtype=torch.float32)
    sims = cosine(query[:, None, None, :], positives[None, :, :, :]).amax(-1)  # (B, B')
    others = _other_instances(own_index, batch, total, query.device)
    value = -(torch.where(others, sims, 0.0).sum(1) / others.sum(1).clamp(min=1))
    return value[:, None].expand(batch, k)


def per_rollout_contrastive_reward(
    query: Tensor, positives: Tensor, negatives: Tensor, negative_mask: Tensor | None = None
) -> Tensor:
    """sim(h_q, h_d⁺(k)) − Σ_m sim(h_d⁺(k), h_dm⁻): Eq. 5 with the negatives seen from each
    rollout, so they no longer cancel in Eq. 10 (method.md §2)."""
    aligned = cosine(query[:, None, :], positives)
    if negatives.shape[1] == 0:
        return aligned
    mask = _real_negatives(negatives, negative_mask)
    sims = cosine(positives[:, :, None, :], negatives[:, None, :, :])  # (B, K, M)
    return aligned - torch.where(mask[:, None, :], sims, 0.0).sum(-1)


def per_rollout_hard_negative_reward(positives: Tensor, queries: Tensor, own_index: Tensor | None = None) -> Tensor:
    """− max over other queries j ≠ i of sim(h_d⁺(k), h_qj): Eq. 7 seen from each rollout
    (method.md §2). positives (B, K, H) local; queries (B', H) of every process."""
    batch, k, total = positives.shape[0], positives.shape[1], queries.shape[0]
    if total < 2:
        return positives.new_zeros((batch, k), dtype=torch.float32)
    sims = cosine(positives[:, :, None, :], queries[None, None, :, :])  # (B, K, B')
    others = _other_instances(own_index, batch, total, positives.device)
    return -torch.where(others[:, None, :], sims, float("-inf")).amax(-1)


def total_reward(
    contrastive: Tensor,
    consistency: Tensor,
    hard_negative: Tensor,
    lambda_consistency: float,
    lambda_hard_negative: float,
) -> Tensor:
    """R_total = R_CL + λ1 R_consist + λ2 R_hard   (Eq. 8)."""
    return contrastive + lambda_consistency * consistency + lambda_hard_negative * hard_negative


def scaled_reward(total: Tensor, tau: float) -> Tensor:
    """R̂ = R_total / τ   (Eq. 9)."""
    return total / tau


def length_penalty(truncated: Tensor, gamma: float) -> Tensor:
    """−γ for a rollout that hit the length limit without EOS, else 0   (Eq. 28)."""
    return -gamma * truncated.float()


def final_reward(scaled: Tensor, truncated: Tensor, gamma: float, mode: str = "add") -> Tensor:
    """R_final from R̂ and Eq. 28: ``add`` gives R̂ − γ·1[truncated]; ``replace`` sets a
    truncated rollout's reward to −γ (the paper's wording allows both readings; the reference
    code replaces); ``off`` leaves R̂ alone."""
    if mode == "off":
        return scaled
    if mode == "replace":
        return torch.where(truncated.bool(), torch.full_like(scaled, -gamma), scaled)
    return scaled + length_penalty(truncated, gamma)


def penalty_in_scaled_units(gamma: float, tau: float, units: str = "scaled") -> float:
    """γ as Eq. 28 applies it to R̂. ``scaled`` (paper): γ as given. ``reward``: γ is in the
    units of R_total (cosines), so it is divided by τ like the contrastive terms and keeps its
    size relative to them whatever τ is (our CPU run: −1 against R̂ ≈ 0.01 taught the policy
    to stop writing, decisions/D003)."""
    return gamma / tau if units == "reward" else gamma


def reward_parts(
    rewards: dict[str, Tensor],
    truncated: Tensor,
    *,
    lambda_consistency: float,
    lambda_hard_negative: float,
    tau: float,
    length_penalty_mode: str = "add",
) -> dict[str, Tensor]:
    """R_final split into additive parts, each (B, K): the three τ-scaled terms of Eq. 8 (zero
    where ``replace`` discarded them) and the length penalty as whatever remains."""
    parts = {
        "contrastive": rewards["contrastive"] / tau,
        "consistency": lambda_consistency * rewards["consistency"] / tau,
        "hard_negative": lambda_hard_negative * rewards["hard_negative"] / tau,
    }
    if length_penalty_mode == "replace":
        kept = ~truncated.bool()
        parts = {name: torch.where(kept, part, 0.0) for name, part in parts.items()}
    parts["length_penalty"] = rewards["final"] - sum(parts.values())
    return parts


def compute_rewards(
    query: Tensor,
    positives: Tensor,
    negatives: Tensor,
    negative_mask: Tensor | None,
    truncated: Tensor,
    *,
    all_queries: Tensor | None = None,
    all_positives: Tensor | None = None,
    own_index: Tensor | None = None,
    mode: str = "paper",
    objective: str = "supervised",
    lambda_consistency: float = 0.2,
    lambda_hard_negative: float = 0.2,
    tau: float = 10.0,
    gamma: float = 1.0,
    length_penalty_mode: str = "add",
    length_penalty_units: str = "scaled",
) -> dict[str, Tensor]:
    """Every reward term for the positive rollouts of a batch, each (B, K).

    ``all_queries`` / ``all_positives`` are the whole batch over processes for the in-batch
    hard negatives (default: this process's). In the unsupervised objective ``query`` is
    the anchor rollout of x and there are no negatives (Eq. 13 replaces Eq. 5).
    """
    all_queries = query if all_queries is None else all_queries
    all_positives = positives if all_positives is None else all_positives
    if objective == "unsupervised":
        alignment = self_alignment_reward(query, positives)
    elif mode == "per_rollout":
        alignment = per_rollout_contrastive_reward(query, positives, negatives, negative_mask)
    else:
        alignment = contrastive_reward(query, positives, negatives, negative_mask)
    if mode == "per_rollout":
        hard = per_rollout_hard_negative_reward(positives, all_queries, own_index)
    else:
        hard = hard_negative_reward(query, all_positives, own_index)
    consistency = consistency_reward(positives)
    total = total_reward(alignment, consistency, hard, lambda_consistency, lambda_hard_negative)
    scaled = scaled_reward(total, tau)
    gamma = penalty_in_scaled_units(gamma, tau, length_penalty_units)
    return {
        "contrastive": alignment,
        "consistency": consistency,
        "hard_negative": hard,
        "total": total,
        "scaled": scaled,
        "length_penalty": length_penalty(truncated, gamma if length_penalty_mode != "off" else 0.0),
        "final": final_reward(scaled, truncated, gamma, length_penalty_mode),
    }
