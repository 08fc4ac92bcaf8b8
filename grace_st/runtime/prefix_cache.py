"""The instruction prefix's keys, values and states, computed once a model and kept across calls.

Every prompt of a prompt type opens with the same tokens: the chat template, the system instruction and
the user turn's opening (27 of a short query's ~40 prompt tokens with the shipped default). The model is
causal, so those positions have the same keys, values and hidden states in every prompt, every call and every
request. :class:`IncrementalDecoder <grace_st.runtime.decoding.IncrementalDecoder>`'s prompt pass asks this
store for them (``DecodeOptions.prefix_cache``) and feeds only each prompt's rest: a single query, a server
request or a batch of corpus texts then computes its own tokens alone.

What is shared stays inside the instruction span (L_sys; never pooled, method.md Eq. 3), so an embedding
does not depend on what else is cached. The prefix is computed as the batch-level shared prefix is (one row, its
own pass, natively where the rest runs natively), so a batch of several rows gets the bits it gets without the
store. A single row then runs as two passes (prefix, rest) instead of one: the same bits where the native step runs,
float32 rounding on PyTorch's float32 kernels, and not at all on bfloat16 or int8 weights (:func:`splits_single_rows`);
tests/test_prefix_cache.py states and tests the bound.

An entry is keyed by the model object, the decode options and thread count that decide its kernels, the pooled
layer and the prefix's token ids (the prompt format, instruction and method's template all show in the ids).
Each entry carries the weights' version (:func:`weights_version`): a lookup after a LoRA swap, merge,
quantisation, optimizer step or ``load_state_dict`` finds another version, drops every entry of that model
and recomputes. The store is an LRU bounded in bytes (:data:`DEFAULT_MAX_BYTES`, :meth:`PrefixStore.resize`);
:meth:`PrefixStore.stats` reports its size, hits and misses (the server's ``/health`` and ``/metrics``).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from grace_st.runtime.cpu.quantization import quantization_scheme

# 64 MiB: the default model's 27-token prefix is 1.3 MB (30 layers, 3 KV heads of 64, float32, plus its states).
DEFAULT_MAX_BYTES = 64 * 2**20


def weights_version(model) -> tuple:
    """What changes whenever ``model``'s forward pass may: every parameter's and buffer's storage and version
    counter (optimizer steps, ``load_state_dict``, an in-place merge; quantisation and LoRA injection make
    new tensors) and each adapter layer's active adapters and switches (PEFT's ``set_adapter``,
    ``disable_adapter``, ``merge``). Cheap (no read of the values): a write through ``.data`` bypasses the
    version counter, so whoever writes that way calls :meth:`PrefixStore.clear`."""
    tensors = tuple((t.data_ptr(), t._version, t.dtype) for t in (*model.parameters(), *model.buffers()))
    adapters = tuple(
        (str(getattr(m, "active_adapters", None)), bool(getattr(m, "disable_adapters", False)),
         str(getattr(m, "merged_adapters", None)))
        for m in model.modules() if hasattr(m, "merged_adapters")
    )
    return tensors, adapters


@dataclass
class PrefixEntry:
    """One prefix: each layer's keys and values (1, heads, n, head dim) and its states (1, n, hidden)."""

    version: tuple
    layers: list[tuple[Tensor, Tensor]]
    states: Tensor
    nbytes: int


class PrefixStore:
    """A byte-bounded LRU of :class:`PrefixEntry`, shared by every thread (the server's scheduler, ``encode``)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[tuple, PrefixEntry] = OrderedDict()
        self._lock = threading.Lock()
        self._tracked: set[int] = set()  # models whose collection drops their entries
        self.bytes = 0
        self.hits = self.misses = self.evictions = self.invalidations = 0

    def lookup(self, model, key: tuple, version: tuple) -> PrefixEntry | None:
        """The entry for ``key`` of ``model`` at weights ``version``; a stale one drops the model's entries."""
        full = (id(model), *key)
        with self._lock:
            entry = self._entries.get(full)
            if entry is not None and entry.version != version:
                self._drop_model(id(model))
                self.invalidations += 1
                entry = None
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(full)
            self.hits += 1
            return entry

    def store(self, model, key: tuple, version: tuple, layers: list[tuple[Tensor, Tensor]], states: Tensor) -> None:
        """Keep a prefix (copies: the caller's buffers go on being written), evicting the least recently used
        entries beyond the bound. An entry larger than the whole bound is not kept."""
        layers = [(keys.detach().clone(), values.detach().clone()) for keys, values in layers]
        states = states.detach().clone()
        nbytes = states.nbytes + sum(keys.nbytes + values.nbytes for keys, values in layers)
        if nbytes > self.max_bytes:
            return
        full = (id(model), *key)
        with self._lock:
            if any(k[0] == id(model) and e.version != version for k, e in self._entries.items()):
                self._drop_model(id(model))
                self.invalidations += 1
            old = self._entries.pop(full, None)
            if old is not None:
                self.bytes -= old.nbytes
            self._entries[full] = PrefixEntry(version, layers, states, nbytes)
            self.bytes += nbytes
            self._evict()
            if id(model) not in self._tracked:
                self._tracked.add(id(model))
                weakref.finalize(model, self._forget, id(model))

    def clear(self, model=None) -> None:
        """Drop every entry (of ``model`` only, when given)."""
        with self._lock:
            if model is None:
                self._entries.clear()
                self.bytes = 0
            else:
                self._drop_model(id(model))

    def resize(self, max_bytes: int) -> None:
        """Bound the store at ``max_bytes`` (0 keeps nothing), evicting at once what no longer fits."""
        with self._lock:
            self.max_bytes = int(max_bytes)
            self._evict()

    def stats(self) -> dict[str, int]:
        """Entries, bytes held, the bound, and the lookups' hits and misses, evictions and invalidations."""
        with self._lock:
            return {
                "entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes, "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions, "invalidations": self.invalidations,
            }

    def _evict(self) -> None:
        while self._entries and self.bytes > self.max_bytes:
            _, entry = self._entries.popitem(last=False)
            self.bytes -= entry.nbytes
            self.evictions += 1

    def _drop_model(self, model_id: int) -> None:
        for full in [k for k in self._entries if k[0] == model_id]:
            self.bytes -= self._entries.pop(full).nbytes

    def _forget(self, model_id: int) -> None:
        with self._lock:
            self._drop_model(model_id)
            self._tracked.discard(model_id)


# The process's store: every model's prefixes, one bound.
PREFIX_STORE = PrefixStore()


def splits_single_rows(model) -> bool:
    """Whether a single row's prompt pass may run as prefix then rest: float32 weights, whose kernels give a row's
    tokens the same values (the native step: the same bits) however its pass is cut. bfloat16 and int8 weights
    round activations to bfloat16 and pick kernels by row count (grace_st.runtime.cpu.quantization), so a cut
    would move a single row's embedding by bfloat16 rounding: such a row keeps its whole pass (batches of
    several rows share their prefix, and keep it here, either way)."""
    embedding = model.get_input_embeddings()
    return embedding.weight.dtype == torch.float32 and quantization_scheme(model) is None


def prefix_key(prefix_ids: Tensor, hidden_layer: int, options, native: bool) -> tuple:
    """What besides the model and its weights decides a prefix's bits: its ids, the pooled layer, the decode options
    (kernels), whether the native step computes it, and PyTorch's thread count (its kernels' blocking)."""
    return (tuple(prefix_ids.reshape(-1).tolist()), hidden_layer, options, native, torch.get_num_threads())
