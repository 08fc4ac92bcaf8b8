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

:func:`latent_pass` is that one pass: ``encode`` (:class:`grace_st.methods.LatentEngine`), :func:`compress` and
training's Eq. 5 step (``grace_training.algorithms.grc.step``) all call it, so the embedding trained is the embedding served
(to float32 rounding: below).

Written here, not taken from a library: no package implements GRC's latents or its cut mask (the paper's code is
unreleased). Training's pass is transformers' own forward, given ``inputs_embeds`` and a 4D additive mask (one a
kind of layer where some layers slide, each windowed as the model's own pass is: :func:`layer_masks`). Without ❸
and without autograd (``encode``, ``compress``) the mask is plain causal, and the same pass runs as the prompt pass
GRACE's prompts get (:mod:`grace_st.runtime.decoding`: the shared instruction prefix once a batch, padding skipped, the
native kernels where they apply): 2.5–2.8 times as fast on the shipped model (``benchmarks/grc_pass_cost.py``, decisions/D040)
and equal to float32 rounding (``tests/test_grc.py``).

What the paper leaves open, as chosen here (docs/grc.md lists them with the measurements):
- no EOS between y and the latents (the paper reports it better without);
- a memory's keys keep the rotary positions they were made at (k..k+m-1): the turn that reads it starts at
  ``next_position`` = k + m, as ❸ did in training. Several memories are concatenated in the order given and the
  turn starts after the largest ``next_position``: each keeps its own positions, so two memories of texts of
  similar length overlap in position, which attention tolerates (rotary scores depend on distance only).
"""

from __future__ import annotations

import contextlib
import json
import numbers
import os
import secrets
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import Tensor, nn

from grace_st.methods.base import LearnedState, Method
from grace_st.methods.grace import RationaleEngine
from grace_st.runtime.batch import Rationales, RolloutRequest, Thoughts, left_pad, position_ids_from_mask, right_pad
from grace_st.runtime.decoding import DecodeOptions, decoder_states, incremental_decoder
from grace_st.runtime.model_view import ModelView
from grace_st.runtime.transformers_compat import cache_kwargs
from grace_st.setting import WHAT, Setting, int_in

LATENT_FILE = "latent_tokens.safetensors"
MAX_LATENT_TOKENS = 4_096  # each one is a position of every pass and of the memory
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
        """e before L2: the mean over the m latent positions of A(h), (B, d) float32, whatever dtype the module was
        cast to with the model (a bfloat16 model's SentenceTransformer may cast every module)."""
        weight, bias = self.adapter.weight.float(), self.adapter.bias.float()
        return torch.nn.functional.linear(latent_states.float(), weight, bias).mean(1)

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


def latent_tokens_problem(latents: LatentTokens, num_latent_tokens: int) -> str | None:
    """Why ``latents`` cannot serve ``num_latent_tokens``, or None."""
    if latents.num_latent_tokens != num_latent_tokens:
        return (
            f"num_latent_tokens is {num_latent_tokens}, but the model's latent tokens number "
            f"{latents.num_latent_tokens}: trained latents cannot be resized; set it back"
        )
    return None


def latent_tokens_for(model, latents: LatentTokens | None, num_latent_tokens: int) -> LatentTokens:
    """The latent tokens a GRC encoder uses: its own, or fresh ones (:meth:`LatentTokens.initialised`) where it has
    none; refused where their number is not ``num_latent_tokens``."""
    if latents is None:
        return LatentTokens.initialised(num_latent_tokens, model.get_input_embeddings().weight)
    problem = latent_tokens_problem(latents, num_latent_tokens)
    if problem is not None:
        raise ValueError(problem)
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


# The dtypes a model computes keys and values in (a memory's are the model's own).
MEMORY_DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64,
}


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class MemoryFileError(ValueError):
    """A memory, or a memory file, that cannot be read or written as given: the message starts with the file (and
    the memory's index in it) or the memory, then says the problem."""


