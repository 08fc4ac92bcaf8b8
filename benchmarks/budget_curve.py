"""The price of thinking: dev-scoreboard quality, texts/s and one-query latency of a model that thinks in text
(GRACE, or GRC, whose latents follow its text response) by rationale budget, per prompt type.

A GRACE model's budget is set per prompt type, ``max_rationale_tokens = {"default": G, "query": Q, "document": D}``,
and each type embeds its own texts on the scoreboard (scoreboard, the same fixed samples and sizes as
benchmarks/dev_eval.py):

  default    ``encode``: STS-B dev and SICK-R trial (Spearman), Banking77 (kNN accuracy), MRPC val (AP)
  query      ``encode_query``: the 72 held-back SciFact claims
  document   ``encode_document``: SciFact's corpus of 1,000 abstracts

A text's embedding depends only on its own budget, so each side is encoded once per budget (--budgets for
default texts and queries, --query-budgets for queries apart, --document-budgets for documents) and every
(query, document) pair of budgets is scored from those embeddings. Texts/s are measured per side in the same run; the one-query latency column
is ``encode_query`` of one claim at a time (--latency-queries of them, after a warm-up call), p50 and p95.

Noise: each score's standard error by bootstrap over its items (pairs, test texts, claims; --resamples,
fixed seed). The comparison between two budgets is paired: the same resampled items score both, and
``Δ`` is the difference of the resampled scores (its 95 % interval is ±1.96 standard errors).

The choice rule, per prompt type: the cheapest budget whose score is within noise of the best budget's,
i.e. best − candidate ≤ 1.96 × the paired standard error of their difference. The default type is scored
by the mean of its four tasks; documents by SciFact with queries at each document budget's best query
budget; queries by SciFact with documents at the chosen document budget.

    python benchmarks/budget_curve.py                                   # the shipped default
    python benchmarks/budget_curve.py --budgets 0 32 --document-budgets 0 --latency-queries 0
    python benchmarks/budget_curve.py --model runs/x/checkpoint-00000100 --out benchmarks/results/budget_curve_x.json

Output: the JSON (--out, rewritten after every side encoded, so a killed run keeps what it finished) and the
tables, printed and written beside it as markdown.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import scoreboard

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_TASKS = ("STS-B dev", "SICK-R trial", "Banking77", "MRPC val")


def default_texts(tasks: dict) -> tuple[list[str], dict[str, slice]]:
    """Every text the default prompt type embeds on the scoreboard, and each task's part of them."""
    parts = {
        "STS-B dev": tasks["STS-B dev"][0] + tasks["STS-B dev"][1],
        "SICK-R trial": tasks["SICK-R trial"][0] + tasks["SICK-R trial"][1],
        "Banking77": tasks["Banking77"][0] + tasks["Banking77"][2],
        "MRPC val": tasks["MRPC val"][0] + tasks["MRPC val"][1],
    }
    texts, where = [], {}
    for name, part in parts.items():
        where[name] = slice(len(texts), len(texts) + len(part))
        texts += part
    return texts, where


