"""Hard-negative mining for triplets (method.md §2: (q, d⁺, D⁻) with mined D⁻).

BM25 over the source's own pool of texts, sparse and vectorised: SciFact's 5,183 abstracts
against its 809 claims take about a second. ``mine_negatives`` also takes any scoring
function ``(queries, pool) -> (len(queries), len(pool)) scores``, e.g. the current model's cosines.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

_WORD = re.compile(r"\w+", re.UNICODE)


def words(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if len(w) > 1]


class BM25:
    """Okapi BM25 (k1 = 1.5, b = 0.75) as one sparse document-by-term weight matrix."""

    def __init__(self, documents: Sequence[str], k1: float = 1.5, b: float = 0.75) -> None:
        from scipy import sparse

        self.vocabulary: dict[str, int] = {}
        rows, cols, counts = [], [], []
        lengths = np.zeros(len(documents), dtype=np.float64)
        for d, text in enumerate(documents):
            tokens = words(text)
            lengths[d] = len(tokens)
            for term, count in Counter(tokens).items():
                rows.append(d)
                cols.append(self.vocabulary.setdefault(term, len(self.vocabulary)))
                counts.append(count)
        tf = np.asarray(counts, dtype=np.float64)
        rows_a, cols_a = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
        doc_freq = np.bincount(cols_a, minlength=len(self.vocabulary))
        n = max(len(documents), 1)
        idf = np.log(1.0 + (n - doc_freq + 0.5) / (doc_freq + 0.5))
        average = max(lengths.mean() if len(lengths) else 1.0, 1e-9)
        norm = k1 * (1 - b + b * lengths[rows_a] / average)
        weights = idf[cols_a] * tf * (k1 + 1) / (tf + norm)
        self.weights = sparse.csr_matrix((weights, (rows_a, cols_a)), shape=(len(documents), len(self.vocabulary)))

    def scores(self, queries: Sequence[str]) -> np.ndarray:
        """(len(queries), len(documents)) BM25 scores."""
        from scipy import sparse

        rows, cols = [], []
        for q, text in enumerate(queries):
            for term in set(words(text)):
                if term in self.vocabulary:
                    rows.append(q)
                    cols.append(self.vocabulary[term])
        indicator = sparse.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(queries), len(self.vocabulary)))
        return np.asarray((indicator @ self.weights.T).todense())


def mine_negatives(
    queries: Sequence[str],
    pool: Sequence[str],
    exclude: Sequence[set[int]],
    k: int,
    *,
    miner: str | Callable = "bm25",
    seed: int = 0,
    chunk: int = 512,
) -> list[list[int]]:
    """For each query, ``k`` pool indices to use as negatives, never one in ``exclude[i]``.

    ``miner``: "bm25" (highest-scoring non-positive texts: hard negatives), "random", or a
    callable ``scorer(queries, pool) -> (Q, P) array``.
    """
    if k <= 0 or not queries:
        return [[] for _ in queries]
    if miner == "random":
        rng = random.Random(seed)
        out = []
        for banned in exclude:
            choices: list[int] = []
            tries = 0
            while len(choices) < k and tries < 50 * k:
                tries += 1
                index = rng.randrange(len(pool))
                if index not in banned and index not in choices:
                    choices.append(index)
            out.append(choices)
        return out
    if miner == "bm25":
        scorer = BM25(pool).scores
    elif callable(miner):
        scorer = lambda qs: miner(qs, pool)
    else:
        raise ValueError(f"miner must be 'bm25', 'random' or a callable, got {miner!r}")
    out = []
    for start in range(0, len(queries), chunk):
        scores = np.asarray(scorer(list(queries[start : start + chunk])), dtype=np.float64)
        for row, banned in zip(scores, exclude[start : start + chunk]):
            # Look a little past k so excluded positives do not leave a query short.
            width = min(len(pool), k + len(banned) + 1)
            top = np.argpartition(-row, width - 1)[:width] if width < len(pool) else np.arange(len(pool))
            ranked = top[np.argsort(-row[top], kind="stable")]
            picked = [int(i) for i in ranked if int(i) not in banned][:k]
            out.append(picked)
    return out
