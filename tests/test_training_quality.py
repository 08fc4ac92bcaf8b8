"""Reward scale options, the hybrid objective (β · InfoNCE on pooled states), LoRA training."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_st_model
from safetensors.torch import load_file
from sentence_transformers import SentenceTransformer
from test_training_trainer import DATA, config

import grace_st
from grace_training.algorithms.grpo.loss import (
    advantage_shares,
    build_policy_batch,
    graded_contrastive_loss,
    group_advantages,
    policy_pass,
    pooled_contrastive_loss,
)
from grace_training.algorithms.grpo.rewards import compute_rewards, reward_parts
from grace_training.data.examples import Triplet
from grace_training.trainer import Trainer


def saved_base(tmp_path):
    """A tiny GRACE model loaded from a directory (a LoRA adapter needs a base it can name)."""
    model = make_st_model()
    model[0].model.save_pretrained(tmp_path / "base")
    model[0].tokenizer.save_pretrained(tmp_path / "base")
    return grace_st.from_causal_lm(str(tmp_path / "base"), max_rationale_tokens=8, device="cpu")


# -- reward scale ---------------------------------------------------------------------------------

torch.manual_seed(0)
Q, P, N = torch.randn(2, 6), torch.randn(2, 3, 6), torch.randn(2, 1, 6)
TRUNCATED = torch.tensor([[True, False, True], [False, False, False]])


def test_length_penalty_off_and_in_reward_units():
    off = compute_rewards(Q, P, N, None, TRUNCATED, tau=0.1, length_penalty_mode="off")
    torch.testing.assert_close(off["final"], off["scaled"])
    assert off["length_penalty"].abs().sum() == 0
    # γ in the units of R_total: divided by τ like the contrastive terms
    units = compute_rewards(Q, P, N, None, TRUNCATED, tau=0.1, gamma=0.05, length_penalty_units="reward")
    torch.testing.assert_close(units["final"], units["scaled"] - 0.5 * TRUNCATED.float())
    replaced = compute_rewards(
        Q, P, N, None, TRUNCATED, tau=0.1, gamma=0.05, length_penalty_mode="replace", length_penalty_units="reward"
    )
    assert torch.all(replaced["final"][TRUNCATED] == -0.5)


def test_group_std_scaling_and_advantage_shares():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.01, 0.02]])
    scaled = group_advantages(rewards, "group")
    torch.testing.assert_close(scaled.std(dim=1, unbiased=False), torch.ones(2), atol=2e-2, rtol=0)
    torch.testing.assert_close(group_advantages(rewards), rewards - rewards.mean(1, keepdim=True))

    out = compute_rewards(Q, P, N, None, TRUNCATED, tau=10.0, gamma=1.0)
    parts = reward_parts(out, TRUNCATED, lambda_consistency=0.2, lambda_hard_negative=0.2, tau=10.0)
    torch.testing.assert_close(sum(parts.values()), out["final"])
    shares = advantage_shares(parts)
    assert abs(sum(shares.values()) - 1) < 1e-6
    # the paper's scale: −1 for a truncated rollout against τ-scaled cosines, the penalty dominates
    assert shares["length_penalty"] > 0.8
    for mode in ("replace", "off"):
        out = compute_rewards(Q, P, N, None, TRUNCATED, length_penalty_mode=mode)
        parts = reward_parts(
            out, TRUNCATED, lambda_consistency=0.2, lambda_hard_negative=0.2, tau=10.0, length_penalty_mode=mode
        )
        torch.testing.assert_close(sum(parts.values()), out["final"])


def test_mask_truncated_drops_cut_rollouts_from_the_loss(tmp_path):
    trainer = Trainer(
        config(tmp_path, mask_truncated=True, max_rationale_tokens=2), model=make_st_model(), train_data=DATA
    )
    rollouts = trainer.algorithm.rollout(trainer.batch_for_step(0), 0)
    assert bool(rollouts.positives.truncated.all())  # two tokens: every rollout is cut
    update = trainer.algorithm.update(rollouts, torch.tensor([0.3, -0.1, -0.2, 0.5, 0.0, -0.5]))
    assert update["trained_tokens"] == 0 and update["grad_norm"] == 0


# -- the hybrid objective ------------------------------------------------------------------------


def test_pooled_contrastive_loss_is_infonce_over_the_batch():
    torch.manual_seed(1)
    query, positives, negatives = torch.randn(3, 5), torch.randn(3, 2, 5), torch.randn(3, 1, 5)
    total = pooled_contrastive_loss(query, positives, negatives, temperature=0.1)
    unit = torch.nn.functional.normalize
    q, p, n = unit(query, dim=-1), unit(positives, dim=-1), unit(negatives, dim=-1)
    expected = 0.0
    for i in range(3):
        for k in range(2):
            candidates = [p[i, k], n[i, 0]] + [p[j, l] for j in range(3) if j != i for l in range(2)]
            logits = torch.stack([q[i] @ c for c in candidates]) / 0.1
            expected += -torch.log_softmax(logits, 0)[0]
    torch.testing.assert_close(total, expected)
    rows = torch.tensor([[True, False], [False, False], [False, True]])
    part = pooled_contrastive_loss(query, positives, negatives, temperature=0.1, rows=rows)
    rest = pooled_contrastive_loss(query, positives, negatives, temperature=0.1, rows=~rows)
    torch.testing.assert_close(part + rest, total)
    # a padded (absent) negative takes no part
    masked = pooled_contrastive_loss(query, positives, negatives, torch.zeros(3, 1, dtype=torch.bool), temperature=0.1)
    assert masked < total


def test_update_pass_pools_the_embedding_encode_returns(tmp_path):
    """The rule: the embedding trained in the update pass is the rollout's, which is encode's."""
    trainer = Trainer(config(tmp_path, contrastive_beta=1.0), model=make_st_model(), train_data=DATA)
    rollouts = trainer.algorithm.rollout(trainer.batch_for_step(0), 0)
    for role in (rollouts.positives, rollouts.queries, rollouts.negatives):
        batch = build_policy_batch(
            role.prompt_ids, role.rationale_ids, role.stop_ids, trainer.encoder.pad_token_id, role.instruction_lengths
        )
        with torch.no_grad():
            pooled = policy_pass(trainer.policy, batch, role.temperature, pool_from=trainer.policy).pooled
        torch.testing.assert_close(torch.nn.functional.normalize(pooled, dim=-1), role.embeddings, atol=1e-5, rtol=1e-4)


def gradients(trainer, rollouts, advantages):
    captured = {}

    def capture(*args, **kwargs):
        captured["grads"] = {n: p.grad.clone() for n, p in trainer.policy.named_parameters() if p.grad is not None}

    trainer.optimizer.step = capture
    trainer.algorithm.update(rollouts, advantages)
    return captured["grads"]


ADVANTAGES = torch.tensor([0.3, -0.1, -0.2, 0.5, 0.0, -0.5])


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_beta_zero_is_the_paper_and_beta_adds_the_infonce_gradient(tmp_path):
    grads = {}
    for beta in (0.0, 0.5):
        trainer = Trainer(
            config(tmp_path / str(beta), contrastive_beta=beta), model=make_st_model(), train_data=DATA
        )
        rollouts = trainer.algorithm.rollout(trainer.batch_for_step(0), 0)
        grads[beta] = gradients(trainer, rollouts, ADVANTAGES)
    paper = Trainer(config(tmp_path / "paper"), model=make_st_model(), train_data=DATA)
    reference = gradients(paper, paper.algorithm.rollout(paper.batch_for_step(0), 0), ADVANTAGES)
    for name, grad in reference.items():
        torch.testing.assert_close(grads[0.0][name], grad)
    assert any(not torch.allclose(grads[0.5][n], g) for n, g in reference.items())


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
@pytest.mark.parametrize("anchors", ["detached", "recompute"])
def test_hybrid_gradient_reaches_the_lora_parameters_only(tmp_path, anchors):
    cfg = config(tmp_path, finetune="lora", contrastive_beta=1.0, contrastive_anchors=anchors)
    trainer = Trainer(cfg, model=saved_base(tmp_path), train_data=DATA)
    rollouts = trainer.algorithm.rollout(trainer.batch_for_step(0), 0)
    grads = gradients(trainer, rollouts, torch.zeros(6))  # no advantage: only the InfoNCE term moves weights
    assert grads and all("lora_" in name for name in grads)
    assert sum(float(g.abs().sum()) for g in grads.values()) > 0


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_hybrid_chunks_add_up_to_the_batch_loss(tmp_path):
    """Chunks sum to the batch's InfoNCE value (other chunks' positives enter as detached negatives)."""
    values = {}
    for parts in (1, 2, 3):
        cfg = config(tmp_path / str(parts), contrastive_beta=1.0, gradient_accumulation_steps=parts)
        trainer = Trainer(cfg, model=make_st_model(), train_data=DATA)
        rollouts = trainer.algorithm.rollout(trainer.batch_for_step(0), 0)
        values[parts] = trainer.algorithm.update(rollouts, ADVANTAGES)["contrastive_loss"]
    assert values[1] > 0
    assert values[2] == pytest.approx(values[1], rel=1e-4) and values[3] == pytest.approx(values[1], rel=1e-4)


# -- LoRA training ----------------------------------------------------------------------------------


def test_lora_run_checkpoints_an_adapter_that_loads_and_resumes(tmp_path):
    # both LM-hold terms on: their reference is the adapter disabled
    cfg = config(
        tmp_path, finetune="lora", contrastive_beta=1.0, max_steps=2, save_steps=1, kl_coef=0.1, text_kl_coef=0.5
    )
    base = saved_base(tmp_path)
    before = {k: v.clone() for k, v in base[0].model.state_dict().items()}
    Trainer(cfg, model=base, train_data=DATA).train()
    checkpoint = tmp_path / "run" / "checkpoint-00000002"
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (checkpoint / "model.safetensors").exists()
    # the frozen base is untouched; the adapter moved
    trained = {k.replace(".base_layer", ""): v for k, v in base[0].model.get_base_model().state_dict().items()}
    for key, value in before.items():
        torch.testing.assert_close(trained[key], value)
    loaded = SentenceTransformer(str(checkpoint), trust_remote_code=True, device="cpu")
    texts = ["a cat on a mat", "rates rose again"]
    torch.testing.assert_close(
        torch.as_tensor(loaded.encode(texts)), torch.as_tensor(base.encode(texts)), atol=1e-5, rtol=1e-4
    )

    # resume from step 1 reaches the same adapter as the straight run
    def resumable(steps):
        return config(
            tmp_path,
            finetune="lora",
            contrastive_beta=1.0,
            max_steps=steps,
            save_steps=1,
            kl_coef=0.1,
            text_kl_coef=0.5,
            output_dir=str(tmp_path / "resumed"),
        )

    Trainer(resumable(1), model=saved_base(tmp_path), train_data=DATA).train()
    second = Trainer(resumable(2), model=saved_base(tmp_path), train_data=DATA)
    second.train(resume=True)
    straight = {k: v for k, v in base[0].model.state_dict().items() if "lora_" in k}
    again = {k: v for k, v in second.policy.state_dict().items() if "lora_" in k}
    for key, value in straight.items():
        torch.testing.assert_close(again[key], value, atol=1e-6, rtol=1e-5)


def test_a_run_starts_from_another_runs_adapter_and_refuses_one_that_does_not_fit(tmp_path):
    """``init_adapter``: a second run's adapter starts at the first run's checkpoint (the scale-recipe run
    goes on from the shipped adapter when a machine lost its checkpoints); the KL reference stays
    the base (the adapter disabled)."""
    first = config(tmp_path, finetune="lora", contrastive_beta=1.0, max_steps=1, save_steps=1)
    Trainer(first, model=saved_base(tmp_path), train_data=DATA).train()
    checkpoint = tmp_path / "run" / "checkpoint-00000001"
    saved = load_file(str(checkpoint / "adapter_model.safetensors"))
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)  # a trained adapter, not PEFT's B = 0

    def second(**overrides):
        cfg = config(
            tmp_path, finetune="lora", contrastive_beta=1.0, text_kl_coef=0.5, max_steps=1,
            init_adapter=str(checkpoint), output_dir=str(tmp_path / "second"), **overrides,
        )
        return Trainer(cfg, model=saved_base(tmp_path), train_data=DATA)

    trainer = second()
    started = {k.replace(".default.", "."): v for k, v in trainer.policy.state_dict().items() if "lora_" in k}
    assert started.keys() == saved.keys()
    for key, value in saved.items():
        torch.testing.assert_close(started[key], value, atol=0, rtol=0)
    texts = ["a cat on a mat", "rates rose again"]
    loaded = SentenceTransformer(str(checkpoint), trust_remote_code=True, device="cpu")
    torch.testing.assert_close(
        torch.as_tensor(trainer.st_model.encode(texts)), torch.as_tensor(loaded.encode(texts)), atol=1e-5, rtol=1e-4
    )
    with trainer.policy.disable_adapter():  # the reference is the base, not the adapter started from
        base = saved_base(tmp_path)
        torch.testing.assert_close(
            trainer.policy(torch.tensor([[1, 2, 3]])).logits, base[0].model(torch.tensor([[1, 2, 3]])).logits
        )
    trainer.train()  # and it trains on from there
    assert json.loads((tmp_path / "second" / "checkpoint-00000001" / "trainer_state" / "state.json").read_text())[
        "config"]["init_adapter"] == str(checkpoint)

    with pytest.raises(ValueError, match="init_adapter: .* has r 8, the config 4"):
        second(lora_r=4)
    with pytest.raises(ValueError, match="init_adapter: .* has lora_alpha 16, the config 32"):
        second(lora_alpha=32)
    with pytest.raises(ValueError, match="lora_target_modules must be the ones it was trained with"):
        second(lora_target_modules=["q_proj"])
    with pytest.raises(ValueError, match="init_adapter: starting from an adapter needs finetune: lora"):
        config(tmp_path, init_adapter=str(checkpoint))


def test_an_adapter_grows_in_rank_with_the_same_embeddings_and_trains_its_new_directions(tmp_path):
    """``init_adapter`` of a lower rank (decisions/D022): r 8, α 16 grown to r 24, α 16 (a third of the
    scale, so the saved B is rescaled by 3) encodes as the saved adapter does; the saved rows of A are kept,
    the new ones are PEFT's random ones, the new columns of B start at zero and move in the first step."""
    first = config(tmp_path, finetune="lora", contrastive_beta=1.0, max_steps=1, save_steps=1)
    Trainer(first, model=saved_base(tmp_path), train_data=DATA).train()
    checkpoint = tmp_path / "run" / "checkpoint-00000001"
    saved = load_file(str(checkpoint / "adapter_model.safetensors"))
    grown_config = config(
        tmp_path, finetune="lora", contrastive_beta=1.0, max_steps=1, save_steps=1, lora_r=24, lora_alpha=16,
        init_adapter=str(checkpoint), output_dir=str(tmp_path / "grown"),
    )
    trainer = Trainer(grown_config, model=saved_base(tmp_path), train_data=DATA)
    started = {k.replace(".default.", "."): v.detach().clone() for k, v in trainer.policy.state_dict().items() if "lora_" in k}
    assert started.keys() == saved.keys()
    for key, value in saved.items():
        if ".lora_A." in key:
            torch.testing.assert_close(started[key][:8], value, atol=0, rtol=0)
            assert started[key][8:].abs().sum() > 0
        else:
            torch.testing.assert_close(started[key][:, :8], value * 3, atol=0, rtol=0)
            assert started[key][:, 8:].abs().sum() == 0
    texts = ["a cat on a mat", "rates rose again"]
    loaded = SentenceTransformer(str(checkpoint), trust_remote_code=True, device="cpu")
    torch.testing.assert_close(
        torch.as_tensor(trainer.st_model.encode(texts)), torch.as_tensor(loaded.encode(texts)), atol=1e-5, rtol=1e-4
    )
    trainer.train()
    trained = load_file(str(tmp_path / "grown" / "checkpoint-00000001" / "adapter_model.safetensors"))
    assert trained[next(k for k in trained if ".lora_B." in k)].shape[1] == 24
    assert any(trained[k][:, 8:].abs().sum() > 0 for k in trained if ".lora_B." in k)