@dataclass(frozen=True)
class MemoryModel:
    """The model a memory was made by, written into its file and compared with the model that reads it: its
    weights' revision (the ``weights_revision`` it was saved with, else its weights' own fingerprint, which covers
    the latents) and the shape and dtype of the keys and values its layers give."""

    weights_revision: str
    num_latent_tokens: int
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """A memory's keys (and values): layers × key-value heads × m × head size."""
        return (self.layers, self.kv_heads, self.num_latent_tokens, self.head_dim)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> MemoryModel:
        """The model a file names; a ``ValueError`` saying what is wrong with the entry."""
        try:
            values = json.loads(text)
        except (TypeError, json.JSONDecodeError):
            raise ValueError("is not JSON") from None
        names = [field.name for field in fields(cls)]
        if not isinstance(values, dict) or set(values) != set(names):
            raise ValueError(f"is not an object of exactly {', '.join(names)}")
        if not isinstance(values["weights_revision"], str) or not values["weights_revision"]:
            raise ValueError("has no weights_revision string")
        for name in ("num_latent_tokens", "layers", "kv_heads", "head_dim"):
            if not _is_int(values[name]) or not 1 <= values[name] <= 1 << 20:
                raise ValueError(f"has {name} {values[name]!r:.40}, not a positive integer")
        if not isinstance(values["dtype"], str) or values["dtype"] not in MEMORY_DTYPES:
            raise ValueError(f"has dtype {values['dtype']!r:.40}, not one of {', '.join(MEMORY_DTYPES)}")
        return cls(**values)

    def differences(self, reader: MemoryModel) -> list[str]:
        """How this model differs from ``reader``'s, one phrase an entry."""
        return [
            f"its {name} is {getattr(self, name)}, this model's {getattr(reader, name)}"
            for name in (field.name for field in fields(self))
            if getattr(self, name) != getattr(reader, name)
        ]


@dataclass
class LatentMemory:
    """One text's compressed memory: the keys and values of its m latent positions at every layer,
    (layers, kv_heads, m, head_dim) each, and the position a turn reading it starts at (k + m). ``model`` is the
    model that made it (:func:`grace_st.memory.compress` sets it; a memory file must name it), ``source`` where it
    was read from (named in errors)."""

    keys: Tensor
    values: Tensor
    next_position: int
    model: MemoryModel | None = None
    source: str | None = None

    @property
    def nbytes(self) -> int:
        """Eq. 6: 2 · L · H_kv · d_h · m · bytes per value, the same for any text length."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


def memory_problem(memory: LatentMemory, model: MemoryModel, max_position: int | None = None) -> str | None:
    """What keeps a model of identity ``model`` from reading ``memory``, or None: keys and values that are not
    tensors of its shape and dtype, or not finite; a next position that is not an integer above m (at least one
    token, then the m latents) and, given ``max_position``, within the model's positions."""
    for name in ("keys", "values"):
        tensor = getattr(memory, name)
        if not isinstance(tensor, Tensor):
            return f"its {name} are a {type(tensor).__name__}, not a tensor"
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype != model.dtype:
            return f"its {name} are {dtype}, not {model.dtype}"
        if tuple(tensor.shape) != model.shape:
            return (
                f"its {name} have shape {tuple(tensor.shape)}, not {model.shape} ({model.layers} layers × "
                f"{model.kv_heads} key-value heads × m {model.num_latent_tokens} × head size {model.head_dim})"
            )
        if not bool(torch.isfinite(tensor).all()):
            return f"its {name} hold NaN or infinite values"
    position = memory.next_position
    if not _is_int(position):
        return f"its next position is {position!r:.40}, not an integer"
    if position <= model.num_latent_tokens:
        return f"its next position is {position}, not above m = {model.num_latent_tokens} (a text, then the latents)"
    if max_position is not None and position > max_position:
        return f"its next position is {position}, beyond the model's {max_position} positions"
    return None


@dataclass
class LatentPass:
    """What one :func:`latent_pass` gives: the embeddings before L2 (B, d), the final states of ❶ (left-padded,
    B × P × d) and of ❸ (right-padded, B × S × d) for training's token losses, and the memories when asked."""

    embeddings: Tensor
    prefix_states: Tensor
    suffix_states: Tensor
    memories: list[LatentMemory] | None


