"""Rationales and their hidden states in one pass (method.md §1, Eqs. 1–2).

The policy is causal, so the hidden state of position t depends on tokens ≤ t only: the
states computed while a rationale is generated are exactly the states of Eq. 2 over
``P(x) ⊕ r``. :func:`generate_rollouts` keeps them as it decodes, so no second forward
pass over prompt + rationale is needed. :func:`grace_st.second_pass.two_pass_reference` is
that second pass (generate, re-encode, pool), kept as the yardstick for tests and benchmarks.
How the policy is fed (KV cache, shared prefix, packed kernels) is :mod:`grace_st.decoding`'s
business; this module is the method.

Pooled positions: the user text and template suffix (t > L_sys) and every rationale token
before the end-of-sequence token. The EOS token and anything after it, and padding, are
not pooled. A rationale cut at the length limit has its last token fed once more so its
state exists; that token is pooled like the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .decoding import DecodeOptions, incremental_decoder


class Rationales(NamedTuple):
    """The rationale contract: what every generator gives, one row a prompt, in order. The HF
    one-pass rollout (:meth:`Rollouts.rationales`) and vLLM
    (:meth:`grace_st.vllm_backend.VLLMRationaleGenerator.generate`) both return it, and encode and
    training read it the same way whichever made it."""

    rationale_ids: list[list[int]]  # the rationale r (Eq. 1), its EOS excluded
    stop_ids: list[int]  # the EOS id that ended it (part of the action scored in Eq. 11); -1 if none
    truncated: list[bool]  # hit the length limit without an EOS (Eq. 28)


@dataclass
class Rollouts:
    """Generated rationales with the hidden states of ``P(x) ⊕ r``.

    The prompt part is left-padded, the rationale part right-padded: column ``N + k`` holds
    rationale token ``k`` of every row.
    """

    attention_mask: Tensor  # (B, N + G) 1 on real tokens, EOS excluded
    pooling_mask: Tensor  # (B, N + G) 1 where Eq. 3 pools: t > L_sys, before EOS, not padding
    token_embeddings: Tensor  # (B, N + G, H) hidden states of the chosen layer
    rationale_ids: Tensor  # (B, G) rationale token ids, -1 after the rationale ends
    truncated: Tensor  # (B,) hit the length limit without EOS (Eq. 28's length penalty)
    stop_ids: Tensor  # (B,) the EOS token that ended each rationale, -1 where none did

    def rationales(self) -> Rationales:
        """The rationales alone, in the contract every generator meets."""
        ids = [[t for t in row if t >= 0] for row in self.rationale_ids.tolist()]
        return Rationales(ids, [int(t) for t in self.stop_ids.tolist()], [bool(t) for t in self.truncated.tolist()])


def left_pad(rows: Sequence[Sequence[int]], pad_token_id: int) -> tuple[Tensor, Tensor]:
    width = max((len(row) for row in rows), default=0)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, width - len(row) :] = 1
    return input_ids, attention_mask


def pad_rationales(groups: list[list[list[int]]], repeats: int) -> Tensor:
    """(texts, repeats, longest) rationale ids, -1 after each rationale's end."""
    width = max((len(ids) for group in groups for ids in group), default=0)
    padded = torch.full((len(groups), repeats, width), -1, dtype=torch.long)
    for i, group in enumerate(groups):
        for k, ids in enumerate(group):
            padded[i, k, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return padded


def prompt_pooling_mask(attention_mask: Tensor, instruction_lengths: Tensor) -> Tensor:
    """Positions t > L_sys of each left-padded prompt (Eq. 3)."""
    width = attention_mask.shape[1]
    first_pooled = (width - attention_mask.sum(1)) + instruction_lengths
    return torch.arange(width, device=attention_mask.device)[None, :] >= first_pooled[:, None]


def per_row(value: float | Sequence[float], rows: int, name: str = "temperatures") -> list[float]:
    """One value for every row, or one a row (checked: as many as rows, each >= 0)."""
    values = [float(value)] * rows if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != rows:
        raise ValueError(f"{len(values)} {name} for {rows} prompts")
    if any(not v >= 0 for v in values):
        raise ValueError(f"{name} must be >= 0, got {values}")
    return values


def inverse_cdf_draw(probs: Tensor, uniforms: Tensor) -> Tensor:
    """One token a row from (unnormalised) ``probs`` (rows, V), given one uniform in [0, 1) a row:
    the first token whose cumulative mass exceeds the uniform times the row's total.

    Exact sampling from ``probs`` with one random number a row. ``torch.multinomial`` draws one
    exponential per vocabulary entry (49,152 a row a token for SmolLM2: 8 % of a training step's
    rollouts, lab/training_recipe.md); this is a cumulative sum and a binary search. In float64 so that
    a token's interval is its probability to about 1e-16 and a zero-probability token (cut by
    top-p) has an empty interval, never drawn.
    """
    cdf = probs.double().cumsum(-1)
    target = uniforms.double().to(cdf.device)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def _sample(
    logits: Tensor, temperature: Tensor, top_p: float, generators: list[torch.Generator] | None, inverse_cdf: bool = True
) -> Tensor:
    """One token a row: sampled at the row's ``temperature`` (rows,), greedy where it is 0."""
    greedy = temperature <= 0
    probs = torch.softmax(logits.float() / temperature.masked_fill(greedy, 1.0)[:, None], dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token always survives)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    if not inverse_cdf and generators is None:
        sampled = torch.multinomial(probs, 1).squeeze(-1)
    elif not inverse_cdf:
        rows = [torch.multinomial(row.cpu(), 1, generator=gen).squeeze(-1) for row, gen in zip(probs, generators)]
        sampled = torch.stack(rows).to(logits.device)
    elif generators is None:
        sampled = inverse_cdf_draw(probs, torch.rand(len(probs), dtype=torch.float64))
    else:
        # One generator a row: a text's rationale does not depend on what it was batched with.
        sampled = inverse_cdf_draw(probs, torch.stack([torch.rand((), dtype=torch.float64, generator=g) for g in generators]))
    return torch.where(greedy, logits.argmax(-1), sampled) if greedy.any() else sampled


def _choose(
    logits: Tensor, rows: Tensor, do_sample: bool, temperatures: Tensor, top_p: float, generators, inverse_cdf: bool
) -> Tensor:
    """Eq. 1 for the rows still fed: r_k ~ pi(. | P(x) + r_<k), or the argmax when greedy."""
    if not do_sample:
        return logits.argmax(-1)
    row_generators = None if generators is None else [generators[i] for i in rows.tolist()]
    return _sample(logits, temperatures[rows], top_p, row_generators, inverse_cdf)


def penalise_repeats(logits: Tensor, written: Tensor | None, penalty: float) -> Tensor:
    """CTRL's repetition penalty (Keskar et al., 2019; transformers' ``repetition_penalty``) over the
    rationale's own tokens: where a row has already written a token (``written``, (rows, V) bool), its
    logit is divided by ``penalty`` when positive and multiplied when negative, so the token is less
    likely again. The text's own tokens are not penalised: a rationale about a text may name it.

    Why: training teaches the policy to repeat the text's topic word ("combat combat combat", the
    distinct-word share of a rationale falls from 0.78 to 0.55, lab/training_recipe.md §20); the penalty keeps a
    rationale readable for ``explain``."""
    if written is None or penalty == 1.0:
        return logits
    # Only the written entries change (a rationale's few dozen of 49,152 a row): penalising those alone
    # is the same arithmetic at 1/3 to 1/8 of the cost of the full-vocabulary passes (lab/latency_study.md).
    rows, tokens = written.nonzero(as_tuple=True)
    seen = logits[rows, tokens]
    return logits.index_put((rows, tokens), torch.where(seen > 0, seen / penalty, seen * penalty))


def _written(rows: int, logits: Tensor | None, penalty: float) -> Tensor | None:
    """Which tokens each row's rationale has written so far, (rows, V) bool: None without a penalty, or
    without logits (a budget of 0 writes nothing)."""
    if penalty == 1.0 or logits is None:
        return None
    return torch.zeros((rows, logits.shape[-1]), dtype=torch.bool, device=logits.device)


def _sampling(eos_token_ids, temperature, rows: int, do_sample: bool, seeds, device):
    """What Eq. 1's draws need, a row at a time: the stop ids, each row's temperature, and one
    generator a row when seeded (so a row's rationale does not depend on its batch)."""
    eos = torch.tensor(sorted(set(eos_token_ids)), device=device)
    temperatures = torch.tensor(per_row(temperature, rows), dtype=torch.float32, device=device)
    generators = [torch.Generator().manual_seed(int(s)) for s in seeds] if do_sample and seeds is not None else None
    return eos, temperatures, generators


@torch.no_grad()
def generate_rollouts(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    instruction_lengths: Tensor,
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    do_sample: bool = False,
    temperature: float | Sequence[float] = 1.0,
    top_p: float = 1.0,
    seeds: Sequence[int] | None = None,
    repetition_penalty: float = 1.0,
    hidden_layer: int = -1,
    options: DecodeOptions | None = None,
) -> Rollouts:
    """A rationale for each left-padded prompt, its hidden states (Eqs. 1–2) and the positions Eq. 3 pools.

    Greedy unless ``do_sample``; ``temperature`` is one for every row or one a row (0: greedy), so a
    training step's queries, negatives and positives share one call; ``seeds`` (one a row) make
    sampling reproducible per text; ``repetition_penalty`` (1: none) makes a token the row's
    rationale already holds less likely (:func:`penalise_repeats`). ``options``: the decoding optimisations
    (:class:`grace_st.decoding.DecodeOptions`, all on by default; they change only rounding)."""
    device, batch = input_ids.device, input_ids.shape[0]
    eos, temperatures, generators = _sampling(eos_token_ids, temperature, batch, do_sample, seeds, device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    stop_ids = torch.full((batch,), -1, dtype=torch.long, device=device)
    tokens: list[Tensor] = []  # one (B,) column a step: the rationale token, -1 once the row's rationale ended
    pooled = [prompt_pooling_mask(attention_mask, instruction_lengths.to(device))]  # Eq. 3: t > L_sys

    with incremental_decoder(model, hidden_layer, options) as decoder:
        states, logits = decoder.prefill(input_ids, attention_mask, instruction_lengths, max_new_tokens)
        inverse_cdf = decoder.options.inverse_cdf_sampling
        written = _written(batch, logits, repetition_penalty)
        all_states = [states]  # Eq. 2 over P(x)
        for _ in range(max_new_tokens):
            rows = decoder.rows  # the rows still fed; logits are theirs
            if written is not None:
                logits = penalise_repeats(logits, written[rows], repetition_penalty)
            token = _choose(logits, rows, do_sample, temperatures, top_p, generators, inverse_cdf)  # Eq. 1
            stopping = ~finished[rows] & torch.isin(token, eos)
            stop_ids[rows[stopping]] = token[stopping]
            finished[rows[stopping]] = True
            if finished.all():
                break
            alive = ~finished[rows]
            step_tokens = torch.full((batch,), -1, dtype=torch.long, device=device)
            step_tokens[rows[alive]] = token[alive]
            if written is not None:
                written[rows[alive], token[alive]] = True
            tokens.append(step_tokens)
            states, logits = decoder.step(token, alive, pad_token_id)
            all_states.append(states)  # Eq. 2 over r_k, pooled where the rationale goes on
            pooled.append((step_tokens >= 0)[:, None])

    rationale_ids = torch.stack(tokens, 1) if tokens else torch.empty((batch, 0), dtype=torch.long, device=device)
    return Rollouts(
        attention_mask=torch.cat([attention_mask, (rationale_ids >= 0).long()], 1),
        pooling_mask=torch.cat(pooled, 1),
        token_embeddings=torch.cat(all_states, 1),
        rationale_ids=rationale_ids,
        truncated=~finished if max_new_tokens > 0 else torch.zeros_like(finished),
        stop_ids=stop_ids,
    )


@torch.no_grad()
def stream_rollouts(
    model,
    prompt_ids: Sequence[Sequence[int]],
    instruction_lengths: Sequence[int],
    *,
    slots: int,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    do_sample: bool = False,
    temperature: float | Sequence[float] = 1.0,
    top_p: float = 1.0,
    seeds: Sequence[int] | None = None,
    repetition_penalty: float = 1.0,
    hidden_layer: int = -1,
    options: DecodeOptions | None = None,
    device: torch.device | str = "cpu",
) -> Rollouts:
    """:func:`generate_rollouts` for many prompts through ``slots`` rows decoded at once (continuous
    batching): when a row's rationale ends (EOS or the budget), its slot takes the next prompt, so
    every step feeds a full batch until the prompts run out. The same rollouts as one call over all
    rows (each row decodes from its own prompt, at its own positions, with its own seed; only float
    rounding can differ, and sampling without ``seeds`` draws from torch's global generator in another
    order), returned in the order given, prompts left-padded to the longest.

    Prompts enter longest first: a later prompt then always fits the columns the cache already
    has. New prompts are prefilled once an eighth of the slots (at least one) are free, or all are.
    """
    rows = len(prompt_ids)
    eos, temperatures, generators = _sampling(eos_token_ids, temperature, rows, do_sample, seeds, device)
    queue = sorted(range(rows), key=lambda i: len(prompt_ids[i]))  # pop() takes the longest waiting
    slots = min(slots, rows)
    text_of = torch.zeros(slots, dtype=torch.long, device=device)  # the prompt each slot decodes
    done = torch.ones(slots, dtype=torch.bool, device=device)  # its rationale ended (or it holds none yet)
    length = torch.zeros(rows, dtype=torch.long, device=device)  # rationale tokens fed so far, by prompt
    stop_ids = torch.full((rows,), -1, dtype=torch.long, device=device)
    prompts: list[tuple[Tensor, Tensor]] = []  # each admission's prompts and their (left-padded) states
    fed: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []  # each step's (prompts, positions, tokens, states)

    with incremental_decoder(model, hidden_layer, options) as decoder:
        inverse_cdf = decoder.options.inverse_cdf_sampling
        logits = None
        written = None  # by slot, cleared when the slot takes a new prompt
        while True:
            if queue and (int(done.sum()) >= max(1, slots // 8) or bool(done.all())):
                free = done.nonzero().squeeze(1)[: len(queue)]
                texts = torch.tensor([queue.pop() for _ in range(len(free))], dtype=torch.long, device=device)
                input_ids, attention_mask = left_pad([prompt_ids[i] for i in texts.tolist()], pad_token_id)
                states, new_logits = decoder.admit(
                    free, input_ids.to(device), attention_mask.to(device),
                    torch.tensor([instruction_lengths[i] for i in texts.tolist()], device=device), slots, max_new_tokens,
                )
                prompts.append((texts, states))
                text_of[free], done[free] = texts, False
                logits = new_logits if logits is None else logits.index_copy(0, free, new_logits)
                written = _written(slots, logits, repetition_penalty) if written is None else written.index_fill_(0, free, False)
            if bool(done.all()):
                break
            slot_rows = decoder.rows  # the slots fed; logits are theirs
            texts = text_of[slot_rows]
            if written is not None:
                logits = penalise_repeats(logits, written[slot_rows], repetition_penalty)
            token = _choose(logits, texts, do_sample, temperatures, top_p, generators, inverse_cdf)  # Eq. 1
            live = ~done[slot_rows]
            stopping = live & torch.isin(token, eos)
            stop_ids[texts[stopping]] = token[stopping]
            alive = live & ~stopping
            done[slot_rows[stopping]] = True
            decoder.release(slot_rows[stopping])
            if not alive.any():
                continue
            states, logits = decoder.step(token, alive, pad_token_id, keep_rows=bool(queue))
            fed_slots = slot_rows[alive]
            if written is not None:
                written[fed_slots, token[alive]] = True
            fed_texts = text_of[fed_slots]
            fed.append((fed_texts, length[fed_texts], token[alive], states[fed_slots, 0]))  # Eq. 2 over r_k
            length[fed_texts] += 1
            ended = fed_slots[length[fed_texts] >= max_new_tokens]
            done[ended] = True
            decoder.release(ended)

    return _assemble(prompt_ids, instruction_lengths, prompts, fed, length, stop_ids, max_new_tokens, device)


def _assemble(prompt_ids, instruction_lengths, prompts, fed, length, stop_ids, max_new_tokens, device) -> Rollouts:
    """:func:`stream_rollouts`' pieces as :class:`Rollouts` in request order: prompts left-padded to
    the longest, rationales right-padded to the longest."""
    rows, width = len(prompt_ids), max(len(p) for p in prompt_ids)
    generated = int(length.max()) if rows else 0
    hidden = prompts[0][1].shape[-1]
    token_embeddings = torch.zeros((rows, width + generated, hidden), dtype=prompts[0][1].dtype, device=device)
    for texts, states in prompts:  # left-padded to their own widest: right-aligned with the rest
        token_embeddings[texts, width - states.shape[1] : width] = states
    rationale_ids = torch.full((rows, generated), -1, dtype=torch.long, device=device)
    for texts, positions, tokens, states in fed:
        token_embeddings[texts, width + positions] = states
        rationale_ids[texts, positions] = tokens
    _, prompt_mask = left_pad(prompt_ids, 0)
    prompt_mask = prompt_mask.to(device)
    attention_mask = torch.cat([prompt_mask, (rationale_ids >= 0).long()], 1)
    pooling_mask = torch.cat(
        [prompt_pooling_mask(prompt_mask, torch.tensor(list(instruction_lengths), device=device)), rationale_ids >= 0], 1
    )
    return Rollouts(
        attention_mask=attention_mask,
        pooling_mask=pooling_mask,
        token_embeddings=token_embeddings,
        rationale_ids=rationale_ids,
        truncated=(stop_ids < 0) & (length >= max_new_tokens),
        stop_ids=stop_ids,
    )
