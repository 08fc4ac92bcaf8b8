"""Rationales and their hidden states in one pass (method.md §1, Eqs. 1–2).

The policy is causal, so the hidden state of position t depends on tokens ≤ t only: the
states computed while a rationale is generated are exactly the states of Eq. 2 over
``P(x) ⊕ r``. :func:`generate_rollouts` keeps them as it decodes, so no second forward
pass over prompt + rationale is needed. :func:`two_pass_reference` is that second pass
(generate, re-encode, pool), kept as the yardstick for tests and benchmarks.

Pooled positions: the user text and template suffix (t > L_sys) and every rationale token
before the end-of-sequence token. The EOS token and anything after it, and padding, are
not pooled. A rationale cut at the length limit has its last token fed once more so its
state exists; that token is pooled like the others.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .packed_linear import packed_linears
from .pooling import masked_mean


@dataclass
class Rollouts:
    """Generated rationales with the hidden states of ``P(x) ⊕ r``.

    The prompt part is left-padded, the rationale part right-padded: column ``N + k`` holds
    rationale token ``k`` of every row.
    """

    attention_mask: Tensor  # (B, N + G) 1 on real tokens, EOS excluded
    pooling_mask: Tensor  # (B, N + G) 1 where Eq. 3 pools: t > L_sys, before EOS, not padding
    token_embeddings: Tensor  # (B, N + G, H) hidden states of the chosen layer
    rationale_ids: Tensor  # (B, G) rationale token ids, -1 after the rationale ends
    truncated: Tensor  # (B,) hit the length limit without EOS (Eq. 28's length penalty)
    stop_ids: Tensor  # (B,) the EOS token that ended each rationale, -1 where none did


def left_pad(rows: Sequence[Sequence[int]], pad_token_id: int) -> tuple[Tensor, Tensor]:
    width = max((len(row) for row in rows), default=0)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, width - len(row) :] = 1
    return input_ids, attention_mask


def prompt_pooling_mask(attention_mask: Tensor, instruction_lengths: Tensor) -> Tensor:
    """Positions t > L_sys of each left-padded prompt (Eq. 3)."""
    width = attention_mask.shape[1]
    first_pooled = (width - attention_mask.sum(1)) + instruction_lengths
    return torch.arange(width, device=attention_mask.device)[None, :] >= first_pooled[:, None]


def shared_prefix_length(input_ids: Tensor, attention_mask: Tensor, instruction_lengths: Tensor) -> int:
    """How many leading tokens all left-padded prompts of a batch have in common, inside the
    instruction span (in ``encode`` that is the whole system turn: one instruction a call).

    Those positions hold the same ids at the same positions in every row, so (the model being
    causal) the same keys, values and hidden states. Capped at the shortest instruction span
    (L_sys: never pooled) and one short of the shortest prompt (each row's last prompt token is
    still fed, for its next-token logits). 0 for a single row: there is nothing to share.
    """
    if input_ids.shape[0] < 2:
        return 0
    lengths = attention_mask.sum(1)
    limit = min(int(instruction_lengths.min()), int(lengths.min()) - 1)
    if limit < 1:
        return 0
    starts = input_ids.shape[1] - lengths
    aligned = input_ids.gather(1, starts[:, None] + torch.arange(limit, device=input_ids.device)[None, :])
    differs = (aligned != aligned[:1]).any(0)
    return int(differs.nonzero()[0]) if differs.any() else limit


@contextlib.contextmanager
def _final_hidden_states(model) -> Iterator[dict]:
    """Capture the decoder's final (normed) hidden states without asking the model for every layer."""
    captured: dict = {}

    def hook(_module, _args, output):
        captured["states"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    handle = model.get_decoder().register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def _forward(model, captured: dict, hidden_layer: int, logits: bool = True, **inputs) -> tuple[Tensor, Tensor | None]:
    """One forward step: (hidden states of the fed tokens, next-token logits). Without
    ``logits`` only the decoder runs: the LM head's logits are not needed when nothing is generated."""
    if not logits:
        return _decoder_states(model.get_decoder(), hidden_layer, **inputs), None
    if hidden_layer == -1:
        output = model(**inputs, logits_to_keep=1, use_cache=True)
        states = captured["states"]
    else:
        output = model(**inputs, logits_to_keep=1, use_cache=True, output_hidden_states=True)
        states = output.hidden_states[hidden_layer]
    return states, output.logits[:, -1, :]


def _prefill(model, captured: dict, hidden_layer: int, input_ids: Tensor, attention_mask: Tensor, cache, shared: int,
             logits: bool) -> tuple[Tensor, Tensor | None, Tensor]:
    """The prompt pass: (hidden states in the prompts' left-padded layout, last-position logits,
    the attention mask over the KV cache's columns). Padding columns hold zeros.

    With ``shared`` > 0 (:func:`shared_prefix_length`) the common prefix is run once, on one row;
    its keys and values are copied into every row of ``cache`` and only the rest of each prompt
    is fed. The cache then holds ``[prefix][padding][rest of prompt]``: padding in the middle is
    masked like padding on the left, and positions come from the mask, so every real token has the
    same position, keys and values as in one left-padded pass. At batch 64 with the default
    instruction this skips 27 of ~41 prompt tokens a row (benchmarks/decode_ablation.py).
    """
    if not shared:
        states, last_logits = _forward(
            model, captured, hidden_layer, logits, input_ids=input_ids, attention_mask=attention_mask,
            position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0), past_key_values=cache,
        )
        return states.masked_fill(attention_mask[..., None] == 0, 0.0), last_logits, attention_mask
    from transformers import DynamicCache

    batch, width = input_ids.shape
    starts = width - attention_mask.sum(1)
    first = int(starts[0])
    prefix_cache = DynamicCache(config=model.config)
    prefix_states, _ = _forward(
        model, captured, hidden_layer, False,
        input_ids=input_ids[:1, first : first + shared], past_key_values=prefix_cache,
    )
    for index, layer in enumerate(prefix_cache.layers):
        cache.update(layer.keys.expand(batch, -1, -1, -1), layer.values.expand(batch, -1, -1, -1), index)
    # Column j of the rest is prompt column j + shared; it holds a real token from the row's start on.
    rest_mask = (torch.arange(width - shared, device=input_ids.device)[None, :] >= starts[:, None]).long()
    cache_mask = torch.cat([rest_mask.new_ones((batch, shared)), rest_mask], 1)
    rest_states, last_logits = _forward(
        model, captured, hidden_layer, logits,
        input_ids=input_ids[:, shared:], attention_mask=cache_mask,
        position_ids=(cache_mask.cumsum(-1)[:, shared:] - 1).clamp(min=0), past_key_values=cache,
    )
    states = rest_states.new_zeros((batch, width, rest_states.shape[-1]))
    states[:, shared:] = rest_states
    prefix_columns = starts[:, None] + torch.arange(shared, device=input_ids.device)[None, :]
    states.scatter_(1, prefix_columns[..., None].expand(-1, -1, states.shape[-1]), prefix_states.expand(batch, -1, -1))
    return states.masked_fill(attention_mask[..., None] == 0, 0.0), last_logits, cache_mask


