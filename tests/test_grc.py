"""GRC (grc.md): latent tokens after the response embed the text, their keys and values are its memory, and
Eq. 5 trains all three in one masked pass; on tiny random models."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import load_benchmark, make_model, make_st_model, make_tokenizer
from sentence_transformers import SentenceTransformer
from test_training_quality import saved_base
from test_training_trainer import DATA, config

import grace_st
from grace_st.memory import memory_prompt
from grace_st.methods.grc import LatentTokens, latent_pass, segment_mask, turn_logits
from grace_st.runtime.decoding import DecodeOptions
from grace_st.runtime.model_view import ModelView
from grace_training.data.examples import Triplet
from grace_training.trainer import Trainer

TEXTS = ["The cat sat on the mat.", "Stock markets fell sharply after the central bank raised rates again."]
BUDGETS = {"default": 4, "query": 4, "document": 0}


def grc_model(layers: int = 2, **settings):
    settings = {"method": "grc", "num_latent_tokens": 3, "max_rationale_tokens": dict(BUDGETS), **settings}
    if layers == 2:
        return make_st_model(**settings)
    tokenizer = make_tokenizer()
    return grace_st.from_causal_lm(model=make_model(tokenizer, layers=layers), tokenizer=tokenizer, device="cpu", **settings)


def test_the_embedding_is_the_mean_of_a_over_the_latents_final_states_after_the_response():
    """Restated without the package's pass: one unpadded row, P(x) ⊕ y then the latents, causal; e = L2(mean A(h))."""
    model = grc_model()
    encoder = model[0]
    with torch.no_grad():  # a trained-looking adapter, so A is not the identity
        encoder.latent_tokens.adapter.weight.add_(0.1 * torch.randn_like(encoder.latent_tokens.adapter.weight))
    with torch.no_grad():
        out = encoder(encoder.preprocess(TEXTS, task="query"))
    for i, text in enumerate(TEXTS):
        prompt = encoder.prompt_token_ids([text], task="query")[0][0]
        response = [t for t in out["rationale_token_ids"][i, 0].tolist() if t >= 0]
        ids = torch.tensor([prompt + response])
        table = encoder.model.get_input_embeddings()
        sequence = torch.cat([table(ids), encoder.latent_tokens.latents[None]], dim=1)
        with torch.no_grad():
            states = encoder.model.get_decoder()(inputs_embeds=sequence).last_hidden_state[0, -3:]
            expected = F.normalize(encoder.latent_tokens.adapter(states).mean(0), dim=-1)
        torch.testing.assert_close(F.normalize(out["sentence_embedding"][i], dim=-1), expected, atol=2e-5, rtol=1e-4)


def test_documents_answer_none_and_queries_think_and_the_embedding_is_deterministic_alone_or_batched():
    model = grc_model()
    documents = grace_st.explain(model, TEXTS, task="document")
    assert [item["rationale"] for item in documents] == ["None", "None"]
    queries = grace_st.explain(model, TEXTS, task="query")
    assert all(item["rationale_budget"] == 4 for item in queries)
    batched = model.encode(TEXTS, convert_to_tensor=True)
    alone = torch.stack([model.encode([text], convert_to_tensor=True)[0] for text in TEXTS])
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(model.encode(TEXTS, convert_to_tensor=True), batched, atol=0, rtol=0)
    assert torch.allclose(batched.norm(dim=1), torch.ones(2))


@pytest.mark.parametrize(
    "options",
    [DecodeOptions(), DecodeOptions(native_step=False), DecodeOptions(share_prefix=False, dedupe_prompts=False)],
    ids=["native", "pytorch", "no-shared-prefix"],
)
def test_encode_and_compress_feed_the_latents_as_a_prompt_pass_equal_to_the_masked_pass(options):
    """``encode`` and ``compress`` run the pass as a rationale's prompt pass (shared prefix, padding skipped, the
    native kernels where they apply): the training pass's embeddings, memories and positions to float32 rounding,
    a duplicated row included; on the native kernels a text's embedding is the same bits alone or batched."""
    encoder = grc_model()[0]
    rows, _ = encoder.prompt_token_ids([*TEXTS, TEXTS[0], "A third text, longer than the others by far."], task="query")
    rows = [row + encoder.tokenizer.encode("None") for row in rows]
    view = dataclasses.replace(encoder.engine.view, options=options)
    kwargs = {"with_memory": True}
    with torch.no_grad():
        masked = latent_pass(view, encoder.latent_tokens, rows, **kwargs)
        fed = latent_pass(view, encoder.latent_tokens, rows, prompt_pass=True, **kwargs)
        alone = [latent_pass(view, encoder.latent_tokens, [row], prompt_pass=True, **kwargs) for row in rows]
    torch.testing.assert_close(fed.embeddings, masked.embeddings, atol=1e-5, rtol=1e-4)
    for mine, theirs in zip(fed.memories, masked.memories):
        assert mine.next_position == theirs.next_position and mine.nbytes == theirs.nbytes
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-4)
    if options.native_step:
        assert torch.equal(torch.cat([one.embeddings for one in alone]), fed.embeddings)
        assert torch.equal(fed.embeddings[0], fed.embeddings[2])


