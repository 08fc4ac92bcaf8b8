"""Training curves and before/after evaluation of grace-train runs (any algorithm), from their metrics.jsonl.

    python benchmarks/training_report.py runs/cpu_paper runs/grc --window 10 [--json curves.json]

Prints markdown (and with ``--json`` writes the same curves and evaluations as JSON): per run, windowed means of the terms the run logs (GRPO's reward terms, advantage spread and
truncation; ICR's and GRC's loss terms), the gradient norm and step time; the step cost by source
(``batch/source``, with GRC's ``batch/tokens``), since a step's time follows its texts' lengths; then the
evaluations the trainer ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from grace_training.run.metrics import cpu_hours

CURVE = [
    ("loss", "loss"),
    ("reward/final", "R_final"),
    ("reward/contrastive", "R_CL"),
    ("reward/consistency", "R_consist"),
    ("reward/hard_negative", "R_hard"),
    ("advantage/std", "A std"),
    ("rollout/truncation_rate", "truncated"),
    ("rollout/positive_length_mean", "len d+"),
    ("loss/contrastive", "L_CL"),
    ("loss/refinement", "L_ICR"),
    ("loss/generation", "L_Gen"),
    ("loss/reconstruction", "L_Recons"),
    ("loss/representation", "L_Rep"),
    ("grad_norm", "grad norm"),
    ("time/step_s", "step s"),
    ("time/rollout_share", "gen share"),
]


def read(run: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss" in r], [r for r in rows if any(k.startswith("eval/") for k in r)]


def windows(steps: list[dict], window: int) -> list[dict]:
    """Each window of ``window`` steps: its first and last step and the mean of every logged term of :data:`CURVE`."""
    keys = [key for key, _ in CURVE if any(key in r for r in steps)]
    return [
        {"first": chunk[0]["step"], "last": chunk[-1]["step"],
         **{key: sum(r.get(key, float("nan")) for r in chunk) / len(chunk) for key in keys}}
        for chunk in (steps[start : start + window] for start in range(0, len(steps), window))
    ]


def evaluations(steps: list[dict], evals: list[dict]) -> list[dict]:
    """Each evaluation the trainer ran: its step, the training CPU hours spent by then, its scores."""
    cpu = cpu_hours(steps)
    return [
        {"step": r["step"], "cpu_hours": cpu.get(r["step"], 0.0) if cpu else None,
         "scores": {k[5:]: v for k, v in r.items() if k.startswith("eval/") and not k.endswith("/margin")}}
        for r in evals
    ]


def curve(steps: list[dict], window: int) -> list[str]:
    columns = [(key, name) for key, name in CURVE if any(key in r for r in steps)]
    lines = ["| steps | " + " | ".join(name for _, name in columns) + " |", "|---|" + "---|" * len(columns)]
    for row in windows(steps, window):
        means = " | ".join(f"{row[key]:.4g}" for key, _ in columns)
        lines.append(f"| {row['first']}–{row['last']} | {means} |")
    total = sum(r["time/step_s"] for r in steps)
    summary = f"{total / 60:.1f} min of steps, {total / len(steps):.1f} s/step"
    if all("time/rollout_s" in r for r in steps):
        summary += f", {100 * sum(r['time/rollout_s'] for r in steps) / total:.0f}% generating"
    return [*lines, "", summary]


def cost_by_source(steps: list[dict]) -> list[str]:
    """Median wall and CPU seconds a step, and positions a step where logged, for each source's steps."""
    by_source = defaultdict(list)
    for r in steps:
        if "batch/source" in r:
            by_source[r["batch/source"]].append(r)
    if not by_source:
        return []
    tokens = any("batch/tokens" in r for r in steps)
    lines = [
        "| source | steps | median s/step | median CPU s/step |"
        + (" median positions | CPU s per 1,000 positions |" if tokens else "")
    ]
    lines.append("|---|---|---|---|" + ("---|---|" if tokens else ""))
    for source, rows in sorted(by_source.items(), key=lambda item: -len(item[1])):
        cpu = statistics.median(r["time/step_cpu_s"] for r in rows)
        line = f"| {source} | {len(rows)} | {statistics.median(r['time/step_s'] for r in rows):.1f} | {cpu:.1f} |"
        if tokens:
            positions = statistics.median(r["batch/tokens"] for r in rows)
            line += f" {positions:,.0f} | {1000 * cpu / positions:.2f} |"
        lines.append(line)
    return ["", *lines]


def report(run: Path, window: int) -> str:
    steps, evals = read(run)
    lines = [f"### {run.name}: {len(steps)} steps", ""]
    if steps:
        lines += curve(steps, window) + cost_by_source(steps)
    if evals:
        rows = evaluations(steps, evals)
        keys = sorted({k for r in rows for k in r["scores"]})
        lines += ["", "| step | CPU h | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
        for r in rows:
            hours = "" if r["cpu_hours"] is None else f"{r['cpu_hours']:.2f}"
            scores = " | ".join(f"{r['scores'][k]:.4f}" if k in r["scores"] else "" for k in keys)
            lines.append(f"| {r['step']} | {hours} | {scores} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--json", type=Path, help="also write each run's windows and evaluations here")
    args = parser.parse_args()
    print("\n\n".join(report(run, args.window) for run in args.runs))
    if args.json:
        runs = {}
        for run in args.runs:
            steps, evals = read(run)
            runs[run.name] = {
                "steps": len(steps), "cpu_hours": sum(r.get("time/step_cpu_s", 0.0) for r in steps) / 3600,
                "windows": windows(steps, args.window), "evaluations": evaluations(steps, evals),
            }
        args.json.write_text(json.dumps({"window": args.window, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
