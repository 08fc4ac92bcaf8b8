"""GIRCSE: soft tokens (gircse.md, Algorithm 1, Eqs. 2–6) as an encoder mode, and their training
by Iterative Contrastive Refinement (Eqs. 7–8)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import make_lora_model, make_st_model, make_tokenizer
from sentence_transformers import SentenceTransformer
from test_training_quality import saved_base
from test_training_trainer import DATA, config

import grace_st
from grace_st.methods.gircse import output_logits, soft_token_states
from grace_st.runtime.batch import left_pad
from grace_st.runtime.model_view import ModelView
from grace_training.algorithms.icr.loss import refinement_loss, stepwise_cosent, stepwise_infonce
from grace_training.data.examples import Triplet
from grace_training.trainer import Trainer

TEXTS = ["The cat sat on the mat.", "Stock markets fell sharply after the central bank raised rates again."]


def algorithm_1_without_a_cache(model, ids: list[int], steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1 as written, one unpadded prompt: each step runs the decoder over [X; d_1..d_{k-1}],
    s_k from the last position (Eq. 5), d_k = s_k E (Eq. 6); then one pass over [X; D] gives G (Eq. 3).
    Returns (G (K, H), s (K, V))."""
    table = model.get_input_embeddings().weight
    x = table[torch.tensor(ids)][None]  # (1, N, H)  Eq. 1
    soft, distributions = [], []
    for _ in range(steps):
        sequence = torch.cat([x, *soft], dim=1) if soft else x
        last = model.get_decoder()(inputs_embeds=sequence).last_hidden_state[:, -1]
        s = torch.softmax(model.get_output_embeddings()(last), dim=-1)
        distributions.append(s[0])
        soft.append((s @ table)[:, None])
    states = model.get_decoder()(inputs_embeds=torch.cat([x, *soft], dim=1)).last_hidden_state
    return states[0, len(ids) :], torch.stack(distributions)


def gircse_model(steps=4, **settings):
    return make_st_model(method="gircse", max_rationale_tokens=steps, **settings)


def test_soft_tokens_are_algorithm_1_kv_cached_and_the_embedding_is_the_mean_of_the_generated_states():
    model = gircse_model(steps=4)
    encoder = model[0]
    rows, _ = encoder.prompt_token_ids(TEXTS)
    with torch.no_grad():
        expected = [algorithm_1_without_a_cache(encoder.model, row, 4) for row in rows]
        input_ids, mask = left_pad(rows, encoder.pad_token_id)  # the short prompt is left-padded
        soft = soft_token_states(encoder.engine.view, input_ids, mask, 4)
    for i, (states, distributions) in enumerate(expected):
        torch.testing.assert_close(soft.states[i], states, atol=2e-4, rtol=1e-3)  # left padding: float rounding
        top = distributions.topk(5, dim=-1)
        torch.testing.assert_close(soft.top_probs[i], top.values, atol=1e-5, rtol=1e-4)
    # Eq. 4: the mean of the K generated states only, not the prompt (then normalised); z_k the mean of the first k
    embeddings = model.encode(TEXTS, convert_to_tensor=True)
    for i, (states, _) in enumerate(expected):
        torch.testing.assert_close(embeddings[i], F.normalize(states.mean(0), dim=0), atol=2e-4, rtol=1e-3)
        torch.testing.assert_close(soft.step_embeddings()[i, 1], states[:2].mean(0), atol=2e-4, rtol=1e-3)
    # deterministic, and batch-independent up to float rounding (the packed CPU kernels round a row by the batch's
    # row count, and K soft steps carry it through a vocabulary-wide softmax: 1.5e-5 seen)
    torch.testing.assert_close(model.encode(TEXTS[1:], convert_to_tensor=True)[0], embeddings[1], atol=5e-5, rtol=1e-3)
    assert torch.equal(model.encode(TEXTS, convert_to_tensor=True), embeddings)