def test_segment_3_never_attends_to_segment_1():
    """One layer: the latents' keys and values are their own embeddings', so with the cut a change to ❶'s tokens
    cannot reach ❸'s logits, while it does reach the latents' states (the embedding)."""
    encoder = grc_model(layers=1)[0]
    tokenizer, head = encoder.tokenizer, encoder.model.get_output_embeddings()
    suffix = [memory_prompt(encoder, "What were we discussing earlier?") + tokenizer.encode("a cat")]
    first = [tokenizer.encode("The cat sat on the mat.")]
    second = [[(token + 7) % len(tokenizer) for token in first[0]]]  # other tokens, the same positions
    with torch.no_grad():
        one, two = (
            head(latent_pass(ModelView(encoder.model), encoder.latent_tokens, prefix, suffix).suffix_states)
            for prefix in (first, second)
        )
        assert torch.equal(one, two)
        assert not torch.equal(
            *(latent_pass(ModelView(encoder.model), encoder.latent_tokens, p).embeddings for p in (first, second))
        )
    real = torch.ones(1, 5, dtype=torch.long)
    allowed = segment_mask(real, torch.tensor([1, 1, 2, 3, 3]), torch.float32)[0, 0] == 0
    assert allowed.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [True, True, True, False, False],
        [False, False, True, True, False],
        [False, False, True, True, True],
    ]


def sliding_grc_model(kind: str, window: int):
    """A tiny GRC model whose layers slide: Mistral's (every layer, by ``sliding_window``) or Qwen2's (the second
    layer only, by ``layer_types``)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = make_tokenizer()
    settings = {
        "vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024, "initializer_range": 0.3,
        "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None,
        "sliding_window": window,
    }
    torch.manual_seed(0)
    if kind == "mistral":
        causal_lm = MistralForCausalLM(MistralConfig(**settings))
    else:
        causal_lm = Qwen2ForCausalLM(Qwen2Config(**settings, use_sliding_window=True, max_window_layers=1))
        assert causal_lm.config.layer_types == ["full_attention", "sliding_attention"]
    return grace_st.from_causal_lm(
        model=causal_lm.eval(), tokenizer=tokenizer, device="cpu", method="grc", num_latent_tokens=3,
        max_rationale_tokens=dict(BUDGETS),
    )


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_the_masked_pass_slides_as_the_model_does_for_texts_longer_than_its_window(kind):
    """Training's masked pass applies the model's sliding window as ``encode``'s prompt pass and a memory's reading
    do: the same embeddings, and ❸'s logits those of the turn read after the memory ``compress`` gives."""
    window = 8
    model = sliding_grc_model(kind, window)
    encoder = model[0]
    rows, _ = encoder.prompt_token_ids(TEXTS, task="document")
    rows = [row + encoder.tokenizer.encode("None") for row in rows]
    assert min(map(len, rows)) > 4 * window
    turn = memory_prompt(encoder, "What were we discussing earlier?")
    view = dataclasses.replace(encoder.engine.view, options=DecodeOptions())
    with torch.no_grad():
        masked = latent_pass(view, encoder.latent_tokens, rows, [turn, turn])
        fed = latent_pass(view, encoder.latent_tokens, rows, prompt_pass=True)
    torch.testing.assert_close(masked.embeddings, fed.embeddings, atol=1e-5, rtol=1e-4)
    encoded = model.encode_document(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(F.normalize(masked.embeddings, dim=-1), encoded, atol=1e-5, rtol=1e-4)
    memories = grace_st.compress(model, TEXTS)
    head = encoder.model.get_output_embeddings()
    for row, memory in enumerate(memories):
        read = turn_logits(encoder.model, turn, [memory])
        torch.testing.assert_close(head(masked.suffix_states[row]), read, atol=2e-5, rtol=1e-4)


def test_grc_trains_a_sliding_window_model_and_refuses_layers_it_cannot_mask(tmp_path):
    from grace_training.config.train_config import ConfigError

    model = sliding_grc_model("qwen2", 8)
    trainer = Trainer(grc_config(tmp_path, "sliding", 1, finetune="full"), model=model, train_data=DATA)
    metrics = trainer.training_step(trainer.batch_for_step(0), 0)
    assert all(math.isfinite(metrics[f"loss/{name}"]) for name in ("generation", "reconstruction", "representation"))
    chunked = grc_model()
    chunked[0].model.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ConfigError, match="algorithm: grc: .* layers of kind chunked_attention"):
        Trainer(grc_config(tmp_path, "chunked", 1), model=chunked, train_data=DATA)


