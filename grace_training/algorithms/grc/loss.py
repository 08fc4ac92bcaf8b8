"""GRC training (grc.md, Eqs. 2–5): one masked forward per text trains its response, its memory and its embedding.

Each text of a batch (queries, positives, hard negatives) is one sequence, laid out by
:func:`grace_st.methods.grc.latent_pass` (the pass ``encode`` runs):

    ❶ P(x) ⊕ y      y: a greedy response at the text's budget, no gradient (:func:`response_targets`): the model's
                    own (``grc_response_targets: policy``, self-distillation; measured to collapse to "None",
                    decisions/D035) or the start model's (``start``, frozen where training began), or "None"
                    at budget 0 (documents, as the paper trains them)
    ❷ r_1..r_m      the latents
    ❸ P_mem(r_p) ⊕ c ⊕ EOS   a reconstruction turn: a prompt r_p drawn from :data:`~grace_st.methods.grc.RECONSTRUCTION_PROMPTS` in the
                    memory's conversation (:func:`grace_st.memory.memory_prompt`), then c, the text itself (cut at
                    ``max_reconstruction_tokens``); ❸ does not attend to ❶, so c is rebuilt from the latents alone

and the loss is Eq. 5, L = α · L_Gen + β · L_Recons + γ · L_Rep:

- L_Gen (Eq. 2): token cross-entropy on y's positions in ❶;
- L_Recons (Eq. 3): token cross-entropy on c ⊕ EOS in ❸;
- L_Rep (Eq. 4): InfoNCE of each query's e against every positive's and hard negative's e in the batch, logits
  τ · cos (τ multiplies); a batch of scored pairs (an ``sts`` source) takes CoSENT instead, as the other algorithms.

Choices the paper leaves open: c is the text alone for every side (the paper rebuilds (u, x, y) for queries: the
compression measured here is of the text); queries are not their own positives (every source here has pairs);
the latents' own next-token predictions are not trained (Eq. 3 trains c only).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from grace_st.memory import memory_prompt
from grace_st.methods.grc import RECONSTRUCTION_PROMPTS, latent_pass
from grace_training.algorithms.grpo.loss import graded_contrastive_loss
from grace_training.algorithms.icr.loss import triplet_sides
from grace_training.data.examples import Triplet


def reconstruction_turns(encoder, texts: Sequence[str], seed: int, max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """❸ of each text: the memory turn asking an r_p (drawn from ``seed`` and the row) and the text's tokens ⊕ EOS;
    and where the target c starts in each turn."""
    tokenizer, eos = encoder.tokenizer, encoder.eos_token_ids[0]
    turns, starts = [], []
    for i, text in enumerate(texts):
        prompt = memory_prompt(encoder, RECONSTRUCTION_PROMPTS[(seed + i) % len(RECONSTRUCTION_PROMPTS)])
        target = tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
        turns.append([*prompt, *target, eos])
        starts.append(len(prompt))
    return turns, starts


def response_targets(
    encoder, rows: list[list[int]], instruction_length: int, budget: int, whose: str, start_model=None
) -> list[list[int]]:
    """y of each prompt, L_Gen's target: the greedy response ``encode`` writes at ``budget``, from the model being
    trained (``whose="policy"``) or from the start model (``"start"``; the paper's y is data, not the policy's: a
    fixed target keeps the answers from drifting with training): ``start_model``, the trainer's frozen copy under
    full fine-tuning, or else the policy with its LoRA adapter disabled."""
    engine = copy.copy(encoder.engine)  # a copy: pointing it at the frozen copy leaves the encoder's engine alone
    if whose == "policy":
        return engine.responses(rows, instruction_length, budget)
    if start_model is not None:
        engine.model = start_model
        return engine.responses(rows, instruction_length, budget)
    with encoder.model.disable_adapter():
        return engine.responses(rows, instruction_length, budget)


def token_loss(lm_head, states: Tensor, ids: Sequence[Sequence[int]], targets: Sequence[tuple[int, int]]) -> Tensor:
    """Mean cross-entropy of the tokens at columns [start, end) of each row of ``ids``, each predicted from the
    state one column before (states and ids laid out alike, (B, T, H) and B rows)."""
    rows, columns, labels = [], [], []
    for row, (start, end) in enumerate(targets):
        for column in range(max(start, 1), end):
            rows.append(row)
            columns.append(column - 1)
            labels.append(ids[row][column])
    if not labels:
        return states.new_zeros((), dtype=torch.float32)
    picked = states[torch.tensor(rows, device=states.device), torch.tensor(columns, device=states.device)]
    logits = lm_head(picked).float()
    return F.cross_entropy(logits, torch.tensor(labels, device=logits.device))


def representation_loss(query: Tensor, documents: Tensor, scale: float, scores: Tensor | None, graded_scale: float) -> Tensor:
    """Eq. 4: InfoNCE over τ · cos(e_q, e_d), query i's target document row i of ``documents`` (positives first,
    then hard negatives); CoSENT on the pairs' cosines when ``scores`` (scored pairs) are given."""
    positives = documents[: len(query)]
    if scores is not None:
        return graded_contrastive_loss(query, positives, scores, scale=graded_scale)
    logits = scale * F.normalize(query.float(), dim=-1) @ F.normalize(documents.float(), dim=-1).T
    return F.cross_entropy(logits, torch.arange(len(query), device=logits.device))