def test_k_is_the_budget_by_prompt_type_and_k_0_pools_the_prompt():
    model = gircse_model(steps={"default": 3, "query": 5, "document": 0})
    encoder = model[0]
    query = model.encode_query(TEXTS[:1], output_value=None)[0]
    assert query["soft_token_ids"].shape == (5, 5) and int(query["rationale_budget"]) == 5
    # documents at 0: the prompt after L_sys, as a GRACE model with budget 0 embeds it
    grace = grace_st.from_causal_lm(
        model=encoder.model, tokenizer=encoder.tokenizer, max_rationale_tokens=0, device="cpu"
    )
    torch.testing.assert_close(
        model.encode_document(TEXTS, convert_to_tensor=True),
        grace.encode_document(TEXTS, convert_to_tensor=True),
        atol=1e-5,
        rtol=1e-4,
    )


def test_an_empty_text_that_leaves_nothing_to_embed_is_refused_naming_its_item():
    """The reference format has no template around the text: an empty text under an empty instruction is a prompt
    of no token, and at K = 0 an empty text has no position after the instruction to pool. Both are refused (as
    encode sorts a batch by length, the item is the batch's); the chat format, like GRACE, embeds an empty text
    from the template around it."""
    budgets = {"default": 2, "query": 0, "document": 2}
    model = gircse_model(steps=budgets, prompt_format="instruct", instructions={"document": ""})
    with pytest.raises(ValueError, match=r"item 1 of this batch \(sorted by length\) is an empty text under an empty"):
        model.encode_document(["a text", ""])
    with pytest.raises(ValueError, match=r"item 1 of this batch \(sorted by length\) leaves nothing to pool"):
        model.encode_query(["a text", ""])
    with pytest.raises(ValueError, match="empty text under an empty instruction"):
        grace_st.explain(model, [""], task="document")
    found = model.encode(["", "a text"], convert_to_tensor=True)  # soft tokens follow "Instruct: ...\nQuery:"
    torch.testing.assert_close(found[0], model.encode([""], convert_to_tensor=True)[0], atol=5e-5, rtol=1e-3)
    torch.testing.assert_close(found.norm(dim=-1), torch.ones(2))
    chat = gircse_model(steps=budgets, instructions={"document": ""})
    for call in (chat.encode, chat.encode_query, chat.encode_document):
        assert torch.isfinite(call(["", "a text"], convert_to_tensor=True)).all()
        torch.testing.assert_close(call(["", "a text"], convert_to_tensor=True).norm(dim=-1), torch.ones(2))


def test_explain_gives_each_steps_top_tokens_with_their_probabilities():
    model = gircse_model(steps=3)
    item = grace_st.explain(model, TEXTS[:1])[0]
    trace = item["soft_tokens"]
    assert len(trace) == 3 and all(len(step) == 5 for step in trace)
    for step in trace:
        probs = [p for _, p in step]
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.0001
    # the "rationale" is each step's most probable token
    assert item["rationale"] == "".join(step[0][0] for step in trace)
    assert torch.allclose(
        torch.as_tensor(item["embedding"]), model.encode(TEXTS[:1], convert_to_tensor=True)[0], atol=1e-6
    )


def test_method_is_a_saved_setting_and_gircse_refuses_what_it_cannot_do(tmp_path):
    model = gircse_model(steps=2)
    before = model.encode(TEXTS)
    model.save(str(tmp_path / "m"))
    loaded = SentenceTransformer(str(tmp_path / "m"), device="cpu", trust_remote_code=True)
    assert loaded[0].method == "gircse"
    assert torch.allclose(torch.as_tensor(loaded.encode(TEXTS)), torch.as_tensor(before), atol=1e-6)
    with pytest.raises(ValueError, match="samples nothing"):
        make_st_model(method="gircse", do_sample=True)
    with pytest.raises(ValueError, match="writes no tokens to penalise"):
        make_st_model(method="gircse", repetition_penalty=1.2)
    with pytest.raises(ValueError, match="method must be 'grace', 'gircse' or 'grc'"):
        make_st_model(method="soft")
    with pytest.raises(ValueError, match="vLLM cannot"):
        loaded[0].use_vllm()


def test_the_rationale_cache_is_keyed_by_the_method(tmp_path):
    model = gircse_model(steps=3)
    encoder = model[0]
    encoder.set_rationale_cache(tmp_path / "cache.sqlite")
    first = model.encode(TEXTS, convert_to_tensor=True)
    again = model.encode(TEXTS, convert_to_tensor=True)  # answered from the cache
    torch.testing.assert_close(again, first)
    encoder.method = "grace"
    grace = model.encode(TEXTS, convert_to_tensor=True)  # a GRACE rationale, not the cached soft tokens
    assert not torch.allclose(grace, first, atol=1e-3)


