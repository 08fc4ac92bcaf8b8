"""Our calls into transformers use its current API: ``encode`` (GRACE and GIRCSE, every decoding path),
``explain``, ``grace-st encode`` and the training pass run without a single warning.

transformers 5.x renamed the KV cache argument and output field (``past_key_values`` → ``cache``) and
gradient checkpointing (→ activation checkpointing), warning on the old names; grace_st.runtime.transformers_compat
passes each under the name the installed release takes. Models are built (and PEFT adapters attached, which
reads transformers' deprecated ``is_gradient_checkpointing`` inside PEFT's own code) before recording starts.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import pytest
import torch
from conftest import make_lora_model, make_model, make_st_model, make_tokenizer

import grace_st
from grace_st.runtime.decoding import DecodeOptions

TEXTS = [
    "The cat sat on the mat and looked at the garden.",
    "Stock markets fell sharply after the central bank raised interest rates again.",
    "",
]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@contextlib.contextmanager
def no_warnings():
    """Fail on any warning raised in the block (each shown, not only a first one), and on transformers
    logging one of its deprecations (``past_key_values``/``cache_params`` read from an output)."""
    handler = _Records()
    transformers_logger = logging.getLogger("transformers")
    transformers_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        transformers_logger.removeHandler(handler)
    shown = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]
    shown += [f"transformers logged: {r.getMessage()}" for r in handler.records if "deprecated" in r.getMessage()]
    assert not shown, "warned:\n" + "\n".join(shown)


def _encode_all_ways(model) -> None:
    model.encode(TEXTS, batch_size=4)
    model.encode(TEXTS, batch_size=1)  # single-row decoding
    model.encode_query(TEXTS[:2])
    model.encode_document(TEXTS[:2])


@pytest.mark.parametrize(
    "settings",
    [
        {"max_rationale_tokens": 4},
        {"max_rationale_tokens": {"default": 3, "query": 5, "document": 0}},
        {"max_rationale_tokens": 4, "hidden_layer": 1},
        {"max_rationale_tokens": 3, "do_sample": True, "seed": 7, "num_rationales": 2},
        {"method": "gircse", "max_rationale_tokens": 3},
        {"method": "gircse", "max_rationale_tokens": 3, "hidden_layer": 1},
    ],
    ids=["grace", "grace-per-type", "grace-layer", "grace-sampled", "gircse", "gircse-layer"],
)
def test_encode_and_explain_warn_nothing(settings):
    model = make_st_model(**settings)
    with no_warnings():
        _encode_all_ways(model)
        explained = grace_st.explain(model, TEXTS[:2])
    assert len(explained) == 2


@pytest.mark.parametrize(
    "options",
    [
        DecodeOptions(native_step=False),
        DecodeOptions.plain(),
        DecodeOptions(share_prefix=False, native_step=False),
        DecodeOptions(decode_rows=1),
    ],
    ids=["native-step-off", "plain", "no-shared-prefix", "continuous-batching"],
)
def test_every_decoding_path_warns_nothing(options):
    model = make_st_model(max_rationale_tokens=4)
    model[0].decode_options = options
    with no_warnings():
        _encode_all_ways(model)
        grace_st.explain(model, TEXTS[:2])


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "peft-forward"])
def test_a_lora_model_warns_nothing(merge):
    tokenizer = make_tokenizer()
    lora = make_lora_model(tokenizer, seed=3)  # PEFT reads is_gradient_checkpointing here: outside the check
    model = grace_st.from_causal_lm(model=lora, tokenizer=tokenizer, device="cpu", max_rationale_tokens=4)
    model[0].decode_options = DecodeOptions(merge_adapters=merge, native_step=merge)
    with no_warnings():
        _encode_all_ways(model)


def test_loading_a_merged_lora_adapter_directory_warns_nothing(tmp_path):
    """A saved base + LoRA adapter loads merged (``merge_adapter: true``, the default) through PEFT's tuner,
    not PeftModel, whose constructor reads transformers' deprecated ``is_gradient_checkpointing``."""
    from peft import LoraConfig, get_peft_model

    tokenizer = make_tokenizer()
    make_model(tokenizer).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    model = grace_st.from_causal_lm(str(tmp_path / "base"), device="cpu", max_rationale_tokens=4)
    model[0].model = get_peft_model(model[0].model, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    model.save(str(tmp_path / "lora"))  # PeftModel built above, outside the check
    with no_warnings():
        loaded = grace_st.load(str(tmp_path / "lora"), device="cpu")
        _encode_all_ways(loaded)
    assert loaded[0].merge_adapter and not hasattr(loaded[0].model, "peft_config")


def test_grace_st_encode_warns_nothing(tmp_path, capsys):
    from grace_st.cli import main

    path = str(tmp_path / "model")
    make_st_model(max_rationale_tokens=4).save(path)
    with no_warnings():
        assert main(["encode", "The cat sat.", "Markets fell.", "--model", path]) == 0
        assert main(["encode", "The cat sat.", "--model", path, "--json", "--method", "gircse"]) == 0
    assert "cosine similarity" in capsys.readouterr().out


def test_the_training_pass_warns_nothing():
    """The shared-prompt update pass (its prompts' KV cache read from one output, fed to the next call),
    its backward, and activation checkpointing turned on."""
    from grace_st.runtime.transformers_compat import enable_activation_checkpointing
    from grace_training.algorithms.grpo.loss import build_policy_batch, grpo_loss, policy_pass

    tokenizer = make_tokenizer()
    model = make_lora_model(tokenizer, seed=1)
    plain = make_model(tokenizer)
    prompts = [[3, 20, 21, 22, 23]] * 2 + [[3, 30]]
    rationales, stops = [[40, 41, 42], [50], [60, 61]], [tokenizer.eos_token_id, -1, -1]
    batch = build_policy_batch(prompts, rationales, stops, tokenizer.pad_token_id, [1] * 3, share_prompts=True)
    with no_warnings():
        log_probs, pooled, text_logits = policy_pass(model, batch, 0.7, pool_from=model, text=True)
        loss, _ = grpo_loss(log_probs, log_probs.detach(), torch.tensor([0.5, -0.5, 0.0]), batch["completion_mask"])
        (loss + pooled.pow(2).sum()).backward()
        enable_activation_checkpointing(plain)
    assert text_logits is not None and any(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
    assert any(getattr(m, "gradient_checkpointing", False) for m in plain.modules())


def test_a_lora_policy_is_attached_without_a_warning():
    """``grace-train``'s LoRA policy: PEFT reads transformers' deprecated ``is_gradient_checkpointing`` when it wraps
    the base; that warning is PEFT's, not the user's, and the run prints none."""
    from grace_training.config.train_config import TrainConfig
    from grace_training.policy import add_lora_adapter

    model = make_model(make_tokenizer())
    with no_warnings():
        policy = add_lora_adapter(model, TrainConfig(finetune="lora", lora_r=2, lora_alpha=4))
    assert hasattr(policy, "peft_config")
