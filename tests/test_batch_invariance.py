"""A text's embedding is the same bits alone, in any batch, and in any order (where the native step
runs): the prompt pass, each decoding step, the attention's softmax and the pooled mean all give
a row the same result whatever padding and other rows surround it. The server relies on it."""

import pytest
import torch
from conftest import make_model, make_tokenizer

from grace_st import from_causal_lm, native_step

needs_compiler = pytest.mark.skipif(native_step.library() is None, reason="no C compiler to build the native step")

TEXTS = [
    "cats",
    "A man is playing a guitar on stage while the crowd sings along with every word of the chorus.",
    "Stock markets fell.",
    "How do vaccines train the immune system to recognise a virus it has never met before?",
    "the",
    "Proteins fold into shapes that decide what they do in the cell.",
]


@pytest.fixture(scope="module")
def model():
    tokenizer = make_tokenizer()
    # head_dim 16: the attention's vector path; budgets by type, a rationale for texts and queries
    return from_causal_lm(
        model=make_model(tokenizer, hidden_size=64),
        tokenizer=tokenizer,
        device="cpu",
        max_rationale_tokens={"default": 6, "query": 3, "document": 0},
    )


@needs_compiler
@pytest.mark.parametrize("prompt_name", [None, "query", "document"])
def test_a_text_is_the_same_bits_alone_batched_and_reordered(model, prompt_name):
    kwargs = {"prompt_name": prompt_name} if prompt_name else {}
    together = model.encode(TEXTS, convert_to_tensor=True, **kwargs)
    reordered = model.encode(TEXTS[::-1], convert_to_tensor=True, **kwargs).flip(0)
    pairs = model.encode(TEXTS, convert_to_tensor=True, batch_size=2, **kwargs)
    for index, text in enumerate(TEXTS):
        alone = model.encode([text], convert_to_tensor=True, **kwargs)[0]
        for other in (together, reordered, pairs):
            assert torch.equal(alone, other[index]), (prompt_name, text)


@needs_compiler
def test_continuous_batching_gives_each_text_the_bits_of_a_batch(model):
    """More texts than decode slots: rows stream through two slots, admitted as others finish."""
    from grace_st.runtime.decoding import DecodeOptions

    texts = TEXTS * 2
    expected = model.encode(texts, convert_to_tensor=True)
    model[0].decode_options = DecodeOptions(decode_rows=2)
    try:
        streamed = model.encode(texts, convert_to_tensor=True)
    finally:
        model[0].decode_options = DecodeOptions()
    assert torch.equal(streamed, expected)


def test_the_pooled_mean_does_not_depend_on_padding():
    from grace_st.runtime.batch import masked_mean

    torch.manual_seed(0)
    states, mask = torch.randn(1, 40, 64), torch.ones(1, 40)
    for pad in (1, 5, 17):
        left = torch.cat([torch.full((1, pad, 64), float("nan")), states], 1)
        right = torch.cat([states, torch.randn(1, pad, 64)], 1)
        others = torch.randn(3, 40 + pad, 64)
        batch = torch.cat([left, others])
        batch_mask = torch.cat([torch.cat([torch.zeros(1, pad), mask], 1), torch.ones(3, 40 + pad)])
        assert torch.equal(masked_mean(states, mask), masked_mean(batch, batch_mask)[:1])
        assert torch.equal(masked_mean(states, mask), masked_mean(right, torch.cat([mask, torch.zeros(1, pad)], 1)))


@needs_compiler
def test_a_stream_that_grows_its_slots_mid_decode_gives_each_row_its_bits(model):
    """Rows arriving while others decode: the cache gains rows (a copy into larger buffers) and every row,
    old or new, gets the rollout it gets alone."""
    from grace_st.runtime.batch import masked_mean
    from grace_st.runtime.decoding import incremental_decoder
    from grace_st.runtime.generation import RolloutSettings, RolloutStream, streamed_row

    encoder = model[0]
    rows, span = encoder.prompt_token_ids(TEXTS)
    engine = encoder.engine
    with torch.no_grad(), incremental_decoder(engine.view) as decoder:
        settings = RolloutSettings(repetition_penalty=encoder.repetition_penalty)
        stream = RolloutStream(decoder, settings, slots=lambda waiting: min(8, waiting))
        finished = {}
        stream.add(streamed_row(0, rows[0], span, 6))
        for step in range(40):
            if step in (1, 2):  # two rows join a running decode, twice: the slots grow from 1
                for index in range(1 + 2 * (step - 1), 3 + 2 * (step - 1)):
                    stream.add(streamed_row(index, rows[index], span, 6))
            for row in stream.step():
                finished[row.key] = row
        assert len(stream.done) >= 3 and not stream.busy
    pooled = {
        key: masked_mean(row.token_embeddings()[None], row.pooling_mask()[None])[0] for key, row in finished.items()
    }
    for key in sorted(pooled):
        expected = encoder.embed(encoder.preprocess([TEXTS[key]]))["sentence_embedding"][0]
        assert torch.equal(pooled[key], expected), key


@needs_compiler
def test_a_stream_gives_pytorch_its_threads_back(model):
    """A stream's last rows decode one at a time on the native single-row step, which holds PyTorch at one
    thread meanwhile: when the stream ends, PyTorch has its threads again."""
    from grace_st.runtime.decoding import DecodeOptions

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    model[0].decode_options = DecodeOptions(decode_rows=2)
    try:
        model.encode(TEXTS)
        assert torch.get_num_threads() == 2
    finally:
        model[0].decode_options = DecodeOptions()
        torch.set_num_threads(threads)
