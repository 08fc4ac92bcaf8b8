"""GRC's compressed memory for users: :func:`compress` texts into their latent keys and values, :func:`answer` a
question from one or more of them (grc.md, "Latent memory-augmented generation"; :mod:`grace_st.grc` holds the
pass and the file format).

A memory is the m latent positions' keys and values at every layer, whatever the text's length
(:attr:`~grace_st.grc.LatentMemory.nbytes`: Eq. 6). The model reads it as the past of a new conversation whose
system turn is :data:`~grace_st.grc.MEMORY_INSTRUCTION`, as training's reconstruction turn did.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .explain import check_texts, find_generative_encoder
from .grc import MEMORY_INSTRUCTION, LatentMemory, answer_from_memory


def _grc_encoder(model):
    encoder = find_generative_encoder(model)
    if encoder.method != "grc":
        raise ValueError(
            f"compressed memories are GRC's (method 'grc'); this model's method is {encoder.method!r}, "
            "whose states are no trained memory"
        )
    encoder.check_settings()
    return encoder


@torch.no_grad()
def compress(model, texts, *, prompt_name: str = "document", batch_size: int = 16) -> list[LatentMemory]:
    """Each text's memory: its prompt under ``prompt_name``'s instruction and response (a document's "None", or
    the response its budget allows), then the latents, whose keys and values are kept (the same pass as its
    embedding)."""
    encoder = _grc_encoder(model)
    texts = check_texts(texts)
    kind = encoder.prompt_names.get(prompt_name, prompt_name)
    prompts, span = encoder.prompt_token_ids(texts, task=kind)
    engine = encoder.engine
    responses = engine.responses(prompts, span, encoder.rationale_budget(kind))
    rows = [[*prompt, *response] for prompt, response in zip(prompts, responses)]
    return [memory for result in engine.latent_passes(rows, batch_size, with_memory=True) for memory in result.memories]


def memory_prompt(encoder, question: str) -> list[int]:
    """The turn that reads a memory: the model's prompt for ``question`` under :data:`MEMORY_INSTRUCTION`."""
    template = encoder.prompt_template(MEMORY_INSTRUCTION)
    return template.rows(encoder.tokenizer, [question], encoder.max_input_tokens)[0]


def answer(
    model,
    question: str,
    memories: Sequence[LatentMemory] = (),
    *,
    context: str | None = None,
    max_new_tokens: int = 128,
) -> str:
    """The model's greedy answer to ``question`` reading ``memories`` (none: from its own knowledge). ``context``
    puts a plain text before the question instead, the baseline a memory stands in for."""
    encoder = _grc_encoder(model)
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question must be a non-empty string, got {question!r:.80}")
    text = question if context is None else f"{context}\n\n{question}"
    ids = answer_from_memory(
        encoder.model, memory_prompt(encoder, text), list(memories), max_new_tokens=max_new_tokens,
        eos_token_ids=encoder.eos_token_ids,
    )
    return encoder.tokenizer.decode(ids, skip_special_tokens=True)
