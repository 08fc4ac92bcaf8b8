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

import contextlib
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from grace_st.runtime.batch import masked_mean, position_ids_from_mask, prompt_pooling_mask
from grace_st.runtime.transformers_compat import cache_kwargs, output_cache


def build_policy_batch(
    prompt_ids: Sequence[Sequence[int]],
    rationale_ids: Sequence[Sequence[int]],
    stop_ids: Sequence[int],
    pad_token_id: int,
    instruction_lengths: Sequence[int] | None = None,
    share_prompts: bool = False,
) -> dict[str, Tensor]:
    """Left-padded prompts ⊕ right-padded completions (rationale, then its EOS when it has one).

    Returns ``input_ids`` and ``attention_mask`` (R, N + G), ``completion_mask`` (R, G) over the
    tokens the policy chose, and ``prompt_width`` N. With ``instruction_lengths`` (L_sys of each
    prompt) also ``pooling_mask`` (R, N + G): the positions Eq. 3 pools in ``encode``, t > L_sys
    and the rationale, never the EOS token nor padding; and ``text_mask`` (R, N): the prompt
    positions whose next token is one of those prompt tokens (the human text and the template after
    it), where :func:`text_kl` holds the LM. With ``share_prompts``, when some rows
    share a prompt (the K rollouts of one positive), also ``prompt_rows`` (U,): the first row of
    each distinct prompt (always given as ``text_rows``, where :func:`text_kl` counts each text
    once), and ``prompt_index`` (R,): each row's entry in it; :func:`policy_pass`
    then runs each distinct prompt once.
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
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "completion_mask": completion_mask,
        "prompt_width": torch.tensor(width),
    }
    if instruction_lengths is not None:
        spans = torch.as_tensor([int(n) for n in instruction_lengths], dtype=torch.long)
        rationale = torch.zeros((rows, generated), dtype=torch.bool)
        for i, ids in enumerate(rationale_ids):
            rationale[i, : len(ids)] = True
        prompt = prompt_pooling_mask(attention_mask[:, :width], spans) & attention_mask[:, :width].bool()
        batch["pooling_mask"] = torch.cat([prompt, rationale], dim=1)
        batch["text_mask"] = torch.zeros_like(prompt)
        batch["text_mask"][:, :-1] = prompt[:, 1:]  # position t predicts token t + 1
    distinct: dict[tuple[int, ...], int] = {}
    index = [distinct.setdefault(tuple(p), len(distinct)) for p in prompt_ids]
    first = {slot: row for row, slot in reversed(list(enumerate(index)))}
    batch["text_rows"] = torch.tensor([first[slot] for slot in range(len(distinct))], dtype=torch.long)
    if share_prompts and len(distinct) < rows:
        batch["prompt_rows"] = batch["text_rows"]
        batch["prompt_index"] = torch.tensor(index, dtype=torch.long)
    return batch


def completion_log_probs(model, batch: dict[str, Tensor], temperature: float = 1.0) -> Tensor:
    """log π_θ of each completion token (R, G), float32, with gradient when enabled.

    The logits are divided by the sampling temperature, so the probabilities are those the
    rollouts were drawn from (and the PPO ratio compares like with like). Only the G + 1 last
    positions' logits are computed: the vocabulary projection dominates memory.
    """
    return policy_pass(model, batch, temperature)[0]


class PolicyPass(NamedTuple):
    """What :func:`policy_pass` computes. ``text_logits`` (U, N, V): the next-token logits at every
    prompt position of each distinct prompt, the batch's ``text_rows`` (only when asked for)."""

    log_probs: Tensor
    pooled: Tensor | None
    text_logits: Tensor | None = None


def policy_pass(
    model, batch: dict[str, Tensor], temperature: float = 1.0, *, pool_from=None, hidden_layer: int = -1,
    text: bool = False,
) -> PolicyPass:
    """One forward pass over ``P(x) ⊕ r ⊕ EOS``: log π_θ of each completion token (R, G), Eq. 3's
    pooled embedding (R, H) or None, and with ``text`` the prompt positions' logits for
    :func:`text_kl` (the same pass: no second forward over the prompts).

    ``pool_from`` is the unwrapped causal LM whose decoder's states are pooled (the call itself
    goes through ``model``, which may be wrapped for DDP/FSDP); pooling needs the batch's
    ``pooling_mask`` and uses ``grace_st.runtime.batch.masked_mean``, the function ``encode`` pools
    with, so the embedding trained here is the one a user gets (tested against the rollout's).
    """
    width = int(batch["prompt_width"])
    generated = batch["input_ids"].shape[1] - width
    captured: dict[str, Tensor] = {}
    hook = contextlib.nullcontext()
    if pool_from is not None and hidden_layer == -1:
        hook = _capture_decoder_output(pool_from, captured)
    wants_states = pool_from is not None and hidden_layer != -1
    text_logits = None
    with hook:
        if "prompt_index" in batch and generated > 0:
            logits, states, text_logits = _shared_prompt_forward(
                model, batch, width, captured, wants_states, hidden_layer, text
            )
        else:
            output = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=position_ids_from_mask(batch["attention_mask"]),
                logits_to_keep=0 if text else generated + 1,  # 0: every position
                use_cache=False,
                output_hidden_states=wants_states,
            )
            logits = output.logits[:, -(generated + 1) : -1, :]
            text_logits = output.logits[batch["text_rows"].to(output.logits.device), :width] if text else None
            states = output.hidden_states[hidden_layer] if wants_states else captured.get("states")
    pooled = None
    if pool_from is not None:
        pooled = masked_mean(states, batch["pooling_mask"].to(states.device))
    if generated == 0:  # every rationale ended at once: no completion token, the text's logits still count
        empty = torch.zeros((batch["input_ids"].shape[0], 0), device=batch["input_ids"].device)
        return PolicyPass(empty, pooled, text_logits)
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    targets = batch["input_ids"][:, width:]
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    return PolicyPass(log_probs, pooled, text_logits)


