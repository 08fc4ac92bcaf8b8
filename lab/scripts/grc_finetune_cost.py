"""GRC trained with LoRA against full fine-tuning, per CPU hour: quality of each checkpoint beside the CPU time the
run spent to reach it, from what the runs and the scorings already wrote (one seed, the same batches):

- cost: CPU seconds a step on one thread without gradient checkpointing, the mean of ``time/step_cpu_s`` over
  steps 1..``--same-conditions`` of the run's ``metrics.jsonl`` (the steps both runs ran alike, on the same
  batches; the LoRA run's later steps ran on two threads), times the step: the CPU hours the study's other rows
  count (lab/grc_study.md §1);
- quality: ``benchmarks/dev_eval.py``'s four short-text tasks for ``RUN/checkpoint-N`` (SciFact and perplexity where
  scored), and for the full model's delta cut to a LoRA adapter (``grace_training.lowrank_adapter``).

    python lab/scripts/grc_finetune_cost.py --out lab/results/grc_finetune_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

LAB = Path(__file__).resolve().parents[1]
RUNS = LAB.parent / "runs"
TASKS = ("STS-B dev", "SICK-R trial", "Banking77", "MRPC val")
# (label, run, step, scoring in lab/results)
POINTS = (
    ("LoRA r 8, lr 1e-4", "grc_m16_s42", 25, "grc_lora_step25_seed42.json"),
    ("LoRA r 8, lr 1e-4", "grc_m16_s42", 50, "grc_seeds_step50_seed42.json"),
    ("LoRA r 8, lr 1e-4", "grc_m16_s42", 125, "grc_scoreboard_seed42.json"),
    ("full, lr 2e-5", "grc_m16_full_s42", 25, "grc_full_step25_seed42.json"),
    ("full, lr 2e-5", "grc_m16_full_s42", 50, "grc_full_step50_seed42.json"),
    ("full, lr 2e-5", "grc_m16_full_s42", 125, "grc_full_step125_seed42.json"),
    ("full, cut to LoRA r 32", "grc_m16_full_s42", 50, "grc_full_step50_lowrank32_seed42.json"),
    ("full, cut to LoRA r 32 (bfloat16, shipped)", "grc_m16_full_s42", 125, "grc_scoreboard_full_lowrank32.json"),
)


def step_cpu_seconds(run: str) -> dict[int, float]:
    """CPU seconds of each step the run logged."""
    path = RUNS / run / "metrics.jsonl"
    by_step = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        record = json.loads(line)
        if "time/step_cpu_s" in record:
            by_step[record["step"]] = record["time/step_cpu_s"]
    return by_step


def point(label: str, run: str, step: int, scoring: str, cpu_s_per_step: float) -> dict | None:
    path = LAB / "results" / scoring
    if not path.is_file():
        return None
    scores = json.loads(path.read_text())["rows"][0]["scores"]
    return {
        "finetune": label, "run": run, "step": step, "cpu_s_per_step": cpu_s_per_step,
        "cpu_hours": step * cpu_s_per_step / 3600, **scores,
        "mean of four": statistics.fmean(scores[task] for task in TASKS),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(LAB / "results" / "grc_finetune_cost.json"))
    parser.add_argument("--same-conditions", type=int, default=25, help="the steps both runs ran alike")
    args = parser.parse_args()
    same = range(1, args.same_conditions + 1)
    cost = {run: step_cpu_seconds(run) for run in {row[1] for row in POINTS}}
    rate = {run: statistics.fmean(seconds[s] for s in same) for run, seconds in cost.items()}
    lora, full = cost[POINTS[0][1]], cost[POINTS[-1][1]]
    ratios = sorted(full[s] / lora[s] for s in same)
    points = [p for p in (point(*row, rate[row[1]]) for row in POINTS) if p is not None]
    ratio = sum(full[s] for s in same) / sum(lora[s] for s in same)
    Path(args.out).write_text(json.dumps({"full_over_lora_cpu": ratio, "points": points}, indent=2) + "\n")
    print(
        f"full / LoRA CPU over steps 1-{args.same_conditions} (same batches, one thread each): {ratio:.3f} "
        f"(step by step {ratios[0]:.2f}-{ratios[-1]:.2f}, median {statistics.median(ratios):.2f})\n"
    )
    columns = [*TASKS, "mean of four", "SciFact", "perplexity"]
    print("| fine-tuning | step | CPU h | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 3) + "|")
    for p in points:
        cells = " | ".join("" if c not in p else f"{p[c]:.1f}" if c == "perplexity" else f"{p[c]:.4f}" for c in columns)
        print(f"| {p['finetune']} | {p['step']} | {p['cpu_hours']:.2f} | {cells} |")


if __name__ == "__main__":
    main()
