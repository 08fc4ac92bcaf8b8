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
from grace_st.runtime.model_view import ModelView


@torch.no_grad()
def two_pass_reference(
    view: ModelView, prompts: Sequence[Sequence[int]], instruction_lengths: Sequence[int], *, max_new_tokens: int
) -> tuple[Tensor, list[list[int]]]:
    """The reference implementation's way: ``generate`` greedily, then re-encode
    ``P(x) ⊕ r`` in a second forward pass and mean-pool positions t > L_sys (Eqs. 1–3).

    Returns the pooled embeddings (B, H) and the rationales' token ids. Of the view's options only
    ``packed_linears`` and ``merge_adapters`` apply, for comparisons with one kernel on both sides.
    """
    model, pad_token_id, eos_token_ids = view.model, view.pad_token_id, view.eos_token_ids
    device = model.device
    input_ids, attention_mask = left_pad(prompts, pad_token_id)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    # The same kernels as the one-pass path, so a comparison is of passes, not of BLAS libraries.
    with packed_linears_block(model, enabled=view.options.packed_linears):
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
        pooled = pooled_embeddings(view, prompts, instruction_lengths, rationales)
    return pooled, rationales


@torch.no_grad()
def pooled_embeddings(
    view: ModelView,
    prompts: Sequence[Sequence[int]],
    instruction_lengths: Sequence[int] | Tensor,
    rationales: Sequence[Sequence[int]],
    *,
    batch_size: int | None = None,
) -> Tensor:
    """Eqs. 2–3 over given rationales: one HF forward pass over each ``prompt ⊕ rationale`` and
    the mean of its hidden states at positions ``t >= instruction_lengths[i]`` (the user text,
    template suffix and rationale; the rationale must exclude EOS).

    This is the second pass of :func:`two_pass_reference`, and how rationales generated
    elsewhere (vLLM) are embedded: right-padded rows, positions from 0, the view's layer pooled.
    With ``batch_size=None`` it is one batch; with a ``batch_size``, rows are batched by length (less padding), which
    changes results only by floating-point noise. Of the view's options, ``packed_linears`` and ``merge_adapters``
    apply. Returns (B, H) float32 on the model's device.
    """
    model, options = view.model, view.options
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
    with packed_linears_block(model, enabled=options.packed_linears, merge_adapters=options.merge_adapters):
        if batch_size is None:
            return _pool_rows(view, rows, spans)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]), reverse=True)
        pooled = [None] * len(rows)
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            vectors = _pool_rows(view, [rows[i] for i in chunk], [spans[i] for i in chunk])
            for i, vector in zip(chunk, vectors):
                pooled[i] = vector
    return torch.stack(pooled)


def right_padded_states(view: ModelView, rows: Sequence[Sequence[int]]) -> Tensor:
    """The view's layer's hidden states of token rows of different lengths in one right-padded pass
    (:func:`~grace_st.runtime.batch.right_pad`), (rows, longest, hidden): a row's states are those of its own pass."""
    ids, mask = right_pad(rows, view.pad_token_id, device=view.model.device)
    return decoder_states(view, input_ids=ids, attention_mask=mask)


def _pool_rows(view: ModelView, rows: list[list[int]], spans: list[int]) -> Tensor:
    states = right_padded_states(view, rows)
    pooled = torch.zeros(states.shape[:2], dtype=torch.bool, device=states.device)
    for i, (row, span) in enumerate(zip(rows, spans)):
        pooled[i, span : len(row)] = True
    return masked_mean(states, pooled)
