"""What :meth:`GenerativeEncoder.forward <grace_st.encoder.GenerativeEncoder.forward>` returns, however the
rationales came.

A batch's rollouts become per-text outputs (:func:`per_text`: the mean over a text's ``num_rationales``
rollouts); the rationale cache answers every text from its entry, the texts it lacks embedded and stored first
(:func:`through_cache`); :func:`outputs` assembles either into the features sentence-transformers reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from grace_st.cache import CacheEntry
from grace_st.runtime.batch import Thoughts, pad_rationales

if TYPE_CHECKING:
    from grace_st.encoder import GenerativeEncoder


def outputs(
    features: dict[str, Tensor],
    budget: int,
    repeats: int,
    embeddings: Tensor,
    rationale_token_ids: Tensor,
    truncated: Tensor,
    /,
    **states: Tensor,
) -> dict[str, Tensor]:
    """Per text of a batch planned as (``budget``, ``repeats``): its embedding (B, H), rationales
    (B, num_rationales, G), truncation flags and budget; ``states`` adds the first rollout's token states."""
    device = features["input_ids"].device
    batch = embeddings.shape[0]
    return {
        "input_ids": features["input_ids"][::repeats],
        **states,
        "sentence_embedding": embeddings.to(device),
        "rationale_token_ids": rationale_token_ids.to(device),
        "rationale_truncated": truncated.to(device),
        "rationale_budget": torch.full((batch,), budget, dtype=torch.long, device=device),
    }


def per_text(
    thoughts: Thoughts, pooled: Tensor, repeats: int
) -> tuple[tuple[Tensor, Tensor, Tensor], dict[str, Tensor]]:
    """A batch's rollouts (``repeats`` a text, one after another) and their pooled embeddings, as
    :func:`outputs` takes them: each text's mean embedding, padded rationales and truncation flags; and
    the per-token states of each text's first rollout, when the engine kept them."""
    rationales = thoughts.rationales
    grouped = [rationales.rationale_ids[i : i + repeats] for i in range(0, len(rationales.rationale_ids), repeats)]
    states = thoughts.single_pass()  # the HF rollout's per-token states (first rationale of each text)
    per_token = (
        {}
        if states is None
        else {
            "attention_mask": states.attention_mask[::repeats],
            "token_embeddings": states.token_embeddings[::repeats],
        }
    )
    soft = getattr(states, "soft", None)
    if soft is not None:  # GIRCSE's readable trace: each step's most probable tokens (explain)
        per_token.update(soft_token_ids=soft.top_ids, soft_token_probs=soft.top_probs)
    return (
        pooled.view(len(grouped), repeats, -1).mean(1),
        pad_rationales(grouped, repeats),
        torch.tensor(rationales.truncated, dtype=torch.bool).view(len(grouped), repeats),
    ), per_token


def through_cache(encoder: GenerativeEncoder, features: dict[str, Tensor]) -> dict[str, Tensor]:
    """``encoder.embed`` for the texts the rationale cache lacks, stored; every text answered from its entry
    (hits carry no per-token states). From several threads at once: reads and writes take turns on the
    one connection, generation does not wait for them; two threads missing the same text both generate
    it (the same entry, stored twice)."""
    keys = features["cache_keys"]
    budget, repeats = encoder.batch_plan(features)
    found = encoder.rationale_cache.lookup(keys)
    missing = [i for i, key in enumerate(keys) if key not in found]
    if missing:
        rows = torch.tensor(
            [i * repeats + k for i in missing for k in range(repeats)], device=features["input_ids"].device
        )
        names = ("input_ids", "attention_mask", "instruction_lengths", "rationale_seeds")
        subset = {name: features[name][rows] for name in names if name in features}
        subset.update(rationale_budget=budget, num_rationales=repeats)
        fresh = dict(zip((keys[i] for i in missing), encoder.cache_entries(encoder.embed(subset))))
        encoder.rationale_cache.store(fresh)
        found.update(fresh)
    entries = [found[key] for key in keys]
    return encoder.outputs(
        features,
        torch.from_numpy(np.stack([entry.embedding for entry in entries])),
        pad_rationales([entry.rationale_ids for entry in entries], repeats),
        torch.tensor([entry.truncated for entry in entries]),
    )


def cache_entries(out: dict[str, Tensor]) -> list[CacheEntry]:
    """Each text of an encoder's output as the rationale cache stores it."""
    return [
        CacheEntry(
            rationale_ids=[[t for t in row if t >= 0] for row in out["rationale_token_ids"][j].tolist()],
            truncated=[bool(t) for t in out["rationale_truncated"][j].tolist()],
            embedding=out["sentence_embedding"][j].float().cpu().numpy(),
        )
        for j in range(len(out["sentence_embedding"]))
    ]
