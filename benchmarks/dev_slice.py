"""Score any GRACE model on a training config's dev slice (its ``eval_data``), as the trainer does.

A run logs these scores every ``eval_steps`` (``eval/<source>/<metric>`` in ``metrics.jsonl``); this
puts another model on the same slice, with the same code (``grace_training.evaluation.evaluate``),
so a curve can be read against the shipped default or the untrained base.

    python benchmarks/dev_slice.py --config grace_training/configs/scale_grace.yaml                 # the shipped default
    python benchmarks/dev_slice.py --config grace_training/configs/scale_grace.yaml --model PATH --out x.json

Each model encodes with its own saved budgets (``max_rationale_tokens``) unless ``--rationale-tokens G`` sets
one budget for every prompt type (G = 0: the prompt alone, what the InfoNCE baseline is trained on).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    import grace_st
    from grace_training.config.train_config import GRPOConfig
    from grace_training.data.examples import cap_per_source, load_data
    from grace_training.evaluation import evaluate

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--model", default=None, help="a model directory (default: the shipped default model)")
    parser.add_argument("--rationale-tokens", type=int, default=None, metavar="G", help="one budget for all prompt types")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="JSON file for the scores")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = GRPOConfig.from_yaml(args.config)
    rows, _ = load_data(config.eval_data, **config.data_settings())
    # the slice the trainer scores, whatever the run's seed
    rows = cap_per_source(rows, config.eval_max_examples, config.eval_seed)
    path = args.model or str(grace_st.default_model_path())
    model = grace_st.load(path, device="cpu")
    if args.rationale_tokens is not None:
        model[0].max_rationale_tokens = args.rationale_tokens
    started = time.perf_counter()
    scores = evaluate(
        model, rows, query_task=config.query_task, document_task=config.document_task, batch_size=config.eval_batch_size
    )
    seconds = time.perf_counter() - started
    print("| metric | value |\n|---|---|")
    for key, value in sorted(scores.items()):
        print(f"| {key} | {value:.4f} |")
    if args.out:
        record = {
            "model": args.model or "shipped default (grace_st.default_model_path())",
            "budgets": model[0].max_rationale_tokens,
            "config": args.config,
            "scores": scores,
            "seconds": seconds,
        }
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
