"""Eqs. 2–3 over rationales that already exist: one HF forward pass over ``P(x) ⊕ r`` and the
mean of its hidden states after L_sys.

:func:`pooled_embeddings` is how rationales generated elsewhere (vLLM) are embedded;
:func:`two_pass_reference` (generate, then this pass) is the reference implementation's way,
kept as the yardstick the one-pass rollout (:mod:`grace_st.runtime.generation`) is tested and
benchmarked against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from grace_st.runtime.batch import left_pad, masked_mean, right_pad
from grace_st.runtime.cpu.packed_linear import packed_linears as packed_linears_block
from grace_st.runtime.decoding import decoder_states


@torch.no_grad()
def two_pass_reference(
    model,
    prompts: Sequence[Sequence[int]],
    instruction_lengths: Sequence[int],
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    hidden_layer: int = -1,
    packed_linears: bool = True,
) -> tuple[Tensor, list[list[int]]]:
    """The reference implementation's way: ``generate`` greedily, then re-encode
    ``P(x) ⊕ r`` in a second forward pass and mean-pool positions t > L_sys (Eqs. 1–3).

    Returns the pooled embeddings (B, H) and the rationales' token ids. ``packed_linears``:
    as :class:`grace_st.runtime.decoding.DecodeOptions`' switch, for comparisons with one kernel on both sides.
    """
    device = model.device
    input_ids, attention_mask = left_pad(prompts, pad_token_id)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    # The same kernels as the one-pass path, so a comparison is of passes, not of BLAS libraries.
    with packed_linears_block(model, enabled=packed_linears):
        if max_new_tokens > 0:
            generated = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=list(eos_token_ids),
                pad_token_id=pad_token_id,
            )[:, input_ids.shape[1] :].tolist()
        else:
            generated = [[] for _ in prompts]
        stop = set(eos_token_ids)
        rationales = []
        for row in generated:
            cut = next((i for i, token in enumerate(row) if token in stop), len(row))
            rationales.append(row[:cut])
        pooled = pooled_embeddings(
            model, prompts, instruction_lengths, rationales, pad_token_id, hidden_layer, packed_linears=packed_linears
        )
    return pooled, rationales


@torch.no_grad()
def pooled_embeddings(
    model,
    prompts: Sequence[Sequence[int]],
    instruction_lengths: Sequence[int] | Tensor,
    rationales: Sequence[Sequence[int]],
    pad_token_id: int,
    hidden_layer: int = -1,
    *,
    batch_size: int | None = None,
    packed_linears: bool = True,
    merge_adapters: bool = True,
) -> Tensor:
    """Eqs. 2–3 over given rationales: one HF forward pass over each ``prompt ⊕ rationale`` and
    the mean of its hidden states at positions ``t >= instruction_lengths[i]`` (the user text,
    template suffix and rationale; the rationale must exclude EOS).

    This is the second pass of :func:`two_pass_reference`, and how rationales generated
    elsewhere (vLLM) are embedded: right-padded rows, positions from 0, ``hidden_layer`` -1 the
    decoder's final (normed) states, other values an index into transformers' ``hidden_states``.
    With ``batch_size=None`` it is one batch; with a ``batch_size``, rows are batched by length (less padding), which
    changes results only by floating-point noise. ``packed_linears`` and ``merge_adapters``: as
    :class:`grace_st.runtime.decoding.DecodeOptions`' switches. Returns (B, H) float32 on the model's device.
    """
    if isinstance(instruction_lengths, Tensor):
        instruction_lengths = instruction_lengths.tolist()
    spans = [int(span) for span in instruction_lengths]
    if not len(prompts) == len(spans) == len(rationales):
        raise ValueError(f"{len(prompts)} prompts, {len(spans)} instruction lengths and {len(rationales)} rationales")
    for i, (prompt, span) in enumerate(zip(prompts, spans)):
        if not 0 <= span <= len(prompt):
            raise ValueError(f"instruction length {span} of row {i} is outside its prompt of {len(prompt)} tokens")
    rows = [[*map(int, prompt), *map(int, rationale)] for prompt, rationale in zip(prompts, rationales)]
    if not rows:
        hidden = model.config.get_text_config().hidden_size
        return torch.empty((0, hidden), dtype=torch.float32, device=model.device)
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or None, got {batch_size!r}")
    # One packing check for all chunks: it reads every weight once (see grace_st.runtime.cpu.packed_linear).
    with packed_linears_block(model, enabled=packed_linears, merge_adapters=merge_adapters):
        if batch_size is None:
            return _pool_rows(model, rows, spans, pad_token_id, hidden_layer)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]), reverse=True)
        pooled = [None] * len(rows)
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            vectors = _pool_rows(model, [rows[i] for i in chunk], [spans[i] for i in chunk], pad_token_id, hidden_layer)
            for i, vector in zip(chunk, vectors):
                pooled[i] = vector
    return torch.stack(pooled)


def right_padded_states(model, rows: Sequence[Sequence[int]], pad_token_id: int, hidden_layer: int) -> Tensor:
    """Layer ``hidden_layer``'s hidden states of token rows of different lengths in one right-padded pass
    (:func:`~grace_st.runtime.batch.right_pad`), (rows, longest, hidden): a row's states are those of its own pass."""
    ids, mask = right_pad(rows, pad_token_id, device=model.device)
    return decoder_states(model.get_decoder(), hidden_layer, input_ids=ids, attention_mask=mask)


def _pool_rows(model, rows: list[list[int]], spans: list[int], pad_token_id: int, hidden_layer: int) -> Tensor:
    states = right_padded_states(model, rows, pad_token_id, hidden_layer)
    pooled = torch.zeros(states.shape[:2], dtype=torch.bool, device=states.device)
    for i, (row, span) in enumerate(zip(rows, spans)):
        pooled[i, span : len(row)] = True
    return masked_mean(states, pooled)
