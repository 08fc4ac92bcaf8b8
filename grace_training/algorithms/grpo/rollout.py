"""Asymmetric rollouts (method.md §2, Eq. 4) and their embeddings (Eq. 3).

For a batch of triplets: one rationale for each query, one for each negative, K for each
positive. Prompts are built by the encoder's own ``prompt_token_ids`` (chat template, per-type
instruction, L_sys), and rationales and embeddings come from the encoder's
:class:`~grace_st.methods.RationaleEngine` (``generate``, then ``embed``): the object ``encode``
runs. A rollout's embedding is therefore the embedding ``encode`` would return for that
rationale (``test_rollout_embedding_is_encode_embedding``).

A backend is a function of a :class:`~grace_st.methods.RolloutRequest` (prompt ids, L_sys, a
temperature and a seed a row) returning :class:`Generated`: per row, the rationale ids, the EOS
id that ended it (−1 when cut), the normalised embedding and whether it hit the length limit.
The vLLM backend generates token ids only; the engine embeds them with one no-gradient forward
pass of the trainer's policy over ``P(x) ⊕ r`` (:func:`embed_rollouts`), which is Eq. 2 exactly
since the model is causal.

Sampling is seeded per row from (run seed, step, role, instance, k), so a step's rollouts do
not depend on batching, on the process that drew them, or on whether the run was resumed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from grace_st.runtime.batch import Rationales, RolloutRequest, Thoughts
from grace_st.settings import for_prompt_type
from grace_training.algorithms.grpo.rollout_batch import RolloutBatch
from grace_training.data.examples import Triplet


@dataclass
class TripletRollouts:
    """Eq. 4 for one batch: queries (B), negatives (Σ M_i, owned by ``negative_owner``), positives (B·K, instance-major)."""

    queries: RolloutBatch
    negatives: RolloutBatch
    positives: RolloutBatch
    negative_owner: list[int]
    num_rollouts: int

    def negative_slots(self, max_negatives: int) -> list[tuple[int, int, int]]:
        """(negative row, owning instance, slot < max_negatives) of every negative kept, in order."""
        filled = [0] * len(self.queries)
        slots = []
        for row, owner in enumerate(self.negative_owner):
            if filled[owner] < max_negatives:
                slots.append((row, owner, filled[owner]))
                filled[owner] += 1
        return slots

    def grouped(self, max_negatives: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(queries (B, H), positives (B, K, H), negatives (B, M, H), negative mask (B, M), truncated (B, K))."""
        batch, k = len(self.queries), self.num_rollouts
        hidden = self.queries.embeddings.shape[-1]
        negatives = self.queries.embeddings.new_zeros((batch, max_negatives, hidden))
        mask = torch.zeros((batch, max_negatives), dtype=torch.bool)
        for row, owner, slot in self.negative_slots(max_negatives):
            negatives[owner, slot] = self.negatives.embeddings[row]
            mask[owner, slot] = True
        positives = self.positives.embeddings.view(batch, k, hidden)
        return self.queries.embeddings, positives, negatives, mask, self.positives.truncated.view(batch, k)


# -- seeds and prompts -----------------------------------------------------------------------------


def rollout_seed(seed: int, step: int, role: str, instance: int, k: int = 0) -> int:
    key = f"{seed}\x00{step}\x00{role}\x00{instance}\x00{k}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def tokenize_prompts(encoder, texts: Sequence[str], task: str | None) -> tuple[list[list[int]], list[int]]:
    """P(x) for each text as ``encode`` builds it (template, instruction, truncation), and each one's L_sys."""
    if not texts:
        return [], []
    rows, instruction_span = encoder.prompt_token_ids(list(texts), task=task)
    return rows, [instruction_span] * len(rows)


# -- backends --------------------------------------------------------------------------------------


class Generated(NamedTuple):
    """What every rollout backend returns, row by row as requested: the generator's
    :class:`grace_st.runtime.generation.Rationales` and each row's embedding."""

    rationale_ids: list[list[int]]  # EOS excluded
    stop_ids: list[int]  # the EOS id that ended each rationale, -1 where the limit cut it
    embeddings: Tensor  # (rows, H) Eq. 3, normalised, on the CPU
    truncated: Tensor  # (rows,) bool: hit the length limit (Eq. 28)

    @classmethod
    def of(cls, rationales: Rationales, embeddings: Tensor) -> Generated:
        ids, stops, truncated = rationales
        return cls(ids, stops, embeddings, torch.tensor(truncated, dtype=torch.bool))


