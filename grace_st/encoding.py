"""The encode data path, one direction: a batch in, each text's result, the features sentence-transformers reads.

- :class:`EncodeBatch`: what :meth:`GenerativeEncoder.preprocess <grace_st.encoder.GenerativeEncoder.preprocess>`
  builds (each text's P(x), checked by :func:`check_texts` and :func:`check_prompts`, repeated once a rationale and
  left-padded, with L_sys, the batch's :class:`Plan`, each rollout's seed from :func:`rationale_seeds` and the
  rationale-cache keys), read back from the features dict in one place (:meth:`EncodeBatch.from_features`);
- :class:`TextResult`: one text's answer, however its rationales came: the mean over its rollouts' pooled
  embeddings (Eq. 3, then the mean over ``num_rationales``), its rationales and their truncation flags;
  :func:`per_text` makes them from an engine's rollouts, and the server's scheduler from its streamed rows;
- :func:`cached`: the rationale cache wrapped around a function that thinks, its halves :func:`lookup` and
  :func:`store` shared with the scheduler;
- :func:`to_features`: the results as the features ``forward`` returns.

Values in, values out: nothing here reads the encoder.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from grace_st.cache import CacheEntry, CacheFile
from grace_st.prompts import text_problem
from grace_st.runtime.batch import RolloutRequest, Thoughts, left_pad, pad_rationales


def check_texts(texts: Sequence[Any]) -> None:
    """Refuse a batch holding anything but strings, naming the item and what it is."""
    for index, text in enumerate(texts):
        problem = text_problem(text)
        if problem is not None:
            # ValueError, not TypeError: sentence-transformers 6 answers a TypeError from
            # preprocess by retrying with the prompt glued to each text, and that retry's
            # own error (str + list) would replace this one.
            raise ValueError(
                f"GenerativeEncoder takes strings; item {index} of this batch (sorted by length) {problem}"
            )


def check_prompts(rows: Sequence[Sequence[int]], instruction_span: int, pools_prompt: bool = False) -> None:
    """Refuse a prompt that leaves nothing to embed, naming the item. Only GIRCSE's reference format can make one
    (a chat template always has tokens around the text): an empty text under an empty instruction is a prompt of
    no token, which no model can be run on; and where the prompt itself is pooled (``pools_prompt``: a budget of 0,
    Eq. 3 over t > L_sys), an empty text leaves no position after the instruction, whose mean would be a zero
    vector standing in for an embedding."""
    for index, row in enumerate(rows):
        if not row:
            raise ValueError(
                f"GenerativeEncoder: item {index} of this batch (sorted by length) is an empty text under an empty "
                "instruction: in prompt_format 'instruct' its prompt has no token to run the model on; give its "
                "prompt type an instruction, or leave empty texts out"
            )
        if pools_prompt and len(row) <= instruction_span:
            raise ValueError(
                f"GenerativeEncoder: item {index} of this batch (sorted by length) leaves nothing to pool: with "
                "max_rationale_tokens 0 the prompt after the instruction is pooled, and in prompt_format 'instruct' "
                "an empty text has no token there (nor has any text once the instruction fills max_input_tokens); "
                "give it soft tokens (max_rationale_tokens >= 1), or leave empty texts out"
            )


def rationale_seed(seed: int, instruction: str, text: str, index: int) -> int:
    key = f"{seed}\x00{index}\x00{instruction}\x00{text}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def rationale_seeds(seed: int, instruction: str, texts: Sequence[str], repeats: int) -> Tensor:
    """One seed a rollout, from the setting's seed, the instruction, the text and the rollout's index: a
    text gets the same rationales whatever batch it is in."""
    return torch.tensor(
        [rationale_seed(seed, instruction, text, k) for text in texts for k in range(repeats)],
        dtype=torch.long,
    )


@dataclass(frozen=True)
class Plan:
    """A batch's rationale budget (``max_new_tokens``; 0: the prompt alone is pooled) and rationales a text."""

    budget: int
    repeats: int


@dataclass(frozen=True)
class Sampling:
    """How rollouts are sampled: the temperature (0: greedy), top-p and repetition penalty."""

    temperature: float
    top_p: float
    repetition_penalty: float


