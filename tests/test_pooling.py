import torch

from grace_st.runtime.batch import left_pad, masked_mean, prompt_pooling_mask


def test_masked_mean_over_left_padded_rows():
    states = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    expected = torch.stack([states[0, 2:].mean(0), states[1, 1:].mean(0)])
    torch.testing.assert_close(masked_mean(states, mask), expected)


def test_non_finite_states_at_masked_positions_do_not_leak():
    states = torch.ones(1, 3, 2)
    states[0, 0] = float("nan")
    states[0, 1] = float("inf")
    out = masked_mean(states, torch.tensor([[0, 0, 1]]))
    assert torch.equal(out, torch.ones(1, 2))


def test_prompt_pooling_mask_starts_after_instruction_span():
    input_ids, attention_mask = left_pad([[5, 6, 7, 8], [5, 6]], pad_token_id=0)
    assert input_ids.tolist() == [[5, 6, 7, 8], [0, 0, 5, 6]]
    mask = prompt_pooling_mask(attention_mask, torch.tensor([2, 1]))
    assert mask.tolist() == [[False, False, True, True], [False, False, False, True]]


def test_masked_mean_is_float32_for_low_precision_states():
    states = torch.ones(1, 2, 4, dtype=torch.bfloat16)
    assert masked_mean(states, torch.ones(1, 2)).dtype == torch.float32
