"""The one-pass rollout against the two-pass reference, and decoding details."""

import pytest
import torch
from conftest import PROMPT_TEXTS, make_prompts, model_view, one_pass_rollouts

from grace_st.runtime.batch import masked_mean
from grace_st.runtime.decoding import DecodeOptions
from grace_st.runtime.second_pass import two_pass_reference

TEXTS = PROMPT_TEXTS


def _rationales(rollouts):
    return [[t for t in row if t >= 0] for row in rollouts.rationale_ids.tolist()]


@pytest.mark.parametrize("template_name", ["chatml", "llama3", "no_system"])
@pytest.mark.parametrize("max_new_tokens", [0, 1, 12])
@pytest.mark.parametrize("packed", ["1", "0"], ids=["onednn", "mkl"])  # grace_st.runtime.cpu.packed_linear on and off
def test_one_pass_equals_two_pass_reference(template_name, max_new_tokens, packed):
    tokenizer, model, rows, spans = make_prompts(template_name)
    options = DecodeOptions(packed_linears=packed == "1")
    rollouts = one_pass_rollouts(model, tokenizer, rows, spans, max_new_tokens, options=options)
    reference, reference_rationales = two_pass_reference(
        model_view(model, tokenizer, options=options), rows, spans, max_new_tokens=max_new_tokens
    )
    assert _rationales(rollouts) == reference_rationales
    one_pass = masked_mean(rollouts.token_embeddings, rollouts.pooling_mask)
    torch.testing.assert_close(one_pass, reference, atol=1e-5, rtol=1e-4)


def test_one_pass_equals_two_pass_at_another_layer():
    tokenizer, model, rows, spans = make_prompts()
    rollouts = one_pass_rollouts(model, tokenizer, rows, spans, 6, hidden_layer=1)
    reference, _ = two_pass_reference(model_view(model, tokenizer, hidden_layer=1), rows, spans, max_new_tokens=6)
    torch.testing.assert_close(masked_mean(rollouts.token_embeddings, rollouts.pooling_mask), reference, atol=1e-5, rtol=1e-4)


def test_eos_ends_the_rationale_and_is_not_pooled():
    tokenizer, model, rows, spans = make_prompts()
    free = one_pass_rollouts(model, tokenizer, rows, spans, 10)
    assert free.truncated.all()
    # declare row 0's fourth token an end-of-sequence token: row 0 must stop before it
    stop = _rationales(free)[0][3]
    stopped = one_pass_rollouts(model, tokenizer, rows, spans, 10, eos=[tokenizer.eos_token_id, stop])
    first = _rationales(stopped)[0]
    assert stop not in first and first == _rationales(free)[0][: len(first)]
    assert not stopped.truncated[0] and int(stopped.stop_ids[0]) == stop
    assert (free.stop_ids == -1).all()
    # pooled positions: prompt after L_sys plus exactly the rationale tokens, EOS excluded
    prompt_pooled = len(rows[0]) - spans[0]
    assert int(stopped.pooling_mask[0].sum()) == prompt_pooled + len(first)
    reference, reference_rationales = two_pass_reference(
        model_view(model, tokenizer, [tokenizer.eos_token_id, stop]), rows, spans, max_new_tokens=10
    )
    assert reference_rationales[0] == first
    torch.testing.assert_close(masked_mean(stopped.token_embeddings, stopped.pooling_mask), reference, atol=1e-5, rtol=1e-4)


def test_batching_and_left_padding_do_not_change_a_text():
    tokenizer, model, rows, spans = make_prompts()
    batched = one_pass_rollouts(model, tokenizer, rows, spans, 8)
    for i in range(len(rows)):
        alone = one_pass_rollouts(model, tokenizer, rows[i : i + 1], spans[i : i + 1], 8)
        assert _rationales(alone) == _rationales(batched)[i : i + 1]
        torch.testing.assert_close(
            masked_mean(alone.token_embeddings, alone.pooling_mask)[0],
            masked_mean(batched.token_embeddings, batched.pooling_mask)[i],
            atol=1e-5,
            rtol=1e-4,
        )


