"""Eq. 11: the batch layout, log-probabilities under left padding, and the loss's gradient."""

from __future__ import annotations

import pytest
import torch
from conftest import make_lora_model, make_model, make_tokenizer

from grace_training.algorithms.grpo.loss import build_policy_batch, completion_log_probs, group_advantages, grpo_loss


def test_build_policy_batch_layout():
    batch = build_policy_batch([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], [0, -1], pad_token_id=99)
    # prompts left-padded to 3, completions (rationale ⊕ EOS when it stopped) right-padded to 3
    assert batch["input_ids"].tolist() == [[5, 6, 7, 1, 2, 0], [99, 99, 8, 3, 4, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]
    assert batch["completion_mask"].tolist() == [[True, True, True], [True, True, True]]
    assert int(batch["prompt_width"]) == 3


def test_completion_log_probs_under_left_padding_match_unpadded_rows():
    tokenizer = make_tokenizer()
    model = make_model(tokenizer)
    prompts, rationales, stops = [[3, 20, 21, 22, 23], [3, 30]], [[40, 41, 42], [50]], [tokenizer.eos_token_id, -1]
    batch = build_policy_batch(prompts, rationales, stops, tokenizer.pad_token_id)
    padded = completion_log_probs(model, batch, temperature=0.7)
    for row, (prompt, rationale, stop) in enumerate(zip(prompts, rationales, stops)):
        completion = [*rationale, stop] if stop >= 0 else rationale
        ids = torch.tensor([prompt + completion])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / 0.7
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
        torch.testing.assert_close(padded[row, : len(completion)], expected, atol=1e-5, rtol=1e-5)


def test_on_policy_loss_gradient_is_eq11():
    """ρ ≡ 1 on-policy: the clipped form's gradient equals that of −Σ A log π / T."""
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 10, requires_grad=True)
    targets = torch.randint(0, 10, (3, 4))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    advantages = torch.tensor([0.5, -1.0, 0.25])

    def log_probs():
        return torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)

    lp = log_probs()
    loss, stats = grpo_loss(lp, lp.detach(), advantages, mask)
    (grad,) = torch.autograd.grad(loss, logits)
    reference = -(advantages[:, None] * log_probs() * mask).sum() / mask.sum()
    (expected,) = torch.autograd.grad(reference, logits)
    torch.testing.assert_close(grad, expected)
    assert stats["clip_fraction"] == 0


def test_gradient_step_raises_positive_advantage_tokens():
    """A toy policy over 3 tokens: a step on Eq. 11 makes the rollout with A > 0 more likely."""
    theta = torch.zeros(3, requires_grad=True)
    optimizer = torch.optim.SGD([theta], lr=1.0)
    chosen = torch.tensor([[0], [1], [2]])  # three one-token rollouts
    rewards = torch.tensor([[1.0, 0.0, -1.0]])  # one group of K = 3
    advantages = group_advantages(rewards).reshape(-1)
    before = torch.softmax(theta, -1).detach()
    lp = torch.log_softmax(theta, -1)[chosen]
    loss, _ = grpo_loss(lp, lp.detach(), advantages, torch.ones_like(chosen, dtype=torch.bool))
    loss.backward()
    optimizer.step()
    after = torch.softmax(theta, -1).detach()
    assert after[0] > before[0] and after[2] < before[2]


def test_clipped_ratio_stops_the_gradient_outside_the_trust_region():
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.9, 0.1]])).requires_grad_()
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = grpo_loss(new, old, torch.tensor([1.0]), mask, clip_epsilon=0.2)
    loss.backward()
    # token 0: ρ = 1.8 > 1.2 with A > 0 is clipped (no gradient); token 1: ρ = 0.2 is not
    assert new.grad[0, 0] == 0 and new.grad[0, 1] != 0
    assert stats["clip_fraction"] == 0.5


def test_kl_term_is_zero_at_the_reference_and_positive_away_from_it():
    lp = torch.log(torch.tensor([[0.5, 0.25]]))
    mask = torch.ones(1, 2, dtype=torch.bool)
    zero = torch.tensor([0.0])
    loss, stats = grpo_loss(lp, lp, zero, mask, ref_log_probs=lp, kl_coef=0.1)
    assert loss == 0 and stats["kl"] == 0
    loss, stats = grpo_loss(lp, lp, zero, mask, ref_log_probs=torch.log(torch.tensor([[0.25, 0.5]])), kl_coef=0.1)
    assert loss > 0 and stats["kl"] > 0


def test_token_level_aggregation_splits_into_chunks():
    """Chunks normalised by the whole batch's token count add up to the batch's loss."""
    torch.manual_seed(1)
    lp = torch.randn(4, 5)
    mask = torch.rand(4, 5) > 0.3
    adv = torch.randn(4)
    whole, _ = grpo_loss(lp, lp - 0.1, adv, mask)
    parts = sum(grpo_loss(lp[i::2], lp[i::2] - 0.1, adv[i::2], mask[i::2], num_tokens=mask.sum())[0] for i in (0, 1))
    torch.testing.assert_close(whole, parts)


