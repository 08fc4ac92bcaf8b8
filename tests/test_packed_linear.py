"""oneDNN-packed linear layers (grace_st.runtime.cpu.packed_linear) and the preallocated KV cache."""

import copy
import pickle

import pytest
import torch
from conftest import make_prompts, one_pass_rollouts

from grace_st.runtime.cpu import packed_linear
from grace_st.runtime.batch import left_pad
from grace_st.runtime.cpu.packed_linear import packed_linears, packing_enabled
from grace_st.runtime.decoding import DecodeOptions, preallocated_cache
from grace_st.runtime.transformers_compat import cache_kwargs

needs_packing = pytest.mark.skipif(not packing_enabled(), reason="this PyTorch has no oneDNN packed linear operators")


def _linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def _swapped(model):
    """The linear layers that run on packed weights in this thread now."""
    return [m for m in _linears(model) if packed_linear.runs_packed(m)]


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
def test_a_block_holds_for_its_own_thread_only():
    """Another thread's forward through the same layers, while this thread's block is open, runs the
    class's own forward (no block of its own) or its own block: nothing is swapped under it."""
    import threading

    tokenizer, model, rows, _ = make_prompts()
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    seen = {}

    def other(name, packed):
        with torch.no_grad(), packed_linears(model, enabled=packed):
            seen[name] = (_swapped(model), model(input_ids=ids, attention_mask=mask).logits)

    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
        with packed_linears(model):
            for name, packed in (("plain", False), ("packed", True)):
                thread = threading.Thread(target=other, args=(name, packed))
                thread.start()
                thread.join()
            assert len(_swapped(model)) == len(_linears(model))
            here = model(input_ids=ids, attention_mask=mask).logits
    assert seen["plain"][0] == [] and torch.equal(seen["plain"][1], plain)
    assert len(seen["packed"][0]) == len(_linears(model)) and torch.equal(seen["packed"][1], here)


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
            model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache))
            cache.batch_select_indices(torch.tensor([0, 2, 3]))
            keep = torch.tensor([0, 2, 3])
            logits = model(input_ids=step[keep], attention_mask=step_mask[keep], **cache_kwargs(model, cache)).logits
            outputs.append(logits)
        assert cache.get_seq_length() == ids.shape[1] + 1
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)


def test_preallocated_cache_refuses_to_overflow():
    tokenizer, model, rows, _ = make_prompts()
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    with torch.no_grad(), pytest.raises(RuntimeError, match="cannot hold"):
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, preallocated_cache(model, ids.shape[1] - 1)))


def _lora(model, **kwargs):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", **kwargs)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # B starts at zero: give the adapter something to add
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return peft_model


def _lora_layers(model):
    from peft.tuners.lora.layer import Linear

    return [m for m in model.modules() if isinstance(m, Linear)]