@dataclass
class EncodeBatch:
    """A batch as ``forward`` takes it: each text's prompt ``plan.repeats`` times in a row, left-padded
    (``input_ids``, ``attention_mask``), each row's L_sys, a sampling seed a row (None: torch's global generator) and a
    rationale-cache key a text (None: no cache, or settings it cannot key)."""

    input_ids: Tensor
    attention_mask: Tensor
    instruction_lengths: Tensor
    plan: Plan
    seeds: Tensor | None = None
    cache_keys: list[str] | None = None

    @classmethod
    def build(
        cls,
        rows: Sequence[Sequence[int]],
        instruction_span: int,
        plan: Plan,
        pad_token_id: int,
        seeds: Tensor | None = None,
        cache_keys: list[str] | None = None,
    ) -> EncodeBatch:
        """From each text's prompt ids (unpadded) and their shared L_sys."""
        repeated = [row for row in rows for _ in range(plan.repeats)]
        input_ids, attention_mask = left_pad(repeated, pad_token_id)
        lengths = torch.full((len(repeated),), instruction_span, dtype=torch.long)
        return cls(input_ids, attention_mask, lengths, plan, seeds, cache_keys)

    @classmethod
    def from_features(cls, features: dict[str, Any], default: Plan | None = None) -> EncodeBatch:
        """The batch a features dict carries (what :meth:`features` wrote, moved to the model's device by
        sentence-transformers); ``default`` is the plan of features built without one."""
        if default is None:
            plan = Plan(features["rationale_budget"], features["num_rationales"])
        else:
            budget, repeats = features.get("rationale_budget", default.budget), features.get("num_rationales")
            plan = Plan(budget, default.repeats if repeats is None else repeats)
        return cls(
            features["input_ids"],
            features["attention_mask"],
            features["instruction_lengths"],
            plan,
            features.get("rationale_seeds"),
            features.get("cache_keys"),
        )

    def features(self) -> dict[str, Any]:
        """The dict sentence-transformers carries from ``preprocess`` to ``forward``."""
        found: dict[str, Any] = {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "instruction_lengths": self.instruction_lengths,
            "rationale_budget": self.plan.budget,
            "num_rationales": self.plan.repeats,
        }
        if self.seeds is not None:
            found["rationale_seeds"] = self.seeds
        if self.cache_keys is not None:
            found["cache_keys"] = self.cache_keys
        return found

    @property
    def size(self) -> int:
        """Texts in the batch."""
        return len(self.input_ids) // self.plan.repeats

    @property
    def instruction_span(self) -> int:
        return int(self.instruction_lengths[0])

    def prompt_tokens(self) -> int:
        """The texts' prompt tokens (template and instruction included), each text counted once."""
        return int(self.attention_mask.sum()) // max(1, self.plan.repeats)

    def subset(self, texts: Sequence[int]) -> EncodeBatch:
        """The batch of the texts at ``texts`` (indices), each with its rows, seeds and key, the padding kept."""
        repeats = self.plan.repeats
        rows = torch.tensor([i * repeats + k for i in texts for k in range(repeats)], device=self.input_ids.device)
        return replace(
            self,
            input_ids=self.input_ids[rows],
            attention_mask=self.attention_mask[rows],
            instruction_lengths=self.instruction_lengths[rows],
            seeds=None if self.seeds is None else self.seeds[rows],
            cache_keys=None if self.cache_keys is None else [self.cache_keys[i] for i in texts],
        )

    def request(self, sampling: Sampling) -> RolloutRequest:
        """The engine's request for every row: its prompt unpadded, its L_sys and seed, ``sampling``, the budget."""
        input_ids, attention_mask = self.input_ids, self.attention_mask
        prompts = [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]
        # built padded: the engine takes the rows as they are, unless they were picked out of a wider batch
        padded = (input_ids, attention_mask) if bool(attention_mask[:, :1].any()) else None
        return RolloutRequest(
            prompts,
            self.instruction_lengths.tolist(),
            temperatures=sampling.temperature,
            top_p=sampling.top_p,
            max_new_tokens=self.plan.budget,
            seeds=self.seeds.tolist() if self.seeds is not None else None,
            repetition_penalty=sampling.repetition_penalty,
            padded=padded,
        )


@dataclass
class TextResult:
    """One text's answer: its embedding (the mean of its rollouts' Eq. 3 vectors), each rollout's rationale ids
    (EOS excluded) and whether it hit the budget without an EOS."""

    embedding: Tensor
    rationale_ids: list[list[int]]
    truncated: list[bool]

    def entry(self) -> CacheEntry:
        """As the rationale cache stores it (the embedding float32, on the CPU)."""
        return CacheEntry(
            rationale_ids=[[int(t) for t in ids] for ids in self.rationale_ids],
            truncated=[bool(t) for t in self.truncated],
            embedding=self.embedding.float().cpu().numpy(),
        )

    @classmethod
    def from_entry(cls, entry: CacheEntry) -> TextResult:
        return cls(torch.from_numpy(np.asarray(entry.embedding)), entry.rationale_ids, entry.truncated)


