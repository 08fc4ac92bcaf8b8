"""What a text costs each shipped model: the GRACE default (``default_model_path()``, at its saved budgets) and the
GRC model (``default_model_path(method="grc")``, answering "None" before its latents), encoding the same texts by
prompt type, side by side in one process: STS-B dev sentences (the default type), held-back SciFact claims
(queries) and SciFact abstracts (documents). Each cell alternates the models and keeps the best of ``--repeats``
runs, so compare the two as a ratio; wall seconds and the process's CPU seconds a text. Prints a table and writes
JSON.

    python benchmarks/default_cost.py --out benchmarks/results/default_cost_grace_vs_grc.json
"""

from __future__ import annotations

import argparse
import time

import torch

import grace_st
from grace_st import scoreboard

MODELS = {"GRACE default": {}, "GRC model": {"method": "grc"}}


def time_encode(model, texts: list[str], kind: str, batch_size: int) -> tuple[float, float]:
    encode = scoreboard.Encoder(model, batch_size)
    wall, cpu = time.perf_counter(), time.process_time()
    encode(texts, kind)
    return time.perf_counter() - wall, time.process_time() - cpu


def cost_arguments(description: str) -> argparse.Namespace:
    """The options of a side-by-side cost script: texts a prompt type, batch size, repeats (best kept), JSON out."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=64, help="texts of each prompt type")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", required=True)
    return parser.parse_args()


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
    args = cost_arguments(__doc__)
    texts = texts_by_prompt_type(args.texts)
    models = {name: grace_st.load(grace_st.default_model_path(**kw)) for name, kw in MODELS.items()}
    report = {"threads": torch.get_num_threads(), "texts": args.texts, "batch_size": args.batch_size, "cells": {}}
    print("| prompt type | " + " | ".join(f"{name}: s a text (CPU s)" for name in models) + " | GRC / GRACE |")
    print("|---|" + "---|" * (len(models) + 1))
    for kind, batch in texts.items():
        best = {name: (float("inf"), float("inf")) for name in models}
        for _ in range(args.repeats):
            for name, model in models.items():
                best[name] = min(best[name], time_encode(model, batch, kind, args.batch_size))
        cell = {name: {"s_per_text": w / len(batch), "cpu_s_per_text": c / len(batch)} for name, (w, c) in best.items()}
        cell["ratio_grc_to_grace"] = best["GRC model"][0] / best["GRACE default"][0]
        report["cells"][kind] = cell
        scoreboard.write_json(report, args.out)
        print(
            f"| {kind} | "
            + " | ".join(f"{cell[name]['s_per_text']:.3f} ({cell[name]['cpu_s_per_text']:.3f})" for name in models)
            + f" | {cell['ratio_grc_to_grace']:.2f}× |",
            flush=True,
        )


if __name__ == "__main__":
    main()
