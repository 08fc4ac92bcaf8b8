"""The quality study: same data, same steps, same budget; one table.

Every training row starts from the untrained embedded base (SmolLM2-135M-Instruct) and runs
``grace_training/configs/default_grace.yaml`` (the shipped recipe) with the overrides below, so rows
differ only where their names say. The InfoNCE yardstick runs sentence-transformers' own
trainer (``grace-train --method infonce``) on the same triplets. Every row is then scored by
``benchmarks/dev_eval.py`` (the development scoreboard, held-back perplexity included) at the
rationale budget trained (32 tokens) and the base also without a rationale and at 64 tokens.

    python lab/scripts/quality_study.py train --jobs 2        # CPU: two rows side by side, one thread each
    python lab/scripts/quality_study.py eval                 # scoreboard of every finished row
    python lab/scripts/quality_study.py table                # docs table from the JSON
    python lab/scripts/quality_study.py train --rows hybrid-b1 paper   # a subset
    python lab/scripts/quality_study.py curves runs/study/*/metrics.jsonl
    python lab/scripts/quality_study.py curves lab/results/quality_study_curves/*.jsonl   # the study's curves, downsampled

Rows write to ``runs/study/<row>``; scores to ``lab/results/quality_study.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root
RECIPE = ROOT / "grace_training" / "configs" / "default_grace.yaml"
RESULTS = ROOT / "lab" / "results" / "quality_study.json"

# name → (description, method, overrides of the shipped recipe)
GRPO_ONLY = ["contrastive_beta=0.0"]
ROWS: dict[str, tuple[str, str, list[str]]] = {
    "paper": (
        "GRPO, paper rewards and scale (τ=10, γ=1 added to truncated rollouts)",
        "grpo",
        [*GRPO_ONLY, "reward_mode=paper", "tau=10.0", "length_penalty_mode=add", "gamma=1.0"],
    ),
    "per-rollout": ("GRPO, per-rollout rewards, fixed scale (τ=0.1, no length penalty)", "grpo", GRPO_ONLY),
    "per-rollout-lp": (
        "GRPO, per-rollout rewards, τ=0.1, length penalty 0.05 in reward units",
        "grpo",
        [*GRPO_ONLY, "length_penalty_mode=add", "length_penalty_units=reward", "gamma=0.05"],
    ),
    "hybrid-b0.1": ("hybrid β=0.1 (detached anchors)", "grpo", ["contrastive_beta=0.1"]),
    "hybrid-b1": ("hybrid β=1 (detached anchors) — the shipped recipe", "grpo", []),
    "hybrid-b1-recompute": (
        "hybrid β=1, queries and negatives recomputed with gradient",
        "grpo",
        ["contrastive_anchors=recompute"],
    ),
    "hybrid-b1-full": ("hybrid β=1, full fine-tuning (lr 1e-5)", "grpo", ["finetune=full", "learning_rate=1.0e-5"]),
    "infonce": (
        "InfoNCE alone (sentence-transformers MNRL, prompt pooling, full FT, lr 1e-5)",
        "infonce",
        ["infonce_batch_size=8", "infonce_learning_rate=1.0e-5", "finetune=full"],
    ),
}


def run_dir(name: str, runs: Path) -> Path:
    return runs / name


def finished_model(name: str, runs: Path) -> Path | None:
    """The row's final model directory: the InfoNCE ``final`` or the last GRPO checkpoint."""
    directory = run_dir(name, runs)
    if (directory / "final" / "modules.json").is_file():
        return directory / "final"
    checkpoints = sorted(directory.glob("checkpoint-*"))
    return checkpoints[-1] if checkpoints else None


def train_row(name: str, runs: Path, threads: int, extra: list[str]) -> dict:
    _, method, overrides = ROWS[name]
    output = run_dir(name, runs)
    output.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "grace_training.cli",
        "--config",
        str(RECIPE),
        "--method",
        method,
        *overrides,
        *extra,
        f"output_dir={output}",
        "save_steps=50",
        "save_total_limit=1",
    ]
    if method == "grpo":
        command.append("--resume")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    with open(output / "train.log", "w") as log:
        code = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    minutes = (time.perf_counter() - start) / 60
    print(f"{name}: exit {code} after {minutes:.1f} min ({output / 'train.log'})", flush=True)
    return {"row": name, "exit": code, "minutes": minutes, "command": " ".join(command)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phase", choices=("train", "eval", "table", "curves"))
    parser.add_argument("metrics", nargs="*", help="curves: metrics.jsonl files")
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--runs", default=str(ROOT / "runs" / "study"))
    parser.add_argument("--jobs", type=int, default=2, help="rows trained (or scored) at once")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per job")
    parser.add_argument(
        "--set", nargs="*", default=[], help="extra key=value for every training row (e.g. data_dir=...)"
    )
    parser.add_argument("--eval-args", default="", help="extra dev_eval.py arguments")
    parser.add_argument("--shipped", default=None, help="also score this model directory as 'shipped default'")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    runs = Path(args.runs)

    if args.phase == "curves":
        curve_table([Path(m) for m in args.metrics])
        return
    if args.phase == "train":
        with ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(lambda n: train_row(n, runs, args.threads, args.set), args.rows))
        # One entry a row, kept across invocations: rows are often trained one at a time.
        summary = runs / "train_summary.json"
        earlier = json.loads(summary.read_text()) if summary.is_file() else []
        done = {result["row"] for result in results}
        summary.write_text(json.dumps([r for r in earlier if r["row"] not in done] + results, indent=2))
        return
    if args.phase == "eval":
        evaluate(args, runs)
    write_table(Path(args.out))


