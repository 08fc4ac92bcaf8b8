"""Reward curves and before/after evaluation of grace-train runs, from their metrics.jsonl.

    python benchmarks/training_report.py runs/cpu_paper runs/cpu_per_rollout --window 10

Prints markdown: per run, windowed means of the reward terms, advantage spread, truncation rate
and step time (the share spent generating), then the evaluations the trainer ran.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from grace_training.metrics import cpu_hours

CURVE = [
    ("reward/final", "R_final"),
    ("reward/contrastive", "R_CL"),
    ("reward/consistency", "R_consist"),
    ("reward/hard_negative", "R_hard"),
    ("advantage/std", "A std"),
    ("rollout/truncation_rate", "truncated"),
    ("rollout/positive_length_mean", "len d+"),
    ("grad_norm", "grad norm"),
    ("time/step_s", "step s"),
    ("time/rollout_share", "gen share"),
]


def read(run: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "reward/final" in r], [r for r in rows if any(k.startswith("eval/") for k in r)]


def report(run: Path, window: int) -> str:
    steps, evals = read(run)
    lines = [f"### {run.name}: {len(steps)} steps", "", "| steps | " + " | ".join(name for _, name in CURVE) + " |"]
    lines.append("|---|" + "---|" * len(CURVE))
    for start in range(0, len(steps), window):
        chunk = steps[start : start + window]
        means = [sum(r.get(key, float("nan")) for r in chunk) / len(chunk) for key, _ in CURVE]
        lines.append(f"| {chunk[0]['step']}–{chunk[-1]['step']} | " + " | ".join(f"{m:.4g}" for m in means) + " |")
    if steps:
        total = sum(r["time/step_s"] for r in steps)
        rollout = sum(r["time/rollout_s"] for r in steps)
        lines += ["", f"{total / 60:.1f} min of steps, {total / len(steps):.1f} s/step, {100 * rollout / total:.0f}% generating"]
    if evals:
        keys = sorted({k for r in evals for k in r if k.startswith("eval/") and not k.endswith(("/margin",))})
        cpu = cpu_hours(steps)
        lines += ["", "| step | CPU h | " + " | ".join(k[5:] for k in keys) + " |", "|---|---|" + "---|" * len(keys)]
        for r in evals:
            hours = f"{cpu.get(r['step'], 0.0):.2f}" if cpu else ""
            lines.append(f"| {r['step']} | {hours} | " + " | ".join(f"{r[k]:.4f}" if k in r else "" for k in keys) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--window", type=int, default=10)
    args = parser.parse_args()
    print("\n\n".join(report(run, args.window) for run in args.runs))


if __name__ == "__main__":
    main()
