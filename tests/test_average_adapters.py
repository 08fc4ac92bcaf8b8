"""grace_training.tools.average_adapters: the mean of LoRA checkpoints' weight deltas, saved as a checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from sentence_transformers import SentenceTransformer
from test_training_quality import saved_base
from test_training_trainer import DATA, config

from grace_training.tools.average_adapters import average_adapters
from grace_training.tools.export_adapter import export
from grace_training.trainer import Trainer

TEXTS = ["The cat sat on the mat.", "Stock markets fell sharply after the central bank raised rates again."]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("average")
    cfg = config(tmp_path, finetune="lora", max_steps=2, save_steps=1, learning_rate=5e-2, max_rationale_tokens=3)
    Trainer(cfg, model=saved_base(tmp_path), train_data=DATA).train()
    return tmp_path / "run"


def weights(path) -> dict[str, torch.Tensor]:
    """The weights a saved checkpoint encodes with: W + ΔW, its adapter merged at load."""
    return SentenceTransformer(str(path), trust_remote_code=True, device="cpu")[0].model.state_dict()


def test_the_average_is_the_mean_of_the_weight_deltas_and_loads_as_a_model(run, tmp_path):
    first, second = run / "checkpoint-00000001", run / "checkpoint-00000002"
    # rank 16 holds the sum of two rank-8 deltas exactly, so the cut loses nothing
    summary = average_adapters([first, second], tmp_path / "avg", rank=16)
    assert summary["relative_cut_error"] < 1e-5 and summary["relative_distance_to_mean"][0] > 0
    # W + mean ΔW = the mean of the two merged weights
    one, two, mean = weights(first), weights(second), weights(tmp_path / "avg")
    assert one.keys() == mean.keys() and any(not torch.equal(one[name], two[name]) for name in one)
    for name in one:
        torch.testing.assert_close(mean[name], (one[name] + two[name]) / 2, atol=1e-6, rtol=1e-5)
    assert not (tmp_path / "avg" / "trainer_state" / "optimizer.pt").exists()  # nothing resumes from an average

    # at the sources' rank (the default) the cut is measured; a checkpoint averaged with itself is itself
    same = average_adapters([second, second], tmp_path / "same")
    assert same["rank"] == 8 and same["relative_cut_error"] < 1e-5
    expected = SentenceTransformer(str(second), trust_remote_code=True, device="cpu").encode(TEXTS)
    got = SentenceTransformer(str(tmp_path / "same"), trust_remote_code=True, device="cpu").encode(TEXTS)
    torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(expected), atol=1e-5, rtol=1e-4)

    shipped = json.loads((export(tmp_path / "avg", tmp_path / "shipped") / "grace_settings.json").read_text())
    assert shipped["training"]["averaged_from"]["sources"] == [str(first), str(second)]
    assert "mean of 2 checkpoints" in (tmp_path / "avg" / "README.md").read_text()


def test_averaging_refuses_one_source_and_what_is_not_a_checkpoint(run, tmp_path):
    with pytest.raises(SystemExit, match="at least two"):
        average_adapters([run / "checkpoint-00000001"], tmp_path / "out")
    with pytest.raises(SystemExit, match="not a LoRA checkpoint"):
        average_adapters([run / "checkpoint-00000001", tmp_path], tmp_path / "out")


def test_an_adapter_exported_in_bfloat16_is_half_the_bytes_and_loads_its_rounded_weights(run, tmp_path):
    """``export_adapter --bfloat16`` (an r 32 adapter fits the package): the matrices are stored rounded to bfloat16
    and read back into the float32 model as exactly those values."""
    from safetensors.torch import load_file

    from grace_st.default_model import build_trained

    checkpoint = run / "checkpoint-00000002"
    full, half = export(checkpoint, tmp_path / "float32"), export(checkpoint, tmp_path / "bfloat16", bfloat16=True)
    stored = load_file(str(half / "adapter_model.safetensors"))
    exact = load_file(str(full / "adapter_model.safetensors"))
    assert stored.keys() == exact.keys() and all(value.dtype == torch.bfloat16 for value in stored.values())
    assert all(torch.equal(stored[name], exact[name].to(torch.bfloat16)) for name in exact)
    assert (half / "adapter_model.safetensors").stat().st_size < 0.6 * (full / "adapter_model.safetensors").stat().st_size

    saved_base(tmp_path / "fresh").save(str(tmp_path / "grace_base"))
    build_trained(str(tmp_path / "grace_base"), tmp_path / "built", half)
    # the cached default holds the shipped bytes; loading upcasts them, as PEFT does
    assert (tmp_path / "built" / "adapter_model.safetensors").read_bytes() == (half / "adapter_model.safetensors").read_bytes()
    loaded = SentenceTransformer(str(tmp_path / "built"), trust_remote_code=True, device="cpu")
    assert all(p.dtype == torch.float32 for p in loaded[0].model.parameters())
    reference = SentenceTransformer(str(checkpoint), trust_remote_code=True, device="cpu")
    loaded[0].max_input_tokens = reference[0].max_input_tokens  # the export sets the shipped 512; these texts are short
    cosine = torch.nn.functional.cosine_similarity(
        torch.as_tensor(loaded.encode(TEXTS)), torch.as_tensor(reference.encode(TEXTS))
    )
    assert cosine.min() > 0.99


def test_an_exported_adapter_carries_the_repetition_penalty_the_default_decodes_with(run, tmp_path):
    from grace_st.default_model import ADAPTER_SETTINGS, build_trained

    plain = export(run / "checkpoint-00000002", tmp_path / "plain")
    assert "repetition_penalty" not in json.loads((plain / ADAPTER_SETTINGS).read_text())["encoder"]
    penalised = export(run / "checkpoint-00000002", tmp_path / "penalised", repetition_penalty=1.3)
    saved_base(tmp_path / "fresh").save(str(tmp_path / "grace_base"))
    build_trained(str(tmp_path / "grace_base"), tmp_path / "built", penalised)
    assert SentenceTransformer(str(tmp_path / "built"), trust_remote_code=True, device="cpu")[0].repetition_penalty == 1.3


def test_a_soup_of_runs_at_different_ranks_needs_a_rank_and_is_their_mean(run, tmp_path):
    """Last checkpoints of two runs on one base, at LoRA r 8 and r 4: averaged only with ``--rank`` given, and at
    a rank that holds both deltas (8 + 4) the soup's merged weights are the mean of the runs' merged weights."""
    cfg = config(tmp_path, finetune="lora", lora_r=4, lora_alpha=8, max_steps=1, save_steps=1, learning_rate=5e-2,
                 max_rationale_tokens=3, seed=7)
    Trainer(cfg, model=saved_base(tmp_path), train_data=DATA).train()
    other, last = tmp_path / "run" / "checkpoint-00000001", run / "checkpoint-00000002"
    with pytest.raises(SystemExit, match="different LoRA ranks"):
        average_adapters([other, last], tmp_path / "refused")
    summary = average_adapters([other, last], tmp_path / "soup", rank=12)
    assert summary["rank"] == 12 and summary["relative_cut_error"] < 1e-5
    one, two, soup = weights(other), weights(last), weights(tmp_path / "soup")
    for name in one:
        torch.testing.assert_close(soup[name], (one[name] + two[name]) / 2, atol=1e-6, rtol=1e-5)
