"""Test-time scaling study: symmetric budgets, seeded sampling and GIRCSE K curves on part of the dev data.

The study script behind lab/budget_curve_first_default.md and lab/gircse_study.md; the product's budget curve
(every scoreboard task, by prompt type) is benchmarks/budget_curve.py.

Quality against cost for one GRACE model on ../shared/data (dev/train splits, the fixed samples
of benchmarks/scoreboard.py): STS-B dev and SICK-R trial (Spearman), SciFact (nDCG@10 of the 72
held-back claims against >= 1,000 documents). Points:

  symmetric     every text at rationale budget G, for G in --budgets; greedy, and with seeded
                sampling (temperature --temperature) averaging --samples rationales per text
  asymmetric    SciFact only: queries at budget q (--query-budgets) and documents at budget d
                (--document-budgets), through the model's per-prompt-type budget mapping,
                i.e. exactly what a user sets: {"query": q, "document": d, "default": q}

Each point encodes its texts afresh and records seconds and texts/s in the same run (so the
asymmetric rows' per-document cost can be set beside the prompt-only G = 0 row's).

  --scifact-grid  SciFact only, every side encoded once: the corpus once per document setting,
                the claims once per query setting, and every (query, document) pair scored from
                those. The symmetric points are the grid's diagonal, the asymmetric grid the rest
                (query budgets x document budgets, greedy; and sampled claims against greedy
                documents). A document's embedding depends only on its own budget, so this is the
                same numbers as encoding each pair afresh, at a sixth of the cost on 1,000 documents.

Output: a JSON
file (rewritten after every point: a killed run keeps what it finished), a markdown table and a
PNG (quality vs texts/s, one line per task and decoding mode).

    python lab/scripts/budget_curve_sampled.py                                  # the trained default
    python lab/scripts/budget_curve_sampled.py --sts 100 --scifact-corpus 1000 --budgets 0 16 32 --samples 1
    python lab/scripts/budget_curve_sampled.py --model runs/x/checkpoint-00000100 --out lab/results/curve_x.json
    python lab/scripts/budget_curve_sampled.py --scifact-grid --samples 1 3 --out lab/results/budget_curve_scifact.json

GIRCSE (gircse.md): --method gircse reads each budget as K soft tokens (greedy only: nothing is sampled),
the test-time-scaling curve of a soft-token model beside GRACE's:

    python lab/scripts/budget_curve_sampled.py --model runs/gircse/checkpoint-00000200 --method gircse \
        --budgets 1 3 5 10 20 40 --samples --out lab/results/gircse_curve.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from grace_st import scoreboard

RESULTS = Path(__file__).resolve().parents[1] / "results"
TASKS = ("STS-B dev", "SICK-R trial", "SciFact")


def load_tasks(sts: int, queries: int, corpus: int) -> dict:
    data = scoreboard.data_dir()
    if not data.is_dir():
        sys.exit(f"budget_curve: {data} is missing (set GRACE_ST_DATA)")
    return {
        "STS-B dev": scoreboard.sts_pairs(data / "stsb" / "dev.tsv", sts),
        "SICK-R trial": scoreboard.sts_pairs(data / "sickr" / "trial.tsv", sts),
        "SciFact": scoreboard.scifact(data / "scifact", queries, corpus),
    }


def score(model, tasks: dict, names: tuple[str, ...], batch_size: int) -> tuple[dict, dict]:
    encode = scoreboard.Encoder(model, batch_size)
    scores = {
        name: scoreboard.scifact_score(encode, tasks[name])
        if name == "SciFact"
        else scoreboard.sts_score(encode, tasks[name])
        for name in names
    }
    per_kind = {kind: encode.seconds_by_kind[kind] / encode.texts_by_kind[kind] for kind in encode.texts_by_kind}
    cost = {"seconds": encode.seconds, "texts": encode.texts, "texts_per_s": encode.texts / encode.seconds}
    return scores, {**cost, "seconds_per_text": per_kind}


def points(args) -> list[dict]:
    """The grid, cheapest first (a killed run keeps the cheap end of every curve)."""
    grid = []
    for budget in sorted(args.budgets):
        # SciFact's 1,000 documents dominate the cost: --scifact-budgets can keep it to a few budgets
        tasks = TASKS if args.scifact_budgets is None or budget in args.scifact_budgets else TASKS[:2]
        grid.append({"mode": "greedy", "budget": budget, "samples": 1, "tasks": tasks})
        if budget > 0:
            for samples in args.samples:
                grid.append({"mode": f"sampled x{samples}", "budget": budget, "samples": samples, "tasks": tasks})
    for document in sorted(args.document_budgets):
        for query in sorted(args.query_budgets):
            if query != document:
                grid.append(
                    {
                        "mode": "asymmetric",
                        "budget": {"query": query, "document": document, "default": query},
                        "samples": 1,
                        "tasks": ("SciFact",),
                    }
                )
    return grid


def apply(encoder, point: dict, temperature: float, seed: int) -> None:
    sampled = point["mode"].startswith("sampled")
    encoder.do_sample, encoder.temperature, encoder.seed = sampled, temperature, seed
    encoder.num_rationales = point["samples"]
    encoder.max_rationale_tokens = point["budget"]
    encoder.check_settings()


def label(point: dict, method: str = "grace") -> str:
    budget = point["budget"]
    if isinstance(budget, dict):
        return f"queries {budget['query']}, documents {budget['document']}"
    return f"{'K' if method == 'gircse' else 'G'}={budget}, {point['mode']}"


def task_rate(report: dict, row: dict, task: str) -> float | None:
    """Texts/s of one task's texts at this point: STS sentences, or SciFact's claims + documents."""
    per = row["cost"]["seconds_per_text"]
    if task != "SciFact":
        return 1.0 / per["default"] if "default" in per else None
    if "query" not in per or "document" not in per:
        return None
    queries, documents = report["sizes"]["scifact_queries"], report["sizes"]["scifact_corpus"]
    return (queries + documents) / (queries * per["query"] + documents * per["document"])


def table(report: dict) -> str:
    lines = [
        "| point | STS-B dev | SICK-R trial | SciFact nDCG@10 | STS texts/s | SciFact texts/s | s per query | s per document |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report["points"]:
        cells = [f"{row['scores'][t]:.4f}" if t in row["scores"] else "" for t in TASKS]
        rates = [task_rate(report, row, task) for task in ("STS-B dev", "SciFact")]
        cells += [f"{rate:.2f}" if rate else "" for rate in rates]
        per = row["cost"]["seconds_per_text"]
        cells += [f"{per[kind]:.3f}" if kind in per else "" for kind in ("query", "document")]
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5))
    for task, marker in zip(TASKS, "osD"):
        for mode in dict.fromkeys(row["mode"] for row in report["points"]):
            rows = [r for r in report["points"] if r["mode"] == mode and task in r["scores"]]
            if mode == "asymmetric" or not rows:
                continue
            x = [task_rate(report, r, task) for r in rows]
            y = [r["scores"][task] for r in rows]
            axis.plot(x, y, marker=marker, label=f"{task}, {mode}")
            for r, xi, yi in zip(rows, x, y):
                axis.annotate(f"{'K' if report.get('method') == 'gircse' else 'G'}{r['budget']}", (xi, yi), fontsize=7, textcoords="offset points", xytext=(3, 3))
        # the asymmetric points with documents embedded prompt-only (the grid's other cells are in its table)
        asymmetric = [
            r
            for r in report["points"]
            if r["mode"] == "asymmetric" and task in r["scores"] and r["budget"]["document"] == 0
        ]
        if asymmetric:
            x = [task_rate(report, r, task) for r in asymmetric]
            y = [r["scores"][task] for r in asymmetric]
            # documents dominate the cost, so these sit at one x: which query budget is which is in the table
            axis.scatter(x, y, marker="*", s=80, label=f"{task}, queries at any budget / documents 0")
    axis.set_xscale("log")
    axis.set_xlabel("texts per second of that task's texts (log; this machine, same run)")
    axis.set_ylabel("score (Spearman / nDCG@10)")
    axis.set_title(report["model_label"])
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="GRACE model directory (default: the trained embedded default; base: the untrained base)")
    parser.add_argument("--method", choices=("grace", "gircse"), help="how the model thinks (default: its saved method)")
    parser.add_argument("--budgets", nargs="+", type=int, default=[0, 16, 32, 64, 128, 256])
    parser.add_argument("--samples", nargs="*", type=int, default=[1, 3], help="sampled rationales averaged per text")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--scifact-budgets",
        nargs="*",
        type=int,
        default=None,
        help="symmetric budgets SciFact is scored at (default: all)",
    )
    parser.add_argument("--query-budgets", nargs="*", type=int, default=[16, 32, 64, 128])
    parser.add_argument("--document-budgets", nargs="*", type=int, default=[0])
    parser.add_argument("--sts", type=int, default=300, help="pairs of STS-B dev and of SICK-R trial")
    parser.add_argument("--scifact-queries", type=int, default=1000, help="held-back claims (there are 72)")
    parser.add_argument("--scifact-corpus", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=str(RESULTS / "budget_curve.json"))
    parser.add_argument("--scifact-grid", action="store_true", help="SciFact only, each side encoded once a setting")
    parser.add_argument("--sampled-budgets", nargs="*", type=int, default=[32], help="--scifact-grid's sampled budgets")
    parser.add_argument(
        "--combine", nargs="+", metavar="JSON", help="only write --out (JSON, table, PNG) from these reports' points"
    )
    parser.add_argument("--replot", action="store_true", help="only rewrite the table and PNG from --out")
    args = parser.parse_args()
    out = Path(args.out)
    if args.combine:
        report = combine([json.loads(Path(f).read_text(encoding="utf-8")) for f in args.combine])
        scoreboard.write_json(report, str(out))
        write_outputs(report, out)
        return
    if args.replot:
        write_outputs(json.loads(out.read_text(encoding="utf-8")), out)
        return
    if args.scifact_corpus < 1000:
        sys.exit("budget_curve: SciFact needs >= 1000 documents (--scifact-corpus)")


    import grace_st

    path = grace_st.default_model_path(trained=False) if args.model == "base" else args.model or grace_st.default_model_path()
    model = grace_st.load(str(path), device=args.device)
    encoder = model[0]
    if args.method:
        encoder.method = args.method
    tasks = load_tasks(args.sts, args.scifact_queries, args.scifact_corpus)
    report = {
        "model": str(path),
        "model_label": (args.model or "trained default (embedded)") + (f" ({args.method})" if args.method else ""),
        "method": encoder.method,
        "device": str(model.device),
        "sizes": {
            "sts_pairs": args.sts,
            "scifact_queries": len(tasks["SciFact"][0]),
            "scifact_corpus": args.scifact_corpus,
        },
        "batch_size": args.batch_size,
        "temperature": args.temperature,
        "seed": args.seed,
        "command": " ".join(sys.argv),
        "points": [],
    }
    if args.scifact_grid:
        report["documents"] = {}
        scifact_grid(model, tasks["SciFact"], args, report, out)
        write_outputs(report, out)
        return
    for point in points(args):
        apply(encoder, point, args.temperature, args.seed)
        scores, cost = score(model, tasks, point["tasks"], args.batch_size)
        row = {
            "label": label(point, encoder.method),
            "mode": point["mode"],
            "budget": point["budget"],
            "samples": point["samples"],
            "scores": scores,
            "cost": cost,
        }
        report["points"].append(row)
        print(
            f"{row['label']}: "
            + ", ".join(f"{k} {v:.4f}" for k, v in scores.items())
            + f"; {cost['texts_per_s']:.2f} texts/s",
            flush=True,
        )
        scoreboard.write_json(report, str(out))
    write_outputs(report, out)


def sides(args) -> list[dict]:
    """The settings one side of SciFact (claims or documents) is encoded at: greedy at every budget,
    cheapest first, then seeded sampling at --sampled-budgets."""
    greedy = [{"mode": "greedy", "budget": b, "samples": 1} for b in sorted(args.budgets)]
    sampled = [
        {"mode": f"sampled x{n}", "budget": b, "samples": n}
        for b in sorted(args.sampled_budgets)
        if b > 0
        for n in args.samples
    ]
    return greedy + sampled


def side_label(side: dict) -> str:
    return f"{side['budget']}" + ("" if side["mode"] == "greedy" else f" {side['mode']}")


def encode_side(model, side: dict, texts: list[str], kind: str, args) -> tuple[np.ndarray, float]:
    """One side of SciFact at one setting: the embeddings and the seconds per text, this run."""
    apply(model[0], side, args.temperature, args.seed)
    encode = scoreboard.Encoder(model, args.batch_size)
    embeddings = encode(texts, kind)
    return embeddings, encode.seconds / len(texts)


def grid_row(query: dict, document: dict, score: float, per: dict, report: dict) -> dict:
    """One (query setting, document setting) pair in the report's point shape."""
    symmetric = query == document
    sizes = report["sizes"]
    seconds = sizes["scifact_queries"] * per["query"] + sizes["scifact_corpus"] * per["document"]
    texts = sizes["scifact_queries"] + sizes["scifact_corpus"]
    return {
        "label": label(query) if symmetric else f"queries {side_label(query)}, documents {side_label(document)}",
        "mode": query["mode"] if symmetric else "asymmetric",
        "budget": query["budget"]
        if symmetric
        else {"query": query["budget"], "document": document["budget"], "default": query["budget"]},
        "query": query,
        "document": document,
        "samples": query["samples"],
        "scores": {"SciFact": score},
        "cost": {"seconds": seconds, "texts": texts, "texts_per_s": texts / seconds, "seconds_per_text": per},
    }


