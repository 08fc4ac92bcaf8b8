"""GRC (grc.md): meta latent tokens that embed a text after the model has answered it, and whose keys and values
are a fixed-size memory of the text (Eqs. 1, 3–6).

A GRC model is a causal LM with m learned vectors r_1..r_m (fed as input embeddings: no ids, no LM-head rows,
never sampled) and an adapter A (:class:`LatentTokens`). One pass over (Eq. 1)

    ❶ P(x) ⊕ y   the prompt and the model's response: its rationale, or "None" for a document (positions 0..k-1)
    ❷ r_1..r_m   the latents (k..k+m-1)
    ❸ a suffix   training's reconstruction turn, positions running on (none when embedding)

under a causal mask with one cut, ❸ never attends to ❶ (:func:`segment_mask`), gives

- the embedding e = mean_i A(h_{r_i}), the final states at the latent positions (L2 by the model's ``Normalize``);
- the memory: the keys and values of the m latent positions at every layer (:class:`LatentMemory`, Eq. 6's size
  whatever the text's length), from which the model answers a new turn (:func:`answer_from_memory`).

:func:`latent_pass` is that one pass: ``encode`` (:class:`grace_st.engine.LatentEngine`), :func:`compress` and
training's Eq. 5 step (``grace_training.grc_step``) all call it, so the embedding trained is the embedding served
(to float32 rounding: below).

Written here, not taken from a library: no package implements GRC's latents or its cut mask (the paper's code is
unreleased). Training's pass is transformers' own forward, given ``inputs_embeds`` and a 4D additive mask (one a
kind of layer where some layers slide, each windowed as the model's own pass is: :func:`layer_masks`). Without ❸
and without autograd (``encode``, ``compress``) the mask is plain causal, and the same pass runs as the prompt pass
GRACE's prompts get (:mod:`grace_st.decoding`: the shared instruction prefix once a batch, padding skipped, the
native kernels where they apply): 2.5–2.8 times as fast on the shipped model (``lab/scripts/grc_pass_cost.py``)
and equal to float32 rounding (``tests/test_grc.py``).

What the paper leaves open, as chosen here (docs/grc.md lists them with the measurements):
- no EOS between y and the latents (the paper reports it better without);
- a memory's keys keep the rotary positions they were made at (k..k+m-1): the turn that reads it starts at
  ``next_position`` = k + m, as ❸ did in training. Several memories are concatenated in the order given and the
  turn starts after the largest ``next_position``: each keeps its own positions, so two memories of texts of
  similar length overlap in position, which attention tolerates (rotary scores depend on distance only).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from .batch import left_pad, position_ids_from_mask, right_pad
from .decoding import DecodeOptions, decoder_states, incremental_decoder
from .transformers_compat import cache_kwargs

LATENT_FILE = "latent_tokens.safetensors"
# A document's response y (grc.md: documents are not reasoned about; the paper trains y = "None").
DOCUMENT_RESPONSE = "None"
# The system turn of the conversation a memory is read in (training's reconstruction turn and answers alike).
MEMORY_INSTRUCTION = "Answer from the text you have read."
# r_p: what training's reconstruction turn asks, one drawn a text (the paper gives "What were we discussing
# earlier?" as an example of its set).
RECONSTRUCTION_PROMPTS = (
    "What were we discussing earlier?",
    "Repeat the text you have read.",
    "Write out the text from before, word for word.",
    "What did the text say? Give it exactly.",
)


class LatentTokens(nn.Module):
    """The m meta latent tokens and the adapter A of the read-out (grc.md, "Inference").

    ``latents`` (m, d) start as draws from the token embeddings' per-dimension mean and spread (seeded: a model
    built twice is the same model); A is ``Linear(d, d)`` at the identity, so an untrained GRC model embeds
    with the mean of its latents' final states.
    """

    def __init__(self, num_latent_tokens: int, hidden_size: int) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.zeros(num_latent_tokens, hidden_size))
        self.adapter = nn.Linear(hidden_size, hidden_size)

    @property
    def num_latent_tokens(self) -> int:
        return self.latents.shape[0]

    @classmethod
    def initialised(cls, num_latent_tokens: int, token_embeddings: Tensor, seed: int = 0) -> LatentTokens:
        """Fresh latents for a model whose input embedding matrix is ``token_embeddings`` (vocab, d)."""
        weights = token_embeddings.detach().float()
        head = cls(num_latent_tokens, weights.shape[1])
        generator = torch.Generator().manual_seed(seed)
        noise = torch.randn(num_latent_tokens, weights.shape[1], generator=generator)
        with torch.no_grad():
            head.latents.copy_(weights.mean(0) + noise * weights.std(0))
            head.adapter.weight.copy_(torch.eye(weights.shape[1]))
            head.adapter.bias.zero_()
        return head.to(token_embeddings.device)

    def readout(self, latent_states: Tensor) -> Tensor:
        """e before L2: the mean over the m latent positions of A(h), (B, d) float32."""
        return self.adapter(latent_states.float()).mean(1)

    def save(self, directory: str | Path) -> None:
        from safetensors.torch import save_file

        tensors = {name: tensor.detach().float().cpu().contiguous() for name, tensor in self.state_dict().items()}
        save_file(tensors, str(Path(directory) / LATENT_FILE))

    @classmethod
    def load(cls, directory: str | Path, device=None) -> LatentTokens | None:
        """The latents saved in ``directory``, or None where it has none (safetensors only)."""
        from safetensors.torch import load_file

        path = Path(directory) / LATENT_FILE
        if not path.is_file():
            return None
        tensors = load_file(str(path))
        if set(tensors) != {"latents", "adapter.weight", "adapter.bias"}:
            raise ValueError(f"{path}: not a latent-token file (tensors {sorted(tensors)})")
        head = cls(*tensors["latents"].shape)
        head.load_state_dict(tensors)
        return head.to(device) if device is not None else head


def latent_tokens_for(model, latents: LatentTokens | None, num_latent_tokens: int) -> LatentTokens:
    """The latent tokens a GRC encoder uses: its own, or fresh ones (:meth:`LatentTokens.initialised`) where it has
    none; refused where their number is not ``num_latent_tokens``."""
    if latents is None:
        return LatentTokens.initialised(num_latent_tokens, model.get_input_embeddings().weight)
    if latents.num_latent_tokens != num_latent_tokens:
        raise ValueError(
            f"num_latent_tokens is {num_latent_tokens}, but the model's latent tokens number "
            f"{latents.num_latent_tokens}: trained latents cannot be resized; set it back"
        )
    return latents


def segment_mask(real: Tensor, segments: Tensor, dtype: torch.dtype, window: int | None = None) -> Tensor:
    """The additive 4D mask (B, 1, T, T) of Eq. 1: causal over real tokens, except that segment 3 does not attend
    to segment 1. ``real`` (B, T) marks tokens (not padding); ``segments`` (T,) holds 1, 2 or 3 by column. A padded
    query row sees itself alone, so no row of the softmax is empty. ``window``: a sliding-window layer's, by
    transformers' rule (a query sees the ``window`` columns up to its own); a row's real tokens are contiguous
    columns but for its cut, so a column's distance is its position's."""
    width = real.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=real.device).tril()
    if window is not None:
        from transformers.masking_utils import sliding_window_overlay

        column = torch.arange(width, device=real.device)
        causal &= sliding_window_overlay(window)(0, 0, column[:, None], column[None, :])
    cut = (segments[:, None] == 3) & (segments[None, :] == 1)
    allowed = causal & ~cut & real.bool()[:, None, :]
    allowed |= torch.eye(width, dtype=torch.bool, device=real.device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=real.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


def sliding_window(config) -> int | None:
    """The window of the model's sliding-window layers (None: it has none), as transformers applies it: per layer
    by ``config.layer_types`` where the config lists them, else to every layer when ``config.sliding_window`` is
    set (Mistral's rule). A kind of layer other than these two is refused: the masked pass could not mask it as
    the model's own pass does."""
    window = getattr(config, "sliding_window", None)
    kinds = set(getattr(config, "layer_types", None) or ())
    unknown = kinds - {FULL_ATTENTION, SLIDING_ATTENTION}
    if unknown:
        raise ValueError(
            f"{type(config).__name__} has layers of kind {', '.join(sorted(unknown))}: GRC's masked pass (training, "
            f"and the pass with a suffix) masks only {FULL_ATTENTION} and {SLIDING_ATTENTION} layers as the model does"
        )
    if kinds and SLIDING_ATTENTION not in kinds:
        return None
    return window


def layer_masks(config, real: Tensor, segments: Tensor, dtype: torch.dtype) -> Tensor | dict[str, Tensor]:
    """:func:`segment_mask` as each of the model's layers applies it (:func:`sliding_window`): one mask for
    every layer, or, where the config lists its layers' kinds and some slide, one by kind, the mapping a
    transformers model takes in place of the masks it would build."""
    window = sliding_window(config)
    if window is None:
        return segment_mask(real, segments, dtype)
    windowed = segment_mask(real, segments, dtype, window)
    if not getattr(config, "layer_types", None):
        return windowed
    return {FULL_ATTENTION: segment_mask(real, segments, dtype), SLIDING_ATTENTION: windowed}


@dataclass
class LatentMemory:
    """One text's compressed memory: the keys and values of its m latent positions at every layer,
    (layers, kv_heads, m, head_dim) each, and the position a turn reading it starts at (k + m)."""

    keys: Tensor
    values: Tensor
    next_position: int

    @property
    def nbytes(self) -> int:
        """Eq. 6: 2 · L · H_kv · d_h · m · bytes per value, the same for any text length."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


@dataclass
class LatentPass:
    """What one :func:`latent_pass` gives: the embeddings before L2 (B, d), the final states of ❶ (left-padded,
    B × P × d) and of ❸ (right-padded, B × S × d) for training's token losses, and the memories when asked."""

    embeddings: Tensor
    prefix_states: Tensor
    suffix_states: Tensor
    memories: list[LatentMemory] | None


def latent_pass(
    model,
    latents: LatentTokens,
    prefixes: Sequence[Sequence[int]],
    suffixes: Sequence[Sequence[int]] | None = None,
    *,
    pad_token_id: int,
    hidden_layer: int = -1,
    with_memory: bool = False,
    options: DecodeOptions | None = None,
) -> LatentPass:
    """One forward over ❶ ``prefixes`` (P(x) ⊕ y, token ids), ❷ the latents and ❸ ``suffixes`` (token ids, or
    none) under :func:`segment_mask`, windowed where the model's layers slide (:func:`layer_masks`); gradients
    flow when autograd is on (training), so call it under ``torch.no_grad`` to embed.

    Given ``options``, without ❸ and with autograd off (``encode``, :func:`grace_st.memory.compress`), the pass
    is a prompt pass of :mod:`grace_st.decoding` (:func:`_latent_prompt_pass`): the same causal pass, fed as
    ``options`` allow."""
    if options is not None and not any(suffixes or ()) and not torch.is_grad_enabled():
        return _latent_prompt_pass(model, latents, prefixes, pad_token_id, hidden_layer, with_memory, options)
    device = latents.latents.device
    rows = len(prefixes)
    suffixes = suffixes if suffixes is not None else [[] for _ in range(rows)]
    prefix_ids, prefix_real = left_pad(prefixes, pad_token_id)
    suffix_ids, suffix_real = right_pad(suffixes, pad_token_id)
    embed = model.get_input_embeddings()
    dtype = embed.weight.dtype
    m, width = latents.num_latent_tokens, prefix_ids.shape[1]
    inputs = torch.cat(
        [
            embed(prefix_ids.to(device)),
            latents.latents.to(dtype)[None].expand(rows, -1, -1),
            embed(suffix_ids.to(device)),
        ],
        dim=1,
    )
    real = torch.cat([prefix_real, torch.ones(rows, m, dtype=torch.long), suffix_real], dim=1).to(device)
    segments = torch.tensor([1] * width + [2] * m + [3] * suffix_ids.shape[1], device=device)
    cache = _new_cache() if with_memory else None
    decoder = model.get_decoder()
    states = decoder_states(
        decoder, hidden_layer, cache=cache, inputs_embeds=inputs,
        attention_mask=layer_masks(decoder.config, real, segments, dtype), position_ids=position_ids_from_mask(real),
    )
    memories = None
    if with_memory:
        next_positions = (prefix_real.sum(1) + m).tolist()
        memories = _memories(cache, slice(width, width + m), next_positions)
    return LatentPass(
        latents.readout(states[:, width : width + m]), states[:, :width], states[:, width + m :], memories
    )


def _latent_prompt_pass(
    model, latents: LatentTokens, prefixes: Sequence[Sequence[int]], pad_token_id: int, hidden_layer: int,
    with_memory: bool, options: DecodeOptions,
) -> LatentPass:
    """:func:`latent_pass` without ❸ as the prompt pass a rationale's prompts get (``IncrementalDecoder.prefill``):
    each row ``P(x) ⊕ y`` then the latents, left-padded, so the latents are every row's last m columns. The
    instruction prefix the rows share runs once a batch, padding is skipped and the native kernels run where they
    apply; the latents enter as ``inputs_embeds``. The shared prefix stops before the latents (each row's own
    length caps it), so a latent column is never taken for a token with the same id."""
    m = latents.num_latent_tokens
    embed = model.get_input_embeddings()
    ids, real = left_pad([[*row, *[pad_token_id] * m] for row in prefixes], pad_token_id)
    ids, real = ids.to(embed.weight.device), real.to(embed.weight.device)
    inputs = embed(ids)
    inputs[:, -m:] = latents.latents.to(inputs.dtype)
    lengths = torch.tensor([len(row) for row in prefixes], device=ids.device)
    with incremental_decoder(model, hidden_layer, options) as decoder:
        states, _ = decoder.prefill(ids, real, lengths, 0, inputs_embeds=inputs, keep_cache=with_memory)
        memories = _memories(decoder.kv_cache, slice(-m, None), (lengths + m).tolist()) if with_memory else None
    width = ids.shape[1] - m
    return LatentPass(latents.readout(states[:, width:]), states[:, :width], states[:, width:width], memories)


def _new_cache():
    from transformers import DynamicCache

    return DynamicCache()


def _memories(cache, columns: slice, next_positions: list[int]) -> list[LatentMemory]:
    """Each row's keys and values at ``columns`` (the latents), every layer, detached and on the CPU."""
    keys = torch.stack([layer.keys[:, :, columns] for layer in cache.layers], dim=1).detach().cpu()
    values = torch.stack([layer.values[:, :, columns] for layer in cache.layers], dim=1).detach().cpu()
    return [
        LatentMemory(keys[row].clone(), values[row].clone(), int(position))  # a copy each: not the batch's storage
        for row, position in enumerate(next_positions)
    ]


def memory_cache(model, memories: Sequence[LatentMemory]):
    """A KV cache holding ``memories`` one after another, on the model's device and in its dtype."""
    cache = _new_cache()
    parameter = next(model.parameters())
    layers = memories[0].keys.shape[0]
    for memory in memories:
        if memory.keys.shape[0] != layers:
            raise ValueError(f"a memory of {memory.keys.shape[0]} layers beside one of {layers}: made by another model")
    for layer in range(layers):
        keys = torch.cat([memory.keys[layer] for memory in memories], dim=1)[None]
        values = torch.cat([memory.values[layer] for memory in memories], dim=1)[None]
        cache.update(keys.to(parameter.device, parameter.dtype), values.to(parameter.device, parameter.dtype), layer)
    return cache


def _open_memories(model, memories: Sequence[LatentMemory]):
    """The cache a turn reads ``memories`` from, how many positions it holds, and where the turn's positions start
    (after the memories: module docstring)."""
    cache = memory_cache(model, memories) if memories else _new_cache()
    past = sum(memory.keys.shape[2] for memory in memories)
    return cache, past, max((memory.next_position for memory in memories), default=0)


def _read(model, ids: Tensor, cache, past: int, position: int):
    """One forward of ``ids`` (1 × width) after ``past`` cached positions, starting at rotary ``position``."""
    width = ids.shape[1]
    return model(
        input_ids=ids,
        attention_mask=torch.ones(1, past + width, dtype=torch.long, device=ids.device),
        position_ids=torch.arange(position, position + width, device=ids.device)[None],
        use_cache=True,
        **cache_kwargs(model, cache),
    )


@torch.no_grad()
def turn_logits(model, turn_ids: Sequence[int], memories: Sequence[LatentMemory]) -> Tensor:
    """The LM's logits (width × vocabulary) at every token of a turn reading ``memories``, teacher-forced: the
    reading :func:`answer_from_memory` does, scored on a known continuation (a reconstruction's text)."""
    device = next(model.parameters()).device
    return _read(model, torch.tensor([list(turn_ids)], device=device), *_open_memories(model, memories)).logits[0]


@torch.no_grad()
def answer_from_memory(
    model,
    prompt_ids: Sequence[int],
    memories: Sequence[LatentMemory],
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
) -> list[int]:
    """Greedy tokens after ``prompt_ids`` (a new turn), reading ``memories`` as past keys and values (none: the
    turn alone). Positions start after the memories (module docstring). One row: a question at a time."""
    device = next(model.parameters()).device
    cache, past, position = _open_memories(model, memories)
    ids = torch.tensor([list(prompt_ids)], device=device)
    stop, made = set(eos_token_ids), []
    for _ in range(max_new_tokens):
        width = ids.shape[1]
        token = int(_read(model, ids, cache, past, position).logits[0, -1].argmax())
        if token in stop:
            break
        made.append(token)
        past, position, ids = past + width, position + width, torch.tensor([[token]], device=device)
    return made


def save_memories(path: str | Path, memories: Sequence[LatentMemory], texts: Sequence[str] | None = None) -> None:
    """``memories`` in one safetensors file (``memory.{i}.keys`` / ``.values``), their positions (and the texts,
    when given) in its metadata."""
    from safetensors.torch import save_file

    tensors = {}
    for i, memory in enumerate(memories):
        tensors[f"memory.{i}.keys"] = memory.keys.contiguous()
        tensors[f"memory.{i}.values"] = memory.values.contiguous()
    metadata = {"format": "grace-st-latent-memory", "next_positions": json.dumps([m.next_position for m in memories])}
    if texts is not None:
        metadata["texts"] = json.dumps(list(texts), ensure_ascii=False)
    save_file(tensors, str(path), metadata=metadata)


def load_memories(path: str | Path) -> list[LatentMemory]:
    """The memories :func:`save_memories` wrote, in order (safetensors only)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
            if metadata.get("format") != "grace-st-latent-memory":
                raise ValueError(f"{path}: not a latent memory file (grace-st compress writes them)")
            positions = json.loads(metadata["next_positions"])
            return [
                LatentMemory(file.get_tensor(f"memory.{i}.keys"), file.get_tensor(f"memory.{i}.values"), int(position))
                for i, position in enumerate(positions)
            ]
    except SafetensorError as error:
        raise ValueError(f"{path}: a truncated or corrupt memory file ({error})") from error