def test_seeded_sampling_is_reproducible_and_per_row():
    tokenizer, model, rows, spans = make_prompts()
    kwargs = dict(do_sample=True, temperature=1.0, top_p=0.9)
    first = one_pass_rollouts(model, tokenizer, rows, spans, 8, seeds=[1, 2, 3, 4], **kwargs)
    again = one_pass_rollouts(model, tokenizer, rows, spans, 8, seeds=[1, 2, 3, 4], **kwargs)
    assert _rationales(first) == _rationales(again)
    alone = one_pass_rollouts(model, tokenizer, rows[2:3], spans[2:3], 8, seeds=[3], **kwargs)
    assert _rationales(alone)[0] == _rationales(first)[2]
    other_seed = one_pass_rollouts(model, tokenizer, rows, spans, 8, seeds=[9, 9, 9, 9], **kwargs)
    assert _rationales(other_seed) != _rationales(first)


def test_the_inverse_cdf_draw_samples_each_token_at_its_probability():
    """One uniform a row picks the token whose cumulative interval holds it: frequencies match the
    distribution (a chi-square well inside its 99.9 % bound), a zero-probability token (cut by
    top-p) is never drawn, not even at the edges u = 0 and u → 1, and rows are independent."""
    from grace_st.runtime.generation import inverse_cdf_draw

    probs = torch.tensor([0.0, 0.1, 0.0, 0.25, 0.05, 0.6, 0.0])
    draws = 200_000
    generator = torch.Generator().manual_seed(0)
    tokens = inverse_cdf_draw(probs.expand(draws, -1), torch.rand(draws, dtype=torch.float64, generator=generator))
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0
    expected = probs[probs > 0].double() * draws
    chi_square = float(((counts[probs > 0] - expected) ** 2 / expected).sum())
    assert chi_square < 16.27  # 3 degrees of freedom, p = 0.001
    edges = torch.tensor([0.0, 1.0 - 2**-53, 0.2, 0.37], dtype=torch.float64)
    assert inverse_cdf_draw(probs.expand(4, -1) * 3, edges).tolist() == [1, 5, 3, 4]  # unnormalised rows too


def test_a_temperature_a_row_equals_one_call_per_temperature():
    """Rows of several temperatures in one call get what separate calls give them (0: greedy)."""
    tokenizer, model, rows, spans = make_prompts()
    temperatures, seeds = [0.5, 0.0, 1.3, 0.0], [1, 2, 3, 4]
    mixed = one_pass_rollouts(model, tokenizer, rows, spans, 8, do_sample=True, temperature=temperatures, seeds=seeds)
    for index, temperature in enumerate(temperatures):
        alone = one_pass_rollouts(
            model, tokenizer, rows[index : index + 1], spans[index : index + 1], 8,
            do_sample=temperature > 0, temperature=temperature or 1.0, seeds=seeds[index : index + 1],
        )
        assert _rationales(alone)[0] == _rationales(mixed)[index], index
    greedy = one_pass_rollouts(model, tokenizer, rows, spans, 8)
    assert [_rationales(mixed)[i] for i in (1, 3)] == [_rationales(greedy)[i] for i in (1, 3)]
    with pytest.raises(ValueError, match="3 temperatures for 4 prompts"):
        one_pass_rollouts(model, tokenizer, rows, spans, 2, do_sample=True, temperature=[1.0, 1.0, 1.0], seeds=seeds)


