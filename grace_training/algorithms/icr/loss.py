"""GIRCSE training: Iterative Contrastive Refinement (``gircse.md``, Eqs. 7–8) on soft-token embeddings.

A soft token is the LM head's whole distribution fed back as an input embedding
(:mod:`grace_st.methods.gircse`), so the K steps are differentiable and the embeddings train with a
contrastive loss directly: no rollouts, no rewards, no policy term. Every step k is trained:

    L = 1/K Σ_k L_k  +  λ · 1/(K−1) Σ_{k<K} max(log L_{k+1} − log L_k, 0)          (Eqs. 7, 8)

with L_k InfoNCE of each query's z_k (the mean of its first k generated states) against every
positive's and hard negative's z_k in the batch, cosine over τ. Eq. 7 is written as a sum; the
mean over k here (as the reference code has it) keeps the gradient's scale when K changes.
A batch of scored pairs (an ``sts`` source) takes CoSENT at each step instead of InfoNCE
(:func:`grace_training.algorithms.grpo.loss.graded_contrastive_loss`, as GRACE's graded term).

The embeddings come from :meth:`grace_st.methods.SoftTokenEngine.step_embeddings`, the computation
``encode`` returns the last row of: what is trained is what a user gets. A side whose prompt type
has fewer steps (a budget of 0 for documents: the prompt alone) keeps its last embedding for the
steps it lacks, so the stepwise loss refines the side that thinks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from grace_st.runtime.batch import left_pad
from grace_st.settings import for_prompt_type
from grace_training.algorithms.grpo.loss import graded_contrastive_loss
from grace_training.data.examples import Triplet
from grace_training.run.processes import gather_rows_with_grad, gather_with_grad, sum_with_grad


def stepwise_infonce(
    query: Tensor, positives: Tensor, negatives: Tensor | None = None, *, temperature: float = 0.02,
    offset: int = 0, reduction: str = "mean",
) -> Tensor:
    """L_k for k = 1..K (Eq. 7's terms), (K,): InfoNCE of query i's z_k against every positive's z_k
    (its own the target, the others in-batch negatives) and every hard negative's z_k in the batch,
    mean (or ``reduction="sum"``) over the B queries. query (B, K, H); positives (P, K, H), query i's
    own at row ``offset + i`` (P = B in one process; the global batch's, gathered, in several);
    negatives (M, K, H) or None."""
    batch, steps, _ = query.shape
    candidates = positives if negatives is None or not len(negatives) else torch.cat([positives, negatives])
    q = F.normalize(query.float(), dim=-1)
    c = F.normalize(candidates.float(), dim=-1)
    scores = torch.einsum("bkh,ckh->kbc", q, c) / temperature  # (K, B, C)
    targets = (torch.arange(batch, device=scores.device) + offset).repeat(steps)
    losses = F.cross_entropy(scores.reshape(steps * batch, -1), targets, reduction="none").view(steps, batch)
    return losses.sum(dim=1) if reduction == "sum" else losses.mean(dim=1)


def stepwise_cosent(first: Tensor, second: Tensor, scores: Tensor, *, scale: float = 20.0) -> Tensor:
    """L_k for k = 1..K on scored pairs, (K,): CoSENT of the pairs' z_k cosines against their gold scores."""
    return torch.stack(
        [graded_contrastive_loss(first[:, k], second[:, k], scores, scale=scale) for k in range(first.shape[1])]
    )


def refinement_loss(step_losses: Tensor, lambda_: float, eps: float = 1e-8) -> tuple[Tensor, Tensor, Tensor]:
    """Eq. 7 (mean over k) + λ · Eq. 8: (total, contrastive part, refinement penalty). Eq. 8 is zero when
    every step's loss is at most the step before's; it is 0 for K = 1."""
    contrastive = step_losses.mean()
    if step_losses.numel() < 2:
        penalty = step_losses.new_zeros(())
    else:
        logs = torch.log(step_losses + eps)
        penalty = torch.relu(logs[1:] - logs[:-1]).mean()
    return contrastive + lambda_ * penalty, contrastive, penalty


def triplet_sides(
    triplets: Sequence[Triplet], num_negatives: int, query_task: str | None, document_task: str | None
) -> tuple[tuple[list[str], str | None], tuple[list[str], str | None], tuple[list[str], str | None]]:
    """(texts, prompt type) of the batch's queries, positives and hard negatives (up to ``num_negatives``
    each): a symmetric source's texts are all of the ``"default"`` type, as ``encode`` embeds them."""
    symmetric = all(t.symmetric for t in triplets)
    if any(t.symmetric for t in triplets) and not symmetric:
        raise ValueError("a GIRCSE batch mixes symmetric and retrieval triplets: use batch_sampling: by_source")
    query_task, document_task = ("default", "default") if symmetric else (query_task, document_task)
    negatives = [n for t in triplets for n in t.negatives[:num_negatives]]
    return (
        ([t.query for t in triplets], query_task),
        ([t.positive for t in triplets], document_task),
        (negatives, document_task),
    )


def side_embeddings(encoder, texts: Sequence[str], task: str | None, steps: int, device) -> Tensor:
    """z_1..z_S of ``texts`` at their prompt type's K (S = max(K, 1)), with gradient, (N, S, H): the
    soft-token steps, or for K = 0 the prompt pooled after L_sys (one 'step')."""
    rows, span = encoder.prompt_token_ids(list(texts), task=task)
    input_ids, attention_mask = left_pad(rows, encoder.pad_token_id)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    engine = encoder.engine
    if steps == 0:
        spans = torch.full((len(rows),), span, dtype=torch.long, device=device)
        return engine.embed_prompts(input_ids, attention_mask, spans)[0].float()[:, None, :]
    return engine.step_embeddings(input_ids, attention_mask, steps)


def held_to(steps: Tensor, total: int) -> Tensor:
    """(N, S, H) → (N, total, H): a side with fewer steps keeps its last embedding for the rest."""
    if steps.shape[1] >= total:
        return steps
    return torch.cat([steps, steps[:, -1:].expand(-1, total - steps.shape[1], -1)], dim=1)


def icr_batch_loss(
    encoder, triplets: Sequence[Triplet], config, scores: Tensor | None, device, accelerator=None
) -> dict[str, Tensor]:
    """One batch's Eqs. 7–8 with gradient: ``loss``, ``contrastive``, ``refinement`` and ``step_losses`` (K,).

    With several processes (``accelerator``), ``triplets`` is this process's share and the loss is the
    global batch's on every process: positives and hard negatives are gathered with gradient (every
    query meets the whole batch's candidates), each L_k is the sum over all queries over the global
    count (Eq. 8's logarithm needs the global L_k), and scored pairs are gathered whole for CoSENT. Each
    process's embeddings then get every process's share of the gradient, times the process count, which
    the trainer's mean over processes takes back out."""
    (queries, q_task), (positives, d_task), (negatives, n_task) = triplet_sides(
        triplets, config.num_negatives, config.query_task, config.document_task
    )
    budgets = encoder.max_rationale_tokens
    k_query, k_document = for_prompt_type(budgets, q_task or "default"), for_prompt_type(budgets, d_task or "default")
    total = max(k_query, k_document, 1)
    query = held_to(side_embeddings(encoder, queries, q_task, k_query, device), total)
    positive = held_to(side_embeddings(encoder, positives, d_task, k_document, device), total)
    world, rank = (1, 0) if accelerator is None else (accelerator.num_processes, accelerator.process_index)
    if scores is not None:
        first, second = gather_with_grad(accelerator, query), gather_with_grad(accelerator, positive)
        step_losses = stepwise_cosent(first, second, scores.to(device), scale=config.graded_scale)
    else:
        negative = query.new_zeros((0, *query.shape[1:]))
        if negatives:
            negative = held_to(side_embeddings(encoder, negatives, n_task, k_document, device), total)
        sums = stepwise_infonce(
            query, gather_with_grad(accelerator, positive), gather_rows_with_grad(accelerator, negative),
            temperature=config.icr_temperature, offset=rank * len(queries), reduction="sum",
        )
        step_losses = sum_with_grad(accelerator, sums) / (len(queries) * world)
    loss, contrastive, penalty = refinement_loss(step_losses, config.icr_lambda)
    return {"loss": loss, "contrastive": contrastive, "refinement": penalty, "step_losses": step_losses}
