"""grace_training.tools.interpolate_weights: a fully fine-tuned model moved back toward its base in weight space."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_model, make_tokenizer
from sentence_transformers import SentenceTransformer
from test_average_adapters import weights as lm_weights

from grace_st import from_causal_lm
from grace_training.tools.interpolate_weights import INTERPOLATED_FROM, interpolate_weights

TEXTS = ["The cat sat on the mat.", "Stock markets fell sharply after the central bank raised rates again."]


def saved(path, seed: int = 0, layers: int = 2, shift: float = 0.0):
    """A tiny GRACE model with tied embeddings, as SmolLM2 has; ``shift`` moves every weight by seeded noise (a
    stand-in for full fine-tuning)."""
    tokenizer = make_tokenizer()
    lm = make_model(tokenizer, layers=layers, tied=True)
    if shift:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for weight in lm.parameters():
                weight.add_(shift * torch.randn(weight.shape, generator=generator))
    from_causal_lm(model=lm, tokenizer=tokenizer, max_rationale_tokens=4, device="cpu").save(str(path))
    return path


def test_every_weight_moves_to_the_interpolated_point_and_the_result_loads(tmp_path):
    base, tuned = saved(tmp_path / "base"), saved(tmp_path / "tuned", shift=0.05)
    summary = interpolate_weights(tuned, 0.5, tmp_path / "half", base=base)
    start, end, half = lm_weights(base), lm_weights(tuned), lm_weights(tmp_path / "half")
    assert any(not torch.equal(start[name], end[name]) for name in start)
    for name in start:  # the tied head is moved once, with the embeddings it shares
        torch.testing.assert_close(half[name], (start[name] + end[name]) / 2, atol=1e-6, rtol=1e-5)
    assert torch.equal(half["lm_head.weight"], half["model.embed_tokens.weight"])
    assert summary["alpha"] == 0.5 and summary["relative_delta"] > 0
    assert json.loads((tmp_path / "half" / INTERPOLATED_FROM).read_text())["tuned"] == str(tuned)

    # the two ends: alpha 1 encodes as the tuned model, alpha 0 as the base
    interpolate_weights(tuned, 1.0, tmp_path / "one", base=base)
    interpolate_weights(tuned, 0.0, tmp_path / "zero", base=base)
    for end_path, got_path in ((tuned, "one"), (base, "zero")):
        expected = SentenceTransformer(str(end_path), trust_remote_code=True, device="cpu").encode(TEXTS)
        got = SentenceTransformer(str(tmp_path / got_path), trust_remote_code=True, device="cpu").encode(TEXTS)
        torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(expected), atol=1e-5, rtol=1e-4)


def test_interpolation_refuses_a_weight_outside_0_1_an_existing_output_and_another_architecture(tmp_path):
    base, tuned = saved(tmp_path / "base"), saved(tmp_path / "tuned", shift=0.05)
    with pytest.raises(SystemExit, match=r"\[0, 1\]"):
        interpolate_weights(tuned, 1.5, tmp_path / "out", base=base)
    with pytest.raises(SystemExit, match="exists"):
        interpolate_weights(tuned, 0.5, tmp_path / "base", base=base)
    deeper = saved(tmp_path / "deeper", layers=3)
    with pytest.raises(SystemExit, match="not one architecture"):
        interpolate_weights(tuned, 0.5, tmp_path / "out", base=deeper)