class Scorer:
    """Each task's score from embeddings, and its bootstrap resamples over the task's items (the same
    resampled items for every budget, so two budgets' resamples pair up)."""

    def __init__(self, tasks: dict, resamples: int, seed: int = 0):
        self.tasks = tasks
        rng = np.random.default_rng(seed)
        sizes = {
            "STS-B dev": len(tasks["STS-B dev"][2]),
            "SICK-R trial": len(tasks["SICK-R trial"][2]),
            "Banking77": len(tasks["Banking77"][3]),
            "MRPC val": len(tasks["MRPC val"][2]),
            "SciFact": len(tasks["SciFact"][0]),
        }
        self.indices = {name: rng.integers(0, n, size=(resamples, n)) for name, n in sizes.items()}

    def default_side(self, embeddings: np.ndarray, where: dict[str, slice]) -> dict[str, tuple[float, np.ndarray]]:
        """(score, resampled scores) of each default-type task from that side's embeddings."""
        out = {}
        for name in ("STS-B dev", "SICK-R trial", "MRPC val"):
            part = embeddings[where[name]]
            half = len(part) // 2
            cosine = np.sum(part[:half] * part[half:], axis=1)
            gold = self.tasks[name][2]
            metric = scoreboard.average_precision if name == "MRPC val" else scoreboard.spearman
            out[name] = (metric(cosine, gold), np.array([metric(cosine[i], gold[i]) for i in self.indices[name]]))
        train_texts, train_labels, _, test_labels = self.tasks["Banking77"]
        part = embeddings[where["Banking77"]]
        hits = scoreboard.knn_hits(part[: len(train_texts)], train_labels, part[len(train_texts) :], test_labels)
        out["Banking77"] = (float(hits.mean()), hits[self.indices["Banking77"]].mean(axis=1))
        return out

    def scifact(self, queries: np.ndarray, documents: np.ndarray) -> tuple[float, np.ndarray]:
        claims, corpus, qrels = self.tasks["SciFact"]
        per_query = scoreboard.ndcg_per_query(queries @ documents.T, list(corpus), [qrels[q] for q in claims])
        return float(per_query.mean()), per_query[self.indices["SciFact"]].mean(axis=1)


def encode_side(model, kind: str, texts: list[str], budget: int, batch_size: int) -> tuple[np.ndarray, float]:
    """Embeddings of ``texts`` as prompt type ``kind`` at ``budget`` rationale tokens, and seconds spent."""
    model[0].max_rationale_tokens = budget
    encode = {"query": model.encode_query, "document": model.encode_document}.get(kind, model.encode)
    start = time.perf_counter()
    embeddings = encode(texts, batch_size=batch_size, normalize_embeddings=True, show_progress_bar=True)
    return embeddings, time.perf_counter() - start


def one_query_latency(model, claims: list[str], budget: int) -> dict | None:
    """p50/p95 seconds of ``encode_query`` on one claim at a time (after one warm-up call)."""
    if not claims:
        return None
    model[0].max_rationale_tokens = budget
    model.encode_query(claims[:1])
    seconds = []
    for claim in claims:
        start = time.perf_counter()
        model.encode_query([claim])
        seconds.append(time.perf_counter() - start)
    return {"p50_s": statistics.median(seconds), "p95_s": float(np.percentile(seconds, 95)), "queries": len(seconds)}


def within_noise(candidate: np.ndarray, best: np.ndarray, candidate_score: float, best_score: float) -> dict:
    """The paired comparison of a budget with the best one: Δ, its standard error, and the verdict."""
    error = float(np.std(best - candidate, ddof=1))
    delta = candidate_score - best_score
    return {"delta": delta, "delta_se": error, "within_noise": -delta <= 1.96 * error}


def cheapest_within_noise(points: dict[int, tuple[float, np.ndarray]]) -> tuple[int, dict[int, dict]]:
    """The chosen budget (the cheapest within noise of the best) and every budget's comparison with the best."""
    best = max(points, key=lambda budget: points[budget][0])
    compared = {b: within_noise(points[b][1], points[best][1], points[b][0], points[best][0]) for b in points}
    chosen = min(b for b in points if compared[b]["within_noise"])
    return chosen, {b: {**compared[b], "best": b == best} for b in compared}


def mean_of(scores: dict[str, tuple[float, np.ndarray]], names=DEFAULT_TASKS) -> tuple[float, np.ndarray]:
    return float(np.mean([scores[n][0] for n in names])), np.mean([scores[n][1] for n in names], axis=0)