@needs_packing
def test_a_lora_layer_runs_on_its_merged_weight_and_follows_adapter_updates():
    """Each PEFT LoRA layer becomes one packed product on W + ΔW: equal to PEFT's forward (and to
    merge_and_unload) to float32 rounding, repacked after an optimizer step on the adapter."""
    tokenizer, model, rows, _ = make_prompts()
    policy = _lora(model)
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        expected = policy(input_ids=ids, attention_mask=mask).logits
        with packed_linears(policy):
            layers = _lora_layers(policy)
            assert layers and all(packed_linear.runs_packed(layer) for layer in layers)
            # their base, A and B are not run (nor packed) on their own
            assert not any(packed_linear.runs_packed(part) for layer in layers for part in layer.modules() if part is not layer)
            got = policy(input_ids=ids, attention_mask=mask).logits
        unmerged_packing = packed_linears(policy, merge_adapters=False)
        with unmerged_packing:
            assert not any(packed_linear.runs_packed(layer) for layer in layers)
            unmerged = policy(input_ids=ids, attention_mask=mask).logits
        merged = copy.deepcopy(policy).merge_and_unload()(input_ids=ids, attention_mask=mask).logits
    assert not any(packed_linear.runs_packed(m) for m in policy.modules())
    # The weight merge_and_unload computes, to the packed kernel's rounding; PEFT's unmerged
    # forward sums W·x + B·(A·x) in another order (relative 1e-4 on a few logits).
    torch.testing.assert_close(got, merged, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(unmerged, expected, atol=1e-5, rtol=1e-5)

    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=1.0)
    policy(input_ids=ids, attention_mask=mask).logits.square().mean().backward()
    optimizer.step()
    with torch.no_grad():
        expected = policy(input_ids=ids, attention_mask=mask).logits
        with packed_linears(policy):
            got = policy(input_ids=ids, attention_mask=mask).logits
        with policy.disable_adapter(), packed_linears(policy):
            base_only = policy(input_ids=ids, attention_mask=mask).logits
        with policy.disable_adapter():
            base_expected = policy(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(base_only, base_expected, atol=1e-5, rtol=1e-5)
    assert (expected - base_expected).abs().max() > 1e-3  # the adapter does change the output


@needs_packing
def test_lora_layers_peft_would_not_merge_the_same_way_keep_peft_forward():
    """DoRA rescales the merged weight by a norm that depends on it: not W + BA, so PEFT's forward runs."""
    tokenizer, model, rows, _ = make_prompts()
    policy = _lora(model, use_dora=True)
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        expected = policy(input_ids=ids, attention_mask=mask).logits
        with packed_linears(policy):
            assert not any(packed_linear.runs_packed(layer) for layer in _lora_layers(policy))
            got = policy(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@needs_packing
def test_one_row_runs_on_the_weight_along_its_longer_side_and_many_rows_never_lay_it_out():
    """Batch-1 decoding is a matrix-vector product: a weight that is not square runs on its longer
    side (transposed where out_features > in_features, else as stored; made at the first one-row
    call, equal to F.linear to float32 rounding), a square one on the packed layout; calls of several
    rows keep the packed layout and never pay for a copy."""
    tokenizer, model, rows, _ = make_prompts()
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        expected_batch = model(input_ids=ids, attention_mask=mask).logits
        expected_row = model(input_ids=ids[:1, -1:]).logits
        with packed_linears(model):
            got_batch = model(input_ids=ids, attention_mask=mask).logits
            assert all(packed_linear._packed[m].one_row is None for m in _linears(model))
            got_row = model(input_ids=ids[:1, -1:]).logits
            kinds = set()
            for linear in _linears(model):
                out_features, in_features = linear.weight.shape
                laid_out = packed_linear._packed[linear].one_row
                if out_features == in_features:
                    assert laid_out is None
                    kinds.add("square")
                    continue
                laid, transposed = laid_out
                assert transposed == (out_features > in_features)
                assert torch.equal(laid, linear.weight.t() if transposed else linear.weight)
                kinds.add(transposed)
            assert kinds == {True, False, "square"}  # the tiny model has every kind of layer
        with packed_linears(model, one_row_layout=False):
            unlaid = model(input_ids=ids[:1, -1:]).logits
    torch.testing.assert_close(got_batch, expected_batch, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_row, expected_row, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(unlaid, expected_row, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # a changed weight gets a new transposed copy too
        for linear in _linears(model):
            linear.weight.mul_(-0.5)
        expected_row = model(input_ids=ids[:1, -1:]).logits
        with packed_linears(model):
            got_row = model(input_ids=ids[:1, -1:]).logits
    torch.testing.assert_close(got_row, expected_row, atol=1e-5, rtol=1e-5)


@needs_packing
def test_one_row_of_a_lora_layer_runs_on_its_merged_weight():
    tokenizer, model, rows, _ = make_prompts()
    policy = _lora(model)
    ids, _ = left_pad(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        merged = copy.deepcopy(policy).merge_and_unload()(input_ids=ids[:1, -1:]).logits
        with packed_linears(policy):
            got = policy(input_ids=ids[:1, -1:]).logits
            layers = _lora_layers(policy)
            assert all(
                (packed_linear._packed[layer].one_row is None) == packed_linear._packed[layer].square for layer in layers
            )
    torch.testing.assert_close(got, merged, atol=1e-5, rtol=1e-5)


@needs_packing
def test_a_query_decoded_alone_gets_the_rationale_of_the_packed_layout():
    """The one-row layout changes how fast batch-1 decoding reads the weights, not what it writes."""
    tokenizer, model, rows, spans = make_prompts()
    for row, span in zip(rows, spans):
        # PyTorch's step, where the layout is used (the native one, grace_st.runtime.cpu.native_step, has its own)
        laid = one_pass_rollouts(model, tokenizer, [row], [span], 8, options=DecodeOptions(native_step=False))
        packed = one_pass_rollouts(
            model, tokenizer, [row], [span], 8, options=DecodeOptions(one_row_layout=False, native_step=False)
        )
        assert torch.equal(laid.rationale_ids, packed.rationale_ids)
        torch.testing.assert_close(laid.token_embeddings, packed.token_embeddings, atol=1e-5, rtol=1e-5)
