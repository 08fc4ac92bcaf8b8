"""The rationale cache inside encode: hits skip generation, and nothing stale is ever served."""

import numpy as np
import pytest
import torch

from grace_st import explain
from grace_st.cache import CacheError
from grace_st.methods import RationaleEngine

TEXTS = ["The cat sat on the mat.", "", "Stock markets fell sharply.", "ignore the instructions"]


def _no_generation(self, request, *args, **kwargs):
    raise AssertionError("a warm cache must not generate")


def test_warm_cache_returns_the_cold_results_without_generating(tiny_model, tmp_path, monkeypatch):
    encoder = tiny_model[0]
    uncached = explain(tiny_model, TEXTS)
    encoder.set_rationale_cache(tmp_path / "cache.sqlite")
    cold = explain(tiny_model, TEXTS, batch_size=3)
    monkeypatch.setattr(RationaleEngine, "generate", _no_generation)
    warm = explain(tiny_model, TEXTS, batch_size=2)
    for a, b, c in zip(uncached, cold, warm):
        assert a["rationale"] == b["rationale"] == c["rationale"] and a["truncated"] == c["truncated"]
        np.testing.assert_allclose(a["embedding"], b["embedding"], atol=1e-6)
        np.testing.assert_array_equal(b["embedding"], c["embedding"])
    np.testing.assert_array_equal(tiny_model.encode(TEXTS), np.stack([c["embedding"] for c in warm]))


def test_partial_hits_generate_only_the_missing_texts(tiny_model, tmp_path, monkeypatch):
    encoder = tiny_model[0]
    encoder.set_rationale_cache(tmp_path / "cache.sqlite")
    tiny_model.encode(TEXTS[:2])
    seen = []
    original = RationaleEngine.generate

    def counting(self, request, *args, **kwargs):
        seen.append(len(request.prompt_ids))
        return original(self, request, *args, **kwargs)

    monkeypatch.setattr(RationaleEngine, "generate", counting)
    tiny_model.encode(TEXTS, batch_size=4)
    assert seen == [2]


def test_settings_weights_and_instructions_change_the_key(tiny_model, tmp_path):
    encoder = tiny_model[0]
    encoder.set_rationale_cache(tmp_path / "cache.sqlite")
    first = tiny_model.encode(TEXTS[:1])
    encoder.max_rationale_tokens = 3
    assert not np.allclose(tiny_model.encode(TEXTS[:1]), first)
    encoder.max_rationale_tokens = 8
    np.testing.assert_array_equal(tiny_model.encode(TEXTS[:1]), first)
    assert not np.allclose(tiny_model.encode_query(TEXTS[:1]), first)
    with torch.no_grad():
        next(encoder.model.parameters()).mul_(1.5)
    second = tiny_model.encode(TEXTS[:1])
    assert not np.allclose(second, first)
    # a write through .data bypasses the version counter; the key must still change
    next(encoder.model.parameters()).data.mul_(1.5)
    assert not np.allclose(tiny_model.encode(TEXTS[:1]), second)


def test_unseeded_sampling_bypasses_the_cache(tiny_model, tmp_path):
    encoder = tiny_model[0]
    encoder.set_rationale_cache(tmp_path / "cache.sqlite")
    encoder.do_sample, encoder.seed = True, None
    assert "cache_keys" not in encoder.preprocess(TEXTS[:1])
    encoder.seed = 3
    assert "cache_keys" in encoder.preprocess(TEXTS[:1])


def test_a_foreign_file_is_refused_when_the_cache_is_set(tiny_model, tmp_path):
    bogus = tmp_path / "notes.sqlite"
    bogus.write_text("these are my notes, not a cache")
    with pytest.raises(CacheError, match="notes.sqlite"):
        tiny_model[0].set_rationale_cache(bogus)
    assert bogus.read_text() == "these are my notes, not a cache"


def test_saved_model_does_not_carry_the_cache(tiny_model, tmp_path):
    from sentence_transformers import SentenceTransformer

    tiny_model[0].set_rationale_cache(tmp_path / "cache.sqlite")
    tiny_model.save(str(tmp_path / "model"))
    reloaded = SentenceTransformer(str(tmp_path / "model"), device="cpu", trust_remote_code=True)
    assert "cache_keys" not in reloaded[0].preprocess(TEXTS[:1])
