"""GRC's m curve: quality, memory size and what the memory holds, by the number of latent tokens m, from the
scorings already written (one seed, the same batches for every m), at one of two points:

- ``--at lora50``: LoRA r 8 at step 50 (lab/grc_study.md §6);
- ``--at full125``: the shipped recipe, full fine-tuning at step 125; the memory measured on each model's rank-32 cut
  (``python -m grace_training.lowrank_adapter CHECKPOINT --rank 32 --calibration 0``), the form m = 16 ships in.

Quality is ``benchmarks/dev_eval.py``'s four short-text tasks; memory is Eq. 6's bytes a text and the
teacher-forced L_Recons gap (the loss rebuilding a held-back text from another text's memory minus from its own,
nats a token) of ``benchmarks/grc_memory.py --no-generation``, by text length.

    python lab/scripts/grc_m_curve.py --at lora50 --out lab/results/grc_m_curve_step50.json
    python lab/scripts/grc_m_curve.py --at full125 --out lab/results/grc_m_curve_full_step125.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
TASKS = ("STS-B dev", "SICK-R trial", "Banking77", "MRPC val")
# (quality, memory) result files by m at each point; "{m}" is filled in, an entry by m overrides the pattern
FILES = {
    "lora50": {
        "pattern": ("grc_m{m}_step50_seed42.json", "grc_memory_teacher_forced_grc_m{m}_s42_step50.json"),
        16: ("grc_seeds_step50_seed42.json", "grc_memory_teacher_forced_grc_m16_s42_step50.json"),
    },
    "full125": {
        "pattern": (
            "grc_full_m{m}_step125_seed42.json",
            "grc_memory_teacher_forced_grc_m{m}_full_lowrank32_s42_step125.json",
        ),
        16: ("grc_full_step125_seed42.json", "grc_memory_teacher_forced_full_lowrank32.json"),
    },
}
OUT = {"lora50": "grc_m_curve_step50.json", "full125": "grc_m_curve_full_step125.json"}


def gap(rows: list[dict]) -> dict[str, float]:
    gaps = [row["other"] - row["own"] for row in rows]
    se = statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else float("nan")
    return {"texts": len(rows), "gap": statistics.fmean(gaps), "se": se}


def point(at: str, m: int) -> dict | None:
    quality, memory = (RESULTS / name.format(m=m) for name in FILES[at].get(m, FILES[at]["pattern"]))
    if not quality.is_file() or not memory.is_file():
        return None
    scores = json.loads(quality.read_text())["rows"][0]["scores"]
    report = json.loads(memory.read_text())
    rows = report["teacher_forced"]
    return {
        "m": m,
        "memory_bytes": report["memory_bytes"],
        **{task: scores[task] for task in TASKS},
        "mean": statistics.fmean(scores[task] for task in TASKS),
        "gap_short": gap([row for row in rows if row["tokens"] <= 32]),
        "gap_long": gap([row for row in rows if row["tokens"] > 128]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--at", choices=sorted(FILES), default="lora50", help="the recipe and step compared")
    parser.add_argument("--m", nargs="+", type=int, default=[4, 8, 16, 32])
    parser.add_argument("--out", help="the JSON written (default: lab/results/grc_m_curve_<point>.json)")
    args = parser.parse_args()
    args.out = args.out or str(RESULTS / OUT[args.at])
    points = [p for p in (point(args.at, m) for m in args.m) if p is not None]
    Path(args.out).write_text(json.dumps(points, indent=2) + "\n")
    print("| m | memory a text | " + " | ".join(TASKS) + " | mean of four | L_Recons gap, ≤ 32 tokens | > 128 tokens |")
    print("|---" * (len(TASKS) + 5) + "|")
    for p in points:
        short, long = p["gap_short"], p["gap_long"]
        print(
            f"| {p['m']} | {p['memory_bytes']:,} B | " + " | ".join(f"{p[t]:.4f}" for t in TASKS)
            + f" | {p['mean']:.4f} | {short['gap']:.3f} ± {short['se']:.3f} ({short['texts']}) "
            + f"| {long['gap']:.3f} ± {long['se']:.3f} ({long['texts']}) |"
        )


if __name__ == "__main__":
    main()