def test_training_reconstruction_reads_the_memory_compress_gives():
    """❸'s logits in the training pass equal those of the same turn decoded after the memory alone (two layers:
    the latents' deeper keys carry ❶), so what Eq. 3 trains is what ``answer`` uses."""
    model = grc_model()
    encoder = model[0]
    [memory] = grace_st.compress(model, TEXTS[:1])
    prompt = encoder.prompt_token_ids(TEXTS[:1], task="document")[0][0] + encoder.tokenizer.encode("None")
    turn = memory_prompt(encoder, "What were we discussing earlier?")
    head = encoder.model.get_output_embeddings()
    with torch.no_grad():
        trained = head(latent_pass(ModelView(encoder.model), encoder.latent_tokens, [prompt], [turn]).suffix_states)
    torch.testing.assert_close(turn_logits(encoder.model, turn, [memory])[None], trained, atol=2e-5, rtol=1e-4)
    assert memory.next_position == len(prompt) + 3


def test_several_memories_are_read_as_a_set_each_at_its_own_positions():
    """Each memory keeps the rotary positions it was made at, so the order they are given in does not change
    the reading; a second memory does change it."""
    model = grc_model()
    encoder = model[0]
    first, second = grace_st.compress(model, TEXTS[:2])
    question = "What were we discussing earlier?"
    turn = memory_prompt(encoder, question)
    both = turn_logits(encoder.model, turn, [first, second])
    torch.testing.assert_close(turn_logits(encoder.model, turn, [second, first]), both, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(turn_logits(encoder.model, turn, [first]), both, atol=1e-4)
    assert grace_st.answer(model, question, [first, second], max_new_tokens=6) == grace_st.answer(
        model, question, [second, first], max_new_tokens=6
    )


def test_the_memory_benchmark_scores_a_text_read_from_its_own_memory_by_the_training_loss():
    """benchmarks/grc_memory.py's teacher-forced L_Recons: the training pass and loss, one text at a time, and the
    memory read is the one named (another text's changes the loss; its own gives the batch's value again)."""
    from grace_training.algorithms.grc.loss import reconstruction_turns, token_loss

    bench = load_benchmark("grc_memory")
    model = grc_model()
    encoder = model[0]
    own = bench.reconstruction_losses(model, TEXTS, [0, 1])
    swapped = bench.reconstruction_losses(model, TEXTS, [1, 0])
    assert all(math.isfinite(x) for x in own + swapped) and own != swapped
    assert bench.reconstruction_losses(model, TEXTS, [0, 1]) == own  # deterministic
    prefix = encoder.prompt_token_ids(TEXTS[:1], task="document")[0][0] + encoder.tokenizer.encode("None")
    [turn], [start] = reconstruction_turns(encoder, TEXTS[:1], 0, 128)
    with torch.no_grad():
        out = latent_pass(encoder.engine.view, encoder.latent_tokens, [prefix], [turn])
        expected = token_loss(encoder.model.get_output_embeddings(), out.suffix_states, [turn], [(start, len(turn))])
    assert own[0] == pytest.approx(expected.item(), rel=1e-5)
    # answer's reading of the memories gives the training loss too, and a second memory changes it
    rows = bench.several_memories(model, TEXTS, per_source=2, lengths=bench.token_counts(model, TEXTS))
    assert [r["own"] for r in rows] == pytest.approx(own, rel=1e-4)
    assert [r["other"] for r in rows] == pytest.approx(swapped, rel=1e-4)
    assert all(r["both"] not in (r["own"], r["other"]) for r in rows)


def test_a_memory_is_the_same_size_for_any_text_and_answers_from_one_or_several(tmp_path):
    model = grc_model()
    config = model[0].model.config
    memories = grace_st.compress(model, ["a", " ".join(["long text"] * 40)])
    expected = 2 * config.num_hidden_layers * config.num_key_value_heads * (config.hidden_size // 4) * 3 * 4  # Eq. 6
    assert [memory.nbytes for memory in memories] == [expected, expected]
    assert memories[0].keys.shape == (config.num_hidden_layers, config.num_key_value_heads, 3, config.hidden_size // 4)
    grace_st.save_memories(tmp_path / "m.safetensors", memories, texts=["a", "b"])
    loaded = grace_st.load_memories(tmp_path / "m.safetensors")
    assert [m.next_position for m in loaded] == [m.next_position for m in memories]
    assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) for a, b in zip(loaded, memories))
    one = grace_st.answer(model, "What was it about?", loaded[:1], max_new_tokens=6)
    assert one == grace_st.answer(model, "What was it about?", memories[:1], max_new_tokens=6)
    assert isinstance(grace_st.answer(model, "What was it about?", loaded, max_new_tokens=6), str)
    assert isinstance(grace_st.answer(model, "What?", context="a cat", max_new_tokens=6), str)
    with pytest.raises(ValueError, match="method 'grc'"):
        grace_st.compress(make_st_model(), ["a"])
    with pytest.raises(ValueError, match="question"):
        grace_st.answer(model, "  ", memories)
    (tmp_path / "other.safetensors").write_bytes((tmp_path / "m.safetensors").read_bytes()[:40])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        grace_st.load_memories(tmp_path / "other.safetensors")
    model.save(str(tmp_path / "model"))
    with pytest.raises(ValueError, match="not a latent memory file"):
        grace_st.load_memories(tmp_path / "model" / "latent_tokens.safetensors")


def test_save_and_load_keep_the_latents_and_refuse_edited_ones(tmp_path):
    model = grc_model()
    before = model.encode(TEXTS, convert_to_tensor=True)
    model.save(str(tmp_path / "m"))
    loaded = grace_st.load(str(tmp_path / "m"))
    assert loaded[0].method == "grc" and loaded[0].num_latent_tokens == 3
    torch.testing.assert_close(loaded.encode(TEXTS, convert_to_tensor=True), before, atol=0, rtol=0)
    edited = LatentTokens.load(tmp_path / "m")
    with torch.no_grad():
        edited.latents.add_(1.0)
    edited.save(tmp_path / "m")
    with pytest.raises(ValueError, match="weights_revision"):
        grace_st.load(str(tmp_path / "m"))
    with pytest.raises(ValueError, match="cannot be resized"):
        loaded[0].num_latent_tokens = 5
        loaded[0].check_settings()


def test_grc_through_the_rationale_cache_the_cli_and_mteb(tmp_path, capsys):
    from grace_st.cli import main

    model = grc_model()
    path = str(tmp_path / "model")
    model.save(path)
    plain = model.encode_query(TEXTS)
    model[0].set_rationale_cache(tmp_path / "cache.sqlite")
    assert (model.encode_query(TEXTS) == plain).all() and (model.encode_query(TEXTS) == plain).all()
    assert main(["compress", TEXTS[0], TEXTS[1], "--model", path, "--out", str(tmp_path / "mem.safetensors")]) == 0
    assert "2 memories of" in capsys.readouterr().out
    assert main(["ask", "What was it?", "--model", path, "--memory", str(tmp_path / "mem.safetensors"),
                 "--max-new-tokens", "3"]) == 0
    assert main(["compress", "a", "--model", path, "--out", str(tmp_path)]) == 2
    assert f"{tmp_path}: a directory" in capsys.readouterr().err
    pytest.importorskip("mteb")
    from test_evaluation import beir_dir, run, scores_of

    from grace_st.evaluation import retrieval_task

    assert 0 <= scores_of(run(model, retrieval_task(beir_dir(tmp_path))), "train")["ndcg_at_10"] <= 1
    import sentence_transformers

    if int(sentence_transformers.__version__.split(".")[0]) < 6:
        return  # the retriever integrations rely on sentence-transformers 6.x
    from test_budgets import assert_retrievers_embed_as

    model[0].set_rationale_cache(None)
    query, documents = model.encode_query(TEXTS[0]), model.encode_document(TEXTS)
    assert_retrievers_embed_as(path, TEXTS, query, documents, atol=2e-4)


def grc_config(tmp_path, out, steps, **overrides):
    return config(
        tmp_path, algorithm="grc", max_rationale_tokens=dict(BUDGETS), num_latent_tokens=3, max_steps=steps,
        save_steps=1, learning_rate=1e-2, output_dir=str(tmp_path / out), **{"finetune": "lora", **overrides},
    )


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_a_grc_run_logs_each_loss_checkpoints_a_grc_model_and_resumes_bit_identically(tmp_path, finetune):
    base = saved_base(tmp_path)
    start = base[0]
    result = Trainer(grc_config(tmp_path, "run", 2, finetune=finetune), model=base, train_data=DATA).train()
    metrics = result["metrics"]
    assert {"loss/generation", "loss/reconstruction", "loss/representation", "time/step_cpu_s"} <= metrics.keys()
    assert all(math.isfinite(value) for value in metrics.values())
    texts = 2 * (1 + 1 + 1)  # batch_size 2: a query, a positive and a negative each
    assert isinstance(metrics["batch/tokens"], int) and metrics["batch/tokens"] > texts * 3  # beyond the m = 3 latents
    report = load_benchmark("training_report").report(tmp_path / "run", window=1)
    assert "L_Recons" in report and "| 2–2 |" in report
    assert "| toy | 2 |" in report  # the step cost by source: both steps drew the one source
    fresh = LatentTokens.initialised(3, start.model.get_input_embeddings().weight)
    assert not torch.equal(start.latent_tokens.latents, fresh.latents)  # the latents trained
    assert not torch.equal(start.latent_tokens.adapter.weight, fresh.adapter.weight)  # and A
    checkpoint = tmp_path / "run" / "checkpoint-00000002"
    loaded = SentenceTransformer(str(checkpoint), trust_remote_code=True, device="cpu")
    assert loaded[0].method == "grc" and (checkpoint / "latent_tokens.safetensors").is_file()
    assert "A GRC generative embedding model" in (checkpoint / "README.md").read_text()
    torch.testing.assert_close(
        torch.as_tensor(loaded.encode(TEXTS)), torch.as_tensor(base.encode(TEXTS)), atol=1e-5, rtol=1e-4
    )

    resumed_config = functools.partial(grc_config, tmp_path, "resumed", finetune=finetune)
    Trainer(resumed_config(1), model=saved_base(tmp_path), train_data=DATA).train()
    second = Trainer(resumed_config(2), model=saved_base(tmp_path), train_data=DATA)
    second.train(resume=True)
    trained = "lora_" if finetune == "lora" else ""
    straight = {k: v for k, v in base[0].model.state_dict().items() if trained in k}
    again = {k: v for k, v in second.policy.state_dict().items() if trained in k}
    assert straight and straight.keys() == again.keys() and all(torch.equal(again[k], v) for k, v in straight.items())
    latents, resumed = start.latent_tokens.state_dict(), second.encoder.latent_tokens.state_dict()
    assert all(torch.equal(resumed[k], v) for k, v in latents.items())


def test_grc_trains_cosent_on_scored_pairs_and_refuses_grpo_keys(tmp_path):
    from grace_training.config.train_config import ConfigError

    pairs = [Triplet(DATA[i].query, DATA[i].positive, (), "sts", symmetric=True, score=float(i % 5)) for i in range(8)]
    cfg = grc_config(tmp_path, "sts", 1, batch_sampling="by_source")
    trainer = Trainer(cfg, model=make_st_model(), train_data=pairs)
    metrics = trainer.training_step(trainer.batch_for_step(0), 0)
    assert metrics["loss/representation"] > 0 and metrics["loss/reconstruction"] > 0
    with pytest.raises(ConfigError, match="would be ignored: contrastive_beta"):
        grc_config(tmp_path, "bad", 1, contrastive_beta=1.0).validate()


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_start_targets_are_the_start_models_answers_however_far_the_policy_moved(tmp_path, finetune):
    from grace_training.algorithms.grc.loss import response_targets

    base = grc_model()
    encoder = base[0]
    rows, span = encoder.prompt_token_ids(TEXTS, task="query")
    before = encoder.engine.responses(rows, span, 6)
    cfg = grc_config(tmp_path, "start", 1, grc_response_targets="start", finetune=finetune)
    trainer = Trainer(cfg, model=base, train_data=DATA)
    moved = "lora_B" if finetune == "lora" else "weight"  # a policy far from where it started answers otherwise
    with torch.no_grad():
        for name, parameter in encoder.model.named_parameters():
            if moved in name:
                parameter.add_(torch.randn_like(parameter))
    # under full fine-tuning the start model is the trainer's frozen copy (with LoRA: the adapter disabled)
    assert (trainer.reference is None) == (finetune == "lora")
    assert response_targets(encoder, rows, span, 6, "policy") != before
    assert response_targets(encoder, rows, span, 6, "start", trainer.reference) == before
    assert encoder.engine.responses(rows, span, 6) != before  # the frozen copy answered; the encoder's model is the policy
    metrics = trainer.training_step(trainer.batch_for_step(0), 0)
    assert math.isfinite(metrics["loss/generation"]) and metrics["loss/generation"] > 0


def test_the_generation_loss_is_taken_on_the_response_tokens_each_from_the_state_before_it():
    """The model's own greedy response costs less than the same tokens reversed: the positions line up."""
    from grace_training.algorithms.grc.loss import token_loss

    encoder = grc_model()[0]
    rows, span = encoder.prompt_token_ids(TEXTS, task="query")
    made = encoder.engine.responses(rows, span, 6)
    losses = []
    for ys in (made, [list(reversed(y)) for y in made]):
        prefixes = [row + y for row, y in zip(rows, ys)]
        with torch.no_grad():
            out = latent_pass(encoder.engine.view, encoder.latent_tokens, prefixes)
        width = out.prefix_states.shape[1]
        laid_out = [[-1] * (width - len(p)) + p for p in prefixes]
        head = encoder.model.get_output_embeddings()
        losses.append(token_loss(head, out.prefix_states, laid_out, [(width - len(y), width) for y in ys]).item())
    assert losses[0] < losses[1] - 1


def test_a_grc_checkpoint_exports_with_its_latents_and_builds_the_grc_default(tmp_path, monkeypatch):
    import json

    from peft import LoraConfig, get_peft_model

    from grace_st import default_model as dm
    from grace_training.config.train_config import TrainConfig
    from grace_training.tools.export_adapter import export

    base = grc_model()
    base.save(str(tmp_path / "base"))
    trained = grc_model()
    with torch.no_grad():  # latents unlike the base's: the build must take the adapter's, not make its own
        trained[0].latent_tokens.latents.add_(1.0)
    checkpoint = tmp_path / "checkpoint"
    get_peft_model(trained[0].model, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear")).save_pretrained(checkpoint)
    trained[0].latent_tokens.save(checkpoint)
    (checkpoint / "grace_config.json").write_text(json.dumps(trained[0].get_config_dict()))
    (checkpoint / "trainer_state").mkdir()
    state = {"config": TrainConfig(algorithm="grc", finetune="lora").to_dict(), "step": 3}
    (checkpoint / "trainer_state" / "state.json").write_text(json.dumps(state))

    adapter = export(checkpoint, tmp_path / "grc_adapter")
    settings = json.loads((adapter / dm.ADAPTER_SETTINGS).read_text())["encoder"]
    assert (settings["method"], settings["num_latent_tokens"]) == ("grc", 3)
    assert (adapter / "latent_tokens.safetensors").read_bytes() == (checkpoint / "latent_tokens.safetensors").read_bytes()
    monkeypatch.setitem(dm.ADAPTER_DIRS, "grc", adapter)
    monkeypatch.setattr(dm, "_base_model_path", lambda home=None: str(tmp_path / "base"))
    path = dm.default_model_path(tmp_path / "home", method="grc")
    assert "grc-trained" in path
    model = SentenceTransformer(path, device="cpu", trust_remote_code=True)
    assert model[0].method == "grc"
    torch.testing.assert_close(model[0].latent_tokens.latents, trained[0].latent_tokens.latents)
    torch.testing.assert_close(
        torch.as_tensor(model.encode(TEXTS)), torch.as_tensor(trained.encode(TEXTS)), atol=1e-5, rtol=1e-4
    )