# -- budgets by prompt type: training what ships -------------------------------------------------

SHIPPED = {"default": 5, "query": 5, "document": 0}


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_recompute_prompts_trains_the_prompt_only_documents_and_nothing_else(tmp_path):
    """Under the shipped budgets a retrieval step rolls out queries; ``recompute_prompts`` pools its
    prompt-only documents again with gradient. Where no row is prompt-only it equals ``detached``."""
    grads = {}
    for budgets in (SHIPPED, 5):
        for anchors in ("detached", "recompute_prompts"):
            cfg = config(
                tmp_path / f"{anchors}{budgets == 5}",
                contrastive_beta=1.0,
                contrastive_anchors=anchors,
                max_rationale_tokens=budgets,
            )
            trainer = Trainer(cfg, model=make_st_model(), train_data=DATA)
            rollouts = trainer.algorithm.rollout(trainer.batch_for_step(0), 0)
            assert (rollouts.queries.budgets == [0, 0]) == (budgets == SHIPPED)
            grads[anchors, budgets == 5] = gradients(trainer, rollouts, torch.zeros(6))
    for name, grad in grads["detached", True].items():
        torch.testing.assert_close(grads["recompute_prompts", True][name], grad)
    assert any(not torch.allclose(grads["recompute_prompts", False][n], g) for n, g in grads["detached", False].items())