def choose(report: dict, default: dict, scifact: dict) -> dict:
    """Apply the rule to each prompt type (see the module docstring); ``scifact`` by (query, document) budget."""
    texts, texts_compared = cheapest_within_noise({g: mean_of(default[g]) for g in default})
    document_budgets = sorted({d for _, d in scifact})
    query_budgets = sorted({q for q, _ in scifact})
    best_by_document = {
        d: max((scifact[q, d] for q in query_budgets), key=lambda point: point[0]) for d in document_budgets
    }
    documents, documents_compared = cheapest_within_noise(best_by_document)
    queries, queries_compared = cheapest_within_noise({q: scifact[q, documents] for q in query_budgets})
    return {
        "rule": "the cheapest budget whose score is within noise of the best (best − it ≤ 1.96 paired bootstrap SE)",
        "default": {"budget": texts, "scored_by": "mean of " + ", ".join(DEFAULT_TASKS), "compared": texts_compared},
        "document": {
            "budget": documents,
            "scored_by": "SciFact nDCG@10, queries at the best query budget for each document budget",
            "compared": documents_compared,
        },
        "query": {
            "budget": queries,
            "scored_by": f"SciFact nDCG@10, documents at {documents}",
            "compared": queries_compared,
        },
    }


def tables(report: dict) -> str:
    rows = report["default"]
    lines = [
        (
            "Default prompt type (`encode`): each task's score ± its bootstrap standard error; Δ is the paired difference "
            "of the four tasks' mean with the best budget's (± its standard error)"
        ),
        "",
        "| G | " + " | ".join(DEFAULT_TASKS) + " | mean | Δ mean vs best | texts/s | one query p50 / p95 s |",
        "|---|" + "---|" * (len(DEFAULT_TASKS) + 4),
    ]
    choice = report.get("choice", {})
    for g, row in rows.items():
        cells = [f"{row['scores'][n]:.4f} ± {row['se'][n]:.3f}" for n in DEFAULT_TASKS]
        compared = choice.get("default", {}).get("compared", {}).get(int(g))
        delta = f"{compared['delta']:+.4f} ± {compared['delta_se']:.4f}" if compared else ""
        latency = report["latency"].get(str(g))
        lat = f"{latency['p50_s']:.3f} / {latency['p95_s']:.3f}" if latency else ""
        lines.append(
            f"| {g} | " + " | ".join(cells) + f" | {row['mean']:.4f} | {delta} | {row['texts_per_s']:.1f} | {lat} |"
        )
    lines += [
        "",
        (
            "SciFact nDCG@10 (± bootstrap SE over the 72 claims) by query budget (rows) and document budget (columns); "
            "texts/s of each side"
        ),
        "",
        "| queries \\ documents | " + " | ".join(f"D = {d}" for d in report["documents"])
        + " | query texts/s | one query p50 / p95 s |",
        "|---|" + "---|" * (len(report["documents"]) + 2),
    ]
    for q, query in report["queries"].items():
        cells = [
            f"{report['scifact'][f'{q},{d}']['score']:.4f} ± {report['scifact'][f'{q},{d}']['se']:.3f}"
            if f"{q},{d}" in report["scifact"]
            else ""
            for d in report["documents"]
        ]
        latency = report["latency"].get(q)
        lat = f"{latency['p50_s']:.3f} / {latency['p95_s']:.3f}" if latency else ""
        lines.append(f"| Q = {q} | " + " | ".join(cells) + f" | {query['texts_per_s']:.1f} | {lat} |")
    lines.append(
        "| document texts/s | " + " | ".join(f"{d['texts_per_s']:.1f}" for d in report["documents"].values()) + " | | |"
    )
    if choice:
        lines += ["", f"Chosen ({choice['rule']}):"]
        for kind in ("default", "query", "document"):
            lines.append(f"- {kind}: {choice[kind]['budget']} ({choice[kind]['scored_by']})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", help="a GRACE or GRC model directory (default: the shipped default; base: the untrained base)"
    )
    parser.add_argument("--budgets", nargs="+", type=int, default=[0, 8, 16, 32, 64], help="default texts and queries")
    parser.add_argument(
        "--query-budgets", nargs="+", type=int, help="queries' budgets when not --budgets (a query costs little to score)"
    )
    parser.add_argument("--document-budgets", nargs="+", type=int, default=[0, 32])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--latency-queries", type=int, default=20, help="claims timed one at a time per budget (0: skip)"
    )
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples for the standard errors")
    parser.add_argument("--out", default=str(RESULTS / "budget_curve_default.json"))
    args = parser.parse_args()

    import grace_st

    data = scoreboard.data_dir()
    if not data.is_dir():
        sys.exit(f"budget_curve: {data} is missing (set GRACE_ST_DATA)")
    tasks = scoreboard.load_tasks(scoreboard.SIZES)
    path = args.model or grace_st.default_model_path()
    if path == "base":
        path = grace_st.default_model_path(trained=False)
    model = grace_st.load(path)
    if getattr(model[0], "method", None) not in ("grace", "grc"):
        sys.exit("budget_curve: the model must think in text (method grace or grc; GIRCSE's K: benchmarks/gircse_k_curve.py)")
    saved_budgets = model[0].max_rationale_tokens
    texts, where = default_texts(tasks)
    claims, corpus, _ = tasks["SciFact"]
    scorer = Scorer(tasks, args.resamples)
    report = {
        "model": str(path),
        "saved_budgets": saved_budgets,
        "sizes": scoreboard.SIZES,
        "seed": scoreboard.SEED,
        "texts": {"default": len(texts), "query": len(claims), "document": len(corpus)},
        "resamples": args.resamples,
        "batch_size": args.batch_size,
        "threads": __import__("torch").get_num_threads(),
        "default": {},
        "queries": {},
        "documents": {},
        "scifact": {},
        "latency": {},
    }
    out = Path(args.out)
    default_scores, query_embeddings, document_embeddings = {}, {}, {}
    query_budgets = sorted(args.query_budgets or args.budgets)
    # SciFact's two sides first: its scores are written before the long default side, so a killed run keeps them
    for q in query_budgets:
        query_embeddings[q], seconds = encode_side(model, "query", list(claims.values()), q, args.batch_size)
        report["queries"][str(q)] = {"seconds": seconds, "texts_per_s": len(claims) / seconds}
    for d in sorted(args.document_budgets):
        document_embeddings[d], seconds = encode_side(model, "document", list(corpus.values()), d, args.batch_size)
        report["documents"][str(d)] = {"seconds": seconds, "texts_per_s": len(corpus) / seconds}
        scoreboard.write_json(report, str(out))
    scifact = {
        (q, d): scorer.scifact(query_embeddings[q], document_embeddings[d])
        for q in query_embeddings
        for d in document_embeddings
    }
    for (q, d), (score, resampled) in scifact.items():
        report["scifact"][f"{q},{d}"] = {"score": score, "se": float(np.std(resampled, ddof=1))}
    scoreboard.write_json(report, str(out))
    for g in sorted(args.budgets):
        embeddings, seconds = encode_side(model, "default", texts, g, args.batch_size)
        default_scores[g] = scorer.default_side(embeddings, where)
        mean, _ = mean_of(default_scores[g])
        report["default"][str(g)] = {
            "scores": {n: s for n, (s, _) in default_scores[g].items()},
            "se": {n: float(np.std(r, ddof=1)) for n, (_, r) in default_scores[g].items()},
            "mean": mean,
            "seconds": seconds,
            "texts_per_s": len(texts) / seconds,
        }
        scoreboard.write_json(report, str(out))
        print(f"G = {g}: mean of the default type {mean:.4f}", flush=True)
    for q in query_budgets:
        latency = one_query_latency(model, list(claims.values())[: args.latency_queries], q)
        if latency:
            report["latency"][str(q)] = latency
    report["choice"] = choose(report, default_scores, scifact)
    scoreboard.write_json(report, str(out))
    text = tables(report)
    out.with_suffix(".md").write_text(text + "\n")
    print("\n" + text + f"\n\nwrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
