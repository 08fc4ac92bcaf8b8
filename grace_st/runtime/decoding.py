"""How the one-pass rollout feeds the policy: incremental decoding and its CPU optimisations.

:func:`grace_st.runtime.generation.generate_rollouts` is the method (Eqs. 1–3); it asks an
:class:`IncrementalDecoder` for the hidden states and next-token logits of the prompts, then of
one token a row a step. Seven optimisations live here, each switched by :class:`DecodeOptions`
and none changing what is computed, only how fast (results differ by float32 rounding at most;
``tests/test_generation.py`` checks each against the plain loop and the two-pass reference):

- ``preallocated_cache``: KV buffers written in place (:func:`preallocated_cache`) instead of
  transformers' ``DynamicCache``, which copies a layer's whole cache at every token;
- ``share_prefix``: the instruction prefix every prompt shares is run once a batch
  (:func:`shared_prefix_length`); with ``prefix_cache`` once a model and instruction, kept across calls
  (:mod:`grace_st.runtime.prefix_cache`), so a single row feeds only its own tokens too;
- ``drop_finished``: rows whose rationale has ended leave the batch and the KV cache;
- ``packed_linears``: linear layers on oneDNN-packed weights (:mod:`grace_st.runtime.cpu.packed_linear`),
  with ``merge_adapters`` a PEFT LoRA layer on its merged weight (one product, not three) and
  ``one_row_layout`` a single row's product on the weight laid out as MKL streams it fastest;
- ``dedupe_prompts``: identical prompts in a batch (the K rollouts of one positive in training)
  are prefilled once and their keys and values copied to every row that shares them;
- ``native_step``: a decoding step (of a query encoded alone, or of many rows) and the prompt pass
  as one native call on every core (:mod:`grace_st.runtime.cpu.native_step`), where the model and weights allow it;
- ``decode_rows``: continuous batching. A call with more rows than this decodes that many at
  once, and a row whose rationale has ended hands its cache slot to the next prompt
  (:meth:`IncrementalDecoder.admit`), so a batch does not decode on with fewer and fewer live rows
  (:func:`grace_st.runtime.generation.stream_rollouts`).

``benchmarks/decode_ablation.py`` measures what each buys (``benchmarks/continuous_batching.py``
the last). ``DecodeOptions.plain()`` turns them all off: textbook incremental decoding with a
``DynamicCache``, every row of a call at once.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grace_st.runtime.batch import position_ids_from_mask
from grace_st.runtime.cpu.native_step import NativeStep
from grace_st.runtime.cpu.packed_linear import packed_linears
from grace_st.runtime.prefix_cache import PREFIX_STORE, prefix_key, splits_single_rows, weights_version
from grace_st.runtime.transformers_compat import cache_kwargs

if TYPE_CHECKING:
    from grace_st.runtime.model_view import ModelView


@dataclass(frozen=True)
class DecodeOptions:
    """Which decoding optimisations a rollout uses (all on by default; see the module docstring)."""

    preallocated_cache: bool = True
    share_prefix: bool = True  # takes effect with preallocated_cache: the layers known to take copied-in keys
    # takes effect with share_prefix, autograd off: the shared prefix's keys, values and states kept across calls
    # (grace_st.runtime.prefix_cache), and a single row's instruction prefix taken from there too
    prefix_cache: bool = True
    drop_finished: bool = True
    packed_linears: bool = True
    dedupe_prompts: bool = True
    merge_adapters: bool = True  # takes effect with packed_linears: a PEFT LoRA layer runs on W + ΔW
    # takes effect with packed_linears: a float32 call of one row (batch-1 decoding) runs on the
    # weight laid out as a matrix-vector product reads it fastest (grace_st.runtime.cpu.packed_linear)
    one_row_layout: bool = True
    # Decoding steps, of one row or many, and the prompt pass as one native call each on every core
    # (grace_st.runtime.cpu.native_step), where the model, weights and pooled layer allow it; elsewhere they run
    # as without it.
    native_step: bool = True
    # Sampling by one uniform a row a token (grace_st.runtime.generation.inverse_cdf_draw) rather than
    # torch.multinomial: the same distribution, other draws for a given seed. Not an optimisation
    # of the loop, so plain() keeps it; off only to time or reproduce the older sampler.
    inverse_cdf_sampling: bool = True
    # Continuous batching: at most this many rows decode at once (None: every row of a call). Takes
    # effect with preallocated_cache, on a call of more rows that generates (encode's batch).
    decode_rows: int | None = 64

    def __post_init__(self) -> None:
        if self.decode_rows is not None and not (isinstance(self.decode_rows, int) and self.decode_rows >= 1):
            raise ValueError(f"decode_rows must be None or an int >= 1, got {self.decode_rows!r}")

    @classmethod
    def plain(cls) -> DecodeOptions:
        return cls(
            preallocated_cache=False, share_prefix=False, prefix_cache=False, drop_finished=False, packed_linears=False,
            dedupe_prompts=False, merge_adapters=False, one_row_layout=False, native_step=False, decode_rows=None,
        )


def shared_prefix_length(
    input_ids: Tensor, attention_mask: Tensor, instruction_lengths: Tensor, alone: bool = False
) -> int:
    """How many leading tokens all left-padded prompts of a batch have in common, inside the
    instruction span (in ``encode`` that is the whole system turn: one instruction a call).

    Those positions hold the same ids at the same positions in every row, so (the model being
    causal) the same keys, values and hidden states. Capped at the shortest instruction span
    (L_sys: never pooled) and one short of the shortest prompt (each row's last prompt token is
    still fed, for its next-token logits). 0 for a single row (nothing to share in the batch), unless
    ``alone``: the prefix is kept across calls (:mod:`grace_st.runtime.prefix_cache`).
    """
    if input_ids.shape[0] < 2 and not alone:
        return 0
    lengths = attention_mask.sum(1)
    limit = min(int(instruction_lengths.min()), int(lengths.min()) - 1)
    if limit < 1:
        return 0
    starts = input_ids.shape[1] - lengths
    aligned = input_ids.gather(1, starts[:, None] + torch.arange(limit, device=input_ids.device)[None, :])
    differs = (aligned != aligned[:1]).any(0)
    return int(differs.nonzero()[0]) if differs.any() else limit


class PreallocatedLayer(DynamicLayer):
    """One full-attention layer of :func:`preallocated_cache`: keys and values written into
    buffers of ``capacity`` positions, read back as a view of the filled ones."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor, *args) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads = key_states.shape[:2]
        self._keys = key_states.new_empty((batch, heads, self.capacity, key_states.shape[-1]))
        self._values = value_states.new_empty((batch, heads, self.capacity, value_states.shape[-1]))
        self.length = 0
        self.keys, self.values = self._keys[:, :, :0], self._values[:, :, :0]
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache of {self.capacity} positions cannot hold {end}")
        self._keys[:, :, self.length : end] = key_states
        self._values[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values

    def advance(self, columns: int) -> None:
        """Count ``columns`` more as filled: written into the buffers by someone else
        (:class:`grace_st.runtime.cpu.native_step.NativeStep`)."""
        end = self.length + columns
        if end > self.capacity:
            raise RuntimeError(f"KV cache of {self.capacity} positions cannot hold {end}")
        self.length = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.is_initialized:
            self._keys, self._values = self._keys[indices], self._values[indices]
            self.keys, self.values = self._keys[:, :, : self.length], self._values[:, :, : self.length]

    # -- continuous batching: rows of the cache as slots that prompts come and go through ----------

    def add_rows(self, count: int) -> None:
        """``count`` more rows (zeros) after the existing ones."""
        if self.is_initialized:
            self._keys = torch.cat([self._keys, self._keys.new_zeros((count, *self._keys.shape[1:]))])
            self._values = torch.cat([self._values, self._values.new_zeros((count, *self._values.shape[1:]))])
            self.keys, self.values = self._keys[:, :, : self.length], self._values[:, :, : self.length]

    def place(self, rows: Tensor, keys: Tensor, values: Tensor) -> None:
        """Write another cache's keys and values into ``rows``, ending at the last filled column."""
        start = self.length - keys.shape[-2]
        self._keys[rows, :, start : self.length] = keys
        self._values[rows, :, start : self.length] = values

    def shift(self, start: int, offset: int) -> None:
        """Move the filled columns from ``start`` on to begin at column ``offset`` (what lies before
        is masked by the decoder)."""
        end = offset + self.length - start
        if end > self.capacity:
            raise RuntimeError(f"KV cache of {self.capacity} positions cannot hold {end}")
        self._keys[:, :, offset:end] = self._keys[:, :, start : self.length].clone()
        self._values[:, :, offset:end] = self._values[:, :, start : self.length].clone()
        self.length = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]


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
    cache = DynamicCache(config=model.config)
    # A config transformers reads no layer types from leaves the layers to be made lazily: plain DynamicCache then.
    cache.layers = [PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def _every_layer_preallocated(cache) -> bool:
    """Only these layers are known to take a shared prefix's keys and values copied in."""
    return bool(cache.layers) and all(type(layer) is PreallocatedLayer for layer in cache.layers)


def continuous_batching(model, options: DecodeOptions) -> bool:
    """Whether :meth:`IncrementalDecoder.admit` can run on this model: every layer of its cache
    preallocated (full attention), and ``options`` asking for it."""
    return (
        options.decode_rows is not None and options.preallocated_cache
        and _every_layer_preallocated(preallocated_cache(model, 1))
    )


def decoder_states(view: ModelView, cache=None, **inputs) -> Tensor:
    """Hidden states at the view's layer of one pass of its model's decoder alone (it fills the KV ``cache`` when
    given one): the LM head's logits over the whole vocabulary are not needed when nothing is generated."""
    decoder = view.model.get_decoder()
    use_cache = cache is not None
    if use_cache:
        inputs.update(cache_kwargs(decoder, cache))
    if view.hidden_layer == -1:
        return decoder(**inputs, use_cache=use_cache).last_hidden_state
    return decoder(**inputs, use_cache=use_cache, output_hidden_states=True).hidden_states[view.hidden_layer]


# The calling thread's (or task's) capture: the dict the decoder's final states go to, see _final_hidden_states.
_capture: contextvars.ContextVar[dict | None] = contextvars.ContextVar("grace_st_final_states", default=None)
_hook_lock = threading.Lock()


def _capture_final_states(_module, _args, output) -> None:
    """The decoder's forward hook (installed once a decoder, kept): the final states go to the calling
    thread's capture, if it has one; a forward outside :func:`_final_hidden_states` is left alone."""
    captured = _capture.get()
    if captured is not None:
        captured["states"] = output[0] if isinstance(output, tuple) else output.last_hidden_state


@contextlib.contextmanager
def _final_hidden_states(model) -> Iterator[dict]:
    """Capture the decoder's final (normed) hidden states without asking the model for every layer.

    Per call: the hook is the decoder's for good (a module-level function, so the model still
    pickles), installed once under a lock, and writes into the dict of the thread that runs the
    forward, so threads decoding with one model at once each get their own states."""
    decoder = model.get_decoder()
    if _capture_final_states not in decoder._forward_hooks.values():
        with _hook_lock:
            if _capture_final_states not in decoder._forward_hooks.values():
                decoder.register_forward_hook(_capture_final_states)
    captured: dict = {}
    token = _capture.set(captured)
    try:
        yield captured
    finally:
        _capture.reset(token)


class IncrementalDecoder:
    """The policy run over a batch of left-padded prompts, then one token a row a step, keeping
    the hidden states of every fed position (Eq. 2) and the next-token logits (Eq. 1).

    ``rows`` are the batch rows still fed: all of them, until ``drop_finished`` takes finished
    ones out. Logits are for ``rows``; hidden states come back for the whole batch (zeros for
    rows no longer fed). Made by :func:`incremental_decoder`.
    """

    def __init__(self, view: ModelView, captured: dict):
        self.view, self.captured = view, captured
        self.model, self.hidden_layer, self.options = view.model, view.hidden_layer, view.options
        self.kv_cache = None
        self.batch = 0
        self.rows: Tensor | None = None
        self.mask: Tensor | None = None  # attention mask over the KV cache's columns, for ``rows``
        self.released: Tensor | None = None  # continuous batching: which cache rows no prompt holds now
        # built at first use
        self.native: NativeStep | None | bool = self.options.native_step and self.hidden_layer == -1
        self.native_threads = 0  # PyTorch's thread count while single-row native steps hold it at one

    def fresh(self) -> IncrementalDecoder:
        """Another decoder on the same model, in the same :func:`incremental_decoder` block: a batch of
        its own (a prompt pass to admit, a new cache)."""
        return IncrementalDecoder(self.view, self.captured)

    def _forward(self, logits: bool = True, cache=None, **inputs) -> tuple[Tensor, Tensor | None]:
        """One forward pass that reads and extends the KV ``cache`` (None: none): (hidden states of the fed
        tokens, next-token logits of each row's last one). Given ``inputs_embeds``, the model reads those instead
        of ``input_ids``' embeddings."""
        if inputs.get("inputs_embeds") is None:
            inputs.pop("inputs_embeds", None)
        else:
            inputs.pop("input_ids", None)
        if not logits:
            return decoder_states(self.view, cache, **inputs), None
        inputs.update(cache_kwargs(self.model, cache))
        if self.hidden_layer == -1:
            output = self.model(**inputs, logits_to_keep=1, use_cache=True)
            states = self.captured["states"]
        else:
            output = self.model(**inputs, logits_to_keep=1, use_cache=True, output_hidden_states=True)
            states = output.hidden_states[self.hidden_layer]
        return states, output.logits[:, -1, :]

    def prefill(
        self, input_ids: Tensor, attention_mask: Tensor, instruction_lengths: Tensor, max_new_tokens: int,
        inputs_embeds: Tensor | None = None, keep_cache: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """The prompt pass: hidden states in the prompts' left-padded layout (zeros on padding)
        and the last position's logits (None when ``max_new_tokens`` is 0: the LM head is skipped).

        ``inputs_embeds`` (B × T × d): the input vectors, in place of ``input_ids``' embeddings (GRC's latents,
        which have no ids). The ids still say which rows and prefixes are the same, so rows with the same ids must
        have the same vectors, and positions inside the instruction span their ids' own embeddings.
        ``keep_cache``: the KV cache is kept even with nothing to generate (GRC's memory is read from it).

        With ``dedupe_prompts``, rows holding the same prompt are prefilled once: the pass runs on
        the distinct rows and its states, logits, mask and KV cache rows are then copied to every
        row (each row still samples its own rationale from there)."""
        if self.options.dedupe_prompts and input_ids.shape[0] > 1:
            distinct, index = torch.unique(torch.cat([input_ids, attention_mask], 1), dim=0, return_inverse=True)
            if distinct.shape[0] < input_ids.shape[0]:
                first = torch.full((distinct.shape[0],), input_ids.shape[0], dtype=torch.long, device=index.device)
                first = first.scatter_reduce(0, index, torch.arange(len(index), device=index.device), "amin")
                states, logits = self._prefill(
                    input_ids[first], attention_mask[first], instruction_lengths[first], max_new_tokens,
                    None if inputs_embeds is None else inputs_embeds[first], keep_cache,
                )
                if self.kv_cache is not None:
                    self.kv_cache.batch_select_indices(index)
                self.batch, self.rows = len(index), torch.arange(len(index), device=index.device)
                self.mask = self.mask[index]
                return states[index], None if logits is None else logits[index]
        return self._prefill(input_ids, attention_mask, instruction_lengths, max_new_tokens, inputs_embeds, keep_cache)

    def _prefill(
        self, input_ids: Tensor, attention_mask: Tensor, instruction_lengths: Tensor, max_new_tokens: int,
        inputs_embeds: Tensor | None = None, keep_cache: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        batch, width = input_ids.shape
        self.batch, self.rows = batch, torch.arange(batch, device=input_ids.device)
        shared = 0
        if self.options.share_prefix:
            # GRC's latents (inputs_embeds) come with spans that are whole rows: a row alone would keep its own text
            alone = self._prefix_cached() and inputs_embeds is None and splits_single_rows(self.model)
            shared = shared_prefix_length(input_ids, attention_mask, instruction_lengths, alone)
        # With nothing to generate a KV cache is needed only when asked for, to hold a shared prefix, or for the
        # native prompt pass, which writes into one: so that a prompt's states are the same bits alone or in a batch.
        native = self.options.preallocated_cache and self._native_model() is not None
        if max_new_tokens or keep_cache or shared or native:
            if self.options.preallocated_cache:
                self.kv_cache = preallocated_cache(self.model, width + max_new_tokens)
            else:
                self.kv_cache = DynamicCache(config=self.model.config)
        if shared and not (self.options.preallocated_cache and _every_layer_preallocated(self.kv_cache)):
            shared, self.kv_cache = 0, self.kv_cache if max_new_tokens or keep_cache else None
        logits = max_new_tokens > 0
        if shared:
            states, last_logits, self.mask = self._prefill_shared(input_ids, attention_mask, shared, logits, inputs_embeds)
        else:
            self.mask = attention_mask
            prompts = {
                "input_ids": input_ids, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask,
                "position_ids": position_ids_from_mask(attention_mask),
            }
            fed = self._native_prefill(logits, **prompts)
            states, last_logits = fed or self._forward(logits, self.kv_cache, **prompts)
        return states.masked_fill(attention_mask[..., None] == 0, 0.0), last_logits

    def _prefill_shared(
        self, input_ids: Tensor, attention_mask: Tensor, shared: int, logits: bool, inputs_embeds: Tensor | None
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """The prompt pass with the common prefix run once, on one row: its keys and values are
        copied into every row of the cache and only the rest of each prompt is fed.

        The cache then holds ``[prefix][padding][rest of prompt]``: padding in the middle is
        masked like padding on the left, and positions come from the mask, so every real token
        has the same position, keys and values as in one left-padded pass. At batch 64 with the
        default instruction this skips 27 of ~41 prompt tokens a row (benchmarks/decode_ablation.py).
        """
        batch, width = input_ids.shape
        starts = width - attention_mask.sum(1)
        first = int(starts[0])
        prefix = {
            "input_ids": input_ids[:1, first : first + shared],
            "attention_mask": attention_mask.new_ones((1, shared)),
            "position_ids": torch.arange(shared, device=input_ids.device)[None, :],
        }
        prefix_layers, prefix_states = self._prefix(prefix)
        for index, (layer_keys, layer_values) in enumerate(prefix_layers):
            keys, values = layer_keys.expand(batch, -1, -1, -1), layer_values.expand(batch, -1, -1, -1)
            self.kv_cache.update(keys, values, index)
        # Column j of the rest is prompt column j + shared; it holds a real token from the row's start on.
        rest_mask = (torch.arange(width - shared, device=input_ids.device)[None, :] >= starts[:, None]).long()
        cache_mask = torch.cat([rest_mask.new_ones((batch, shared)), rest_mask], 1)
        rest = {
            "input_ids": input_ids[:, shared:], "attention_mask": cache_mask,
            "inputs_embeds": None if inputs_embeds is None else inputs_embeds[:, shared:],
            "position_ids": (cache_mask.cumsum(-1)[:, shared:] - 1).clamp(min=0),
        }
        fed = self._native_prefill(logits, **rest)
        rest_states, last_logits = fed or self._forward(logits, self.kv_cache, **rest)
        states = rest_states.new_zeros((batch, width, rest_states.shape[-1]))
        states[:, shared:] = rest_states
        prefix_columns = starts[:, None] + torch.arange(shared, device=input_ids.device)[None, :]
        prefix_index = prefix_columns[..., None].expand(-1, -1, states.shape[-1])
        states.scatter_(1, prefix_index, prefix_states.expand(batch, -1, -1))
        return states, last_logits, cache_mask

    def _prefix_cached(self) -> bool:
        """Whether the shared prefix comes from (and goes to) :data:`grace_st.runtime.prefix_cache.PREFIX_STORE`."""
        return self.options.prefix_cache and self.options.preallocated_cache and not torch.is_grad_enabled()

    def _prefix(self, prefix: dict) -> tuple[list[tuple[Tensor, Tensor]], Tensor]:
        """The shared prefix's keys and values a layer, and its states: from the prefix store where it holds them,
        else one pass on one row, natively where the rest runs natively (every token then has the bits a prompt
        prefilled whole gets)."""
        native = self._native_model() is not None
        if self._prefix_cached():
            key = prefix_key(prefix["input_ids"], self.hidden_layer, self.options, native)
            version = weights_version(self.model)
            entry = PREFIX_STORE.lookup(self.model, key, version)
            if entry is not None:
                return entry.layers, entry.states
        fed = None
        if native:
            prefix_cache = preallocated_cache(self.model, prefix["input_ids"].shape[1])
            fed = self._native_prefill(False, cache=prefix_cache, **prefix)
        if fed is None:
            prefix_cache = DynamicCache(config=self.model.config)
            fed = self._forward(False, prefix_cache, **prefix)
        layers = [(layer.keys, layer.values) for layer in prefix_cache.layers]
        if self._prefix_cached():
            PREFIX_STORE.store(self.model, key, version, layers, fed[0])
        return layers, fed[0]

    def admit(
        self, slots: Tensor, input_ids: Tensor, attention_mask: Tensor, instruction_lengths: Tensor, slot_count: int,
        max_new_tokens: int,
    ) -> tuple[Tensor, Tensor]:
        """Continuous batching: prefill left-padded prompts into the cache rows ``slots`` (of
        ``slot_count``, allocated at the first call), whose earlier occupants have finished. Returns
        their prompt states (as :meth:`prefill`) and last logits.

        The prompts run as a batch of their own (with the shared prefix and deduplication) and
        their keys and values are written right-aligned at the cache's last filled column; the
        columns before them in those rows are masked. Keys are stored after their rotary
        embedding, at each row's own positions, and a step's positions come from its row of the
        mask, so a row decodes exactly as if it had been prefilled alone. Rows are fed while
        ``self.rows`` stays every slot (:meth:`step` with ``keep_rows``)."""
        batch_rows = self.fresh()
        states, logits = batch_rows.prefill(input_ids, attention_mask, instruction_lengths, 1)
        width = batch_rows.mask.shape[1]
        if self.kv_cache is None:
            # room for the widest prompt, a rationale, and as many columns again: compacting
            # (a copy of the cache) then happens once every width + budget steps at most
            self.kv_cache = preallocated_cache(self.model, 2 * (width + max_new_tokens) + 1)
            for layer, new in zip(self.kv_cache.layers, batch_rows.kv_cache.layers):
                shape = (slot_count, *new.keys.shape[1:2], 0, new.keys.shape[-1])
                layer.lazy_initialization(new.keys.new_empty(shape), new.values.new_empty(shape))
            self.batch, self.rows = slot_count, torch.arange(slot_count, device=input_ids.device)
            self.mask = attention_mask.new_zeros((slot_count, 0))
            self.released = torch.ones(slot_count, dtype=torch.bool, device=input_ids.device)
        self.released[slots] = False
        self._make_room(width)
        for layer, new in zip(self.kv_cache.layers, batch_rows.kv_cache.layers):
            layer.place(slots, new.keys, new.values)
        length = self.mask.shape[1]
        self.mask[slots] = torch.cat([self.mask.new_zeros((len(slots), length - width)), batch_rows.mask], 1)
        return states, logits

    def add_slots(self, count: int) -> None:
        """Continuous batching: ``count`` more cache rows, free, after the ones in use (a copy of the
        cache into larger buffers). Rows keep their numbers; a new row attends to nothing until a
        prompt is admitted into it."""
        if self.kv_cache is None or count <= 0:
            return
        for layer in self.kv_cache.layers:
            layer.add_rows(count)
        self.batch += count
        self.rows = torch.arange(self.batch, device=self.rows.device)
        self.mask = torch.cat([self.mask, self.mask.new_zeros((count, self.mask.shape[1]))])
        self.released = torch.cat([self.released, self.released.new_ones(count)])

    def release(self, slots: Tensor) -> None:
        """Mark ``slots`` finished: their columns no longer hold the cache's width (:meth:`_make_room`)."""
        self.released[torch.isin(self.rows, slots)] = True  # rows may have left the cache since (step)

    def _make_room(self, width: int) -> None:
        """At least ``width`` filled columns (a prompt is written right-aligned) and one free column
        (the next step). Columns no row in use attends to are dropped from the left first."""
        length, capacity = self.mask.shape[1], self.kv_cache.layers[0].capacity
        if length + 1 > capacity:
            used = self.mask[~self.released].bool().any(0)
            start = int(used.nonzero()[0]) if used.any() else length
        else:
            start = 0
        offset = max(width - (length - start), 0)  # masked columns in front, so the prompt fits
        if start or offset:
            for layer in self.kv_cache.layers:
                layer.shift(start, offset)
            self.mask = torch.cat([self.mask.new_zeros((len(self.mask), offset)), self.mask[:, start:]], 1)

    def step(self, tokens: Tensor, alive: Tensor, keep_rows: bool = False) -> tuple[Tensor, Tensor]:
        """Feed one token to each of ``rows`` (``alive``: its rationale goes on; the others get
        the view's padding, masked out). Returns the hidden states (B, 1, H) and the logits of ``rows``
        after any finished ones were dropped (none with ``keep_rows``: slots about to take new prompts)."""
        dead = int((~alive).sum())
        # Finished rows leave once they are a quarter of those fed: dropping copies the KV cache
        # (about one decode step's memory traffic), so it waits until enough rows go at once.
        if not keep_rows and self.options.drop_finished and dead and dead >= len(self.rows) // 4:
            keep = alive.nonzero().squeeze(1)
            self.kv_cache.batch_select_indices(keep)
            self.rows, self.mask, tokens, alive = self.rows[keep], self.mask[keep], tokens[keep], alive[keep]
            if self.released is not None:
                self.released = self.released[keep]
        if self.released is not None:  # slots prompts come and go through: keep a column free
            self._make_room(0)
        tokens = torch.where(alive, tokens, self.view.pad_token_id)
        # A finished slot attends to its own padding, never to nothing: a row with no column to attend
        # would put NaN into its keys and values, where a later prompt could meet them behind the mask.
        fed = alive if self.released is None else torch.ones_like(alive)
        self.mask = torch.cat([self.mask, fed[:, None].long()], dim=1)
        positions = self.mask.sum(1, keepdim=True) - 1
        fast = self._native_step(tokens, positions)
        if fast is not None:
            states, logits = fast
        else:
            states, logits = self._forward(
                cache=self.kv_cache, input_ids=tokens[:, None], attention_mask=self.mask, position_ids=positions
            )
        batch_states = states.new_zeros((self.batch, 1, states.shape[-1]))
        batch_states[self.rows] = states
        return batch_states, logits

    def _native_model(self) -> NativeStep | None:
        """The model's native step (built at first use), or None where it cannot run this model."""
        if self.native is True:
            self.native = NativeStep.for_model(self.model, merge_adapters=self.options.merge_adapters) or False
        return self.native or None

    def _native(self, rows: int, columns: int, allocate: bool = False, cache=None) -> NativeStep | None:
        """The native step, if it can feed ``columns`` more columns of ``rows`` rows into ``cache`` (None:
        the decoder's). With ``allocate``, a preallocated cache nothing was written to yet gets its
        buffers first (a prompt pass)."""
        native = self._native_model()
        if native is None:
            return None
        cache = self.kv_cache if cache is None else cache
        if (
            allocate and native.takes(rows, columns) and cache is not None
            and _every_layer_preallocated(cache) and not cache.layers[0].is_initialized
        ):
            native.allocate(cache, rows)
        return native if native.applies(cache, rows, columns) else None

    def _native_prefill(
        self, logits: bool, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, cache=None,
        inputs_embeds: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None] | None:
        """The prompts (after the shared prefix, if any) as one native call over their real tokens,
        padding skipped (:meth:`grace_st.runtime.cpu.native_step.NativeStep.prefill`), into ``cache`` (None: the
        decoder's); None where it does not apply."""
        cache = self.kv_cache if cache is None else cache
        native = self._native(*input_ids.shape, allocate=True, cache=cache)
        if native is None:
            return None
        return native.prefill(
            input_ids, cache, attention_mask, position_ids, logits, torch.get_num_threads(), inputs_embeds
        )

    def _native_step(self, tokens: Tensor, positions: Tensor) -> tuple[Tensor, Tensor] | None:
        """The step as one native call (:mod:`grace_st.runtime.cpu.native_step`); None where it does not apply
        (the caller runs the model's forward)."""
        native = self._native(len(tokens), 1)
        if native is None:
            return None
        if len(tokens) > 1 and self.native_threads:  # rows joined (a stream): PyTorch gets its threads back
            self.close()
        threads = self.native_threads or torch.get_num_threads()
        if len(tokens) == 1 and not self.native_threads:
            # A single row's step takes milliseconds: PyTorch's own small ops between native steps (the
            # next token's choice over the whole vocabulary) run on one thread until the block ends, or
            # its other threads would spin after each of them on the cores the native step needs (12 %
            # of a step, measured).
            self.native_threads = threads
            torch.set_num_threads(1)
        return native(tokens, self.kv_cache, self.mask, positions, threads)

    def close(self) -> None:
        """Give PyTorch back the threads :meth:`_native_step` took."""
        if self.native_threads:
            torch.set_num_threads(self.native_threads)
            self.native_threads = 0


def packed_linears_for(model, options: DecodeOptions):
    """The :func:`grace_st.runtime.cpu.packed_linear.packed_linears` block ``options`` ask for."""
    return packed_linears(
        model, enabled=options.packed_linears, merge_adapters=options.merge_adapters,
        one_row_layout=options.one_row_layout,
    )


@contextlib.contextmanager
def incremental_decoder(view: ModelView) -> Iterator[IncrementalDecoder]:
    """An :class:`IncrementalDecoder` over the view's model for one batch, with packed linear layers on if its
    options say so."""
    with packed_linears_for(view.model, view.options), _final_hidden_states(view.model) as captured:
        decoder = IncrementalDecoder(view, captured)
        try:
            yield decoder
        finally:
            decoder.close()