def test_a_run_with_budgets_by_prompt_type_saves_the_model_that_encodes_with_them(tmp_path):
    cfg = config(tmp_path, contrastive_beta=1.0, max_rationale_tokens=SHIPPED, max_steps=1, batch_sampling="by_source")
    trainer = Trainer(cfg, model=make_st_model(), train_data=DATA)
    trainer.train()
    saved = SentenceTransformer(str(tmp_path / "run" / "checkpoint-00000001"), trust_remote_code=True)
    assert saved[0].max_rationale_tokens == SHIPPED
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert metrics["rollout/positive_length_mean"] > 0  # the queries were rolled out


def test_warm_start_rolls_out_one_greedy_rationale_a_text_then_the_configured_k(tmp_path):
    """The first warm_start_steps train β · InfoNCE on one greedy rollout a text (the same rollouts
    as a K = 1 run at temperature 0); the steps after it roll out the configured K, sampled."""
    cfg = config(tmp_path / "warm", contrastive_beta=1.0, warm_start_steps=1, temperature_positive=1.0)
    trainer = Trainer(cfg, model=make_st_model(), train_data=DATA)
    greedy = config(
        tmp_path / "greedy", contrastive_beta=1.0, num_rollouts=1,
        temperature_positive=0.0, temperature_query=0.0, temperature_negative=0.0,
    )
    reference = Trainer(greedy, model=make_st_model(), train_data=DATA)
    warm = trainer.algorithm.rollout(trainer.batch_for_step(0), 0)
    expected = reference.algorithm.rollout(reference.batch_for_step(0), 0)
    assert warm.num_rollouts == 1 and len(warm.positives.rationale_ids) == cfg.batch_size
    for part in ("queries", "negatives", "positives"):
        assert getattr(warm, part).rationale_ids == getattr(expected, part).rationale_ids
    hybrid = trainer.algorithm.rollout(trainer.batch_for_step(1), 1)
    assert hybrid.num_rollouts == 3 and len(hybrid.positives.rationale_ids) == 3 * cfg.batch_size
    with pytest.raises(ValueError, match="warm_start_steps: .* contrastive_beta > 0"):
        config(tmp_path / "paper", warm_start_steps=1)