def test_a_prompt_shared_by_k_rollouts_runs_once_with_the_same_loss_and_gradients():
    """The update pass over the K rollouts of a positive: each distinct prompt is run once and its
    keys and values expanded; log-probs, pooled states and LoRA gradients equal the full pass's."""
    from grace_training.algorithms.grpo.loss import policy_pass

    tokenizer = make_tokenizer()
    model = make_lora_model(tokenizer, seed=1)
    prompts = [[3, 20, 21, 22, 23]] * 3 + [[3, 30]] * 2 + [[3, 40, 41]]
    rationales = [[40, 41, 42], [50], [51, 52, 53, 54], [60, 61], [], [70]]
    stops = [tokenizer.eos_token_id, -1, tokenizer.eos_token_id, -1, tokenizer.eos_token_id, -1]
    advantages = torch.tensor([0.3, -0.1, -0.2, 0.5, 0.0, -0.5])

    def run(share: bool):
        model.zero_grad()
        batch = build_policy_batch(prompts, rationales, stops, tokenizer.pad_token_id, [1] * 6, share_prompts=share)
        assert ("prompt_index" in batch) == share
        log_probs, pooled, _ = policy_pass(model, batch, 0.7, pool_from=model)
        loss, _ = grpo_loss(log_probs, log_probs.detach(), advantages, batch["completion_mask"])
        (loss + pooled.pow(2).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return log_probs.detach(), pooled.detach(), grads

    full, shared = run(False), run(True)
    assert build_policy_batch(prompts, rationales, stops, 0, share_prompts=True)["prompt_rows"].tolist() == [0, 3, 5]
    torch.testing.assert_close(shared[0], full[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(shared[1], full[1], atol=1e-5, rtol=1e-4)
    assert full[2] and full[2].keys() == shared[2].keys() and all("lora_" in n for n in full[2])
    for name, grad in full[2].items():
        torch.testing.assert_close(shared[2][name], grad, atol=1e-4, rtol=1e-3)
    # distinct prompts only: nothing to share, the plain pass
    assert "prompt_index" not in build_policy_batch([[1], [2]], [[3], [4]], [-1, -1], 0, share_prompts=True)


def test_text_kl_is_the_kl_to_the_reference_over_the_texts_own_positions():
    """The LM-hold term: KL(π_ref ‖ π_θ) of the full next-token distribution at each position whose
    next token is text after the instruction span; zero for the adapter's initial (zero) update; the
    same from the shared-prompt pass as from the full one, with gradients into LoRA."""
    from grace_training.algorithms.grpo.loss import policy_pass, text_kl, text_log_probs

    tokenizer = make_tokenizer()
    model = make_lora_model(tokenizer)
    prompts = [[3, 20, 21, 22, 23]] * 2 + [[3, 30, 31]]
    rationales, stops = [[40, 41], [50], [60]], [tokenizer.eos_token_id, -1, -1]
    batch = build_policy_batch(prompts, rationales, stops, tokenizer.pad_token_id, [2, 2, 1], share_prompts=True)
    # position t holds the LM where token t + 1 is past the instruction span (left-padded rows)
    assert batch["text_mask"].tolist() == [[False, True, True, True, False]] * 2 + [[False, False, True, True, False]]
    assert batch["text_rows"].tolist() == [0, 2]
    with torch.no_grad(), model.disable_adapter():
        reference = text_log_probs(model, batch)
    rows_mask = batch["text_mask"][batch["text_rows"]]
    count = float(rows_mask.sum())
    logits = policy_pass(model, batch, text=True).text_logits
    assert float(text_kl(logits, reference, rows_mask, count).detach()) == pytest.approx(0.0, abs=1e-6)  # B = 0: no change yet

    torch.manual_seed(2)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # the adapter moves the model away from the reference
            torch.nn.init.normal_(parameter, std=0.1)
    values, grads = {}, {}
    for share in (False, True):
        model.zero_grad()
        b = build_policy_batch(prompts, rationales, stops, tokenizer.pad_token_id, [2, 2, 1], share_prompts=share)
        with torch.no_grad(), model.disable_adapter():
            ref = text_log_probs(model, b)
        mask = b["text_mask"][b["text_rows"]]
        value = text_kl(policy_pass(model, b, text=True).text_logits, ref, mask, float(mask.sum()))
        value.backward()
        values[share] = value.detach()
        grads[share] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # by hand, one row and position: Σ_v p_ref (log p_ref − log p_θ)
    with torch.no_grad():
        policy = torch.log_softmax(policy_pass(model, batch, text=True).text_logits.float(), -1)
    by_hand = sum(
        float((reference[r, t].exp() * (reference[r, t] - policy[r, t])).sum())
        for r in range(2) for t in range(5) if rows_mask[r, t]
    ) / count
    assert float(values[True]) > 0 and float(values[True]) == pytest.approx(by_hand, rel=1e-4)
    torch.testing.assert_close(values[False], values[True], atol=1e-6, rtol=1e-4)  # each text once, shared or not
    assert grads[True] and all("lora_" in n for n in grads[True])
    for name, grad in grads[True].items():
        torch.testing.assert_close(grad, grads[False][name], atol=1e-5, rtol=1e-3)
