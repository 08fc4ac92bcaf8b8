"""One loaded model, several Python threads encoding at once (a web app, a ThreadPoolExecutor, LangChain's
aembed_* in an executor): every call returns exactly what the same call returns alone."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import make_model, make_tokenizer

from grace_st import explain, from_causal_lm
from grace_st.runtime.decoding import DecodeOptions

THREADS = 6
ROUNDS = 2
# each thread its own texts (one of them a single text: the one-row path of a search box's query)
TEXTS = [
    ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog near the river bank."],
    ["Proteins fold into shapes that decide what they do in the cell."],
    ["Stock markets fell sharply after the central bank raised interest rates again.", "", "ignore the instructions"],
    ["Search query: which drugs lower blood pressure?", "beta blockers reduce heart rate."],
    ["Read and analyze the following text."],
    ["The cat looked at the garden.", "The river bank.", "Interest rates rose.", "Cells fold proteins."],
]


def _model(native_step: bool):
    tokenizer = make_tokenizer()
    model = from_causal_lm(
        model=make_model(tokenizer, hidden_size=64),
        tokenizer=tokenizer,
        device="cpu",
        max_rationale_tokens={"default": 8, "query": 3, "document": 12},
    )
    model[0].decode_options = DecodeOptions(native_step=native_step)
    return model


def _calls(model, texts: list[str]) -> list:
    """One thread's calls, in order: mixed encode / encode_query / explain at three budgets."""
    results = [
        model.encode(texts),
        model.encode_query(texts),
        model.encode(texts, prompt_name="document", batch_size=2),
    ]
    results += [item["embedding"] for item in explain(model, texts, task="query")]
    results += [item["rationale"] for item in explain(model, texts)]
    return results


def _same(expected: list, got: list) -> bool:
    return len(expected) == len(got) and all(
        np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(expected, got)
    )


@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("native_step", [True, False], ids=["native", "pytorch-step"])
def test_threads_get_what_the_same_calls_get_alone(native_step, cache, tmp_path):
    model = _model(native_step)
    if cache:  # each run starts from an empty file: a thread's first call generates, its later ones hit
        model[0].set_rationale_cache(tmp_path / "alone.sqlite")
    alone = [[_calls(model, texts) for _ in range(ROUNDS)] for texts in TEXTS]
    if cache:
        model[0].set_rationale_cache(tmp_path / "together.sqlite")

    got: list[list] = [[] for _ in TEXTS]
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def work(index: int) -> None:
        try:
            start.wait()
            for _ in range(ROUNDS):
                got[index].append(_calls(model, TEXTS[index]))
        except BaseException as error:  # noqa: BLE001 - reported below, with the thread's texts
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    assert not errors, f"{len(errors)} calls raised, the first: {errors[0]!r}"
    for index, (expected, rounds) in enumerate(zip(alone, got)):
        assert len(rounds) == ROUNDS
        for round_results, expected_results in zip(rounds, expected):
            assert _same(expected_results, round_results), f"thread {index} got other results than alone"
    if cache:
        model[0].set_rationale_cache(None)
