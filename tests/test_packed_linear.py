"""oneDNN-packed linear layers (grace_st.packed_linear) and the preallocated KV cache."""

import copy
import pickle

import pytest
import torch
from conftest import make_prompts, one_pass_rollouts

from grace_st import packed_linear
from grace_st.decoding import DecodeOptions, preallocated_cache
from grace_st.generation import left_pad
from grace_st.packed_linear import packed_linears, packing_enabled

needs_packing = pytest.mark.skipif(not packing_enabled(), reason="this PyTorch has no oneDNN packed linear operators")


def _linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def _swapped(model):
    return [m for m in _linears(model) if "forward" in m.__dict__]


@needs_packing
def test_packed_layers_match_pytorch_and_are_restored():
    tokenizer, model, rows, _ = make_prompts()
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        with packed_linears(model):
            assert len(_swapped(model)) == len(_linears(model)) > 0
            got = model(input_ids=ids, attention_mask=mask).logits
    assert _swapped(model) == []
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@needs_packing
def test_rollouts_with_packing_equal_rollouts_without(monkeypatch):
    tokenizer, model, rows, spans = make_prompts()
    packed = one_pass_rollouts(model, tokenizer, rows, spans, 8)
    with torch.no_grad(), packed_linears(model, enabled=False):
        assert _swapped(model) == []
    plain = one_pass_rollouts(model, tokenizer, rows, spans, 8, options=DecodeOptions(packed_linears=False))
    assert torch.equal(packed.rationale_ids, plain.rationale_ids)
    torch.testing.assert_close(packed.token_embeddings, plain.token_embeddings, atol=1e-5, rtol=1e-5)


@needs_packing
@pytest.mark.parametrize("through_data", [False, True])
def test_a_weight_update_is_repacked(through_data):
    """A training step changes the weights in place: the next rollout must see the new ones.
    ``weight.data`` writes bypass the version counter; the packed copy must follow them too."""
    tokenizer, model, rows, _ = make_prompts()
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        with packed_linears(model):
            model(input_ids=ids, attention_mask=mask)
        for linear in _linears(model):
            (linear.weight.data if through_data else linear.weight).mul_(-0.5)
        expected = model(input_ids=ids, attention_mask=mask).logits
        with packed_linears(model):
            got = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@needs_packing
def test_no_packing_with_autograd_on_or_for_other_dtypes():
    _, model, _, _ = make_prompts()
    with packed_linears(model):
        assert _swapped(model) == []
    double = copy.deepcopy(model).to(torch.float64)
    with torch.no_grad(), packed_linears(double):
        assert _swapped(double) == []


@needs_packing
@pytest.mark.skipif(torch.bfloat16 not in packed_linear.packed_dtypes(), reason="no oneDNN bfloat16 kernels on this CPU")
def test_bfloat16_layers_are_packed_and_match_pytorch():
    tokenizer, model, rows, _ = make_prompts()
    model = model.to(torch.bfloat16)
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits.float()
        with packed_linears(model):
            assert len(_swapped(model)) == len(_linears(model))
            got = model(input_ids=ids, attention_mask=mask).logits.float()
    # both round to bfloat16 (8 significant bits) after every layer; they agree to that precision
    assert torch.nn.functional.cosine_similarity(got.flatten(1), expected.flatten(1)).min() > 0.99


@needs_packing
def test_nested_blocks_swap_once_and_restore():
    _, model, _, _ = make_prompts()
    with torch.no_grad(), packed_linears(model):
        with packed_linears(model.get_decoder()):
            assert len(_swapped(model)) == len(_linears(model))
        assert len(_swapped(model)) == len(_linears(model))
    assert _swapped(model) == []


@needs_packing
def test_packed_weights_stay_out_of_the_model():
    tokenizer, model, rows, spans = make_prompts()
    keys = set(model.state_dict())
    one_pass_rollouts(model, tokenizer, rows, spans, 8)
    assert set(model.state_dict()) == keys
    pickle.loads(pickle.dumps(model))  # the multi-process pool pickles the model
    copy.deepcopy(model)


def test_a_kernel_that_disagrees_switches_packing_off(monkeypatch):
    monkeypatch.setattr(packed_linear, "_kernel_ok", None)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, w, b, *args: torch.zeros(1), raising=False)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda w, *args: w, raising=False)
    _, model, _, _ = make_prompts()
    with pytest.warns(UserWarning, match="disagree"), torch.no_grad(), packed_linears(model):
        assert _swapped(model) == []
    assert not packing_enabled()


def test_preallocated_cache_matches_transformers_dynamic_cache():
    from transformers import DynamicCache

    tokenizer, model, rows, _ = make_prompts()
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    step = torch.tensor([[5], [6], [7], [8]])
    step_mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.long)], 1)
    outputs = []
    for cache in (DynamicCache(config=model.config), preallocated_cache(model, ids.shape[1] + 1)):
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, past_key_values=cache)
            cache.batch_select_indices(torch.tensor([0, 2, 3]))
            keep = torch.tensor([0, 2, 3])
            outputs.append(model(input_ids=step[keep], attention_mask=step_mask[keep], past_key_values=cache).logits)
        assert cache.get_seq_length() == ids.shape[1] + 1
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)


def test_preallocated_cache_refuses_to_overflow():
    tokenizer, model, rows, _ = make_prompts()
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    with torch.no_grad(), pytest.raises(RuntimeError, match="cannot hold"):
        model(input_ids=ids, attention_mask=mask, past_key_values=preallocated_cache(model, ids.shape[1] - 1))