# -- training: Eqs. 7 and 8 ---------------------------------------------------------------------


def test_eq7_stepwise_infonce_by_hand():
    torch.manual_seed(0)
    q, p, n = torch.randn(3, 2, 4), torch.randn(3, 2, 4), torch.randn(2, 2, 4)
    losses = stepwise_infonce(q, p, n, temperature=0.5)
    for k in range(2):
        candidates = torch.cat([p[:, k], n[:, k]])
        by_hand = 0.0
        for i in range(3):
            sims = [float(F.cosine_similarity(q[i, k], c, dim=0)) / 0.5 for c in candidates]
            by_hand += -(sims[i] - math.log(sum(math.exp(s) for s in sims))) / 3
        assert float(losses[k]) == pytest.approx(by_hand, rel=1e-5)
    graded = stepwise_cosent(q, p, torch.tensor([1.0, 3.0, 2.0]), scale=5.0)
    assert graded.shape == (2,) and bool((graded > 0).all())


def test_eq8_is_zero_when_each_step_is_no_worse_and_penalises_a_step_that_is():
    total, contrastive, penalty = refinement_loss(torch.tensor([2.0, 1.5, 1.5, 0.7]), 1.0)
    assert float(penalty) == 0.0 and float(total) == pytest.approx(float(contrastive)) == pytest.approx(5.7 / 4)
    _, _, penalty = refinement_loss(torch.tensor([1.0, 2.0, 1.0]), 1.0)
    assert float(penalty) == pytest.approx(math.log(2.0) / 2, rel=1e-6)
    assert float(refinement_loss(torch.tensor([1.3]), 1.0)[2]) == 0.0


def test_gradients_reach_lora_through_every_soft_step():
    """d_k = s_k E depends on the LoRA weights through h'_{k-1}; the embedding's gradient reaches each d_k."""
    model = make_lora_model(make_tokenizer(), seed=3)
    fed: list[torch.Tensor] = []

    def keep(_module, _args, kwargs):
        if kwargs.get("inputs_embeds") is not None:
            kwargs["inputs_embeds"].retain_grad()
            fed.append(kwargs["inputs_embeds"])

    handle = model.get_decoder().register_forward_pre_hook(keep, with_kwargs=True)
    ids = torch.tensor([[3, 20, 21, 22]])
    soft = soft_token_states(ModelView(model), ids, torch.ones_like(ids), 4)
    handle.remove()
    soft.step_embeddings()[:, -1].pow(2).sum().backward()
    assert len(fed) == 4 and all(d.grad is not None and float(d.grad.abs().sum()) > 0 for d in fed)
    lora = {n: p.grad for n, p in model.named_parameters() if "lora_" in n}
    assert lora and all(g is not None for g in lora.values()) and sum(float(g.abs().sum()) for g in lora.values()) > 0