def per_row(value: float | Sequence[float], rows: int, name: str = "temperatures") -> list[float]:
    """One value for every row, or one a row (checked: as many as rows, each >= 0)."""
    values = [float(value)] * rows if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != rows:
        raise ValueError(f"{len(values)} {name} for {rows} prompts")
    if any(not v >= 0 for v in values):
        raise ValueError(f"{name} must be >= 0, got {values}")
    return values


def _sample(logits: Tensor, temperature: Tensor, top_p: float, generators: list[torch.Generator] | None) -> Tensor:
    """One token a row: sampled at the row's ``temperature`` (rows,), greedy where it is 0."""
    greedy = temperature <= 0
    probs = torch.softmax(logits.float() / temperature.masked_fill(greedy, 1.0)[:, None], dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token always survives)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    if generators is None:
        sampled = torch.multinomial(probs, 1).squeeze(-1)
    else:
        # One generator a row: a text's rationale does not depend on what it was batched with.
        sampled = torch.stack(
            [torch.multinomial(row.cpu(), 1, generator=gen).squeeze(-1) for row, gen in zip(probs, generators)]
        ).to(logits.device)
    return torch.where(greedy, logits.argmax(-1), sampled) if greedy.any() else sampled


def preallocated_cache(model, capacity: int):
    """A KV cache whose full-attention layers are written in place into buffers of ``capacity``
    positions, allocated once at prefill.

    transformers' ``DynamicCache`` concatenates a layer's whole cache with each new token: at
    batch 64 that is a fresh multi-megabyte allocation and copy per layer per step.
    ``StaticCache`` avoids the copy but attends over its whole capacity every step. Here a step
    writes one column and attends over a view of the filled columns only (0–5% faster end to end
    on the 2-core CPU, ``benchmarks/decode_ablation.py``). Layers of other kinds (sliding
    windows) keep transformers' own class.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            batch, heads = key_states.shape[:2]
            self._keys = key_states.new_empty((batch, heads, capacity, key_states.shape[-1]))
            self._values = value_states.new_empty((batch, heads, capacity, value_states.shape[-1]))
            self.length = 0
            self.keys, self.values = self._keys[:, :, :0], self._values[:, :, :0]
            self.is_initialized = True

        def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if end > capacity:
                raise RuntimeError(f"KV cache of {capacity} positions cannot hold {end}")
            self._keys[:, :, self.length : end] = key_states
            self._values[:, :, self.length : end] = value_states
            self.length = end
            self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length if self.is_initialized else 0

        def batch_select_indices(self, indices: Tensor) -> None:
            if self.is_initialized:
                self._keys, self._values = self._keys[indices], self._values[indices]
                self.keys, self.values = self._keys[:, :, : self.length], self._values[:, :, : self.length]

    cache = DynamicCache(config=model.config)
    # A config transformers reads no layer types from leaves the layers to be made lazily: plain DynamicCache then.
    cache.layers = [PreallocatedLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    # Only these layers are known to take a shared prefix's keys and values copied in (generate_rollouts)
    cache.every_layer_preallocated = bool(cache.layers) and all(
        type(layer) is PreallocatedLayer for layer in cache.layers
    )
    return cache


@torch.no_grad()
def generate_rollouts(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    instruction_lengths: Tensor,
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    do_sample: bool = False,
    temperature: float | Sequence[float] = 1.0,
    top_p: float = 1.0,
    seeds: Sequence[int] | None = None,
    hidden_layer: int = -1,
    drop_finished: bool = True,
    share_prefix: bool = True,
) -> Rollouts:
    """Generate a rationale for each left-padded prompt and keep its hidden states (Eqs. 1–2).

    Greedy unless ``do_sample``; ``temperature`` is one for every row or one a row (a row at 0
    is greedy), so rows of several temperatures (a training step's queries, negatives and
    positives) share one call. With ``seeds`` (one a row) sampling is reproducible per text.
    ``drop_finished`` stops feeding rows whose rationale has ended, and ``share_prefix`` computes
    the prompts' common instruction prefix once (:func:`_prefill`); both change results only by
    floating-point rounding and only save work.
    """
    device = input_ids.device
    batch = input_ids.shape[0]
    eos = torch.tensor(sorted(set(eos_token_ids)), device=device)
    generators = None
    if do_sample and seeds is not None:
        generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
    temperatures = torch.tensor(per_row(temperature, batch), dtype=torch.float32, device=device)

    shared = shared_prefix_length(input_ids, attention_mask, instruction_lengths) if share_prefix else 0
    # G = 0 needs a KV cache only to hold a shared prefix for the rest of the prompt to attend to
    cache = preallocated_cache(model, input_ids.shape[1] + max_new_tokens) if max_new_tokens or shared else None
    if shared and not cache.every_layer_preallocated:  # sliding windows, lazily made layers: per-row prompts
        shared, cache = 0, cache if max_new_tokens else None
    pooled = [prompt_pooling_mask(attention_mask, instruction_lengths.to(device))]
    tokens: list[Tensor] = []
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    stop_ids = torch.full((batch,), -1, dtype=torch.long, device=device)
    # Rows of the batch still fed to the model, and their attention mask so far. Finished rows
    # are dropped from the batch and the KV cache once enough of them accumulate: dropping
    # copies the cache (about one decode step's memory traffic), so it waits for a quarter.
    active = torch.arange(batch, device=device)

    with packed_linears(model), _final_hidden_states(model) as captured:
        # with nothing to generate (G = 0) the LM head is skipped: only the states are needed
        states, logits, active_mask = _prefill(
            model, captured, hidden_layer, input_ids, attention_mask, cache, shared, logits=max_new_tokens > 0
        )
        all_states = [states]
        for _ in range(max_new_tokens):
            if do_sample:
                row_generators = None if generators is None else [generators[i] for i in active.tolist()]
                token = _sample(logits, temperatures[active], top_p, row_generators)
            else:
                token = logits.argmax(-1)
            stopping = ~finished[active] & torch.isin(token, eos)
            stop_ids[active[stopping]] = token[stopping]
            finished[active[stopping]] = True
            alive = ~finished[active]
            if not alive.any():
                break
            step_tokens = torch.full((batch,), -1, dtype=torch.long, device=device)
            step_tokens[active[alive]] = token[alive]
            tokens.append(step_tokens)
            dead = int((~alive).sum())
            if drop_finished and dead and dead >= len(active) // 4:
                keep = alive.nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                active, active_mask, token, alive = active[keep], active_mask[keep], token[keep], alive[keep]
            token = torch.where(alive, token, pad_token_id)
            active_mask = torch.cat([active_mask, alive[:, None].long()], dim=1)
            states, logits = _forward(
                model,
                captured,
                hidden_layer,
                input_ids=token[:, None],
                attention_mask=active_mask,
                position_ids=active_mask.sum(1, keepdim=True) - 1,
                past_key_values=cache,
            )
            step_states = states.new_zeros((batch, 1, states.shape[-1]))
            step_states[active] = states
            all_states.append(step_states)
            pooled.append((step_tokens >= 0)[:, None])

    rationale_ids = torch.stack(tokens, 1) if tokens else torch.empty((batch, 0), dtype=torch.long, device=device)
    rationale_mask = rationale_ids >= 0
    full_attention = torch.cat([attention_mask, rationale_mask.long()], 1)
    return Rollouts(
        attention_mask=full_attention,
        pooling_mask=torch.cat(pooled, 1),
        token_embeddings=torch.cat(all_states, 1),
        rationale_ids=rationale_ids,
        truncated=~finished if max_new_tokens > 0 else torch.zeros_like(finished),
        stop_ids=stop_ids,
    )


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
) -> tuple[Tensor, list[list[int]]]:
    """The reference implementation's way: ``generate`` greedily, then re-encode
    ``P(x) ⊕ r`` in a second forward pass and mean-pool positions t > L_sys (Eqs. 1–3).

    Returns the pooled embeddings (B, H) and the rationales' token ids.
    """
    device = model.device
    input_ids, attention_mask = left_pad(prompts, pad_token_id)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    # The same kernels as the one-pass path, so a comparison is of passes, not of BLAS libraries.
    with packed_linears(model):
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
        pooled = pooled_embeddings(model, prompts, instruction_lengths, rationales, pad_token_id, hidden_layer)
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
) -> Tensor:
    """Eqs. 2–3 over given rationales: one HF forward pass over each ``prompt ⊕ rationale`` and
    the mean of its hidden states at positions ``t >= instruction_lengths[i]`` (the user text,
    template suffix and rationale; the rationale must exclude EOS).

    This is the second pass of :func:`two_pass_reference`, and how rationales generated
    elsewhere (vLLM) are embedded: right-padded rows, positions from 0, ``hidden_layer`` -1 the
    decoder's final (normed) states, other values an index into transformers' ``hidden_states``.
    With ``batch_size=None`` it is one batch; with a ``batch_size``, rows are batched by length (less padding), which
    changes results only by floating-point noise. Returns (B, H) float32 on the model's device.
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
    # One packing check for all chunks: it reads every weight once (see grace_st.packed_linear).
    with packed_linears(model):
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


def _pool_rows(model, rows: list[list[int]], spans: list[int], pad_token_id: int, hidden_layer: int) -> Tensor:
    device = model.device
    width = max(len(row) for row in rows)
    # Right padding: causal attention means a real token never sees the padding after it, and
    # positions start at 0 as in an unpadded pass.
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    pooled = torch.zeros((len(rows), width), dtype=torch.bool, device=device)
    for i, (row, span) in enumerate(zip(rows, spans)):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long, device=device)
        mask[i, : len(row)] = 1
        pooled[i, span : len(row)] = True
    states = _decoder_states(model.get_decoder(), hidden_layer, input_ids=ids, attention_mask=mask)
    return masked_mean(states, pooled)


def _decoder_states(decoder, hidden_layer: int, **inputs) -> Tensor:
    """Hidden states of one pass of the decoder alone (it fills ``past_key_values`` when given one):
    the LM head's logits over the whole vocabulary are not needed when nothing is generated."""
    use_cache = inputs.get("past_key_values") is not None
    if hidden_layer == -1:
        return decoder(**inputs, use_cache=use_cache).last_hidden_state
    return decoder(**inputs, use_cache=use_cache, output_hidden_states=True).hidden_states[hidden_layer]