@pytest.mark.parametrize("do_sample", [False, True])
def test_dropping_finished_rows_changes_nothing(do_sample):
    tokenizer, model, rows, spans = make_prompts()
    decoding = dict(do_sample=do_sample, seeds=[1, 2, 3, 4] if do_sample else None)
    free = one_pass_rollouts(model, tokenizer, rows, spans, 10, **decoding)
    # stop tokens that end rows 0 and 2 early, at different steps, so rows leave the batch
    stops = [tokenizer.eos_token_id, _rationales(free)[0][2], _rationales(free)[2][5]]
    kwargs = dict(eos=stops, **decoding)
    dropped = one_pass_rollouts(model, tokenizer, rows, spans, 10, options=DecodeOptions(drop_finished=True), **kwargs)
    kept = one_pass_rollouts(model, tokenizer, rows, spans, 10, options=DecodeOptions(drop_finished=False), **kwargs)
    assert _rationales(dropped) == _rationales(kept)
    assert not dropped.truncated.all()
    assert torch.equal(dropped.pooling_mask, kept.pooling_mask) and torch.equal(dropped.stop_ids, kept.stop_ids)
    torch.testing.assert_close(
        masked_mean(dropped.token_embeddings, dropped.pooling_mask),
        masked_mean(kept.token_embeddings, kept.pooling_mask),
        atol=1e-5,
        rtol=1e-4,
    )


def test_shared_prefix_length_stops_at_the_first_difference_and_at_its_caps():
    from grace_st.runtime.batch import left_pad
    from grace_st.runtime.decoding import shared_prefix_length

    ids, mask = left_pad([[5, 6, 7, 8, 9], [5, 6, 7, 1], [5, 6, 2, 3, 4, 4]], 0)
    assert shared_prefix_length(ids, mask, torch.tensor([4, 4, 4])) == 2  # rows part after 5, 6
    ids, mask = left_pad([[5, 6, 7, 8, 9], [5, 6, 7, 8, 1, 2]], 0)
    assert shared_prefix_length(ids, mask, torch.tensor([4, 4])) == 4
    assert shared_prefix_length(ids, mask, torch.tensor([4, 3])) == 3  # never into a pooled position
    ids, mask = left_pad([[5, 6, 7], [5, 6, 7, 8, 1, 2]], 0)
    assert shared_prefix_length(ids, mask, torch.tensor([3, 3])) == 2  # each row keeps a token to feed
    ids, mask = left_pad([[5, 6, 7, 8]], 0)
    assert shared_prefix_length(ids, mask, torch.tensor([3])) == 0  # one row: nothing to share
    ids, mask = left_pad([[1, 6, 7, 8], [5, 6, 7, 8]], 0)
    assert shared_prefix_length(ids, mask, torch.tensor([3, 3])) == 0