def test_cosent_ranks_the_pairs_by_their_gold_scores():
    """The graded term: zero-ish when cosines follow the scores, large when they invert them; only the
    order of the scores counts."""
    first = torch.eye(3)
    second = torch.stack([torch.tensor([1.0, 0, 0]), torch.tensor([1.0, 1.0, 0]), torch.tensor([1.0, 0, 1.0])])
    cosines = torch.nn.functional.cosine_similarity(first, second, dim=-1)  # 1, 0.71, 0.71
    scores = torch.tensor([5.0, 3.0, 1.0])
    expected = torch.log(1 + sum(torch.exp(20 * (cosines[j] - cosines[i]))
                                 for i in range(3) for j in range(3) if scores[i] > scores[j]))
    torch.testing.assert_close(graded_contrastive_loss(first, second, scores), expected)
    torch.testing.assert_close(graded_contrastive_loss(first, second, scores * 10 - 7), expected)
    inverted = graded_contrastive_loss(first, second, scores.flip(0))
    assert inverted > expected + 5
    assert graded_contrastive_loss(first, second, torch.ones(3)) == 0  # no pair is ranked above another


def graded_rows():
    pairs = [("a cat sits", "a cat is sitting", 4.8), ("a man runs", "a man is running fast", 4.0),
             ("a dog barks", "the dog is loud", 3.1), ("kids play", "children are playing", 4.5),
             ("a car stops", "the sky is blue", 0.2), ("he eats", "she sleeps", 1.0),
             ("rain falls", "it is raining", 4.9), ("a bird sings", "a plane lands", 0.5)]
    return [Triplet(a, b, (), "sts/train", s, symmetric=True) for a, b, s in pairs]