def grc_batch_loss(
    encoder, triplets: Sequence[Triplet], config, scores: Tensor | None, seed: int, start_model=None
) -> dict[str, Tensor]:
    """One batch's Eq. 5 with gradient: ``loss`` and its three terms ``generation``, ``reconstruction`` and
    ``representation`` (unweighted), and ``tokens``, the positions the masked forward ran (unpadded).
    ``start_model``: the frozen start model that writes ``start`` targets under full fine-tuning
    (:func:`response_targets`)."""
    sides = triplet_sides(triplets, config.num_negatives, config.query_task, config.document_task)
    prefixes, texts, response_spans, side_sizes = [], [], [], []
    for side_texts, task in sides:
        if not side_texts:
            side_sizes.append(0)
            continue
        rows, span = encoder.prompt_token_ids(list(side_texts), task=task)
        budget = encoder.rationale_budget(task or "default")
        made = response_targets(encoder, rows, span, budget, config.grc_response_targets, start_model)
        prefixes += [[*row, *response] for row, response in zip(rows, made)]
        response_spans += [len(response) for response in made]
        texts += list(side_texts)
        side_sizes.append(len(side_texts))
    suffixes, starts = reconstruction_turns(encoder, texts, seed, config.max_reconstruction_tokens)
    out = latent_pass(encoder.engine.view, encoder.latent_tokens, prefixes, suffixes)
    lm_head = encoder.model.get_output_embeddings()
    width = out.prefix_states.shape[1]
    left_padded = [[-1] * (width - len(row)) + row for row in prefixes]  # the prefixes as latent_pass laid them
    generation = token_loss(lm_head, out.prefix_states, left_padded, [(width - n, width) for n in response_spans])
    reconstruction = token_loss(
        lm_head, out.suffix_states, suffixes, [(start, len(turn)) for start, turn in zip(starts, suffixes)]
    )
    queries = side_sizes[0]
    representation = representation_loss(
        out.embeddings[:queries], out.embeddings[queries:], config.grc_scale, scores, config.graded_scale
    )
    loss = config.grc_alpha * generation + config.grc_beta * reconstruction + config.grc_gamma * representation
    tokens = sum(map(len, prefixes)) + sum(map(len, suffixes)) + len(prefixes) * encoder.latent_tokens.num_latent_tokens
    return {
        "loss": loss, "generation": generation, "reconstruction": reconstruction, "representation": representation,
        "tokens": tokens,
    }
