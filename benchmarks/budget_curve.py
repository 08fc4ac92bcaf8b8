"""Test-time scaling: what a token of rationale buys, measured on the development data.

Quality against cost for one GRACE model on ../shared/data (dev/train splits, the fixed samples
of benchmarks/dev_eval.py): STS-B dev and SICK-R trial (Spearman), SciFact (nDCG@10 of the 72
held-back claims against >= 1,000 documents). Points:

  symmetric     every text at rationale budget G, for G in --budgets; greedy, and with seeded
                sampling (temperature --temperature) averaging --samples rationales per text
  asymmetric    SciFact only: queries at budget q (--query-budgets) and documents at budget d
                (--document-budgets), through the model's per-prompt-type budget mapping,
                i.e. exactly what a user sets: {"query": q, "document": d, "default": q}

Each point encodes its texts afresh and records seconds and texts/s in the same run (so the
asymmetric rows' per-document cost can be set beside the prompt-only G = 0 row's). Output: a JSON
file (rewritten after every point: a killed run keeps what it finished), a markdown table and a
PNG (quality vs texts/s, one line per task and decoding mode).

    python benchmarks/budget_curve.py                                  # the trained default
    python benchmarks/budget_curve.py --sts 100 --scifact-corpus 1000 --budgets 0 16 32 --samples 1
    python benchmarks/budget_curve.py --model runs/x/checkpoint-00000100 --out benchmarks/results/curve_x.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dev_eval

RESULTS = Path(__file__).resolve().parent / "results"
TASKS = ("STS-B dev", "SICK-R trial", "SciFact")


def load_tasks(sts: int, queries: int, corpus: int) -> dict:
    data = dev_eval.DATA
    if not data.is_dir():
        sys.exit(f"budget_curve: {data} is missing (set GRACE_ST_DATA)")
    return {
        "STS-B dev": dev_eval.sts_pairs(data / "stsb" / "dev.tsv", sts),
        "SICK-R trial": dev_eval.sts_pairs(data / "sickr" / "trial.tsv", sts),
        "SciFact": dev_eval.scifact(data / "scifact", queries, corpus),
    }


def score(model, tasks: dict, names: tuple[str, ...], batch_size: int) -> tuple[dict, dict]:
    encode = dev_eval.Encoder(model, batch_size)
    scores = {
        name: dev_eval.scifact_score(encode, tasks[name]) if name == "SciFact" else dev_eval.sts_score(encode, tasks[name])
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


def label(point: dict) -> str:
    budget = point["budget"]
    if isinstance(budget, dict):
        return f"queries {budget['query']}, documents {budget['document']}"
    return f"G={budget}, {point['mode']}"


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
                axis.annotate(f"G{r['budget']}", (xi, yi), fontsize=7, textcoords="offset points", xytext=(3, 3))
        asymmetric = [r for r in report["points"] if r["mode"] == "asymmetric" and task in r["scores"]]
        if asymmetric:
            axis.scatter(
                [task_rate(report, r, task) for r in asymmetric],
                [r["scores"][task] for r in asymmetric],
                marker="*",
                s=80,
                label=f"{task}, queries q / documents d",
            )
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
    parser.add_argument("--model", help="GRACE model directory (default: the trained embedded default)")
    parser.add_argument("--budgets", nargs="+", type=int, default=[0, 16, 32, 64, 128, 256])
    parser.add_argument("--samples", nargs="*", type=int, default=[1, 3], help="sampled rationales averaged per text")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--scifact-budgets", nargs="*", type=int, default=None, help="symmetric budgets SciFact is scored at (default: all)"
    )
    parser.add_argument("--query-budgets", nargs="*", type=int, default=[16, 32, 64, 128])
    parser.add_argument("--document-budgets", nargs="*", type=int, default=[0])
    parser.add_argument("--sts", type=int, default=300, help="pairs of STS-B dev and of SICK-R trial")
    parser.add_argument("--scifact-queries", type=int, default=1000, help="held-back claims (there are 72)")
    parser.add_argument("--scifact-corpus", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=str(RESULTS / "budget_curve.json"))
    parser.add_argument("--replot", action="store_true", help="only rewrite the table and PNG from --out")
    args = parser.parse_args()
    out = Path(args.out)
    if args.replot:
        write_outputs(json.loads(out.read_text(encoding="utf-8")), out)
        return
    if args.scifact_corpus < 1000:
        sys.exit("budget_curve: SciFact needs >= 1000 documents (--scifact-corpus)")

    from sentence_transformers import SentenceTransformer

    import grace_st

    path = args.model or grace_st.default_model_path()
    model = SentenceTransformer(str(path), device=args.device, trust_remote_code=True)
    encoder = model[0]
    tasks = load_tasks(args.sts, args.scifact_queries, args.scifact_corpus)
    report = {
        "model": str(path),
        "model_label": args.model or "trained default (embedded)",
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
    for point in points(args):
        apply(encoder, point, args.temperature, args.seed)
        scores, cost = score(model, tasks, point["tasks"], args.batch_size)
        row = {
            "label": label(point),
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
        dev_eval.write_json(report, str(out))
    write_outputs(report, out)


def write_outputs(report: dict, out: Path) -> None:
    print(table(report))
    out.with_suffix(".md").write_text(table(report) + "\n", encoding="utf-8")
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