def test_a_batch_of_scored_pairs_trains_cosent_on_one_greedy_rollout_a_text(tmp_path):
    """A step drawn from an sts source rolls out one greedy rationale a text and its contrastive term
    is CoSENT on the rollouts' cosines against the gold scores; other sources' steps keep K and InfoNCE."""
    rows = graded_rows() + DATA
    cfg = config(tmp_path / "run", contrastive_beta=1.0, batch_sampling="by_source", batch_size=4)
    trainer = Trainer(cfg, model=make_st_model(), train_data=rows)
    steps = {source: next(s for s in range(50) if trainer.batch_for_step(s)[0].source == source)
             for source in ("sts/train", DATA[0].source)}
    step = steps["sts/train"]
    scores = trainer.graded_scores(step)
    rollouts = trainer.algorithm.rollout(trainer.batch_for_step(step), step)
    assert rollouts.num_rollouts == 1 and rollouts.positives.temperature == 0.0
    query, positives = rollouts.grouped(cfg.num_negatives)[:2]
    expected = graded_contrastive_loss(query, positives[:, 0], scores, scale=cfg.graded_scale)
    metrics = trainer.training_step(trainer.batch_for_step(step), step)
    assert metrics["loss/contrastive"] == pytest.approx(expected.item(), rel=1e-4)
    assert trainer.graded_scores(steps[DATA[0].source]) is None
    with pytest.raises(ValueError, match="scored pairs .* by_source"):
        Trainer(config(tmp_path / "mixed", contrastive_beta=1.0), model=make_st_model(), train_data=rows)
    with pytest.raises(ValueError, match="'sts' source .* by_source"):
        config(tmp_path / "spec", contrastive_beta=1.0, train_data=[{"type": "sts", "path": "x.tsv"}])