def scifact_grid(model, task, args, report: dict, out: Path) -> None:
    """SciFact over (query setting) x (document setting), each side encoded once (see --scifact-grid).

    Claims first (72 texts a setting, cheap), then the corpus one setting at a time; after each
    corpus pass every pair it completes is scored and the JSON rewritten, so a killed run keeps
    every finished document budget. Pairs scored: the diagonal (the symmetric points), every
    greedy query budget against every greedy document budget, and each sampled query setting
    against greedy documents.
    """
    queries, corpus, qrels = task
    query_ids, doc_ids = list(queries), list(corpus)
    relevant = [qrels[q] for q in query_ids]
    claim_texts, documents = [queries[q] for q in query_ids], [corpus[d] for d in doc_ids]
    settings = sides(args)
    # the first encode of a process pays one-off costs (kernels, allocator); keep them out of the timings
    encode_side(model, settings[0], documents[: args.batch_size], "document", args)
    claims = {}
    for side in settings:
        claims[side_label(side)] = encode_side(model, side, claim_texts, "query", args)
        print(f"claims at {side_label(side)}: {claims[side_label(side)][1]:.3f} s each", flush=True)
    for document in settings:
        doc_embeddings, per_document = encode_side(model, document, documents, "document", args)
        report["documents"][side_label(document)] = per_document
        pairs = [q for q in settings if q == document or document["mode"] == "greedy"]
        for query in pairs:
            query_embeddings, per_query = claims[side_label(query)]
            similarity = query_embeddings @ doc_embeddings.T
            # each claim's own nDCG@10 too: two cells' difference can then be tested claim by claim (paired)
            by_claim = [
                scoreboard.ndcg_at_10(similarity[i : i + 1], doc_ids, relevant[i : i + 1]) for i in range(len(relevant))
            ]
            per = {"query": per_query, "document": per_document}
            row = grid_row(query, document, float(np.mean(by_claim)), per, report)
            report["points"].append({**row, "per_claim": by_claim})
        print(f"documents at {side_label(document)}: {per_document:.3f} s each", flush=True)
        scoreboard.write_json(report, str(out))


