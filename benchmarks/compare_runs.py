"""Two code versions side by side, from benchmark JSON files written in alternation (before,
after, before, after, ...): each row's best time over its rounds and the after/before ratio.

    python benchmarks/compare_runs.py decode_ablation \
        --before before/decode_ablation_*.json \
        --after after/decode_ablation_*.json
    python benchmarks/compare_runs.py encode_throughput --before ... --after ... [--out summary.json]

Reads the files ``decode_ablation.py`` and ``encode_throughput.py`` write; prints a table and,
with ``--out``, writes it as JSON. Rows are matched by their configuration; ratio > 1 means the
``after`` code is faster.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _decode_rows(report: dict) -> dict[tuple, float]:
    return {(r["kv_cache"], r["linears"], r["instruction_prefix"]): r["texts_per_s"] for r in report["rows"]}


def _encode_rows(report: dict) -> dict[tuple, float]:
    return {
        (run["dtype"], f"batch {r['batch_size']}", f"G {r['rationale_tokens']}"): r["texts_per_s"]
        for run in report["runs"]
        for r in run["rows"]
    }


READERS = {"decode_ablation": _decode_rows, "encode_throughput": _encode_rows}


def best(paths: list[str], read) -> tuple[dict[tuple, float], int]:
    """The best texts/s of each row over the files (each file one round)."""
    out: dict[tuple, float] = {}
    for path in paths:
        for key, value in read(json.loads(Path(path).read_text())).items():
            out[key] = max(out.get(key, 0.0), value)
    return out, len(paths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=sorted(READERS))
    parser.add_argument("--before", nargs="+", required=True)
    parser.add_argument("--after", nargs="+", required=True)
    parser.add_argument("--out")
    args = parser.parse_args()
    read = READERS[args.kind]
    before, rounds_before = best(args.before, read)
    after, rounds_after = best(args.after, read)
    print(f"{args.kind}: best texts/s over {rounds_before} rounds before and {rounds_after} after")
    print(f"{'row':<40} {'before':>9} {'after':>9} {'after/before':>13}")
    rows = []
    for key in before:
        if key not in after:
            continue
        ratio = after[key] / before[key]
        rows.append(
            {"row": list(key), "before_texts_per_s": before[key], "after_texts_per_s": after[key], "ratio": ratio}
        )
        print(f"{' / '.join(key):<40} {before[key]:>9.2f} {after[key]:>9.2f} {ratio:>12.3f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"kind": args.kind, "before": args.before, "after": args.after,
                                              "rows": rows}, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