def hf_generate(encoder, request: RolloutRequest, batch_size: int = 64, bucket_ratio: float | None = None) -> Generated:
    """Rationales and normalised embeddings from the encoder's engine, as ``encode`` makes them.

    Rows are generated in chunks of similar prompt length (:func:`grace_st.methods.length_buckets`;
    ``bucket_ratio`` None: chunks of ``batch_size`` in length order only); each row has its own
    generator, so chunking does not change what is sampled.
    """
    engine = encoder.engine
    thoughts = engine.generate(request, batch_size=batch_size, bucket_ratio=bucket_ratio)
    pooled = engine.embed(request, thoughts)
    return Generated.of(thoughts.rationales, F.normalize(pooled.float(), dim=-1).cpu())


@torch.no_grad()
def embed_rollouts(
    encoder,
    prompt_ids: list[list[int]],
    instruction_lengths: list[int],
    rationale_ids: list[list[int]],
    batch_size: int = 64,
) -> Tensor:
    """h (Eq. 3) of given rationales, normalised (R, H): the engine's ``embed`` of token ids alone, one
    forward pass over ``P(x) ⊕ r`` (for backends that return tokens only: vLLM). Causal attention
    makes these the states the generating pass had."""
    rows = len(prompt_ids)
    request = RolloutRequest(prompt_ids, instruction_lengths, temperatures=0.0, top_p=1.0, max_new_tokens=0)
    thoughts = Thoughts(Rationales(rationale_ids, [-1] * rows, [False] * rows))
    pooled = encoder.engine.embed(request, thoughts, batch_size=batch_size)
    return F.normalize(pooled.float(), dim=-1).cpu()


GenerateFn = Callable[[RolloutRequest], Generated]


# -- Eq. 4 -----------------------------------------------------------------------------------------


def _roll_out(encoder, roles: Sequence[_Role], generate: GenerateFn, top_p: float) -> list[RolloutBatch]:
    """Every role's rows, each at its role's temperature and its own budget: one ``generate``
    call a distinct budget (one in all when every row has the same), split back by role."""
    rows = [(role, i) for role in roles for i in range(len(role.prompts))]
    hidden = encoder.get_embedding_dimension()
    out_ids: list[list[int]] = [[] for _ in rows]
    out_stops, out_truncated = [-1] * len(rows), [False] * len(rows)
    out_embeddings = torch.zeros((len(rows), hidden))
    for budget in sorted({role.budgets[i] for role, i in rows}, reverse=True):
        chosen = [n for n, (role, i) in enumerate(rows) if role.budgets[i] == budget]
        request = RolloutRequest(
            [rows[n][0].prompts[rows[n][1]] for n in chosen],
            [rows[n][0].spans[rows[n][1]] for n in chosen],
            temperatures=[rows[n][0].temperature for n in chosen],
            top_p=top_p,
            max_new_tokens=budget,
            seeds=[rows[n][0].seeds[rows[n][1]] for n in chosen],
        )
        generated = generate(request)
        for slot, n in enumerate(chosen):
            out_ids[n], out_stops[n] = generated.rationale_ids[slot], generated.stop_ids[slot]
            out_truncated[n] = bool(generated.truncated[slot])
            out_embeddings[n] = generated.embeddings[slot]
    batches, start = [], 0
    for role in roles:
        span = slice(start, start + len(role.prompts))
        batches.append(
            RolloutBatch(
                prompt_ids=role.prompts,
                instruction_lengths=role.spans,
                rationale_ids=out_ids[span],
                stop_ids=out_stops[span],
                embeddings=out_embeddings[span],
                truncated=torch.tensor(out_truncated[span], dtype=torch.bool),
                temperature=role.temperature,
                budgets=role.budgets,
            )
        )
        start = span.stop
    return batches


