"""The development scoreboard's tasks and metrics, shared by ``benchmarks/dev_eval.py`` (the scoreboard),
``benchmarks/budget_curve.py`` and ``benchmarks/gpu_check.py``.

Every task is a fixed sample of the shared data's dev and train splits (``data_dir()``: ``$GRACE_ST_DATA``, else
``shared/data`` beside the repository), the same every run, and none of its texts is a training instance: STS-B dev
and SICK-R trial (Spearman), the SciFact claims training holds back (nDCG@10 against a corpus of every abstract
they cite plus fixed distractors), Banking77 (kNN accuracy, k = 5, within the 800 texts training leaves out), MRPC
val (average precision), and the model's own perplexity on held-back SICK-R sentences (a trained model must still
generate). What each number means and how large its noise is: ``benchmarks/dev_eval.py``'s docstring.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from pathlib import Path

import numpy as np

from grace_st.data import (
    SCOREBOARD_SEED,
    id_fraction,
    read_beir,
    read_labelled_pairs,
    read_labelled_texts,
    read_scored_pairs,
    scoreboard_sample,
)
from grace_training.evaluation import spearman

SEED = SCOREBOARD_SEED
# The scoreboard's sample sizes: pairs of STS-B dev, SICK-R trial and MRPC val; SciFact's held-back claims (0: all
# 72) and its corpus; Banking77's kNN train and test texts; held-back sentences for the perplexity column.
SIZES = {
    "sts": 300,
    "scifact_queries": 0,
    "scifact_corpus": 1000,
    "banking_train": 500,
    "banking_test": 300,
    "mrpc": 300,
    "perplexity": 200,
}
HELD_BACK = 0.9  # training's SciFact source keeps query_fraction [0.0, 0.9]; the scoreboard the rest


def data_dir() -> Path:
    """$GRACE_ST_DATA (e.g. a copy carried to a GPU machine), else ``shared/data`` beside the repository."""
    return Path(os.environ.get("GRACE_ST_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data"))


def sentences(count: int) -> tuple[list[str], str]:
    """``count`` real sentences for timing (STS-B dev's first sentences), or built-in ones repeated when the
    data folder is absent; and a line saying which."""
    dev = data_dir() / "stsb" / "dev.tsv"
    if dev.is_file():
        pairs = read_scored_pairs(dev)
        return [p.sentence1 for p in pairs][:count], f"STS-B dev sentence1, first {count}"
    repeated = (FALLBACK_SENTENCES * (count // len(FALLBACK_SENTENCES) + 1))[:count]
    return repeated, f"{len(FALLBACK_SENTENCES)} built-in sentences, repeated to {count}"


FALLBACK_SENTENCES = [
    "A man is playing a guitar on stage.",
    "The central bank raised interest rates again this quarter.",
    "Proteins fold into shapes that decide what they do in the cell.",
    "A child is riding a bicycle down a quiet street.",
    "Scientists found water ice in craters near the moon's south pole.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Heavy rain flooded several roads in the city overnight.",
    "The committee approved the new budget after a long debate.",
]


# -- tasks -----------------------------------------------------------------------------------


def sts_pairs(path: Path, count: int) -> tuple[list[str], list[str], np.ndarray]:
    pairs = scoreboard_sample(read_scored_pairs(path), count, path.name)
    return [p.sentence1 for p in pairs], [p.sentence2 for p in pairs], np.array([p.score for p in pairs])


def mrpc_pairs(path: Path, count: int) -> tuple[list[str], list[str], np.ndarray]:
    pairs = scoreboard_sample(read_labelled_pairs(path), count, path.name)
    return [p.sentence1 for p in pairs], [p.sentence2 for p in pairs], np.array([p.label for p in pairs])


def held_back_claims(ids) -> list[str]:
    """The claim ids training never sees: id_fraction(id) >= 0.9, the complement of its [0.0, 0.9)."""
    return sorted(q for q in ids if id_fraction(q) >= HELD_BACK)


def scifact(root: Path, queries: int, corpus: int) -> tuple[dict, dict, dict[str, set[str]]]:
    """Held-back claims (all of them, or a fixed sample of ``queries`` when > 0) and a corpus of
    every abstract they cite plus fixed random distractors, ``corpus`` documents at least."""
    folder = read_beir(root, "train")
    claims = {q: record.text for q, record in folder.queries.items()}
    qrels = {q: {d for d, score in scores.items() if score > 0} for q, scores in folder.qrels.items()}
    documents = {d: f"{record.title}. {record.text}".strip() for d, record in folder.corpus.items()}
    held_back = held_back_claims(q for q in qrels if qrels[q])
    if queries > 0:
        held_back = sorted(scoreboard_sample(held_back, queries, "scifact-queries"))
    relevant = sorted({d for q in held_back for d in qrels[q]})
    others = scoreboard_sample(sorted(set(documents) - set(relevant)), max(0, corpus - len(relevant)), "scifact-corpus")
    return (
        {q: claims[q] for q in held_back},
        {d: documents[d] for d in relevant + others},
        {q: qrels[q] for q in held_back},
    )


def banking77(path: Path, train: int, test: int) -> tuple[list[str], list[str], list[str], list[str]]:
    rows = scoreboard_sample(read_labelled_texts(path), train + test, "banking77")
    return (
        [r.text for r in rows[:train]],
        [r.label for r in rows[:train]],
        [r.text for r in rows[train:]],
        [r.label for r in rows[train:]],
    )


# -- metrics ---------------------------------------------------------------------------------


def ndcg_per_query(scores: np.ndarray, doc_ids: list[str], relevant: list[set[str]]) -> np.ndarray:
    """nDCG@10 of each query (a row of ``scores``) against its relevant documents."""
    values = []
    for row, rel in zip(scores, relevant):
        top = np.argsort(-row, kind="stable")[:10]
        dcg = sum(1.0 / math.log2(rank + 2) for rank, i in enumerate(top) if doc_ids[i] in rel)
        ideal = sum(1.0 / math.log2(rank + 2) for rank in range(min(10, len(rel))))
        values.append(dcg / ideal)
    return np.array(values)


def ndcg_at_10(scores: np.ndarray, doc_ids: list[str], relevant: list[set[str]]) -> float:
    return float(np.sum(ndcg_per_query(scores, doc_ids, relevant)) / len(relevant))


def knn_hits(
    train: np.ndarray, train_labels: list[str], test: np.ndarray, test_labels: list[str], k: int = 5
) -> np.ndarray:
    """Whether each test text's kNN vote (k nearest train texts by cosine) gives its gold label."""
    similarity = test @ train.T
    hits = []
    for row, gold in zip(similarity, test_labels):
        top = np.argsort(-row, kind="stable")[:k]
        votes = Counter(train_labels[i] for i in top)
        best = max(votes.values())
        # ties go to the label of the nearest neighbour among the tied labels
        prediction = next(train_labels[i] for i in top if votes[train_labels[i]] == best)
        hits.append(prediction == gold)
    return np.array(hits, dtype=bool)


def knn_accuracy(
    train: np.ndarray, train_labels: list[str], test: np.ndarray, test_labels: list[str], k: int = 5
) -> float:
    return int(knn_hits(train, train_labels, test, test_labels, k).sum()) / len(test_labels)


def perplexity(model, texts: list[str], batch_size: int) -> float | None:
    """Perplexity of a GRACE model's own causal LM on held-back human text: training must leave a
    model that still generates (method.md §2). None for a model that is not generative."""
    import torch

    from grace_st.runtime.batch import left_pad, position_ids_from_mask

    encoder = model[0]
    if not hasattr(encoder, "tokenizer") or not hasattr(encoder.model, "generate"):
        return None
    total_nll, total_tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            # padded with the encoder's pad id (EOS when the tokenizer has none: GGUF tokenizers may not)
            rows = encoder.tokenizer(texts[start : start + batch_size])["input_ids"]
            input_ids, attention_mask = left_pad(rows, encoder.pad_token_id)
            batch = {
                "input_ids": input_ids.to(encoder.model.device),
                "attention_mask": attention_mask.to(encoder.model.device),
            }
            logits = encoder.model(**batch, position_ids=position_ids_from_mask(batch["attention_mask"]))
            logits = logits.logits[:, :-1].float()
            targets = batch["input_ids"][:, 1:]
            # a target counts when it and the token predicting it are real
            mask = (batch["attention_mask"][:, 1:] * batch["attention_mask"][:, :-1]).bool()
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
            total_nll += float(nll[mask].sum())
            total_tokens += int(mask.sum())
    return math.exp(total_nll / total_tokens)


def average_precision(scores: np.ndarray, labels: np.ndarray) -> float:
    from sklearn.metrics import average_precision_score

    return float(average_precision_score(labels, scores))


# -- scoring ------------------------------------------------------------------------------


METRICS = {
    "STS-B dev": "Spearman",
    "SICK-R trial": "Spearman",
    "SciFact": "nDCG@10",
    "Banking77": "kNN acc",
    "MRPC val": "AP",
}
TASKS = (*METRICS, "perplexity")  # what evaluate can score: the metrics' tasks and the LM check


def load_tasks(sizes: dict, data: Path | None = None) -> dict:
    """Every task's fixed sample, ``sizes`` by :func:`scoreboard` keys (``sts``, ``scifact_queries``, ...)."""
    data = data or data_dir()
    if not data.is_dir():
        raise FileNotFoundError(f"{data} is missing: the scoreboard needs the shared data folder (or $GRACE_ST_DATA)")
    return {
        "STS-B dev": sts_pairs(data / "stsb" / "dev.tsv", sizes["sts"]),
        "SICK-R trial": sts_pairs(data / "sickr" / "trial.tsv", sizes["sts"]),
        "SciFact": scifact(data / "scifact", sizes["scifact_queries"], sizes["scifact_corpus"]),
        "Banking77": banking77(data / "banking77" / "train.csv", sizes["banking_train"], sizes["banking_test"]),
        "MRPC val": mrpc_pairs(data / "mrpc" / "val.tsv", sizes["mrpc"]),
        # held-back text for the generation check: SICK-R trial sentences (no training config uses them)
        "perplexity": sts_pairs(data / "sickr" / "trial.tsv", sizes["perplexity"])[0],
    }


class Encoder:
    """model.encode / encode_query / encode_document, counting the texts and the seconds spent,
    in all and by kind ("default", "query", "document")."""

    def __init__(self, model, batch_size: int):
        self.model, self.batch_size = model, batch_size
        self.texts_by_kind: dict[str, int] = {}
        self.seconds_by_kind: dict[str, float] = {}

    @property
    def texts(self) -> int:
        return sum(self.texts_by_kind.values())

    @property
    def seconds(self) -> float:
        return sum(self.seconds_by_kind.values())

    def __call__(self, texts: list[str], kind: str | None = None) -> np.ndarray:
        kind = kind or "default"
        function = {"query": self.model.encode_query, "document": self.model.encode_document}.get(
            kind, self.model.encode
        )
        start = time.perf_counter()
        embeddings = function(texts, batch_size=self.batch_size, normalize_embeddings=True, show_progress_bar=True)
        self.seconds_by_kind[kind] = self.seconds_by_kind.get(kind, 0.0) + time.perf_counter() - start
        self.texts_by_kind[kind] = self.texts_by_kind.get(kind, 0) + len(texts)
        return embeddings


def sts_score(encode: Encoder, task) -> float:
    """Spearman of the pairs' cosine similarities against the gold scores."""
    first, second, gold = task
    return spearman(np.sum(encode(first) * encode(second), axis=1), gold)


def scifact_score(encode: Encoder, task) -> float:
    """nDCG@10 of the claims (encoded as queries) against the corpus (as documents)."""
    queries, corpus, qrels = task
    query_ids, doc_ids = list(queries), list(corpus)
    similarity = encode([queries[q] for q in query_ids], "query") @ encode([corpus[d] for d in doc_ids], "document").T
    return ndcg_at_10(similarity, doc_ids, [qrels[q] for q in query_ids])


def evaluate(
    model, tasks: dict, batch_size: int, only: tuple[str, ...] | None = None
) -> tuple[dict[str, float], Encoder]:
    """Scores by task name (:data:`TASKS`); ``only`` a subset of them."""
    only = only or TASKS
    encode = Encoder(model, batch_size)
    scores = {name: sts_score(encode, tasks[name]) for name in ("STS-B dev", "SICK-R trial") if name in only}
    if "SciFact" in only:
        scores["SciFact"] = scifact_score(encode, tasks["SciFact"])
    if "Banking77" in only:
        train_texts, train_labels, test_texts, test_labels = tasks["Banking77"]
        scores["Banking77"] = knn_accuracy(encode(train_texts), train_labels, encode(test_texts), test_labels)
    if "MRPC val" in only:
        first, second, labels = tasks["MRPC val"]
        scores["MRPC val"] = average_precision(np.sum(encode(first) * encode(second), axis=1), labels)
    if "perplexity" in only:
        scores["perplexity"] = perplexity(model, tasks["perplexity"], batch_size)
    return scores, encode


def write_json(report: dict, out: str) -> None:
    """Atomic: a reader (or a killed run) sees the previous complete file or the new one."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(report, indent=2))
    os.replace(temporary, path)
