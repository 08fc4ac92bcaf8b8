"""grace_training.tools.lowrank_adapter: a full fine-tuning's delta as a LoRA adapter on its base."""

from __future__ import annotations

import json

import pytest
import torch
from sentence_transformers import SentenceTransformer
from test_interpolate_weights import TEXTS, saved

from grace_training.tools.lowrank_adapter import LOWRANK_FROM, TARGET_MODULES, lowrank_adapter, lowrank_factors


def test_factors_recover_a_low_rank_delta_and_the_calibrated_cut_moves_the_outputs_least():
    generator = torch.Generator().manual_seed(0)
    delta = torch.randn(12, 3, generator=generator) @ torch.randn(3, 8, generator=generator)
    a, b = lowrank_factors(delta, 3)
    assert a.shape == (3, 8) and b.shape == (12, 3) and a.dtype == torch.float32
    torch.testing.assert_close(b @ a, delta, atol=1e-5, rtol=1e-5)

    full = torch.randn(12, 8, generator=generator)
    singular = torch.linalg.svdvals(full.double())
    a, b = lowrank_factors(full, 2)
    # Eckart–Young: the plain cut's error is the singular values it drops
    assert float((full - b @ a).double().norm()) == pytest.approx(float(singular[2:].norm()), rel=1e-5)

    # inputs that mostly take two directions: the calibrated cut is nearer on them than the plain one
    inputs = torch.randn(8, 2, generator=generator) @ torch.randn(2, 200, generator=generator)
    inputs += 0.01 * torch.randn(8, 200, generator=generator)
    calibrated_a, calibrated_b = lowrank_factors(full, 2, gram=inputs @ inputs.T)
    plain_error = ((full - b @ a) @ inputs).norm()
    calibrated_error = ((full - calibrated_b @ calibrated_a) @ inputs).norm()
    assert calibrated_error < 0.1 * plain_error
    # each term's two factors have one norm, so one learning rate suits both
    torch.testing.assert_close(calibrated_a.norm(dim=1), calibrated_b.norm(dim=0), rtol=1e-4, atol=0)


def tuned_by_a_low_rank_delta(base_path, path, rank: int = 2, embeddings: float = 0.0):
    """The base with every target linear layer moved by a rank-``rank`` delta (and the embeddings by noise)."""
    model = SentenceTransformer(str(base_path), trust_remote_code=True, device="cpu")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, module in model[0].model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGET_MODULES:
                out_features, in_features = module.weight.shape
                left = torch.randn(out_features, rank, generator=generator)
                module.weight.add_(0.1 * left @ torch.randn(rank, in_features, generator=generator))
        if embeddings:
            weight = model[0].model.get_input_embeddings().weight
            weight.add_(embeddings * torch.randn(weight.shape, generator=generator))
    model.save(str(path))
    return path


def encode(path):
    return torch.as_tensor(SentenceTransformer(str(path), trust_remote_code=True, device="cpu").encode(TEXTS))