def latent_pass(
    view: ModelView,
    latents: LatentTokens,
    prefixes: Sequence[Sequence[int]],
    suffixes: Sequence[Sequence[int]] | None = None,
    *,
    with_memory: bool = False,
    prompt_pass: bool = False,
) -> LatentPass:
    """One forward over ❶ ``prefixes`` (P(x) ⊕ y, token ids), ❷ the latents and ❸ ``suffixes`` (token ids, or
    none) under :func:`segment_mask`, windowed where the model's layers slide (:func:`layer_masks`); gradients
    flow when autograd is on (training), so call it under ``torch.no_grad`` to embed.

    With ``prompt_pass``, without ❸ and with autograd off (``encode``, :func:`grace_st.memory.compress`), the pass
    is a prompt pass of :mod:`grace_st.runtime.decoding` (:func:`_latent_prompt_pass`): the same causal pass, fed as
    the view's options allow."""
    if prompt_pass and not any(suffixes or ()) and not torch.is_grad_enabled():
        return _latent_prompt_pass(view, latents, prefixes, with_memory)
    model, pad_token_id = view.model, view.pad_token_id
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
    states = decoder_states(
        view, cache=cache, inputs_embeds=inputs,
        attention_mask=layer_masks(model.get_decoder().config, real, segments, dtype),
        position_ids=position_ids_from_mask(real),
    )
    memories = None
    if with_memory:
        next_positions = (prefix_real.sum(1) + m).tolist()
        memories = _memories(cache, slice(width, width + m), next_positions)
    return LatentPass(
        latents.readout(states[:, width : width + m]), states[:, :width], states[:, width + m :], memories
    )


def _latent_prompt_pass(
    view: ModelView, latents: LatentTokens, prefixes: Sequence[Sequence[int]], with_memory: bool
) -> LatentPass:
    """:func:`latent_pass` without ❸ as the prompt pass a rationale's prompts get (``IncrementalDecoder.prefill``):
    each row ``P(x) ⊕ y`` then the latents, left-padded, so the latents are every row's last m columns. The
    instruction prefix the rows share runs once a batch, padding is skipped and the native kernels run where they
    apply; the latents enter as ``inputs_embeds``. The shared prefix stops before the latents (each row's own
    length caps it), so a latent column is never taken for a token with the same id."""
    m, pad_token_id = latents.num_latent_tokens, view.pad_token_id
    embed = view.model.get_input_embeddings()
    ids, real = left_pad([[*row, *[pad_token_id] * m] for row in prefixes], pad_token_id)
    ids, real = ids.to(embed.weight.device), real.to(embed.weight.device)
    inputs = embed(ids)
    inputs[:, -m:] = latents.latents.to(inputs.dtype)
    lengths = torch.tensor([len(row) for row in prefixes], device=ids.device)
    with incremental_decoder(view) as decoder:
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


MEMORY_FORMAT = "grace-st-latent-memory"
# Files that make a folder a model's (a causal LM, a LoRA adapter, a sentence-transformers or GRACE model): a memory
# file is never written among them, where it could replace one or be taken for one.
# A folder holding one of these holds a model (a bare config.json or tokenizer file does not say so: any project has one).
MODEL_FOLDER_FILES = (
    "modules.json", "adapter_config.json", "grace_config.json", "config_sentence_transformers.json",
    "model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors", LATENT_FILE, "pytorch_model.bin",
)


def check_memory_out(path: str | Path, overwrite: bool = False) -> Path:
    """``path`` as a memory file about to be written, or a :class:`MemoryFileError`: a directory, a path whose folder
    is missing, unwritable or a model's folder (:data:`MODEL_FOLDER_FILES`), or an existing file unless
    ``overwrite``."""
    path = Path(path)
    if path.is_dir():
        raise MemoryFileError(f"{path}: a directory; give a file name")
    folder = path.parent
    if not folder.is_dir():
        raise MemoryFileError(f"{path}: its folder {folder} does not exist")
    marker = next((name for name in MODEL_FOLDER_FILES if (folder / name).exists()), None)
    if marker is not None:
        raise MemoryFileError(
            f"{path}: {folder} holds a model ({marker}); a memory file is never written into a model's folder, "
            "give a path outside it"
        )
    if os.path.lexists(path) and not overwrite:
        raise MemoryFileError(f"{path}: exists; give another path, or overwrite it (--overwrite, overwrite=True)")
    if not os.access(folder, os.W_OK):
        raise MemoryFileError(f"{path}: cannot be written (no write permission in {folder})")
    return path


