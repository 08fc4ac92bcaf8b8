"""Development evaluation during training, with the encoder's own ``encode`` path (greedy).

- triplet sources: ``accuracy`` (sim(q, d⁺) > every sim(q, d⁻)), mean ``margin``, and in-set
  retrieval over all the set's positives (``recall@1``, ``mrr``);
- ``sts`` sources: Spearman correlation of cosine similarity with the gold score.

Each text is embedded with the prompt type ``encode`` would give it: scored pairs and
``symmetric`` sources with ``"default"``, retrieval sources' queries and documents with the
query and document types (so each at its budget when budgets differ by type).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from grace_training.data.examples import Triplet


@torch.no_grad()
def encode_texts(st_model, texts: Sequence[str], task: str | None, batch_size: int = 16) -> torch.Tensor:
    """Normalised embeddings through the encoder's ``preprocess`` → ``forward`` (what ``encode`` runs)."""
    encoder = st_model[0]
    device = next(encoder.model.parameters()).device
    out = []
    for start in range(0, len(texts), batch_size):
        features = encoder.preprocess(list(texts[start : start + batch_size]), task=task)
        features = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in features.items()}
        out.append(F.normalize(encoder(features, task=task)["sentence_embedding"].float(), dim=-1).cpu())
    return torch.cat(out) if out else torch.zeros((0, encoder.get_embedding_dimension()))


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation of two score lists, as STS tasks report it (the dev scoreboard's too)."""
    from scipy.stats import spearmanr

    return float(spearmanr(x, y).statistic)


def triplet_scores(query: torch.Tensor, positive: torch.Tensor, negatives: list[torch.Tensor]) -> dict[str, float]:
    aligned = (query * positive).sum(-1)
    margins, wins = [], []
    for i, negs in enumerate(negatives):
        best = (negs @ query[i]).max().item() if len(negs) else -1.0
        margins.append(aligned[i].item() - best)
        wins.append(aligned[i].item() > best)
    ranks = (query @ positive.T > aligned[:, None]).sum(1) + 1  # rank of the own positive among all
    return {
        "accuracy": float(np.mean(wins)),
        "margin": float(np.mean(margins)),
        "recall@1": float((ranks == 1).float().mean()),
        "mrr": float((1.0 / ranks.float()).mean()),
    }


def evaluate(
    st_model, rows: list[Triplet], *, query_task: str | None, document_task: str | None, batch_size: int = 16
) -> dict[str, float]:
    """Scores per source, keyed ``eval/<source>/<metric>``."""
    encoder = st_model[0]
    was_training = encoder.model.training
    encoder.model.eval()
    by_source: dict[str, list[Triplet]] = defaultdict(list)
    for row in rows:
        by_source[row.source].append(row)
    scores: dict[str, float] = {}
    try:
        for source, items in by_source.items():
            if items[0].score is not None:  # scored pairs (STS): symmetric, as encode embeds them
                left = encode_texts(st_model, [r.query for r in items], "default", batch_size)
                right = encode_texts(st_model, [r.positive for r in items], "default", batch_size)
                scores[f"eval/{source}/spearman"] = spearman((left * right).sum(-1).tolist(), [r.score for r in items])
                continue
            tasks = ("default", "default") if items[0].symmetric else (query_task, document_task)
            query = encode_texts(st_model, [r.query for r in items], tasks[0], batch_size)
            positive = encode_texts(st_model, [r.positive for r in items], tasks[1], batch_size)
            flat = [n for r in items for n in r.negatives]
            encoded = encode_texts(st_model, flat, tasks[1], batch_size)
            negatives, start = [], 0
            for r in items:
                negatives.append(encoded[start : start + len(r.negatives)])
                start += len(r.negatives)
            for metric, value in triplet_scores(query, positive, negatives).items():
                scores[f"eval/{source}/{metric}"] = value
    finally:
        encoder.model.train(was_training)
    return scores