def write_config(tmp_path):
    rows = [{"query": f"question {i} about cats", "positive": f"an answer {i} on the mat"} for i in range(6)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    config = tmp_path / "config.yaml"
    config.write_text(
        f"data_dir: {tmp_path}\ntrain_data:\n  - {{type: triplets, path: train.jsonl}}\n", encoding="utf-8"
    )
    return config


@pytest.mark.parametrize("calibration", [0, 4])
def test_an_adapter_of_the_delta_rank_encodes_as_the_tuned_model(tmp_path, calibration):
    base = saved(tmp_path / "base")
    tuned = tuned_by_a_low_rank_delta(base, tmp_path / "tuned")
    config = write_config(tmp_path) if calibration else None
    summary = lowrank_adapter(tuned, tmp_path / "adapter", 2, base=base, config=config, calibration=calibration)

    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert not (tmp_path / "adapter" / "model.safetensors").exists()  # the base's weights are not copied
    torch.testing.assert_close(encode(tmp_path / "adapter"), encode(tuned), atol=1e-5, rtol=1e-4)
    assert summary["delta_share_not_carried"] == pytest.approx(0.0, abs=1e-12)
    for kept in summary["kept_by_layer"].values():
        assert kept["weights"] == pytest.approx(1.0, abs=1e-6)
        assert ("outputs_on_calibration" in kept) == bool(calibration)
    if calibration:
        assert summary["calibration"]["tokens"] > 0
    assert json.loads((tmp_path / "adapter" / LOWRANK_FROM).read_text())["rank"] == 2


def test_a_grc_model_is_cut_with_its_latents_by_the_plain_svd(tmp_path):
    base = saved(tmp_path / "base")
    tuned = SentenceTransformer(str(tuned_by_a_low_rank_delta(base, tmp_path / "lm")), trust_remote_code=True, device="cpu")
    tuned[0].method, tuned[0].num_latent_tokens = "grc", 3
    tuned[0].prepare_method_state()  # fresh latents; moved, as training moves them
    with torch.no_grad():
        tuned[0].latent_tokens.latents.add_(0.5)
    tuned.save(str(tmp_path / "tuned"))
    with pytest.raises(SystemExit, match="plain SVD"):
        lowrank_adapter(tmp_path / "tuned", tmp_path / "x", 2, base=base, config=write_config(tmp_path), calibration=4)
    lowrank_adapter(tmp_path / "tuned", tmp_path / "adapter", 2, base=base, calibration=0)
    cut = SentenceTransformer(str(tmp_path / "adapter"), trust_remote_code=True, device="cpu")
    assert cut[0].method == "grc" and torch.equal(cut[0].latent_tokens.latents, tuned[0].latent_tokens.latents)
    torch.testing.assert_close(encode(tmp_path / "adapter"), encode(tmp_path / "tuned"), atol=1e-5, rtol=1e-4)


def test_distilling_the_cut_brings_it_nearer_the_tuned_model_and_keeps_the_best_step(tmp_path):
    base = saved(tmp_path / "base")
    tuned = tuned_by_a_low_rank_delta(base, tmp_path / "tuned", rank=4)
    config = write_config(tmp_path)
    cut = lowrank_adapter(tuned, tmp_path / "cut", 1, base=base, config=config, calibration=6)
    assert cut["distillation"] is None
    summary = lowrank_adapter(
        tuned,
        tmp_path / "distilled",
        1,
        base=base,
        config=config,
        calibration=6,
        distill_steps=40,
        distill_learning_rate=1e-2,
    )
    distillation = summary["distillation"]
    assert distillation["sequences"] + distillation["held_out_sequences"] == 12  # a query and a positive each
    assert distillation["held_out_error_after"] < 0.75 * distillation["held_out_error_before"]
    kept = [point for point in distillation["curve"] if point["step"] == distillation["kept_step"]]
    assert kept[0]["held_out_error"] == distillation["held_out_error_after"]
    assert distillation["curve"][0]["held_out_error"] == pytest.approx(distillation["held_out_error_before"])
    # texts it never trained on: the distilled adapter embeds them nearer the tuned model than the cut does
    target = encode(tuned)
    nearer = torch.nn.functional.cosine_similarity(encode(tmp_path / "distilled"), target)
    farther = torch.nn.functional.cosine_similarity(encode(tmp_path / "cut"), target)
    assert nearer.mean() > farther.mean()


def test_a_lower_rank_keeps_less_and_the_embeddings_are_reported_not_carried(tmp_path):
    base = saved(tmp_path / "base")
    tuned = tuned_by_a_low_rank_delta(base, tmp_path / "tuned", rank=4, embeddings=0.01)
    summary = lowrank_adapter(tuned, tmp_path / "adapter", 1, base=base, calibration=0)
    assert 0.0 < summary["delta_share_not_carried"] < 1.0
    assert all(0.0 < kept["weights"] < 1.0 for kept in summary["kept_by_layer"].values())
    assert not torch.allclose(encode(tmp_path / "adapter"), encode(tuned), atol=1e-3)


def test_refuses_a_bad_rank_an_existing_output_calibration_without_data_and_another_architecture(tmp_path):
    base, tuned = saved(tmp_path / "base"), saved(tmp_path / "tuned", shift=0.05)
    with pytest.raises(SystemExit, match="at least 1"):
        lowrank_adapter(tuned, tmp_path / "out", 0, base=base, calibration=0)
    with pytest.raises(SystemExit, match="exists"):
        lowrank_adapter(tuned, tmp_path / "base", 2, base=base, calibration=0)
    with pytest.raises(SystemExit, match="needs --config"):
        lowrank_adapter(tuned, tmp_path / "out", 2, base=base)
    with pytest.raises(SystemExit, match="steps >= 0"):
        lowrank_adapter(tuned, tmp_path / "out", 2, base=base, calibration=0, distill_steps=-1)
    with pytest.raises(SystemExit, match="positive rate"):
        lowrank_adapter(tuned, tmp_path / "out", 2, base=base, calibration=0, distill_learning_rate=0.0)
    with pytest.raises(SystemExit, match="needs --calibration"):
        lowrank_adapter(tuned, tmp_path / "out", 2, base=base, calibration=0, distill_steps=5)
    deeper = saved(tmp_path / "deeper", layers=3)
    with pytest.raises(SystemExit, match="not one architecture"):
        lowrank_adapter(tuned, tmp_path / "out", 2, base=deeper, calibration=0)


def test_export_ships_it_with_what_it_approximates(tmp_path):
    from grace_training.config.train_config import TrainConfig
    from grace_training.tools.export_adapter import export

    base = saved(tmp_path / "base")
    tuned = tuned_by_a_low_rank_delta(base, tmp_path / "tuned")
    (tuned / "trainer_state").mkdir()
    state = {"config": TrainConfig(model_name_or_path="runs/warm_start").to_dict(), "step": 7}
    (tuned / "trainer_state" / "state.json").write_text(json.dumps(state), encoding="utf-8")
    lowrank_adapter(tuned, tmp_path / "adapter", 2, base=base, calibration=0)

    shipped = export(tmp_path / "adapter", tmp_path / "shipped", bfloat16=True)
    settings = json.loads((shipped / "grace_settings.json").read_text(encoding="utf-8"))
    assert settings["training"]["step"] == 7  # the approximated model's last stage
    lowrank = settings["training"]["lowrank_from"]
    assert lowrank["rank"] == 2 and lowrank["tuned"] == str(tuned)
    assert lowrank["tuned_from"] == "runs/warm_start" and lowrank["tuned_steps"] == 7
    assert "budget_choice" not in settings

    # exported over a shipped adapter: the account of its budgets (written from a budget study) stays
    settings["budget_choice"] = "documents think 0 tokens: measured"
    (shipped / "grace_settings.json").write_text(json.dumps(settings), encoding="utf-8")
    again = json.loads((export(tmp_path / "adapter", shipped) / "grace_settings.json").read_text(encoding="utf-8"))
    assert again["budget_choice"] == "documents think 0 tokens: measured"