def text_log_probs(model, batch: dict[str, Tensor]) -> Tensor:
    """log-probabilities of the next token at every prompt position (U, N, V), float32, of each
    distinct prompt (``text_rows``): the reference side of :func:`text_kl` (run it under ``no_grad``)."""
    width = int(batch["prompt_width"])
    rows = batch["text_rows"].to(batch["input_ids"].device)
    mask = batch["attention_mask"][rows, :width]
    output = model(
        input_ids=batch["input_ids"][rows, :width],
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask),
        use_cache=False,
    )
    return torch.log_softmax(output.logits.float(), dim=-1)


def text_kl(logits: Tensor, reference_log_probs: Tensor, text_mask: Tensor, num_positions: float) -> Tensor:
    """KL(π_ref ‖ π_θ) of the next-token distribution, summed over the text positions and divided by
    ``num_positions`` (the whole batch's count, so chunks add up): the LM-hold term (beyond the paper).

    Σ_t Σ_v π_ref(v | x_≤t) · (log π_ref(v | x_≤t) − log π_θ(v | x_≤t)), over every position of the
    human text being embedded, with the full vocabulary: no sampling. Its gradient is that of the
    cross-entropy against the reference's distribution, so it holds what perplexity on human text
    measures, where ``kl_coef`` only holds the tokens the policy writes (decisions/D013).
    logits (U, N, V) of the policy, reference_log_probs (U, N, V), text_mask (U, N): the batch's
    ``text_mask`` at its ``text_rows``.
    """
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    per_position = (reference_log_probs.exp() * (reference_log_probs - log_probs)).sum(-1)
    mask = text_mask.to(per_position.device).float()
    return (per_position * mask).sum() / max(num_positions, 1.0)