def test_a_gircse_run_trains_checkpoints_a_gircse_model_and_resumes_bit_identically(tmp_path):
    def gircse_config(out, steps):
        return config(
            tmp_path,
            algorithm="icr",
            finetune="lora",
            max_rationale_tokens=3,
            max_steps=steps,
            save_steps=1,
            learning_rate=1e-2,
            output_dir=str(tmp_path / out),
        )

    base = saved_base(tmp_path)
    before = {k: v.clone() for k, v in base[0].model.state_dict().items() if "lora_" not in k}
    result = Trainer(gircse_config("run", 2), model=base, train_data=DATA).train()
    metrics = result["metrics"]
    assert {
        "loss",
        "loss/contrastive",
        "loss/refinement",
        "loss/step_1",
        "loss/step_3",
        "time/step_cpu_s",
    } <= metrics.keys()
    assert all(math.isfinite(v) for v in metrics.values())
    checkpoint = tmp_path / "run" / "checkpoint-00000002"
    loaded = SentenceTransformer(str(checkpoint), trust_remote_code=True, device="cpu")
    assert loaded[0].method == "gircse" and loaded[0].max_rationale_tokens == 3
    assert "A GIRCSE generative embedding model" in (checkpoint / "README.md").read_text()  # the card says which
    torch.testing.assert_close(
        torch.as_tensor(loaded.encode(TEXTS)), torch.as_tensor(base.encode(TEXTS)), atol=1e-5, rtol=1e-4
    )
    trained = {k.replace(".base_layer", ""): v for k, v in base[0].model.get_base_model().state_dict().items()}
    assert all(torch.equal(trained[k], v) for k, v in before.items())  # only the adapter moved

    # exported as the package ships it, and built as default_model_path(method="gircse") builds it
    from grace_st.default_model import build_trained
    from grace_training.tools.export_adapter import _slice_scores, export

    adapter = export(checkpoint, tmp_path / "gircse_adapter")
    shipped = json.loads((adapter / "grace_settings.json").read_text())
    assert shipped["encoder"]["method"] == "gircse" and shipped["training"]["algorithm"] == "icr"
    saved_base(tmp_path / "fresh").save(str(tmp_path / "grace_base"))  # the untrained base as a GRACE directory
    build_trained(str(tmp_path / "grace_base"), tmp_path / "built", adapter)
    built = SentenceTransformer(str(tmp_path / "built"), trust_remote_code=True, device="cpu")
    built[0].max_input_tokens = loaded[0].max_input_tokens  # the export sets the shipped 512; these texts are short
    torch.testing.assert_close(
        torch.as_tensor(built.encode(TEXTS)), torch.as_tensor(loaded.encode(TEXTS)), atol=1e-5, rtol=1e-4
    )
    assert _slice_scores({"step": 7, "scores": {"eval/stsb/dev/spearman": 0.5, "time/eval_s": 3.0}}) == {
        "dev slice at step 7: stsb/dev/spearman": 0.5
    }

    Trainer(gircse_config("resumed", 1), model=saved_base(tmp_path), train_data=DATA).train()
    second = Trainer(gircse_config("resumed", 2), model=saved_base(tmp_path), train_data=DATA)
    second.train(resume=True)
    straight = {k: v for k, v in base[0].model.state_dict().items() if "lora_" in k}
    again = {k: v for k, v in second.policy.state_dict().items() if "lora_" in k}
    assert straight and all(torch.equal(again[k], v) for k, v in straight.items())


def test_a_gircse_run_refuses_the_grpo_steps_own_keys(tmp_path):
    from grace_training.config.train_config import ConfigError

    with pytest.raises(ConfigError, match="would be ignored: contrastive_beta, text_kl_coef"):
        config(tmp_path, algorithm="icr", contrastive_beta=1.0, text_kl_coef=0.5).validate()


def test_a_gircse_batch_of_scored_pairs_trains_cosent_at_every_step(tmp_path):
    pairs = [Triplet(DATA[i].query, DATA[i].positive, (), "sts", symmetric=True, score=float(i % 5)) for i in range(8)]
    cfg = config(tmp_path, algorithm="icr", max_rationale_tokens=2, batch_sampling="by_source", max_steps=1)
    trainer = Trainer(cfg, model=make_st_model(), train_data=pairs)
    assert trainer.graded_scores(0) is not None
    metrics = trainer.training_step(trainer.batch_for_step(0), 0)
    assert metrics["loss/step_1"] > 0 and metrics["loss/step_2"] > 0