def save_memories(
    path: str | Path, memories: Sequence[LatentMemory], *, texts: Sequence[str] | None = None, overwrite: bool = False
) -> None:
    """``memories`` (of one model, as :func:`grace_st.memory.compress` made them) in one safetensors file:
    ``memory.{i}.keys`` / ``.values``, and in its metadata the format, the model that made them
    (:class:`MemoryModel`) and their next positions. The texts are kept only when given (``texts``): a memory
    stands in for its text, and its file holds no text otherwise.

    An existing ``path`` is refused unless ``overwrite``, and so is a path in a model's folder
    (:func:`check_memory_out`); the file is written beside its destination and moved into place, so an
    interrupted save leaves no half-written file."""
    from safetensors.torch import save_file

    memories = list(memories)
    if not memories:
        raise MemoryFileError(f"{path}: no memories to save")
    model = memories[0].model
    for index, memory in enumerate(memories):
        if memory.model is None:
            raise MemoryFileError(f"memory {index}: names no model that made it; save memories grace_st.compress made")
        if memory.model != model:
            differences = "; ".join(memory.model.differences(model))
            raise MemoryFileError(f"memory {index}: made by another model than memory 0 ({differences})")
        problem = memory_problem(memory, model)
        if problem is not None:
            raise MemoryFileError(f"memory {index}: {problem}")
    metadata = {
        "format": MEMORY_FORMAT,
        "model": model.to_json(),
        "next_positions": json.dumps([memory.next_position for memory in memories]),
    }
    if texts is not None:
        texts = list(texts)
        if len(texts) != len(memories) or not all(isinstance(text, str) for text in texts):
            raise ValueError(f"texts must be {len(memories)} strings, one a memory")
        metadata["texts"] = json.dumps(texts, ensure_ascii=False)
    path = check_memory_out(path, overwrite)
    tensors = {}
    for i, memory in enumerate(memories):
        tensors[f"memory.{i}.keys"] = memory.keys.contiguous()
        tensors[f"memory.{i}.values"] = memory.values.contiguous()
    staged = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    try:
        save_file(tensors, str(staged), metadata=metadata)
        os.replace(staged, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            staged.unlink()
        raise


def load_memories(path: str | Path) -> list[LatentMemory]:
    """The memories :func:`save_memories` wrote, in order, each checked against the model the file names
    (:func:`memory_problem`): anything else is a :class:`MemoryFileError` naming the file and the problem. A
    regular safetensors file only: a directory, a device or a FIFO is refused before it is read."""
    from safetensors import SafetensorError, safe_open

    from grace_st.data.files import open_regular_file

    try:
        with open_regular_file(path, "a latent memory"):
            pass
    except ValueError as error:
        raise MemoryFileError(str(error)) from None
    except OSError as error:
        raise MemoryFileError(f"{path}: cannot be read ({error.strerror or error})") from None
    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
            if metadata.get("format") != MEMORY_FORMAT:
                raise MemoryFileError(f"{path}: not a latent memory file (grace-st compress writes them)")
            if "model" not in metadata:
                raise MemoryFileError(
                    f"{path}: names no model that made it, so no model can check it is its own; compress the texts "
                    "again"
                )
            try:
                model = MemoryModel.from_json(metadata["model"])
            except ValueError as error:
                raise MemoryFileError(f"{path}: its model entry {error}") from None
            positions = _next_positions(path, metadata.get("next_positions"))
            expected = {f"memory.{i}.{part}" for i in range(len(positions)) for part in ("keys", "values")}
            found = set(file.keys())
            if found != expected:
                named = (("no", sorted(expected - found)), ("unexpected", sorted(found - expected)))
                problem = "; ".join(f"{what} {', '.join(names[:4])}" for what, names in named if names)
                raise MemoryFileError(f"{path}: tensors do not match its {len(positions)} next positions ({problem})")
            memories = [
                LatentMemory(
                    file.get_tensor(f"memory.{i}.keys"), file.get_tensor(f"memory.{i}.values"), position, model,
                    f"{path}, memory {i}",
                )
                for i, position in enumerate(positions)
            ]
    except SafetensorError as error:
        raise MemoryFileError(f"{path}: a truncated or corrupt memory file ({error})") from error
    for memory in memories:
        problem = memory_problem(memory, model)
        if problem is not None:
            raise MemoryFileError(f"{memory.source}: {problem}")
    return memories


def _next_positions(path, text) -> list:
    """The metadata's next positions: a non-empty JSON list (each entry is checked with its memory)."""
    if text is None:
        raise MemoryFileError(f"{path}: no next_positions in its metadata")
    try:
        positions = json.loads(text)
    except json.JSONDecodeError:
        raise MemoryFileError(f"{path}: next_positions is not JSON ({text!r:.40})") from None
    if not isinstance(positions, list):
        raise MemoryFileError(f"{path}: next_positions is {positions!r:.40}, not a list")
    if not positions:
        raise MemoryFileError(f"{path}: holds no memories (next_positions is empty)")
    return positions


class LatentEngine(RationaleEngine):
    """A causal LM that answers in text, then reads its meta latent tokens (GRC, ``grc.md``; :mod:`grace_st.methods.grc`):
    the same two calls as :class:`RationaleEngine`. ``generate`` writes the response y as GRACE writes a rationale
    (a budget of 0 gives the document response "None" instead, as GRC trains documents); ``embed`` runs one pass
    over ``P(x) ⊕ y`` and the latents and reads e = mean A(h) at the latent positions, not the text's states."""

    def __init__(
        self, model, tokenizer, *, hidden_layer: int = -1, options: DecodeOptions | None = None, generator=None,
        latents: LatentTokens,
    ):
        super().__init__(model, tokenizer, hidden_layer=hidden_layer, options=options, generator=generator)
        self.latents = latents

    embeds_decoding_states = False

    @property
    def document_response(self) -> list[int]:
        return self.tokenizer.encode(DOCUMENT_RESPONSE, add_special_tokens=False)

    def generate(self, request: RolloutRequest, batch_size: int | None = None, bucket_ratio: float | None = None) -> Thoughts:
        """y for each row: a response of up to ``max_new_tokens`` (GRACE's decoding), or "None" at budget 0. The
        decoding states are not kept: the embedding is the latents' (:meth:`embed`)."""
        rows = len(request.prompt_ids)
        if request.max_new_tokens == 0:
            return Thoughts(Rationales([self.document_response for _ in range(rows)], [-1] * rows, [False] * rows))
        return Thoughts(super().generate(request, batch_size, bucket_ratio).rationales)

    @torch.no_grad()
    def responses(self, prompt_ids: list[list[int]], instruction_length: int, budget: int) -> list[list[int]]:
        """y of each prompt, greedy, as ``encode`` writes it at ``budget`` (what ``compress`` and training read)."""
        request = RolloutRequest(prompt_ids, [instruction_length] * len(prompt_ids), 0.0, 1.0, budget)
        return self.generate(request).rationales.rationale_ids

    @torch.no_grad()
    def embed(self, request: RolloutRequest, thoughts: Thoughts, batch_size: int | None = None) -> Tensor:
        """e of each row before L2 (grc.md): one pass over ``P(x) ⊕ y ⊕ r_1..r_m``, ``batch_size`` rows at a time
        (None: one batch), (R, H) float32."""
        rows = [[*prompt, *response] for prompt, response in zip(request.prompt_ids, thoughts.rationales.rationale_ids)]
        if not rows:
            return torch.zeros((0, self.hidden_size))
        return torch.cat([result.embeddings for result in self.latent_passes(rows, batch_size or len(rows))])

    @torch.no_grad()
    def latent_passes(self, rows: list[list[int]], batch_size: int, with_memory: bool = False) -> list[LatentPass]:
        """:func:`~grace_st.methods.grc.latent_pass` over ``rows`` (``P(x) ⊕ y`` token ids), ``batch_size`` at a time, as
        the prompt pass a rationale's prompts get (this engine's :class:`DecodeOptions`): what :meth:`embed` and
        :func:`grace_st.compress` read."""
        return [
            latent_pass(
                self.view, self.latents, rows[start : start + batch_size], with_memory=with_memory, prompt_pass=True
            )
            for start in range(0, len(rows), batch_size)
        ]


GRC = Method(
    "grc",
    LatentEngine,
    "writes a response of up to max_rationale_tokens tokens ('None' at 0), then embeds with the final states of "
    "num_latent_tokens learned latent tokens after it (GRC), whose keys and values are also the text's "
    "compressed memory",
    settings={
        "num_latent_tokens": Setting(
            16,
            "method 'grc': m, the meta latent tokens after the response (learned vectors saved in "
            f"{LATENT_FILE}): the embedding's read-out and the memory's size, the same for any text length",
            f"an int in [1, {MAX_LATENT_TOKENS}]",
            int_in(1, MAX_LATENT_TOKENS),
            **WHAT,
        ),
    },
    engine_options=lambda settings, state: {"latents": state},
    state=LearnedState(
        "latent_tokens",
        LATENT_FILE,
        load=LatentTokens.load,
        save=lambda state, folder: state.save(folder),
        prepare=lambda model, state, settings: latent_tokens_for(model, state, settings["num_latent_tokens"]),
        problem=lambda state, settings: latent_tokens_problem(state, settings["num_latent_tokens"]),
    ),
    pools_prompt_at_budget_zero=False,
    shipped_adapter="grc",
    trained_by="grc",
)