@pytest.mark.parametrize("max_new_tokens", [0, 7])
@pytest.mark.parametrize("hidden_layer", [-1, 1])
@pytest.mark.parametrize("mixed", [False, True], ids=["one_instruction", "two_instructions"])
def test_a_shared_instruction_prefix_computed_once_changes_nothing(max_new_tokens, hidden_layer, mixed):
    from grace_st.prompts import build_prompt_template, tokenize_texts
    from grace_st.runtime.batch import left_pad
    from grace_st.runtime.decoding import shared_prefix_length

    tokenizer, model, rows, spans = make_prompts()
    if mixed:  # a batch of two instructions shares only the template's opening tokens
        other = build_prompt_template(tokenizer, "Summarise the passage below.")
        rows[1] = other.build(tokenize_texts(tokenizer, [TEXTS[1]])[0])
        spans[1] = other.instruction_span
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    shared = shared_prefix_length(ids, mask, torch.tensor(spans))
    assert 0 < shared < min(spans) if mixed else shared == min(spans)
    kwargs = dict(hidden_layer=hidden_layer, do_sample=True, seeds=[3, 1, 4, 1])
    once = one_pass_rollouts(model, tokenizer, rows, spans, max_new_tokens, options=DecodeOptions(share_prefix=True), **kwargs)
    per_row = one_pass_rollouts(
        model, tokenizer, rows, spans, max_new_tokens, options=DecodeOptions(share_prefix=False), **kwargs
    )
    assert torch.equal(once.rationale_ids, per_row.rationale_ids)
    assert torch.equal(once.pooling_mask, per_row.pooling_mask)
    real = once.attention_mask.bool()  # padding columns carry no state worth comparing
    torch.testing.assert_close(once.token_embeddings[real], per_row.token_embeddings[real], atol=1e-5, rtol=1e-4)
    prompt = slice(0, once.attention_mask.shape[1] - once.rationale_ids.shape[1])
    for rollouts in (once, per_row):
        assert (rollouts.token_embeddings[:, prompt][~real[:, prompt]] == 0).all()


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("max_new_tokens", [0, 10])
def test_the_plain_loop_and_every_optimisation_agree(do_sample, max_new_tokens):
    """DecodeOptions.plain() is textbook incremental decoding with a DynamicCache; the default turns on
    all four optimisations of grace_st.runtime.decoding at once (rows finishing early, so some are dropped)."""
    tokenizer, model, rows, spans = make_prompts()
    decoding = dict(do_sample=do_sample, seeds=[5, 6, 7, 8] if do_sample else None)
    free = one_pass_rollouts(model, tokenizer, rows, spans, 10, **decoding)
    stops = [tokenizer.eos_token_id, _rationales(free)[1][1], _rationales(free)[3][4]]
    plain = one_pass_rollouts(model, tokenizer, rows, spans, max_new_tokens, stops, options=DecodeOptions.plain(), **decoding)
    fast = one_pass_rollouts(model, tokenizer, rows, spans, max_new_tokens, stops, options=DecodeOptions(), **decoding)
    assert torch.equal(plain.rationale_ids, fast.rationale_ids)
    assert torch.equal(plain.pooling_mask, fast.pooling_mask) and torch.equal(plain.stop_ids, fast.stop_ids)
    assert torch.equal(plain.truncated, fast.truncated) and (max_new_tokens == 0 or not fast.truncated.all())
    torch.testing.assert_close(
        masked_mean(fast.token_embeddings, fast.pooling_mask), masked_mean(plain.token_embeddings, plain.pooling_mask),
        atol=1e-5, rtol=1e-4,
    )


@pytest.mark.parametrize("max_new_tokens", [0, 8])
@pytest.mark.parametrize("preallocated", [False, True])
def test_repeated_prompts_prefilled_once_change_nothing(max_new_tokens, preallocated):
    """The K rollouts of one positive repeat its prompt: prefilled once and copied, each row still
    samples its own rationale, exactly as when every row is prefilled."""
    tokenizer, model, rows, spans = make_prompts()
    rows, spans = [rows[0], rows[2], rows[0], rows[2], rows[0], rows[3]], [spans[0]] * 6
    kwargs = dict(do_sample=True, seeds=[1, 2, 3, 4, 5, 6])
    options = dict(preallocated_cache=preallocated, share_prefix=preallocated)
    once = one_pass_rollouts(model, tokenizer, rows, spans, max_new_tokens,
                             options=DecodeOptions(dedupe_prompts=True, **options), **kwargs)
    each = one_pass_rollouts(model, tokenizer, rows, spans, max_new_tokens,
                             options=DecodeOptions(dedupe_prompts=False, **options), **kwargs)
    assert torch.equal(once.rationale_ids, each.rationale_ids) and torch.equal(once.stop_ids, each.stop_ids)
    assert torch.equal(once.pooling_mask, each.pooling_mask)
    torch.testing.assert_close(once.token_embeddings, each.token_embeddings, atol=1e-5, rtol=1e-4)
    if max_new_tokens:  # different seeds, one prompt: the copies write different rationales
        assert len({tuple(r) for r in _rationales(once)[0::2]}) > 1


