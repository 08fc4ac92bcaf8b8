"""GRACE models saved as a base + LoRA adapter: load (merged or apart), exact base with the
adapter disabled, and adapters that do not fit refused with an error naming the mismatch."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_model, make_st_model, make_tokenizer
from peft import LoraConfig, get_peft_model
from sentence_transformers import SentenceTransformer

import grace_st

TEXTS = ["A man is playing a guitar.", "The central bank raised rates."]


def adapter_model(tmp_path, tokenizer=None, folder="grace-lora", **settings):
    """A tiny base saved to disk and a GRACE model around it (``settings``: its encoder's, e.g. another method's)
    with a random (non-zero) LoRA adapter, saved as ``folder``."""
    tokenizer = tokenizer or make_tokenizer()
    base = make_model(tokenizer)
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    settings.setdefault("max_rationale_tokens", 6)
    model = grace_st.from_causal_lm(str(tmp_path / "base"), device="cpu", **settings)
    peft = get_peft_model(model[0].model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in peft.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    model[0].model = peft
    model.save(str(tmp_path / folder))
    return model, tmp_path / folder


def test_adapter_directory_loads_merged_or_apart_and_matches(tmp_path):
    model, path = adapter_model(tmp_path)
    assert (path / "adapter_model.safetensors").is_file() and not (path / "model.safetensors").exists()
    expected = model.encode(TEXTS)
    merged = SentenceTransformer(str(path), trust_remote_code=True, device="cpu")
    assert not hasattr(merged[0].model, "peft_config")
    torch.testing.assert_close(torch.as_tensor(merged.encode(TEXTS)), torch.as_tensor(expected), atol=1e-5, rtol=1e-4)
    apart = SentenceTransformer(str(path), trust_remote_code=True, device="cpu", model_kwargs={})
    apart[0].model = grace_st.files.adapter.load_base_and_adapter(path, merge=False)
    torch.testing.assert_close(torch.as_tensor(apart.encode(TEXTS)), torch.as_tensor(expected), atol=1e-5, rtol=1e-4)
    assert grace_st.explain(merged, TEXTS[:1])[0]["rationale"] == grace_st.explain(model, TEXTS[:1])[0]["rationale"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_merged_weights_are_peft_models_merge_bit_for_bit(tmp_path, dtype):
    """The merge builds PEFT's tuner alone (no PeftModel); its weights, dtypes and config are the ones
    PeftModel.from_pretrained(...).merge_and_unload() gives (a bfloat16 base: adapter upcast the same)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, path = adapter_model(tmp_path)
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=dtype), str(path), is_trainable=False
    )
    reference = reference.eval().merge_and_unload()
    merged = grace_st.files.adapter.load_base_and_adapter(path, model_kwargs={"dtype": dtype})
    assert type(merged) is type(reference) and not hasattr(merged, "peft_config")
    ours, theirs = merged.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype == dtype and torch.equal(ours[name], tensor), name
    assert merged.config.to_dict() == reference.config.to_dict()
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=dtype).state_dict()
    assert not torch.equal(
        ours["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
    )


@pytest.mark.parametrize("damage", ["extra", "lacking"])
def test_adapter_weights_that_do_not_all_load_are_refused(tmp_path, damage):
    from safetensors.torch import load_file, save_file

    _, path = adapter_model(tmp_path)
    file = path / "adapter_model.safetensors"
    weights = load_file(file)
    if damage == "extra":
        weights["base_model.model.model.norm.lora_extra"] = torch.zeros(4)
    else:
        del weights[next(k for k in sorted(weights) if ".lora_B." in k)]
    save_file(weights, file)
    match = "fit no module" if damage == "extra" else "lacks 1 tensors"
    with pytest.raises(ValueError, match=rf"adapter_model.safetensors does not fit its base: .*{match}"):
        grace_st.files.adapter.load_base_and_adapter(path)


def test_merge_adapter_false_is_saved_and_disabled_adapter_is_exactly_the_base(tmp_path):
    _, path = adapter_model(tmp_path)
    config = json.loads((path / "grace_config.json").read_text())
    (path / "grace_config.json").write_text(json.dumps({**config, "merge_adapter": False}))
    apart = SentenceTransformer(str(path), trust_remote_code=True, device="cpu")
    lm = apart[0].model
    assert hasattr(lm, "peft_config")
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    ids = torch.tensor([[1, 5, 9, 14, 20, 33]])
    with torch.no_grad(), lm.disable_adapter():
        disabled = lm(input_ids=ids).logits
        generated = lm.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    with torch.no_grad():
        assert torch.equal(disabled, plain(input_ids=ids).logits)
        assert torch.equal(generated, plain.generate(input_ids=ids, max_new_tokens=5, do_sample=False))
        assert not torch.equal(lm(input_ids=ids).logits, disabled)  # the adapter does something


@pytest.mark.parametrize("method", ["grace", "gircse"])
def test_merge_adapter_false_runs_the_adapter_apart_on_the_fast_path_too(tmp_path, monkeypatch, method):
    """``merge_adapter: false`` asks for the adapter apart: the CPU fast path (packed kernels, native step) must not
    run a LoRA layer on a merged weight, and the embedding is PyTorch's unmerged forward to float32 rounding."""
    from grace_st.runtime.cpu import native_step, packed_linear
    from grace_st.runtime.decoding import DecodeOptions

    _, path = adapter_model(tmp_path)
    config = json.loads((path / "grace_config.json").read_text())
    (path / "grace_config.json").write_text(json.dumps({**config, "merge_adapter": False}))
    apart = SentenceTransformer(str(path), trust_remote_code=True, device="cpu")
    encoder = apart[0]
    encoder.method, encoder.max_rationale_tokens = method, 3 if method == "gircse" else 6
    merges, merge = [], packed_linear._merged_weight

    def merged_weight(module, adapters):
        merges.append(module)
        return merge(module, adapters)

    monkeypatch.setattr(packed_linear, "_merged_weight", merged_weight)
    monkeypatch.setattr(native_step, "_merged_weight", merged_weight)
    encoder.decode_options = DecodeOptions()  # every optimisation asked for, merging included
    assert not encoder.decode_options.merge_adapters
    fast = torch.as_tensor(apart.encode(TEXTS))
    lora = [m for m in encoder.model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    assert lora and not merges and not any(m.merged for m in lora)
    assert not any(m in packed_linear._packed for m in lora)  # no merged packing kept for a LoRA layer
    encoder.decode_options = DecodeOptions.plain()  # PyTorch's own forward through PEFT, nothing packed
    torch.testing.assert_close(fast, torch.as_tensor(apart.encode(TEXTS)), atol=1e-5, rtol=1e-4)
    assert not merges


def test_adapter_directory_is_a_causal_lm_that_generates(tmp_path):
    from transformers import AutoModelForCausalLM

    _, path = adapter_model(tmp_path)
    lm = AutoModelForCausalLM.from_pretrained(path)
    out = lm.generate(input_ids=torch.tensor([[1, 5, 9]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)


def test_adapter_for_another_base_is_refused_naming_the_mismatch(tmp_path):
    _, path = adapter_model(tmp_path)
    from transformers import LlamaForCausalLM

    config = make_model(make_tokenizer()).config
    config.hidden_size, config.intermediate_size = 48, 96  # same architecture, other sizes
    LlamaForCausalLM(config).save_pretrained(tmp_path / "other")
    adapter = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(
        json.dumps({**adapter, "base_model_name_or_path": str(tmp_path / "other")})
    )
    with pytest.raises(ValueError, match=r"does not fit its base.*shape"):
        SentenceTransformer(str(path), trust_remote_code=True, device="cpu")


@pytest.mark.parametrize("damage", ["missing", "corrupt", "pickle-only"])
def test_missing_or_corrupt_adapter_weights_are_refused(tmp_path, damage):
    _, path = adapter_model(tmp_path)
    weights = path / "adapter_model.safetensors"
    if damage == "missing":
        weights.unlink()
        expected = FileNotFoundError
    elif damage == "corrupt":
        weights.write_bytes(weights.read_bytes()[:100])
        expected = ValueError
    else:
        weights.rename(path / "adapter_model.bin")
        expected = FileNotFoundError
    with pytest.raises(expected, match="adapter_model.safetensors"):
        SentenceTransformer(str(path), trust_remote_code=True, device="cpu")


def test_adapter_without_a_findable_base_cannot_be_saved(tmp_path):
    model = make_st_model()  # built in memory: its base has no directory
    model[0].model = get_peft_model(model[0].model, LoraConfig(r=2, target_modules="all-linear"))
    with pytest.raises(ValueError, match="save the base model first"):
        model.save(str(tmp_path / "x"))
