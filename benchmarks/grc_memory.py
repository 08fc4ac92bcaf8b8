"""A GRC model's compressed memory (docs/grc.md): how much of a text it can rebuild from its latent keys and values,
and whether it answers a question from them.

Reconstruction: held-back dev texts, each compressed (``grace_st.compress``) and asked the first reconstruction
prompt from that memory alone; chrF (sacrebleu) of the answer against the text, by text length in tokens, beside
the same turn given the plain text (the ceiling: copying) and given nothing (the floor). Texts: STS-B dev sentences
(training reads stsb/train only) and the SciFact abstracts cited by the held-back claims (never a positive in
training; they may have been drawn as negatives).

Question answering: WikiQA questions with their gold answer sentence as the text; chrF of the answer against that
sentence, from the memory, from the plain text and from nothing. WikiQA's pairs are training data (as retrieval pairs
for L_Rep; no answer is ever a generation target), so this is a check of the mechanism, not a held-out QA score.

    python benchmarks/grc_memory.py --model runs/grc/checkpoint-00000200 --out benchmarks/results/grc_memory.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import time

import numpy as np

import grace_st
from grace_st.grc import RECONSTRUCTION_PROMPTS
from grace_st.scoreboard import SIZES, data_dir, scifact, sts_pairs, write_json

BUCKETS = ((0, 16), (17, 32), (33, 64), (65, 128), (129, 10**9))


def chrf(hypothesis: str, reference: str) -> float:
    from sacrebleu.metrics import CHRF

    return CHRF().sentence_score(hypothesis, [reference]).score


def held_back_texts(count: int) -> list[str]:
    short = sts_pairs(data_dir() / "stsb" / "dev.tsv", SIZES["sts"])[0][:count]
    _, corpus, qrels = scifact(data_dir() / "scifact", 0, 0)
    cited = sorted({d for relevant in qrels.values() for d in relevant})[:count]
    return short + [corpus[d] for d in cited]


def wikiqa(count: int) -> list[tuple[str, str]]:
    with gzip.open(data_dir() / "wikiqa" / "train_pairs.jsonl.gz", "rt", encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines]
    return [(row["query"], row["positive"]) for row in rows[-count:]]


def three_ways(model, question: str, text: str, max_new_tokens: int) -> dict[str, str]:
    """The answer from the text's memory, from the plain text, and from nothing."""
    [memory] = grace_st.compress(model, [text])
    return {
        "memory": grace_st.answer(model, question, [memory], max_new_tokens=max_new_tokens),
        "plain text": grace_st.answer(model, question, context=text, max_new_tokens=max_new_tokens),
        "nothing": grace_st.answer(model, question, max_new_tokens=max_new_tokens),
    }


def bucket_of(tokens: int) -> str:
    low, high = next((low, high) for low, high in BUCKETS if low <= tokens <= high)
    return f"{low}-{high}" if high < 10**9 else f">{low - 1}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a GRC model directory (method 'grc')")
    parser.add_argument("--texts", type=int, default=40, help="texts of each source (STS-B dev, SciFact)")
    parser.add_argument("--questions", type=int, default=40, help="WikiQA questions")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--out", default="benchmarks/results/grc_memory.json")
    args = parser.parse_args()
    model = grace_st.load(args.model, device="cpu")
    tokenizer = model[0].tokenizer
    report = {"model": args.model, "num_latent_tokens": model[0].num_latent_tokens, "reconstruction": [], "qa": []}
    started = time.perf_counter()
    for text in held_back_texts(args.texts):
        tokens = len(tokenizer.encode(text, add_special_tokens=False))
        answers = three_ways(model, RECONSTRUCTION_PROMPTS[0], text, min(args.max_new_tokens, tokens + 16))
        report["reconstruction"].append(
            {"tokens": tokens, "bucket": bucket_of(tokens), **{k: chrf(v, text) for k, v in answers.items()}}
        )
    for question, sentence in wikiqa(args.questions):
        answers = three_ways(model, question, sentence, args.max_new_tokens)
        report["qa"].append({"question": question, **{k: chrf(v, sentence) for k, v in answers.items()}})
    report["memory_bytes"] = grace_st.compress(model, ["x"])[0].nbytes
    report["seconds"] = time.perf_counter() - started
    write_json(report, args.out)
    print_tables(report)


def mean_se(values: list[float]) -> str:
    """Mean ± its standard error over the texts (the sample's noise; chrF is 0-100)."""
    se = np.std(values, ddof=1) / np.sqrt(len(values)) if len(values) > 1 else float("nan")
    return f"{np.mean(values):.1f} ± {se:.1f}"


def print_tables(report: dict) -> None:
    ways = ("memory", "plain text", "nothing")
    print(f"memory: {report['memory_bytes']:,} bytes a text (m = {report['num_latent_tokens']})\n")
    print("| text length (tokens) | texts | chrF from memory (± SE) | from plain text | from nothing |")
    print("|---|---|---|---|---|")
    rows = report["reconstruction"]
    for low, high in BUCKETS:
        label = bucket_of(low if low else 1)
        group = [r for r in rows if r["bucket"] == label]
        if group:
            means = " | ".join(mean_se([r[w] for r in group]) for w in ways)
            print(f"| {label} | {len(group)} | {means} |")
    if report["qa"]:
        means = " | ".join(mean_se([r[w] for r in report["qa"]]) for w in ways)
        print("\n| WikiQA questions | chrF from memory | from plain text | from nothing |\n|---|---|---|---|")
        print(f"| {len(report['qa'])} | {means} |")


if __name__ == "__main__":
    main()
