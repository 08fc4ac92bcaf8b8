"""A GRC model's compressed memory (docs/grc.md): how much of a text it can rebuild from its latent keys and values,
and whether it answers a question from them.

Reconstruction: held-back dev texts, each compressed (``grace_st.compress``) and asked the first reconstruction
prompt from that memory alone; chrF (sacrebleu) of the answer against the text, by text length in tokens, beside
the same turn given the plain text (the ceiling: copying) and given nothing (the floor). Texts: STS-B dev sentences
(training reads stsb/train only) and the SciFact abstracts cited by the held-back claims (never a positive in
training; they may have been drawn as negatives).

Teacher-forced reconstruction (cheap, and it sees what greedy answers hide): Eq. 3's L_Recons of each held-back
text in nats a token, the training pass and loss (:func:`grace_st.methods.grc.latent_pass`,
:func:`grace_training.algorithms.grc.loss.token_loss`), reading the latents after the text itself against the latents after
another text of the same source. The gap is what the memory holds of its own text. Several memories: the same
texts rebuilt through ``answer``'s own reading (:func:`grace_st.methods.grc.turn_logits`) from their memory, another's, and
both at once; what the second costs is how well one memory among several is still found.

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
import torch

import grace_st
from grace_st.methods.grc import RECONSTRUCTION_PROMPTS, latent_pass, turn_logits
from scoreboard import SIZES, data_dir, scifact, sts_pairs, write_json
from grace_training.algorithms.grc.loss import reconstruction_turns, token_loss

BUCKETS = ((0, 16), (17, 32), (33, 64), (65, 128), (129, 10**9))
RECONSTRUCTION_TOKENS = 128  # ❸ rebuilds a text's first 128 tokens, as training's max_reconstruction_tokens


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
    return [(row["query"], row["positive"]) for row in rows[len(rows) - count :]]  # the last ``count`` (0: none)


def three_ways(model, question: str, text: str, max_new_tokens: int) -> dict[str, str]:
    """The answer from the text's memory, from the plain text, and from nothing."""
    [memory] = grace_st.compress(model, [text])
    return {
        "memory": grace_st.answer(model, question, [memory], max_new_tokens=max_new_tokens),
        "plain text": grace_st.answer(model, question, context=text, max_new_tokens=max_new_tokens),
        "nothing": grace_st.answer(model, question, max_new_tokens=max_new_tokens),
    }


@torch.no_grad()
def reconstruction_losses(
    model, texts: list[str], read_from: list[int], max_tokens: int = RECONSTRUCTION_TOKENS
) -> list[float]:
    """L_Recons (Eq. 3) of each text, nats a token, teacher-forced: ❸ rebuilding ``texts[i]`` while it reads the
    latents after ``texts[read_from[i]]`` (compressed as documents, as :func:`grace_st.compress` does)."""
    encoder = model[0]
    rows, span = encoder.prompt_token_ids(texts, task="document")
    responses = encoder.engine.responses(rows, span, encoder.rationale_budget("document"))
    prefixes = [[*row, *response] for row, response in zip(rows, responses)]
    turns, starts = reconstruction_turns(encoder, texts, 0, max_tokens)
    head = encoder.model.get_output_embeddings()
    losses = []
    for i, source in enumerate(read_from):  # one text a pass: token_loss is a mean over its rows
        out = latent_pass(encoder.engine.view, encoder.latent_tokens, [prefixes[source]], [turns[i]])
        losses.append(token_loss(head, out.suffix_states, [turns[i]], [(starts[i], len(turns[i]))]).item())
    return losses


def bucket_of(tokens: int) -> str:
    low, high = next((low, high) for low, high in BUCKETS if low <= tokens <= high)
    return f"{low}-{high}" if high < 10**9 else f">{low - 1}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a GRC model directory (method 'grc')")
    parser.add_argument("--texts", type=int, default=40, help="texts of each source (STS-B dev, SciFact)")
    parser.add_argument("--questions", type=int, default=40, help="WikiQA questions")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--no-generation", action="store_true", help="the teacher-forced losses only")
    parser.add_argument("--out", default="benchmarks/results/grc_memory.json")
    args = parser.parse_args()
    model = grace_st.load(args.model, device="cpu")
    report = {"model": args.model, "num_latent_tokens": model[0].num_latent_tokens, "reconstruction": [], "qa": []}
    started = time.perf_counter()
    texts = held_back_texts(args.texts)
    lengths = token_counts(model, texts)
    report["teacher_forced"] = teacher_forced(model, texts, args.texts, lengths)
    report["several_memories"] = several_memories(model, texts, args.texts, lengths)
    for text, tokens in [] if args.no_generation else zip(texts, lengths):
        answers = three_ways(model, RECONSTRUCTION_PROMPTS[0], text, min(args.max_new_tokens, tokens + 16))
        report["reconstruction"].append(
            {"tokens": tokens, "bucket": bucket_of(tokens), **{k: chrf(v, text) for k, v in answers.items()}}
        )
    for question, sentence in wikiqa(0 if args.no_generation else args.questions):
        answers = three_ways(model, question, sentence, args.max_new_tokens)
        report["qa"].append({"question": question, **{k: chrf(v, sentence) for k, v in answers.items()}})
    report["memory_bytes"] = grace_st.compress(model, ["x"])[0].nbytes
    report["seconds"] = time.perf_counter() - started
    write_json(report, args.out)
    print_tables(report)


