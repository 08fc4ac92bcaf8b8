"""GRC's compressed memory for users: :func:`compress` texts into their latent keys and values, :func:`answer` a
question from one or more of them (grc.md, "Latent memory-augmented generation"; :mod:`grace_st.methods.grc` holds the
pass and the file format).

A memory is the m latent positions' keys and values at every layer, whatever the text's length
(:attr:`~grace_st.methods.grc.LatentMemory.nbytes`: Eq. 6). The model reads it as the past of a new conversation whose
system turn is :data:`~grace_st.methods.grc.MEMORY_INSTRUCTION`, as training's reconstruction turn did. Keys and values
mean something only to the model that made them, so a memory carries that model's identity
(:class:`~grace_st.methods.grc.MemoryModel`) and another model refuses it (:func:`check_memories`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from grace_st.explain import check_texts, find_generative_encoder
from grace_st.methods.grc import (
    MEMORY_INSTRUCTION,
    LatentMemory,
    MemoryFileError,
    MemoryModel,
    answer_from_memory,
    memory_problem,
)


def _grc_encoder(model):
    encoder = find_generative_encoder(model)
    if encoder.method != "grc":
        raise ValueError(
            f"compressed memories are GRC's (method 'grc'); this model's method is {encoder.method!r}, "
            "whose states are no trained memory"
        )
    encoder.check_settings()
    return encoder


def memory_model(encoder) -> MemoryModel:
    """The identity a GRC encoder writes into its memories: its ``weights_revision`` (the fingerprint it was saved
    with, else that of its weights and latents now) and the shape and dtype of its layers' keys and values."""
    config = encoder.model.config.get_text_config()
    heads = config.num_attention_heads
    return MemoryModel(
        weights_revision=encoder.weights_revision or encoder.weights_key()[:16],
        num_latent_tokens=encoder.num_latent_tokens,
        layers=config.num_hidden_layers,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        dtype=str(encoder.model.get_input_embeddings().weight.dtype).removeprefix("torch."),
    )


def check_memories(model, memories: Sequence[LatentMemory]) -> None:
    """Refuse, with a :class:`~grace_st.methods.grc.MemoryFileError` naming the memory (its file and index when read from
    one) and the problem, any memory another model made (:func:`memory_model`) or that this model cannot read
    (:func:`~grace_st.methods.grc.memory_problem`: shape, dtype, non-finite values, a next position out of range)."""
    encoder = _grc_encoder(model)
    if not memories:
        return
    reader = memory_model(encoder)
    max_position = getattr(encoder.model.config.get_text_config(), "max_position_embeddings", None)
    for index, memory in enumerate(memories):
        where = (memory.source if isinstance(memory, LatentMemory) else None) or f"memory {index}"
        if not isinstance(memory, LatentMemory):
            raise MemoryFileError(f"{where}: a {type(memory).__name__}, not a LatentMemory")
        if memory.model is not None and memory.model != reader:
            raise MemoryFileError(
                f"{where}: made by another model ({'; '.join(memory.model.differences(reader))}); compress the "
                "texts again with this model"
            )
        problem = memory_problem(memory, reader, max_position)
        if problem is not None:
            raise MemoryFileError(f"{where}: {problem}")


@torch.no_grad()
def compress(model, texts, *, prompt_name: str = "document", batch_size: int = 16) -> list[LatentMemory]:
    """Each text's memory: its prompt under ``prompt_name``'s instruction and response (a document's "None", or
    the response its budget allows), then the latents, whose keys and values are kept (the same pass as its
    embedding), with the model's identity (:func:`memory_model`)."""
    encoder = _grc_encoder(model)
    texts = check_texts(texts)
    kind = encoder.prompt_names.get(prompt_name, prompt_name)
    prompts, span = encoder.prompt_token_ids(texts, task=kind)
    engine = encoder.engine
    responses = engine.responses(prompts, span, encoder.rationale_budget(kind))
    rows = [[*prompt, *response] for prompt, response in zip(prompts, responses)]
    memories = [m for result in engine.latent_passes(rows, batch_size, with_memory=True) for m in result.memories]
    identity = memory_model(encoder)
    for index, memory in enumerate(memories):
        memory.model = identity
        problem = memory_problem(memory, identity)
        if problem is not None:  # a cache laid out otherwise than the config says, or a model giving NaN
            raise ValueError(f"texts[{index}]: this model's memory cannot be kept: {problem}")
    return memories


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
    """The model's greedy answer to ``question`` reading ``memories`` (none: from its own knowledge), each checked
    first (:func:`check_memories`). ``context`` puts a plain text before the question instead, the baseline a
    memory stands in for."""
    encoder = _grc_encoder(model)
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question must be a non-empty string, got {question!r:.80}")
    memories = list(memories)
    check_memories(model, memories)
    text = question if context is None else f"{context}\n\n{question}"
    ids = answer_from_memory(
        encoder.model, memory_prompt(encoder, text), memories, max_new_tokens=max_new_tokens,
        eos_token_ids=encoder.eos_token_ids,
    )
    return encoder.tokenizer.decode(ids, skip_special_tokens=True)