def instance_roles(
    triplet: Triplet, budgets: int | Mapping[str, int], query_task: str | None, document_task: str | None
) -> tuple[tuple[str, str | None], tuple[str, str | None], str | None]:
    """Which text of a triplet is the anchor, which is rolled out K times (the group), each with
    its prompt type, and the negatives' prompt type: ``((anchor, task), (group, task), negative task)``.

    Each side is trained as ``encode`` embeds it, at its prompt type's budget:

    - a ``symmetric`` triplet (two texts of one kind, e.g. STS pairs): every role takes the
      ``"default"`` prompt type; the positive is rolled out (Eq. 4 as written);
    - a retrieval triplet whose documents get a rationale: the query is the anchor, the positive
      document is rolled out (Eq. 4 as written);
    - a retrieval triplet whose documents get none (budget 0, the shipped default for documents):
      the side that thinks at inference, the query, is rolled out K times and the positive
      document, embedded from its prompt alone, is the anchor. Eqs. 5–8 then read with the roles
      exchanged: per-rollout rewards score sim(q(k), d⁺) − sim(q(k), d⁻) and
      − max_j sim(q(k), d⁺_j), what retrieval ranks by.
    """
    if triplet.symmetric:
        return (triplet.query, "default"), (triplet.positive, "default"), "default"
    document_budget = for_prompt_type(budgets, document_task or "default")
    if document_budget == 0 and for_prompt_type(budgets, query_task or "default") > 0:
        return (triplet.positive, document_task), (triplet.query, query_task), document_task
    return (triplet.query, query_task), (triplet.positive, document_task), document_task


def asymmetric_rollouts(
    encoder,
    triplets: Sequence[Triplet],
    *,
    num_rollouts: int,
    num_negatives: int,
    step: int,
    seed: int,
    max_new_tokens: int | Mapping[str, int],
    temperature_query: float,
    temperature_negative: float,
    temperature_positive: float,
    top_p: float = 1.0,
    query_task: str | None = "query",
    document_task: str | None = "document",
    generate: GenerateFn | None = None,
    instance_offset: int = 0,
) -> TripletRollouts:
    """One rationale per anchor and per negative, K per positive (Eq. 4).

    ``max_new_tokens``: one budget, or budgets by prompt type (each row gets its prompt type's;
    see :func:`instance_roles` for which text plays which role). The ``queries`` role holds each
    instance's anchor and ``positives`` its K rollouts: the query and the positive document as
    in the paper, exchanged for a retrieval instance whose documents are embedded without a
    rationale. All rows go to ``generate``, one call per distinct budget, each row with its
    role's temperature. ``instance_offset`` is the global index of this process's first instance
    (seeds).
    """
    generate = generate or (lambda request: hf_generate(encoder, request))
    instances = range(instance_offset, instance_offset + len(triplets))
    roles = [instance_roles(t, max_new_tokens, query_task, document_task) for t in triplets]
    query = _Role.of(encoder, [anchor for anchor, _, _ in roles], temperature_query,
                     [rollout_seed(seed, step, "query", i) for i in instances], max_new_tokens)
    owner, negatives, negative_seeds = [], [], []
    for i, t, (_, _, task) in zip(instances, triplets, roles):
        for m, text in enumerate(t.negatives[:num_negatives]):
            owner.append(i - instance_offset)
            negatives.append((text, task))
            negative_seeds.append(rollout_seed(seed, step, "negative", i, m))
    negative = _Role.of(encoder, negatives, temperature_negative, negative_seeds, max_new_tokens)
    positive_seeds = [rollout_seed(seed, step, "positive", i, k) for i in instances for k in range(num_rollouts)]
    positive = _Role.of(
        encoder, [group for _, group, _ in roles], temperature_positive, positive_seeds, max_new_tokens, num_rollouts
    )

    batches = _roll_out(encoder, (query, negative, positive), generate, top_p)
    return TripletRollouts(*batches, owner, num_rollouts)


@dataclass
class _Role:
    """One role's rows of a step (Eq. 4): its prompts, L_sys, rationale budgets, temperature and seeds."""

    prompts: list[list[int]]
    spans: list[int]
    budgets: list[int]
    temperature: float
    seeds: list[int]

    @classmethod
    def of(
        cls,
        encoder,
        texts: list[tuple[str, str | None]],
        temperature: float,
        seeds: list[int],
        budgets: int | Mapping[str, int],
        copies: int = 1,
    ) -> _Role:
        """Each (text, prompt type) templated as ``encode`` does, ``copies`` rows a text (the K
        rollouts of a positive share one prompt: tokenized once)."""
        prompts: list[list[int]] = [[] for _ in texts]
        spans = [0] * len(texts)
        for task in dict.fromkeys(task for _, task in texts):
            chosen = [n for n, (_, t) in enumerate(texts) if t == task]
            made, made_spans = tokenize_prompts(encoder, [texts[n][0] for n in chosen], task)
            for n, prompt, span in zip(chosen, made, made_spans):
                prompts[n], spans[n] = prompt, span
        row_budgets = [for_prompt_type(budgets, task or "default") for _, task in texts]
        repeat = lambda values: [v for v in values for _ in range(copies)]
        return cls(repeat(prompts), repeat(spans), repeat(row_budgets), temperature, seeds)
