"""The encode data path on plain values (no model): a batch read back from its features, a subset of it, the
rationale cache around a function that thinks, and the features a batch's results become."""

from __future__ import annotations

import pytest
import torch

from grace_st.cache import CacheFile
from grace_st.encoding import EncodeBatch, Plan, Sampling, TextResult, cached, text_results, to_features

SAMPLING = Sampling(temperature=0.5, top_p=0.9, repetition_penalty=1.1)


def make_batch(texts: int = 3, repeats: int = 2, keys: bool = True) -> EncodeBatch:
    rows = [[7] * (i + 2) for i in range(texts)]  # text i: i + 2 tokens, the first one the instruction
    return EncodeBatch.build(
        rows,
        1,
        Plan(budget=4, repeats=repeats),
        pad_token_id=0,
        seeds=torch.arange(texts * repeats),
        cache_keys=[f"k{i}" for i in range(texts)] if keys else None,
    )


def thought(batch: EncodeBatch) -> list[TextResult]:
    """A stand-in for the engine: each text's vector is its prompt's length, its rationale its seeds."""
    lengths = batch.attention_mask.sum(1).float()
    pooled = lengths[:, None].expand(-1, 2).contiguous()
    ids = [[int(seed)] for seed in batch.seeds]
    return text_results(pooled, ids, [False, True] * batch.size, batch.plan.repeats)


def test_a_batch_reads_back_from_its_features_and_features_without_a_plan_take_the_default():
    batch = make_batch()
    again = EncodeBatch.from_features(batch.features())
    assert again.plan == Plan(4, 2) and again.cache_keys == ["k0", "k1", "k2"] and again.size == 3
    assert torch.equal(again.input_ids, batch.input_ids) and torch.equal(again.seeds, batch.seeds)
    assert again.instruction_span == 1 and again.prompt_tokens() == 2 + 3 + 4
    planned = make_batch(repeats=1).features()
    bare = {k: v for k, v in planned.items() if k not in ("rationale_budget", "num_rationales")}
    assert EncodeBatch.from_features(bare, default=Plan(9, 1)).plan == Plan(9, 1)
    with pytest.raises(KeyError):
        EncodeBatch.from_features(bare)


def test_a_subset_keeps_each_text_rows_seeds_and_key_and_is_padded_again_by_the_engine():
    batch = make_batch()
    part = batch.subset([1, 0])
    assert part.cache_keys == ["k1", "k0"] and part.seeds.tolist() == [2, 3, 0, 1] and part.size == 2
    request = part.request(SAMPLING)
    assert request.prompt_ids == [[7] * 3, [7] * 3, [7] * 2, [7] * 2]
    assert request.padded is None  # the widest text is left out: its padding is not these rows'
    assert (request.max_new_tokens, request.top_p, request.repetition_penalty) == (4, 0.9, 1.1)
    assert request.temperatures == [0.5] * 4 and request.seeds == [2, 3, 0, 1]
    assert batch.request(SAMPLING).padded is not None


def test_the_cache_thinks_only_about_the_texts_it_lacks_and_answers_in_order(tmp_path):
    cache = CacheFile(tmp_path / "cache.sqlite")
    batch = make_batch()
    asked = []

    def think(part: EncodeBatch) -> list[TextResult]:
        asked.append(part.cache_keys)
        return thought(part)

    cached(think, cache, batch.subset([1]))
    first = cached(think, cache, batch)
    again = cached(think, cache, batch)
    assert asked == [["k1"], ["k0", "k2"]]
    for results in (first, again):
        assert [float(r.embedding[0]) for r in results] == [2.0, 3.0, 4.0]
        assert [r.rationale_ids for r in results] == [[[0], [1]], [[2], [3]], [[4], [5]]]
        assert all(r.truncated == [False, True] and r.embedding.dtype == torch.float32 for r in results)


def test_results_become_the_features_forward_returns():
    batch = make_batch()
    out = to_features(batch, thought(batch), {"token_embeddings": torch.zeros(3, 1, 2)})
    assert torch.equal(out["input_ids"], batch.input_ids[::2]) and out["token_embeddings"].shape == (3, 1, 2)
    assert out["sentence_embedding"][:, 0].tolist() == [2.0, 3.0, 4.0]
    assert out["rationale_token_ids"].tolist() == [[[0], [1]], [[2], [3]], [[4], [5]]]
    assert out["rationale_truncated"].tolist() == [[False, True]] * 3 and out["rationale_truncated"].dtype == torch.bool
    assert out["rationale_budget"].tolist() == [4, 4, 4]