def evaluate(args, runs: Path) -> None:
    """dev_eval.py over every finished row (and the base rows), ``--jobs`` processes at once."""
    import grace_st

    base = grace_st.default_model_path(trained=False)
    groups: list[list[tuple[str, str]]] = [
        [("base, no rationale", f"{base}@0")],
        [("base, 32-token rationale", f"{base}@32")],
        [("base, 64-token rationale (shipped before)", f"{base}@64")],
    ]
    if args.shipped:
        groups.append([("shipped default (CPU-trained)", f"{args.shipped}@32")])
    for name in args.rows:
        model = finished_model(name, runs)
        if model is None:
            print(f"{name}: no finished model in {run_dir(name, runs)}, skipped", flush=True)
            continue
        groups.append([(ROWS[name][0], f"{model}@32")])
    parts = Path(args.out).with_suffix(".parts")
    parts.mkdir(parents=True, exist_ok=True)

    def score(index_group):
        index, group = index_group
        out = parts / f"part{index:02d}.json"
        command = [sys.executable, str(ROOT / "benchmarks" / "dev_eval.py"), "--no-defaults", "--out", str(out)]
        if index:  # the peer row rides with the first group
            command.append("--no-peer")
        for label, model in group:
            command += ["--model", model, "--label", label]
        command += args.eval_args.split()
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        with open(parts / f"part{index:02d}.log", "w") as log:
            subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        return out

    with ThreadPoolExecutor(args.jobs) as pool:
        outputs = list(pool.map(score, enumerate(groups)))
    report = {"rows": []}
    for out in outputs:
        if out.is_file():
            part = json.loads(out.read_text())
            report.setdefault("sizes", part.get("sizes"))
            report.setdefault("scifact", part.get("scifact"))
            report.setdefault("device", part.get("device"))
            report["rows"].extend(part["rows"])
    summary = runs / "train_summary.json"
    if summary.is_file():
        report["training"] = json.loads(summary.read_text())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


CURVE = [
    ("reward/contrastive", "R_CL", 3),
    ("rollout/positive_length_mean", "len d+", 1),
    ("rollout/truncation_rate", "truncated", 2),
    ("loss/contrastive", "InfoNCE", 3),
]
SHARES = ["contrastive", "consistency", "hard_negative", "length_penalty"]


def curve_table(paths: list[Path], window: int = 10) -> None:
    """First vs last ``window`` steps of each run: what the policy was pushed by, and where it went."""
    head = " | ".join(f"{label} first→last" for _, label, _ in CURVE)
    print(f"| run | steps | {head} | advantage share (CL / consist / hard / length) | s/step |")
    print("|---|---|" + "---|" * (len(CURVE) + 2))
    for path in paths:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rows = [row for row in rows if "loss" in row]

        def mean(key, part):
            values = [row[key] for row in part if key in row]
            return sum(values) / len(values) if values else float("nan")

        first, last = rows[:window], rows[-window:]
        cells = [f"{mean(k, first):.{d}f} → {mean(k, last):.{d}f}" for k, _, d in CURVE]
        shares = " / ".join(f"{mean(f'advantage_share/{n}', rows):.2f}" for n in SHARES)
        print(
            f"| {path.name.removesuffix('.jsonl').rsplit('.', 1)[0]} | {len(rows)} | "
            + " | ".join(cells)
            + f" | {shares} | {mean('time/step_s', rows):.1f} |"
        )


TASKS = ["STS-B dev", "SICK-R trial", "SciFact", "Banking77", "MRPC val"]


def write_table(path: Path) -> None:
    report = json.loads(path.read_text())
    print("| row | " + " | ".join(TASKS) + " | mean | LM perplexity | texts/s |")
    print("|---|" + "---|" * (len(TASKS) + 3))
    for row in report["rows"]:
        scores = row["scores"]
        values = [scores[t] for t in TASKS]
        ppl = scores.get("perplexity")
        print(
            f"| {row['label']} | "
            + " | ".join(f"{v:.4f}" for v in values)
            + f" | {sum(values) / len(values):.4f} | {'n/a' if ppl is None else f'{ppl:.1f}'}"
            + f" | {row.get('texts_per_s', float('nan')):.1f} |"
        )


if __name__ == "__main__":
    main()