def _many_prompts(extra: int = 9):
    """make_prompts' rows and ``extra`` more of assorted lengths (more rows than the slots they stream through)."""
    from grace_st.prompts import build_prompt_template, tokenize_texts

    tokenizer, model, rows, spans = make_prompts()
    built = build_prompt_template(tokenizer, "Read and analyze the following text.")
    texts = ["word " * (i % 7) + f"number {i} " + "x " * (i % 3) for i in range(extra)]
    rows += [built.build(ids) for ids in tokenize_texts(tokenizer, texts)]
    return tokenizer, model, rows, spans + [built.instruction_span] * extra


def _stream(model, tokenizer, rows, spans, max_new_tokens, eos, slots, **kwargs):
    from conftest import rollout_settings

    from grace_st.runtime.generation import stream_rollouts

    view, settings, per_row = rollout_settings(model, tokenizer, eos, **kwargs)
    return stream_rollouts(view, rows, spans, settings, slots=slots, max_new_tokens=max_new_tokens, **per_row)


def _assert_same_rollouts(streamed, one_pass):
    assert torch.equal(streamed.rationale_ids, one_pass.rationale_ids)
    assert torch.equal(streamed.stop_ids, one_pass.stop_ids) and torch.equal(streamed.truncated, one_pass.truncated)
    assert torch.equal(streamed.attention_mask, one_pass.attention_mask)
    assert torch.equal(streamed.pooling_mask, one_pass.pooling_mask)
    real = one_pass.attention_mask.bool()
    torch.testing.assert_close(streamed.token_embeddings[real], one_pass.token_embeddings[real], atol=1e-5, rtol=1e-4)
    assert (streamed.token_embeddings[~real] == 0).all()


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("slots", [1, 3])
def test_continuous_batching_changes_nothing(do_sample, slots, monkeypatch):
    """Rows streamed through a few slots (a finished row's slot prefilled with the next prompt) give the
    rollouts of one pass over every row: rationales, stops, truncation, pooled positions and states. With
    one slot the cache runs out of columns and is compacted on the way."""
    from grace_st.runtime.decoding import PreallocatedLayer

    tokenizer, model, rows, spans = _many_prompts()
    decoding = dict(do_sample=do_sample, seeds=list(range(len(rows))) if do_sample else None)
    free = one_pass_rollouts(model, tokenizer, rows, spans, 12, **decoding)
    # stop tokens that end rows at different steps (some at once, some never)
    stops = [tokenizer.eos_token_id] + [_rationales(free)[i][j] for i, j in [(0, 2), (2, 5), (5, 1), (7, 8)]]
    one_pass = one_pass_rollouts(model, tokenizer, rows, spans, 12, stops, **decoding)
    lengths = {len(r) for r in _rationales(one_pass)}
    assert len(lengths) >= 3 and 12 in lengths  # ragged: what streaming is for

    compactions = []
    shift = PreallocatedLayer.shift
    monkeypatch.setattr(PreallocatedLayer, "shift", lambda layer, start, offset: (compactions.append(start), shift(layer, start, offset))[1])
    streamed = _stream(model, tokenizer, rows, spans, 12, stops, slots, **decoding)
    _assert_same_rollouts(streamed, one_pass)
    assert (slots == 1) <= any(start > 0 for start in compactions)


def test_continuous_batching_with_two_instructions_repeats_and_another_layer():
    """Prompts of two instructions (admitted together, sharing only the template's opening), a prompt
    repeated (prefilled once) and states from another layer stream as they decode in one pass."""
    from grace_st.prompts import build_prompt_template, tokenize_texts

    tokenizer, model, rows, spans = _many_prompts(5)
    other = build_prompt_template(tokenizer, "Summarise the passage below.")
    rows[1], spans[1] = other.build(tokenize_texts(tokenizer, [TEXTS[1]])[0]), other.instruction_span
    rows[4], spans[4] = rows[2], spans[2]
    kwargs = dict(hidden_layer=1, do_sample=True, seeds=[9, 8, 7, 6, 5, 4, 3, 2, 1])
    free = one_pass_rollouts(model, tokenizer, rows, spans, 9, **kwargs)
    stops = [tokenizer.eos_token_id, _rationales(free)[0][1], _rationales(free)[3][4]]
    one_pass = one_pass_rollouts(model, tokenizer, rows, spans, 9, stops, **kwargs)
    _assert_same_rollouts(_stream(model, tokenizer, rows, spans, 9, stops, 4, **kwargs), one_pass)