def _shared_prompt_forward(
    model, batch: dict[str, Tensor], width: int, captured: dict, wants_states: bool, hidden_layer: int,
    text: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The pass of :func:`policy_pass` with each distinct prompt run once (``prompt_rows``), its
    keys and values expanded to the rows that share it (``prompt_index``), then the completions
    fed on top: (logits of the G completion positions (R, G, V), hidden states (R, N + G, H) or None,
    with ``text`` the distinct prompts' logits at every prompt position (U, N, V), else None).

    The model is causal, so a prompt's states do not depend on the completion after it: this is
    the same computation as the full pass, and the expansion's backward sums the K rollouts'
    gradients through the shared prompt, as K separate copies would. The update pass of the K
    rollouts of a positive thus costs one prompt, not K.
    """
    prompts, index = batch["prompt_rows"].to(batch["input_ids"].device), batch["prompt_index"]
    index = index.to(batch["input_ids"].device)
    mask = batch["attention_mask"]
    positions = position_ids_from_mask(mask)
    head = model(
        input_ids=batch["input_ids"][prompts, :width],
        attention_mask=mask[prompts, :width],
        position_ids=positions[prompts, :width],
        logits_to_keep=0 if text else 1,
        use_cache=True,
        output_hidden_states=wants_states,
    )
    head_states = head.hidden_states[hidden_layer] if wants_states else captured.get("states")
    cache = output_cache(head)
    cache.batch_select_indices(index)
    tail = model(
        input_ids=batch["input_ids"][:, width:],
        attention_mask=mask,
        position_ids=positions[:, width:],
        **cache_kwargs(model, cache),
        logits_to_keep=batch["input_ids"].shape[1] - width,
        use_cache=True,
        output_hidden_states=wants_states,
    )
    tail_states = tail.hidden_states[hidden_layer] if wants_states else captured.get("states")
    logits = torch.cat([head.logits[:, -1:, :].index_select(0, index), tail.logits[:, :-1, :]], dim=1)
    states = None
    if head_states is not None:
        states = torch.cat([head_states.index_select(0, index), tail_states], dim=1)
    return logits, states, head.logits if text else None


@contextlib.contextmanager
def _capture_decoder_output(model, captured: dict):
    """The decoder's final (normed) hidden states, the states ``encode`` pools at hidden_layer -1."""

    def hook(_module, _args, output):
        captured["states"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    handle = model.get_decoder().register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def pooled_contrastive_loss(
    query: Tensor,
    positives: Tensor,
    negatives: Tensor,
    negative_mask: Tensor | None = None,
    *,
    temperature: float = 0.05,
    rows: Tensor | None = None,
) -> Tensor:
    """InfoNCE on pooled embeddings (the hybrid objective, beyond the paper), summed over ``rows``.

    For positive rollout k of instance i the candidates are: d⁺_i(k) (the target), instance i's
    negatives, and every rollout of the other instances' positives (in-batch negatives):

        ℓ(i, k) = − log softmax_c( sim(h_qi, c) / t )[d⁺_i(k)]

    query (B, H), positives (B, K, H), negatives (B, M, H), negative_mask (B, M). ``rows`` (a
    bool (B, K) mask) picks the terms to sum (the chunk whose positives carry gradient);
    default all. Returns the sum, so chunks add up; divide by B·K for the batch mean.
    """
    batch, k, _ = positives.shape
    q = F.normalize(query.float(), dim=-1)
    p = F.normalize(positives.float(), dim=-1)
    own = (q[:, None, :] * p).sum(-1)  # (B, K)
    others = q @ p.reshape(batch * k, -1).T  # (B, B·K)
    owner = torch.arange(batch, device=q.device).repeat_interleave(k)
    others = others.masked_fill(owner[None, :] == torch.arange(batch, device=q.device)[:, None], float("-inf"))
    columns = [others]
    if negatives.shape[1]:
        n = F.normalize(negatives.float(), dim=-1)
        sims = (q[:, None, :] * n).sum(-1)  # (B, M)
        if negative_mask is not None:
            sims = sims.masked_fill(~negative_mask.bool().to(sims.device), float("-inf"))
        columns.append(sims)
    distractors = torch.cat(columns, dim=1) / temperature  # (B, C)
    logits = torch.cat([own[..., None] / temperature, distractors[:, None, :].expand(batch, k, -1)], dim=-1)
    losses = -torch.log_softmax(logits, dim=-1)[..., 0]  # (B, K)
    if rows is not None:
        losses = losses[rows.to(losses.device)]
    return losses.sum()


def graded_contrastive_loss(first: Tensor, second: Tensor, scores: Tensor, *, scale: float = 20.0) -> Tensor:
    """CoSENT on pooled embeddings of scored pairs (the graded term, beyond the paper).

    With c_i = cos(first_i, second_i) and gold scores s_i, every two pairs ranked by their scores
    contribute: ℒ = log(1 + Σ_{s_i > s_j} exp(λ · (c_j − c_i))). Only the order of the scores counts,
    so a pair scored 2 of 5 is pushed to sit below one scored 4 and above one scored 0, where
    InfoNCE on pairs scored ≥ 4 only separates "paraphrase" from "not". first, second (B, H); scores (B,).
    """
    cosines = F.cosine_similarity(first.float(), second.float(), dim=-1) * scale
    differences = cosines[None, :] - cosines[:, None]  # [i, j] = λ (c_j − c_i)
    ranked = scores[:, None].to(cosines.device) > scores[None, :].to(cosines.device)  # s_i > s_j
    terms = torch.cat([differences.new_zeros(1), differences[ranked]])  # the 1 of log(1 + ...)
    return torch.logsumexp(terms, dim=0)


def group_advantages(rewards: Tensor, scale: str = "none", eps: float = 1e-4) -> Tensor:
    """A(k) = R_final(k) − mean_j R_final(j) over the K rollouts of a group (Eq. 10).

    ``scale="none"``: no std division (the paper, its reference code, Dr. GRPO). ``"group"``:
    divided by the group's std (DeepSeek's GRPO), which makes every group's spread 1 however
    small its reward differences are. rewards (B, K) → advantages (B, K).
    """
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "group":
        return centred / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)
    return centred


def advantage_shares(parts: dict[str, Tensor]) -> dict[str, float]:
    """Each reward part's share of the advantage: mean |part − its group mean| over the sum of
    those for all parts. Says which term the policy is actually pushed by (a length penalty
    that drowns the contrastive terms shows up here first). parts: name → (B, K)."""
    spread = {name: (part - part.mean(dim=1, keepdim=True)).abs().mean().item() for name, part in parts.items()}
    total = sum(spread.values())
    return {name: value / total if total > 0 else 0.0 for name, value in spread.items()}


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
