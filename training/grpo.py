"""Group-relative advantages and the policy-gradient loss (method.md §2, Eqs. 10–11).

The policy's action for a positive rollout is its rationale followed by the EOS token that
ended it: stopping was a choice, so the EOS token's log-probability is part of
log π_θ(y | P(d⁺)). A rollout cut at the length limit has no EOS and is scored without one.

Batches are laid out as the generation code lays them out: the prompt left-padded to a
common width N, the completion (rationale ⊕ EOS) right-padded after it. Position ids come
from the attention mask (``cumsum − 1``), so a left-padded row sees the positions an
unpadded one would.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions for a left-padded batch: 0 at each row's first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def build_policy_batch(
    prompt_ids: Sequence[Sequence[int]],
    rationale_ids: Sequence[Sequence[int]],
    stop_ids: Sequence[int],
    pad_token_id: int,
) -> dict[str, Tensor]:
    """Left-padded prompts ⊕ right-padded completions (rationale, then its EOS when it has one).

    Returns ``input_ids`` and ``attention_mask`` (R, N + G), ``completion_mask`` (R, G) over the
    tokens the policy chose, and ``prompt_width`` N.
    """
    rows = len(prompt_ids)
    width = max((len(p) for p in prompt_ids), default=0)
    completions = [[*r, s] if s >= 0 else list(r) for r, s in zip(rationale_ids, stop_ids)]
    generated = max((len(c) for c in completions), default=0)
    input_ids = torch.full((rows, width + generated), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, width + generated), dtype=torch.long)
    completion_mask = torch.zeros((rows, generated), dtype=torch.bool)
    for i, (prompt, completion) in enumerate(zip(prompt_ids, completions)):
        start = width - len(prompt)
        input_ids[i, start:width] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[i, start:width] = 1
        if completion:
            input_ids[i, width : width + len(completion)] = torch.tensor(completion, dtype=torch.long)
            attention_mask[i, width : width + len(completion)] = 1
            completion_mask[i, : len(completion)] = True
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "completion_mask": completion_mask,
        "prompt_width": torch.tensor(width),
    }


def completion_log_probs(model, batch: dict[str, Tensor], temperature: float = 1.0) -> Tensor:
    """log π_θ of each completion token (R, G), float32, with gradient when enabled.

    The logits are divided by the sampling temperature, so the probabilities are those the
    rollouts were drawn from (and the PPO ratio compares like with like). Only the G + 1 last
    positions' logits are computed: the vocabulary projection dominates memory.
    """
    width = int(batch["prompt_width"])
    generated = batch["input_ids"].shape[1] - width
    if generated == 0:
        return torch.zeros((batch["input_ids"].shape[0], 0), device=batch["input_ids"].device)
    output = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=position_ids_from_mask(batch["attention_mask"]),
        logits_to_keep=generated + 1,
        use_cache=False,
    )
    logits = output.logits[:, :-1, :].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    targets = batch["input_ids"][:, width:]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def group_advantages(rewards: Tensor) -> Tensor:
    """A(k) = R_final(k) − mean_j R_final(j) over the K rollouts of a group; no std division (Eq. 10).

    rewards (B, K) → advantages (B, K).
    """
    return rewards - rewards.mean(dim=1, keepdim=True)


def grpo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    clip_epsilon: float = 0.2,
    ref_log_probs: Tensor | None = None,
    kl_coef: float = 0.0,
    num_tokens: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """L = − Σ_k Σ_t A(k) · log π_θ(y_t^k | P(d⁺), y_<t^k) / T   (Eq. 11), token-level aggregation.

    Written in the PPO-clipped form: ρ = π_θ / π_old, per token −min(ρ A, clip(ρ, 1 ± ε) A).
    On-policy (one pass over the batch) ``old_log_probs`` is ``log_probs.detach()``: ρ ≡ 1,
    nothing is clipped, and the gradient is exactly that of Eq. 11. With several passes,
    ``old_log_probs`` are those of the policy that sampled the rollouts.

    T, the token count, is the whole batch's (``num_tokens``), so chunks of one batch
    accumulate to the loss of the batch: longer rationales do not get less weight per token.
    Optional KL to the initial policy: k3 estimator exp(r) − r − 1, r = log π_ref − log π_θ.
    """
    mask = completion_mask.float()
    tokens = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=mask.dtype)
    tokens = tokens.clamp(min=1.0)
    ratio = torch.exp(log_probs - old_log_probs)
    advantage = advantages[:, None].to(log_probs.dtype)
    unclipped = ratio * advantage
    clipped = ratio.clamp(1.0 - clip_epsilon, 1.0 + clip_epsilon) * advantage
    per_token = -torch.minimum(unclipped, clipped)
    # the clip is active (and the token's gradient zero) where the clipped term is the smaller
    stats = {"clip_fraction": ((clipped < unclipped).float() * mask).sum() / mask.sum().clamp(min=1.0)}
    if ref_log_probs is not None and kl_coef > 0:
        log_ratio = ref_log_probs - log_probs
        kl = torch.exp(log_ratio) - log_ratio - 1.0
        per_token = per_token + kl_coef * kl
        stats["kl"] = (kl.detach() * mask).sum() / mask.sum().clamp(min=1.0)
    loss = (per_token * mask).sum() / tokens
    return loss, stats