def other_of_same_source(texts: list[str], per_source: int) -> list[int]:
    """For each text, the next text of its source (STS-B sentences first, then SciFact abstracts), cyclically."""
    groups = ((0, len(texts[:per_source])), (per_source, len(texts[per_source:])))
    return [offset + (i + 1) % size for offset, size in groups for i in range(size)]


def teacher_forced(model, texts: list[str], per_source: int, lengths: list[int]) -> list[dict]:
    """Each text's L_Recons from its own memory and from the next text's of the same source (STS-B, SciFact);
    ``lengths``: the texts' token counts (:func:`token_counts`)."""
    own = reconstruction_losses(model, texts, list(range(len(texts))))
    others = reconstruction_losses(model, texts, other_of_same_source(texts, per_source))
    return [
        {"tokens": n, "bucket": bucket_of(n), "own": a, "other": b}
        for n, a, b in zip(lengths, own, others)
    ]


def token_counts(model, texts: list[str]) -> list[int]:
    tokenizer = model[0].tokenizer
    return [len(tokenizer.encode(text, add_special_tokens=False)) for text in texts]


@torch.no_grad()
def several_memories(model, texts: list[str], per_source: int, lengths: list[int]) -> list[dict]:
    """Each text rebuilt (teacher-forced, nats a token) through ``answer``'s reading of memories
    (:func:`grace_st.methods.grc.turn_logits`): from its own memory, from another text's, and from both at once (the order
    does not matter: each memory keeps its positions). What the second memory costs is ``both - own``."""
    encoder = model[0]
    memories = grace_st.compress(model, texts)
    turns, starts = reconstruction_turns(encoder, texts, 0, RECONSTRUCTION_TOKENS)

    def loss(i: int, read: list[int]) -> float:
        logits = turn_logits(encoder.model, turns[i], [memories[j] for j in read])
        targets = torch.tensor(turns[i][starts[i] :], device=logits.device)
        return torch.nn.functional.cross_entropy(logits[starts[i] - 1 : -1].float(), targets).item()

    return [
        {"tokens": n, "bucket": bucket_of(n), "own": loss(i, [i]), "other": loss(i, [j]), "both": loss(i, [i, j])}
        for i, (j, n) in enumerate(zip(other_of_same_source(texts, per_source), lengths))
    ]


def mean_se(values: list[float], digits: int = 1) -> str:
    """Mean ± its standard error over the texts (the sample's noise; chrF is 0-100, losses in nats)."""
    se = np.std(values, ddof=1) / np.sqrt(len(values)) if len(values) > 1 else float("nan")
    return f"{np.mean(values):.{digits}f} ± {se:.{digits}f}"


def by_bucket(rows: list[dict]):
    """(length bucket, its rows) in the order of :data:`BUCKETS`, the empty ones left out."""
    for low, _ in BUCKETS:
        label = bucket_of(low if low else 1)
        group = [r for r in rows if r["bucket"] == label]
        if group:
            yield label, group


def print_tables(report: dict) -> None:
    ways = ("memory", "plain text", "nothing")
    print(f"memory: {report['memory_bytes']:,} bytes a text (m = {report['num_latent_tokens']})\n")
    print("| text length (tokens) | texts | L_Recons from its own memory (nats/token ± SE) | from another text's "
          "| gap (paired ± SE) |\n|---|---|---|---|---|")
    for label, group in by_bucket(report["teacher_forced"]):
        own, other = mean_se([r["own"] for r in group], 3), mean_se([r["other"] for r in group], 3)
        print(f"| {label} | {len(group)} | {own} | {other} | {mean_se([r['other'] - r['own'] for r in group], 3)} |")
    if report.get("several_memories"):
        print("\n| text length (tokens) | texts | L_Recons read from its own memory | another's | both at once "
              "| both − own (paired ± SE) |\n|---|---|---|---|---|---|")
        for label, group in by_bucket(report["several_memories"]):
            own, other, both = (mean_se([r[way] for r in group], 3) for way in ("own", "other", "both"))
            cost = mean_se([r["both"] - r["own"] for r in group], 3)
            print(f"| {label} | {len(group)} | {own} | {other} | {both} | {cost} |")
    if report["reconstruction"]:
        print("\n| text length (tokens) | texts | chrF from memory (± SE) | from plain text | from nothing |")
        print("|---|---|---|---|---|")
        for label, group in by_bucket(report["reconstruction"]):
            means = " | ".join(mean_se([r[w] for r in group]) for w in ways)
            print(f"| {label} | {len(group)} | {means} |")
    if report["qa"]:
        means = " | ".join(mean_se([r[w] for r in report["qa"]]) for w in ways)
        print("\n| WikiQA questions | chrF from memory | from plain text | from nothing |\n|---|---|---|---|")
        print(f"| {len(report['qa'])} | {means} |")


if __name__ == "__main__":
    main()
