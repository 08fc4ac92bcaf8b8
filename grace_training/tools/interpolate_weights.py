"""Interpolate a fully fine-tuned GRACE model back toward its base in weight space: θ = θ_base + α·(θ_tuned − θ_base)
(WiSE-FT, Wortsman et al. 2022). Full fine-tuning with InfoNCE alone buys embedding quality and costs the language
model its perplexity (decisions/D023: +10.7 % of the base). At α = 0.7 perplexity is back within +5 % of the base,
at the price of most of the retrieval gain (decisions/D027): a warm start for the hybrid stage whose LM is inside the bound.

    python -m grace_training.tools.interpolate_weights runs/yardstick_long/final --alpha 0.7 --out runs/wise_70

The base is the untrained embedded base unless ``--base`` names another saved model of the same architecture.
The output is a saved GRACE model like the tuned one (its settings, prompts and card; ``dev_eval.py PATH@0`` scores
it, ``grace-train model_name_or_path=PATH`` trains from it) with ``interpolated_from.json`` naming the two ends.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

INTERPOLATED_FROM = "interpolated_from.json"


@torch.no_grad()
def interpolate_weights(tuned: Path, alpha: float, out: Path, base: Path | None = None) -> dict:
    """Write the tuned model with every weight moved to ``base + alpha · (tuned − base)`` into ``out``; return a
    summary with the relative size of the tuned model's delta."""
    from transformers import AutoModelForCausalLM

    from grace_st import default_model_path, load

    if not 0.0 <= alpha <= 1.0:
        raise SystemExit(f"--alpha {alpha}: give a weight in [0, 1] (0 is the base, 1 the tuned model)")
    if out.exists():
        raise SystemExit(f"{out} exists: give a new directory")
    base = base or Path(default_model_path(trained=False))
    model = load(str(tuned), device="cpu")  # no code that ships with a model it is given runs
    lm = model[0].model
    start = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).state_dict()
    weights = lm.state_dict()
    check_one_architecture(weights, start, tuned, base)
    moved = size = 0.0
    for name in distinct_weights(weights):
        weight = weights[name]
        delta = weight - start[name]
        moved, size = moved + float(delta.pow(2).sum()), size + float(start[name].pow(2).sum())
        weight.copy_(start[name] + alpha * delta)
    model.save(str(out))
    summary = {
        "tuned": str(tuned),
        "base": str(base),
        "alpha": alpha,
        # ‖θ_tuned − θ_base‖ / ‖θ_base‖: how far full fine-tuning went
        "relative_delta": (moved / size) ** 0.5,
    }
    (out / INTERPOLATED_FROM).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary


def check_one_architecture(tuned_weights: dict, base_weights: dict, tuned, base) -> None:
    """SystemExit unless the two state dicts hold the same weight names with the same shapes."""
    shared = tuned_weights.keys() & base_weights.keys()
    mismatched = sorted(tuned_weights.keys() ^ base_weights.keys()) + sorted(
        n for n in shared if base_weights[n].shape != tuned_weights[n].shape
    )
    if mismatched:
        raise SystemExit(
            f"{tuned} and {base} are not one architecture: {len(mismatched)} weights differ in name or shape "
            f"(first: {mismatched[0]})"
        )


def distinct_weights(weights: dict) -> list[str]:
    """The names of a state dict with each tensor once: tied weights (the LM head and the embeddings) are one tensor
    under two names, and the first name stands for it."""
    first = {}
    for name, weight in weights.items():
        first.setdefault(weight.data_ptr(), name)
    return list(first.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "tuned", type=Path, help="a saved GRACE model with its full weights (e.g. an InfoNCE run's final/)"
    )
    parser.add_argument("--alpha", type=float, required=True, help="how much of the fine-tuning to keep, in [0, 1]")
    parser.add_argument("--out", type=Path, required=True, help="a new directory")
    parser.add_argument(
        "--base", type=Path, help="the model the tuned one was trained from (default: the untrained embedded base)"
    )
    args = parser.parse_args(argv)
    print(json.dumps(interpolate_weights(args.tuned, args.alpha, args.out, args.base), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
