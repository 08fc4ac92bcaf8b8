"""How a :class:`~grace_st.encoder.GenerativeEncoder` uses the rationale cache (:mod:`grace_st.cache`).

:class:`CacheBinding` holds the cache file's path and a connection per process, makes each
text's :func:`~grace_st.cache.entry_key` at ``preprocess`` time and, at ``forward`` time,
generates only the texts the file lacks and returns every text's entry through the encoder's
one output builder. Set with ``GenerativeEncoder.set_rationale_cache``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .batch import pad_rationales
from .cache import CacheEntry, RationaleCache, entry_key

_opening = threading.Lock()


class CacheBinding:
    """One cache file as an encoder uses it; a corrupt or foreign file is refused on construction."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._open: tuple[int, RationaleCache] | None = None  # (process id, connection)
        self.connection()

    def connection(self) -> RationaleCache:
        # A sqlite connection must not cross a fork or a pickle: each process opens its own. Threads
        # share it (RationaleCache serialises its calls); the lock makes it one connection, not one a thread.
        with _opening:
            if self._open is None or self._open[0] != os.getpid():
                self._open = (os.getpid(), RationaleCache(self.path))
            return self._open[1]

    def close(self) -> None:
        if self._open is not None and self._open[0] == os.getpid():
            self._open[1].close()
        self._open = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": None}

    @staticmethod
    def keys(
        weights: str, instruction: str, texts: Sequence[str], rows: Sequence[Sequence[int]], settings: dict[str, Any]
    ) -> list[str]:
        """Each text's entry key: the weights, the instruction, the text, the prompt's token ids
        (tokenizer, template and truncation included) and every generation setting."""
        return [
            entry_key(weights, instruction, text, {**settings, "prompt_token_ids": row})
            for text, row in zip(texts, rows)
        ]

    def forward(self, encoder, features: dict[str, Tensor]) -> dict[str, Tensor]:
        """``encoder.forward`` through the cache: embed only the texts it lacks, store them, and
        answer every text from its entry (hits carry no per-token states). From several threads at
        once: reads and writes take turns on the one connection, generation does not wait for them;
        two threads missing the same text both generate it (the same entry, stored twice)."""
        cache, keys = self.connection(), features["cache_keys"]
        budget, repeats = encoder.batch_plan(features)
        found = cache.get_many(keys)
        missing = [i for i, key in enumerate(keys) if key not in found or found[key].embedding is None]
        if missing:
            rows = torch.tensor(
                [i * repeats + k for i in missing for k in range(repeats)], device=features["input_ids"].device
            )
            names = ("input_ids", "attention_mask", "instruction_lengths", "rationale_seeds")
            subset = {name: features[name][rows] for name in names if name in features}
            subset.update(rationale_budget=budget, num_rationales=repeats)
            out = encoder.embed(subset)
            fresh = {
                keys[i]: CacheEntry(
                    rationale_ids=[[t for t in row if t >= 0] for row in out["rationale_token_ids"][j].tolist()],
                    truncated=[bool(t) for t in out["rationale_truncated"][j].tolist()],
                    embedding=out["sentence_embedding"][j].float().cpu().numpy(),
                )
                for j, i in enumerate(missing)
            }
            cache.put_many(fresh)
            found.update(fresh)
        entries = [found[key] for key in keys]
        return encoder.outputs(
            features,
            torch.from_numpy(np.stack([entry.embedding for entry in entries])),
            pad_rationales([entry.rationale_ids for entry in entries], repeats),
            torch.tensor([entry.truncated for entry in entries]),
        )
