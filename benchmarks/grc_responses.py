"""What a GRC model answers before its latents: the text responses it writes at a budget of 16 tokens for the 72
held-back SciFact claims (queries) and the first 100 STS-B dev sentences (the default prompt type), and how many are
"None" (the document response). A model whose every response is "None" embeds the same at any budget, which is why
the shipped GRC model's budgets are 0.

    GRC=$(python -c 'import grace_st; print(grace_st.default_model_path(method="grc"))')
    python benchmarks/grc_responses.py "GRC default=$GRC" --out benchmarks/results/grc_responses_grc_default.json
"""

from __future__ import annotations

import argparse
import collections

import grace_st
import scoreboard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="GRC model directories, each optionally LABEL=PATH")
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    tasks = scoreboard.load_tasks(scoreboard.SIZES)
    claims = list(tasks["SciFact"][0].values())
    sentences = scoreboard.sts_pairs(scoreboard.data_dir() / "stsb" / "dev.tsv", scoreboard.SIZES["sts"])[0][:100]
    report = {"budget": args.budget, "models": {}}
    for spec in args.models:
        label, _, path = spec.rpartition("=")
        model = grace_st.load(path)
        model[0].max_rationale_tokens = args.budget
        row = {"path": path}
        for name, texts, task in (("claims", claims, "query"), ("sts_sentences", sentences, None)):
            answers = collections.Counter(
                r["rationale"] for r in grace_st.explain(model, texts, task=task, batch_size=32)
            )
            row[name] = {"texts": len(texts), "none": answers["None"], "most_common": answers.most_common(3)}
        report["models"][label or path] = row
        scoreboard.write_json(report, args.out)
        print(
            f"{label or path}: claims answering None {row['claims']['none']}/{len(claims)}, "
            f"STS-B sentences {row['sts_sentences']['none']}/{len(sentences)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