def text_results(
    pooled: Tensor, rationale_ids: Sequence[list[int]], truncated: Sequence[bool], repeats: int
) -> list[TextResult]:
    """Rollouts, ``repeats`` a text one after another, as each text's result: the mean over its rollouts'
    pooled embeddings, its rationales and truncation flags."""
    texts = len(rationale_ids) // repeats
    means = pooled.view(texts, repeats, -1).mean(1)
    return [
        TextResult(
            means[i],
            list(rationale_ids[i * repeats : (i + 1) * repeats]),
            [bool(t) for t in truncated[i * repeats : (i + 1) * repeats]],
        )
        for i in range(texts)
    ]


def per_text(thoughts: Thoughts, pooled: Tensor, repeats: int) -> tuple[list[TextResult], dict[str, Tensor]]:
    """An engine's rollouts and their pooled embeddings as each text's result; and the per-token states of each
    text's first rollout, when one pass made them all (``token_embeddings``, ``attention_mask``, and GIRCSE's
    readable trace: each step's most probable tokens)."""
    rationales = thoughts.rationales
    states = thoughts.single_pass()
    per_token = (
        {}
        if states is None
        else {
            "attention_mask": states.attention_mask[::repeats],
            "token_embeddings": states.token_embeddings[::repeats],
        }
    )
    soft = getattr(states, "soft", None)
    if soft is not None:
        per_token.update(soft_token_ids=soft.top_ids, soft_token_probs=soft.top_probs)
    return text_results(pooled, rationales.rationale_ids, rationales.truncated, repeats), per_token


def lookup(cache: CacheFile, batch: EncodeBatch) -> dict[int, TextResult]:
    """The batch's texts the rationale cache holds, by their index in the batch."""
    found = cache.lookup(batch.cache_keys)
    return {i: TextResult.from_entry(found[key]) for i, key in enumerate(batch.cache_keys) if key in found}


def store(cache: CacheFile, keys: Sequence[str], results: Sequence[TextResult]) -> list[TextResult]:
    """``results`` stored under ``keys``; each returned as the cache answers it, so a text gets the same
    vector whether it was thought about now or found."""
    entries = [result.entry() for result in results]
    cache.store(dict(zip(keys, entries)))
    return [TextResult.from_entry(entry) for entry in entries]


def cached(
    think: Callable[[EncodeBatch], list[TextResult]], cache: CacheFile, batch: EncodeBatch
) -> list[TextResult]:
    """Each text of ``batch`` from the rationale cache, ``think`` run on the texts it lacks and its results
    stored first. From several threads at once: reads and writes take turns on the one connection, thinking
    does not wait for them; two threads missing the same text both think about it (the same entry, stored twice)."""
    found = lookup(cache, batch)
    missing = [i for i in range(batch.size) if i not in found]
    if missing:
        fresh = think(batch.subset(missing))
        found.update(zip(missing, store(cache, [batch.cache_keys[i] for i in missing], fresh)))
    return [found[i] for i in range(batch.size)]


def to_features(
    batch: EncodeBatch, results: Sequence[TextResult], per_token: dict[str, Tensor] | None = None
) -> dict[str, Tensor]:
    """What ``forward`` returns for ``batch``: per text its first row's ``input_ids``, the ``per_token`` states,
    ``sentence_embedding`` (B, H), ``rationale_token_ids`` (B, num_rationales, G; -1 pads), ``rationale_truncated``
    (B, num_rationales) and ``rationale_budget`` (B,)."""
    device, repeats = batch.input_ids.device, batch.plan.repeats
    return {
        "input_ids": batch.input_ids[::repeats],
        **(per_token or {}),
        "sentence_embedding": torch.stack([result.embedding for result in results]).to(device),
        "rationale_token_ids": pad_rationales([result.rationale_ids for result in results], repeats).to(device),
        "rationale_truncated": torch.tensor([result.truncated for result in results], dtype=torch.bool).to(device),
        "rationale_budget": torch.full((len(results),), batch.plan.budget, dtype=torch.long, device=device),
    }
