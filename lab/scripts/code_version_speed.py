"""Encode and training speed of two code versions of grace-st, side by side on one machine: each round runs
the same measurement once under each version (alternating which goes first), each in a fresh process with
that version's packages first on the path. Prints a table of medians and the after/before ratio, writes JSON.

    python lab/scripts/code_version_speed.py --before OLD_TREE --after . --out lab/results/code_version_speed.json

A measurement: ``encode`` of the first 48 STS-B dev sentences with the shipped default (the ``default``
prompt type, its 32-token rationale, batch 16) and of the same texts as documents (budget 0); and a fixed
tiny GRPO run and ICR run of ``benchmarks/training_digest.py`` (its test-suite model, 40 steps each).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child(texts_file: Path) -> dict[str, float]:
    import tempfile

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import training_digest

    import grace_st

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    texts = json.loads(texts_file.read_text())  # the parent's: a tree elsewhere may not find the data folder
    model = grace_st.load(grace_st.default_model_path(), device="cpu")
    model.encode(texts[:4], batch_size=16)  # the kernel built and bound before the clock starts
    timings = {}
    for name, call in (("encode_texts_s", model.encode), ("encode_documents_s", model.encode_document)):
        started = time.perf_counter()
        call(texts, batch_size=16)
        timings[name] = time.perf_counter() - started
    training_digest.COMMON["max_steps"] = 40
    with tempfile.TemporaryDirectory() as folder:
        for name, settings in training_digest.RUNS.items():
            timings[f"train_{name}_s"] = training_digest.run(name, settings, Path(folder))["seconds"]
    return timings


def measure(tree: Path, texts_file: Path) -> dict[str, float]:
    environment = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    command = [sys.executable, __file__, "--child", str(texts_file)]
    done = subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path)
    parser.add_argument("--after", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    from grace_st.scoreboard import sentences

    texts, source = sentences(48)
    texts_file = (args.out or Path("code_version_speed.json")).with_suffix(".texts.tmp")
    texts_file.write_text(json.dumps(texts))
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for round_index in range(args.rounds):
        order = ("before", "after") if round_index % 2 == 0 else ("after", "before")
        for version in order:
            runs[version].append(measure(args.before if version == "before" else args.after, texts_file))
            print(f"round {round_index + 1} {version}: {runs[version][-1]}", flush=True)
    rows = []
    print("\n| measurement | before (median s) | after (median s) | after / before | spread (max/min, both) |")
    print("|---|---|---|---|---|")
    for name in runs["before"][0]:
        before = [run[name] for run in runs["before"]]
        after = [run[name] for run in runs["after"]]
        row = {
            "measurement": name,
            "before_median_s": statistics.median(before),
            "after_median_s": statistics.median(after),
            "ratio": statistics.median(after) / statistics.median(before),
            "spread": max(max(before) / min(before), max(after) / min(after)),
        }
        rows.append(row)
        print(
            f"| {name} | {row['before_median_s']:.2f} | {row['after_median_s']:.2f} | {row['ratio']:.3f} | "
            f"{row['spread']:.3f} |"
        )
    texts_file.unlink()
    if args.out:
        report = {"texts": source, "rounds": args.rounds, "rows": rows, "runs": runs}
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
