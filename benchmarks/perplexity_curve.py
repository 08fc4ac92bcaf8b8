"""The LM perplexity of each checkpoint of training runs: how far training has moved the model's own
language model, against the step (a trained default must still generate: within +5 % of its base's perplexity).

The same measure and texts as the dev scoreboard's perplexity column (``scoreboard.perplexity``
on its held-back SICK-R trial sentences), so a point here is the scoreboard's number for that checkpoint.
Prints a table and writes JSON.

    python benchmarks/perplexity_curve.py runs/scale_kl runs/scale_kl0      # JSON: benchmarks/results/perplexity_curve.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scoreboard import data_dir, perplexity, sts_pairs, write_json
from grace_training.run.checkpoint import list_checkpoints
from grace_training.run.metrics import cpu_hours


def logged_steps(run: Path) -> list[dict]:
    """The run's step rows from its metrics file (none when it has no file)."""
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [row for row in rows if "time/step_cpu_s" in row]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="training output directories")
    parser.add_argument("--base", help="a model directory to score as step 0 (default: the untrained embedded base)")
    parser.add_argument("--sentences", type=int, default=200, help="held-back sentences (the scoreboard's 200)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results/perplexity_curve.json")
    args = parser.parse_args()

    import grace_st

    texts = sts_pairs(data_dir() / "sickr" / "trial.tsv", args.sentences)[0]

    def load(path):
        return grace_st.load(str(path), device="cpu")  # no code that ships with a checkpoint runs

    base = args.base or grace_st.default_model_path(trained=False)
    report = {
        "sentences": len(texts),
        "base": str(base),
        "base_perplexity": perplexity(load(base), texts, args.batch_size),
    }
    report["runs"] = {}
    print(f"base: {report['base_perplexity']:.1f}")
    for run in args.runs:
        hours = cpu_hours(logged_steps(run))
        points = report["runs"][str(run)] = []
        for step, path in list_checkpoints(run):
            value = perplexity(load(path), texts, args.batch_size)
            points.append(
                {
                    "step": step,
                    "cpu_h": hours.get(step),
                    "perplexity": value,
                    "vs_base": value / report["base_perplexity"] - 1,
                }
            )
            write_json(report, args.out)
    print("| run | step | CPU h | perplexity | vs base |")
    print("|---|---|---|---|---|")
    for run, points in report["runs"].items():
        for p in points:
            hours = "" if p["cpu_h"] is None else f"{p['cpu_h']:.2f}"
            print(f"| {run} | {p['step']} | {hours} | {p['perplexity']:.1f} | {p['vs_base']:+.1%} |")
    write_json(report, args.out)


if __name__ == "__main__":
    main()