def test_gircse_under_mteb_langchain_llamaindex_and_the_cli(tmp_path, capsys):
    """K by prompt type reaches every caller: mteb's queries and documents, LangChain, LlamaIndex, grace-st.
    (Compared across batches: a left-padded row's soft tokens differ from its unpadded ones by float rounding.)"""
    import json

    import numpy as np
    import sentence_transformers

    from grace_st.cli import main

    budgets = {"query": 4, "document": 2, "default": 3}
    model = gircse_model(steps=dict(budgets))
    path = str(tmp_path / "model")
    model.save(path)
    query, documents = model.encode_query(TEXTS[0]), model.encode_document(TEXTS)
    assert main(["encode", *TEXTS, "--model", path, "--task", "query", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["rationale_budgets"] == [4, 4]
    np.testing.assert_allclose(np.asarray(shown["embeddings"][0]), query, atol=2e-4)
    assert main(["encode", TEXTS[0], "--model", path, "--method", "grace", "--max-rationale-tokens", "2"]) == 0
    pytest.importorskip("mteb")
    from test_evaluation import beir_dir, run, scores_of

    from grace_st.evaluation import retrieval_task

    assert 0 <= scores_of(run(model, retrieval_task(beir_dir(tmp_path))), "train")["ndcg_at_10"] <= 1
    if int(sentence_transformers.__version__.split(".")[0]) < 6:
        return  # the retriever integrations rely on sentence-transformers 6.x
    from test_budgets import assert_retrievers_embed_as

    assert_retrievers_embed_as(path, TEXTS, query, documents, atol=2e-4)


@pytest.mark.parametrize("empty", ["document", "query", "default"])
def test_an_empty_instruction_claims_no_call_made_without_a_prompt(empty):
    """A corpus embedded bare (the reference's `instructions["document"] = ""`) must not turn calls made
    without a prompt into calls of its type: each type keeps its instruction and its K, in encode and in
    training's side embeddings."""
    budgets = {"default": 2, "query": 3, "document": 1}
    model = gircse_model(steps=budgets, instructions={empty: ""})
    plain = gircse_model(steps=budgets)
    encoder = model[0]
    for task in ("query", "document", "default", None):
        kind = task or "default"
        assert encoder.prompt_type(task, None) == kind and encoder.prompt_type(task, "") == kind
        assert encoder.instruction_for(task, None) == encoder.instructions[kind]
        if kind != empty:  # training's sides: the type's own instruction, as without the empty one
            assert encoder.prompt_token_ids(["a text"], task=task) == plain[0].prompt_token_ids(["a text"], task=task)
    calls = {"query": model.encode_query, "document": model.encode_document, "default": model.encode}
    for kind, call in calls.items():
        assert int(call(["a text"], output_value=None)[0]["rationale_budget"]) == budgets[kind]


def reference_gircse(lm, tokenizer, text: str, instruction: str, steps: int, temperature: float = 1.0) -> torch.Tensor:
    """GIRCSE as gircse.md describes it, restated without grace-st's code: the reference string, no special
    tokens added, a whole forward pass at every step (no cache, no padding); each step feeds the LM head's
    distribution back as an input embedding (Eqs. 5-6), and the embedding is the mean of the final states at
    the K generated positions, L2-normalised (Eq. 4)."""
    prompt = f"Instruct: {instruction}\nQuery:{text}" if instruction else text
    with torch.no_grad():
        inputs = lm.get_input_embeddings()  # each token's input embedding, as the model embeds it
        table = inputs(torch.arange(inputs.weight.shape[0]))
        sequence = inputs(torch.tensor(tokenizer(prompt, add_special_tokens=False)["input_ids"]))[None]
        for _ in range(steps):
            logits = lm(inputs_embeds=sequence).logits[:, -1]  # the model's own forward: its logit processing too
            distribution = torch.softmax(logits.float() / temperature, dim=-1)
            sequence = torch.cat([sequence, (distribution.to(table.dtype) @ table)[:, None]], dim=1)
        generated = lm.get_decoder()(inputs_embeds=sequence).last_hidden_state[:, -steps:]
    return torch.nn.functional.normalize(generated.mean(dim=1), dim=-1)[0]


@pytest.mark.parametrize(
    ("steps", "dtype", "tolerance"),
    [(1, "float32", 1e-5), (1, "float64", 1e-6), (3, "float64", 1e-6), (5, "float64", 1e-6)],
)
def test_the_instruct_format_is_the_reference_computation(steps, dtype, tolerance):
    """Every prompt type, a padded batch against each text alone. In float32 the random tiny model amplifies
    rounding through the fed-back distributions (about 4e-5 at K = 3, 8e-5 at K = 5, between a cached batch
    and whole passes); in float64 the two computations agree to the float32 output's rounding."""
    instructions = {"default": "Retrieve semantically similar text", "query": "Given a question, find answers"}
    model = gircse_model(steps=steps, prompt_format="instruct", instructions={**instructions, "document": ""})
    model[0].model.to(getattr(torch, dtype))
    texts = ["A cat sat on the mat.", "Proteins fold.", "Which drugs lower blood pressure?"]
    lm, tokenizer = model[0].model, model[0].tokenizer
    calls = {"default": model.encode, "query": model.encode_query, "document": model.encode_document}
    for kind, call in calls.items():
        found = torch.as_tensor(call(texts)).double()
        instruction = {**instructions, "document": ""}[kind]
        for row, text in enumerate(texts):
            expected = reference_gircse(lm, tokenizer, text, instruction, steps).double()
            assert (found[row] - expected).abs().max() <= tolerance, (kind, text)
    features = model[0].preprocess(texts[:1])
    assert features["input_ids"][0].tolist() == tokenizer(
        f"Instruct: {instructions['default']}\nQuery:{texts[0]}", add_special_tokens=False
    )["input_ids"]  # the reference's ids: no chat template, no special token added


def test_the_instruct_format_is_gircse_s_own():
    with pytest.raises(ValueError, match="prompt_format 'instruct' is GIRCSE's reference format"):
        make_st_model(prompt_format="instruct")
    with pytest.raises(ValueError, match="prompt_format must be 'chat' or 'instruct'"):
        gircse_model(prompt_format="raw")


def gemma2_gircse(steps: int, **settings):
    """A tiny Gemma 2 (final logit soft-capping: its logits are not the LM head's alone) as a GIRCSE model in
    the reference format (no chat template needed)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    tokenizer = make_tokenizer()
    config = Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, final_logit_softcapping=2.0,
        initializer_range=0.3, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    lm = Gemma2ForCausalLM(config).eval()
    return grace_st.from_causal_lm(
        model=lm, tokenizer=tokenizer, device="cpu", method="gircse", prompt_format="instruct",
        max_rationale_tokens=steps, **settings,
    )


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_soft_tokens_are_the_model_s_own_distribution_at_the_soft_token_temperature(temperature):
    model = gemma2_gircse(3, soft_token_temperature=temperature)
    lm, tokenizer = model[0].model, model[0].tokenizer
    texts = ["A cat sat on the mat.", "Proteins fold."]
    found = torch.as_tensor(model.encode(texts))
    for row, text in enumerate(texts):
        expected = reference_gircse(lm, tokenizer, text, model[0].instructions["default"], 3, temperature)
        assert (found[row] - expected).abs().max() <= 1e-5
    states = torch.randn(2, 32)
    raw = lm.get_output_embeddings()(states)
    assert not torch.allclose(output_logits(lm, states), raw)  # the soft-capping is the model's, and applied
    assert output_logits(lm, states).abs().max() <= 2.0
    if temperature != 1.0:
        assert not torch.allclose(torch.as_tensor(gemma2_gircse(3).encode(texts)), found)
    with pytest.raises(ValueError, match="soft_token_temperature is GIRCSE's"):
        make_st_model(soft_token_temperature=0.5)
    with pytest.raises(ValueError, match="soft_token_temperature must be a finite number > 0"):
        gircse_model(soft_token_temperature=0.0)


def authors_adapter(tmp_path):
    """A base (no chat template) and a LoRA adapter saved as the authors' releases are (``PeftModel.save_pretrained``:
    no tokenizer, no GRACE settings): (the adapter's folder, the adapted model, the base's tokenizer)."""
    from conftest import make_model
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    tokenizer = make_tokenizer()
    tokenizer.chat_template = None  # a base model: no chat template
    make_model(tokenizer).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    adapted = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tmp_path / "base"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    )
    torch.manual_seed(1)
    for name, parameter in adapted.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.1)
    adapted.save_pretrained(tmp_path / "adapter")
    assert not (tmp_path / "adapter" / "tokenizer_config.json").exists()
    return str(tmp_path / "adapter"), adapted.eval(), tokenizer


def test_a_gircse_adapter_in_the_authors_layout_loads_and_encodes_offline(tmp_path):
    """The authors' released adapters are PEFT LoRA folders on base models without a chat template: a base and
    adapter saved so here load as a GIRCSE model in the reference format, encode as the adapted model does, and
    save and load back."""
    adapter, adapted, tokenizer = authors_adapter(tmp_path)
    instructions = {"default": "Retrieve semantically similar text", "query": "Given a question, find answers"}
    model = grace_st.from_causal_lm(
        adapter, device="cpu", method="gircse", prompt_format="instruct", max_rationale_tokens=1,
        instructions={**instructions, "document": ""},
    )
    texts = ["A cat sat on the mat.", "Proteins fold."]
    found = torch.as_tensor(model.encode_query(texts))
    for row, text in enumerate(texts):
        expected = reference_gircse(adapted, tokenizer, text, instructions["query"], 1)
        assert (found[row] - expected).abs().max() <= 1e-5
    model.save(str(tmp_path / "grace"))
    loaded = grace_st.load(str(tmp_path / "grace"), device="cpu")
    assert loaded[0].prompt_format == "instruct" and loaded[0].instructions["document"] == ""
    assert torch.allclose(torch.as_tensor(loaded.encode_query(texts)), found, atol=1e-6)


def test_the_authors_adapters_load_with_their_code_s_settings_and_512_token_prompts(tmp_path):
    """``from_gircse_adapter`` encodes as the reference code: its prompt string, K = 3, the corpus bare, and the
    formatted prompt cut at 512 tokens (the reference tokenizes with ``max_length=512``)."""
    from grace_st.from_causal_lm import GIRCSE_REFERENCE_INSTRUCTIONS

    adapter, adapted, tokenizer = authors_adapter(tmp_path)
    model = grace_st.from_gircse_adapter(adapter, device="cpu")
    encoder = model[0]
    assert model.max_seq_length == encoder.max_input_tokens == 512
    assert (encoder.method, encoder.prompt_format, encoder.max_rationale_tokens) == ("gircse", "instruct", 3)
    assert encoder.instructions == GIRCSE_REFERENCE_INSTRUCTIONS
    long = "The cat sat on the mat and looked at the garden. " * 80
    instruction = GIRCSE_REFERENCE_INSTRUCTIONS["query"]
    ids = tokenizer(f"Instruct: {instruction}\nQuery:{long}", add_special_tokens=False)["input_ids"]
    assert len(ids) > 600
    (row,), _ = encoder.prompt_token_ids([long], task="query")
    assert row == ids[:512]
    with torch.no_grad():
        table = adapted.get_input_embeddings()
        sequence = table(torch.tensor(ids[:512]))[None]
        for _ in range(3):
            distribution = torch.softmax(adapted(inputs_embeds=sequence).logits[:, -1].float(), dim=-1)
            sequence = torch.cat([sequence, (distribution @ table.weight)[:, None]], dim=1)
        states = adapted.get_decoder()(inputs_embeds=sequence).last_hidden_state[:, -3:]
    expected = F.normalize(states.mean(dim=1), dim=-1)[0]
    # float32 rounding carried through K = 3 fed-back distributions (test_the_instruct_format_is_the_reference_...)
    assert (torch.as_tensor(model.encode_query([long])[0]) - expected).abs().max() <= 5e-5
    documents = torch.as_tensor(model.encode_document(["Proteins fold."]))[0]
    assert (documents - reference_gircse(adapted, tokenizer, "Proteins fold.", "", 3)).abs().max() <= 5e-5
    custom = grace_st.from_gircse_adapter(adapter, device="cpu", instructions={"query": "Find it"}, max_input_tokens=64)
    assert custom[0].instructions == {**GIRCSE_REFERENCE_INSTRUCTIONS, "query": "Find it"}
    assert custom.max_seq_length == 64


def test_a_gircse_model_without_a_saved_k_gets_the_measured_default(tmp_path):
    from grace_st.settings import GIRCSE_DEFAULT_K

    tokenizer = make_tokenizer()
    from conftest import make_model

    built = grace_st.from_causal_lm(model=make_model(tokenizer), tokenizer=tokenizer, device="cpu", method="gircse")
    assert built[0].max_rationale_tokens == GIRCSE_DEFAULT_K
    grace = grace_st.from_causal_lm(model=make_model(tokenizer), tokenizer=tokenizer, device="cpu")
    assert grace[0].max_rationale_tokens == 256
    built.save(str(tmp_path / "m"))
    config_file = tmp_path / "m" / "grace_config.json"
    saved = json.loads(config_file.read_text())
    del saved["max_rationale_tokens"]
    config_file.write_text(json.dumps(saved))
    assert grace_st.load(str(tmp_path / "m"))[0].max_rationale_tokens == GIRCSE_DEFAULT_K
