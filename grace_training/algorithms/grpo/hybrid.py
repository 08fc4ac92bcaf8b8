"""The hybrid objective's InfoNCE term (beyond the paper; β · Eq. 3-pooled InfoNCE added to Eq. 11),
and its graded variant for scored pairs (β · CoSENT, :func:`graded_pairs_loss`).

The update pass already runs the policy over ``P(d⁺) ⊕ r`` with gradient for the log-probs;
:func:`hybrid_contrastive_loss` pools those same hidden states and scores them with
:func:`grace_training.algorithms.grpo.loss.pooled_contrastive_loss` against the step's queries, the instances'
negatives and the other instances' positives. Queries and negatives are the rollouts' own
embeddings (``contrastive_anchors: detached``) or pooled again with gradient
(``recompute``, :func:`pooled_with_grad`), or pooled again only where they were embedded from the
prompt alone (``recompute_prompts``: under budgets by prompt type, a retrieval source's documents,
whose prompt-only embedding the rollouts never train otherwise).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grace_st.runtime.model_view import ModelView
from grace_training.algorithms.grpo.loss import (
    build_policy_batch,
    graded_contrastive_loss,
    policy_pass,
    pooled_contrastive_loss,
)
from grace_training.algorithms.grpo.rollout import TripletRollouts
from grace_training.algorithms.grpo.rollout_batch import RolloutBatch
from grace_training.config.train_config import TrainConfig
from grace_training.run.processes import gather


def hybrid_candidates(rollouts: TripletRollouts, num_negatives: int, accelerator) -> tuple[torch.Tensor, ...]:
    """The rollout embeddings the hybrid term scores against: (queries (B, H), positives
    (B, K, H), negatives (B, M, H), negative mask (B, M)) of the global batch, on the device.
    Several processes: gathered, in process order."""
    grouped = rollouts.grouped(num_negatives)[:4]
    return tuple(gather(accelerator, t).to(accelerator.device) for t in grouped)


def pooled_with_grad(
    policy_wrapped,
    policy,
    parts: tuple[RolloutBatch, ...],
    view: ModelView,
    device,
    prompts_only: bool = False,
) -> torch.Tensor:
    """Eq. 3 embeddings of rollouts (queries, negatives) recomputed with gradient, in one pass, in order.

    ``prompts_only``: only the rows embedded from their prompt alone (budget 0) are recomputed; the
    others keep their rollout embedding (no gradient). One pass is still run when no row qualifies
    (over the first row, unused): under DDP or FSDP every process must run as many forwards.
    """
    rows = [(part, i) for part in parts for i in range(len(part))]
    chosen = list(range(len(rows)))
    if prompts_only:
        chosen = [n for n, (part, i) in enumerate(rows) if part.budgets and part.budgets[i] == 0]
    selected = [rows[n] for n in (chosen or [0])]
    batch = build_policy_batch(
        [part.prompt_ids[i] for part, i in selected],
        [part.rationale_ids[i] for part, i in selected],
        [part.stop_ids[i] for part, i in selected],
        view.pad_token_id,
        [part.instruction_lengths[i] for part, i in selected],
    )
    batch = {k: v.to(device) for k, v in batch.items()}
    # the temperature scales log-probs only, which are not used here
    temperature = parts[0].temperature
    fresh = policy_pass(policy_wrapped, batch, temperature, pool_from=policy, hidden_layer=view.hidden_layer)[1]
    if not prompts_only:
        return fresh
    kept = torch.cat([part.embeddings for part in parts]).to(device=device, dtype=fresh.dtype)
    if not chosen:
        return kept + 0.0 * fresh.sum()  # the pass joins the graph; nothing of it counts
    return kept.index_copy(0, torch.tensor(chosen, device=device), fresh)


def hybrid_contrastive_loss(
    candidates: tuple[torch.Tensor, ...],
    rollouts: TripletRollouts,
    chunk: list[int],
    pooled: torch.Tensor,
    config: TrainConfig,
    process_index: int,
    recompute_anchors: Callable[[], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The hybrid term for one chunk of positive rows (summed; the caller divides by B·K).

    ``pooled`` are the chunk's positives pooled with gradient; every other embedding is the
    rollout's from ``candidates`` (:func:`hybrid_candidates`: Eq. 3 under no_grad, the same
    value before the optimiser step), except this process's queries and negatives when
    ``recompute_anchors`` is given (``contrastive_anchors: recompute``): it returns them pooled
    with gradient, queries first (:func:`pooled_with_grad`).
    """
    query, positives, negatives, mask = candidates
    device = pooled.device
    local, k = len(rollouts.queries), rollouts.num_rollouts
    # Several processes: this process's rows sit at its offset and carry gradient; the
    # others' act as another chunk's would (no gradient).
    offset = process_index * local
    batch = positives.shape[0]
    index = torch.tensor([offset * k + row for row in chunk], device=device)
    flat = positives.reshape(batch * k, -1).to(dtype=pooled.dtype).index_copy(0, index, pooled)
    selected = torch.zeros(batch * k, dtype=torch.bool, device=device)
    selected[index] = True
    if recompute_anchors is not None:
        # One forward for queries and negatives: every process runs the same number of passes
        # (each DDP or FSDP forward is a collective), whether or not its instances have negatives.
        fresh = recompute_anchors()
        mine = torch.arange(offset, offset + local, device=device)
        query = query.to(pooled.dtype).index_copy(0, mine, fresh[:local])
        fresh = fresh[local:]
        slots = rollouts.negative_slots(config.num_negatives)
        if slots:
            rows = [row for row, _, _ in slots]
            targets = [(offset + owner) * config.num_negatives + slot for _, owner, slot in slots]
            targets = torch.tensor(targets, device=device)
            negatives = negatives.reshape(batch * config.num_negatives, -1).to(fresh.dtype)
            negatives = negatives.index_copy(0, targets, fresh[rows])
            negatives = negatives.reshape(batch, config.num_negatives, -1)
    return pooled_contrastive_loss(
        query,
        flat.reshape(batch, k, -1),
        negatives,
        mask,
        temperature=config.contrastive_temperature,
        rows=selected.reshape(batch, k),
    )


def graded_pairs_loss(
    candidates: tuple[torch.Tensor, ...],
    rollouts: TripletRollouts,
    chunk: list[int],
    pooled: torch.Tensor,
    scores: torch.Tensor,
    config: TrainConfig,
    process_index: int,
) -> torch.Tensor:
    """β · CoSENT's loss for one chunk of a batch of scored pairs (one greedy rollout a text, K = 1).

    The pairs are (query, positive) of the global batch, ``scores`` their gold similarities. The
    chunk's positives are ``pooled`` (with gradient); every other embedding is the rollout's, which
    the update pass reproduces (the weights have not moved yet), so the chunks' gradients add up to
    the whole batch's. The value returned is the loss weighted by the chunk's share of the rows, so
    the chunks' values also add up to the batch's loss.
    """
    query, positives = candidates[0], candidates[1]
    if rollouts.num_rollouts != 1:
        raise ValueError(f"graded pairs are rolled out once a text, got K = {rollouts.num_rollouts}")
    offset = process_index * len(rollouts.queries)
    index = torch.tensor([offset + row for row in chunk], device=pooled.device)
    second = positives[:, 0].to(dtype=pooled.dtype).index_copy(0, index, pooled)
    loss = graded_contrastive_loss(query.to(pooled.dtype), second, scores, scale=config.graded_scale)
    share = len(chunk) / len(rollouts.positives)
    # the full gradient for the chunk's rows, the chunk's share of the value
    return loss + (share - 1.0) * loss.detach()