def grid_table(report: dict) -> str:
    """nDCG@10 with claims at each query setting (rows) against documents at each greedy budget."""
    rows = {}
    for point in report["points"]:
        query, document = point.get("query"), point.get("document")
        if query is None or document["mode"] != "greedy":
            continue
        rows.setdefault(side_label(query), {})[document["budget"]] = point["scores"]["SciFact"]
    documents = sorted({b for cells in rows.values() for b in cells})
    lines = [
        "| claims at \\ documents at | " + " | ".join(f"G={b}" for b in documents) + " |",
        "|---|" + "---|" * len(documents),
        "| s per document | " + " | ".join(f"{report['documents'][str(b)]:.3f}" for b in documents) + " |",
    ]
    for query, cells in rows.items():
        lines.append(f"| {query} | " + " | ".join(f"{cells[b]:.4f}" if b in cells else "" for b in documents) + " |")
    return "\n".join(lines)


def combine(reports: list[dict]) -> dict:
    """One report of several runs' points, in order (say, the STS curve of one run and the SciFact grid
    of another). Each point keeps the cost measured in its own run, so read speeds as ratios within
    one line of the plot, not across lines."""
    sizes = {}
    for report in reports:
        sizes.update(report["sizes"])
    combined = {**reports[0], "sizes": sizes, "points": [p for r in reports for p in r["points"]]}
    combined["combined_from"] = [r.get("command", "") for r in reports]
    documents = {k: v for r in reports for k, v in r.get("documents", {}).items()}
    if documents:
        combined["documents"] = documents
    return combined


def write_outputs(report: dict, out: Path) -> None:
    text = table(report) + ("\n\n" + grid_table(report) if "documents" in report else "")
    print(text)
    out.with_suffix(".md").write_text(text + "\n", encoding="utf-8")
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
