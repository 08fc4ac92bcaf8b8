"""What :meth:`GenerativeEncoder.preprocess <grace_st.encoder.GenerativeEncoder.preprocess>` hands forward.

Each text's P(x): checked to be a string (:func:`check_texts`), templated and cut to fit
``max_input_tokens`` (the prompt template's ``rows``); the rows repeated once a rationale and left-padded, with L_sys
and the batch's plan (:func:`features`); and each rollout's sampling seed (:func:`rationale_seeds`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from grace_st.prompts import text_problem
from grace_st.runtime.batch import left_pad


def check_texts(texts: Sequence[Any]) -> None:
    """Refuse a batch holding anything but strings, naming the item and what it is."""
    for index, text in enumerate(texts):
        problem = text_problem(text)
        if problem is not None:
            # ValueError, not TypeError: sentence-transformers 6 answers a TypeError from
            # preprocess by retrying with the prompt glued to each text, and that retry's
            # own error (str + list) would replace this one.
            raise ValueError(
                f"GenerativeEncoder takes strings; item {index} of this batch (sorted by length) {problem}"
            )


def check_prompts(rows: Sequence[Sequence[int]], instruction_span: int, pools_prompt: bool = False) -> None:
    """Refuse a prompt that leaves nothing to embed, naming the item. Only GIRCSE's reference format can make one
    (a chat template always has tokens around the text): an empty text under an empty instruction is a prompt of
    no token, which no model can be run on; and where the prompt itself is pooled (``pools_prompt``: a budget of 0,
    Eq. 3 over t > L_sys), an empty text leaves no position after the instruction, whose mean would be a zero
    vector standing in for an embedding."""
    for index, row in enumerate(rows):
        if not row:
            raise ValueError(
                f"GenerativeEncoder: item {index} of this batch (sorted by length) is an empty text under an empty "
                "instruction: in prompt_format 'instruct' its prompt has no token to run the model on; give its "
                "prompt type an instruction, or leave empty texts out"
            )
        if pools_prompt and len(row) <= instruction_span:
            raise ValueError(
                f"GenerativeEncoder: item {index} of this batch (sorted by length) leaves nothing to pool: with "
                "max_rationale_tokens 0 the prompt after the instruction is pooled, and in prompt_format 'instruct' "
                "an empty text has no token there (nor has any text once the instruction fills max_input_tokens); "
                "give it soft tokens (max_rationale_tokens >= 1), or leave empty texts out"
            )


def features(
    rows: list[list[int]], instruction_span: int, repeats: int, budget: int, pad_token_id: int
) -> dict[str, Any]:
    """Each row ``repeats`` times, left-padded, with its L_sys, and the batch's rationale budget and count."""
    rows = [row for row in rows for _ in range(repeats)]
    input_ids, attention_mask = left_pad(rows, pad_token_id)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "instruction_lengths": torch.full((len(rows),), instruction_span, dtype=torch.long),
        "rationale_budget": budget,
        "num_rationales": repeats,
    }


def rationale_seed(seed: int, instruction: str, text: str, index: int) -> int:
    key = f"{seed}\x00{index}\x00{instruction}\x00{text}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def rationale_seeds(seed: int, instruction: str, texts: Sequence[str], repeats: int) -> Tensor:
    """One seed a rollout, from the setting's seed, the instruction, the text and the rollout's index: a
    text gets the same rationales whatever batch it is in."""
    return torch.tensor(
        [rationale_seed(seed, instruction, text, k) for text in texts for k in range(repeats)],
        dtype=torch.long,
    )