def test_decode_rows_must_be_a_positive_int():
    for bad in (0, -1, 2.5, "64"):
        with pytest.raises(ValueError, match="decode_rows"):
            DecodeOptions(decode_rows=bad)


def test_the_repetition_penalty_divides_positive_logits_and_multiplies_negative_ones_of_written_tokens():
    from grace_st.runtime.generation import penalise_repeats

    logits = torch.tensor([[2.0, -2.0, 1.0], [2.0, -2.0, 1.0]])
    written = torch.tensor([[True, True, False], [False, False, False]])
    assert torch.equal(penalise_repeats(logits, written, 2.0), torch.tensor([[1.0, -4.0, 1.0], [2.0, -2.0, 1.0]]))
    assert penalise_repeats(logits, None, 2.0) is logits and penalise_repeats(logits, written, 1.0) is logits
    # the written entries alone are touched, with CTRL's formula over the whole vocabulary bit for bit
    logits, written = torch.randn(5, 300), torch.rand(5, 300) < 0.05
    dense = torch.where(written, torch.where(logits > 0, logits / 1.3, logits * 1.3), logits)
    before = logits.clone()
    assert torch.equal(penalise_repeats(logits, written, 1.3), dense) and torch.equal(logits, before)


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_repetition_penalty_keeps_a_rationale_from_repeating_its_own_tokens(do_sample):
    """Without a penalty the tiny model's greedy rationales repeat tokens; with a large one no rationale
    holds a token twice. A penalty of 1 is exactly no penalty."""
    tokenizer, model, rows, spans = _many_prompts(3)
    decoding = dict(do_sample=do_sample, seeds=list(range(len(rows))) if do_sample else None)
    free = one_pass_rollouts(model, tokenizer, rows, spans, 12, **decoding)
    assert any(len(set(r)) < len(r) for r in _rationales(free))  # not vacuous: the model repeats itself
    _assert_same_rollouts(one_pass_rollouts(model, tokenizer, rows, spans, 12, repetition_penalty=1.0, **decoding), free)
    penalised = one_pass_rollouts(model, tokenizer, rows, spans, 12, repetition_penalty=1e6, **decoding)
    assert all(len(set(r)) == len(r) for r in _rationales(penalised))
    assert _rationales(penalised) != _rationales(free)
    # a budget of 0 writes nothing to penalise: the prompt is pooled as without a penalty
    prompt_only = one_pass_rollouts(model, tokenizer, rows, spans, 0, **decoding)
    _assert_same_rollouts(one_pass_rollouts(model, tokenizer, rows, spans, 0, repetition_penalty=1.3, **decoding), prompt_only)


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_repetition_penalty_streams_as_it_decodes_in_one_pass(do_sample):
    """Continuous batching clears a slot's written tokens when the slot takes the next prompt: each row's
    penalty counts its own rationale only, as in one pass."""
    tokenizer, model, rows, spans = _many_prompts()
    decoding = dict(do_sample=do_sample, seeds=list(range(len(rows))) if do_sample else None, repetition_penalty=1.5)
    free = one_pass_rollouts(model, tokenizer, rows, spans, 10, **decoding)
    stops = [tokenizer.eos_token_id] + [_rationales(free)[i][j] for i, j in [(0, 2), (2, 5), (5, 1)]]
    one_pass = one_pass_rollouts(model, tokenizer, rows, spans, 10, stops, **decoding)
    _assert_same_rollouts(_stream(model, tokenizer, rows, spans, 10, stops, 3, **decoding), one_pass)
