"""Where a training step's time goes, and what the step speed-ups buy: variants side by side.

One trainer per variant, all from the untrained embedded base with the shipped recipe
(``grace_training/configs/default_grace.yaml``) plus the variant's overrides. They run the same steps
(same batches, same rollout seeds) alternately, step by step, so the machine's noise falls on
every variant alike. Each step's stages come from the trainer's own metrics: rollout (Eq. 4 +
Eq. 3 pooling), rewards (Eqs. 5–10), the update's forward, backward and optimizer step.

    python lab/scripts/step_profile.py --steps 6                 # before vs after, shipped settings
    python lab/scripts/step_profile.py --variants before shared_prompt after --steps 6
    python lab/scripts/step_profile.py --variants after buckets --steps 6

Prints a markdown table (median seconds over the steps after the first, which also packs weights)
and writes ``lab/results/step_profile.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository root
RECIPE = ROOT / "grace_training" / "configs" / "default_grace.yaml"

# name → (what it is, config overrides, decode options of the rollouts)
# The shared-prompt speed-ups, then the rollout ones: LoRA merged into the packed weights for rollouts
# and the one-uniform sampler. Older variants switch the newer ones off, so each row is a code state.
OLDER_ROLLOUTS = {"merge_adapters": False, "inverse_cdf_sampling": False}
VARIANTS: dict[str, tuple[str, list[str], dict]] = {
    "before": (
        "every rollout's prompt prefilled and run again in the update pass once a row",
        ["share_prompt_pass=false"],
        {"dedupe_prompts": False, **OLDER_ROLLOUTS},
    ),
    "shared_prompt": (
        "a positive's prompt prefilled once and run once in the update pass for its K rollouts",
        [],
        OLDER_ROLLOUTS,
    ),
    "after": (
        "shared_prompt, with rollouts on LoRA merged into the packed weights and one uniform a sampled token",
        [],
        {},
    ),
    "buckets": (
        "after, with rollouts prefilled in length buckets (rollout_bucket_ratio 1.5)",
        ["rollout_bucket_ratio=1.5"],
        {},
    ),
}

STAGES = [
    ("time/rollout_s", "rollout"),
    ("time/reward_s", "rewards"),
    ("time/update_forward_s", "update fwd"),
    ("time/update_backward_s", "update bwd"),
    ("time/update_optimizer_s", "optimizer"),
    ("time/step_s", "step"),
]


def build(name: str, overrides: list[str], output: Path):
    from grace_st.decoding import DecodeOptions
    from grace_training.config import GRPOConfig
    from grace_training.trainer import GRPOTrainer

    _, changes, decode = VARIANTS[name]
    config = GRPOConfig.from_yaml(
        RECIPE, [f"data_dir={ROOT.parent / 'shared' / 'data'}", f"output_dir={output / name}", *changes, *overrides]
    )
    trainer = GRPOTrainer(config)
    trainer.encoder.decode_options = DecodeOptions(**decode)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["before", "after"], choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for every variant (key=value)")
    parser.add_argument("--output", default=str(ROOT / "lab" / "results" / "step_profile.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    scratch = ROOT / "runs" / "step_profile"
    trainers = {name: build(name, args.set, scratch) for name in args.variants}
    steps: dict[str, list[dict]] = {name: [] for name in args.variants}
    for step in range(args.steps):
        for name, trainer in trainers.items():  # alternate: the same step on every variant, back to back
            metrics = trainer.training_step(trainer.batch_for_step(step), step)
            steps[name].append({k: v for k, v in metrics.items() if k.startswith(("time/", "reward/", "loss"))})
            print(
                f"step {step} {name}: {metrics['time/step_s']:.2f} s, reward {metrics['reward/final']:.4f}", flush=True
            )
    kept = slice(1, None) if args.steps > 1 else slice(None)
    summary = {
        name: {key: statistics.median(s[key] for s in rows[kept]) for key, _ in STAGES if key in rows[0]}
        for name, rows in steps.items()
    }
    first = args.variants[0]
    lines = [
        f"| variant | {' | '.join(label for _, label in STAGES)} | s/step vs {first} |",
        "|---|" + "---|" * (len(STAGES) + 1),
    ]
    for name, medians in summary.items():
        cells = " | ".join(f"{medians.get(key, float('nan')):.2f}" for key, _ in STAGES)
        lines.append(f"| {name} | {cells} | {medians['time/step_s'] / summary[first]['time/step_s']:.3f}× |")
    print("\n".join(lines))
    record = {
        "command": "python lab/scripts/step_profile.py "
        + " ".join(
            [f"--variants {' '.join(args.variants)}", f"--steps {args.steps}", f"--threads {args.threads}"]
            + ([f"--set {' '.join(args.set)}"] if args.set else [])
        ),
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "variants": {name: VARIANTS[name][0] for name in args.variants},
        "median_seconds_after_the_first_step": summary,
        "steps": steps,
        "table": lines,
    }
    Path(args.output).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
